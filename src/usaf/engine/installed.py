"""The engine's state on a prepared model: every module prepare_model installed sparse entries on."""

from __future__ import annotations

from torch import nn

from usaf.engine.state import SparseState, owned_state


def sparse_modules(model: nn.Module):
    """(module path, state) for every prepared module: the expert stacks (`SparseExperts` on experts modules), then
    the other targeted weights (`SparseWeight`), in model order within each kind."""
    yield from sparse_experts(model)
    yield from _owned(model, expert_stacks=False)


def sparse_experts(model: nn.Module):
    """(experts module path, SparseExperts) for every prepared experts module."""
    yield from _owned(model, expert_stacks=True)


def sparse_weights(model: nn.Module):
    """(module path, SparseWeight) for every other prepared weight (attention, embeddings, norms, ...)."""
    yield from _owned(model, expert_stacks=False)


def row_observers(model: nn.Module) -> dict[str, SparseState]:
    """{module path: state} of the states that rank their rows (`SparseState.observes_rows`)."""
    return {path: state for path, state in sparse_modules(model) if state.observes_rows}


def _owned(model: nn.Module, expert_stacks: bool):
    for path, module in model.named_modules():
        state = owned_state(module)
        if state is not None and state.is_expert_stack == expert_stacks:
            yield path, state
