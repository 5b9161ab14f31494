"""Group-wise asymmetric int4 in pure PyTorch, so it runs wherever torch does (CUDA, ROCm, MPS, XPU, CPU).

Each row is cut into groups of `GROUP_SIZE` values; a group stores w ≈ q * scale + low with q in 0..15, and
`scale`, `low` in fp16. Two values share a byte (the even column in the low nibble). Rows are padded to a whole
number of groups; the padding is dropped on dequantization.
"""

from __future__ import annotations

import torch

from usaf.quant.descriptor import Descriptor

GROUP_SIZE = 64
# temporaries: the unpacked nibbles, their fp32 codes and the fp32 result
DESCRIPTOR = Descriptor(
    "int4", "int4, fp16 scale and offset per group of 64", 4.5, 9, constants={"group_size": GROUP_SIZE}
)


def _padded(cols: int, group_size: int) -> int:
    return -(-cols // group_size) * group_size


def layout(rows: int, cols: int, source_dtype: torch.dtype, group_size: int = GROUP_SIZE) -> dict:
    padded = _padded(cols, group_size)
    groups = padded // group_size
    return {
        "data": (torch.uint8, (rows, padded // 2)),
        "scale": (torch.float16, (rows, groups)),
        "low": (torch.float16, (rows, groups)),
    }


def pieces(weight: torch.Tensor, max_elements: int):
    """Consecutive pieces of whole rows: quantized one by one, their parts concatenated are the parts of the
    whole (so the quantizer's temporaries stay bounded)."""
    step = max(1, max_elements // max(1, weight.shape[-1]))
    for start in range(0, weight.shape[0], step):
        yield weight[start : start + step]


def quantize(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> dict[str, torch.Tensor]:
    """weight [..., cols]; rows are independent."""
    if group_size % 2:
        raise ValueError("int4 group size must be even (two values per byte).")
    w = weight.float()
    cols = w.shape[-1]
    padded = _padded(cols, group_size)
    if padded != cols:  # pad with the row's first value so the padding does not widen any group's range
        w = torch.cat([w, w[..., :1].expand(*w.shape[:-1], padded - cols)], dim=-1)
    groups = w.reshape(*w.shape[:-1], padded // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    # stored in fp16: quantize against the rounded values so that dequantization sees what quantization saw
    scale = ((high - low) / 15.0).to(torch.float16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: any scale, q = 0
    low = low.to(torch.float16)
    q = torch.round((groups - low.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)).clamp_(0, 15)
    q = q.to(torch.uint8).reshape(*w.shape[:-1], padded)
    data = q[..., 0::2] | (q[..., 1::2] << 4)
    return {"data": data.contiguous(), "scale": scale, "low": low}


def dequantize(
    parts: dict[str, torch.Tensor], rows: int, cols: int, dtype: torch.dtype, group_size: int = GROUP_SIZE
) -> torch.Tensor:
    data = parts["data"].reshape(-1, rows, parts["data"].shape[-1])
    k, padded = data.shape[0], data.shape[-1] * 2
    q = torch.stack([data & 0x0F, data >> 4], dim=-1).reshape(k, rows, padded // group_size, group_size)
    scale = parts["scale"].reshape(k, rows, -1, 1).float()
    low = parts["low"].reshape(k, rows, -1, 1).float()
    w = torch.addcmul(low, q.to(scale.dtype), scale).reshape(k, rows, padded)
    w = (
        w if padded == cols else w[..., :cols].contiguous()
    )  # callers write into the result through a flat view
    return w.to(dtype)
