"""int8 with one absmax scale per row: w ≈ data * scale (scale = absmax / 127), pure PyTorch."""

from __future__ import annotations

import torch

from usaf.quant.descriptor import Descriptor

DESCRIPTOR = Descriptor("int8", "int8, one fp32 scale per row", 8, 8)  # codes and scales widened to fp32


def layout(rows: int, cols: int, source_dtype: torch.dtype) -> dict:
    return {"data": (torch.int8, (rows, cols)), "scale": (torch.float32, (rows,))}


def pieces(weight: torch.Tensor, max_elements: int):
    """Consecutive pieces of whole rows: quantized one by one, their parts concatenated are the parts of the
    whole (so the quantizer's temporaries stay bounded)."""
    step = max(1, max_elements // max(1, weight.shape[-1]))
    for start in range(0, weight.shape[0], step):
        yield weight[start : start + step]


def quantize(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """weight [rows, cols] (or any [..., cols]: rows are independent, so large matrices can go in chunks)."""
    w = weight.float()
    scale = w.abs().amax(dim=-1) / 127.0
    # an all-zero row has no scale; any positive one reproduces it exactly
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    data = torch.round(w / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return {"data": data, "scale": scale}


def dequantize(parts: dict[str, torch.Tensor], rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    data = parts["data"].reshape(-1, rows, cols)
    scale = parts["scale"].reshape(-1, rows, 1)
    return (data.float() * scale).to(dtype)
