"""Live tensor bytes on the simulated card and in host memory, by what they are (the ledger's lines).

`MemoryTracker` is a `TorchDispatchMode` that sees every tensor an op returns: each new storage is counted once
(views share it) under the tag current when it was made (`tagged`: the dequantized workspace, the offload
buffers, the logits chunk, the optimizer step; anything else made during a step is an activation), and leaves
the count when the storage is freed (a weakref finalizer on the storage: torch keeps one Python object per
storage as long as it lives, and a tensor with a weakref could not be swapped by `Module.to`). `retag` moves a live tensor's bytes to another
line (a gradient that is the sparse state's, optimizer moments made inside the step). The peak keeps the bytes
by line at its moment.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

DEVICE, HOST = "device", "host"
ACTIVATIONS = "activations"


class _Storage:
    __slots__ = ("nbytes", "tag", "where")

    def __init__(self, nbytes: int, tag: str, where: str):
        self.nbytes, self.tag, self.where = nbytes, tag, where


class MemoryTracker(TorchDispatchMode):
    """Counts storages of tensors on `device_type` (the simulated card) and on the CPU (host memory)."""

    def __init__(self, device_type: str = "meta"):
        super().__init__()
        self.device_type = device_type
        self.storages: dict[int, _Storage] = {}
        self.live = Counter()  # (where, tag) -> bytes
        self.total = Counter()  # where -> bytes
        self.peak = Counter()
        # (where, tag) -> the line's own largest live bytes since the last reset_peak
        self.line_max = Counter()
        self.at_peak: dict[str, Counter] = {DEVICE: Counter(), HOST: Counter()}
        self.tags = [ACTIVATIONS]

    # ---- what is made and freed
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out

    def _where(self, t: torch.Tensor) -> str | None:
        kind = t.device.type
        return DEVICE if kind == self.device_type else HOST if kind == "cpu" else None

    def track(self, t: torch.Tensor, tag: str | None = None) -> None:
        """Count `t`'s storage (once) under `tag` (default: the current one)."""
        where = self._where(t)
        if where is None:
            return
        storage = t.untyped_storage()  # one Python object per storage, as long as it lives
        key = id(storage)
        if key in self.storages:
            return
        entry = self.storages[key] = _Storage(storage.nbytes(), tag or self.tags[-1], where)
        self._add(entry, entry.nbytes)
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        entry = self.storages.pop(key, None)
        if entry is not None:
            self._add(entry, -entry.nbytes)

    def _add(self, entry: _Storage, nbytes: int) -> None:
        self.live[(entry.where, entry.tag)] += nbytes
        if nbytes > 0 and self.live[(entry.where, entry.tag)] > self.line_max[(entry.where, entry.tag)]:
            self.line_max[(entry.where, entry.tag)] = self.live[(entry.where, entry.tag)]
        self.total[entry.where] += nbytes
        if nbytes > 0 and self.total[entry.where] > self.peak[entry.where]:
            self.peak[entry.where] = self.total[entry.where]
            self.at_peak[entry.where] = Counter(
                {tag: n for (where, tag), n in self.live.items() if where == entry.where and n}
            )

    def retag(self, t: torch.Tensor | None, tag: str) -> None:
        """Count `t`'s storage under `tag` from now on (tracking it first if it is not yet counted)."""
        if t is None or self._where(t) is None:
            return
        self.track(t, tag)
        entry = self.storages.get(id(t.untyped_storage()))
        if entry is None or entry.tag == tag:
            return
        self.live[(entry.where, entry.tag)] -= entry.nbytes
        entry.tag = tag
        self.live[(entry.where, tag)] += entry.nbytes
        key = (entry.where, tag)
        self.line_max[key] = max(self.line_max[key], self.live[key])

    def reset_peak(self) -> None:
        """A new peak from here (the warm-up step's is not the steady step's)."""
        self.line_max = Counter(self.live)
        for where in (DEVICE, HOST):
            self.peak[where] = self.total[where]
            self.at_peak[where] = Counter({tag: n for (w, tag), n in self.live.items() if w == where and n})

    @contextlib.contextmanager
    def tagged(self, tag: str):
        """Storages made within the block belong to `tag`."""
        self.tags.append(tag)
        try:
            yield
        finally:
            self.tags.pop()
