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

Adding a format is a module (or any object) with the functions above and a `DESCRIPTOR` (the protocol
`QuantFormat`; a published format: `PublishedFormat`, without `pieces`), and one `register_format` call (below, or
from the code that defines it): it joins `FORMATS` or `PUBLISHED`, the registries the config, the store and the
planner read, by its descriptor's `published` flag.

Parts are plain tensors, so a stack of experts is stored as one tensor per part ([E, *shape]) and any subset of
experts is dequantized by indexing those tensors: nothing ever needs a whole layer in full precision.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import torch

from usaf.errors import ConfigError
from usaf.quant import fp8, int4, int8, mxfp4, nf4, none
from usaf.quant.descriptor import Descriptor
from usaf.registry import Registry


@runtime_checkable
class PublishedFormat(Protocol):
    """A format read as a checkpoint publishes it: its parts are the checkpoint's own tensors."""

    DESCRIPTOR: Descriptor

    def layout(self, rows: int, cols: int, source_dtype: torch.dtype) -> dict: ...

    def dequantize(self, parts: dict, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor: ...


@runtime_checkable
class QuantFormat(PublishedFormat, Protocol):
    """A format usaf quantizes into (the functions of the module docstring)."""

    def quantize(self, weight: torch.Tensor) -> dict: ...

    def pieces(self, weight: torch.Tensor, max_elements: int) -> Iterator[torch.Tensor]: ...


def _format_name(fmt: PublishedFormat) -> str:
    return fmt.DESCRIPTOR.name


FORMATS: Registry[QuantFormat] = Registry("quantization format", QuantFormat, _format_name)  # usaf's own
PUBLISHED: Registry[PublishedFormat] = Registry(  # read as checkpoints publish them
    "published quantization format", PublishedFormat, _format_name
)


def register_format(module):
    """Make a format (a module, or any object with the functions above and a `DESCRIPTOR`) known by its name to
    the config, the store and the planner; returns it. A name is one format's, published or not."""
    registry, other = (PUBLISHED, FORMATS) if module.DESCRIPTOR.published else (FORMATS, PUBLISHED)
    if _format_name(module) in other:
        raise ConfigError(f"A {other.kind} named {_format_name(module)!r} is registered already.")
    return registry.register(module)


# this order is the one `model.quant` lists its choices in
for _module in (none, nf4, int8, int4, mxfp4, fp8):
    register_format(_module)


def by_precision() -> tuple[str, ...]:
    """usaf's own formats, most to least precise (more stored bits first; ties in registration order)."""
    return tuple(sorted(FORMATS, key=lambda name: -descriptor(name).bits))


def descriptor(name: str) -> Descriptor:
    return get_format(name).DESCRIPTOR


def format_constants() -> dict:
    """The block and group sizes of usaf's own formats, as a store's metadata records them ("nf4_block_size")."""
    return {
        f"{name}_{key}": value
        for name, fmt in FORMATS.items()
        for key, value in fmt.DESCRIPTOR.constants.items()
    }


def get_format(name: str) -> PublishedFormat:
    """The format named `name`, usaf's own or published."""
    fmt = FORMATS.get(name) or PUBLISHED.get(name)
    if fmt is None:
        raise ConfigError(
            f"Unknown quantization format {name!r}; choose one of {sorted([*FORMATS, *PUBLISHED])}."
        )
    return fmt


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
