"""`base_weights(model)`: the prepared model as it was before training, for as long as a `with` block lasts.

The trained entries are the only thing a sparse fine-tune changes, so the base is the same weights with each
entry's starting value put back: no second copy of the model (PEFT's `disable_adapter` plays this part for
adapters, and TRL's DPO uses it as the reference model when none is given). The trained values are stashed
(4 bytes an entry) and put back bit for bit when the block ends, whatever happens inside it.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from usaf.engine.installed import sparse_modules
from usaf.engine.state import model_state
from usaf.errors import UsafError


def starting_values(model: nn.Module, path: str, state, name: str) -> torch.Tensor:
    """What the entries of `path`.`name` held before training (as `prepare_model` started them, in the store's
    dtype): the full-precision originals a quantized base recorded, else the base values the entries keep, else
    the frozen store at their places."""
    entries, store = state[name], state.stores[name]
    whole = model_state(model)
    original = whole.original_values if whole is not None else None
    if original is not None:
        start = original(f"{path}.{name}", entries.expanded_flat_indices())
    elif entries.keeps_base:
        start = entries.base_values
    else:
        start = store.read(entries.expanded_flat_indices())
    return start.to(store.dtype).reshape(entries.values.shape)


def _trained_dense_parameters(model: nn.Module) -> list[str]:
    """Parameters trained outside the sparse entries (routers): their starting values are not kept."""
    return [n for n, p in model.named_parameters() if p.requires_grad and ".usaf." not in f".{n}"]


@contextlib.contextmanager
def base_weights(model: nn.Module):
    """Inside the block, `model` computes with its starting weights (every trained entry at its base value);
    after it, with its trained values again, exactly."""
    dense = _trained_dense_parameters(model)
    if dense:
        raise UsafError(
            f"{dense[0]} is trained as a whole (routers in targets), and its base values are not kept on the "
            "model: switching to the base needs the base model itself."
        )
    stashed = []
    with torch.no_grad():
        for path, state in sparse_modules(model):
            for name, entries in state.items():
                start = starting_values(model, path, state, name)
                stashed.append((state, entries, entries.values.detach().clone()))
                entries.values.copy_(start.to(device=entries.values.device, dtype=entries.values.dtype))
        _written(stashed)
    try:
        yield model
    finally:
        with torch.no_grad():
            for _, entries, trained in stashed:
                entries.values.copy_(trained)
            _written(stashed)


def _written(stashed) -> None:
    """Resident stores hold the values written in: write them now, not only at the next forward."""
    for state in {id(s): s for s, _, _ in stashed}.values():
        state.write_resident()
