"""The Triton implementations of `usaf.kernels` (CUDA and ROCm; the CPU too under TRITON_INTERPRET=1, for tests).

Each primitive is one kernel launch whatever the number of experts E and entries K, reading only the device
`offsets` of its `Segments` (never the host `counts`), so a call never waits for the device. Every product is
accumulated in fp32 and every output is fp32, whatever the inputs' dtype.

Entries (or lines) are sorted by expert, and a program takes a block of consecutive ones that may straddle an
expert boundary: each lane finds its own expert (a binary search over the entry offsets, in the kernel) and so its
own rows; the program walks the union of its lanes' rows in tiles and each lane keeps only its own. A block lies in
one expert unless the expert boundaries fall inside it, so the extra rows walked are at most the rows of the
experts a block straddles.
"""

from __future__ import annotations

import os

import torch

from usaf.errors import ConfigError

try:  # optional: `import usaf.kernels.triton_path` must work without Triton (available() is then False)
    import triton
    import triton.language as tl
except ImportError:
    triton = None
    tl = None

# sampled_dots: entries a program takes, rows a tile (lanes gather single elements: no matrix unit to feed)
ENTRY_BLOCK = 64
ROW_BLOCK = 32
# line_dots: lines x row tile x columns, a matrix product per tile (tl.dot needs every side >= 16)
LINE_BLOCK = 16
LINE_ROW_BLOCK = 32
COLUMN_BLOCK = 64


# Triton reads TRITON_INTERPRET when a kernel is defined (below), so the module's kernels are interpreted or not
# for good from its import on
_TRUE = ("1", "true", "on", "yes")
INTERPRETED = triton is not None and os.environ.get("TRITON_INTERPRET", "0").lower() in _TRUE


def available(device) -> bool:
    """Whether Triton can run on `device`: importable, and a GPU (ROCm's torch says "cuda" too), or any device
    when TRITON_INTERPRET=1 (at this module's import) runs kernels on the CPU."""
    if triton is None:
        return False
    device = torch.device(device)
    return device.type == "cuda" or (INTERPRETED and device.type == "cpu")


def require() -> None:
    if triton is None:
        raise ConfigError(
            "train.kernels=triton needs Triton, which is not importable: install it (pip install triton; CUDA "
            "and ROCm builds of PyTorch usually bring it) or set train.kernels=auto or torch."
        )


if triton is not None:

    @triton.jit
    def _segment_of(index, offsets_ptr, num_segments, STEPS: tl.constexpr):
        """Each lane's segment e with offsets[e] <= index < offsets[e + 1]: the last e with offsets[e] <= index
        (so an empty segment, whose offsets equal the next one's, is never chosen). STEPS >= log2(E)."""
        low = tl.zeros_like(index)
        high = low + num_segments
        for _ in tl.static_range(STEPS):
            middle = (low + high) // 2
            below = tl.load(offsets_ptr + middle) <= index
            low = tl.where(below, middle, low)
            high = tl.where(below, high, middle)
        return low

    @triton.jit
    def _lane_rows(index, live, entry_offsets, row_offsets, E, STEPS: tl.constexpr):
        """Each lane's rows first..last (its entry's expert's; none past the end) and the span the block walks."""
        expert = _segment_of(tl.where(live, index, 0), entry_offsets, E, STEPS)
        last = tl.load(row_offsets + expert + 1)
        first = tl.where(live, tl.load(row_offsets + expert), last)  # lanes past the end walk no rows
        start = tl.min(tl.where(live, first, 1 << 62))
        stop = tl.max(tl.where(live, last, 0))
        return first, last, start, stop

    @triton.jit
    def _sampled_dots_kernel(
        U,
        V,
        row_offsets,
        local,
        entry_offsets,
        out,
        K,
        E,
        width,
        stride_ut,
        stride_ua,
        stride_vt,
        stride_vb,
        STEPS: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_T: tl.constexpr,
    ):
        k = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
        live = k < K
        first, last, start, stop = _lane_rows(k, live, entry_offsets, row_offsets, E, STEPS)
        entry = tl.load(local + k, mask=live, other=0)
        a = entry // width
        b = entry - a * width
        u_columns = U + a * stride_ua
        v_columns = V + b * stride_vb
        acc = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
        for t0 in range(start, stop, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
            mine = (t[:, None] >= first[None, :]) & (t[:, None] < last[None, :])
            u = tl.load(u_columns[None, :] + t[:, None] * stride_ut, mask=mine, other=0.0)
            v = tl.load(v_columns[None, :] + t[:, None] * stride_vt, mask=mine, other=0.0)
            acc += u.to(tl.float32) * v.to(tl.float32)
        tl.store(out + k, tl.sum(acc, axis=0), mask=live)

    @triton.jit
    def _line_dots_kernel(
        fixed,
        spanning,
        row_offsets,
        lines,
        entry_offsets,
        out,
        L,
        E,
        W,
        stride_ft,
        stride_fa,
        stride_st,
        stride_sw,
        STEPS: tl.constexpr,
        AS_FP32: tl.constexpr,
        BLOCK_L: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_W: tl.constexpr,
    ):
        ell = tl.program_id(0).to(tl.int64) * BLOCK_L + tl.arange(0, BLOCK_L)
        w = tl.program_id(1).to(tl.int64) * BLOCK_W + tl.arange(0, BLOCK_W)
        live = ell < L
        first, last, start, stop = _lane_rows(ell, live, entry_offsets, row_offsets, E, STEPS)
        column = tl.load(lines + ell, mask=live, other=0)
        fixed_columns = fixed + column * stride_fa
        w_live = w < W
        acc = tl.zeros((BLOCK_L, BLOCK_W), dtype=tl.float32)
        for t0 in range(start, stop, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
            # [L, T]: zero where the row is not the line's expert's, so the product keeps only its own rows (an
            # inf in another expert's spanning rows of the same block still turns this line's sum into NaN)
            mine = (t[None, :] >= first[:, None]) & (t[None, :] < last[:, None])
            f = tl.load(fixed_columns[:, None] + t[None, :] * stride_ft, mask=mine, other=0.0)
            s_mask = (t[:, None] < stop) & w_live[None, :]
            s = tl.load(spanning + t[:, None] * stride_st + w[None, :] * stride_sw, mask=s_mask, other=0.0)
            if AS_FP32:
                # "ieee": fp32 inputs must not be rounded to tf32 on the way into the matrix unit
                acc = tl.dot(f.to(tl.float32), s.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(f, s, acc)  # fp16 / bf16 products are exact in the fp32 accumulator
        tl.store(out + ell[:, None] * W + w[None, :], acc, mask=live[:, None] & w_live[None, :])


def _steps(num_segments: int) -> int:
    return max(1, num_segments.bit_length())


def _index(values: torch.Tensor, device) -> torch.Tensor:
    return values.to(device=device, dtype=torch.int64).contiguous()


def _segment_operands(a, b, rows, picked, entries) -> tuple:
    """What both kernels take first: the two row-grouped operands, the rows' and the entries' segment offsets
    around the picked entries (or lines) as int64 on the operands' device."""
    device = a.device
    return a, b, _index(rows.offsets, device), _index(picked, device), _index(entries.offsets, device)


def _strides(a, b) -> tuple[int, int, int, int]:
    return a.stride(0), a.stride(1), b.stride(0), b.stride(1)


def sampled_dots(U, V, rows, local, entries, width):
    """See `usaf.kernels.sampled_dots`."""
    require()
    K = local.shape[0]
    if K == 0 or U.shape[0] == 0:
        return torch.zeros(K, dtype=torch.float32, device=U.device)
    out = torch.empty(K, dtype=torch.float32, device=U.device)  # the kernel writes every entry
    E = entries.offsets.shape[0] - 1
    grid = (triton.cdiv(K, ENTRY_BLOCK),)
    _sampled_dots_kernel[grid](
        *_segment_operands(U, V, rows, local, entries),
        out,
        K,
        E,
        width,
        *_strides(U, V),
        STEPS=_steps(E),
        BLOCK_K=ENTRY_BLOCK,
        BLOCK_T=ROW_BLOCK,
    )
    return out


def line_dots(fixed, spanning, rows, lines, entries):
    """See `usaf.kernels.line_dots`."""
    require()
    L, W = lines.shape[0], spanning.shape[1]
    if L == 0 or W == 0 or fixed.shape[0] == 0:
        return torch.zeros(L, W, dtype=torch.float32, device=fixed.device)
    out = torch.empty(L, W, dtype=torch.float32, device=fixed.device)  # the kernel writes every element
    E = entries.offsets.shape[0] - 1
    # the matrix unit takes fp16 x fp16 or bf16 x bf16 as they are; anything else goes in as fp32, and so does
    # bf16 on the CPU: Triton 3.9's interpreter multiplies bf16's raw bits in tl.dot
    halves = (torch.float16,) if fixed.device.type == "cpu" else (torch.float16, torch.bfloat16)
    as_fp32 = not (fixed.dtype == spanning.dtype and fixed.dtype in halves)
    grid = (triton.cdiv(L, LINE_BLOCK), triton.cdiv(W, COLUMN_BLOCK))
    _line_dots_kernel[grid](
        *_segment_operands(fixed, spanning, rows, lines, entries),
        out,
        L,
        E,
        W,
        *_strides(fixed, spanning),
        STEPS=_steps(E),
        AS_FP32=as_fp32,
        BLOCK_L=LINE_BLOCK,
        BLOCK_T=LINE_ROW_BLOCK,
        BLOCK_W=COLUMN_BLOCK,
    )
    return out
