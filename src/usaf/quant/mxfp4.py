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
def _lookup_table(device: torch.device) -> torch.Tensor:
    """FP4 code -> value, once per device: a forward dequantizes per layer and chunk, each a host-to-device copy."""
    return torch.tensor(FP4_VALUES, dtype=torch.float32, device=device)


def dequantize(parts: dict[str, torch.Tensor], rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """parts of k matrices ({"blocks": [k, cols, rows/32, 16], "scales": [k, cols, rows/32]}) -> [k, rows, cols]."""
    groups = rows // BLOCK_SIZE
    blocks = parts["blocks"].reshape(-1, cols, groups, BLOCK_SIZE // 2)
    scales = parts["scales"].reshape(-1, cols, groups)
    lut = _lookup_table(blocks.device)
    values = torch.empty(*blocks.shape[:-1], BLOCK_SIZE, dtype=torch.float32, device=blocks.device)
    values[..., 0::2] = lut[(blocks & 0x0F).int()]
    values[..., 1::2] = lut[(blocks >> 4).int()]
    # a power of two: exact in fp32, as transformers' ldexp is in the load dtype
    values.mul_(torch.exp2(scales.float() - 127.0).unsqueeze(-1))
    return values.reshape(-1, cols, rows).transpose(1, 2).to(dtype).contiguous()
