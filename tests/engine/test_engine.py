"""The engine against transformers' own implementation: logits, patched weights, gradients, frozen entries."""

import copy

import pytest
import torch

import usaf
from usaf.testing.tiny import FAMILIES, tiny_model

IDS = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(1))


def prepared(family, granularity="element", **kw):
    reference = tiny_model(family)
    model = usaf.prepare_model(
        copy.deepcopy(reference),
        usaf.UsafConfig(
            density=0.15, granularity=granularity, selection="random", targets=["experts", "routers"], **kw
        ),
    )
    return reference, model


def perturb(model, scale=0.2):
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".values"):
                param.add_(torch.randn_like(param) * scale)


def patched_reference(reference, model):
    """A plain transformers model whose weights are replaced at the trained entries."""
    ref = copy.deepcopy(reference)
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, delta in usaf.get_delta(model).items():
            params[name].view(-1)[delta.flat_indices] = (
                delta.values.detach().reshape(-1).to(params[name].dtype)
            )
    return ref


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("granularity", ["element", "neuron"])
@pytest.mark.usefixtures("each_kernel_path")
def test_logits_and_gradients_match_transformers(family, granularity):
    reference, model = prepared(family, granularity)
    with torch.no_grad():  # (a) untouched: same logits as transformers' grouped_mm
        assert (model(IDS).logits - reference(IDS).logits).abs().max() < 1e-5

    perturb(model)
    ref = patched_reference(reference, model)
    embeds = ref.get_input_embeddings()(IDS).detach()
    target = torch.randn(2, 7, 97, generator=torch.Generator().manual_seed(2))

    def loss_of(m):
        x = embeds.clone().requires_grad_(True)
        logits = m(inputs_embeds=x).logits
        (logits * target).sum().backward()
        return logits.detach(), x.grad

    for param in ref.parameters():
        param.requires_grad_(True)
    ref_logits, ref_input_grad = loss_of(ref)
    logits, input_grad = loss_of(model)
    assert (logits - ref_logits).abs().max() < 1e-5  # (b) perturbed values = patched plain model
    assert _rel(input_grad, ref_input_grad) < 1e-4  # (c) input gradients unaffected

    ref_params = dict(ref.named_parameters())
    deltas = usaf.get_delta(model)
    assert deltas, "nothing was selected"
    for name, delta in deltas.items():
        dense = ref_params[name].grad.reshape(-1)[delta.flat_indices]
        assert _rel(delta.values.grad.reshape(-1), dense) < 1e-4, name
    routers = [(n, p) for n, p in model.named_parameters() if p.requires_grad and ".values" not in n]
    assert routers, "no router is trainable"
    for name, param in routers:
        assert _rel(param.grad, ref_params[name].grad) < 1e-4, name


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("granularity", ["element", "neuron"])
def test_unselected_entries_stay_bit_identical(family, granularity):
    reference, model = prepared(family, granularity)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(4):
        model(IDS, labels=IDS).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model(IDS)  # the forward writes the latest values into the weights
    ref_params = dict(reference.named_parameters())
    deltas = usaf.get_delta(model)
    for name, param in model.named_parameters():
        if name not in ref_params or "router" in name or name.endswith("gate.weight"):
            continue
        changed = (param.detach() != ref_params[name]).reshape(-1)
        if name in deltas:
            changed[deltas[name].flat_indices] = False
            trained = param.detach().reshape(-1)[deltas[name].flat_indices]
            assert torch.equal(trained, deltas[name].values.detach().reshape(-1).to(trained.dtype))
        assert not changed.any(), f"{name}: {int(changed.sum())} unselected entries changed"


def test_budget_and_summary():
    _, model = prepared("qwen3_moe")
    summary = usaf.trainable_summary(model)
    deltas = usaf.get_delta(model)
    assert summary["expert_entries"] == sum(d.flat_indices.numel() for d in deltas.values())
    assert summary["total"] == summary["expert_entries"] + summary["routers"]
    exact = usaf.prepare_model(
        tiny_model("qwen3_moe"), usaf.UsafConfig(num_entries=1234, selection="random", targets=["experts"])
    )
    assert usaf.trainable_summary(exact)["expert_entries"] == 1234
    for delta in usaf.get_delta(exact).values():
        assert delta.flat_indices.dtype == torch.int64 and delta.flat_indices.dim() == 1
        assert delta.values.dtype == torch.float32


def test_magnitude_selection_picks_largest_entries():
    model = usaf.prepare_model(tiny_model("mixtral"), usaf.UsafConfig(density=0.05, selection="magnitude"))
    for name, delta in usaf.get_delta(model).items():
        weight = dict(model.named_parameters())[name].detach().reshape(-1).abs()
        chosen = torch.zeros_like(weight, dtype=torch.bool)
        chosen[delta.flat_indices] = True
        assert weight[chosen].min() >= weight[~chosen].max()


def test_selection_is_seeded():
    picks = [
        usaf.get_delta(
            usaf.prepare_model(tiny_model("qwen3_moe"), usaf.UsafConfig(selection="random", seed=s))
        )
        for s in (1, 1, 2)
    ]
    name = next(iter(picks[0]))
    assert torch.equal(picks[0][name].flat_indices, picks[1][name].flat_indices)
    assert not torch.equal(picks[0][name].flat_indices, picks[2][name].flat_indices)


def test_router_can_stay_frozen_and_layers_can_be_chosen():
    model = usaf.prepare_model(tiny_model("qwen3_moe"), usaf.UsafConfig(train_router=False, layers=[1]))
    summary = usaf.trainable_summary(model)
    assert summary["routers"] == 0
    assert all(".layers.1." in name for name in usaf.get_delta(model))


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
