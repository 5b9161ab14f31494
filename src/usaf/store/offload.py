"""Where the frozen experts' quantized data lives, and how a routed expert's data reaches the compute device.

Three residencies:
- "device": all of it on the compute device (`ResidentParts`).
- "host": in host memory (pinned where an accelerator can copy from it asynchronously) and streamed to the device
  one MoE layer at a time, the next layer's copy issued on a side stream while the current layer computes.
- "mmap": memory-mapped from the prepared store and streamed the same way: for models larger than host memory.

Streamed layers share one `LayerStreamer`; its `ExpertCache` keeps the most-routed experts on the device within a
byte budget, so they are not streamed again. On a device without streams (the CPU) the copies are synchronous:
the code path is the same, which is how the tests exercise it.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

import torch

from usaf.kernels import host_ints_to_device


def _expert_index(expert_ids: list[int], device: torch.device):
    """Slices for a contiguous run of experts (no copy), else an index tensor."""
    if expert_ids == list(range(expert_ids[0], expert_ids[0] + len(expert_ids))):
        return slice(expert_ids[0], expert_ids[0] + len(expert_ids))
    return host_ints_to_device(expert_ids, device)


class ResidentParts:
    """Quantized parts ([E, ...] per part) kept whole on the compute device."""

    def __init__(self, parts: dict[str, torch.Tensor]):
        self.parts = parts
        self.device = next(iter(parts.values())).device

    def fetch(self, expert_ids: list[int]) -> dict[str, torch.Tensor]:
        index = _expert_index(expert_ids, self.device)
        return {name: t[index] for name, t in self.parts.items()}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    def __repr__(self) -> str:
        return f"ResidentParts({self.device})"


class StreamedParts:
    """Quantized parts kept off the device (host memory or a memory map); fetched through a `LayerStreamer`."""

    def __init__(self, parts: dict[str, torch.Tensor], streamer: LayerStreamer, layer: int):
        self.host = parts
        self.streamer = streamer
        self.layer = layer
        self.num_experts = next(iter(parts.values())).shape[0]
        self.bytes_per_expert = sum(t[0].numel() * t.element_size() for t in parts.values())
        streamer.register(self)

    @property
    def device(self) -> torch.device:
        return self.streamer.device

    def fetch(self, expert_ids: list[int]) -> dict[str, torch.Tensor]:
        return self.streamer.fetch(self, expert_ids)

    @property
    def nbytes(self) -> int:
        """The bytes held off the device (memory-mapped ones count in full, as they may all be paged in)."""
        return sum(t.numel() * t.element_size() for t in self.host.values())

    def __repr__(self) -> str:
        return f"StreamedParts(layer={self.layer}, {self.streamer.device})"


class _LayerCopy:
    """The device copy of one layer's experts that were not cached when it was issued."""

    def __init__(self):
        self.rows: dict[StreamedParts, dict[int, int]] = {}  # expert -> row of the copied tensors
        self.tensors: dict[StreamedParts, dict[str, torch.Tensor]] = {}
        self.event = None


class ExpertCache:
    """The most-routed experts' quantized data, kept on the device within `budget_bytes`.

    Each fetch counts the experts it asks for. When a layer's experts are on the device, an expert counted more
    often than the coldest cached one takes its place; among equally cold ones the least recently used leaves.
    """

    def __init__(self, budget_bytes: int):
        self.budget = max(0, int(budget_bytes))
        self.used = 0
        self.counts: Counter = Counter()
        self.entries: OrderedDict = (
            OrderedDict()
        )  # (parts, expert) -> {part: [1, ...]}, least recently used first
        self.hits = self.misses = 0

    def get(self, parts: StreamedParts, expert: int):
        return self.entries.get((parts, expert))

    def record(self, parts: StreamedParts, expert_ids: list[int]) -> None:
        for e in expert_ids:
            key = (parts, e)
            self.counts[key] += 1
            if key in self.entries:
                self.entries.move_to_end(key)
                self.hits += 1
            else:
                self.misses += 1

    def admit(self, parts: StreamedParts, rows: dict[int, int], tensors: dict[str, torch.Tensor]) -> None:
        """Offer the experts of `parts` that are on the device now (row `rows[e]` of `tensors`)."""
        size = parts.bytes_per_expert
        if self.budget < size:
            return
        candidates = sorted(
            (e for e in rows if self.counts[(parts, e)] > 0 and (parts, e) not in self.entries),
            key=lambda e: -self.counts[(parts, e)],
        )
        for e in candidates:
            count = self.counts[(parts, e)]
            while self.used + size > self.budget:
                coldest = min(self.entries, key=lambda k: self.counts[k], default=None)
                if coldest is None or self.counts[coldest] >= count:
                    return  # nothing colder to replace: the rest of the candidates are colder still
                self.used -= coldest[0].bytes_per_expert
                del self.entries[coldest]
            self.entries[(parts, e)] = {name: t[rows[e] : rows[e] + 1].clone() for name, t in tensors.items()}
            self.used += size


class LayerStreamer:
    """Streams the quantized experts of one MoE layer at a time to `device`, prefetching the next.

    "Next" follows the direction of travel: up the layers in a forward, down them in a backward (with or without
    recomputation). At most two layers' copies exist at a time, besides the cache.

    Going up, a layer's routing is not known before it runs, so the whole next layer is prefetched. Going down
    (the backward and its recomputation), each layer's routing is the one its forward used: only the experts that
    forward asked for are copied. An expert asked for that was not copied is fetched at once (a safe fallback,
    counted like any other copy in `bytes_streamed`). `routed_only=False` copies whole layers in both directions
    (what streaming cost before; benchmarks and tests compare the two).
    """

    def __init__(self, device: torch.device | str, cache_bytes: int = 0, routed_only: bool = True):
        self.device = torch.device(device)
        self.routed_only = routed_only
        self.layers: dict[int, list[StreamedParts]] = {}
        self.copies: dict[int, _LayerCopy] = {}
        self.current: int | None = None
        self.direction = 1
        self.cache = ExpertCache(cache_bytes)
        self.bytes_streamed = 0  # host -> device bytes of quantized expert data, cumulative
        self.routed: dict[
            int, set[int]
        ] = {}  # layer -> experts its last forward asked for (per parts, union)
        self._module, self._side_stream = _streams_for(self.device)

    def register(self, parts: StreamedParts) -> None:
        self.layers.setdefault(parts.layer, []).append(parts)

    def fetch(self, parts: StreamedParts, expert_ids: list[int]) -> dict[str, torch.Tensor]:
        self._enter(parts.layer)
        if self.direction > 0:
            self.routed.setdefault(parts.layer, set()).update(expert_ids)
        self.cache.record(parts, expert_ids)
        copy = self.copies[parts.layer]
        rows = copy.rows[parts]
        if all(e in rows for e in expert_ids):
            at = [rows[e] for e in expert_ids]
            tensors = copy.tensors[parts]
            if at == list(range(at[0], at[0] + len(at))):  # consecutive rows (the usual case): views, no copy
                return {
                    name: t if len(at) == t.shape[0] else t[at[0] : at[0] + len(at)]
                    for name, t in tensors.items()
                }
            index = host_ints_to_device(at, self.device)
            return {name: t.index_select(0, index) for name, t in tensors.items()}
        # some asked for are not in the layer's copy: gathered from the copy, the cache and (evicted since the
        # copy) host memory with one indexed copy a source, not one per expert (a launch each on a device)
        copied, cached, fetched = [], [], []
        for i, e in enumerate(expert_ids):
            if e in rows:
                copied.append((i, rows[e]))
            elif (entry := self.cache.get(parts, e)) is not None:
                cached.append((i, entry))
            else:
                fetched.append((i, e))
        out = {}
        for name, host in parts.host.items():
            dest = torch.empty((len(expert_ids), *host.shape[1:]), dtype=host.dtype, device=self.device)
            if copied:
                at, source = (host_ints_to_device(list(c), self.device) for c in zip(*copied, strict=True))
                dest.index_copy_(0, at, copy.tensors[parts][name].index_select(0, source))
            if cached:
                at = host_ints_to_device([i for i, _ in cached], self.device)
                dest.index_copy_(0, at, torch.cat([entry[name] for _, entry in cached]))
            for i, e in fetched:
                dest[i].copy_(host[e])
                self.bytes_streamed += host[e].numel() * host.element_size()
            out[name] = dest
        return out

    def _enter(self, layer: int) -> None:
        if layer == self.current:
            return
        if self.current is not None:
            self.direction = 1 if layer > self.current else -1
        if self.direction > 0:  # a new forward through this layer: its routing is recorded afresh
            self.routed.pop(layer, None)
        self.current = layer
        copy = self.copies.get(layer)
        if copy is None:  # not prefetched (the first layer, or a change of direction)
            copy = self._copy(layer, asynchronous=False)
        self._wait(copy)
        self.copies = {layer: copy}
        for parts in self.layers[layer]:
            self.cache.admit(parts, copy.rows[parts], copy.tensors[parts])
        following = layer + self.direction
        if following in self.layers:
            self.copies[following] = self._copy(following, asynchronous=self._side_stream is not None)

    def _copy(self, layer: int, asynchronous: bool) -> _LayerCopy:
        copy = _LayerCopy()
        if asynchronous:
            with self._module.stream(self._side_stream):
                self._fill(layer, copy, non_blocking=True)
                copy.event = self._side_stream.record_event()
        else:
            self._fill(layer, copy, non_blocking=False)
        return copy

    def _fill(self, layer: int, copy: _LayerCopy, non_blocking: bool) -> None:
        # going down, the layer's own forward told which experts it routes to; going up, all may be. The lowest
        # layer is where the next forward turns back up: it is copied whole.
        partial = self.routed_only and self.direction < 0 and layer != min(self.layers)
        routed = self.routed.get(layer) if partial else None
        for parts in self.layers[layer]:
            candidates = sorted(routed) if routed is not None else range(parts.num_experts)
            wanted = [e for e in candidates if self.cache.get(parts, e) is None]
            copy.rows[parts] = {e: i for i, e in enumerate(wanted)}
            copy.tensors[parts] = {}
            for name, host in parts.host.items():
                whole = len(wanted) == host.shape[0]
                if whole and host.device == self.device:  # every expert, where it lies: nothing to copy
                    dest = host
                elif whole:  # every expert: one copy
                    dest = host.to(self.device, non_blocking=non_blocking)
                else:  # contiguous runs: one copy each, straight from host
                    dest = torch.empty((len(wanted), *host.shape[1:]), dtype=host.dtype, device=self.device)
                    for start, stop, at in _runs(wanted):
                        dest[at : at + stop - start].copy_(host[start:stop], non_blocking=non_blocking)
                copy.tensors[parts][name] = dest
                self.bytes_streamed += dest.numel() * dest.element_size()

    def _wait(self, copy: _LayerCopy) -> None:
        if copy.event is None:
            return
        current = self._module.current_stream(self.device)
        current.wait_event(copy.event)
        for tensors in copy.tensors.values():
            for t in tensors.values():
                t.record_stream(current)  # the allocator must not reuse it while the compute stream reads it
        copy.event = None


def _runs(experts: list[int]):
    """(first, last + 1, position in `experts`) of each run of consecutive ids."""
    at = 0
    while at < len(experts):
        end = at
        while end + 1 < len(experts) and experts[end + 1] == experts[end] + 1:
            end += 1
        yield experts[at], experts[end] + 1, at
        at = end + 1


def _streams_for(device: torch.device):
    """(device module, side stream) where the device has streams (CUDA, ROCm, XPU); (None, None) elsewhere."""
    if device.type == "cpu":
        return None, None
    module = getattr(torch, device.type, None)
    if module is None or not all(hasattr(module, a) for a in ("Stream", "stream", "current_stream")):
        return None, None
    return module, module.Stream(device)


def host_copy(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` copied into host memory, pinned when `device` is an accelerator that copies from pinned memory
    asynchronously."""
    pin = device.type in ("cuda", "xpu")
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
    out.copy_(tensor)
    return out
