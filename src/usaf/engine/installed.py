"""The engine's state on a prepared model: every module prepare_model installed sparse entries on."""

from __future__ import annotations

from torch import nn

from usaf.engine.experts import SparseExperts
from usaf.engine.sparse_weights import SparseWeight


def sparse_modules(model: nn.Module):
    """(module path, state) for every prepared module: SparseExperts on experts modules, then SparseWeight on the
    other targeted weights, in model order within each kind."""
    yield from sparse_experts(model)
    for path, module in model.named_modules():
        state = getattr(module, "usaf", None)
        if isinstance(state, SparseWeight):
            yield path, state


def sparse_experts(model: nn.Module):
    """(experts module path, SparseExperts) for every prepared experts module."""
    for path, module in model.named_modules():
        state = getattr(module, "usaf", None)
        if isinstance(state, SparseExperts):
            yield path, state
