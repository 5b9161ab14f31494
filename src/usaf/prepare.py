"""`prepare_model`: the one call that makes a transformers MoE model sparsely trainable, in place."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from usaf.config import UsafConfig
from usaf.engine import expert_parallel
from usaf.engine.costs import keeps_base
from usaf.engine.experts import IMPLEMENTATION_NAME, SparseExperts, register
from usaf.engine.installed import sparse_experts, sparse_modules, sparse_weights
from usaf.engine.router import make_routers_fp32
from usaf.engine.sparse import ElementEntries, LineEntries, line_flat_indices
from usaf.engine.sparse_weights import install, tie
from usaf.engine.state import ModelState, SparseState, model_state, set_model_state
from usaf.errors import ConfigError, ModelError
from usaf.kernels.host import read_int
from usaf.model.hf import apply_renamings, checkpoint_renamings, use_experts_implementation
from usaf.model.layout import MoELayer, find_moe_layers
from usaf.model.targets import find_target_weights, tied_output_layer
from usaf.selection import across_ranks, choose
from usaf.selection.saved import Chosen
from usaf.store.dense import DenseStore


@dataclass
class TensorChange:
    """New values of one model parameter: `values.reshape(-1)[i]` replaces `param.view(-1)[flat_indices[i]]`, or
    the whole tensor when `flat_indices` is None. What `get_delta` returns per parameter, and what a delta file
    holds (`usaf.export.delta.Delta`)."""

    flat_indices: torch.Tensor | None
    values: torch.Tensor

    @property
    def count(self) -> int:
        return self.values.numel()


def prepare_model(
    model: nn.Module,
    config: UsafConfig | None = None,
    *,
    stores: dict | None = None,
    original_values: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    calibration_batches=None,
) -> nn.Module:
    """Freeze `model`, make a sparse set of its expert entries (and its routers, and entries of the other native
    weights named in `config.targets`) trainable, and switch its experts to usaf's implementation. Returns the same
    model.

    stores: frozen storage per expert tensor, keyed "<experts module path>.<tensor name>" (e.g. quantized stores
        from `usaf.base.load`); tensors not named use the module's own parameter in place.
    original_values: (key, flat indices) -> the original full-precision values there, used to initialise the
        trained values when the store holds only an approximation (a quantized base).
    calibration_batches: batches of the task (dicts with input_ids, labels, position_ids) for data-driven
        strategies ("routing", "gradient") and selection="gradient".
    """
    config = config or UsafConfig()
    stores = stores or {}
    across_ranks.check_joined()
    if model_state(model) is not None or any(isinstance(m, SparseState) for m in model.modules()):
        raise ModelError(
            "This model was already prepared by usaf.prepare_model; prepare a fresh model instead."
        )
    layers = find_moe_layers(model)
    trained = [layer for layer in layers if layer.index in _trained_layers(layers, config)]
    for param in model.parameters():
        param.requires_grad_(False)

    # the engine goes in first, with nothing trained: calibration runs through it
    layer_stores = _install_experts(model, layers, stores, config)
    weight_stores = _install_weights(model, layers, config)
    chosen, calibration = choose.choose(
        trained, layer_stores, config, calibration_batches, model, weight_stores
    )
    # expert parallelism: a rank trains only its own experts' share of the (global) selection
    expert_stores = {
        f"{path}.{n}": s for path, stores_of in layer_stores.items() for n, s in stores_of.items()
    }
    install_selection(model, expert_parallel.keep_owned(chosen, expert_stores), original_values)
    if config.trains_routers:
        _train_routers(model, trained)
    model.register_load_state_dict_pre_hook(_accept_checkpoint_names)
    # calibration: what the selection was calibrated on (None: no calibration)
    set_model_state(model, ModelState(config, calibration=calibration, original_values=original_values))
    # data parallel (usaf's loop, or DDP under transformers.Trainer): every rank trains rank 0's selection, and
    # DDP (which reads this attribute when it wraps the model) leaves the selection's buffers alone
    across_ranks.broadcast_trainable(model)
    model._ddp_params_and_buffers_to_ignore = across_ranks.selection_buffers(model)
    return model


def _install_experts(model: nn.Module, layers: list[MoELayer], stores: dict, config: UsafConfig) -> dict:
    """usaf's experts implementation on every MoE layer, with nothing trained yet: {experts path: {tensor name:
    its frozen store}} (a given store, else the module's own parameter)."""
    layer_stores = {}
    for layer in layers:
        experts = layer.experts
        layer_stores[layer.experts_name] = {
            t.name: stores.get(f"{layer.experts_name}.{t.name}") or DenseStore(experts, t.name)
            for t in layer.tensors
        }
        experts.usaf = SparseExperts(
            layer_stores[layer.experts_name],
            {},
            transposed=experts.is_transposed,
            workspace_bytes=config.fixed_workspace_mb << 20,
        )
    _switch_implementation(model, layers)
    return layer_stores


def _install_weights(model: nn.Module, layers: list[MoELayer], config: UsafConfig) -> dict:
    """usaf's state on every targeted weight beyond the experts (a tied output layer shares the embedding's):
    {"<module path>.weight": (target, its store)}."""
    weights = [
        w
        for w in find_target_weights(model, layers, config.targets)
        # with layers named, only those decoder layers train: nothing below them (a frozen prefix stays frozen)
        if config.layers is None or w.layer_index in config.layers
    ]
    states = {w.key: install(w.module, w.target, w.kind) for w in weights}
    tied_head = tied_output_layer(model)
    embedding_key = next((w.key for w in weights if w.target == "embeddings"), None)
    if tied_head is not None and embedding_key is not None:
        tie(tied_head, states[embedding_key])
    return {w.key: (w.target, states[w.key].stores["weight"]) for w in weights}


def _train_routers(model: nn.Module, trained: list[MoELayer]) -> None:
    for layer in trained:
        for param in layer.router.parameters() if layer.router is not None else ():
            param.requires_grad_(True)
    make_routers_fp32(model)  # bf16/fp16 routers: fp32 master weights, or small updates round away


def model_renamings(model: nn.Module) -> list:
    """The key renamings transformers applies when loading `model`'s checkpoints (and reverses when saving)."""
    return checkpoint_renamings(model)


def _accept_checkpoint_names(model: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """`save_pretrained` (and so transformers.Trainer) writes keys in the checkpoint's own naming (Mixtral's `.mlp.`
    as `.block_sparse_moe.`), but Trainer's resume and best-model reload use a plain `load_state_dict`: rename keys
    that the model's own load-time renamings map onto its parameters and buffers (trained values, selections,
    routers), or they would be skipped silently and training would restart from the base."""
    try:
        renamings = model_renamings(model)
    except Exception:  # a model transformers has no conversion mapping for: nothing to rename
        return
    if not renamings:
        return
    own = {prefix + name for name, _ in [*model.named_parameters(), *model.named_buffers()]}
    for key in [k for k in state_dict if k not in own]:
        renamed = apply_renamings(key, renamings)
        if renamed != key and renamed in own and renamed not in state_dict:
            state_dict[renamed] = state_dict.pop(key)


def _switch_implementation(model: nn.Module, layers: list[MoELayer]) -> None:
    """usaf's experts implementation; under expert parallelism (a layout installed) its dispatch over the ranks,
    from the start, since calibration runs through it."""
    if expert_parallel.layout() is not None:
        expert_parallel.enable(model)
        return
    register()
    use_experts_implementation(model, [layer.experts for layer in layers], IMPLEMENTATION_NAME)


def install_selection(model: nn.Module, chosen: dict, original_values=None) -> None:
    """Make the chosen entries trainable: values start from the original weights at those entries."""
    states = dict(sparse_modules(model))
    # model order, whatever the order of `chosen`: parameter order must not depend on where a selection came
    # from, or a resumed optimizer state would be matched to the wrong tensors
    keys = [f"{path}.{name}" for path, state in states.items() for name in state.stores]
    order = {key: i for i, key in enumerate(keys)}
    unknown = sorted(set(chosen) - set(order))
    if unknown:
        raise ModelError(
            f"The selection names {unknown[:3]}, which are not weights this model trains (expert tensors, or the "
            "weights of select.targets); use the configuration the selection was made with."
        )
    for key in sorted(chosen, key=order.__getitem__):
        axis, indices = chosen[key]
        path, name = key.rsplit(".", 1)
        store = states[path].stores[name]
        device = store.device
        # checked where the selection was made (the host, for usaf's own), before it travels: two reads
        bound = math.prod(store.shape) if axis is None else store.shape[0] * store.shape[axis]
        if indices.numel() and (
            read_int(indices.min(), 0) < 0 or read_int(indices.max(), bound - 1) >= bound
        ):
            raise ModelError(
                f"The selection for '{key}' points outside the tensor (shape {list(store.shape)})."
            )
        indices = indices.to(device=device, dtype=torch.int64)
        if not states[path].is_expert_stack and axis is not None:  # native weights train elements
            axis, indices = None, line_flat_indices(store.shape, axis, indices).sort().values
        flat = indices if axis is None else line_flat_indices(store.shape, axis, indices)
        base = original_values(key, flat) if original_values is not None else store.read(flat)
        base = base.to(store.dtype)
        if axis is None:  # a resident store is written into: only there must the base be kept to revert to
            entries = ElementEntries(store.shape, flat, base, keep_base=keeps_base(True, store.resident))
        else:
            entries = LineEntries(store.shape, axis, indices, base.view(indices.numel(), -1))
        states[path][name] = entries.to(device)


def current_selection(model: nn.Module) -> dict:
    """The selection a prepared model trains, as `usaf.selection.saved.Chosen` per tensor key (for saving and reuse).
    Under expert parallelism the whole one, gathered from the ranks of the EP group (each of which must call it)."""
    chosen = {}
    for path, state in sparse_modules(model):
        for name, e in state.items():
            indices = getattr(e, e.selection_name).detach().cpu()
            if state.is_expert_stack:
                indices = expert_parallel.gather_owned(indices)
            chosen[f"{path}.{name}"] = Chosen(getattr(e, "axis", None), indices)
    return chosen


def _trained_layers(layers: list[MoELayer], config: UsafConfig) -> set[int]:
    if config.layers is None:
        return {layer.index for layer in layers}
    by_number = {layer.layer_index: layer.index for layer in layers}
    missing = sorted(set(config.layers) - set(by_number))
    if missing:
        raise ConfigError(
            f"UsafConfig.layers names {missing}, which are not MoE layers; MoE layers: {sorted(by_number)}."
        )
    return {by_number[i] for i in config.layers}


def get_delta(model: nn.Module) -> dict[str, TensorChange]:
    """{parameter name as in model.state_dict(): TensorChange} for every expert tensor with trained entries."""
    deltas = {}
    for path, state in sparse_modules(model):
        for name, entries in state.items():
            deltas[f"{path}.{name}"] = TensorChange(entries.expanded_flat_indices(), entries.values)
    if not deltas and not any(True for _ in sparse_modules(model)):
        raise ModelError("This model has not been prepared by usaf.prepare_model.")
    return deltas


def trainable_summary(model: nn.Module) -> dict[str, int]:
    """Trainable counts by kind (trained expert entries, routers, entries of each other target as
    "<target>_entries", anything else), the total, and the number of expert entries the model has."""
    expert_values = {id(e.values) for _, state in sparse_experts(model) for e in state.values()}
    target_of = {id(e.values): state.target for _, state in sparse_weights(model) for e in state.values()}
    router_params, expert_entries = set(), 0
    for layer in find_moe_layers(model):
        if layer.router is not None:
            router_params.update(id(p) for p in layer.router.parameters())
        expert_entries += sum(getattr(layer.experts, t.name).numel() for t in layer.tensors)
    summary = {"expert_entries": 0, "routers": 0, "other": 0}
    for param in model.parameters():
        if param.requires_grad:
            if id(param) in expert_values:
                kind = "expert_entries"
            elif id(param) in target_of:
                kind = f"{target_of[id(param)]}_entries"
            elif id(param) in router_params:
                kind = "routers"
            else:
                kind = "other"
            summary[kind] = summary.get(kind, 0) + param.numel()
    # expert parallelism: a rank trains its own experts' entries; the count is the job's (every rank must call)
    summary["expert_entries"] = across_ranks.job_expert_count(summary["expert_entries"])
    summary["total"] = sum(summary.values())
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
