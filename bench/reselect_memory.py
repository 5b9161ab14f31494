"""Peak memory with and without dynamic reselection, and of gradient calibration (issue 14, item 4).

A random Qwen3-MoE-shaped model (fp32, 1 % element entries, gradient selection calibrated on 4 batches) trains for
a number of steps in a fresh subprocess per configuration, with and without `select.reselect_every`, with and
without per-layer recomputation. Each child reports:
- live-tensor peaks (bench/harness.py's TensorPeak: what a GPU allocator's peak counts) of the calibration and of
  every training step, the reselection steps and the probe steps before them included;
- the process's peak RSS (VmHWM, reset after imports and a warm-up) over calibration and over training.
A reselected run must peak within 10 % of the same run without reselection, however many reselections it makes,
and calibration no higher than a training step.

    .venv/bin/python bench/reselect_memory.py            # writes bench/results/reselect_memory-<date>.{json,md}
    .venv/bin/python bench/reselect_memory.py --smoke    # a few steps of a smaller model (seconds)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
SHAPE = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    moe_intermediate_size=256,
    num_experts=16,
    num_experts_per_tok=4,
    vocab_size=2048,
    max_position_embeddings=512,
)
SMOKE_SHAPE = {**SHAPE, "hidden_size": 64, "moe_intermediate_size": 64, "num_experts": 8, "vocab_size": 256}
LIMIT = 1.10


def child(args) -> None:
    import torch

    sys.path.insert(0, str(BENCH))
    from harness import TensorPeak, proc_status_bytes, reset_peak_rss

    import usaf
    from usaf.selection.reselect import Reselector
    from usaf.testing.steps import training_step
    from usaf.testing.tiny import tiny_model

    torch.set_num_threads(args.threads)
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(4):
        ids = torch.randint(0, shape["vocab_size"], (args.batch, args.seq), generator=generator)
        batches.append(
            {
                "input_ids": ids,
                "labels": ids.clone(),
                "position_ids": torch.arange(args.seq).expand(args.batch, -1),
            }
        )
    model = tiny_model("qwen3_moe", **shape)
    config = usaf.UsafConfig(
        density=0.01, selection="gradient", reselect_every=args.every, calibration_batches=len(batches)
    )
    if args.recompute:
        usaf.enable_recomputation(model)
    reset_peak_rss()
    with TensorPeak() as calibration:
        usaf.prepare_model(model, config, calibration_batches=batches)
    calibration_rss = proc_status_bytes("VmHWM")
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    reselector = Reselector(model, config, total_steps=args.steps) if args.every else None
    reset_peak_rss()
    steps, reselections = [], 0
    for step in range(1, args.steps + 1):
        batch = batches[step % len(batches)]
        with TensorPeak() as peak:
            done = training_step(model, optimizer, batch["input_ids"], batch["labels"], reselector, step)
        reselections += done is not None
        steps.append({"step": step, "live_peak_bytes": peak.peak, "reselected": done is not None})
    print(
        json.dumps(
            {
                "calibration_live_peak_bytes": calibration.peak,
                "calibration_peak_rss_bytes": calibration_rss,
                "step_live_peak_bytes": max(s["live_peak_bytes"] for s in steps),
                "train_peak_rss_bytes": proc_status_bytes("VmHWM"),
                "reselections": reselections,
                "steps": steps,
            }
        )
    )


def run_child(args, every: int, recompute: bool) -> dict:
    command = [sys.executable, __file__, "--child", "--every", str(every), "--steps", str(args.steps)]
    command += ["--seq", str(args.seq), "--batch", str(args.batch), "--threads", str(args.threads)]
    command += ["--recompute"] * recompute + ["--smoke"] * args.smoke
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--every", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--recompute", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="a smaller model, a few steps")
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    parser.add_argument("--label", default="", help="suffix of the results' file name (e.g. before)")
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    if args.smoke:
        args.steps, args.seq = min(args.steps, 6), min(args.seq, 32)
    sys.path.insert(0, str(BENCH))
    from harness import machine, table, write_results

    everies = (0, 10, 5) if not args.smoke else (0, 2)
    rows = []
    for recompute in (True, False):
        for every in everies:
            result = run_child(args, every, recompute)
            rows.append({"recompute": recompute, "reselect_every": every, **result})
            print(_row(rows[-1], rows), flush=True)
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    payload = {
        "machine": machine(),
        "command": " ".join(
            ["python", "bench/reselect_memory.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "shape": shape,
        "settings": {
            "steps": args.steps,
            "seq": args.seq,
            "batch": args.batch,
            "density": 0.01,
            "dtype": "fp32",
        },
        "limit": LIMIT,
        "rows": rows,
    }
    lines = [
        f"# Peak memory with and without reselection ({payload['machine']['date']})",
        "",
        f"Command: `{payload['command']}`  ",
        f"Random qwen3_moe {shape}, fp32, 1 % element entries, gradient selection (4 calibration batches), "
        f"batch {args.batch} x {args.seq}, {args.steps} steps, AdamW, {args.threads} thread(s). Live MB: the peak "
        "of live tensor storages (TensorPeak, what a GPU allocator's peak counts); RSS MB: VmHWM over the phase, "
        "reset after the previous one. Ratio: the step peak against the same run without reselection.",
        "",
        *table(
            [
                "recompute",
                "reselect every",
                "reselections",
                "calibration live MB",
                "step live MB",
                "ratio",
                "calibration ÷ step",
                "calibration RSS MB",
                "training RSS MB",
            ],
            [_row(r, rows) for r in rows],
        ),
        "",
    ]
    suffix = f"-{args.label}" if args.label else ""
    json_path, md_path = write_results(f"reselect_memory{suffix}", payload, "\n".join(lines), args.out)
    print(f"wrote {json_path} and {md_path}")
    return 0


def _row(row: dict, rows: list[dict]) -> list[str]:
    base = next(r for r in rows if r["recompute"] == row["recompute"] and r["reselect_every"] == 0)
    mb = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    ratio = row["step_live_peak_bytes"] / base["step_live_peak_bytes"]
    calibration = row["calibration_live_peak_bytes"] / row["step_live_peak_bytes"]
    return [
        "on" if row["recompute"] else "off",
        row["reselect_every"] or "-",
        row["reselections"],
        mb(row["calibration_live_peak_bytes"]),
        mb(row["step_live_peak_bytes"]),
        f"{ratio:.3f}",
        f"{calibration:.2f}",
        mb(row["calibration_peak_rss_bytes"]),
        mb(row["train_peak_rss_bytes"]),
    ]


if __name__ == "__main__":
    sys.exit(main())
