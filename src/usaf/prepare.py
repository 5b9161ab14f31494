"""`prepare_model`: the one call that makes a transformers MoE model sparsely trainable, in place."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from . import select
from .arch import MoELayer, find_moe_layers
from .config import UsafConfig
from .errors import UsafError
from .experts import IMPLEMENTATION_NAME, SparseExperts, register
from .sparse import ElementEntries, LineEntries, line_flat_indices
from .store import DenseStore


@dataclass
class Delta:
    """The trained entries of one parameter: `values.reshape(-1)[i]` replaces `param.view(-1)[flat_indices[i]]`."""

    flat_indices: torch.Tensor
    values: torch.Tensor


def prepare_model(
    model: nn.Module,
    config: UsafConfig | None = None,
    *,
    stores: dict | None = None,
    original_values: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> nn.Module:
    """Freeze `model`, make a sparse set of its expert entries (and its routers) trainable, and switch its
    experts to usaf's implementation. Returns the same model.

    stores: frozen storage per expert tensor, keyed "<experts module path>.<tensor name>" (e.g. quantized stores
        from `usaf.load`); tensors not named use the module's own parameter in place.
    original_values: (key, flat indices) -> the original full-precision values there, used to initialise the
        trained values when the store holds only an approximation (a quantized base).
    """
    config = config or UsafConfig()
    stores = stores or {}
    if any(isinstance(m, SparseExperts) for m in model.modules()):
        raise UsafError(
            "This model was already prepared by usaf.prepare_model; prepare a fresh model instead."
        )
    layers = find_moe_layers(model)
    trained = _trained_layers(layers, config)
    for param in model.parameters():
        param.requires_grad_(False)

    budgets = _weight_budgets([layer for layer in layers if layer.index in trained], config)
    for layer in layers:
        experts = layer.experts
        layer_stores = {
            t.name: stores.get(f"{layer.experts_name}.{t.name}") or DenseStore(experts, t.name)
            for t in layer.tensors
        }
        entries = {}
        if layer.index in trained:
            entries = _select_entries(layer, layer_stores, budgets, config, original_values)
            if config.train_router and layer.router is not None:
                for param in layer.router.parameters():
                    param.requires_grad_(True)
        experts.usaf = SparseExperts(
            layer_stores, entries, transposed=experts.is_transposed, workspace_bytes=config.workspace_mb << 20
        )
        experts.usaf.to(device=layer_stores["down_proj"].device)

    register()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(IMPLEMENTATION_NAME)
    for layer in layers:
        config_of = getattr(layer.experts, "config", None)
        if config_of is not None and config_of._experts_implementation != IMPLEMENTATION_NAME:
            config_of._experts_implementation_internal = IMPLEMENTATION_NAME
    model.usaf_config = config
    return model


def _trained_layers(layers: list[MoELayer], config: UsafConfig) -> set[int]:
    if config.layers is None:
        return {layer.index for layer in layers}
    by_number = {layer.layer_index: layer.index for layer in layers}
    missing = sorted(set(config.layers) - set(by_number))
    if missing:
        raise UsafError(
            f"UsafConfig.layers names {missing}, which are not MoE layers; MoE layers: {sorted(by_number)}."
        )
    return {by_number[i] for i in config.layers}


def _intermediate_size(experts: nn.Module) -> int:
    down = experts.down_proj
    return down.shape[1] if experts.is_transposed else down.shape[2]


def _weight_budgets(layers: list[MoELayer], config: UsafConfig) -> dict[str, int]:
    """Trained entries per expert weight tensor (element) or per layer (neuron), keyed by name."""
    numels = {}
    for layer in layers:
        for t in layer.tensors:
            if not t.is_bias:
                numels[f"{layer.experts_name}.{t.name}"] = getattr(layer.experts, t.name).numel()
    if config.granularity == "neuron":
        numels = {
            layer.experts_name: sum(v for k, v in numels.items() if k.startswith(layer.experts_name + "."))
            for layer in layers
        }
    if config.num_entries is not None:
        return select.split_budget(config.num_entries, numels)
    return {k: min(n, max(1, round(config.density * n))) for k, n in numels.items()}


def _select_entries(layer: MoELayer, stores: dict, budgets: dict, config: UsafConfig, original_values):
    name = layer.experts_name

    def initial(key: str, store, flat: torch.Tensor) -> torch.Tensor:
        return original_values(key, flat) if original_values is not None else store.read(flat)

    entries: dict[str, nn.Module] = {}
    weight_tensors = [t for t in layer.tensors if not t.is_bias]
    if config.granularity == "element":
        for t in weight_tensors:
            key = f"{name}.{t.name}"
            entries[t.name] = _element_entries(stores[t.name], budgets[key], config, key, initial)
    else:
        entries.update(_neuron_entries(layer, stores, budgets[name], config, initial))
    if config.train_biases:
        for t in layer.tensors:
            if t.is_bias:
                store = stores[t.name]
                numel = store.shape[0] * store.shape[2]
                count = min(numel, max(1, round(config.density * numel)))
                entries[t.name] = _element_entries(store, count, config, f"{name}.{t.name}", initial)
    return entries


def _element_entries(store, count: int, config: UsafConfig, key: str, initial) -> ElementEntries:
    numel = store.shape[0] * store.shape[1] * store.shape[2]
    if config.selection == "random":
        flat = select.random_flat_indices(numel, count, select.generator_for(config.seed, key))
    else:
        flat = select.magnitude_flat_indices(store, count)
    flat = flat.to(store.device)
    return ElementEntries(store.shape, flat, initial(key, store, flat).to(store.dtype))


def _neuron_entries(
    layer: MoELayer, stores: dict, budget: int, config: UsafConfig, initial
) -> dict[str, LineEntries]:
    """Whole neurons j of experts e: row j of gate and up, column j of down (transposed layouts: the reverse)."""
    experts = layer.experts
    first = "gate_up_proj" if experts.has_gate else "up_proj"
    intermediate = _intermediate_size(experts)
    num_experts = layer.num_experts
    axes = {first: 2 if experts.is_transposed else 1, "down_proj": 1 if experts.is_transposed else 2}
    per_neuron = sum(
        stores[n].shape[3 - axis] * (2 if n == "gate_up_proj" else 1) for n, axis in axes.items()
    )
    count = min(num_experts * intermediate, max(1, budget // per_neuron))
    if config.selection == "random":
        chosen = select.random_flat_indices(
            num_experts * intermediate, count, select.generator_for(config.seed, layer.experts_name)
        )
    else:
        chosen = _magnitude_neurons(experts, stores, axes, intermediate, count)
    expert, neuron = chosen // intermediate, chosen % intermediate
    entries = {}
    for name, axis in axes.items():
        gate = name == "gate_up_proj"
        lines = select.neuron_lines(neuron, intermediate, gate, experts.is_concatenated)
        owners = torch.cat([expert, expert]) if gate else expert
        line_ids = (owners * stores[name].shape[axis] + lines).sort().values.to(stores[name].device)
        key = f"{layer.experts_name}.{name}"
        base = initial(key, stores[name], line_flat_indices(stores[name].shape, axis, line_ids)).to(
            stores[name].dtype
        )
        entries[name] = LineEntries(stores[name].shape, axis, line_ids, base.view(line_ids.numel(), -1))
    return entries


def _magnitude_neurons(experts, stores, axes, intermediate: int, count: int) -> torch.Tensor:
    """Neurons with the largest squared norm over their gate, up and down lines."""
    scores = torch.zeros(stores["down_proj"].shape[0], intermediate)
    for name, axis in axes.items():
        for e in range(stores[name].shape[0]):
            w = stores[name].materialize([e])[0].float().cpu()
            line_norms = w.pow(2).sum(dim=2 - axis)  # one value per line along `axis`
            if name == "gate_up_proj":
                if experts.is_concatenated:
                    line_norms = line_norms[:intermediate] + line_norms[intermediate:]
                else:
                    line_norms = line_norms[0::2] + line_norms[1::2]
            scores[e] += line_norms
    return torch.topk(scores.reshape(-1), count, sorted=False).indices.sort().values


def sparse_modules(model: nn.Module):
    """(experts module path, SparseExperts) for every prepared experts module."""
    for path, module in model.named_modules():
        state = getattr(module, "usaf", None)
        if isinstance(state, SparseExperts):
            yield path, state


def get_delta(model: nn.Module) -> dict[str, Delta]:
    """{parameter name as in model.state_dict(): Delta} for every expert tensor with trained entries."""
    deltas = {}
    for path, state in sparse_modules(model):
        for name, entries in state.items():
            deltas[f"{path}.{name}"] = Delta(entries.expanded_flat_indices(), entries.values)
    if not deltas and not any(True for _ in sparse_modules(model)):
        raise UsafError("This model has not been prepared by usaf.prepare_model.")
    return deltas


def trainable_summary(model: nn.Module) -> dict[str, int]:
    """Trainable counts by kind (trained expert entries, routers, anything else), the total, and the number of
    expert entries the model has (trained or not)."""
    expert_values = {id(e.values) for _, state in sparse_modules(model) for e in state.values()}
    router_params, expert_entries = set(), 0
    for layer in find_moe_layers(model):
        if layer.router is not None:
            router_params.update(id(p) for p in layer.router.parameters())
        expert_entries += sum(getattr(layer.experts, t.name).numel() for t in layer.tensors)
    summary = {"expert_entries": 0, "routers": 0, "other": 0}
    for param in model.parameters():
        if param.requires_grad:
            kind = (
                "expert_entries"
                if id(param) in expert_values
                else "routers"
                if id(param) in router_params
                else "other"
            )
            summary[kind] += param.numel()
    summary["total"] = summary["expert_entries"] + summary["routers"] + summary["other"]
    summary["expert_entries_in_model"] = expert_entries
    return summary


def enable_recomputation(model: nn.Module, offload: bool = False) -> nn.Module:
    """Per-layer recomputation: keep only each decoder layer's input and recompute the layer in backward.

    Non-reentrant checkpointing, because every base parameter is frozen (the reentrant variant drops gradients
    when no input of a checkpointed block requires grad). `offload` keeps the saved layer inputs in host memory.
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, offload=offload)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model
