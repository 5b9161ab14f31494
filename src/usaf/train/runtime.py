"""Where and how a run computes: device, dtype, autocast, seeding, RNG snapshots, peak memory."""

from __future__ import annotations

import contextlib
import random
import resource
import sys

import numpy as np
import torch

from usaf.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():  # also ROCm builds
            return torch.device("cuda")
        if getattr(torch, "xpu", None) is not None and torch.xpu.is_available():
            return torch.device("xpu")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(
            f"model.device = {name!r} is not a device torch knows (auto, cpu, cuda, cuda:1, ...)."
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("model.device asks for CUDA, but this torch build sees no CUDA/ROCm device.")
    return device


# AMD GPUs of RDNA1/RDNA2 (gfx10xx, e.g. the RX 6750 XT's gfx1031) have no bf16 matrix units: ROCm runs bf16
# matmuls emulated, while fp16 runs at twice the fp32 rate. RDNA3 (gfx11xx) and CDNA (gfx9xx) have bf16 WMMA/MFMA.
_NO_FAST_BF16_ARCHES = ("gfx10",)


def has_fast_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls have hardware support on `device` (a CUDA or ROCm/HIP GPU)."""
    if device.type != "cuda" or not torch.cuda.is_bf16_supported():
        return False
    if getattr(torch.version, "hip", None):
        arch = getattr(torch.cuda.get_device_properties(device), "gcnArchName", "") or ""
        return not arch.startswith(_NO_FAST_BF16_ARCHES)
    return True


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bf16 where the accelerator has bf16 matmuls, fp16 (trained with loss scaling) on a GPU without them
    (AMD RDNA2), fp32 on CPU (bf16 matmuls are slow on most CPUs)."""
    if name != "auto":
        return DTYPES[name]
    if has_fast_bf16(device):
        return torch.bfloat16
    if device.type == "cuda":
        return torch.float16
    return torch.float32


def autocast_dtype(precision: str, model_dtype: torch.dtype) -> torch.dtype | None:
    """The forward's low-precision dtype: bf16/fp16 when asked (or `auto` with a low-precision model), else None."""
    if precision == "none" or (precision == "auto" and model_dtype == torch.float32):
        return None
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, model_dtype)


def autocast(precision: str, device: torch.device, model_dtype: torch.dtype):
    """A context for the forward: autocast to `autocast_dtype`, or nothing."""
    dtype = autocast_dtype(precision, model_dtype)
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type=device.type, dtype=dtype)


def loss_scaler(precision: str, device: torch.device, model_dtype: torch.dtype) -> torch.amp.GradScaler:
    """Dynamic loss scaling when the forward runs in fp16 (whose gradients underflow without it); a pass-through
    scaler otherwise. The only scaling in the loop: the loss is scaled once, the gradients unscaled once."""
    return torch.amp.GradScaler(device.type, enabled=autocast_dtype(precision, model_dtype) == torch.float16)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """Every RNG a step can touch, as tensors and JSON-able lists (no pickles)."""
    py = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def peak_memory_bytes(device: torch.device) -> int:
    """The allocator's peak on an accelerator; the process's peak resident set on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
