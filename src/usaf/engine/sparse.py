"""Sparse trainable state of one expert tensor: which entries are trained, their values, and their gradients.

Two granularities share one interface:
- `ElementEntries`: arbitrary entries, as sorted flat indices into the [E, A, B] tensor.
- `LineEntries`: whole lines of expert matrices (a row W[e, a, :] or a column W[e, :, b]); an expert neuron is a
  row of gate and up and a column of down (or the transpose, for transposed layouts).

Gradients are sampled products of the two activations that meet in a weight (U indexed by A, V indexed by B):
dL/dW[e, a, b] = sum_t U[t, a] * V[t, b] over the tokens routed to e. They are computed only at the trained
entries (a sampled dense-dense product, or a small matmul for whole lines) and never as a dense expert matrix.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from usaf import kernels
from usaf.engine.costs import VALUE_DTYPE, index_dtype
from usaf.kernels import Segments
from usaf.kernels.host import read_int

# torch's sampled dense-dense product needs a CSR pattern; building one warns on every call.
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")


class _Entries(nn.Module):
    """Common parts: the values parameter, the base values where they are kept, per-expert grouping of entries.

    `base_values` (the original weights at the entries) are kept only where nothing else can give them back: a
    resident store is overwritten with the trained values, so reverting an entry there needs them. A quantized
    (streamed) store is never written into, and a dropped entry reads as its dequantized base again; entries on
    such a store keep no base (`base_values` is None), which saves 2 bytes an entry."""

    shape: tuple[int, int, int]

    def __init__(self, shape, initial: torch.Tensor, keep_base: bool = True):
        super().__init__()
        self.shape = tuple(int(s) for s in shape)
        self.base_values: torch.Tensor | None
        if keep_base:
            self.register_buffer("base_values", initial.detach().clone())
        else:
            self.base_values = None
        self.values = nn.Parameter(initial.detach().to(VALUE_DTYPE).clone())
        self._grouping: tuple | None = None

    @property
    def num_experts(self) -> int:
        return self.shape[0]

    @property
    def keeps_base(self) -> bool:
        return self.base_values is not None

    def numel(self) -> int:
        return self.values.numel()

    def _set_indices(self, selection: torch.Tensor) -> None:
        setattr(self, self.selection_name, selection.to(device=self.values.device, dtype=torch.int64))

    @property
    def stored_selection(self) -> torch.Tensor:
        """The tensor that holds the selection: replaced, never edited in place, when the selection changes (what
        a cache of per-selection facts compares)."""
        return getattr(self, self.selection_name)

    def set_selection(
        self, selection: torch.Tensor, base_values: torch.Tensor | None, values: torch.Tensor | None = None
    ):
        """Train a different set of entries: new indices (flat indices or line ids), their base values (kept where
        this object keeps them), and their trained values (default: the base values).

        The `values` parameter stays the same object (its data is swapped), so optimizers keep referring to it;
        their per-entry state must be remapped by the caller (see `usaf.selection.reselect`)."""
        device = self.values.device
        self._set_indices(selection)
        if self.keeps_base:
            self.base_values = base_values.to(device=device, dtype=self.base_values.dtype)
        start = base_values if values is None else values
        self.values.data = start.detach().to(device=device, dtype=VALUE_DTYPE).clone()
        self.values.grad = None
        self._grouping = None

    def saved_tensors(self) -> dict[str, torch.Tensor]:
        """What a checkpoint holds besides the values: the selection (and the base where it is kept)."""
        tensors = {self.selection_name: getattr(self, self.selection_name)}
        if self.keeps_base:
            tensors["base_values"] = self.base_values
        return tensors


class ElementEntries(_Entries):
    """Arbitrary entries of an [E, A, B] tensor.

    Held as one int32 index per entry within its expert (sorted, experts in order) and E + 1 offsets, not as an
    int64 flat index with cached rows and columns: 4 bytes an entry instead of 16. Rows, columns and flat indices
    are derived per use, one expert (or one tensor) at a time. Outside, `flat_indices` is the int64 flat index,
    as checkpoints and deltas store it."""

    selection_name = "flat_indices"

    def __init__(self, shape, flat_indices: torch.Tensor, base_values: torch.Tensor, keep_base: bool = True):
        super().__init__(shape, base_values, keep_base)
        _, rows_a, cols_b = self.shape
        self.per_expert = rows_a * cols_b
        self.index_dtype = index_dtype(self.per_expert)
        self.register_buffer("local_indices", torch.zeros(0, dtype=self.index_dtype), persistent=False)
        self.register_buffer("expert_offsets", torch.zeros(0, dtype=torch.int64), persistent=False)
        self._set_indices(flat_indices)

    def _set_indices(self, flat: torch.Tensor) -> None:
        flat = flat.to(device=self.values.device, dtype=torch.int64)
        if flat.numel() > 1 and not read_int((flat[1:] > flat[:-1]).all(), 1):  # once per selection
            raise ValueError("ElementEntries needs sorted, unique flat indices.")
        expert = torch.div(flat, self.per_expert, rounding_mode="floor")
        _, offsets = kernels.offsets_of(expert, self.num_experts)
        self.local_indices = (flat - expert * self.per_expert).to(self.index_dtype)
        self.expert_offsets = offsets
        self._grouping = None

    @property
    def stored_selection(self) -> torch.Tensor:
        return self.local_indices

    @property
    def flat_indices(self) -> torch.Tensor:
        """int64 flat indices into [E, A, B] (computed: a transient of one tensor's entries)."""
        segments = self.segments()
        if "experts" not in segments.cache:  # [E]: per selection, not per call
            segments.cache["experts"] = torch.arange(self.num_experts, device=self.local_indices.device)
        return self.flat_indices_at(segments.cache["experts"])

    def flat_indices_at(self, slots: torch.Tensor) -> torch.Tensor:
        """int64 flat indices of the entries in a stack [n, A, B] that holds expert e at slot `slots[e]`."""
        segments = self.segments()
        if "counts" not in segments.cache:
            segments.cache["counts"] = self.expert_offsets[1:] - self.expert_offsets[:-1]
        at = torch.repeat_interleave(slots, segments.cache["counts"], output_size=self.local_indices.numel())
        return torch.add(self.local_indices, at, alpha=self.per_expert)

    def segments(self) -> Segments:
        """The entries grouped by expert: offsets on the device, counts on the host (read once per selection and
        cached until it changes)."""
        key = (self.expert_offsets.data_ptr(), self.local_indices.numel())
        if self._grouping is None or self._grouping[0] != key:
            self._grouping = (key, Segments.from_offsets(self.expert_offsets, key[1]))
        return self._grouping[1]

    def expanded_flat_indices(self) -> torch.Tensor:
        return self.flat_indices

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "flat_indices"] = self.flat_indices

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        key = prefix + "flat_indices"
        if key in state_dict:
            self._set_indices(state_dict[key])
        elif strict:
            missing.append(key)
        rest = {k: v for k, v in state_dict.items() if k != key}
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing, unexpected, errors)

    @torch.no_grad()
    def write_into(self, weight: torch.Tensor, slots: torch.Tensor | None) -> None:
        """Write the trained values into `weight`: the whole [E, A, B] stack (slots None), or a chunk [n, A, B]
        that holds expert e at slot `slots[e]` (see `usaf.engine.experts.Chunking`): one scatter."""
        if self.values.numel() == 0:
            return
        values = kernels.cast(self.values, weight.dtype)  # no_grad: no detach needed (an op a call)
        if slots is None and self.num_experts == 1:  # one matrix: the stored indices are the flat ones
            weight.view(-1).index_put_((self.local_indices,), values)  # takes int32: no index op
            return
        flat = self.flat_indices if slots is None else self.flat_indices_at(slots)
        _flat_view(weight).index_copy_(0, flat, values)  # index_copy_ beats index_put_ on CPU

    def add_grad(
        self, grad: torch.Tensor | None, U: torch.Tensor, V: torch.Tensor, rows: Segments, first: int
    ) -> torch.Tensor | None:
        """grad[k] += sum_t U[t, a_k] * V[t, b_k] over the rows of entry k's expert, for the entries of experts
        first .. first + n - 1 whose rows U and V hold (grouped by `rows`, n segments): one kernel call. `grad`
        None starts a gradient (see `accumulate`); returns it."""
        entries, last = self.segments(), first + rows.num_segments - 1
        k0, k1 = entries.start(first), entries.start(last + 1)
        if k0 == k1:
            return grad
        local = self.local_indices
        if (k0, k1) != (0, local.numel()):  # a slice is an op: none for all the entries
            local = local[k0:k1]
        part = kernels.sampled_dots(U, V, rows, local, entries.span(first, last), self.shape[2])
        return accumulate(grad, part, k0, self.values)


def _flat_view(weight: torch.Tensor) -> torch.Tensor:
    """weight as one flat vector: the flat tensor it is a whole view of where there is one (a dequantized chunk
    is made flat, then viewed as [k, A, B]), which saves the view op, else a view."""
    base = weight._base
    if (
        base is not None
        and base.dim() == 1
        and base.numel() == weight.numel()
        and weight.is_contiguous()
        and weight.storage_offset() == base.storage_offset()
    ):
        return base
    return weight.view(-1)


def accumulate(grad: torch.Tensor | None, part: torch.Tensor, k0: int, values: torch.Tensor) -> torch.Tensor:
    """`grad` with `part` added at entries k0.. (None: a new gradient, `part` itself when it covers every entry,
    which saves a zero fill and a copy per call)."""
    if grad is None:
        if k0 == 0 and part.shape[0] == values.shape[0]:
            return part
        grad = torch.zeros_like(values)
    grad[k0 : k0 + part.shape[0]] += part
    return grad


class LineEntries(_Entries):
    """Whole lines: axis 1 trains rows W[e, a, :] (line index a), axis 2 trains columns W[e, :, b]."""

    selection_name = "line_ids"

    def __init__(self, shape, axis: int, line_ids: torch.Tensor, base_values: torch.Tensor):
        if axis not in (1, 2):
            raise ValueError("LineEntries axis must be 1 (rows) or 2 (columns).")
        line_ids = line_ids.to(torch.int64)
        if line_ids.numel() > 1 and not bool((line_ids[1:] > line_ids[:-1]).all()):
            raise ValueError("LineEntries needs sorted, unique line ids.")
        super().__init__(shape, base_values)
        self.axis = axis
        self.register_buffer("line_ids", line_ids)  # expert * lines_per_expert + line

    @property
    def lines_per_expert(self) -> int:
        return self.shape[self.axis]

    def grouping(self) -> tuple[Segments, torch.Tensor, torch.Tensor]:
        """(the lines grouped by expert, each line's expert, its index within its expert), cached per selection."""
        key = (self.line_ids.data_ptr(), self.line_ids.numel())
        if self._grouping is None or self._grouping[0] != key:
            self._grouping = (key, *_line_grouping(self.line_ids, self.shape, self.axis))
        return self._grouping[1:]

    def expanded_flat_indices(self) -> torch.Tensor:
        """Flat indices of every trained entry, in the order of `values.view(-1)`."""
        return line_flat_indices(self.shape, self.axis, self.line_ids)

    @torch.no_grad()
    def write_into(self, weight: torch.Tensor, slots: torch.Tensor | None) -> None:
        """Write the trained lines into `weight` (see `ElementEntries.write_into`)."""
        if self.values.numel() == 0:
            return
        _, expert, line = self.grouping()
        slot = expert if slots is None else slots.index_select(0, expert)
        values = kernels.cast(self.values, weight.dtype)
        if self.axis == 1:
            weight[slot, line, :] = values
        else:
            weight[slot, :, line] = values

    def add_grad(
        self, grad: torch.Tensor | None, U: torch.Tensor, V: torch.Tensor, rows: Segments, first: int
    ) -> torch.Tensor | None:
        """Rows: grad[k, :] += U[:, a_k]^T V; columns: grad[k, :] += V[:, b_k]^T U, over the rows of each line's
        expert (see `ElementEntries.add_grad` for the arguments)."""
        segments, _, line = self.grouping()
        return _add_line_grads(grad, self.values, U, V, rows, first, segments, line, self.axis)


def _line_grouping(
    line_ids: torch.Tensor, shape, axis: int, among: range | None = None
) -> tuple[Segments, torch.Tensor, torch.Tensor]:
    """(the lines grouped by expert, each line's expert, its index within its expert); `among`: the only experts
    the lines can lie in (an expert-parallel rank's own)."""
    expert = torch.div(line_ids, shape[axis], rounding_mode="floor")
    return Segments.of(expert, shape[0], among), expert, line_ids - expert * shape[axis]


def _add_line_grads(grad, like, U, V, rows: Segments, first: int, segments: Segments, line, axis: int):
    fixed, spanning = (U, V) if axis == 1 else (V, U)
    last = first + rows.num_segments - 1
    k0, k1 = segments.start(first), segments.start(last + 1)
    if k0 == k1:
        return grad
    part = kernels.line_dots(fixed, spanning, rows, line[k0:k1], segments.span(first, last))
    return accumulate(grad, part, k0, like)


class LineProbe:
    """Gradient magnitudes of candidate lines that are not trained: used to choose what to train next.

    Each backward adds |dL/dW| over the candidate lines to `score` (a sum of per-micro-batch magnitudes);
    nothing is written into the weights and nothing is trained. `owned`: under expert parallelism, the experts
    of this rank, the only ones its lines lie in (None: any).
    """

    def __init__(self, shape, axis: int, line_ids: torch.Tensor, owned: range | None = None):
        self.shape, self.axis = tuple(shape), axis
        self.line_ids = line_ids.to(torch.int64)
        self.segments, _, self.line = _line_grouping(self.line_ids, self.shape, axis, owned)
        length = self.shape[3 - axis]
        self.score = torch.zeros(self.line_ids.numel(), length, device=line_ids.device)

    def accumulate(self, U, V, rows: Segments, first: int) -> None:
        grad = _add_line_grads(None, self.score, U, V, rows, first, self.segments, self.line, self.axis)
        if grad is not None:
            self.score += grad.abs()

    def flat_indices(self) -> torch.Tensor:
        """Flat indices of the candidate entries, in the order of `score.view(-1)`."""
        return line_flat_indices(self.shape, self.axis, self.line_ids)


def line_flat_indices(shape, axis: int, line_ids: torch.Tensor) -> torch.Tensor:
    """Flat indices into [E, A, B] of whole lines (`line_ids` = expert * lines_per_expert + line), line-major."""
    _, rows_a, cols_b = shape
    lines_per_expert = shape[axis]
    expert = torch.div(line_ids, lines_per_expert, rounding_mode="floor")
    line = line_ids - expert * lines_per_expert
    if axis == 1:
        start = (expert * rows_a + line) * cols_b
        return (start[:, None] + torch.arange(cols_b, device=start.device)).reshape(-1)
    start = expert * rows_a * cols_b + line
    return (start[:, None] + torch.arange(rows_a, device=start.device) * cols_b).reshape(-1)
