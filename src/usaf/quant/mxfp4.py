"""MXFP4 as gpt-oss publishes its experts: e2m1 codes, two a byte (the even value in the low nibble), and one 8-bit
exponent scale 2**(scale - 127) per 32 values along a matrix's input dimension.

A published format: the store holds the checkpoint's own `*_blocks` / `*_scales` bytes, so usaf never quantizes
into it. The published tensors are output-major ([E, out, in/32, 16]) while the parameter is [E, in, out]: for a
parameter matrix [rows, cols], blocks are [cols, rows/32, 16] and scales [cols, rows/32].
"""

from __future__ import annotations

import functools

import torch

from usaf.errors import ConfigError
from usaf.quant.descriptor import Descriptor

BLOCK_SIZE = 32
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# fp32 values (4 B), int32 codes (2 B a value) and the gathered half (2 B) before the cast to the output dtype
DESCRIPTOR = Descriptor(
    "mxfp4",
    "MXFP4 as published, one 8-bit exponent scale per 32 weights",
    4.25,
    8,
    published=True,
    constants={"block_size": BLOCK_SIZE},
)


def layout(rows: int, cols: int, source_dtype: torch.dtype) -> dict:
    groups = rows // BLOCK_SIZE
    return {"blocks": (torch.uint8, (cols, groups, BLOCK_SIZE // 2)), "scales": (torch.uint8, (cols, groups))}


def quantize(weight: torch.Tensor):
    raise ConfigError("mxfp4 is read as a checkpoint publishes it; usaf does not quantize into it.")


@functools.cache
def _byte_tables(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """byte -> its low and its high nibble's FP4 value, once per device and dtype (a forward dequantizes per
    layer and chunk)."""
    codes = torch.arange(256)
    values = torch.tensor(FP4_VALUES, dtype=torch.float32)
    return values[codes & 0x0F].to(device, dtype), values[codes >> 4].to(device, dtype)


def dequantize(parts: dict[str, torch.Tensor], rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """parts of k matrices ({"blocks": [k, cols, rows/32, 16], "scales": [k, cols, rows/32]}) -> [k, rows, cols].

    The published bytes are output-major, the result input-major: the bytes are transposed (one byte a pair of
    values) before two table lookups write the even and odd rows, so no value-sized transpose is copied (5x faster
    on a CPU than looking up each nibble and transposing the values). FP4 values times a power of two are exact in
    bf16 and fp32, which therefore compute in place; other dtypes go through fp32, as transformers' ldexp does."""
    groups = rows // BLOCK_SIZE
    blocks = parts["blocks"]
    k = blocks.numel() // (cols * rows // 2)
    work = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
    low, high = _byte_tables(blocks.device, work)
    pairs = blocks.reshape(k, cols, rows // 2).transpose(1, 2).contiguous().reshape(-1).int()
    out = torch.empty(k, rows // 2, 2, cols, dtype=work, device=blocks.device)
    out[:, :, 0] = low.index_select(0, pairs).view(k, rows // 2, cols)
    out[:, :, 1] = high.index_select(0, pairs).view(k, rows // 2, cols)
    del pairs
    scales = parts["scales"].reshape(k, cols, groups).transpose(1, 2)
    out.view(k, groups, BLOCK_SIZE, cols).mul_(torch.exp2(scales.float() - 127.0).to(work).unsqueeze(2))
    return out.view(k, rows, cols).to(dtype)
