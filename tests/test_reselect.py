"""Dynamic reselection: surgery keeps what it must, and what runs in training is what is saved and exported."""

import copy

import pytest
import torch
from helpers import EXPERTS_AND_ROUTERS

import usaf
from usaf.loss import causal_lm_loss
from usaf.reselect import Reselector
from usaf.tiny import tiny_model

IDS = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(6))


def train_steps(model, optimizer, reselector, first, last):
    info = None
    for step in range(first, last + 1):
        reselector.before_step(step)
        reselector.set_observing(True)
        loss = causal_lm_loss(model, IDS, IDS)
        reselector.set_observing(False)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        info = reselector.after_step(step, optimizer) or info
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


def test_evaluated_equals_checkpointed_equals_exported(tmp_path):
    from usaf.checkpoint import load, save
    from usaf.train import restore_trainable

    config = usaf.UsafConfig(
        targets=EXPERTS_AND_ROUTERS, density=0.1, reselect_every=2, reselect_fraction=0.5, train_biases=False
    )
    base = tiny_model("olmoe")
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

    from usaf.calibrate import Calibration, _Observer
    from usaf.prepare import sparse_experts
    from usaf.reselect import Reselector

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
