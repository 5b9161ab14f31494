"""How fast does `usaf` answer before any work: `--help`, `--version` and argument errors, each run N times in a
fresh process (as hyperfine does), median, min and max wall time, beside the bare interpreter's start.

    python bench/startup.py [--src SRC] [--runs N] [--out FILE]   # SRC: a checkout's src (default: this one)

The parent never imports usaf (or torch): every figure is a `python -m usaf ...` subprocess with PYTHONPATH=SRC and
one torch thread. The machine may be shared: the load average before and after is recorded with the figures.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# (what is measured, the arguments after `python`); the exit status each must give
CASES = [
    ("python -c pass (the interpreter alone)", ["-c", "pass"], 0),
    ("usaf --help", ["-m", "usaf", "--help"], 0),
    ("usaf --version", ["-m", "usaf", "--version"], 0),
    ("usaf train --no-such-flag", ["-m", "usaf", "train", "--no-such-flag"], 2),
    ("usaf bogus", ["-m", "usaf", "bogus"], 2),
]


def timed(args: list[str], env: dict, expected: int) -> float:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - start
    if done.returncode != expected:
        raise SystemExit(
            f"{' '.join(args)} exited {done.returncode} (expected {expected}): {done.stderr[-2000:]}"
        )
    return seconds


def commit(src: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip() or "unknown"


def main(src: Path, runs: int, out: Path | None) -> None:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    load_before = os.getloadavg()[0]
    rows = []
    for label, args, expected in CASES:
        timed(args, env, expected)  # warm the file cache and the bytecode, as hyperfine's warm-up run
        times = [timed(args, env, expected) for _ in range(runs)]
        rows.append((label, statistics.median(times), min(times), max(times)))
    load_after = os.getloadavg()[0]
    lines = [
        f"<!-- made by: python bench/startup.py --src {src} --runs {runs} ({commit(src)}) -->",
        "",
        f"## Start time of `usaf` ({commit(src)})",
        "",
        f"{runs} runs each after one warm-up, wall seconds; {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, load average {load_before:.1f} before and {load_after:.1f} after "
        "(a shared machine: compare rows of one file, and the interpreter's own start).",
        "",
        "| command | median s | min s | max s |",
        "| --- | ---: | ---: | ---: |",
        *(f"| `{label}` | {median:.3f} | {low:.3f} | {high:.3f} |" for label, median, low, high in rows),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if out is not None:
        out.write_text(text)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", type=Path, default=REPO / "src", help="a checkout's src (default: this one)")
    parser.add_argument("--runs", type=int, default=10, help="timed runs per command (default 10)")
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown to this file")
    options = parser.parse_args()
    main(options.src.resolve(), options.runs, options.out)
