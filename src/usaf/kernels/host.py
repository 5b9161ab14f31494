"""usaf's intended reads of tensor data by the host, through one seam.

The engine must read a few values on the host: how many rows each expert got (grouped products, chunking,
padding), the routed experts' ids, a step's loss. Each such read goes through `read_ints` / `read_int` /
`read_float` here, with a `plausible` value: what the read would give on balanced data, computed from shapes
alone. A real run ignores it. `usaf.simulate` installs a reader (`reading_with`) that counts each read (a host
sync when the tensor is on the device) and returns the plausible value instead, since its fake tensors carry no
data; any other read of tensor data (a raw `.item()`, `.tolist()`, `bool(t)`) then fails under the simulation and
is reported where it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

__all__ = ["balanced", "pinned", "read_float", "read_int", "read_ints", "reading_with"]

# (tensor, kind, plausible) -> the value; None: the tensor's own
_reader: Callable | None = None


def _plausible(value):
    return value() if callable(value) else value


def read_ints(tensor: torch.Tensor, plausible) -> list[int]:
    """`tensor.tolist()` (1-D integers). `plausible`: the list (or a callable making it) balanced data gives."""
    if _reader is not None:
        return list(_reader(tensor, "ints", lambda: _plausible(plausible)))
    return tensor.tolist()


def read_int(tensor: torch.Tensor, plausible) -> int:
    """`int(tensor)` of a one-element tensor; `plausible` as in `read_ints`."""
    if _reader is not None:
        return int(_reader(tensor, "int", lambda: _plausible(plausible)))
    return int(tensor)


def read_float(tensor: torch.Tensor, plausible) -> float:
    """`float(tensor)` of a one-element tensor; `plausible` as in `read_ints`."""
    if _reader is not None:
        return float(_reader(tensor, "float", lambda: _plausible(plausible)))
    return float(tensor)


def pinned(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in pinned host memory, for an asynchronous copy to an accelerator (under a simulation, whose fake
    tensors cannot be pinned, the tensor itself: the same bytes of host memory)."""
    return tensor if _reader is not None else tensor.pin_memory()


def balanced(total: int, parts: int) -> list[int]:
    """`total` items spread as evenly as can be over `parts` (the first ones take the remainder): what uniform
    routing gives each expert."""
    if parts <= 0:
        return []
    base, extra = divmod(int(total), parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


@contextlib.contextmanager
def reading_with(reader: Callable):
    """Within the block, every read here goes to `reader(tensor, kind, plausible)` (`plausible()` gives the
    balanced value): the simulator's seam."""
    global _reader
    previous, _reader = _reader, reader
    try:
        yield
    finally:
        _reader = previous
