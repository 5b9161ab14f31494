"""What every benchmark script shares: the machine's and libraries' facts, functions and long-lived workers in
forked processes, peak memory (resident set and live tensors), timing side by side, markdown tables and result
files and charts. Scripts import this module, never each other's private helpers.

torch, transformers and matplotlib are imported inside the functions that use them: a parent process that only
forks workers (compare.py, quality.py) never pays for their imports."""

from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import importlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

# ---- facts: the machine and the libraries a result was measured with -------------------------------------------


def machine() -> dict:
    import torch
    import transformers

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


def library_versions() -> dict:
    """Versions of the optional libraries a result depends on (None where one is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("peft", "bitsandbytes", "usaf"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def environment(threads: int) -> dict:
    """{machine, versions} as a process with `threads` torch threads sees them (what every result records)."""
    import torch

    torch.set_num_threads(threads)
    return {"machine": machine(), "versions": library_versions()}


# ---- processes: a function, or a long-lived worker, in a fork of a server that imported the libraries once ----


def call_main(conn, module: str, name: str, kwargs: dict) -> None:
    """Entry point of a helper process: run `module.name(**kwargs)`, send back its result or its traceback."""
    try:
        conn.send({"result": getattr(importlib.import_module(module), name)(**kwargs)})
    except BaseException:
        conn.send({"error": traceback.format_exc()})


def call_in_fork(context, module: str, name: str, **kwargs):
    """`module.name(**kwargs)` in a fresh process of `context` (a multiprocessing context); its result. A fresh
    process keeps the parent free of torch and of model memory, and makes the peak memory the call's own."""
    parent, child = context.Pipe()
    proc = context.Process(target=call_main, args=(child, module, name, kwargs), daemon=True)
    proc.start()
    child.close()
    try:
        reply = parent.recv()
    except EOFError:
        reply = {"error": f"{name}: the helper process died (exit code {proc.exitcode})"}
    proc.join()
    if "error" in reply:
        raise RuntimeError(reply["error"])
    return reply["result"]


def map_in_forks(context, module: str, name: str, calls: list[dict], jobs: int):
    """`module.name(**kwargs)` for every kwargs of `calls`, each in its own process, `jobs` at a time; yields
    (kwargs, result, error, seconds) in the order of `calls` (error: the traceback, result None)."""

    def one(kwargs):
        began = time.perf_counter()
        try:
            result, error = call_in_fork(context, module, name, **kwargs), None
        except RuntimeError as err:
            result, error = None, str(err)
        return kwargs, result, error, time.perf_counter() - began

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        yield from pool.map(one, calls)


def serve_worker(conn, job: dict) -> None:
    """Entry point of a long-lived worker process: build `job["worker"]` ("module:Class") from the job, report
    ready, then run each command (a method name and its keyword arguments) until "finish"."""
    with open(
        job["log"], "a", buffering=1
    ) as log:  # library chatter to the worker's log, not the parent's stdout
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        module, cls = job["worker"].split(":")
        worker = getattr(importlib.import_module(module), cls)(job)
        conn.send({"ready": True, "setup_s": worker.setup_s})
        while True:
            message = conn.recv()
            cmd = message.pop("cmd")
            conn.send(getattr(worker, cmd)(**message))
            if cmd == "finish":
                return
    except BaseException:
        traceback.print_exc()
        with contextlib.suppress(Exception):
            conn.send({"error": traceback.format_exc()})


class WorkerPool:
    """Long-lived workers, one per key, forked from a server that imported the heavy libraries once; they obey
    commands in rounds, so a noisy machine slows them all alike. A worker that fails is reported and stopped."""

    def __init__(self, context, jobs: dict[str, dict], parallel: int):
        self.context, self.procs, self.conns, self.errors, self.setup = context, {}, {}, {}, {}
        self.logs = {key: Path(job["log"]) for key, job in jobs.items()}
        keys = list(jobs)
        # a few at a time (one per CPU): loading transients of big models must not pile up
        for first in range(0, len(keys), parallel):
            group = keys[first : first + parallel]
            began = time.perf_counter()
            for key in group:
                parent, child = context.Pipe()
                proc = context.Process(target=serve_worker, args=(child, jobs[key]), daemon=True)
                proc.start()
                child.close()
                self.procs[key], self.conns[key] = proc, parent
            for key in group:
                reply = self._receive(key)
                if reply is not None:
                    self.setup[key] = reply["setup_s"]
                    print(
                        f"  {key}: ready (model {reply['setup_s']:.1f} s, process "
                        f"{time.perf_counter() - began:.1f} s)",
                        flush=True,
                    )

    def _receive(self, key: str):
        try:
            reply = self.conns[key].recv()
        except EOFError:
            reply = {"error": f"the process died (exit code {self.procs[key].exitcode}); see its log"}
        if "error" in reply:
            self.errors[key] = reply["error"]
            with contextlib.suppress(OSError):
                reply["error"] += "\n-- log tail --\n" + self.logs[key].read_text()[-3000:]
            print(f"  {key}: FAILED\n{reply['error'][-4000:]}", flush=True)
            self._stop(key)
            return None
        return reply

    def _stop(self, key: str) -> None:
        self.procs[key].join(timeout=30)
        if self.procs[key].is_alive():
            self.procs[key].kill()
        del self.procs[key], self.conns[key]

    @property
    def alive(self) -> list[str]:
        return list(self.conns)

    def round(self, rotation: int, cmd: str, **kwargs) -> None:
        """`cmd` to every worker in turn, one at a time (what is timed), starting from a rotated worker."""
        keys = self.alive
        keys = keys[rotation % len(keys) :] + keys[: rotation % len(keys)] if keys else keys
        for key in keys:
            self.conns[key].send({"cmd": cmd, **kwargs})
            self._receive(key)

    def broadcast(self, cmd: str, parallel: int) -> dict:
        """`cmd` to every worker, a few at a time (for what is not timed: evaluation); {key: reply}."""
        results, keys = {}, self.alive
        for first in range(0, len(keys), parallel):
            group = keys[first : first + parallel]
            for key in group:
                self.conns[key].send({"cmd": cmd})
            for key in group:
                reply = self._receive(key)
                if reply is not None:
                    results[key] = reply
        return results

    def finish(self, parallel: int) -> dict:
        """Every worker's `finish()`, then the processes end."""
        results = self.broadcast("finish", parallel)
        for key in results:
            self._stop(key)
        return results


# ---- timing ----------------------------------------------------------------------------------------------------


def sync() -> None:
    import torch

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


# ---- markdown tables, charts and result files ------------------------------------------------------------------


def run_commands(commands: list[list[str]], env: dict) -> None:
    """A bench's command lines in turn (`usaf train`, then `usaf export` of its run); the first that fails raises
    with its command line and the tail of its stderr."""
    for command in commands:
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode:
            raise RuntimeError(f"{shlex.join(command)} failed:\n{done.stderr[-3000:]}")


def fmt(value, pattern: str = "{:.2f}") -> str:
    """A table cell: `pattern` applied to `value`, a dash where there is none."""
    return "–" if value is None else pattern.format(value)


def params_label(n: int) -> str:
    """A parameter count the way the tables print it: millions, or thousands below 0.1 M."""
    return f"{n / 1e6:.2f} M" if n >= 1e5 else f"{n / 1e3:.1f} k"


def table(header: list[str], rows: list[list], align: str = "") -> list[str]:
    """A markdown table's lines: the header, its rule (`align`: one letter a column, "l" left or "r" right; left
    where it runs out), then a line a row: str() of each cell, None for a blank one (a row may have fewer cells
    than the header)."""
    rule = ["---:" if a == "r" else "---" for a in align.ljust(len(header), "l")]

    def line(cells) -> str:
        return "|" + "|".join(" " if cell is None else f" {cell} " for cell in cells) + "|"

    return [line(header), "|" + "|".join(rule) + "|", *map(line, rows)]


def subplots(rows: int, cols: int, figsize: tuple[float, float]):
    """A figure and its grid of axes (always 2-D), drawn off-screen: benchmarks run on machines without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(rows, cols, figsize=figsize, squeeze=False)


def save_figure(fig, path: Path, right: float | None = None) -> None:
    """Lay the figure out (`right`: the plots' right edge, to leave room for a legend beside them), write it as a
    PNG and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    if right is not None:
        fig.subplots_adjust(right=right)
    fig.savefig(path, dpi=110)
    plt.close(fig)


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


# ---- peak memory: the resident set, the allocator's peak, live tensors -----------------------------------------


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

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def reset_peak_rss() -> bool:
    """Restart the peak RSS (VmHWM := VmRSS, Linux >= 4.0); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """Peak memory of this process above a baseline: VmHWM (reset through /proc/self/clear_refs) on CPU, the
    allocator's peak on CUDA/ROCm."""

    def __init__(self, device):
        import torch

        self.torch, self.device = torch, device
        self.cuda = device.type == "cuda"
        self.baseline = 0 if self.cuda else proc_status_bytes("VmRSS")

    def reset(self) -> None:
        """Forget transients so far (loading, preparing): the peak from here on is what training needs."""
        gc.collect()
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats(self.device)
            return
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the system, or RSS keeps it
        reset_peak_rss()

    def now(self) -> int:
        if self.cuda:
            return int(self.torch.cuda.memory_allocated(self.device))
        return proc_status_bytes("VmRSS") - self.baseline

    def peak(self) -> int:
        if self.cuda:
            return int(self.torch.cuda.max_memory_allocated(self.device))
        return proc_status_bytes("VmHWM") - self.baseline


def own_mapped_weights(model) -> None:
    """Copy into process memory every weight still backed by the checkpoint's memory map. Loading leaves some
    tensors as views of the mapped file, which keeps the whole file's pages in the resident set (as file pages):
    the peak would count the checkpoint once more, for the methods loaded that way only."""
    import torch

    mapped = []
    with contextlib.suppress(OSError), open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[5].endswith(".safetensors"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                mapped.append((start, end))
    if not mapped:
        return
    with torch.no_grad():
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for tensor in table.values():
                    if (
                        tensor is not None
                        and tensor.device.type == "cpu"
                        and any(start <= tensor.data_ptr() < end for start, end in mapped)
                    ):
                        tensor.data = tensor.data.clone()


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
