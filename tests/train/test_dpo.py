"""`usaf train --set train.objective=dpo`: preference pairs read as pairs (chosen rows, then rejected rows), the
base as its own reference, the preferred answers' margin moving the right way, resumed exactly."""

import json
import random

import pytest
import torch
from helpers import FAST_RUN, losses, make_model_dir, plans_by_objective, run_killed
from safetensors.torch import load_file

from usaf.cli import main
from usaf.config import RunConfig
from usaf.data import Batches, load_dataset
from usaf.data.pairs import PreferencePairs
from usaf.engine.loss import IGNORE_INDEX
from usaf.train.objectives import PREFERENCE_LR
from usaf.train.tokenizer import char_tokenizer


def write_pairs(path, count: int, seed: int = 0):
    """Copy a word (chosen) rather than reverse it (rejected)."""
    rnd = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            word = "".join(rnd.choice("abcdef") for _ in range(5))
            f.write(
                json.dumps({"prompt": f"copy {word} ->", "chosen": f" {word}", "rejected": f" {word[::-1]}"})
                + "\n"
            )
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    return make_model_dir(root / "model"), write_pairs(root / "pairs.jsonl", 48)


def test_pairs_are_read_as_pairs(inputs, tmp_path):
    _, data = inputs
    tokenizer = char_tokenizer()
    train, held_out, _ = load_dataset([str(data)], tokenizer, 48, eval_fraction=0.25, pairs=True)
    assert isinstance(train, PreferencePairs) and len(train) == 36 and len(held_out) == 12
    batch = next(iter(Batches(train, 4, shuffle=False)))
    ids, labels = batch["input_ids"], batch["labels"]
    assert ids.shape[0] == 8
    for i in range(4):
        chosen, rejected = ids[i], ids[4 + i]
        answer_c = tokenizer.decode(chosen[labels[i] != IGNORE_INDEX][:-1])  # less the EOS
        answer_r = tokenizer.decode(rejected[labels[4 + i] != IGNORE_INDEX][:-1])
        prompt = tokenizer.decode(chosen[: int((labels[i] != IGNORE_INDEX).nonzero()[0])])
        assert answer_r == answer_c[0] + answer_c[:0:-1]  # the reversed word
        assert prompt.endswith("copy" + answer_c + " ->")


@pytest.mark.parametrize(
    "record, says",
    [
        (
            {"prompt": "a", "completion": "b"},
            "dpo trains on preference pairs (prompt/chosen/rejected), not prompt/completion",
        ),
        ({"chosen": "a b", "rejected": "a c"}, "a preference pair of texts needs its 'prompt'"),
        (
            {
                "chosen": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
                "rejected": [{"role": "user", "content": "z"}, {"role": "assistant", "content": "y"}],
            },
            "differ only in their last turn",
        ),
        ({"prompt": "a", "chosen": "b", "rejected": [{"role": "assistant", "content": "c"}]}, "must both be"),
    ],
)
def test_a_record_that_is_no_pair_is_named(inputs, tmp_path, capsys, record, says):
    model, _ = inputs
    data = tmp_path / "bad.jsonl"
    data.write_text(
        json.dumps({"prompt": "p", "chosen": "c", "rejected": "r"}) + "\n" + json.dumps(record) + "\n"
    )
    sets = [f"--set={s}" for s in [*FAST_RUN, "train.objective=dpo", "schedule.max_steps=1"]]
    assert main(["train", f"--model={model}", f"--data={data}", f"--out={tmp_path / 'run'}", *sets]) == 2
    err = capsys.readouterr().err
    assert f"{data}:2: " in err and says in err and len(err.strip().splitlines()) == 1


def test_implicit_prompt_conversations_are_pairs(tmp_path):
    data = tmp_path / "chat.jsonl"
    turn = {"role": "user", "content": "2+2?"}
    data.write_text(
        json.dumps(
            {
                "chosen": [turn, {"role": "assistant", "content": "4"}],
                "rejected": [turn, {"role": "assistant", "content": "5"}],
            }
        )
        + "\n"
    )
    train, _, _ = load_dataset([str(data)], char_tokenizer(), 64, eval_fraction=0.0, pairs=True)
    assert len(train) == 1
    batch = next(iter(Batches(train, 1, shuffle=False)))
    supervised = [batch["input_ids"][r][batch["labels"][r] != IGNORE_INDEX] for r in (0, 1)]
    assert char_tokenizer().decode(supervised[0]).startswith("4") and char_tokenizer().decode(
        supervised[1]
    ).startswith("5")


DPO = ["train.objective=dpo", "train.dpo_beta=0.5", "optim.lr=0.01"]


def test_dpo_moves_the_margin_the_right_way(inputs, tmp_path, capsys):
    model, data = inputs
    # evaluated on the pairs it trains on: a tiny random model fits them, the margin says how far
    sets = [f"--set={s}" for s in [*FAST_RUN, *DPO, "schedule.max_steps=12", f"data.eval={data}"]]
    assert main(["train", f"--model={model}", f"--data={data}", f"--out={tmp_path / 'run'}", *sets]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["eval_margin_before"] == pytest.approx(0.0, abs=1e-6)  # the policy starts as the reference
    assert (
        summary["eval_margin_after"] > 0.05
        and summary["eval_accuracy_after"] > summary["eval_accuracy_before"]
    )
    assert summary["eval_loss_after"] < summary["eval_loss_before"]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all("rewards/margins" in r and "rewards/accuracies" in r for r in rows if "loss" in r)
    assert "eval margin before → after" in capsys.readouterr().out
    (final,) = [
        r for r in rows if r.get("final")
    ]  # the final evaluation's row carries DPO's measures (issue 35)
    assert final["step"] == 12 and {k: final[f"eval/{k}"] for k in ("loss", "margin", "accuracy")} == {
        k: pytest.approx(summary[f"eval_{k}_after"]) for k in ("loss", "margin", "accuracy")
    }


def test_dpo_at_the_default_rate_trains_at_the_preference_rate_and_records_it(inputs, tmp_path):
    """optim.lr=auto (the default) is DPO's own rate, written as a number into config.yaml (a resume reads it); an
    optim.lr given is taken as given."""
    model, data = inputs
    for name, given in (("auto", []), ("given", ["optim.lr=0.02"])):
        sets = [f"--set={s}" for s in [*FAST_RUN, "train.objective=dpo", "schedule.max_steps=2", *given]]
        assert main(["train", f"--model={model}", f"--data={data}", f"--out={tmp_path / name}", *sets]) == 0
    assert RunConfig.load(str(tmp_path / "auto" / "config.yaml")).optim.lr == PREFERENCE_LR
    assert RunConfig.load(str(tmp_path / "given" / "config.yaml")).optim.lr == 0.02
    rates = {
        name: [
            json.loads(line).get("lr")
            for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        ]
        for name in ("auto", "given")
    }
    assert [r / 0.02 for r in rates["given"] if r] == pytest.approx(
        [r / PREFERENCE_LR for r in rates["auto"] if r]
    )


@pytest.mark.slow
def test_dpo_resumes_exactly(inputs, tmp_path):
    model, data = inputs
    args = [f"--model={model}", f"--data={data}"]
    sets = [f"--set={s}" for s in [*FAST_RUN, *DPO, "schedule.max_steps=8", "checkpoint.every_steps=4"]]
    assert main(["train", *args, f"--out={tmp_path / 'straight'}", *sets]) == 0
    killed = run_killed(["train", *args, f"--out={tmp_path / 'killed'}", *sets], 4)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert main(["train", f"--resume={tmp_path / 'killed'}"]) == 0
    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "killed")
    assert sorted(resumed) == list(range(1, 9)) and all(straight[s] == resumed[s] for s in range(1, 9))
    a = load_file(str(tmp_path / "straight" / "checkpoints" / "step-00000008" / "trainable.safetensors"))
    b = load_file(str(tmp_path / "killed" / "checkpoints" / "step-00000008" / "trainable.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_dpo_refuses_the_prefix_cache(inputs, tmp_path, capsys):
    model, data = inputs
    sets = [f"--set={s}" for s in [*FAST_RUN, "train.objective=dpo", "train.prefix_cache=ram"]]
    assert main(["train", f"--model={model}", f"--data={data}", f"--out={tmp_path / 'run'}", *sets]) == 2
    assert "train.objective=dpo needs it off" in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_the_planner_counts_the_pairs_rows_and_the_reference_forward(tmp_path, capsys):
    import re

    shown, batch = plans_by_objective(["sft", "dpo"], tmp_path, capsys)
    assert f"x batch {batch}," in shown["sft"] and f"x batch {2 * batch}," in shown["dpo"]
    assert "dpo (batch counts the chosen and rejected rows" in shown["dpo"]
    step = {k: float(re.search(r"step ~ ([\d.]+) s", v).group(1)) for k, v in shown.items()}
    assert step["dpo"] > 2 * step["sft"]  # twice the rows, and four passes where SFT makes three
