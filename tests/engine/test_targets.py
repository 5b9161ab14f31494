"""Sparse native training beyond the experts: attention, dense MLPs, norms, embedding and output-layer rows.

Each target against a plain transformers model patched at the trained entries: logits, and the value gradients
against the dense gradient gathered at the entries, on the nine tested families."""

import copy

import pytest
import torch
from test_engine import patched_reference, perturb

import usaf
from usaf.config import TARGETS
from usaf.errors import UsafError
from usaf.testing.tiny import FAMILIES, tiny_model

IDS = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(1))
ALL = list(TARGETS)


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def prepared(family, targets, **kw):
    reference = tiny_model(family, tie_word_embeddings=False)
    config = usaf.UsafConfig(density=0.15, selection="random", targets=targets, **kw)
    return reference, usaf.prepare_model(copy.deepcopy(reference), config)


def backward_against_patched_reference(reference, model):
    """Perturb the trained values, patch a plain copy of `reference` with them, run both with one loss: the
    logits must agree and each value's gradient must equal the plain model's dense gradient at its entry."""
    perturb(model)
    ref = patched_reference(reference, model)
    for param in ref.parameters():
        param.requires_grad_(True)
    target = torch.randn(2, 7, 97, generator=torch.Generator().manual_seed(2))
    logits, ref_logits = model(IDS).logits, ref(IDS).logits
    (logits * target).sum().backward()
    (ref_logits * target).sum().backward()
    assert (logits - ref_logits).abs().max() < 1e-5
    ref_params = dict(ref.named_parameters())
    for name, delta in usaf.get_delta(model).items():
        dense = ref_params[name].grad.reshape(-1)[delta.flat_indices]
        assert _rel(delta.values.grad.reshape(-1), dense) < 1e-4, name
    return ref


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_target_matches_transformers(family):
    reference, model = prepared(family, ALL)
    summary = usaf.trainable_summary(model)
    for target in ("attention", "norms", "embeddings", "lm_head"):
        assert summary.get(f"{target}_entries", 0) > 0, (target, summary)
    with torch.no_grad():
        assert (model(IDS).logits - reference(IDS).logits).abs().max() < 1e-5
    backward_against_patched_reference(reference, model)


# ---- every consumer follows: checkpoints, export, apply, load_delta, Trainer checkpoints -------------------------

EXPORTED = ("qwen3_moe", "qwen2_moe", "gpt_oss", "deepseek_v3", "gemma4_text")


@pytest.fixture(scope="module")
def trained_all_targets(tmp_path_factory):
    from safetensors.torch import save_file
    from test_export import adamw_steps, logits, save_run
    from transformers import AutoModelForCausalLM

    from usaf.train.tokenizer import char_tokenizer

    root = tmp_path_factory.mktemp("targets")
    input_ids = torch.randint(8, 100, (2, 10), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": input_ids}, str(root / "ids.safetensors"))
    runs = {}
    for family in EXPORTED:
        base = root / family / "base"
        tokenizer = char_tokenizer()
        tiny_model(family, vocab_size=len(tokenizer), tie_word_embeddings=False).save_pretrained(base)
        tokenizer.save_pretrained(base)
        model = AutoModelForCausalLM.from_pretrained(base)
        before = logits(model, input_ids)
        usaf.prepare_model(model, usaf.UsafConfig(density=0.1, targets=ALL))
        optimizer = adamw_steps(model, input_ids)
        sets = [f"select.targets=[{','.join(ALL)}]"]
        runs[family] = {
            "base": base,
            "run": save_run(root / family / "run", model, optimizer, base, *sets),
            "model": model,
            "logits": logits(model, input_ids),
            "before": before,
        }
    return {"root": root, "ids": root / "ids.safetensors", "input_ids": input_ids, "runs": runs}


@pytest.mark.slow
def test_all_targets_export_merged_and_applied_into_plain_transformers(trained_all_targets):
    from test_export import plain_logits

    from usaf.cli import main

    t, jobs = trained_all_targets, []
    for family, run in t["runs"].items():
        out = t["root"] / family
        assert main(["export", str(run["run"]), "--merged", str(out / "merged")]) == 0
        assert main(["export", str(run["run"]), "--delta", str(out / "delta.safetensors")]) == 0
        assert main(["apply", str(run["base"]), str(out / "delta.safetensors"), str(out / "applied")]) == 0
        changed = usaf.export.delta.read_delta(out / "delta.safetensors").changes
        for part in ("self_attn", "embed_tokens", "lm_head", "norm"):
            assert any(part in name for name in changed), (family, part)
        jobs += [(f"{family}/{k}", out / k, t["ids"]) for k in ("merged", "applied")]
    got = plain_logits(jobs, t["root"] / "plain.safetensors")
    for family, run in t["runs"].items():
        assert not torch.allclose(run["logits"], run["before"], atol=1e-4), family
        for kind in ("merged", "applied"):
            torch.testing.assert_close(got[f"{family}/{kind}"], run["logits"], atol=2e-5, rtol=1e-5)


def test_all_targets_delta_loads_into_plain_and_prepared_models(trained_all_targets):
    from test_export import logits
    from transformers import AutoModelForCausalLM

    t = trained_all_targets
    run = t["runs"]["qwen2_moe"]
    path = t["root"] / "qwen2_moe" / "loading.safetensors"
    usaf.export.delta.export_delta(run["run"], path)
    plain = usaf.load_delta(AutoModelForCausalLM.from_pretrained(run["base"]), path, base_dir=run["base"])
    torch.testing.assert_close(logits(plain, t["input_ids"]), run["logits"], atol=2e-5, rtol=1e-5)
    prepared = usaf.prepare_model(
        AutoModelForCausalLM.from_pretrained(run["base"]), usaf.UsafConfig(density=0.02, targets=ALL)
    )
    usaf.load_delta(prepared, path)
    torch.testing.assert_close(logits(prepared, t["input_ids"]), run["logits"], atol=2e-5, rtol=1e-5)
    loaded = usaf.get_delta(prepared)
    for name, change in usaf.get_delta(run["model"]).items():
        order = torch.argsort(change.flat_indices)
        assert torch.equal(loaded[name].flat_indices, change.flat_indices[order]), name


def test_merged_export_changes_only_trained_entries(trained_all_targets):
    from safetensors.torch import load_file

    from usaf.cli import main

    t = trained_all_targets
    run = t["runs"]["qwen3_moe"]
    folder = t["root"] / "qwen3_moe" / "merged"
    if not folder.exists():  # the slow test above writes it; the fast loop (-m "not slow") runs this alone
        assert main(["export", str(run["run"]), "--merged", str(folder)]) == 0
    merged = load_file(str(folder / "model.safetensors"))
    base = load_file(str(run["base"] / "model.safetensors"))
    deltas = usaf.get_delta(run["model"])
    for key, tensor in base.items():
        if key not in deltas:
            continue  # routers (trained whole) and untouched tensors
        outside = torch.ones(tensor.numel(), dtype=torch.bool)
        outside[deltas[key].flat_indices] = False
        assert torch.equal(merged[key].reshape(-1)[outside], tensor.reshape(-1)[outside]), key


@pytest.mark.parametrize("named", [["lm_head"], ["embeddings"], ["experts", "embeddings", "lm_head"]])
def test_tied_embedding_and_output_layer_train_one_weight(named):
    """A tied weight has two uses: its entries live on the embedding, the output layer reads the same values,
    and the value gradients are the sum of both uses (the tied dense gradient)."""
    reference = tiny_model("qwen3_moe", tie_word_embeddings=True)
    model = usaf.prepare_model(
        copy.deepcopy(reference), usaf.UsafConfig(density=0.15, selection="random", targets=named)
    )
    deltas = usaf.get_delta(model)
    assert "model.embed_tokens.weight" in deltas and "lm_head.weight" not in deltas
    ref = backward_against_patched_reference(reference, model)  # the tied dense gradient: both uses summed
    assert ref.lm_head.weight is ref.model.embed_tokens.weight


def test_unknown_target_is_refused():
    with pytest.raises(UsafError, match="targets must be"):
        usaf.UsafConfig(targets=["experts", "mlp"])


def test_gradient_selection_reaches_every_target_kind():
    ids = torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(0))
    model = usaf.prepare_model(
        tiny_model("qwen2_moe", tie_word_embeddings=False),
        usaf.UsafConfig(density=0.05, selection="gradient", targets=ALL),
        calibration_batches=[{"input_ids": ids, "labels": ids}] * 2,
    )
    summary = usaf.trainable_summary(model)
    for target in ("attention", "dense_mlp", "norms", "embeddings", "lm_head"):
        assert summary.get(f"{target}_entries", 0) > 0, target
    # embedding rows of tokens never seen in calibration have no gradient: none of them is chosen
    seen = set(ids.reshape(-1).tolist())
    embed = dict(usaf.get_delta(model))["model.embed_tokens.weight"]
    rows = (embed.flat_indices // model.get_input_embeddings().weight.shape[1]).tolist()
    assert set(rows) <= seen


@pytest.mark.parametrize("granularity", ["element", "neuron"])
def test_density_ratios_move_budget_between_targets_and_keep_the_total(granularity):
    """density_ratios weighs the targets' densities against each other; the total budget does not change."""

    def counts(**kw):
        model = usaf.prepare_model(
            tiny_model("qwen3_moe", tie_word_embeddings=False),
            usaf.UsafConfig(
                density=0.05, selection="random", targets=TARGETS_NO_ROUTERS, granularity=granularity, **kw
            ),
        )
        summary = usaf.trainable_summary(model)
        return summary["expert_entries"], summary["attention_entries"], summary["total"]

    experts, attention, total = counts()
    more_experts, more_attention, ratio_total = counts(density_ratios={"attention": 8.0})
    # attention's density is 8 x the experts' (both measured against the uniform split: same tensor sizes)
    assert (more_attention / attention) / (more_experts / experts) == pytest.approx(
        8.0, rel=0.05 if granularity == "element" else 0.2
    )
    # rounding: per tensor (uniform split); whole neurons per layer (neuron granularity: 2 layers, 3 x 32 each)
    assert abs(ratio_total - total) <= (0.01 * total if granularity == "element" else 2 * 3 * 32)


def test_density_ratios_are_checked():
    with pytest.raises(UsafError, match="density_ratios"):
        usaf.UsafConfig(density_ratios={"attention": 0})
    with pytest.raises(UsafError, match="density_ratios"):
        usaf.UsafConfig(density_ratios={"routers": 2})


TARGETS_NO_ROUTERS = [t for t in TARGETS if t != "routers"]


def test_calibration_probes_only_the_best_rows_of_a_native_weight(monkeypatch):
    """Gradient selection never scores a whole output layer: its rows are ranked by first-order importance
    first, and only oversample x the budget (in rows) get exact gradients."""
    from usaf.selection import calibrate

    probed = {}
    real = calibrate.probe_lines

    def recording(model, candidates, *args):
        probed.update({key: lines.numel() for key, (_, lines) in candidates.items()})
        return real(model, candidates, *args)

    monkeypatch.setattr(calibrate, "probe_lines", recording)
    ids = torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(0))
    model = usaf.prepare_model(
        tiny_model("qwen3_moe", tie_word_embeddings=False),
        usaf.UsafConfig(density=0.02, selection="gradient", targets=["experts", "lm_head"], oversample=2.0),
        calibration_batches=[{"input_ids": ids, "labels": ids}] * 2,
    )
    rows, width = model.lm_head.weight.shape
    budget = usaf.trainable_summary(model)["lm_head_entries"]
    assert probed["lm_head.weight"] == -(-2 * budget // width) + 1 < rows
