"""DPO on the bundled demo model with the base as its own reference, beside SFT at the same rows per micro-batch:
does the preferred answers' margin move the right way, and is the memory that of SFT? (issue 25.4)

The demo's preference set (usaf.demo.task.preference_pairs): the shifted word chosen over the copied one, which is
what the pretrained model does. Each run is its own `usaf train` process (peak resident memory is the process's),
on the CPU with one torch thread: SFT on the demo's prompt/completion records with batch 2B rows, DPO on B pairs
(the same 2B rows: chosen and rejected). Reported: the held-out DPO loss, margin and pair accuracy before and after,
the shift task's exact-match accuracy of each exported model, and each run's measured peak beside the planner's.

    .venv/bin/python bench/dpo_demo.py                    # about 3 minutes on 2 cores
    .venv/bin/python bench/dpo_demo.py --steps 20 --out /tmp/x   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "src"))

from harness import RESULTS, machine, table  # noqa: E402


def run(args, out: Path, name: str, data: Path, eval_data: Path, extra: list[str]) -> dict:
    from usaf.demo.run import assets

    sets = [
        f"schedule.max_steps={args.steps}",
        "data.max_seq_len=64",
        "log.report_to=none",
        "log.progress=false",
        f"checkpoint.every_steps={args.steps}",
        *extra,
    ]
    command = [
        sys.executable, "-m", "usaf", "train", f"--model={assets() / 'model'}", f"--data={data}",
        f"--out={out / name}", f"--set=data.eval={eval_data}", *[f"--set={s}" for s in sets],
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / name / "summary.json").read_text())
    return {
        "command": shlex.join(command[1:]),
        "summary": summary,
        "peak_mb": max(r.get("peak_memory_mb", 0) for r in rows),
        "planned_mb": planned(out / name) / 2**20,
    }


def planned(run_dir: Path) -> float:
    """The planner's peak for the run's own configuration on the CPU (what `train.recompute=auto` reads)."""
    from usaf import planner
    from usaf.config import RunConfig

    config = RunConfig.load(str(run_dir / "config.yaml"))
    name, model_config = planner.load_model_config(config.model.path)
    shape = planner.model_shape(model_config, name)
    settings = planner.settings_for_run(planner.PlannedRun.of(config), "fp32")
    return planner.plan(shape, settings, planner.DEVICES["cpu"]).device_peak


def shift_accuracy(run_dir: Path) -> float:
    from usaf.demo.run import assets
    from usaf.demo.task import read_jsonl, task_accuracy
    from usaf.export.merged import export_merged
    from usaf.model.hf import load_causal_lm, load_tokenizer

    model_dir = assets() / "model"
    merged = export_merged(run_dir, run_dir.parent / (run_dir.name + "-merged"))
    records = read_jsonl(assets() / "data" / "eval.jsonl")
    return task_accuracy(load_causal_lm(merged), load_tokenizer(model_dir), records)


def markdown(payload: dict) -> str:
    sft, dpo = payload["sft"], payload["dpo"]
    s, d = sft["summary"], dpo["summary"]
    lines = [
        f"# DPO on the demo model, beside SFT ({payload['date']})",
        "",
        f"Command: `{payload['command']}`; {payload['machine']['cpus']} CPUs, one torch thread per run, "
        f"{payload['steps']} steps; SFT batch {payload['rows']} rows, DPO batch {payload['rows'] // 2} pairs "
        "(the same rows).",
        "",
        *table(
            [
                "run",
                "held-out DPO loss before → after",
                "margin before → after",
                "pairs ahead before → after",
                "shift accuracy after",
                "peak RSS measured",
                "planner",
            ],
            [
                [
                    "SFT",
                    "-",
                    "-",
                    "-",
                    f"{sft['shift_accuracy']:.1%}",
                    f"{sft['peak_mb']:.0f} MB",
                    f"{sft['planned_mb']:.0f} MB",
                ],
                [
                    "DPO",
                    f"{d['eval_loss_before']:.4f} → {d['eval_loss_after']:.4f}",
                    f"{d['eval_margin_before']:.3f} → {d['eval_margin_after']:.3f}",
                    f"{d['eval_accuracy_before']:.1%} → {d['eval_accuracy_after']:.1%}",
                    f"{dpo['shift_accuracy']:.1%}",
                    f"{dpo['peak_mb']:.0f} MB",
                    f"{dpo['planned_mb']:.0f} MB",
                ],
            ],
        ),
        "",
        f"DPO peak ÷ SFT peak, measured: {dpo['peak_mb'] / sft['peak_mb']:.3f}; planned: "
        f"{dpo['planned_mb'] / sft['planned_mb']:.3f}. Shift accuracy of the base: {payload['base_accuracy']:.1%}.",
        f"SFT eval loss before → after: {s['eval_loss_before']:.4f} → {s['eval_loss_after']:.4f}.",
        "",
        "Runs:",
        f"- `{sft['command']}`",
        f"- `{dpo['command']}`",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--rows", type=int, default=16, help="rows per micro-batch (DPO: half as many pairs)")
    parser.add_argument("--out", default=None, help="folder for the result files (default bench/results)")
    parser.add_argument("--stem", default="dpo_demo")
    args = parser.parse_args(argv)
    from usaf.demo.run import assets
    from usaf.demo.task import read_jsonl, task_accuracy
    from usaf.model.hf import load_causal_lm, load_tokenizer

    data = assets() / "data"
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        # the same words: SFT on the preference set's prompts and chosen answers
        sft_train = scratch / "sft_train.jsonl"
        pairs = read_jsonl(data / "preference_train.jsonl")
        sft_train.write_text(
            "".join(json.dumps({"prompt": p["prompt"], "completion": p["chosen"]}) + "\n" for p in pairs)
        )
        sft = run(args, scratch, "sft", sft_train, data / "eval.jsonl", [f"data.batch_size={args.rows}"])
        dpo = run(
            args,
            scratch,
            "dpo",
            data / "preference_train.jsonl",
            data / "preference_eval.jsonl",
            ["train.objective=dpo", f"data.batch_size={args.rows // 2}"],
        )
        sft["shift_accuracy"] = shift_accuracy(scratch / "sft")
        dpo["shift_accuracy"] = shift_accuracy(scratch / "dpo")
        model_dir = assets() / "model"
        base_accuracy = task_accuracy(
            load_causal_lm(model_dir), load_tokenizer(model_dir), read_jsonl(data / "eval.jsonl")
        )
    payload = {
        "date": machine()["date"][:10],
        "machine": machine(),
        "command": shlex.join(["bench/dpo_demo.py", *(argv if argv is not None else sys.argv[1:])]),
        "steps": args.steps,
        "rows": args.rows,
        "sft": sft,
        "dpo": dpo,
        "base_accuracy": base_accuracy,
    }
    out = Path(args.out) if args.out else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{args.stem}-{payload['date']}"
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=2, default=str))
    stem.with_suffix(".md").write_text(markdown(payload))
    print(markdown(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
