"""NF4 through bitsandbytes' functional API: 4-bit NormalFloat codes in blocks of `BLOCK_SIZE` values, one fp32
absmax per block, each expert matrix quantized on its own (flattened), two codes per byte."""

from __future__ import annotations

import logging

import torch

from usaf.quant.descriptor import Descriptor

BLOCK_SIZE = 64
# the kernel writes the dtype: no temporaries
DESCRIPTOR = Descriptor(
    "nf4", "NF4, one fp32 absmax per 64 weights", 4.5, 0, constants={"block_size": BLOCK_SIZE}
)
_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA", "xpu": "XPU", "mps": "MPS", "hpu": "HPU"}


# bitsandbytes logs a warning about optional CPU kernels when it is imported, and the hub kernel it then asks
# `kernels` for logs that the hub is offline: noise for usaf's users, and bitsandbytes may be imported before this
# module is (by accelerate, transformers), so the loggers are quieted here, at usaf's import
for _noisy in ("bitsandbytes", "kernels"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)


def _functional():
    import bitsandbytes.functional as F

    return F


def has_kernels(device: torch.device) -> bool:
    """Whether bitsandbytes has a native NF4 dequantization kernel for `device` (not only its slow fallback)."""
    key = _DISPATCH_KEYS.get(device.type)
    if key is None:
        return False
    try:
        _functional()
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key("bitsandbytes::dequantize_4bit", key))
    except Exception:  # bitsandbytes missing or broken on this platform
        return False


def layout(rows: int, cols: int, source_dtype: torch.dtype) -> dict:
    numel = rows * cols
    return {
        "data": (torch.uint8, ((numel + 1) // 2,)),
        "absmax": (torch.float32, (-(-numel // BLOCK_SIZE),)),
    }


def pieces(weight: torch.Tensor, max_elements: int):
    """Consecutive pieces of the flattened matrix, whole blocks each: quantized one by one, their parts
    concatenated are the parts of the whole (so the quantizer's temporaries stay bounded)."""
    step = max(BLOCK_SIZE, max_elements // BLOCK_SIZE * BLOCK_SIZE)
    flat = weight.reshape(-1)
    for start in range(0, flat.numel(), step):
        yield flat[start : start + step]


def quantize(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    F = _functional()
    w = weight if weight.dtype in (torch.float32, torch.float16, torch.bfloat16) else weight.float()
    data, state = F.quantize_4bit(w.contiguous(), blocksize=BLOCK_SIZE, quant_type="nf4")
    return {"data": data.reshape(-1), "absmax": state.absmax.float().reshape(-1)}


def dequantize(parts: dict[str, torch.Tensor], rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    F = _functional()
    data, absmax = parts["data"], parts["absmax"]
    numel = rows * cols
    k = data.numel() // ((numel + 1) // 2)
    # whole blocks (and bytes) per expert: k experts are one long quantized vector
    if numel % BLOCK_SIZE == 0:
        # bitsandbytes' registered op, not `F.dequantize_4bit`: it takes the [k, ...] parts as they are, where the
        # wrapper wants them flat (an op each); the op itself is the one the wrapper calls. A flat output shape:
        # bitsandbytes 0.50's CPU kernel blocks a 2-D or 3-D shape per row, which is wrong (not merely different)
        # when a row is not a whole number of blocks; quantization blocks the flattened tensor.
        flat = torch.ops.bitsandbytes.dequantize_4bit(data, absmax, BLOCK_SIZE, "nf4", [k * numel], dtype)
        return flat.view(k, rows, cols)

    def run(data, absmax, count):
        state = F.QuantState(absmax, shape=(count,), blocksize=BLOCK_SIZE, quant_type="nf4", dtype=dtype)
        return F.dequantize_4bit(data.reshape(-1, 1), quant_state=state)

    data, absmax = data.reshape(k, -1), absmax.reshape(k, -1)
    return torch.stack([run(data[i], absmax[i], numel).view(rows, cols) for i in range(k)])
