"""Dynamic reselection: surgery keeps what it must, and what runs in training is what is saved and exported."""

import copy

import pytest
import torch
from helpers import EXPERTS_AND_ROUTERS, reselecting_step

import usaf
from usaf.selection.reselect import Reselector
from usaf.testing.tiny import tiny_model

IDS = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(6))


def train_steps(model, optimizer, reselector, first, last):
    info = None
    for step in range(first, last + 1):
        info = reselecting_step(model, optimizer, reselector, step, IDS) or info
    return info


@pytest.mark.parametrize("granularity", ["element", "neuron"])
def test_surgery_keeps_moments_and_budget_and_reverts_dropped(granularity):
    config = usaf.UsafConfig(
        targets=EXPERTS_AND_ROUTERS,
        density=0.1,
        granularity=granularity,
        reselect_every=4,
        reselect_fraction=0.5,
        train_biases=False,
    )
    base = tiny_model("qwen3_moe")
    model = usaf.prepare_model(copy.deepcopy(base), config)
    values = [p for n, p in model.named_parameters() if n.endswith(".values")]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    reselector = Reselector(model, config, total_steps=20)
    before = {
        k: (d.flat_indices.clone(), d.values.detach().clone()) for k, d in usaf.get_delta(model).items()
    }
    moments = {}
    train_steps(model, optimizer, reselector, 1, 3)
    for k, d in usaf.get_delta(model).items():
        p = d.values
        moments[k] = (
            d.flat_indices.clone(),
            optimizer.state[p]["exp_avg"].reshape(-1).clone(),
            p.detach().clone(),
        )
    info = train_steps(model, optimizer, reselector, 4, 4)
    assert info["reselected_entries"] > 0
    params = dict(model.named_parameters())
    base_params = dict(base.named_parameters())
    for k, d in usaf.get_delta(model).items():
        old_flat, _ = before[k]
        assert d.flat_indices.numel() == old_flat.numel(), "the budget changed"
        kept = torch.isin(d.flat_indices, old_flat)
        assert 0 < int(kept.sum()) < d.flat_indices.numel(), "nothing was replaced"
        state = optimizer.state[d.values]
        assert state["exp_avg"].shape == d.values.shape and values  # same parameter objects
        grown = ~kept
        assert torch.all(state["exp_avg"].reshape(-1)[grown] == 0) and torch.all(
            state["exp_avg_sq"].reshape(-1)[grown] == 0
        )
        assert torch.all(state["exp_avg"].reshape(-1)[kept] != 0), "kept entries lost their moments"
        model(IDS)  # the forward writes trained values in; dropped entries must read as base
        dropped = old_flat[~torch.isin(old_flat, d.flat_indices)]
        weight = params[k].detach().reshape(-1)
        assert torch.equal(weight[dropped], base_params[k].detach().reshape(-1)[dropped])
        grown_flat = d.flat_indices[grown]
        assert torch.equal(
            d.values.detach().reshape(-1)[grown], base_params[k].detach().reshape(-1)[grown_flat]
        )


def test_every_target_is_reselected_keeping_moments_and_budget():
    """Beyond the experts (attention, dense MLP, norms, embedding and output rows) reselection follows the same
    rules: the budget per weight is kept, kept entries keep value and moments, grown entries start at the base
    value with zero moments, dropped entries read as base in the weight the forward uses."""
    from usaf.config import TARGETS

    config = usaf.UsafConfig(
        targets=[t for t in TARGETS if t != "routers"],
        density=0.1,
        selection="random",
        reselect_every=4,
        reselect_fraction=0.5,
    )
    base = tiny_model("qwen2_moe", tie_word_embeddings=False)  # qwen2_moe: a shared expert (dense_mlp)
    model = usaf.prepare_model(copy.deepcopy(base), config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    reselector = Reselector(model, config, total_steps=20)
    train_steps(model, optimizer, reselector, 1, 3)
    reselecting_step(model, optimizer, reselector, 4, IDS, reselect=False)
    before = {}
    for k, d in usaf.get_delta(model).items():
        state = optimizer.state[d.values]
        before[k] = {
            int(f): (float(v), float(m), float(m2))
            for f, v, m, m2 in zip(
                d.flat_indices.tolist(),
                d.values.detach().reshape(-1).tolist(),
                state["exp_avg"].reshape(-1).tolist(),
                state["exp_avg_sq"].reshape(-1).tolist(),
                strict=True,
            )
        }
    assert reselector.after_step(4, optimizer)["reselected_entries"] > 0
    model(IDS)  # the forward writes trained values in; dropped entries must read as base
    params, base_params = dict(model.named_parameters()), dict(base.named_parameters())
    replaced_in = set()
    for k, d in usaf.get_delta(model).items():
        old = before[k]
        flat = d.flat_indices.tolist()
        assert len(flat) == len(old), f"{k}: the budget changed"
        state = optimizer.state[d.values]
        now = zip(
            flat,
            d.values.detach().reshape(-1).tolist(),
            state["exp_avg"].reshape(-1).tolist(),
            state["exp_avg_sq"].reshape(-1).tolist(),
            strict=True,
        )
        original = base_params[k].detach().reshape(-1)
        for f, v, m, m2 in now:
            if f in old:
                assert (v, m, m2) == old[f], f"{k}[{f}]: a kept entry lost its value or moments"
            else:
                assert v == float(original[f]) and m == 0 and m2 == 0, f"{k}[{f}]: a grown entry"
                replaced_in.add(k)
        dropped = torch.tensor(sorted(set(old) - set(flat)), dtype=torch.int64)
        assert torch.equal(params[k].detach().reshape(-1)[dropped], original[dropped]), k
    kinds = {name.rsplit(".", 2)[-2] for name in replaced_in}
    for wanted in ("q_proj", "o_proj", "embed_tokens", "lm_head", "input_layernorm", "experts"):
        assert any(wanted in k for k in replaced_in), (wanted, sorted(replaced_in), kinds)
    assert any("shared_expert" in k for k in replaced_in), sorted(replaced_in)


@pytest.mark.parametrize("targets", [EXPERTS_AND_ROUTERS, None], ids=["experts", "default-targets"])
def test_evaluated_equals_checkpointed_equals_exported(tmp_path, targets):
    from usaf.train.checkpoint import load, restore_trainable, save

    config = usaf.UsafConfig(
        targets=targets or list(usaf.config.DEFAULT_TARGETS),
        density=0.1,
        reselect_every=2,
        reselect_fraction=0.5,
        train_biases=False,
    )
    base = tiny_model("olmoe", tie_word_embeddings=False)
    model = usaf.prepare_model(copy.deepcopy(base), config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    reselector = Reselector(model, config, total_steps=10)
    assert train_steps(model, optimizer, reselector, 1, 4)["reselected_entries"] > 0
    with torch.no_grad():
        in_run = model(IDS).logits
    path = save(
        tmp_path,
        4,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        state={"rng": {"torch": torch.get_rng_state()}},
        keep_last=1,
    )

    resumed = usaf.prepare_model(copy.deepcopy(base), config)
    restore_trainable(resumed, load(path)["trainable"], path)
    exported = copy.deepcopy(base)
    exported_params = dict(exported.named_parameters())
    with torch.no_grad():
        for name, delta in usaf.get_delta(model).items():
            exported_params[name].view(-1)[delta.flat_indices] = delta.values.detach().reshape(-1)
        for name, param in model.named_parameters():
            if param.requires_grad and name in exported_params:  # routers
                exported_params[name].copy_(param)
        assert torch.equal(resumed(IDS).logits, in_run)
        assert torch.allclose(exported(IDS).logits, in_run, atol=1e-6)


def test_observers_do_not_keep_activations_alive():
    """The reselection and calibration observers hook the experts' activations; a hook that refers back to its
    tensor makes a cycle through autograd's graph that nothing frees (memory grew ~25 MB a step on the quality
    benchmark's model). After a step, the activations the observers saw must be gone."""
    import gc
    import weakref

    from usaf.engine.installed import sparse_experts
    from usaf.selection.calibrate import Calibration, _Observer
    from usaf.selection.reselect import Reselector

    model = tiny_model("qwen3_moe")
    config = usaf.UsafConfig(targets=EXPERTS_AND_ROUTERS, density=0.1, reselect_every=2)
    usaf.prepare_model(model, config)
    reselector = Reselector(model, config, total_steps=10)
    calibration, seen = Calibration(), []
    for path, state in sparse_experts(model):
        observer = _Observer(calibration, path, state.num_experts, with_gradients=True)
        observer.active = True
        state.observers += [observer, lambda state, plan, weights, h: seen.append(weakref.ref(h))]
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    reselector.set_observing(True)
    model(ids, labels=ids).loss.backward()
    reselector.set_observing(False)
    gc.collect()
    assert (
        seen and all(i.score is not None for i in reselector.importance.values()) and calibration.neuron_score
    )
    assert all(ref() is None for ref in seen), "an observer keeps the experts' activations alive"
