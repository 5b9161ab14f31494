"""Trained entries in native weights beyond the experts: linear layers, embedding rows, norm vectors.

The same rules as the experts engine (`usaf.engine.experts`): the frozen weight stays the module's own parameter, the
trained values are fp32 at flat indices and are written into it ("replace" semantics), and the weight's gradient
is computed only at the trained entries:
- a linear layer y = x W^T: dL/dW[a, b] = sum_t g[t, a] x[t, b], a sampled product of the output gradient and
  the input (`ElementEntries.add_grad`, the weight seen as one expert [1, A, B]); the input gradient goes through
  the effective weight;
- an embedding y[t] = W[id_t] (times the family's scale): dL/dW[v, h] = sum over the tokens with id v of
  g[t, h], gathered from the output gradient summed per distinct token of the batch (activation-sized);
- a norm's weight is one vector of the hidden size: its gradient is computed by autograd through the family's
  own forward and gathered at the entries (a vector as large as one activation row).

A prepared module keeps its class's behaviour; its class is swapped for a same-named subclass whose forward routes
the weight through these functions, and its state lives in `module.usaf` (a `SparseWeight`, see
`usaf.engine.state.SparseState`). No forward deletes or reassigns a module's parameter by hand: a norm's family
forward sees the effective weight through `torch.func.functional_call` (torch's own reparametrization, which holds
the weight's slot for the call's duration, restores it, and which torch.compile traces).

The forward of each kind of weight (`usaf.model.targets.TargetKind.kind`: "linear", "rows", "vector") is a
plug-in of `FORWARDS` (the protocol `SparseForward`: a `name` and the `forward(module, *args, **kwargs)` the
module's class is given); a target kind whose `kind` has no forward here is refused when it is registered.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from usaf import kernels
from usaf.engine.sparse import ElementEntries
from usaf.engine.state import SparseState, module_state, share_state
from usaf.errors import ConfigError
from usaf.kernels import Segments
from usaf.registry import TARGET_KINDS, Registry
from usaf.store.dense import DenseStore


class SparseWeight(SparseState):
    """usaf's state on one native weight: its trained entries (under the tensor name "weight") and its store,
    the same protocol as `SparseExperts` (`usaf.engine.state.SparseState`)."""

    is_expert_stack, observes_rows = False, True

    def __init__(self, module: nn.Module, target: str, kind: str):
        super().__init__({"weight": DenseStore(module, "weight", one_matrix=True)})
        # first-order importance per row while `observing` (reselection's ranking of candidate rows): for a
        # linear layer sum_t g[t, a]^2 |x_t|^2 (the squared norm of row a's gradient for one token), for
        # embedding rows the squared norm of each row's gradient; [rows], never weight-sized
        self.observing = False
        self.row_score: torch.Tensor | None = None
        self.target, self.kind = target, kind

    @property
    def entries(self) -> ElementEntries | None:
        return self.entries_of("weight")

    def observe_rows(self, rows: torch.Tensor | None, score: torch.Tensor) -> None:
        """Add `score` to the importance of `rows` (None: every row, in order)."""
        if self.row_score is None:
            self.row_score = torch.zeros(self.stores["weight"].shape[1], device=score.device)
        if rows is None:
            self.row_score += score
        else:
            self.row_score.index_add_(0, rows, score)

    def effective_weight(self) -> torch.Tensor:
        """The module's weight with the trained values written in (in place, as the experts' resident stores)."""
        self.write_resident()
        return self.stores["weight"].tensor


def _values(state: SparseWeight):
    """The trained values, or (nothing trained, a probe installed or rows observed) an empty tensor that lets the
    backward run."""
    entries = state.entries
    if entries is not None:
        return entries.values
    if (state.probes or state.observing) and torch.is_grad_enabled():
        return torch.zeros(0, requires_grad=True, device=state.stores["weight"].device)
    return None


def _common(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = a.dtype if a.dtype == b.dtype else torch.promote_types(a.dtype, b.dtype)
    return kernels.cast(a, dtype), kernels.cast(b, dtype)


class _SparseLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, values, state: SparseWeight, module: nn.Linear):
        weight = state.effective_weight()
        ctx.state, ctx.observing = state, state.observing  # the forward's flag: recomputation runs unobserved
        ctx.save_for_backward(x)
        return F.linear(x, weight.to(x.dtype) if x.dtype != weight.dtype else weight, module.bias)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        state = ctx.state
        need_x, need_values = ctx.needs_input_grad[:2]
        store = state.stores["weight"]
        # a sharded (FSDP2) weight is gathered afresh for the backward, without the entries: written again
        weight = state.effective_weight() if store.regathered else store.tensor
        grad_x = None
        if need_x:
            # the output gradient as it comes ([..., out]): matmul folds its leading dimensions, so the input
            # gradient has x's shape without a view
            grad_x = kernels.cast(kernels.cast(grad_out, weight.dtype) @ weight, x.dtype)
        probe = state.probes.get("weight")
        g = grad_out.reshape(-1, grad_out.shape[-1])
        if need_values or probe is not None:
            U, V = _common(g, x.reshape(-1, x.shape[-1]))
            rows = Segments.single(U.shape[0], U.device)  # one matrix: one expert
        grad_values = None
        if need_values and state.entries is None:
            grad_values = grad_out.new_zeros(0)
        elif need_values:
            grad_values = state.entries.add_grad(None, U, V, rows, 0)
            if grad_values is None:  # no entries
                grad_values = torch.zeros_like(state.entries.values)
        if probe is not None:
            probe.accumulate(U, V, rows, 0)
        if ctx.observing:
            flat_x = x.reshape(-1, x.shape[-1]).float()
            state.observe_rows(None, (g.float().pow(2) * flat_x.pow(2).sum(1, keepdim=True)).sum(0))
        return grad_x, grad_values, None, None


def embedding_scale(module: nn.Module):
    """The factor some families multiply looked-up rows by (Gemma's scaled word embeddings), else None."""
    return getattr(module, "embed_scale", None)


class _SparseRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, values, state: SparseWeight, module: nn.Embedding):
        state.effective_weight()
        ctx.state, ctx.module, ctx.observing = state, module, state.observing
        ctx.save_for_backward(ids)
        return family_forward(module)(ids)

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        state = ctx.state
        scale = embedding_scale(ctx.module)
        g = kernels.cast(grad_out.reshape(-1, grad_out.shape[-1]), torch.float32)
        if scale is not None:
            g = g * (scale.float() if torch.is_tensor(scale) else float(scale))
        # the weight's gradient at the rows this batch looked up: [tokens, H] (one slot per distinct id, the rest
        # empty), never [vocab, H]
        num_rows = state.stores["weight"].shape[1]
        rows, inverse = _distinct_rows(ids.reshape(-1), num_rows)
        per_row = g.new_zeros(rows.numel(), g.shape[1]).index_add_(0, inverse, g)
        padding = getattr(ctx.module, "padding_idx", None)
        if padding is not None:  # a mask, not boolean indexing: no host sync
            per_row = per_row.masked_fill((rows == padding).unsqueeze(1), 0)
        grad_values = None
        if ctx.needs_input_grad[1] and state.entries is None:
            grad_values = g.new_zeros(0)
        elif ctx.needs_input_grad[1]:
            entries = state.entries
            _, width = entries.shape[1:]
            flat = entries.flat_indices  # derived per call: once
            row, col = flat // width, flat % width
            where = torch.searchsorted(rows, row).clamp_max(rows.numel() - 1)
            hit = rows[where] == row
            grad_values = torch.where(hit, per_row[where, col], torch.zeros((), device=g.device))
        probe = state.probes.get("weight")
        if probe is not None:  # candidate rows (line ids are row ids, sorted)
            where = torch.searchsorted(probe.line_ids, rows).clamp_max(probe.line_ids.numel() - 1)
            hit = (probe.line_ids[where] == rows).unsqueeze(1)  # rows not among the candidates add zeros
            probe.score.index_add_(
                0, where, torch.where(hit, per_row.abs(), torch.zeros((), device=g.device))
            )
        if ctx.observing:  # the empty slots add zeros (to the last row)
            state.observe_rows(rows.clamp_max(num_rows - 1), per_row.pow(2).sum(1))
        return None, grad_values, None, None


def _distinct_rows(ids: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.unique(ids, return_inverse=True)` with a shape known in advance (no host sync): the distinct ids
    sorted, then `num_rows` (greater than any id, so the result stays sorted) in the slots left over; and each
    id's slot."""
    ordered, order = torch.sort(ids)
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    slot_of_ordered = torch.cumsum(first, 0) - 1
    rows = torch.full_like(ordered, num_rows).scatter_(0, slot_of_ordered, ordered)
    inverse = torch.empty_like(slot_of_ordered).scatter_(0, order, slot_of_ordered)
    return rows, inverse


def _state(module: nn.Module) -> SparseWeight:
    # an output layer tied to the embedding reads the embedding's state (see `usaf.engine.state.share_state`)
    return module_state(module)


def _linear_forward(self, x):
    state = _state(self)
    return _SparseLinear.apply(x, _values(state), state, self)


def _rows_forward(self, ids):
    state = _state(self)
    return _SparseRows.apply(ids, _values(state), state, self)


class _FamilyForward(nn.Module):
    """Runs a prepared module's own (family) forward, without usaf's override and without the module's hooks
    running a second time: what `torch.func.functional_call` calls with the weight replaced."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, args, kwargs):
        return family_forward(self.module)(*args, **kwargs)


def _vector_forward(self, *args, **kwargs):
    """The family's own forward with the weight replaced by base-with-entries, differentiable in the values.

    The family forward sees the effective weight through `torch.func.functional_call`, not by deleting and
    restoring the module's parameter: outside the call (and in the module's hooks) `weight` is its parameter."""
    state: SparseWeight = _state(self)
    entries, probe = state.entries, state.probes.get("weight")
    if (entries is None and probe is None) or not torch.is_grad_enabled():
        state.write_resident()
        return family_forward(self)(*args, **kwargs)
    weight = state.stores["weight"].tensor  # the module's own parameter
    if entries is not None:
        flat = entries.flat_indices
        effective = weight.detach().reshape(-1).index_put((flat,), entries.values.to(weight.dtype))
    else:
        effective = weight.detach().reshape(-1).clone().requires_grad_(True)
    if probe is not None:  # candidates are the one line of the vector

        def accumulate(grad):
            probe.score.add_(grad.abs().view_as(probe.score).float())

        effective.register_hook(accumulate)
    return torch.func.functional_call(
        _FamilyForward(self), {"module.weight": effective.view(weight.shape)}, (args, kwargs)
    )


@runtime_checkable
class SparseForward(Protocol):
    """The forward a prepared module of one kind of weight runs (its class's `forward`, with `self` the module)."""

    name: str
    forward: Callable


@dataclass(frozen=True)
class WeightForward:
    name: str
    forward: Callable


# the forward of each kind of weight (`usaf.model.targets.TargetKind.kind`); a new kind registers here
FORWARDS: Registry[SparseForward] = Registry("sparse forward", SparseForward)
for _forward in (
    WeightForward("linear", _linear_forward),
    WeightForward("rows", _rows_forward),
    WeightForward("vector", _vector_forward),
):
    FORWARDS.register(_forward)


def _has_forward(role) -> None:
    """A target kind's weights are trained by a registered forward (checked when the kind is registered)."""
    if role.kind not in FORWARDS:
        raise ConfigError(
            f"Target kind {role.name!r} has kind {role.kind!r}, which no sparse forward is registered as; known: "
            f"{', '.join(FORWARDS)} (usaf.engine.sparse_weights.FORWARDS)."
        )


TARGET_KINDS.require(_has_forward)
# swapped subclass -> (the family's class, kind); made once per (class, kind), so no attribute marks a class
_SWAPPED: dict[type, tuple[type, str]] = {}
_SUBCLASSES: dict[tuple[type, str], type] = {}


def family_forward(module: nn.Module):
    """The family's own forward of a prepared module, bound to it (what its class did before the swap). The
    swapped class may itself have been subclassed since (FSDP2's `fully_shard` does): the nearest one counts."""
    swapped = next((cls for cls in type(module).__mro__ if cls in _SWAPPED), None)
    family = _SWAPPED[swapped][0] if swapped is not None else type(module)
    return family.forward.__get__(module)


def _swap_class(module: nn.Module, kind: str) -> None:
    """Give `module` the forward of `kind`: its class becomes a subclass of the same name and module (so it keeps its
    family's behaviour, `isinstance` checks and checkpoint naming), created once per (class, kind)."""
    family, current = _SWAPPED.get(type(module), (type(module), None))
    if current == kind:
        return
    key = (family, kind)
    if key not in _SUBCLASSES:
        sub = type(
            family.__name__,
            (family,),
            {
                "forward": FORWARDS[kind].forward,
                "__module__": family.__module__,
                "__qualname__": family.__qualname__,
            },
        )
        _SUBCLASSES[key], _SWAPPED[sub] = sub, (family, kind)
    module.__class__ = _SUBCLASSES[key]


def install(module: nn.Module, target: str, kind: str) -> SparseWeight:
    """Give `module` usaf's state and the forward of its kind (its class swapped for a same-named subclass)."""
    state = SparseWeight(module, target, kind)
    _swap_class(module, kind)
    module.usaf = state
    return state


def tie(head: nn.Linear, state: SparseWeight) -> None:
    """An output layer that shares its weight with the embedding owning `state` uses the same trained values."""
    _swap_class(head, "linear")
    share_state(head, state)
