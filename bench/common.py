"""Shared helpers for benchmarks: timing medians side by side, machine facts, result files."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import transformers

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def interleaved_medians(fns: dict, repeats: int, warmup: int = 1) -> dict:
    """Run every function once per round, round after round, so machine noise hits all alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    return {
        name: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t), "runs": len(t)}
        for name, t in times.items()
    }


def write_results(stem: str, payload: dict, markdown: str, out_dir: Path = RESULTS) -> tuple[Path, Path]:
    """<out_dir>/<stem>-<date>.{json,md} (bench/results/ by default), written atomically."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    day = _dt.date.today().isoformat()
    paths = []
    for suffix, text in ((".json", json.dumps(payload, indent=2, default=str)), (".md", markdown)):
        path = out_dir / f"{stem}-{day}{suffix}"
        tmp = path.with_suffix(suffix + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
        paths.append(path)
    return paths[0], paths[1]


def proc_status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS, VmHWM) in bytes; elsewhere the lifetime peak RSS."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return lifetime_peak_rss()


def lifetime_peak_rss() -> int:
    """The process's peak RSS since it started, in bytes (getrusage; macOS reports bytes, Linux KiB)."""
    import resource
    import sys

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def reset_peak_rss() -> bool:
    """Restart the peak RSS (VmHWM := VmRSS, Linux >= 4.0); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class TensorPeak:
    """Peak bytes of live tensors over a block of code, on the CPU: what a GPU's caching allocator reports as its
    peak (`torch.cuda.max_memory_allocated`), without the C allocator's or oneDNN's caches that RSS includes.

    `resident()` counts the storages of every tensor alive before the block (weights, quantized stores, optimizer
    state); inside the block, a dispatch mode adds each new storage an op creates and subtracts it when it is freed.
    Peak = resident + the highest sum of new storages; `at_peak` names what was live then (op and shape).
    """

    def __init__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracker._record(func, args, kwargs, out)
                return out

        self._torch, self._mode = torch, _Mode()
        self.live: dict[int, tuple[int, str]] = {}
        self.current = self.peak_new = 0
        self.at_peak: dict[str, int] = {}
        self.resident_bytes = 0

    def resident(self) -> int:
        import gc

        storages = {}
        for obj in gc.get_objects():
            if isinstance(obj, self._torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
                with contextlib.suppress(RuntimeError):  # tensors without storage (e.g. sparse)
                    storage = obj.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def __enter__(self):
        self.resident_bytes = self.resident()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)

    @property
    def peak(self) -> int:
        return self.resident_bytes + self.peak_new

    def _record(self, func, args, kwargs, out) -> None:
        import weakref

        from torch.utils._pytree import tree_flatten

        tensor = self._torch.Tensor
        # sparse tensors (a sampled product's pattern) have no storage of their own: their parts are counted
        strided = self._torch.strided
        inputs = {
            a.untyped_storage().data_ptr()
            for a in tree_flatten((args, kwargs))[0]
            if isinstance(a, tensor) and a.layout == strided
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, tensor) or t.device.type != "cpu" or t.layout != strided:
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in inputs or key in self.live or storage.nbytes() == 0:  # a view, or already counted
                continue
            self.live[key] = (storage.nbytes(), f"{func.__name__}{tuple(t.shape)}")
            self.current += storage.nbytes()
            weakref.finalize(storage, self._free, key)
        if self.current > self.peak_new:
            self.peak_new = self.current
            at_peak: dict[str, int] = {}
            for nbytes, name in self.live.values():
                at_peak[name] = at_peak.get(name, 0) + nbytes
            self.at_peak = at_peak

    def _free(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.current -= entry[0]
