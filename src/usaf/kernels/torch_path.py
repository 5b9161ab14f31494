"""The pure-PyTorch implementations of `usaf.kernels` (CPU, MPS, ROCm or CUDA without Triton).

A fixed number of ops per call, whatever the number of experts, entries or rows: the rows of every expert are laid
out padded to the longest expert's count ("slots"), so that one batched product serves all experts at once. The
sampled product is one `torch.sparse.sampled_addmm` over a block-diagonal pattern: rows (e, a) of an [E * A, T]
matrix against columns (e, b) of a [T, E * B] one, so no entry ever meets another expert's rows. Padding costs
memory (E x the longest expert x the width): experts are taken in groups whose padded copy stays within a bound
(one group in a balanced batch), which is the only loop, on host integers already known.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# a group of experts' padded rows holds at most PADDING_FACTOR x the real rows, or MIN_PADDED_ROWS if more (see
# `_groups`): routing as uneven as a random model's (the longest expert up to ~10x the mean at 128 experts) still
# fits one group, so the ops do not grow with the number of experts; more uneven routing splits into groups
PADDING_FACTOR = 16
MIN_PADDED_ROWS = 1024


def cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` in `dtype`, without an op when it already is (each op is a launch's worth of host time)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def offsets_of(ids: torch.Tensor, num_segments: int, dtype=torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts [n], offsets [n + 1]) of the segments that `ids` (each item's segment, ascending) group items into."""
    # not bincount: its output size depends on the largest id, which a GPU reads back to the host (a sync)
    counts = torch.zeros(num_segments, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, ids.long(), torch.ones_like(ids, dtype=torch.int64))
    return counts, F.pad(torch.cumsum(counts, 0, dtype=dtype), (1, 0))


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    # sampled_addmm has no half-precision CPU kernel, and sums of products want fp32 anyway
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _groups(counts: list[int]):
    """(first, last) expert of consecutive groups whose padded size (experts x the group's longest) stays bounded."""
    budget = max(MIN_PADDED_ROWS, PADDING_FACTOR * sum(counts))
    first, longest = 0, 0
    for e, c in enumerate(counts):
        grown = max(longest, c)
        if e > first and (e + 1 - first) * grown > budget:
            yield first, e - 1
            first, grown = e, c
        longest = grown
    if counts:
        yield first, len(counts) - 1


def _slots(rows, num_rows: int):
    """(expert of each row, position of each row within its expert), for rows grouped by `rows` (Segments): kept
    in its cache, so a layer's projections, which share the routing, make them once."""
    key = ("slots", num_rows)
    if key not in rows.cache:
        offsets = rows.offsets
        counts = offsets[1:] - offsets[:-1]
        expert = torch.repeat_interleave(
            torch.arange(counts.numel(), device=offsets.device), counts, output_size=num_rows
        )
        rows.cache[key] = expert, torch.arange(num_rows, device=offsets.device) - offsets[expert]
    return rows.cache[key]


def _entry_experts(entries_offsets: torch.Tensor, num_entries: int) -> torch.Tensor:
    counts = entries_offsets[1:] - entries_offsets[:-1]
    return torch.repeat_interleave(
        torch.arange(counts.numel(), device=counts.device), counts, output_size=num_entries
    )


def _by_groups(rows, entries, out_shape, device, group_fn) -> torch.Tensor:
    """fp32 [K, ...]: `group_fn(row range, rows, entry range, entries)` for each group of experts (see `_groups`),
    the whole at once (ranges None) where one group holds them all (no copy into an output)."""
    groups = list(_groups(rows.counts))
    if len(groups) == 1:
        return group_fn(None, rows, None, entries)
    out = torch.zeros(out_shape, dtype=torch.float32, device=device)
    for first, last in groups:
        r0, r1 = rows.start(first), rows.start(last + 1)
        k0, k1 = entries.start(first), entries.start(last + 1)
        if r0 < r1 and k0 < k1:
            out[k0:k1] = group_fn(
                slice(r0, r1), rows.span(first, last), slice(k0, k1), entries.span(first, last)
            )
    return out


def _part(t: torch.Tensor, where: slice | None) -> torch.Tensor:
    return t if where is None else t[where]  # None: all of it (a slice is an op)


def _padded_columns(x: torch.Tensor, expert, slot, n: int, longest: int, dtype) -> torch.Tensor:
    """[n, width, longest]: expert e's rows of x [R, width] as the columns of its own [width, longest] block,
    zero past its count."""
    padded = x.new_zeros(n, x.shape[1], longest, dtype=dtype)
    padded[expert, :, slot] = cast(x, dtype)
    return padded


def sampled_dots(U, V, rows, local, entries, width):
    num_entries = local.numel()
    if num_entries == 0 or rows.total == 0:
        return torch.zeros(num_entries, dtype=torch.float32, device=U.device)
    dtype = _compute_dtype(U)
    return _by_groups(
        rows,
        entries,
        (num_entries,),
        U.device,
        lambda r, group_rows, k, group_entries: _sampled_group(
            _part(U, r), _part(V, r), group_rows, _part(local, k), group_entries, width, dtype
        ),
    )


def _sampled_group(U, V, rows, local, entries, width: int, dtype) -> torch.Tensor:
    # both operands as [lines, rows] row-major (the second passed transposed): the layout the CPU kernel takes a dot
    # product of without copying either (4x faster than a row-major second operand)
    n, a_dim = rows.num_segments, U.shape[1]
    if n == 1:  # one expert (a native weight): no padding
        # one op each: the cast and the transposed copy together
        m1 = U.t().to(dtype, memory_format=torch.contiguous_format)
        m2t = _transposed_copy(V, dtype)
    else:
        longest = max(rows.counts)
        expert, slot = _slots(rows, U.shape[0])
        m1 = _padded_columns(U, expert, slot, n, longest, dtype)
        m2t = _padded_columns(V, expert, slot, n, longest, dtype)
        m1, m2t = m1.view(n * a_dim, longest), m2t.view(n * width, longest)
    crow, columns = _block_diagonal_pattern(local, entries, a_dim, width)
    # the unchecked constructor, one op: the public `torch.sparse_csr_tensor` adds three (no-op) conversions of its
    # arguments, and the pattern is valid by construction
    pattern = torch.ops.aten._sparse_compressed_tensor_unsafe(
        crow,
        columns,
        # zeros, not empty: beta=0 still multiplies them (0 x a NaN of garbage is NaN)
        torch.zeros(local.numel(), dtype=dtype, device=local.device),
        [n * a_dim, n * width],
        layout=torch.sparse_csr,
    )
    return cast(torch.sparse.sampled_addmm(pattern, m1, m2t.t(), beta=0.0).values(), torch.float32)


_last_transposed: list = []  # [(source, dtype, version), its copy]: see `_transposed_copy`


def _transposed_copy(t: torch.Tensor, dtype) -> torch.Tensor:
    """t.t() as a contiguous `dtype` copy; the last one is kept for the next call on the same data, as the
    attention's q, k and v projections' backwards in a row are (one input, three weights). The source is held with
    it, so its memory cannot be another tensor's while the copy is kept; its version counter tells an in-place
    change."""
    if _last_transposed:
        (source, kept_dtype, version), copy = _last_transposed
        if (
            kept_dtype == dtype
            and source._version == version
            and source.device == t.device
            and source.data_ptr() == t.data_ptr()
            and source.shape == t.shape
            and source.stride() == t.stride()
        ):
            return copy
    copy = t.t().to(dtype, memory_format=torch.contiguous_format)
    _last_transposed[:] = [(t, dtype, t._version), copy]
    return copy


def _block_diagonal_pattern(local, entries, a_dim: int, width: int):
    """CSR (row pointers, columns) of entry (e, a, b) at row e * A + a, column e * B + b. It depends only on the
    selection: kept in the entries' `cache` (a whole selection's grouping lives as long as its selection), so a
    step derives it once per selection rather than once per call."""
    key = ("block_diagonal", a_dim, width)
    if key in entries.cache:
        return entries.cache[key]
    n = entries.num_segments
    index_dtype = torch.int32 if max(n * a_dim + 1, n * width, local.numel()) < 2**31 else torch.int64
    local = local.long()
    a = torch.div(local, width, rounding_mode="floor")
    expert_of = _entry_experts(entries.offsets, local.numel())
    columns = (local - a * width + expert_of * width).to(index_dtype)
    lines = a.add_(expert_of * a_dim)
    _, crow = offsets_of(lines, n * a_dim, index_dtype)
    entries.cache[key] = crow, columns
    return crow, columns


def line_dots(fixed, spanning, rows, lines, entries):
    num_lines, width = lines.numel(), spanning.shape[1]
    if num_lines == 0 or rows.total == 0:
        return torch.zeros(num_lines, width, dtype=torch.float32, device=fixed.device)
    dtype = _compute_dtype(fixed)
    return _by_groups(
        rows,
        entries,
        (num_lines, width),
        fixed.device,
        lambda r, group_rows, k, group_entries: _line_group(
            _part(fixed, r), _part(spanning, r), group_rows, _part(lines, k), group_entries, dtype
        ),
    )


def _line_group(fixed, spanning, rows, lines, entries, dtype) -> torch.Tensor:
    """Each line's column of `fixed` over its expert's rows, times that expert's rows of `spanning`: one gather
    and one grouped product."""
    n, a_dim, longest = rows.num_segments, fixed.shape[1], max(rows.counts)
    expert, slot = _slots(rows, fixed.shape[0])
    columns = _padded_columns(fixed, expert, slot, n, longest, dtype)
    spans = spanning.new_zeros(n, longest, spanning.shape[1], dtype=dtype)
    spans[expert, slot] = cast(spanning, dtype)
    expert_of = _entry_experts(entries.offsets, lines.numel())
    picked = columns.view(n * a_dim, longest).index_select(0, expert_of * a_dim + lines)  # [L, longest]
    return cast(grouped_matmul(picked, spans, entries), torch.float32)


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, rows) -> torch.Tensor:
    """[R, K] rows grouped by `rows` (n segments) @ weight [n, K, N] -> [R, N]: torch's grouped_mm where it runs
    (aligned strides, a supported dtype and device), else one batched product over padded rows."""
    if x.shape[0] == 0:
        return x.new_zeros(0, weight.shape[2])
    if hasattr(F, "grouped_mm"):
        try:
            ends = rows.cache.get("int32 ends")
            if ends is None:
                ends = rows.cache["int32 ends"] = rows.offsets[1:].to(torch.int32)
            return F.grouped_mm(x, weight, offs=ends)
        except (RuntimeError, NotImplementedError):
            pass  # unaligned strides, old GPU or unsupported dtype: the padded batched product below
    groups = list(_groups(rows.counts))
    if len(groups) == 1:
        return _padded_matmul(x, weight, rows)
    out = x.new_empty(x.shape[0], weight.shape[2])
    for first, last in groups:
        r0, r1 = rows.start(first), rows.start(last + 1)
        if r0 < r1:
            out[r0:r1] = _padded_matmul(x[r0:r1], weight[first : last + 1], rows.span(first, last))
    return out


def _padded_matmul(x, weight, rows):
    expert, slot = _slots(rows, x.shape[0])
    padded = x.new_zeros(rows.num_segments, max(rows.counts), x.shape[1])
    padded[expert, slot] = x
    return torch.bmm(padded, weight)[expert, slot]
