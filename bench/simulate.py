"""The issue's four simulated configurations (usaf plan --simulate), one process each; writes
bench/results/simulate-<date>.md and .json. Run: PYTHONPATH=src python bench/simulate.py [--date 2026-12-07]"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

RUNS = [
    (
        "Qwen3-30B-A3B, 12 GB, seq 2048",
        "--model qwen3-30b-a3b --vram 12GB --ram 32GB --seq 2048",
    ),
    ("gpt-oss-20b, 16 GB", "--model gpt-oss-20b --vram 16GB --ram 32GB"),
    (
        "Qwen3-235B-A22B, EP 8, 24 GB cards",
        "--model qwen3-235b-a22b --gpus 8 --expert-parallel 8 --vram 24GB --ram 1TB",
    ),
    ("DeepSeek-V3, EP 8, 80 GB", "--model deepseek-v3 --gpus 8 --expert-parallel 8 --vram 80GB --ram 1TB"),
    # the same without reselection: the step without the probe window (each EP rank probes its own experts'
    # candidate lines, usaf.selection.reselect; before 2026-12-08 every rank probed the job's: docs/simulate.md)
    (
        "DeepSeek-V3, EP 8, 80 GB, --no-reselect",
        "--model deepseek-v3 --gpus 8 --expert-parallel 8 --vram 80GB --ram 1TB --no-reselect",
    ),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    parser.add_argument("--timeout", type=int, default=1200)
    args = parser.parse_args()
    rows = []
    for name, flags in RUNS:
        command = f"usaf plan {flags} --simulate"
        started = time.perf_counter()
        try:
            done = subprocess.run(
                [sys.executable, "-m", "usaf", "plan", *flags.split(), "--simulate"],
                capture_output=True,
                text=True,
                timeout=args.timeout,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            out, rc = done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired:
            out, rc = "timed out", None
        row = {"name": name, "command": command, "rc": rc, "seconds": round(time.perf_counter() - started, 1)}
        if m := re.search(
            r"device peak: ([\d.]+ \w+) simulated .* vs ([\d.]+ \w+) planned \(([+-][\d.]+%)", out
        ):
            row.update(simulated=m[1], planned=m[2], difference=m[3])
        if m := re.search(r"host syncs: (\d+) a step: ([\d.]+) a layer-step .* \+ (\d+) once a step", out):
            row.update(syncs_per_step=int(m[1]), syncs_per_layer_step=float(m[2]), per_step_syncs=int(m[3]))
        if m := re.search(r"device mismatches: (\d+)", out):
            row["mismatches"] = int(m[1])
        row["output"] = [
            line for line in out.splitlines() if "Warning" not in line and "return func" not in line
        ][-25:]
        rows.append(row)
        print(name, {k: v for k, v in row.items() if k != "output"}, flush=True)
    results = Path(__file__).parent / "results"
    (results / f"simulate-{args.date}.json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = [
        f"# usaf plan --simulate ({args.date})",
        "",
        f"Made by `PYTHONPATH=src python bench/simulate.py --date {args.date}`.",
        "",
        "| configuration | planned peak | simulated peak | difference | syncs/step | syncs/layer-step | once a step "
        "| mismatches | s | command |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r.get('planned', '-')} | {r.get('simulated', '-')} | {r.get('difference', '-')} | "
            f"{r.get('syncs_per_step', '-')} | {r.get('syncs_per_layer_step', '-')} | {r.get('per_step_syncs', '-')} | "
            f"{r.get('mismatches', '-')} | "
            f"{r['seconds']} | `{r['command']}` |"
        )
    for r in rows:
        lines += ["", f"## {r['name']} (exit {r['rc']})", "", "```", *r["output"], "```"]
    (results / f"simulate-{args.date}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
