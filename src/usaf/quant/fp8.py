"""Block-scaled FP8 as DeepSeek-V3 and Qwen3-*-FP8 publish their linear layers: float8_e4m3fn values and one
`weight_scale_inv` per block x block tile (w = value * scale_inv); a partial tile at the edge shares its scale.

A published format: the store holds the checkpoint's own bytes, so usaf never quantizes into it. Dequantization
is transformers' (fp32 product, then the checkpoint's dtype), so the values are those of its dequantized load.
"""

from __future__ import annotations

import torch

from usaf.errors import ConfigError
from usaf.quant.descriptor import Descriptor

BLOCK = (128, 128)
# the values widened to fp32 (scaled in place, whole blocks) and their rounding to the checkpoint's dtype
DESCRIPTOR = Descriptor(
    "fp8",
    "FP8 (e4m3) as published, one fp32 scale per 128x128 block",
    8 + 32 / (128 * 128),
    6,
    published=True,
    constants={"block": BLOCK},
)


def layout(rows: int, cols: int, source_dtype: torch.dtype, block=BLOCK) -> dict:
    b0, b1 = block
    return {
        "data": (torch.float8_e4m3fn, (rows, cols)),
        "scale_inv": (torch.float32, (-(-rows // b0), -(-cols // b1))),
    }


def quantize(weight: torch.Tensor):
    raise ConfigError("fp8 is read as a checkpoint publishes it; usaf does not quantize into it.")


def dequantize(
    parts: dict[str, torch.Tensor],
    rows: int,
    cols: int,
    dtype: torch.dtype,
    block=BLOCK,
    values_dtype: str | None = None,
) -> torch.Tensor:
    """parts of k matrices ({"data": [k, rows, cols], "scale_inv": [k, rows/b0, cols/b1]}) -> [k, rows, cols].

    values_dtype: the checkpoint's dtype (its torch name, e.g. "bfloat16"): values are rounded to it first, as transformers'
    dequantized load holds them."""
    b0, b1 = block
    data = parts["data"].reshape(-1, rows, cols)
    k = data.shape[0]
    scale = parts["scale_inv"].reshape(k, -(-rows // b0), -(-cols // b1)).float()
    out = data.float()
    if rows % b0 == 0 and cols % b1 == 0:  # whole blocks: the scales broadcast, nothing weight-sized is built
        out.view(k, rows // b0, b0, cols // b1, b1).mul_(scale[:, :, None, :, None])
    else:  # a partial block at the edge shares its scale
        out.mul_(scale.repeat_interleave(b0, dim=1)[:, :rows].repeat_interleave(b1, dim=2)[:, :, :cols])
    if values_dtype is not None:
        out = out.to(getattr(torch, values_dtype))
    return out.to(dtype)
