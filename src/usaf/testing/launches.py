"""Count what a step would cost a GPU's host: top-level aten ops (each at least one kernel launch) and host syncs
(reads of tensor data by the host, which drain the device's queue). Counted on any device, the CPU included.

Ops: `torch.profiler` with record_shapes off; an op counts when its name starts with "aten::" and no event above it
(`FunctionEvent.cpu_parent`, per thread, so the autograd engine's backward thread is walked as well) is an aten op:
`aten::linear` counts once, not with its `aten::t` and `aten::addmm`. That is what issue 22 measured. `method=
"dispatch"` counts with a `TorchDispatchMode` instead (every op that reaches the dispatcher below autograd, after
composite ops have been decomposed: higher counts, a different baseline), for a profiler whose tree is unreliable.

Syncs: a `TorchFunctionMode` that intercepts `Tensor.tolist/item/__bool__/__int__/__float__/__index__/cpu/numpy`
and `Tensor.to` with an explicit CPU device (on the CPU, these do not always dispatch `aten::_local_scalar_dense`,
so the profiler alone cannot see them), plus every `aten::_local_scalar_dense` in the profile not under one of those
(an op reading a scalar on the host in C++: validation, an output size). The same calls count on every device,
because on a GPU each is a sync. The mode pops itself while a handler runs: `bool(t)` calling `item` counts once.

`cpu_only_syncs`, not in `syncs`: reads that would not sync on a GPU. `_grouped_mm`'s CPU implementation reads each
group's offset on the host (its CUDA kernel on the device; issue 22's `_local_scalar_dense` count included these,
four per expert a layer-step), and torch's optimizers read their step counters, which stay on the host unless
capturable or fused (on a GPU run, any CPU tensor's read).

`shape_syncs`, reported apart: ops whose output size depends on the data (nonzero, unique, masked_select), which
sync on CUDA without any host read in Python. `repeat_interleave` without an output size reads its size through
`_local_scalar_dense` and counts among the syncs.
"""

from __future__ import annotations

import gc
import inspect
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Counts", "count_launches", "per_layer"]

_HOST_READS = {
    torch.Tensor.tolist: "tolist",
    torch.Tensor.item: "item",
    torch.Tensor.__bool__: "bool",
    torch.Tensor.__int__: "int",
    torch.Tensor.__float__: "float",
    torch.Tensor.__index__: "index",
    torch.Tensor.numpy: "numpy",
    torch.Tensor.cpu: "cpu",
}
# data-dependent output sizes: the device must tell the host how big the result is
_SHAPE_SYNC_OPS = ("aten::nonzero", "aten::_unique", "aten::unique", "aten::masked_select")
_USAF = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # src/usaf
_HERE = os.path.abspath(__file__)
_HOST_READ = "usaf::host_read"
_DEVICE_SIDE_ON_GPU = ("aten::_grouped_mm", "aten::grouped_mm")


@dataclass
class Counts:
    """ops: top-level aten ops; syncs: host reads of tensor data; names: ops by name; sync_sites: "file:line
    (kind)" of each sync's caller, the innermost frame in src/usaf (else the innermost outside torch)."""

    ops: int = 0
    syncs: int = 0
    names: Counter = field(default_factory=Counter)
    sync_sites: Counter = field(default_factory=Counter)
    shape_syncs: int = 0
    method: str = "profiler"
    # reads that would not sync on a GPU, so not in `syncs`: inside grouped_mm's CPU implementation, and of
    # tensors that stay on the host in a GPU run too (torch optimizers' step counters)
    cpu_only_syncs: int = 0
    shape_sync_ops: Counter = field(default_factory=Counter)  # "op < outermost aten op"

    def __sub__(self, other: Counts) -> Counts:
        return Counts(
            self.ops - other.ops,
            self.syncs - other.syncs,
            _minus(self.names, other.names),
            _minus(self.sync_sites, other.sync_sites),
            self.shape_syncs - other.shape_syncs,
            self.method,
            self.cpu_only_syncs - other.cpu_only_syncs,
            _minus(self.shape_sync_ops, other.shape_sync_ops),
        )

    def top(self, n: int = 8) -> list[tuple[str, int]]:
        return self.names.most_common(n)


def _minus(a: Counter, b: Counter) -> Counter:
    out = Counter(a)
    out.subtract(b)
    return Counter({k: v for k, v in out.items() if v})


def _caller() -> str:
    frame = inspect.currentframe().f_back.f_back
    fallback = None
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path != _HERE:
            if path.startswith(_USAF):
                return f"{os.path.relpath(path, os.path.dirname(_USAF))}:{frame.f_lineno}"
            if fallback is None and f"{os.sep}torch{os.sep}" not in path:
                fallback = f"{path}:{frame.f_lineno}"
        frame = frame.f_back
    return fallback or "?"


def _to_cpu(args, kwargs) -> bool:
    """Tensor.to(...) names the CPU explicitly (a device, a device string, or a CPU tensor to copy the type of)."""
    for value in (*args[1:], kwargs.get("device")):
        if isinstance(value, (str, torch.device)):
            try:
                return torch.device(value).type == "cpu"
            except RuntimeError:
                continue  # a dtype-like string
        if isinstance(value, torch.Tensor):
            return value.device.type == "cpu"
    return False


def _in_torch_optim() -> bool:
    """The read's caller (the first frame outside this module and torch.overrides) is in torch.optim."""
    frame = inspect.currentframe().f_back
    while frame is not None and (
        os.path.abspath(frame.f_code.co_filename) == _HERE
        or frame.f_code.co_filename.endswith("overrides.py")
    ):
        frame = frame.f_back
    return frame is not None and f"{os.sep}torch{os.sep}optim{os.sep}" in frame.f_code.co_filename


class _SyncMode(TorchFunctionMode):
    def __init__(self, counts: Counts, profiled: bool, device: torch.device):
        super().__init__()
        self.counts = counts
        self.profiled = profiled
        self.on_cpu = device.type == "cpu"
        self.reading = 0

    def _host_resident(self, tensor: torch.Tensor, kind: str) -> bool:
        """A read that would not sync on a GPU: of a tensor that lives on the host in a GPU run as well. On a GPU,
        any CPU tensor; on the CPU, torch's optimizers' `step` counters (kept on the host unless capturable or
        fused, read by `_get_value`)."""
        if not self.on_cpu:
            return tensor.device.type == "cpu" and kind not in ("cpu", "to(cpu)")
        return _in_torch_optim()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _HOST_READS.get(func)
        if kind is None and func is torch.Tensor.to and _to_cpu(args, kwargs):
            kind = "to(cpu)"
        if kind is not None and args and isinstance(args[0], torch.Tensor):
            if self._host_resident(args[0], kind):
                self.counts.cpu_only_syncs += 1
            else:
                self.counts.syncs += 1
                self.counts.sync_sites[f"{_caller()} ({kind})"] += 1
            # the read's own ops (item, is_nonzero, resolve_conj, ...) are the sync, not launches of the step
            self.reading += 1
            try:
                if self.profiled:
                    with torch.profiler.record_function(_HOST_READ):
                        return func(*args, **kwargs)
                return func(*args, **kwargs)
            finally:
                self.reading -= 1
        return func(*args, **kwargs)


class _OpMode(TorchDispatchMode):
    def __init__(self, counts: Counts, syncs: _SyncMode):
        super().__init__()
        self.counts = counts
        self.syncs = syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.syncs.reading:
            return func(*args, **(kwargs or {}))
        name = f"aten::{func._schema.name.split('::')[-1]}"
        # called directly, not through a Tensor method the sync mode sees: a sync, not a launch
        if name == "aten::_local_scalar_dense":
            self.counts.syncs += 1
            self.counts.sync_sites[f"{_caller()} (_local_scalar_dense)"] += 1
            return func(*args, **(kwargs or {}))
        self.counts.ops += 1
        self.counts.names[name] += 1
        if name.startswith(_SHAPE_SYNC_OPS) or (
            name == "aten::index"
            and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        ):
            self.counts.shape_syncs += 1
        return func(*args, **(kwargs or {}))


def count_launches(fn: Callable[[], object], method: str = "profiler", device="cpu") -> Counts:
    """Run `fn()` once; its top-level aten ops and host syncs (see the module's docstring). `device`: where the
    step runs (on a GPU, reads of CPU tensors are not syncs)."""
    counts = Counts(method=method)
    device = torch.device(device)
    if method == "dispatch":
        syncs = _SyncMode(counts, profiled=False, device=device)
        with syncs, _OpMode(counts, syncs):
            fn()
        return counts
    if method != "profiler":
        raise ValueError(f"method must be 'profiler' or 'dispatch', got {method!r}")
    activities = [torch.profiler.ProfilerActivity.CPU]
    with (
        torch.profiler.profile(activities=activities, record_shapes=False, with_stack=False) as prof,
        _SyncMode(counts, profiled=True, device=device),
    ):
        fn()
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CPU or not event.name.startswith("aten::"):
            continue
        up, outer, read = event.cpu_parent, None, False
        while up is not None:
            read = read or up.name == _HOST_READ
            if up.name.startswith("aten::"):
                outer = up
            up = up.cpu_parent
        if event.name.startswith(_SHAPE_SYNC_OPS) and not read:
            counts.shape_syncs += 1
            counts.shape_sync_ops[f"{event.name} < {outer.name if outer else '-'}"] += 1
        if event.name == "aten::_local_scalar_dense" and not read:
            # an op that reads a scalar on the host itself (C++ `.item()`: sizes, validation): a sync as well,
            # except grouped_mm's CPU loop over groups (its CUDA kernel reads the offsets on the device)
            where = outer.name if outer else event.name
            if where in _DEVICE_SIDE_ON_GPU:
                counts.cpu_only_syncs += 1
            else:
                counts.syncs += 1
                counts.sync_sites[f"{where} (inside an op)"] += 1
        if outer is None and not read:
            counts.ops += 1
            counts.names[event.name] += 1
    return counts


def per_layer(
    make_step_for_layers: Callable[[int], Callable[[], object]], method: str = "profiler", device="cpu"
) -> Counts:
    """Counts of one step of a 2-layer model minus a 1-layer model (same config otherwise): what one more decoder
    layer adds. `make_step_for_layers(n)` builds the n-layer model and returns its step; each step runs once to warm
    up (lazy state, optimizer moments), the second is counted; models are built one at a time and freed."""
    counts = {}
    for layers in (1, 2):
        step = make_step_for_layers(layers)
        step()
        counts[layers] = count_launches(step, method, device)
        del step
        gc.collect()
    return counts[2] - counts[1]
