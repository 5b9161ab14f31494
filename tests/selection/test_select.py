"""Choosing what to train: strategies honour the budget, routing skips cold experts, calibration accumulates."""

import dataclasses
import json

import pytest
import torch
from helpers import EXPERTS_AND_ROUTERS

import usaf
from usaf.engine.state import model_state
from usaf.model.layout import find_moe_layers
from usaf.prepare import current_selection
from usaf.selection.calibrate import calibrate
from usaf.selection.saved import load_selection, save_selection
from usaf.testing.tiny import tiny_model


def batches(n, seed=0, length=12):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 97, (2, length), generator=g)
        out.append(
            {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(length).repeat(2, 1)}
        )
    return out


def cold_gpt_oss():
    """gpt-oss whose routers never pick experts 4 and 5 (a large negative router bias)."""
    model = tiny_model("gpt_oss")
    with torch.no_grad():
        for layer in find_moe_layers(model):
            layer.router.bias[4:] = -1e4
    return model


def trained_entries(model):
    return usaf.trainable_summary(model)["expert_entries"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["uniform", "routing", "gradient"])
@pytest.mark.parametrize("selection", ["random", "magnitude", "gradient"])
def test_element_budget_is_honoured_exactly(strategy, selection):
    config = usaf.UsafConfig(
        targets=EXPERTS_AND_ROUTERS,
        num_entries=1500,
        strategy=strategy,
        selection=selection,
        train_biases=False,
        calibration_batches=3,
    )
    model = usaf.prepare_model(cold_gpt_oss(), config, calibration_batches=batches(3))
    assert trained_entries(model) == 1500


@pytest.mark.parametrize("strategy", ["uniform", "routing", "gradient"])
@pytest.mark.parametrize("selection", ["random", "magnitude", "gradient"])
def test_neuron_budget_is_honoured_in_whole_neurons(strategy, selection):
    config = usaf.UsafConfig(
        targets=EXPERTS_AND_ROUTERS,
        density=0.2,
        granularity="neuron",
        strategy=strategy,
        selection=selection,
        train_biases=False,
    )
    model = usaf.prepare_model(cold_gpt_oss(), config, calibration_batches=batches(2))
    per_neuron = 3 * 32  # gate, up (rows of gate_up) and down: hidden 32 each
    total = sum(
        getattr(layer.experts, n).numel()
        for layer in find_moe_layers(model)
        for n in ("gate_up_proj", "down_proj")
    )
    neurons_per_layer = round(0.2 * total / 2) // per_neuron
    assert trained_entries(model) == 2 * neurons_per_layer * per_neuron


@pytest.mark.slow
@pytest.mark.parametrize("granularity", ["element", "neuron"])
@pytest.mark.parametrize("selection", ["random", "magnitude", "gradient"])
def test_routing_strategy_gives_nothing_to_cold_experts(granularity, selection):
    config = usaf.UsafConfig(
        targets=EXPERTS_AND_ROUTERS,
        density=0.2,
        strategy="routing",
        granularity=granularity,
        selection=selection,
        routing_coverage=1.0,
        train_biases=False,
    )
    model = usaf.prepare_model(cold_gpt_oss(), config, calibration_batches=batches(2))
    for name, delta in usaf.get_delta(model).items():
        shape = dict(model.named_parameters())[name].shape
        experts = torch.unique(delta.flat_indices // (shape[1] * shape[2]))
        assert experts.numel() > 0 and int(experts.max()) < 4, (name, experts)


def test_calibration_accumulates_over_batches():
    model = usaf.prepare_model(
        tiny_model("qwen3_moe"), usaf.UsafConfig(targets=EXPERTS_AND_ROUTERS, density=0.1)
    )
    data = batches(3, seed=5)
    together = calibrate(model, data, 3, with_gradients=True)
    separate = [calibrate(model, [b], 1, with_gradients=True) for b in data]
    assert together.batches == 3
    for path in together.tokens:
        assert torch.equal(together.tokens[path], sum(c.tokens[path] for c in separate))
        assert together.tokens[path].sum() == 3 * 2 * 12 * 2  # batches x rows x tokens x top-k
        assert torch.allclose(
            together.neuron_score[path], sum(c.neuron_score[path] for c in separate), rtol=1e-4
        )


def test_gradient_selection_prefers_entries_the_task_moves():
    """Entries chosen by gradient have larger calibration gradients than randomly chosen ones."""
    data = batches(3, seed=1)
    grad_model = usaf.prepare_model(
        tiny_model("mixtral"),
        usaf.UsafConfig(targets=EXPERTS_AND_ROUTERS, density=0.05, selection="gradient"),
        calibration_batches=data,
    )
    rand_model = usaf.prepare_model(
        tiny_model("mixtral"), usaf.UsafConfig(targets=EXPERTS_AND_ROUTERS, density=0.05, selection="random")
    )
    norms = []
    for model in (grad_model, rand_model):
        for batch in data:
            usaf.engine.loss.causal_lm_loss(model, batch["input_ids"], batch["labels"]).backward()
        norms.append(sum(float(d.values.grad.abs().sum()) for d in usaf.get_delta(model).values()))
    assert norms[0] > 2 * norms[1]


def test_saved_selection_is_reused(tmp_path):
    data = batches(2)
    first = usaf.prepare_model(
        tiny_model("qwen3_moe"),
        usaf.UsafConfig(targets=EXPERTS_AND_ROUTERS, strategy="routing", granularity="neuron"),
        calibration_batches=data,
    )
    chosen = current_selection(first)
    save_selection(tmp_path / "selection.safetensors", chosen, {"strategy": "routing"})
    again = usaf.prepare_model(
        tiny_model("qwen3_moe"),
        usaf.UsafConfig(
            targets=EXPERTS_AND_ROUTERS, strategy="file", file=str(tmp_path / "selection.safetensors")
        ),
    )
    loaded = load_selection(tmp_path / "selection.safetensors")
    for key, c in current_selection(again).items():
        assert torch.equal(c.indices, chosen[key].indices) and c.axis == chosen[key].axis == loaded[key].axis


def test_data_driven_strategy_without_data_is_a_clear_error():
    with pytest.raises(usaf.UsafError, match="needs calibration data"):
        usaf.prepare_model(
            tiny_model("qwen3_moe"), usaf.UsafConfig(targets=EXPERTS_AND_ROUTERS, strategy="routing")
        )
    with pytest.raises(usaf.UsafError, match="strategy='file' needs"):
        usaf.UsafConfig(targets=EXPERTS_AND_ROUTERS, strategy="file")


def test_a_file_selection_after_a_calibrated_one_reports_no_calibration(tmp_path):
    """Calibration statistics belong to the model they selected for, not to the process (issue 10)."""
    from usaf.config import RunConfig
    from usaf.train.session import selection_summary

    calibrated = usaf.prepare_model(
        tiny_model("qwen3_moe"),
        usaf.UsafConfig(density=0.1, selection="gradient", calibration_batches=2),
        calibration_batches=batches(2),
    )
    run = RunConfig()
    assert selection_summary(calibrated, run)["calibration"]["batches"] == 2
    save_selection(tmp_path / "sel.safetensors", current_selection(calibrated))
    from_file = usaf.prepare_model(
        tiny_model("qwen3_moe"), usaf.UsafConfig(strategy="file", file=str(tmp_path / "sel.safetensors"))
    )
    run = dataclasses.replace(run, select=model_state(from_file).config)
    assert selection_summary(from_file, run)["calibration"] is None


def test_calibration_takes_its_batches_then_more_until_its_tokens_are_in():
    """select.calibration_batches at least, more until select.calibration_tokens supervised tokens are in, never past
    the batches given (usaf train gives one pass over the data); labels of -100 are not supervised."""
    from usaf.selection.choose import calibration_sample

    data = batches(10)  # 2 rows x 12 tokens, all supervised: 24 a batch
    half = [dict(b, labels=torch.where(torch.arange(12) < 6, -100, b["labels"])) for b in data]  # 12 a batch

    def taken(given, **select):
        return len(calibration_sample(iter(given), usaf.UsafConfig(**select)))

    assert taken(data, calibration_batches=3, calibration_tokens=0) == 3
    assert taken(data, calibration_batches=3, calibration_tokens=24 * 5) == 5
    assert taken(half, calibration_batches=3, calibration_tokens=24 * 5) == 10  # half as many tokens a batch
    assert taken(data, calibration_batches=3, calibration_tokens=10**6) == 10  # the data ends first
    assert taken(data, calibration_batches=4, calibration_tokens=24) == 4


@pytest.mark.slow
def test_the_run_says_what_calibration_took_and_a_resume_says_nothing(tmp_path, capsys):
    """The first lines name the calibration's batches, supervised tokens and time (a cost paid before the first
    step); data shorter than select.calibration_tokens is said to be used whole; a resume does not calibrate."""
    import re

    from helpers import FAST_RUN, make_model_dir, write_copy_task

    from usaf.cli import main

    model, data = make_model_dir(tmp_path / "m"), write_copy_task(tmp_path / "d.jsonl", 40)
    sets = [
        f"--set={s}" for s in [*FAST_RUN, "schedule.max_steps=2", "data.pack=false", "data.eval_fraction=0"]
    ]
    run = tmp_path / "run"
    assert main(["train", f"--model={model}", f"--data={data}", f"--out={run}", *sets]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("calibration:")]
    found = re.fullmatch(
        r"calibration: (\d+) batches, ([\d,]+) supervised tokens in [\d.]+ s: the whole training data, short of "
        r"select.calibration_tokens=65536",
        said[0] if len(said) == 1 else "",
    )
    assert found, said
    assert int(found.group(1)) == 10  # 40 records, a record a row, 4 rows a batch: one pass
    assert json.loads((run / "selection.json").read_text())["summary"]["calibration"]["batches"] == 10
    few = [*sets, "--set=select.calibration_tokens=1", "--set=select.calibration_batches=3"]
    assert main(["train", f"--model={model}", f"--data={data}", f"--out={tmp_path / 'few'}", *few]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("calibration:")]
    assert (
        len(said) == 1
        and said[0].startswith("calibration: 3 batches, ")
        and "calibration_tokens=1:" in said[0]
    )
    assert main(["train", f"--resume={run}", "--set=schedule.max_steps=3"]) == 0
    assert "calibration:" not in capsys.readouterr().out
    out = tmp_path / "sel.safetensors"  # usaf select calibrates as usaf train does, and says so on stderr
    assert main(["select", f"--model={model}", f"--data={data}", f"--out={out}", *few]) == 0
    assert "calibration: 3 batches, " in capsys.readouterr().err
