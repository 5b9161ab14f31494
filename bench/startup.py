"""How fast does `usaf` answer before any work: `--help`, `--version` and argument errors, each run N times in a
fresh process (as hyperfine does), median, min and max wall time, beside the bare interpreter's start.

    python bench/startup.py [--src SRC ...] [--runs N] [--out FILE]   # SRC: a checkout's src (default: this one)

Several --src are measured side by side (their runs interleaved, so a shared machine's load falls on each alike):
the figures of one file compare. The parent never imports usaf (or torch): every figure is a `python -m usaf ...`
subprocess with PYTHONPATH=SRC and one torch thread; the load average before and after is recorded with them.
A subcommand's --help builds that command's options, some of which (the config's choices, the planner's presets)
import torch: those rows say what a user waits for there.
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
    ("usaf train --help", ["-m", "usaf", "train", "--help"], 0),
    ("usaf plan --help", ["-m", "usaf", "plan", "--help"], 0),
    ("usaf export --help", ["-m", "usaf", "export", "--help"], 0),
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


def main(sources: list[Path], runs: int, out: Path | None) -> None:
    envs = [{**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"} for src in sources]
    load_before = os.getloadavg()[0]
    rows = []
    for label, args, expected in CASES:
        for env in envs:
            timed(args, env, expected)  # warm the file cache and the bytecode, as hyperfine's warm-up run
        times = [[] for _ in envs]
        for _ in range(runs):
            for index, env in enumerate(envs):
                times[index].append(timed(args, env, expected))
        rows.append((label, [f"{statistics.median(t):.3f} ({min(t):.3f}-{max(t):.3f})" for t in times]))
    load_after = os.getloadavg()[0]
    commits = [commit(src) for src in sources]
    lines = [
        f"<!-- made by: python bench/startup.py {' '.join(f'--src {s}' for s in sources)} --runs {runs} "
        f"({', '.join(commits)}) -->",
        "",
        f"## Start time of `usaf` ({', '.join(commits)})",
        "",
        f"{runs} runs each after one warm-up, interleaved, wall seconds, median (min-max); {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}, load average {load_before:.1f} before and "
        f"{load_after:.1f} after (a shared machine: compare within a row, and the interpreter's own start).",
        "",
        "| command | " + " | ".join(f"{c} s" for c in commits) + " |",
        "| --- |" + " ---: |" * len(commits),
        *(f"| `{label}` | " + " | ".join(cells) + " |" for label, cells in rows),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if out is not None:
        out.write_text(text)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--src", type=Path, action="append", help="a checkout's src, once per checkout (default: this one)"
    )
    parser.add_argument("--runs", type=int, default=10, help="timed runs per command (default 10)")
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown to this file")
    options = parser.parse_args()
    main([src.resolve() for src in options.src or [REPO / "src"]], options.runs, options.out)
