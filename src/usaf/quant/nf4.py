"""NF4 through bitsandbytes' functional API: 4-bit NormalFloat codes in blocks of `BLOCK_SIZE` values, one fp32
absmax per block, each expert matrix quantized on its own (flattened), two codes per byte."""

from __future__ import annotations

import functools
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
    w = weight if weight.dtype in (torch.float32, torch.float16, torch.bfloat16) else weight.float()
    if w.device.type == "cpu" and w.numel() % BLOCK_SIZE == 0 and not _has_native_quantize("CPU"):
        return _quantize_cpu(w.reshape(-1, BLOCK_SIZE))
    F = _functional()
    data, state = F.quantize_4bit(w.contiguous(), blocksize=BLOCK_SIZE, quant_type="nf4")
    return {"data": data.reshape(-1), "absmax": state.absmax.float().reshape(-1)}


def _has_native_quantize(key: str) -> bool:
    if key not in _NATIVE_QUANTIZE:
        try:
            _functional()
            _NATIVE_QUANTIZE[key] = bool(
                torch._C._dispatch_has_kernel_for_dispatch_key("bitsandbytes::quantize_4bit", key)
            )
        except Exception:  # bitsandbytes missing or broken: its own call below says so
            _NATIVE_QUANTIZE[key] = True
    return _NATIVE_QUANTIZE[key]


_NATIVE_QUANTIZE: dict[str, bool] = {}


def _quantize_cpu(blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    """bitsandbytes' own CPU quantization (its default torch kernel: there is no native one), bit for bit, ~4x
    faster: the same fp32 absmax, reciprocal and product, but the code of each scaled value is looked up by the top
    16 bits of its float (`_code_tables`) instead of a binary search per value (`torch.bucketize`, most of the
    time), clamping is left out (it changes no code: every midpoint lies inside [-1, 1]), and the absmax is taken
    on the input's own dtype (a max selects, so it is exact)."""
    table, bound = _code_tables()
    absmax = blocks.abs().amax(dim=1).float()
    scaled = blocks * (1.0 / absmax.clamp(min=1e-38))[:, None]  # fp32, as bitsandbytes' A_com * (1 / absmax)
    top = (scaled.view(torch.int32) >> 16) & 0xFFFF
    codes = table[top]
    codes += scaled > bound[top]  # the 15 prefixes that hold a midpoint: one comparison decides
    codes = codes.view(-1, 2)
    return {"data": (codes[:, 0] << 4) | codes[:, 1], "absmax": absmax}


@functools.cache
def _code_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """Per top 16 bits p of an fp32 value (unsigned): the NF4 code `torch.bucketize(value, midpoints)` gives the
    lowest value with those bits, and the midpoint inside their range where there is one (+inf elsewhere), so that
    code = table[p] + (value > bound[p]). The midpoints are bitsandbytes' (`_get_4bit_quantize_bounds`): fp32
    halves of neighbouring codes."""
    from bitsandbytes.functional import get_4bit_type

    code = get_4bit_type("nf4", device="cpu").float()
    midpoints = (code[:-1] + code[1:]) / 2
    prefix = torch.arange(1 << 16, dtype=torch.int32)
    ends = torch.stack([prefix << 16, (prefix << 16) | 0xFFFF]).view(torch.float32)  # both ends of each range
    low, high = ends.amin(dim=0), ends.amax(dim=0)
    finite = torch.isfinite(low) & torch.isfinite(high)
    low, high = torch.where(finite, low, 0.0), torch.where(finite, high, 0.0)  # never met: finite inputs only
    lower, upper = torch.bucketize(low, midpoints), torch.bucketize(high, midpoints)
    if bool(
        (upper - lower > 1).any()
    ):  # two midpoints in one range: a lookup plus one comparison is not enough
        raise AssertionError("NF4 midpoints closer than a 16-bit float prefix")
    bound = torch.full((1 << 16,), float("inf"))
    split = upper > lower
    bound[split] = midpoints[lower[split]]
    return lower.to(torch.uint8), bound


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


def read_entries(
    parts: dict[str, torch.Tensor], flat: torch.Tensor, rows: int, cols: int, dtype: torch.dtype
) -> torch.Tensor:
    """Values at flat indices of one stored matrix ([1, ...] parts): only the blocks that hold them dequantized,
    by the same kernel as `dequantize` (each block on its own, so the values are the same bits)."""
    # each entry's block on its own (a block shared by two entries is dequantized twice): sizes from the shapes
    # alone, no host sync (a torch.unique of the blocks would be one); the whole matrix where that is no more work
    if (rows * cols) % BLOCK_SIZE or flat.numel() * BLOCK_SIZE >= rows * cols:
        return dequantize(parts, rows, cols, dtype).reshape(-1)[flat]
    block = torch.div(flat, BLOCK_SIZE, rounding_mode="floor")
    data = parts["data"].reshape(-1, BLOCK_SIZE // 2)[block].reshape(-1)
    absmax = parts["absmax"].reshape(-1)[block]
    values = dequantize({"data": data, "absmax": absmax}, 1, flat.numel() * BLOCK_SIZE, dtype).reshape(-1)
    at = torch.arange(flat.numel(), device=flat.device) * BLOCK_SIZE
    return values[at + flat % BLOCK_SIZE]
