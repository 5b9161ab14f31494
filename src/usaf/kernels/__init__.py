"""The engine's heavy primitives over expert segments, each in one call whatever the number of experts.

Rows of a routed batch are grouped by expert (`Segments`: expert e's rows are offsets[e]:offsets[e + 1]); so are
the trained entries of a fused [E, A, B] tensor. Two primitives give every gradient the engine needs:
- `sampled_dots`: the trained entries' gradients, out[k] = sum over expert e_k's rows t of U[t, a_k] * V[t, b_k]
  (a sampled dense-dense product per expert, never the dense [E, A, B] product);
- `line_dots`: whole trained lines, out[l, :] = sum over expert e_l's rows t of fixed[t, line_l] * spanning[t, :].

Each has a pure-PyTorch implementation (`usaf.kernels.torch_path`: any device, a bounded number of ops) and may
have a Triton one (`usaf.kernels.triton_path`: CUDA and ROCm). `use(name)` chooses: "auto" takes Triton for
tensors on a GPU when Triton is importable, else PyTorch; "triton" insists; "torch" never uses Triton.
"""

from __future__ import annotations

import array
import itertools
from dataclasses import dataclass, field

import torch

from usaf.errors import ConfigError
from usaf.kernels import torch_path, triton_path  # triton_path imports without Triton (then unavailable)
from usaf.kernels.host import balanced, pinned, read_ints

CHOICES = ("auto", "triton", "torch")


def _balanced_among(total: int, parts: int, among: range | None) -> list[int]:
    """`balanced(total, parts)`, or, with `among`, `total` spread over those parts alone (zero elsewhere)."""
    if among is None:
        return balanced(total, parts)
    spread = iter(balanced(total, len(among)))
    return [next(spread) if i in among else 0 for i in range(parts)]


@dataclass
class Segments:
    """E groups of consecutive rows: `offsets` [E + 1] int64 on the device, `counts` the same on the host (read
    once, where a caller already had them: a routing plan's one host sync, or a selection's cached grouping)."""

    offsets: torch.Tensor
    counts: list[int]
    # what an implementation derives from these segments alone (a sparsity pattern, say): it lives as long as this
    # object, which a selection keeps until it changes
    cache: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_counts(cls, counts: list[int], device) -> Segments:
        return cls(host_ints_to_device([0, *itertools.accumulate(counts)], device), list(counts))

    @classmethod
    def of(
        cls, ids: torch.Tensor, num_segments: int, among: range | None = None, known: list[int] | None = None
    ) -> Segments:
        """The segments `ids` (each item's segment, ascending) group items into; reads the counts to the host,
        unless they are `known` (read by the caller already). `among`: the only segments the ids can name (an
        expert-parallel rank's own experts), where balanced data spreads them (a simulation's plausible counts)."""
        counts, offsets = torch_path.offsets_of(ids, num_segments)
        if known is not None:
            return cls(offsets, list(known))
        return cls(offsets, read_ints(counts, lambda: _balanced_among(ids.numel(), num_segments, among)))

    @classmethod
    def from_offsets(cls, offsets: torch.Tensor, total: int | None = None) -> Segments:
        """Segments from device offsets; reads the counts to the host. `total`: the items they group, where the
        caller knows it (a simulation spreads them evenly)."""
        parts = offsets.numel() - 1
        return cls(offsets, read_ints(offsets[1:] - offsets[:-1], lambda: balanced(total or 0, parts)))

    @classmethod
    def single(cls, count: int, device) -> Segments:
        """One segment of `count` rows (a native weight's tokens), its offsets made once per count and device."""
        key = (count, str(device))
        if key not in _SINGLE:
            if len(_SINGLE) > 64:  # sequence lengths vary: keep the table small
                _SINGLE.clear()
            _SINGLE[key] = cls.from_counts([count], device)
        return _SINGLE[key]

    @property
    def num_segments(self) -> int:
        return len(self.counts)

    @property
    def total(self) -> int:
        return self.start(len(self.counts))

    def start(self, segment: int) -> int:
        """Where segment `segment` starts (host arithmetic; `start(n)` is the total)."""
        starts = self.__dict__.get("_starts")
        if starts is None:
            starts = self.__dict__["_starts"] = [0, *itertools.accumulate(self.counts)]
        return starts[segment]

    def span(self, first: int, last: int) -> Segments:
        """Segments first..last (inclusive), offsets counted from segment `first`'s start."""
        if first == 0 and last == len(self.counts) - 1:
            return self
        offsets = self.offsets[first : last + 2]
        return Segments(offsets - offsets[0], self.counts[first : last + 1])


cast, offsets_of = torch_path.cast, torch_path.offsets_of


def host_ints_to_device(values: list[int], device) -> torch.Tensor:
    """int64 tensor of host integers on `device` without a host sync: on an accelerator made in pinned memory and
    copied asynchronously (a copy from pageable memory waits for the device's queue first), on the CPU as it is.
    Made over an `array` buffer: `torch.tensor(list)` costs four ops (empty, to, lift_fresh, detach_) and a
    Python loop over the list; `frombuffer` none."""
    tensor = (
        torch.frombuffer(array.array("q", values), dtype=torch.int64)
        if values
        else torch.empty(0, dtype=torch.int64)
    )
    device = torch.device(device)
    if device.type == "cpu":
        return tensor
    return pinned(tensor).to(device, non_blocking=True)


_choice = "auto"
_SINGLE: dict = {}


def use(name: str) -> None:
    """Choose the implementation for later calls (see the module's docstring)."""
    global _choice
    if name not in CHOICES:
        raise ConfigError(f"train.kernels must be one of {', '.join(CHOICES)}, got {name!r}.")
    if name == "triton":
        triton_path.require()
    _choice = name


def chosen() -> str:
    return _choice


def _implementation(tensor: torch.Tensor):
    if _choice == "torch" or (_choice == "auto" and tensor.device.type != "cuda"):
        return torch_path
    if _choice == "triton" or triton_path.available(tensor.device):
        return triton_path
    return torch_path


def sampled_dots(
    U: torch.Tensor, V: torch.Tensor, rows: Segments, local: torch.Tensor, entries: Segments, width: int
) -> torch.Tensor:
    """[K] fp32: out[k] = sum_{t in rows of e_k} U[t, a_k] * V[t, b_k].

    U [R, A] and V [R, B] (any float dtype, the same), rows grouped by `rows`; `local` [K] the entries' indices
    a * width + b within their expert's matrix (width = B), grouped by expert by `entries` (ascending within an
    expert). Experts with no rows or no entries are allowed; so are R = 0 and K = 0."""
    return _implementation(U).sampled_dots(U, V, rows, local, entries, width)


def line_dots(
    fixed: torch.Tensor, spanning: torch.Tensor, rows: Segments, lines: torch.Tensor, entries: Segments
) -> torch.Tensor:
    """[L, W] fp32: out[l, :] = sum_{t in rows of e_l} fixed[t, lines[l]] * spanning[t, :].

    fixed [R, A'], spanning [R, W]; `lines` [L] int64 indices into fixed's columns, grouped by expert by
    `entries`."""
    return _implementation(fixed).line_dots(fixed, spanning, rows, lines, entries)


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, rows: Segments) -> torch.Tensor:
    """[R, K] rows grouped by `rows` @ weight [n, K, N] -> [R, N] (torch's grouped_mm where it runs, else one
    batched product over padded rows; see `usaf.kernels.torch_path.grouped_matmul`)."""
    return torch_path.grouped_matmul(x, weight, rows)
