"""A delta loaded into a live model: a prepared model's trained entries, or a plain model's weights, take the delta's values."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from usaf.base.checkpoint import BaseCheckpoint
from usaf.engine.costs import keeps_base
from usaf.engine.installed import sparse_modules
from usaf.engine.sparse import ElementEntries
from usaf.errors import ModelError
from usaf.export.delta import Delta, check_base, check_base_recorded, read_delta, verify_checksums
from usaf.prepare import TensorChange

# ---- applying a delta to a loaded model ----------------------------------------------------------------------------


@torch.no_grad()
def load_delta(
    model: nn.Module,
    path: str | Path | Delta,
    base_dir: str | Path | None = None,
    *,
    unchecked_base: bool = False,
) -> nn.Module:
    """Apply a delta file to a loaded transformers model, for inference; returns the model.

    A plain model gets the trained values written into its parameters (cast to their dtype). A model prepared by
    `usaf.prepare_model` (quantized base or not) gets them as its trained values: the engine writes them over the
    frozen base in every forward. base_dir: also verify the checksums of the checkpoint the model was loaded from
    (a delta without its base record is then refused unless `unchecked_base`). The delta's content is checked as
    it is read (indices, values: `usaf.export.delta.check_change`). `path` may be a delta read already.
    """

    delta = path if isinstance(path, Delta) else read_delta(path)
    path = delta.origin
    if not unchecked_base:
        check_base_recorded(delta, "this model", "unchecked_base=True")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    made_for = (delta.base_record or {}).get("model_type")
    if model_type is not None and made_for not in (None, model_type):
        raise ModelError(f"{path} was made for a {made_for} model; this model is {model_type}.")
    if base_dir is not None:
        check_delta_base(delta, base_dir, unchecked_base=unchecked_base)
    prepared = dict(sparse_modules(model))
    for name, change in delta.changes.items():
        shape = delta.info["changes"][name]["shape"]
        module_path, _, attr = name.rpartition(".")
        state = prepared.get(module_path)
        if state is not None and attr in state.stores:
            _load_into_entries(state, attr, change, name, path)
            continue
        try:
            tensor = model.get_parameter(name)
        except AttributeError:
            raise ModelError(f"{path} changes '{name}', which this model does not have.") from None
        if list(tensor.shape) != shape:
            raise ModelError(
                f"{path} changes '{name}' of shape {shape}; this model's is {list(tensor.shape)}."
            )
        _write_entries(tensor.data, change, name)
    return model


def check_delta_base(
    delta: Delta | str | Path, base_dir: str | Path, *, unchecked_base: bool = False
) -> None:
    """Wherever a delta meets a base (usaf apply, generate and chat with --delta, load_delta): the same identity
    check, `check_base`'s cheap facts and the full sha256 of the tensors recorded with one."""
    delta = delta if isinstance(delta, Delta) else read_delta(delta)
    base = BaseCheckpoint(base_dir)
    check_base(delta, base, unchecked_base=unchecked_base)
    verify_checksums(delta, base)


def _write_entries(tensor: torch.Tensor, change: TensorChange, name: str) -> None:
    if change.flat_indices is None:
        tensor.copy_(change.values.reshape(tensor.shape).to(tensor.dtype))
        return
    if not tensor.is_contiguous():
        raise ModelError(f"'{name}' is not contiguous in this model; load it with contiguous weights.")
    flat = tensor.view(-1)
    flat[change.flat_indices.to(flat.device)] = change.values.to(device=flat.device, dtype=flat.dtype)


def _load_into_entries(state, attr: str, change: TensorChange, name: str, path: str) -> None:
    """Make `change` the trained values of a prepared experts tensor (its selection becomes the delta's)."""
    store = state.stores[attr]
    numel = store.shape[0] * store.shape[1] * store.shape[2]
    flat = change.flat_indices if change.flat_indices is not None else torch.arange(numel)
    if flat.numel() and int(flat.max()) >= numel:
        raise ModelError(f"{path} changes entries of '{name}' beyond its shape {list(store.shape)}.")
    values = change.values.reshape(-1)
    old = state[attr] if attr in state else None  # noqa: SIM401 (ModuleDict has no .get)
    if old is not None:
        current = old.expanded_flat_indices().cpu()
        order = torch.argsort(current)
        if current.numel() == flat.numel() and torch.equal(current[order], flat):
            reordered = torch.empty(flat.numel(), dtype=old.values.dtype)
            reordered[order] = values.to(old.values.dtype)
            old.values.data.copy_(reordered.view_as(old.values))
            state.write_resident()
            return
        if store.resident:
            # the old selection was written into the model's own weights: put the base back there first
            old.values.data.copy_(old.base_values.to(old.values.dtype).view_as(old.values))
            old.write_into(store.full(), None)
    entries = ElementEntries(
        store.shape,
        flat.to(store.device),
        store.read(flat.to(store.device)),
        keep_base=keeps_base(True, store.resident),
    )
    entries.values.data.copy_(values.to(entries.values.dtype).view_as(entries.values))
    entries.values.requires_grad_(old.values.requires_grad if old is not None else False)
    state[attr] = entries.to(store.device)
    state.write_resident()
