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
from usaf.errors import ModelError


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
        raise ModelError(
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


class BaseReference(nn.Module):
    """The base of a prepared `policy` as a model of its own, for a trainer that wants a reference model (TRL's
    `DPOTrainer(ref_model=...)`): every call runs inside `base_weights(policy)`, so no copy of the weights exists.

    The context is entered in `__call__`, not `forward`, because trainers patch `forward` on the instance (TRL's
    fused LM head reads the backbone and `lm_head.weight` itself); whatever forward runs, it runs on the base. The
    policy is not a submodule: moving, `eval()` or preparing the reference must not touch the trained model, and
    the reference has no parameters of its own for an optimizer or a checkpoint to find."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.__dict__["policy"] = policy  # not registered (see the class)

    def __call__(self, *args, **kwargs):
        with torch.no_grad(), base_weights(self.policy):
            return super().__call__(*args, **kwargs)

    def forward(self, *args, **kwargs):
        return self.policy(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["policy"], name)  # config, backbone, output embeddings, dtype, ...
