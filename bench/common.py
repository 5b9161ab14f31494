"""Shared helpers for benchmarks: timing medians side by side, machine facts, result files."""

from __future__ import annotations

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


def write_results(stem: str, payload: dict, markdown: str) -> tuple[Path, Path]:
    """bench/results/<stem>-<date>.{json,md}, written atomically."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    day = _dt.date.today().isoformat()
    paths = []
    for suffix, text in ((".json", json.dumps(payload, indent=2)), (".md", markdown)):
        path = RESULTS / f"{stem}-{day}{suffix}"
        tmp = path.with_suffix(suffix + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
        paths.append(path)
    return paths[0], paths[1]
