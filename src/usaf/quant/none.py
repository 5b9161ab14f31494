"""No quantization: the weight as stored in the checkpoint (bf16, fp16 or fp32)."""

from __future__ import annotations

import torch

from usaf.quant.descriptor import Descriptor

DESCRIPTOR = Descriptor("none", "unquantized (compute dtype)", 16, 0)


def layout(rows: int, cols: int, source_dtype: torch.dtype) -> dict:
    return {"data": (source_dtype, (rows, cols))}


def pieces(weight: torch.Tensor, max_elements: int):
    yield weight  # nothing to bound: stored as is


def quantize(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"data": weight.contiguous()}


def dequantize(parts: dict[str, torch.Tensor], rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    # always a copy: the caller writes trained values into it, never into the frozen base
    return parts["data"].reshape(-1, rows, cols).to(dtype, copy=True)
