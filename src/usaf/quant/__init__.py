"""Frozen storage formats for expert weights: quantize one matrix, dequantize a stack of them.

Every format is a module of small pure functions with explicit state, in the style of bitsandbytes' `functional`:

    layout(rows, cols, source_dtype) -> {part: (dtype, shape)}   how one [rows, cols] matrix is stored
    quantize(weight)   -> {part: tensor}               weight [rows, cols] -> its parts (packed data + state)
    dequantize(parts, rows, cols, dtype) -> tensor     parts stacked over k matrices ([k, *shape]) -> [k, rows, cols]
    pieces(weight, max_elements) -> pieces of weight   quantized one by one, their parts concatenate to the whole's

Published formats (`mxfp4`, `fp8`) are read as a checkpoint publishes them: the store holds the checkpoint's own
bytes as the parts, and their `quantize` refuses. Every format has a `DESCRIPTOR` (`usaf.quant.descriptor`): its
name, stored bits, temporaries and constants, read by the config (`model.quant`'s choices), the prepared store and
the planner.

Adding a format is a module with the functions above and a `DESCRIPTOR`, and one `register_format` call (below,
or from the code that defines it).

Parts are plain tensors, so a stack of experts is stored as one tensor per part ([E, *shape]) and any subset of
experts is dequantized by indexing those tensors: nothing ever needs a whole layer in full precision.
"""

from __future__ import annotations

from types import ModuleType

import torch

from usaf.errors import ConfigError
from usaf.quant import fp8, int4, int8, mxfp4, nf4, none
from usaf.quant.descriptor import Descriptor

FORMATS: dict[str, ModuleType] = {}  # usaf quantizes into these
PUBLISHED: dict[str, ModuleType] = {}  # read as checkpoints publish them


def register_format(module):
    """Make a format (a module, or any object with the functions above and a `DESCRIPTOR`) known by its name to
    the config, the store and the planner."""
    descriptor = module.DESCRIPTOR
    (PUBLISHED if descriptor.published else FORMATS)[descriptor.name] = module
    return module


# this order is the one `model.quant` lists its choices in
for _module in (none, nf4, int8, int4, mxfp4, fp8):
    register_format(_module)


def by_precision() -> tuple[str, ...]:
    """usaf's own formats, most to least precise (more stored bits first; ties in registration order)."""
    return tuple(sorted(FORMATS, key=lambda name: -FORMATS[name].DESCRIPTOR.bits))


def descriptor(name: str) -> Descriptor:
    return get_format(name).DESCRIPTOR


def format_constants() -> dict:
    """The block and group sizes of usaf's own formats, as a store's metadata records them ("nf4_block_size")."""
    return {
        f"{name}_{key}": value
        for name, module in FORMATS.items()
        for key, value in module.DESCRIPTOR.constants.items()
    }


def get_format(name: str) -> ModuleType:
    try:
        return FORMATS.get(name) or PUBLISHED[name]
    except KeyError:
        raise ConfigError(
            f"Unknown quantization format {name!r}; choose one of {sorted(FORMATS | PUBLISHED)}."
        ) from None


def resolve_format(name: str, device: torch.device | str | None = None) -> str:
    """The format to use for `name` on `device`: NF4 needs bitsandbytes kernels for the device; where it has none
    (e.g. ROCm without a ROCm build of bitsandbytes), the pure-PyTorch int4 takes its place."""
    get_format(name)
    if name == "nf4" and not nf4.has_kernels(torch.device(device or default_device())):
        return "int4"
    return name


def default_device() -> torch.device:
    """The accelerator torch sees (CUDA/ROCm, XPU, MPS, ...), else the CPU."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        return torch.device(accelerator.current_accelerator().type)
    return torch.device("cpu")
