"""gpt-oss-20b (published MXFP4) and Qwen3-30B-A3B (published block FP8, prepared as NF4) at full size on this
machine: random weights in the published shard layout, then plan -> prepare -> train -> export delta -> generate ->
merged export, each phase a `usaf` command in its own process, timed, its host peak (ru_maxrss of that child, from
os.wait4) set against the planner's figure. Prepare's MB/s is set against the disk's read rate (dd iflag=direct).

    .venv/bin/python bench/full_size.py --work /work/big47/full        # both models, hours of CPU, ~60 GB of disk
    .venv/bin/python bench/full_size.py --work W --models gpt-oss-20b --phases make,plan,prepare
    .venv/bin/python bench/full_size.py --work W --write               # results -> bench/results/full_size-<date>
    .venv/bin/python bench/full_size.py --dry-run                      # the same phases on tiny shapes (seconds)

Each phase's record is kept in WORK/state.json, so phases can run one at a time (a long one in the background) and
a failed one rerun. `--rm NAME,...` deletes a model's files once no later phase needs them (source, store, merged),
which keeps the peak disk use bounded; what was deleted when is recorded. Never part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
GB = 1e9
PHASES = ("make", "prepare", "plan", "train", "delta", "generate", "merged")

# what each model runs with: the experts in host memory, a short sequence, a small calibration, no reselection
MODELS = {
    "gpt-oss-20b": {"quant": None, "residency": "host"},  # the published MXFP4 experts, kept
    "qwen3-30b-a3b": {"quant": "nf4", "residency": "host"},  # the published FP8 experts, prepared as NF4
}
TINY = {  # --dry-run: the presets' families at tiny shapes
    "gpt-oss-20b": dict(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        experts_per_token=2,
        num_experts_per_tok=2,
        vocab_size=256,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=1,
    ),
    "qwen3-30b-a3b": dict(
        hidden_size=128,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        vocab_size=256,
        max_window_layers=2,
        max_position_embeddings=256,
        bos_token_id=2,
        eos_token_id=1,
    ),
}


def env() -> dict:
    threads = os.environ.get("OMP_NUM_THREADS", "2")
    return {
        **os.environ,
        "PYTHONPATH": str(SRC),
        "OMP_NUM_THREADS": threads,
        "MALLOC_MMAP_THRESHOLD_": "131072",  # freed blocks go back to the system (as plan_accuracy.py measures)
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",  # a phase's lines reach its log as they are printed
        "USAF_CACHE": os.environ.get("USAF_CACHE", ""),
    }


def usaf(*args: str) -> list[str]:
    return [sys.executable, "-m", "usaf", *args]


def run_child(argv: list[str], log: Path, environ: dict) -> dict:
    """Run `argv`, its output to `log`; wall seconds, the child's peak RSS (os.wait4's ru_maxrss), exit status."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        out.write("$ " + shlex.join(argv) + "\n")
        out.flush()
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=environ, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - start
    return {
        "command": shlex.join(argv),
        "wall_s": round(wall, 1),
        "peak_host_bytes": usage.ru_maxrss * 1024,
        "returncode": proc.returncode,
        "log": str(log),
    }


def tail(path: Path, lines: int = 15) -> str:
    return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])


def dir_bytes(path: Path) -> int:
    """Bytes of the files under `path`, each file once (a merged export hard-links the base's unchanged shards)."""
    if not Path(path).exists():
        return 0
    seen = {}
    for p in Path(path).rglob("*"):
        if p.is_file():
            stat = p.stat()
            seen[(stat.st_dev, stat.st_ino)] = stat.st_size
    return sum(seen.values())


def disk_read_rate(folder: Path, size_mb: int) -> dict:
    """The disk's sequential read rate: a file written with O_DIRECT, read back with O_DIRECT (no page cache)."""
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / "dd-probe"
    try:
        subprocess.run(
            ["dd", "if=/dev/urandom", f"of={probe}", "bs=1M", f"count={size_mb}", "oflag=direct"],
            check=True,
            capture_output=True,
        )
        start = time.perf_counter()
        subprocess.run(
            ["dd", f"if={probe}", "of=/dev/null", "bs=1M", "iflag=direct"], check=True, capture_output=True
        )
        seconds = time.perf_counter() - start
    finally:
        probe.unlink(missing_ok=True)
    return {
        "bytes": size_mb << 20,
        "seconds": round(seconds, 2),
        "mb_per_s": round((size_mb << 20) / seconds / 1e6),
    }


def short_texts(work: Path) -> Path:
    """Text records that fill a short sequence (the demo's prompt/completion pairs need 32 tokens at least)."""
    path = work / "short.jsonl"
    words = ["abc bcd cde", "xyz yza zab", "hello hello", "moe npf oqg"]
    path.write_text("".join(json.dumps({"text": w}) + "\n" for w in words * 8))
    return path


def train_config(model: str, work: Path, args) -> Path:
    """The run's YAML: what `usaf plan --config` plans and `usaf train --config` runs."""
    spec = MODELS[model]
    lines = [
        "model:",
        f"  path: {work / model / 'store'}",
        f"  residency: {spec['residency']}",
        "  device: cpu",
        f"  dtype: {args.dtype}",
        "data:",
        f"  train: [{args.data or short_texts(work)}]",
        f"  max_seq_len: {args.seq}",
        "  batch_size: 1",
        "  eval_fraction: 0",  # no evaluation before and after: two more passes over the model
        "select:",
        f"  density: {args.density}",
        f"  workspace_mb: {args.workspace_mb}",
        f"  selection: {args.selection}",
        *([f"  layers: [{args.layers}]"] if args.layers else []),
        f"  calibration_batches: {args.calibration_batches}",
        "  calibration_tokens: 0",
        "  reselect_every: 0",
        "schedule:",
        f"  max_steps: {args.steps}",
        "  warmup_steps: 0",
        "checkpoint:",
        "  every_steps: 0",
        "log:",
        "  every_steps: 1",
        "router:",
        "  health_every_steps: 0",
    ]
    path = work / model / "train.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


_PEAK = re.compile(r"^peak\s+([\d.]+)\s+(KB|MB|GB|TB)\s", re.MULTILINE)
_UNITS = {"KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}


def planned_peak(plan_text: str) -> int | None:
    found = _PEAK.search(plan_text)
    return int(float(found.group(1)) * _UNITS[found.group(2)]) if found else None


def make_source(model: str, folder: Path, dry_run: bool) -> list[str]:
    if not dry_run:
        return [
            sys.executable,
            str(REPO / "scripts" / "make_published_checkpoints.py"),
            str(folder.parent),
            "--full",
            model,
        ]
    code = (
        "import json,sys;from usaf.testing.published import write_full_published as w;"
        f"c=json.load(open({str(SRC / 'usaf' / 'presets' / (model + '.json'))!r}));c.update(json.loads(sys.argv[2]));"
        "w(sys.argv[1],c,block=32,shard_bytes=1<<20)"
    )
    return [sys.executable, "-c", code, str(folder), json.dumps(TINY[model])]


def run_phase(model: str, phase: str, work: Path, state: dict, args) -> dict:
    root = work / model
    source, store, run, merged = root / "source" / model, root / "store", root / "run", root / "merged"
    logs = root / "logs"
    cfg = train_config(model, work, args)
    spec = MODELS[model]
    record: dict = {}
    if phase == "make":
        shutil.rmtree(source, ignore_errors=True)
        argv = make_source(model, source, args.dry_run)
        record["bytes_written"] = None
    elif phase == "plan":
        # the store's own format once prepared (an NF4 store of a published FP8 checkpoint plans as NF4)
        model = [] if (store / "usaf_store.json").exists() else ["--model", str(source)]
        argv = usaf(
            "plan",
            "--config",
            str(cfg),
            *model,
            "--device",
            "cpu",
            "--no-reselect",
            *(["--quant", spec["quant"]] if spec["quant"] and model else []),
        )
    elif phase == "prepare":
        shutil.rmtree(store, ignore_errors=True)
        argv = usaf(
            "prepare",
            str(source),
            "--out",
            str(store),
            "--device",
            "cpu",
            *(["--quant", spec["quant"]] if spec["quant"] else []),
        )
    elif phase == "train":
        shutil.rmtree(run, ignore_errors=True)
        argv = usaf("train", "--config", str(cfg), "--out", str(run))
    elif phase == "delta":
        argv = usaf(
            "export", str(run), "--delta", str(root / "delta.safetensors"), "--base", str(source), "--force"
        )
    elif phase == "generate":
        prompts = root / "prompts.jsonl"
        prompts.write_text(json.dumps({"prompt": "shift: abc -> "}) + "\n")
        argv = usaf(
            "generate",
            str(run),
            "--prompts",
            str(prompts),
            "--out",
            str(root / "generated.jsonl"),
            "--max-new-tokens",
            "8",
            "--force",
            "--set",
            "model.device=cpu",
        )
    elif phase == "merged":
        shutil.rmtree(merged, ignore_errors=True)
        argv = usaf("export", str(run), "--merged", str(merged), "--base", str(source), "--force")
    else:
        raise ValueError(phase)
    record.update(run_child(argv, logs / f"{phase}.log", env()))
    text = Path(record["log"]).read_text(errors="replace")
    if record["returncode"] != 0:
        record["error"] = tail(Path(record["log"]))
    if phase == "make":
        record["bytes_written"] = dir_bytes(source)
        record["shards"] = sorted(p.name for p in source.glob("*.safetensors"))
    if phase == "plan":
        record["planned_train_peak_bytes"] = planned_peak(text)
        record["plan"] = text.split("\n", 1)[1]
    if phase == "prepare":
        read = sum(p.stat().st_size for p in source.glob("*.safetensors"))
        record["source_bytes"], record["store_bytes"] = read, dir_bytes(store)
        record["source_mb_per_s"] = round(read / record["wall_s"] / 1e6)
    if phase == "train":
        record["metrics"] = (
            [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
            if (run / "metrics.jsonl").exists()
            else []
        )
    if phase == "generate" and (root / "generated.jsonl").exists():
        record["rows"] = [json.loads(line) for line in (root / "generated.jsonl").read_text().splitlines()]
    if phase == "merged":
        record["merged_bytes"] = dir_bytes(merged)
    record["disk_used_bytes"] = dir_bytes(work)
    return record


def load_state(work: Path) -> dict:
    path = work / "state.json"
    return json.loads(path.read_text()) if path.exists() else {"models": {}, "removed": []}


def save_state(work: Path, state: dict, models: list[str]) -> None:
    """Written merged into what is on disk: another model's phases may be running in another process."""
    merged = load_state(work)
    for key, value in state.items():
        if key == "models":
            for m in models:  # phase by phase: two processes may run phases of one model
                merged["models"].setdefault(m, {}).update(value.get(m, {}))
        elif key == "removed":
            seen = {json.dumps(r, sort_keys=True) for r in merged["removed"]}
            merged["removed"] += [r for r in value if json.dumps(r, sort_keys=True) not in seen]
        else:
            merged.setdefault(key, value)
    state.update(merged)
    tmp = work / f"state.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(merged, indent=2, default=str))
    os.replace(tmp, work / "state.json")


def remove(work: Path, model: str, what: str, state: dict) -> None:
    target = {
        "source": work / model / "source",
        "store": work / model / "store",
        "merged": work / model / "merged",
    }[what]
    size = dir_bytes(target)
    shutil.rmtree(target, ignore_errors=True)
    state["removed"].append(
        {
            "model": model,
            "what": what,
            "bytes": size,
            "at": time.strftime("%H:%M:%S"),
            "after": list(state["models"].get(model, {})),
        }
    )


def fmt_gb(n) -> str:
    return "-" if n is None else f"{n / GB:.2f} GB"


def markdown(state: dict, command: str) -> str:
    out = [
        "# Full size on this machine: gpt-oss-20b (MXFP4) and Qwen3-30B-A3B (FP8 -> NF4)",
        "",
        f"Made by `{command}` (phases run one at a time, in the background, into WORK/state.json).",
        "",
    ]
    m = state.get("machine", {})
    out += [
        f"Machine: {m.get('processor', '?')}, {m.get('cpus', '?')} cores, {fmt_gb(m.get('ram_bytes'))} RAM; disk read "
        f"rate {state.get('disk', {}).get('mb_per_s', '?')} MB/s (dd iflag=direct of a fresh file).",
        "",
    ]
    for model, phases in state["models"].items():
        out += [f"## {model}", ""]
        planned = phases.get("plan", {}).get("planned_train_peak_bytes")
        rows = []
        for phase in PHASES:
            r = phases.get(phase)
            if r is None:
                rows.append([phase, "not run", "", "", "", ""])
                continue
            plan_cell, err = "", ""
            if phase == "train" and planned:
                plan_cell = fmt_gb(planned)
                err = f"{r['peak_host_bytes'] / planned - 1:+.1%}"
            extra = ""
            if phase == "prepare":
                disk = state.get("disk", {}).get("mb_per_s")
                extra = (
                    f"{r['source_mb_per_s']} MB/s of source against the disk's {disk} MB/s "
                    f"({fmt_gb(r['source_bytes'])} -> store {fmt_gb(r['store_bytes'])})"
                )
                if r.get("interrupted"):
                    extra = f"stopped: {r['interrupted']}"
            if phase == "make":
                extra = f"{fmt_gb(r.get('bytes_written'))}, {len(r.get('shards', []))} shards"
            if phase == "merged":
                extra = fmt_gb(r.get("merged_bytes"))
            if phase == "generate" and r.get("rows"):
                extra = "; ".join(
                    json.dumps(row.get("completion", row.get("output", row)))[:80] for row in r["rows"]
                )
            if phase == "train" and r.get("metrics"):
                losses = [x.get("loss") for x in r["metrics"] if "loss" in x]
                extra = "loss " + ", ".join(f"{x:.3f}" for x in losses if x is not None)
            status = "ok" if r["returncode"] == 0 else f"FAILED ({r['returncode']})"
            if phase == "plan" and r["returncode"] == 1:
                status = "verdict: does not fit"
            planned_cell = plan_cell + (f" ({err})" if err else "")
            rows.append(
                [phase, status, f"{r['wall_s']:.0f} s", fmt_gb(r["peak_host_bytes"]), planned_cell, extra]
            )
        out += harness.table(
            ["phase", "status", "wall", "host peak (child)", "planned host (measured against it)", "notes"],
            rows,
        )
        out.append("")
    if state.get("removed"):
        out += ["Deleted along the way (peak disk):", ""]
        out += [
            f"- {r['model']} {r['what']} ({fmt_gb(r['bytes'])}) after {', '.join(r['after'])}"
            for r in state["removed"]
        ]
        out.append("")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, help="folder of the multi-GB files (outside any git tree)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--phases", default=",".join(PHASES))
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--layers", default="", help="select.layers, e.g. 23 (default: all)")
    parser.add_argument("--data", help="training file (default: short text records written into WORK)")
    parser.add_argument(
        "--selection", default="random", help="select.selection (random: no calibration pass)"
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--calibration-batches", type=int, default=1)
    parser.add_argument(
        "--density", type=float, default=0.002, help="select.density (a 24 GB host: not auto)"
    )
    parser.add_argument("--workspace-mb", type=int, default=128, help="select.workspace_mb")
    parser.add_argument("--dtype", default="bfloat16", help="model.dtype (bf16 halves the dense weights)")
    parser.add_argument(
        "--rm", default="", help="after the phases: delete these of each model (source,store,merged)"
    )
    parser.add_argument("--write", action="store_true", help="write bench/results/full_size-<date>.{md,json}")
    parser.add_argument("--out-dir", type=Path, default=harness.RESULTS)
    parser.add_argument(
        "--notes", type=Path, help="with --write: a markdown narrative appended to the results"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny shapes in a temporary folder, every phase"
    )
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    phases = [p for p in args.phases.split(",") if p]
    for name in models:
        if name not in MODELS:
            parser.error(f"--models: unknown model '{name}' (one of {', '.join(MODELS)})")
    for name in phases:
        if name not in PHASES:
            parser.error(f"--phases: unknown phase '{name}' (one of {', '.join(PHASES)})")
    temp = None
    if args.dry_run:
        temp = tempfile.TemporaryDirectory(prefix="full-size-dry-")
        args.work, args.steps = Path(temp.name), 2
    if args.work is None:
        parser.error("--work is required (a folder for the multi-GB files, outside any git tree)")
    if REPO in args.work.resolve().parents:
        parser.error(f"--work {args.work} is inside the repository; put the multi-GB files elsewhere")
    args.work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("USAF_CACHE", str(args.work / "cache"))
    state = load_state(args.work)
    state.setdefault(
        "machine",
        {**harness.machine(), "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")},
    )
    if "disk" not in state and (phases or args.dry_run):
        state["disk"] = disk_read_rate(args.work, 64 if args.dry_run else 2048)
    failed = False
    for model in models:
        state["models"].setdefault(model, {})
        for phase in phases if not args.write or args.dry_run else []:
            record = run_phase(model, phase, args.work, state, args)
            state["models"][model][phase] = record  # not a dict kept across phases: save_state replaces it
            save_state(args.work, state, models)
            print(
                f"{model} {phase}: {'ok' if record['returncode'] == 0 else 'FAILED'} {record['wall_s']:.0f} s, "
                f"peak {fmt_gb(record['peak_host_bytes'])}",
                flush=True,
            )
            verdict = phase == "plan" and record["returncode"] == 1  # "does not fit": a figure, not a failure
            if record["returncode"] != 0 and not verdict:
                print(record["error"], file=sys.stderr)
                failed = True
                break
        for what in [w for w in args.rm.split(",") if w]:
            remove(args.work, model, what, state)
            save_state(args.work, state, models)
    command = "python bench/full_size.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    text = markdown(state, command)
    if args.notes:  # the narrative: what broke, what was fixed, what the figures mean
        text += "\n" + args.notes.read_text()
    if args.write or args.dry_run:
        out_dir = args.out_dir if not args.dry_run else args.work
        harness.write_results("full_size", {**state, "command": command}, text, out_dir)
    print(text)
    if temp is not None:
        temp.cleanup()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
