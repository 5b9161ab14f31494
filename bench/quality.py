"""Quality of fine-tunes, side by side: how much each method learns of a new domain and how much it forgets of
the old one, at equal steps, against LoRA's and full fine-tuning's frontiers, over seeds. `make bench-quality`
runs it; results go to bench/results/quality-<date>.{md,json,png}.

    .venv/bin/python bench/quality.py                     # shift + arith, every method, seeds 0 1 2
    .venv/bin/python bench/quality.py --task shift --steps 60
    .venv/bin/python bench/quality.py --quick             # fewer steps and methods, one seed (a few minutes)
    .venv/bin/python bench/quality.py --smoke --out DIR   # tiny shapes, seconds of work (tests)
    .venv/bin/python bench/quality.py --usaf-spec '{"label": "usaf 1 %", "set": {"select.density": 0.01}}'

Tasks (--task shift, arith, demo; all: shift and arith)
- shift: a byte-level Qwen3-MoE (~13.5 M parameters) pretrained on English documentation/licence prose
  (scripts/make_shift_model.py, cached in bench/.cache/shift-model/) is fine-tuned on roff man-page source.
  Adaptation: held-out loss on the new domain (nats/byte = nats/token); forgetting: held-out loss on the old
  domain. Lower is better for both.
- arith: the same pretrained model fine-tuned on lines of integer arithmetic (bench/arith.py), a shift unlike the
  first: adaptation = held-out arithmetic loss, forgetting = the same held-out prose loss.
- demo: the bundled demo model (knows `copy` and `upper`) learns `shift` (usaf.demo.task) from the bundled
  train.jsonl. Adaptation: exact-match accuracy on the bundled held-out shift records; forgetting: the mean
  accuracy on fresh copy and upper records (a seed that neither pretraining nor the bundled data used).
  Higher is better for both.

How it measures
- A usaf row is the command line a user runs: `python -m usaf train` on the task's training records (a JSONL of
  text records) with only the task's shape set (steps, batch size, sequence length, seed; no in-run evaluation,
  logging off) plus the row's `--set` overrides, then `python -m usaf export --merged`; the exported folder is
  loaded with plain transformers and judged by the same evaluator as every other method. Its curve has two points:
  the base (step 0) and the exported model (the last step).
- The baselines (PEFT LoRA, full fine-tuning, dense experts) train in the bench on the same records, a record a
  row (<bos> text <eos>, at most the sequence length), the same batch size and steps, in a seeded order per seed
  (usaf orders its own, seeded by train.seed): AdamW (betas 0.9/0.999, no weight decay), clipping at 1.0, linear
  warm-up over 10 % of the steps then cosine to 10 % of the peak learning rate, transformers' `grouped_mm` experts.
- Every run (method x learning rate x seed) is its own process, forked from a server that imported torch,
  transformers and peft once; `--jobs` of them run at once (default 2, 1 torch thread each, OMP_NUM_THREADS for
  the usaf processes: on a shared 2-core CPU, 2-thread processes stall on OpenMP barriers). Peak memory of a
  baseline: the resident set's peak above the process's baseline (VmHWM, reset after the model is built), and the
  live-tensor peak of one more step (bench/harness.py's TensorPeak); of a usaf row: its metrics.jsonl's
  peak_memory_mb (the whole `usaf train` process).
- Frontiers: LoRA's and full fine-tuning's, piecewise linear through their per-learning-rate means (new, old);
  a usaf row's distance is its old value minus the frontier's old at its new value (signs flipped where higher
  is better), so negative = past the frontier; "outside" where the new value lies beyond the frontier's range.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import itertools
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results"
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(REPO / "scripts"))
import arith  # noqa: E402
from harness import (  # noqa: E402
    PeakMemory,
    TensorPeak,
    call_in_fork,
    fmt,
    map_in_forks,
    own_mapped_weights,
    params_label,
    run_commands,
    save_figure,
    subplots,
    table,
    write_results,
)
from recipe import LORA_ALPHA, LORA_ATTENTION, LORA_EXPERTS, LORA_RANK, lr_factor, stock_baseline  # noqa: E402

from usaf.train.objectives import NEXT_TOKEN_LR  # noqa: E402

# optim.lr=auto of next-token training: the rate of a usaf row that does not set one
DEFAULT_LR = NEXT_TOKEN_LR

# ============================================================================================================
# usaf rows: EXTEND HERE (or pass --usaf-spec JSON on the command line, repeatable). "set" holds `usaf train
# --set` overrides, dotted keys exactly as the command line takes them; nothing else of usaf's configuration is
# touched, so {"set": {}} is what a user gets with the defaults.
# ============================================================================================================
USAF_SPECS: list[dict] = [
    {"label": "usaf default", "set": {}},
    # the default at half and twice the rate: usaf's own frontier
    {"label": "usaf default, lr x 0.5", "set": {"optim.lr": DEFAULT_LR / 2}},
    {"label": "usaf default, lr x 2", "set": {"optim.lr": DEFAULT_LR * 2}},
]

# Baselines: learning rates per family (LoRA's middle one is the reference of "at equal wall-clock").
LORA_LRS = [1e-3, 3e-3, 1e-2]
FULL_LRS = [1e-4, 3e-4, 1e-3]  # three: full fine-tuning's frontier spans the usaf rows' adaptation
EXPERTS_LRS = [3e-4, 1e-3]
SPREAD_LIMIT = 0.03  # the bound on the seed spread of a usaf row, on both axes

# Per-mode sizes of the runs. arith: 100 steps in full mode, not 150: arithmetic is learnt fast.
# train_records: the first N training records only (None: all of them).
MODES = {
    "full": dict(
        shift=dict(steps=150, batch=8, seq=128, eval_every=25, eval_windows=32, train_records=None),
        arith=dict(steps=100, batch=8, seq=128, eval_every=25, eval_windows=32, train_records=None),
        demo=dict(steps=150, batch=32, seq=64, eval_every=50, eval_records=200),
        seeds=[0, 1, 2],
    ),
    "quick": dict(
        shift=dict(steps=40, batch=8, seq=128, eval_every=10, eval_windows=16, train_records=None),
        arith=dict(steps=30, batch=8, seq=128, eval_every=10, eval_windows=16, train_records=None),
        demo=dict(steps=60, batch=32, seq=64, eval_every=20, eval_records=100),
        seeds=[0],
    ),
    "smoke": dict(
        shift=dict(steps=3, batch=2, seq=32, eval_every=3, eval_windows=2, train_records=64),
        arith=dict(steps=3, batch=2, seq=32, eval_every=3, eval_windows=2, train_records=64),
        demo=dict(steps=3, batch=8, seq=64, eval_every=3, eval_records=8),
        seeds=[0],
    ),
}
FRESH_SEED = (
    2 * 10**9
)  # copy/upper records for the demo task's forgetting: no pretraining step or bundled file used it
TASKS = {
    "shift": dict(
        title="text domain shift (English prose -> roff man pages)",
        metric="held-out loss (nats/byte)",
        new="new-domain loss (man pages)",
        old="old-domain loss (prose)",
        higher_is_better=False,
    ),
    "arith": dict(
        title="second shift (English prose -> integer arithmetic)",
        metric="held-out loss (nats/byte)",
        new="new-domain loss (arithmetic)",
        old="old-domain loss (prose)",
        higher_is_better=False,
    ),
    "demo": dict(
        title="demo model: learn `shift`, keep `copy` and `upper`",
        metric="exact-match accuracy",
        new="shift accuracy",
        old="mean copy/upper accuracy",
        higher_is_better=True,
    ),
}
TEXT_TASKS = ("shift", "arith")


def methods_for(mode: str, extra_specs: list[dict], builtin_usaf: bool = True) -> list[dict]:
    """Every row: {key, label, kind, lr} (+ set: the `usaf train --set` overrides of a usaf row)."""
    rows = [{"key": "inference", "label": "inference (no training)", "kind": "inference", "lr": 0.0}]
    lora, full, experts, specs = LORA_LRS, FULL_LRS, EXPERTS_LRS, USAF_SPECS
    if mode == "quick":
        full, experts, specs = FULL_LRS[-1:], EXPERTS_LRS[-1:], USAF_SPECS[:1]
    if mode == "smoke":
        lora, full, experts, specs = LORA_LRS[:2], FULL_LRS[1:], EXPERTS_LRS[-1:], USAF_SPECS[:1]
    if not builtin_usaf:
        specs = []
    rows += [
        {"key": f"lora@{lr:g}", "label": f"PEFT LoRA r={LORA_RANK} attn + experts", "kind": "lora", "lr": lr}
        for lr in lora
    ]
    rows += [{"key": f"full@{lr:g}", "label": "full fine-tuning", "kind": "full", "lr": lr} for lr in full]
    rows += [
        {"key": f"experts@{lr:g}", "label": "experts + routers, dense", "kind": "experts", "lr": lr}
        for lr in experts
    ]
    for spec in [*specs, *extra_specs]:
        if set(spec) != {"label", "set"} or not isinstance(spec["set"], dict):
            raise SystemExit(f'a usaf spec is {{"label": ..., "set": {{"optim.lr": ..., ...}}}}: {spec}')
        rows.append(
            {
                "key": f"usaf:{spec['label']}",
                "label": spec["label"],
                "kind": "usaf",
                "lr": float(spec["set"].get("optim.lr", DEFAULT_LR)),
                "set": dict(spec["set"]),
            }
        )
    keys = [r["key"] for r in rows]
    if len(set(keys)) != len(keys):
        raise SystemExit(f"two methods share a label: {sorted(k for k in keys if keys.count(k) > 1)}")
    return rows


# ---- data, in a helper process ---------------------------------------------------------------------------------


def prepare_task(task: str, sizes: dict, seeds: list[int], workdir: str, smoke: bool) -> dict:
    """Writes the model (smoke: a tiny one), the training records usaf train reads and per-seed batches of the
    same records for the baselines; returns {model_dir, records, data: {seed: path}, facts}."""
    import torch

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    root = Path(workdir) / task
    root.mkdir(parents=True, exist_ok=True)
    return (_prepare_demo if task == "demo" else _prepare_text)(root, task, sizes, seeds, smoke)


def utf8_records(data: bytes, size: int) -> list[str]:
    """`data` cut into pieces of at most `size` bytes, never inside a multi-byte UTF-8 character, decoded; blank
    pieces are left out (usaf train refuses a blank text record)."""
    out, start = [], 0
    while start < len(data):
        end = min(start + size, len(data))
        while end < len(data) and data[end] & 0xC0 == 0x80:  # a continuation byte: cut before its character
            end -= 1
        piece = data[start:end].decode("utf-8")
        if piece.strip():
            out.append(piece)
        start = end
    return out


def seeded_batches(items: list, batch: int, count: int, order: random.Random) -> list[list]:
    """`count` batches of `batch` items, the items reshuffled by `order` each epoch."""
    batches, pool = [], []
    while len(batches) < count:
        if len(pool) < batch:
            fresh = list(items)
            order.shuffle(fresh)
            pool += fresh
        batches.append(pool[:batch])
        pool = pool[batch:]
    return batches


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _shift_model(root: Path, old_train: bytes, smoke: bool) -> tuple[Path, dict]:
    """The pretrained shift model's folder and its facts (smoke: a tiny model, a few pretraining steps)."""
    import make_shift_model as shift

    if not smoke:
        model_dir = shift.build(log=lambda line: print(f"  [pretrain] {line}", flush=True))
        return model_dir, json.loads((model_dir / "pretrain.json").read_text())
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    tiny = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    tiny.update(head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
    model = AutoModelForCausalLM.from_config(shift.model_config(**tiny), dtype=torch.float32)
    settings = dict(steps=4, batch=4, seq=32, lr=3e-3, warmup=1)
    shift.pretrain(model, shift.encode(old_train), {}, settings, log=lambda *_: None)
    model_dir = root / "model"
    model.save_pretrained(model_dir)
    shift.byte_tokenizer().save_pretrained(model_dir)
    return model_dir, {"parameters": sum(p.numel() for p in model.parameters()), "smoke": True}


def _prepare_text(root: Path, task: str, sizes: dict, seeds: list[int], smoke: bool) -> dict:
    import make_shift_model as shift
    import torch
    from transformers import AutoTokenizer

    data = shift.domains()
    new = data["new"] if task == "shift" else arith.domain()
    model_dir, pretrained = _shift_model(root, data["old"]["train"], smoke)
    seq = sizes["seq"]
    evals = {
        "old": shift.held_out_batches(shift.encode(data["old"]["held_out"]), seq, sizes["eval_windows"], 16),
        "new": shift.held_out_batches(shift.encode(new["held_out"]), seq, sizes["eval_windows"], 16),
    }
    # usaf train reads a text record as <bos> text <eos> (usaf.data.records.encode_text): seq - 2 bytes fill a row
    texts = utf8_records(new["train"], seq - 2)[: sizes["train_records"]]
    records = root / "train.jsonl"
    _write_jsonl(records, [{"text": t} for t in texts])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [[*ids, tokenizer.eos_token_id] for ids in tokenizer(texts)["input_ids"]]
    assert max(map(len, rows)) <= seq, "a record longer than a row"
    paths = {}
    for seed in seeds:
        batches = seeded_batches(rows, sizes["batch"], sizes["steps"] + 1, random.Random(seed))
        path = root / f"data-{seed}.pt"
        torch.save({"train": [_padded(b, tokenizer.pad_token_id) for b in batches], "eval": evals}, path)
        paths[seed] = str(path)
    return {
        "model_dir": str(model_dir),
        "records": str(records),
        "data": paths,
        "facts": {
            "model": pretrained,
            "domains": {
                "old": {k: len(v) for k, v in data["old"].items()},
                "new": {k: len(v) for k, v in new.items()},
            },
            "train_records": len(texts),
            "tokens_per_step": sizes["batch"] * seq,
            "eval_tokens": {k: sum(b.numel() for b in v) for k, v in evals.items()},
        },
    }


def _padded(rows: list[list[int]], pad: int):
    """(input_ids, labels) of token rows, right-padded to the longest (labels -100 on the padding: a causal
    model's earlier positions never see it)."""
    import torch

    width = max(map(len, rows))
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    labels = torch.tensor([r + [-100] * (width - len(r)) for r in rows])
    return ids, labels


def _prepare_demo(root: Path, task: str, sizes: dict, seeds: list[int], smoke: bool) -> dict:
    import torch
    from transformers import AutoTokenizer

    from usaf.demo.run import assets
    from usaf.demo.task import encode_records, make_examples, read_jsonl

    model_dir, data_dir = assets() / "model", assets() / "data"
    if not (model_dir / "config.json").exists():
        raise RuntimeError(f"demo assets not found under {assets()}")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    records = read_jsonl(data_dir / "train.jsonl")
    n = sizes["eval_records"]
    evals = {
        "shift": read_jsonl(data_dir / "eval.jsonl")[:n],
        "copy": make_examples("copy", n, FRESH_SEED),
        "upper": make_examples("upper", n, FRESH_SEED),
    }
    train_prompts = {r["prompt"] for r in records}
    assert not train_prompts & {r["prompt"] for r in evals["shift"]}, "held-out shift records overlap train"
    paths = {}
    for seed in seeds:  # seeded, reshuffled each epoch, the same for every baseline
        batches = seeded_batches(records, sizes["batch"], sizes["steps"] + 1, random.Random(seed))
        path = root / f"data-{seed}.pt"
        torch.save({"train": [encode_records(tokenizer, b) for b in batches], "eval": evals}, path)
        paths[seed] = str(path)
    params = sum(t.numel() for t in _safetensors(model_dir).values())
    return {
        "model_dir": str(model_dir),
        "records": str(data_dir / "train.jsonl"),
        "data": paths,
        "facts": {"model": {"parameters": params}, "train_records": len(records), "eval_records": n},
    }


def _safetensors(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        out.update(load_file(f))
    return out


# ---- one run, in its own process -------------------------------------------------------------------------------


def load_plain(model_dir):
    """A checkpoint folder as plain transformers loads it (float32), its weights in process memory."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    own_mapped_weights(model)
    return model


class Evaluator:
    """The held-out numbers of a model, the same function for every method and the exported usaf checkpoints:
    transformers' own loss (text tasks) or the demo task's exact-match accuracy."""

    def __init__(self, task: str, evals: dict, model_dir: str):
        self.task, self.evals = task, evals
        if task == "demo":
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def __call__(self, model) -> dict:
        import torch

        was = model.training
        model.eval()
        try:
            if self.task in TEXT_TASKS:
                out = {}
                with torch.no_grad():
                    for name, batches in self.evals.items():
                        total = sum(float(model(input_ids=b, labels=b).loss) * b.shape[0] for b in batches)
                        out[name] = total / sum(b.shape[0] for b in batches)
                return out
            from usaf.demo.task import task_accuracy

            acc = {k: task_accuracy(model, self.tokenizer, records) for k, records in self.evals.items()}
            return {"new": acc["shift"], "old": (acc["copy"] + acc["upper"]) / 2, **acc}
        finally:
            model.train(was)


def run_method(task: str, method: dict, seed: int, job: dict) -> dict:
    """Train one method on one task with one seed, judged by the task's evaluator; a usaf row through usaf's
    command line, a baseline in this process."""
    import torch

    torch.set_num_threads(job["threads"])
    torch.manual_seed(seed)
    data = torch.load(job["data"][seed], weights_only=True)  # the bench's own tensors, lists and strings
    evaluate = Evaluator(task, data["eval"], job["model_dir"])
    if method["kind"] == "usaf":
        return _run_usaf_cli(task, method, seed, job, evaluate)
    return _run_baseline(task, method, seed, job, data["train"], evaluate)


def usaf_commands(method: dict, seed: int, job: dict, run_dir: Path) -> tuple[list[str], list[str]]:
    """`usaf train` with the task's shape and the row's overrides, and `usaf export --merged` of its run."""
    shape = {
        "train.seed": seed,
        "schedule.max_steps": job["steps"],
        "data.batch_size": job["batch"],
        "data.max_seq_len": job["seq"],
        "data.pack": "false",  # a record a row, as the baselines train
        "data.eval_fraction": 0,  # every record trains; the bench judges on its own held-out data
        "checkpoint.every_steps": 0,  # the last step saves
        "log.report_to": "none",
        "log.progress": "false",
    }
    sets = [f"{k}={v}" for k, v in {**shape, **method["set"]}.items()]
    train = [sys.executable, "-m", "usaf", "train", "--model", job["model_dir"], "--data", job["records"]]
    train += ["--out", str(run_dir / "run"), "--set", *sets]
    export = [
        sys.executable,
        "-m",
        "usaf",
        "export",
        str(run_dir / "run"),
        "--merged",
        str(run_dir / "merged"),
    ]
    return train, export


def _run_usaf_cli(task: str, method: dict, seed: int, job: dict, evaluate) -> dict:
    import usaf

    run_dir = Path(tempfile.mkdtemp(prefix=f"usaf-{seed}-", dir=job["workdir"]))
    train, export = usaf_commands(method, seed, job, run_dir)
    env = {**os.environ, "OMP_NUM_THREADS": str(job["threads"])}
    # the same usaf the bench imported (a worktree's src/, or the installed one)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(usaf.__file__).parents[1]), env.get("PYTHONPATH", "")])
    run_commands([train, export], env)
    summary = json.loads((run_dir / "run" / "summary.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "run" / "metrics.jsonl").read_text().splitlines()]
    base, tuned = load_plain(job["model_dir"]), load_plain(run_dir / "merged")
    train_s = summary["train_seconds"]
    trained = summary["trained_expert_entries"] + summary["trained_router_weights"]
    trained += sum(summary["trained_entries_beyond_experts"].values())
    return {
        "task": task,
        "method": method["key"],
        "seed": seed,
        "commands": [shlex.join(["python", *train[1:]]), shlex.join(["python", *export[1:]])],
        "judged_from": str(run_dir / "merged"),
        "trainable_params": trained,
        "total_params": sum(p.numel() for p in tuned.parameters()),
        "curve": [
            {"step": 0, "elapsed_s": 0.0, **evaluate(base)},
            {"step": summary["steps"], "elapsed_s": train_s, **evaluate(tuned)},
        ],
        "step_times_s": [train_s / summary["steps"]] * summary["steps"],  # the run's mean: no per-step times
        "train_losses": [row["loss"] for row in metrics if "loss" in row],
        "peak_bytes": max(row.get("peak_memory_mb", 0) for row in metrics) * 2**20 or None,
    }


def _run_baseline(task: str, method: dict, seed: int, job: dict, train: list, evaluate) -> dict:
    """One baseline (or the untrained model) on the bench's batches, evaluated every eval_every steps."""
    import torch

    import usaf

    memory = PeakMemory(torch.device("cpu"))
    started = time.perf_counter()
    model = stock_baseline(load_plain(job["model_dir"]), method["kind"])
    trainable = [p for p in model.parameters() if p.requires_grad]
    setup_s = time.perf_counter() - started
    curve = [{"step": 0, "elapsed_s": 0.0, **evaluate(model)}]
    result = {
        "task": task,
        "method": method["key"],
        "seed": seed,
        "trainable_params": sum(p.numel() for p in trainable),
        "total_params": sum(p.numel() for p in model.parameters()),
        "setup_s": setup_s,
    }
    if method["kind"] == "inference":
        return {**result, "curve": curve, "step_times_s": [], "train_losses": [], "peak_bytes": None}
    steps = job["steps"]
    optimizer = torch.optim.AdamW(trainable, lr=method["lr"], betas=(0.9, 0.999), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(steps))
    model.train()
    memory.reset()
    step_times, losses, elapsed = [], [], 0.0
    for step in range(steps):
        ids, labels = train[step]
        start = time.perf_counter()
        loss = usaf.causal_lm_loss(model, ids, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        took = time.perf_counter() - start
        step_times.append(took)
        elapsed += took
        losses.append(float(loss.detach()))
        if (step + 1) % job["eval_every"] == 0 or step + 1 == steps:
            curve.append({"step": step + 1, "elapsed_s": elapsed, **evaluate(model)})
    peak = memory.peak()
    with TensorPeak() as tensors:  # one more step, after every figure above: live tensors at their highest
        usaf.causal_lm_loss(model, *train[steps]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {
        **result,
        "curve": curve,
        "step_times_s": step_times,
        "train_losses": losses,
        "peak_bytes": peak,
        "tensor_peak_bytes": tensors.peak,
    }


# ---- aggregation -----------------------------------------------------------------------------------------------


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _interp(points: list[tuple[float, float]], x: float) -> float | None:
    """Linear interpolation through points sorted by x; None outside their range."""
    points = sorted(points)
    if not points or x < points[0][0] - 1e-12 or x > points[-1][0] + 1e-12:
        return None
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[0][1]


def frontier(rows: dict, kind: str) -> list[tuple[float, float]]:
    """A family's frontier: its per-learning-rate means (new, old), sorted by new."""
    return sorted((r["after"]["new"], r["after"]["old"]) for r in rows.values() if r["kind"] == kind)


def distance(
    points: list[tuple[float, float]], new: float, old: float, higher_is_better: bool
) -> float | None:
    """How far `old` lies behind the frontier at the same `new` (negative: past it); None outside its range."""
    at = _interp(points, new)
    if at is None:
        return None
    return at - old if higher_is_better else old - at


def better_than_every_point(
    points: list[tuple[float, float]], new: float, old: float, higher_is_better: bool
) -> bool:
    """At least as good as each of the frontier's points on both axes: past it where it has no distance to give
    (a new value beyond the frontier's better end)."""
    at_least = (lambda a, b: a >= b) if higher_is_better else (lambda a, b: a <= b)
    return bool(points) and all(at_least(new, n) and at_least(old, o) for n, o in points)


def against_frontiers(row: dict, rows: dict, higher_is_better: bool) -> dict:
    """A usaf row against LoRA's and full fine-tuning's frontiers: distances of the mean and of each seed, the
    seed spread on both axes, and the verdict."""
    out = {}
    for kind in ("full", "lora"):
        points = frontier(rows, kind)
        out[kind] = {
            "frontier": points,
            "old_at_same_new": _interp(points, row["after"]["new"]),
            "mean": distance(points, row["after"]["new"], row["after"]["old"], higher_is_better),
            "per_seed": [
                distance(points, s["new"], s["old"], higher_is_better) for s in row["per_seed_after"]
            ],
            "better_than_every_point": better_than_every_point(
                points, row["after"]["new"], row["after"]["old"], higher_is_better
            ),
        }
    spread = {
        k: max(s[k] for s in row["per_seed_after"]) - min(s[k] for s in row["per_seed_after"])
        for k in ("new", "old")
    }

    def past(kind: str, strictly: bool) -> bool | None:
        if out[kind]["better_than_every_point"]:
            return True
        d = out[kind]["mean"]
        return None if d is None else (d < 0 if strictly else d <= 0)

    out["spread"] = spread
    out["verdict"] = {
        "past_full": past("full", strictly=False),
        "lora_dominated": past("lora", strictly=True),
        "spread_within_limit": max(spread.values()) <= SPREAD_LIMIT,
    }
    return out


def aggregate(task: str, methods: list[dict], runs: dict, errors: dict) -> dict:
    """Per method: means over seeds of every curve point, per-seed finals, times, memory; then the frontiers."""
    rows = {}
    for m in methods:
        seeds = runs.get(m["key"], [])
        if not seeds:
            continue
        steps = [p["step"] for p in seeds[0]["curve"]]
        curve = []
        for i, step in enumerate(steps):
            point = {"step": step}
            for k in seeds[0]["curve"][i]:
                if k != "step":
                    point[k] = _mean([s["curve"][i][k] for s in seeds])
            curve.append(point)
        times = [t for s in seeds for t in s["step_times_s"][2:]]
        rows[m["key"]] = {
            **{k: v for k, v in m.items() if k != "key"},
            "seeds": [s["seed"] for s in seeds],
            "trainable_params": seeds[0]["trainable_params"],
            "total_params": seeds[0]["total_params"],
            "before": {k: curve[0][k] for k in ("new", "old")},
            "after": {k: curve[-1][k] for k in ("new", "old")},
            "per_seed_after": [{k: s["curve"][-1][k] for k in ("new", "old")} for s in seeds],
            "extra_after": {
                k: v for k, v in curve[-1].items() if k not in ("step", "elapsed_s", "new", "old")
            },
            "curve": curve,
            "step_ms": statistics.median(times) * 1000 if times else None,
            "train_s": _mean([s["curve"][-1]["elapsed_s"] for s in seeds])
            if m["kind"] != "inference"
            else 0.0,
            "peak_mb": _mean(
                [s["peak_bytes"] / 2**20 if s["peak_bytes"] is not None else None for s in seeds]
            ),
            "tensor_peak_mb": _mean([s.get("tensor_peak_bytes", 0) / 2**20 or None for s in seeds]),
            "runs": seeds,
        }
    better = TASKS[task]["higher_is_better"]
    for r in rows.values():
        if r["kind"] == "usaf":
            r["against_frontiers"] = against_frontiers(r, rows, better)
    lora = sorted((r for r in rows.values() if r["kind"] == "lora"), key=lambda r: r["lr"])
    mid = lora[len(lora) // 2] if lora else None
    wall = mid["train_s"] if mid else None
    for r in rows.values():
        # a usaf row's curve has no middle points: a line from the base to the end would be made up
        if wall is not None and not (r["kind"] == "usaf" and r["train_s"] > wall):
            curve = r["curve"]
            points = {k: [(p["elapsed_s"], p[k]) for p in curve] for k in ("new", "old")}
            done = r["train_s"] is not None and r["train_s"] <= wall
            r["at_lora_wall"] = {
                "seconds": wall,
                "finished": done or r["kind"] == "inference",
                **{
                    k: (curve[-1][k] if done or r["kind"] == "inference" else _interp(v, wall))
                    for k, v in points.items()
                },
            }
    return {
        "methods": rows,
        "errors": errors,
        "lora_mid": mid and {"lr": mid["lr"], "key": next(k for k, v in rows.items() if v is mid)},
        "wall_reference_s": wall,
    }


# ---- reporting -------------------------------------------------------------------------------------------------


def _metric(task: str, value) -> str:
    return fmt(value, "{:.1%}" if TASKS[task]["higher_is_better"] else "{:.3f}")


def markdown(payload: dict) -> str:
    m = payload["machine"]
    lines = [
        f"# Fine-tune quality: adaptation and forgetting ({m['date']})",
        "",
        f"Command: `{payload['command']}`  ",
        f"Machine: {m['processor']}, {m['cpus']} CPUs, {m['platform']}; torch {m['torch']}, transformers "
        f"{m['transformers']}, peft {payload['versions'].get('peft')}. {payload['threads']} torch thread(s) per run, "
        f"{payload['jobs']} run(s) at once (each run its own process). Mode {payload['mode']}, seeds "
        f"{payload['seeds']}; whole benchmark {payload['wall_s']:.0f} s.",
        "",
        "usaf rows: `usaf train` from the command line with the defaults and only the task's shape set (plus the "
        "row's `--set` overrides: see the commands below), exported with `usaf export --merged` and judged from the "
        "exported folder loaded by plain transformers; their curves have two points, the base (step 0) and the last "
        "step; step ms = the run's train_seconds ÷ steps; peak MB = the run's metrics.jsonl peak_memory_mb (the whole "
        "process, not above a baseline). Baselines: trained in the bench on the same records (a record a row), the "
        "same batch size and steps, in a seeded order per seed, AdamW (0.9/0.999, no weight decay), clip 1.0, "
        "warm-up 10 % then cosine to 10 %; step ms: median step time over all seeds (first 2 steps of each left "
        "out); peak MB: resident-set peak above the run's process baseline during training; live MB: live-tensor "
        "peak of one more step. Every model, trained either way, is judged by the same evaluator (transformers' own "
        "loss on the held-out windows, or the demo's exact-match accuracy). Values are means over seeds, per-seed "
        "values in brackets; train s: training seconds of the whole run (evaluation excluded).",
        "",
    ]
    if payload.get("reused"):
        reused = payload["reused"]
        lines += [
            f"Runs reused from {', '.join(f'`{f}`' for f in reused['files'])} (earlier invocations of this benchmark "
            f"with the same mode, seeds, steps and batches): {', '.join(reused['methods'])}. Their step times and "
            "peaks were measured in those runs.",
            "",
        ]
    for task, data in payload["tasks"].items():
        info, rows = TASKS[task], data["methods"]
        facts = data["facts"]
        arrow = "higher is better" if info["higher_is_better"] else "lower is better"
        lines += [f"## Task: {info['title']}", ""]
        if task in TEXT_TASKS:
            mdl = facts["model"]
            lines.append(
                f"Model: byte-level qwen3_moe, {mdl.get('parameters', 0) / 1e6:.1f} M parameters"
                + (
                    f", pretrained {mdl['pretrain']['steps']} steps × {mdl['pretrain']['batch']} × "
                    f"{mdl['pretrain']['seq']} bytes in {mdl['seconds']:.0f} s ({mdl['threads']} threads): held-out "
                    f"loss old {mdl['old_loss']:.3f}, new {mdl['new_loss']:.3f} nats/byte (uniform "
                    f"{mdl['uniform_loss']:.2f})"
                    if "old_loss" in mdl
                    else " (smoke: a tiny model)"
                )
                + f". Domains (bytes): {json.dumps(facts['domains'])}; {facts['train_records']} training records; "
                f"{facts['tokens_per_step']} tokens per step; eval tokens {json.dumps(facts['eval_tokens'])}."
            )
        else:
            lines.append(
                f"Model: the bundled demo model ({facts['model']['parameters'] / 1e6:.2f} M parameters); "
                f"{facts['train_records']} shift training records; {facts['eval_records']} held-out records per "
                f"kind (shift: bundled eval.jsonl; copy/upper: make_examples(kind, n, {FRESH_SEED}))."
            )
        lines += [
            "",
            f"{payload['steps'][task]} steps. New: {info['new']}; old: {info['old']} ({info['metric']}, {arrow}).",
            "",
        ]
        table_rows = []
        for r in rows.values():
            per_new = " / ".join(_metric(task, s["new"]) for s in r["per_seed_after"])
            per_old = " / ".join(_metric(task, s["old"]) for s in r["per_seed_after"])
            lr = f"{r['lr']:g}"
            table_rows.append(
                [
                    r["label"],
                    lr if r["kind"] != "inference" else "–",
                    params_label(r["trainable_params"]),
                    f"{_metric(task, r['before']['new'])} → {_metric(task, r['after']['new'])} [{per_new}]",
                    f"{_metric(task, r['before']['old'])} → {_metric(task, r['after']['old'])} [{per_old}]",
                    fmt(r["step_ms"], "{:.0f}"),
                    fmt(r["train_s"], "{:.0f}"),
                    fmt(r["peak_mb"], "{:.0f}"),
                    fmt(r["tensor_peak_mb"], "{:.0f}"),
                ]
            )
        for key, error in data["errors"].items():
            table_rows.append([key, f"FAILED: {error.strip().splitlines()[-1][:150]}", *[None] * 7])
        header = [
            "method",
            "lr",
            "trainable",
            "new before → after [per seed]",
            "old before → after [per seed]",
            "step ms",
            "train s",
            "peak MB",
            "live MB",
        ]
        lines += table(header, table_rows, align="lrrllrrrr")
        if task == "demo":
            lines += [
                "",
                "Per kind after training (means): "
                + "; ".join(
                    f"{r['label']} @ {r['lr']:g}: "
                    + ", ".join(f"{k} {v:.1%}" for k, v in r["extra_after"].items())
                    for r in rows.values()
                ),
            ]
        # equal steps: the curves
        trained = [r for r in rows.values() if r["kind"] != "inference"]
        if trained:
            steps = sorted({p["step"] for r in trained for p in r["curve"]})
            lines += [
                "",
                "### At equal steps: new / old along the run (means over seeds; training seconds in brackets; "
                "usaf rows: the base and the last step only)",
                "",
            ]
            curves = []
            for r in trained:
                at = {p["step"]: p for p in r["curve"]}
                cells = [
                    f"{_metric(task, p['new'])} / {_metric(task, p['old'])} ({p['elapsed_s']:.0f} s)"
                    if (p := at.get(step))
                    else "–"
                    for step in steps
                ]
                curves.append([r["label"], f"{r['lr']:g}", *cells])
            lines += table(["method", "lr", *(f"step {s}" for s in steps)], curves, align="lr")
        if data.get("wall_reference_s"):
            wall = data["wall_reference_s"]
            lines += [
                "",
                f"### At equal wall-clock: {wall:.0f} training seconds (LoRA at lr {data['lora_mid']['lr']:g}, its "
                "whole run); a method that finished sooner shows its final values; a usaf row that did not is left "
                "out (its curve has no middle points)",
                "",
            ]
            at_wall = []
            for r in rows.values():
                w = r.get("at_lora_wall")
                if not w:
                    continue
                note = "finished sooner" if w["finished"] and r["kind"] != "inference" else ""
                lr = f"{r['lr']:g}" if r["kind"] != "inference" else "–"
                at_wall.append([r["label"], lr, _metric(task, w["new"]), _metric(task, w["old"]), note])
            lines += table(["method", "lr", "new", "old", "note"], at_wall, align="lrrr")
        # usaf rows' peaks are their whole process's (metrics.jsonl), not above a baseline: not compared here
        measured = [r for r in rows.values() if r["peak_mb"] is not None and r["kind"] != "usaf"]
        lora_peak = _mean([r["peak_mb"] for r in rows.values() if r["kind"] == "lora"])
        if measured:
            lines += [
                "",
                "### At equal peak memory: the baselines by peak RSS; best new-domain result within each budget "
                "(usaf rows measure their whole `usaf train` process: see the first table, not comparable here)",
                "",
            ]
            sign = -1 if info["higher_is_better"] else 1
            by_peak = []
            for r in sorted(measured, key=lambda r: r["peak_mb"]):
                within = [x for x in measured if x["peak_mb"] <= r["peak_mb"]]
                best = min(within, key=lambda x: sign * x["after"]["new"])
                by_peak.append(
                    [
                        r["label"],
                        f"{r['lr']:g}",
                        f"{r['peak_mb']:.0f}",
                        fmt(r["peak_mb"] / lora_peak if lora_peak else None, "{:.2f}"),
                        fmt(r["tensor_peak_mb"], "{:.0f}"),
                        _metric(task, r["after"]["new"]),
                        _metric(task, r["after"]["old"]),
                        f"{_metric(task, best['after']['new'])} ({best['label']} @ {best['lr']:g})",
                    ]
                )
            header = ["method", "lr", "peak MB", "÷ LoRA", "live MB", "new", "old"]
            lines += table([*header, "best new within this peak (method)"], by_peak, align="lrrrrrr")
        lines += frontier_lines(task, rows)
        lines.append("")
    lines += ["## usaf specs", "", "```json", json.dumps(payload["usaf_specs"], indent=1), "```", ""]
    return "\n".join(lines)


def _distance(task: str, value) -> str:
    return (
        "outside"
        if value is None
        else fmt(value, "{:+.1%}" if TASKS[task]["higher_is_better"] else "{:+.3f}")
    )


_SAID = {True: "yes", False: "no", None: "outside"}


def _verdict(against: dict, kind: str, key: str) -> str:
    """A verdict in words; past a frontier where no distance could be given says why."""
    beyond = against[kind]["mean"] is None and against[kind].get("better_than_every_point")
    return _SAID[against["verdict"][key]] + (
        " (better than each of its points on both axes)" if beyond else ""
    )


def frontier_lines(task: str, rows: dict) -> list[str]:
    """The "Against the frontiers" table, a verdict a usaf row, and the usaf runs' command lines."""
    usaf_rows = [r for r in rows.values() if r["kind"] == "usaf"]
    if not usaf_rows:
        return []
    flip = (
        " (accuracies: signs flipped, so negative = past the frontier here too)"
        if TASKS[task]["higher_is_better"]
        else ""
    )
    lines = [
        "",
        "### Against the frontiers",
        "",
        "A frontier: the family's per-learning-rate means (new, old), piecewise linear, sorted by new. Distance: the "
        "usaf row's old minus the frontier's old at the row's new value, for the mean and [each seed]; negative = "
        f"past the frontier{flip}; outside = the new value lies beyond the frontier's range (no extrapolation); a "
        "row at least as good as each of a frontier's points on both axes is past that frontier all the same. "
        "Spread: max − min over seeds.",
        "",
    ]
    header = [
        "usaf",
        "lr",
        "new [per seed]",
        "old [per seed]",
        "full FT's old at same new",
        "to full FT [per seed]",
    ]
    header += ["LoRA's old at same new", "to LoRA [per seed]", "spread new / old"]
    body, verdicts = [], []
    for r in usaf_rows:
        against, seeds = r["against_frontiers"], r["per_seed_after"]
        cells = [r["label"], f"{r['lr']:g}"]
        for k in ("new", "old"):
            cells.append(f"{_metric(task, r['after'][k])} [{' / '.join(_metric(task, s[k]) for s in seeds)}]")
        for kind in ("full", "lora"):
            a = against[kind]
            cells.append(_metric(task, a["old_at_same_new"]))
            cells.append(
                f"{_distance(task, a['mean'])} [{' / '.join(_distance(task, d) for d in a['per_seed'])}]"
            )
        spread, verdict = against["spread"], against["verdict"]
        cells.append(f"{_metric(task, spread['new'])} / {_metric(task, spread['old'])}")
        body.append(cells)
        verdicts.append(
            f"- {r['label']}: on/past full FT's frontier: {_verdict(against, 'full', 'past_full')}; LoRA "
            f"dominated: {_verdict(against, 'lora', 'lora_dominated')}; spread new {_metric(task, spread['new'])} / old "
            f"{_metric(task, spread['old'])} (≤ {SPREAD_LIMIT}: {_SAID[verdict['spread_within_limit']]})"
        )
    lines += [
        *table(header, body, align="lrllrlrlr"),
        "",
        *verdicts,
        "",
        "usaf runs (each seed's command lines):",
        "",
    ]
    for r in usaf_rows:
        for run in r["runs"]:
            lines += [
                f"- {r['label']}, seed {run['seed']}: `{run['commands'][0]}` then `{run['commands'][1]}`"
            ]
    return lines


def chart(payload: dict, path: Path) -> None:
    tasks = payload["tasks"]
    fig, axes = subplots(len(tasks), 1, figsize=(13, 6.5 * len(tasks)))
    colors = {"lora": "tab:blue", "full": "tab:red", "experts": "tab:orange", "usaf": "tab:green"}
    for ax, (task, data) in zip(axes[:, 0], tasks.items(), strict=True):
        info, rows = TASKS[task], data["methods"]
        scale = 100 if info["higher_is_better"] else 1
        for kind, name in (("lora", "LoRA frontier"), ("full", "full fine-tuning frontier")):
            points = frontier(rows, kind)
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(
                    [x * scale for x in xs],
                    [y * scale for y in ys],
                    "-",
                    color=colors[kind],
                    alpha=0.6,
                    label=name,
                )
        markers = {"lora": "o", "full": "s", "experts": "D", "usaf": "^", "inference": "*"}
        for i, r in enumerate(rows.values()):
            color = colors.get(r["kind"], "black")
            if len(r["per_seed_after"]) > 1:  # each seed's point, faint
                ax.scatter(
                    [s["new"] * scale for s in r["per_seed_after"]],
                    [s["old"] * scale for s in r["per_seed_after"]],
                    marker=markers[r["kind"]],
                    s=18,
                    color=color,
                    alpha=0.25,
                    zorder=2,
                )
            x, y = r["after"]["new"] * scale, r["after"]["old"] * scale
            size = 90 if r["kind"] in ("inference", "usaf") else 50
            ax.scatter(x, y, marker=markers[r["kind"]], s=size, color=color, zorder=3)
            ax.annotate(f"{i}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        legend = "\n".join(
            f"{i}: {r['label']}" + (f" @ {r['lr']:g}" if r["kind"] != "inference" else "")
            for i, r in enumerate(rows.values())
        )
        ax.text(1.01, 1.0, legend, transform=ax.transAxes, fontsize=7, va="top", family="monospace")
        unit = " (%)" if info["higher_is_better"] else ""
        ax.set_xlabel(f"{info['new']}{unit} — adaptation")
        ax.set_ylabel(f"{info['old']}{unit} — forgetting")
        ax.set_title(
            f"{task}: {info['title']}\n({'up-right' if info['higher_is_better'] else 'down-left'} is better)",
            fontsize=10,
        )
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    fig.suptitle(
        f"usaf (usaf train, exported) vs LoRA / full FT / experts: adaptation vs forgetting, means and seeds — "
        f"{payload['machine']['date']}"
    )
    save_figure(fig, path, right=0.66)  # room for the numbered legend on the right


# ---- main ------------------------------------------------------------------------------------------------------


def _reusable_runs(paths: list[Path], payload: dict, methods: list[dict], baselines_only: bool) -> dict:
    """{(task, method key): (per-seed runs, file)} of this invocation's methods found in earlier results files of
    the same mode, seeds and sizes (refused otherwise: a different setting would compare unequal runs); a usaf row
    only where its --set overrides are the same; the first file that has a method gives it."""
    wanted = {m["key"]: m for m in methods if not (baselines_only and m["kind"] == "usaf")}
    found = {}
    for path in paths:
        old = json.loads(Path(path).read_text())
        for field in ("mode", "seeds"):
            if old.get(field) != payload[field]:
                raise SystemExit(
                    f"{path}: {field} {old.get(field)!r} differs from this run's {payload[field]!r}"
                )
        for task, sizes in payload["sizes"].items():
            if task not in old.get("tasks", {}):
                continue
            if old.get("sizes", {}).get(task) != sizes:
                raise SystemExit(f"{path}: the {task} task's sizes differ from this run's")
            for key, method in old["tasks"][task]["methods"].items():
                same = key in wanted and method.get("set") == wanted[key].get("set")
                if same and len(method.get("runs", [])) == len(payload["seeds"]):
                    found.setdefault((task, key), (method["runs"], str(path)))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_const", dest="mode", const="quick", help="a few minutes")
    mode.add_argument("--smoke", action="store_const", dest="mode", const="smoke", help="tiny shapes (tests)")
    parser.set_defaults(mode="full")
    parser.add_argument(
        "--task", choices=["shift", "arith", "demo", "all"], default="all", help="all: shift and arith"
    )
    parser.add_argument("--steps", type=int, default=None, help="training steps of every run (every task)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default: 0 1 2 (quick, smoke: 0)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    parser.add_argument(
        "--jobs", type=int, default=None, help="runs at once (default: CPUs // threads, <= 2)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for quality-<date>.{md,json,png}")
    parser.add_argument(
        "--methods", default=None, help="comma-separated kinds to run (inference,lora,full,...)"
    )
    parser.add_argument(
        "--usaf-spec",
        action="append",
        default=[],
        type=json.loads,
        help='one more usaf row: {"label": ..., "set": {"optim.lr": 5e-3, ...}} (usaf train --set keys)',
    )
    parser.add_argument(
        "--only-given-specs", action="store_true", help="of the usaf rows, run only those of --usaf-spec"
    )
    parser.add_argument(
        "--reuse-baselines",
        type=Path,
        action="append",
        default=[],
        help="a results JSON of the same mode, seeds and steps: take its LoRA, full fine-tuning, dense experts "
        "and inference runs instead of running them again (they do not depend on usaf's code); repeatable",
    )
    parser.add_argument(
        "--reuse-runs",
        type=Path,
        action="append",
        default=[],
        help="as --reuse-baselines, usaf rows too (the same label and --set overrides): one report of runs made "
        "by several invocations, e.g. baselines and usaf rows run side by side; repeatable",
    )
    args = parser.parse_args(argv)
    sizes = copy.deepcopy(MODES[args.mode])
    seeds = args.seeds if args.seeds is not None else sizes["seeds"]
    if args.steps:
        for task in TASKS:
            sizes[task]["steps"] = args.steps
            sizes[task]["eval_every"] = min(sizes[task]["eval_every"], args.steps)
    jobs = args.jobs or max(1, min(2, (os.cpu_count() or 1) // args.threads))
    methods = methods_for(args.mode, args.usaf_spec, builtin_usaf=not args.only_given_specs)
    if args.methods:
        kinds = set(args.methods.split(","))
        methods = [m for m in methods if m["kind"] in kinds]
    tasks = list(TEXT_TASKS) if args.task == "all" else [args.task]
    stem = "quality" if args.mode == "full" else f"quality-{args.mode}"

    import multiprocessing as mp

    context = mp.get_context("forkserver")
    context.set_forkserver_preload(
        ["torch", "transformers", "peft", "usaf", "usaf.demo.task", "recipe", "harness", "arith"]
    )
    started = time.perf_counter()
    env = call_in_fork(context, "harness", "environment", threads=args.threads)
    payload = {
        "command": " ".join(["python", "bench/quality.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": env["machine"],
        "versions": env["versions"],
        "mode": args.mode,
        "threads": args.threads,
        "jobs": jobs,
        "seeds": seeds,
        "steps": {t: sizes[t]["steps"] for t in tasks},
        "sizes": {t: sizes[t] for t in tasks},
        "usaf_specs": [m for m in methods if m["kind"] == "usaf"],
        "lora": {"r": LORA_RANK, "alpha": LORA_ALPHA, "modules": LORA_ATTENTION, "parameters": LORA_EXPERTS},
        "tasks": {},
    }
    reused = {
        **_reusable_runs(args.reuse_runs, payload, methods, baselines_only=False),
        **_reusable_runs(args.reuse_baselines, payload, methods, baselines_only=True),
    }
    if reused:
        payload["reused"] = {
            "files": sorted({file for _, file in reused.values()}),
            "methods": sorted(f"{task}:{key}" for task, key in reused),
        }
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="usaf-quality-")))
        for task in tasks:
            print(f"== {task}: preparing", flush=True)
            began = time.perf_counter()
            try:
                prepared = call_in_fork(
                    context,
                    "quality",
                    "prepare_task",
                    task=task,
                    sizes=sizes[task],
                    seeds=seeds,
                    workdir=str(workdir),
                    smoke=args.mode == "smoke",
                )
            except RuntimeError as err:
                print(f"error: {task}: {str(err).strip().splitlines()[-1]}", file=sys.stderr)
                return 2
            print(f"   prepared in {time.perf_counter() - began:.0f} s", flush=True)
            job = {
                "model_dir": prepared["model_dir"],
                "records": prepared["records"],
                "data": prepared["data"],
                "workdir": str(workdir / task),
                "threads": args.threads,
                "steps": sizes[task]["steps"],
                "batch": sizes[task]["batch"],
                "seq": sizes[task]["seq"],
                "eval_every": sizes[task]["eval_every"],
            }
            runs: dict[str, list] = {k: v for (t, k), (v, _) in reused.items() if t == task}
            errors: dict[str, str] = {}

            todo = [
                {"task": task, "method": m, "seed": seed, "job": job}
                for m in methods
                for seed in seeds
                if m["key"] not in runs
            ]
            for call, result, error, took in map_in_forks(context, "quality", "run_method", todo, jobs):
                method, seed = call["method"], call["seed"]
                if error is not None:
                    errors[f"{method['key']} seed {seed}"] = error
                    print(f"   {method['key']:<60} seed {seed}: FAILED\n{error}", flush=True)
                    continue
                runs.setdefault(method["key"], []).append(result)
                last, first = result["curve"][-1], result["curve"][0]
                print(
                    f"   {method['key']:<60} seed {seed}: new {first['new']:.4f} -> {last['new']:.4f}  "
                    f"old {first['old']:.4f} -> {last['old']:.4f}  ({took:.0f} s)",
                    flush=True,
                )
            payload["tasks"][task] = {**aggregate(task, methods, runs, errors), "facts": prepared["facts"]}
            gc.collect()
    payload["wall_s"] = time.perf_counter() - started
    text = markdown(payload)
    json_path, md_path = write_results(stem, payload, text, out_dir=args.out)
    png = json_path.with_suffix(".png")
    chart(payload, png)
    print(text)
    print(f"wrote {json_path}, {md_path}, {png} in {payload['wall_s']:.0f} s")
    return 1 if any(t["errors"] for t in payload["tasks"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
