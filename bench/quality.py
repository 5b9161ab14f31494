"""Quality of fine-tunes, side by side: how much each method learns of a new domain and how much it forgets of
the old one, at equal steps, equal wall-clock and equal peak memory. `make bench-quality` runs it; results go to
bench/results/quality-<date>.{md,json,png}.

    .venv/bin/python bench/quality.py                     # both tasks, every method, seeds 0 1, 60 steps (~20 min)
    .venv/bin/python bench/quality.py --steps 150         # longer runs (~2.5x the time)
    .venv/bin/python bench/quality.py --quick             # fewer steps and methods, one seed (a few minutes)
    .venv/bin/python bench/quality.py --smoke --out DIR   # tiny shapes, seconds of work (tests)
    .venv/bin/python bench/quality.py --usaf-spec '{"label": "usaf 2 %", "select": {"density": 0.02}, "lr": 1e-2}'

Tasks
- shift (the headline): a byte-level Qwen3-MoE (~13.5 M parameters) pretrained on English documentation/licence
  prose (scripts/make_shift_model.py, cached in bench/.cache/shift-model/) is fine-tuned on roff man-page
  source. Adaptation: held-out loss on the new domain (nats/byte = nats/token); forgetting: held-out loss on the
  old domain. Lower is better for both.
- demo: the bundled demo model (knows `copy` and `upper`) learns `shift` (usaf.demo.task) from the bundled
  train.jsonl. Adaptation: exact-match accuracy on the bundled held-out shift records; forgetting: the mean
  accuracy on fresh copy and upper records (a seed that neither pretraining nor the bundled data used).
  Higher is better for both.

How it measures
- Every run (method x learning rate x seed) is its own process, forked from a server that imported torch,
  transformers, peft and usaf once; `--jobs` of them run at once (default 2, 1 torch thread each: on a shared
  2-core CPU, 2-thread processes stall on OpenMP barriers). Peak memory: the resident set's peak above the
  process's baseline (VmHWM, reset after the model is built), and the live-tensor peak of one more training step
  (bench/harness.py's TensorPeak: what a GPU allocator's peak would count).
- Every training run: the same batches in the same order for a given seed, the same number of steps,
  `usaf.causal_lm_loss`, AdamW (betas 0.9/0.999, no weight decay), clipping at 1.0, linear warm-up over 10 % of the
  steps then cosine to 10 % of the peak learning rate. Baselines run transformers' `grouped_mm` experts.
- Evaluations at step 0 and every `eval_every` steps, with the training seconds elapsed (evaluation time not
  counted), so methods compare at equal steps and, interpolated, at equal wall-clock.
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
from harness import (  # noqa: E402
    PeakMemory,
    TensorPeak,
    call_in_fork,
    fmt,
    map_in_forks,
    own_mapped_weights,
    params_label,
    save_figure,
    subplots,
    table,
    write_results,
)
from recipe import LORA_ALPHA, LORA_ATTENTION, LORA_EXPERTS, LORA_RANK, lr_factor, stock_baseline  # noqa: E402

from usaf.config import AUTO_DENSITIES, OptimSection  # noqa: E402

DEFAULT_DECAY = OptimSection().decay_to_base  # optim.decay_to_base

# ============================================================================================================
# usaf configurations: EXTEND HERE (or pass --usaf-spec JSON on the command line, repeatable).
# "select" goes to usaf.UsafConfig(**select) untouched, so any UsafConfig keyword works (new ones too);
# routers train at lr * router_lr_multiplier (0.1: what the README found better than 1.0 on the demo task).
# ============================================================================================================
USAF_SPECS: list[dict] = [
    # the defaults (usaf.RunConfig()): experts + attention + embedding and output rows at select.density=auto (the
    # most auto takes, AUTO_DENSITIES[0] = 2 %, where usaf train's memory plan fits it, as on this machine), chosen
    # by gradient on calibration batches and reselected every 10 steps, optim.decay_to_base 4, routers frozen,
    # values' moments in bf16; at the default rate 1e-2, at half and twice it, and at four times it
    *(
        {
            "label": "usaf default",
            "select": {"density": AUTO_DENSITIES[0]},
            "lr": lr,
            "router_lr_multiplier": 0.1,
            "decay_to_base": DEFAULT_DECAY,
        }
        for lr in (1e-2, 5e-3, 2e-2, 4e-2)
    ),
    # what auto takes on a 12 GB card for Qwen3-30B-A3B (1 %: usaf plan), and the previous default (1 %, 5e-3, no
    # decay toward the base)
    {
        "label": "usaf default at 1 %",
        "select": {"density": 0.01},
        "lr": 1e-2,
        "router_lr_multiplier": 0.1,
        "decay_to_base": DEFAULT_DECAY,
    },
    {
        "label": "usaf 0.2.0 default (1 %, no decay)",
        "select": {"density": 0.01},
        "lr": 5e-3,
        "router_lr_multiplier": 0.1,
    },
    # the same with fp32 moments: what the 16-byte entry state (bf16 moments) changes
    {
        "label": "usaf default, fp32 moments",
        "select": {"density": AUTO_DENSITIES[0]},
        "lr": 1e-2,
        "router_lr_multiplier": 0.1,
        "decay_to_base": DEFAULT_DECAY,
        "moments": "fp32",
    },
    # what reselection and the larger budget add: the previous default (0.5 %, no reselection) and 1 % without
    {
        "label": "usaf 0.5 %, no reselection",
        "select": {"density": 0.005, "reselect_every": 0},
        "lr": 1e-2,
        "router_lr_multiplier": 0.1,
    },
    {
        "label": "usaf 1 %, no reselection",
        "select": {"density": 0.01, "reselect_every": 0},
        "lr": 5e-3,
        "router_lr_multiplier": 0.1,
    },
    # 0.1.0's defaults: experts + routers at 0.5 % by magnitude, lr 1e-3, routers at the same rate
    {
        "label": "usaf 0.1.0 default (experts + routers, magnitude)",
        "select": {
            "targets": ["experts", "routers"],
            "selection": "magnitude",
            "density": 0.005,
            "reselect_every": 0,
        },
        "lr": 1e-3,
        "router_lr_multiplier": 1.0,
    },
    # routers on top of the default, at a tenth of the rate
    {
        "label": "usaf default + routers (lr x 0.1)",
        "select": {
            "density": AUTO_DENSITIES[0],
            "targets": ["experts", "routers", "attention", "embeddings", "lm_head"],
        },
        "lr": 1e-2,
        "decay_to_base": DEFAULT_DECAY,
        "router_lr_multiplier": 0.1,
    },
]

# Baselines: learning rates per family (LoRA's middle one is the reference point of "dominates").
LORA_LRS = [1e-3, 3e-3, 1e-2]
FULL_LRS = [1e-4, 3e-4, 1e-3]  # three: full fine-tuning's frontier spans the usaf rows' adaptation
EXPERTS_LRS = [3e-4, 1e-3]

# Per-mode sizes of the runs.
MODES = {
    "full": dict(
        # 60 steps, not 150: at 150 the whole benchmark takes ~60 min on this project's 2-core CPU (--steps 150)
        shift=dict(steps=150, batch=8, seq=128, eval_every=25, eval_windows=32),
        demo=dict(steps=150, batch=32, eval_every=50, eval_records=200),
        seeds=[0, 1],
    ),
    "quick": dict(
        shift=dict(steps=40, batch=8, seq=128, eval_every=10, eval_windows=16),
        demo=dict(steps=60, batch=32, eval_every=20, eval_records=100),
        seeds=[0],
    ),
    "smoke": dict(
        shift=dict(steps=3, batch=2, seq=32, eval_every=3, eval_windows=2),
        demo=dict(steps=3, batch=8, eval_every=3, eval_records=8),
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
    "demo": dict(
        title="demo model: learn `shift`, keep `copy` and `upper`",
        metric="exact-match accuracy",
        new="shift accuracy",
        old="mean copy/upper accuracy",
        higher_is_better=True,
    ),
}


def methods_for(mode: str, extra_specs: list[dict], builtin_usaf: bool = True) -> list[dict]:
    """Every row: {key, label, kind, lr, select, router_lr_multiplier}."""
    rows = [{"key": "inference", "label": "inference (no training)", "kind": "inference", "lr": 0.0}]
    lora, full, experts, specs = LORA_LRS, FULL_LRS, EXPERTS_LRS, USAF_SPECS
    if mode == "quick":
        full, experts, specs = FULL_LRS[-1:], EXPERTS_LRS[-1:], USAF_SPECS[:2]
    if mode == "smoke":
        lora, full, experts, specs = (
            LORA_LRS[:2],
            FULL_LRS[-1:],
            EXPERTS_LRS[-1:],
            [USAF_SPECS[0], USAF_SPECS[3]],
        )
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
        if not {"label", "select", "lr"} <= set(spec):
            raise SystemExit(f"a usaf spec needs label, select and lr: {spec}")
        rows.append(
            {
                "key": f"usaf:{spec['label']}@{spec['lr']:g}",
                "label": spec["label"],
                "kind": "usaf",
                "lr": float(spec["lr"]),
                "select": dict(spec["select"]),
                "router_lr_multiplier": float(spec.get("router_lr_multiplier", 1.0)),
                "moments": spec.get("moments", "bf16"),
                "decay_to_base": float(spec.get("decay_to_base", 0.0)),  # optim.decay_to_base
            }
        )
    keys = [r["key"] for r in rows]
    if len(set(keys)) != len(keys):
        raise SystemExit(f"two methods share label and lr: {sorted(k for k in keys if keys.count(k) > 1)}")
    return rows


# ---- data, in a helper process ---------------------------------------------------------------------------------


def prepare_task(task: str, sizes: dict, seeds: list[int], workdir: str, smoke: bool) -> dict:
    """Writes the model (smoke: a tiny one) and per-seed batches; returns {model_dir, data: {seed: path}, facts}."""
    import torch

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    root = Path(workdir) / task
    root.mkdir(parents=True, exist_ok=True)
    return (_prepare_shift if task == "shift" else _prepare_demo)(root, sizes, seeds, smoke)


def _prepare_shift(root: Path, sizes: dict, seeds: list[int], smoke: bool) -> dict:
    import make_shift_model as shift
    import torch

    data = shift.domains()
    if smoke:  # a tiny byte-level model, a few pretraining steps: seconds
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        tiny = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
        tiny.update(head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
        model = AutoModelForCausalLM.from_config(shift.model_config(**tiny), dtype=torch.float32)
        shift.pretrain(
            model,
            shift.encode(data["old"]["train"]),
            {},
            dict(steps=4, batch=4, seq=32, lr=3e-3, warmup=1),
            log=lambda *_: None,
        )
        model_dir = root / "model"
        model.save_pretrained(model_dir)
        shift.byte_tokenizer().save_pretrained(model_dir)
        pretrained = {"parameters": sum(p.numel() for p in model.parameters()), "smoke": True}
    else:
        model_dir = shift.build(log=lambda line: print(f"  [pretrain] {line}", flush=True))
        pretrained = json.loads((model_dir / "pretrain.json").read_text())
    seq = sizes["seq"]
    evals = {
        name: shift.held_out_batches(shift.encode(data[name]["held_out"]), seq, sizes["eval_windows"], 16)
        for name in ("old", "new")
    }
    train_ids = shift.encode(data["new"]["train"])
    paths = {}
    for seed in seeds:
        generator = torch.Generator().manual_seed(1000 + seed)
        batches = [
            shift.windows(train_ids, sizes["batch"], seq, generator) for _ in range(sizes["steps"] + 1)
        ]
        path = root / f"data-{seed}.pt"
        torch.save({"train": [(b, b) for b in batches], "eval": evals}, path)
        paths[seed] = str(path)
    return {
        "model_dir": str(model_dir),
        "data": paths,
        "facts": {
            "model": pretrained,
            "domains": {k: {kk: len(vv) for kk, vv in v.items()} for k, v in data.items()},
            "tokens_per_step": sizes["batch"] * seq,
            "eval_tokens": {k: sum(b.numel() for b in v) for k, v in evals.items()},
        },
    }


def _prepare_demo(root: Path, sizes: dict, seeds: list[int], smoke: bool) -> dict:
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
    for seed in seeds:
        order = random.Random(seed)  # seeded, reshuffled each epoch, the same for every method
        batches, pool = [], []
        while len(batches) < sizes["steps"] + 1:
            if len(pool) < sizes["batch"]:
                fresh = list(records)
                order.shuffle(fresh)
                pool += fresh
            batches.append(encode_records(tokenizer, pool[: sizes["batch"]]))
            pool = pool[sizes["batch"] :]
        path = root / f"data-{seed}.pt"
        torch.save({"train": batches, "eval": evals}, path)
        paths[seed] = str(path)
    params = sum(t.numel() for t in _safetensors(model_dir).values())
    return {
        "model_dir": str(model_dir),
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


def _build(method: dict, model_dir: str, calibration: list):
    """The model of one method, with exactly its trainable parameters; and the optimizer's parameter groups."""
    import torch
    from transformers import AutoModelForCausalLM

    import usaf

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    own_mapped_weights(model)
    kind, lr = method["kind"], method["lr"]
    if kind == "usaf":
        from usaf.train.optim import router_params as _router_params

        config = usaf.UsafConfig(**method["select"])
        usaf.prepare_model(model, config, calibration_batches=calibration)
        routers = {id(p) for p in _router_params(model)}
        trainable = [p for p in model.parameters() if p.requires_grad]
        # the values' moments as `usaf train` keeps them (optim.moments): bf16 unless the spec says "fp32"
        compact = method.get("moments", "bf16") == "bf16"
        values = [p for p in trainable if id(p) not in routers]
        decay = method.get("decay_to_base", 0.0)
        groups = [{"params": values, "lr": lr, "compact": compact, "decay_to_base": decay}]
        router_list = [p for p in trainable if id(p) in routers]
        if router_list:
            groups.append({"params": router_list, "lr": lr * method["router_lr_multiplier"]})
        return model, groups, config
    model = stock_baseline(model, kind)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, ([{"params": trainable, "lr": lr}] if trainable else []), None


class _Evaluator:
    def __init__(self, task: str, evals: dict, model_dir: str):
        self.task, self.evals = task, evals
        if task == "demo":
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def __call__(self, model) -> dict:
        import torch

        import usaf

        was = model.training
        model.eval()
        try:
            if self.task == "shift":
                out = {}
                with torch.no_grad():
                    for name, batches in self.evals.items():
                        total = sum(float(usaf.causal_lm_loss(model, b, b)) * b.shape[0] for b in batches)
                        out[name] = total / sum(b.shape[0] for b in batches)
                return out
            from usaf.demo.task import task_accuracy

            acc = {k: task_accuracy(model, self.tokenizer, records) for k, records in self.evals.items()}
            return {"new": acc["shift"], "old": (acc["copy"] + acc["upper"]) / 2, **acc}
        finally:
            model.train(was)


def run_method(task: str, method: dict, seed: int, job: dict) -> dict:
    """Train one method on one task with one seed; evaluations along the way; its own process's memory."""
    import torch

    import usaf

    torch.set_num_threads(job["threads"])
    torch.manual_seed(seed)
    data = torch.load(job["data"][seed], weights_only=True)  # the bench's own tensors, lists and strings
    train, steps = data["train"], job["steps"]
    memory = PeakMemory(torch.device("cpu"))

    def as_batch(ids, labels):
        return {"input_ids": ids, "labels": labels, "position_ids": torch.arange(ids.shape[1]).expand_as(ids)}

    calibration = [as_batch(*train[i]) for i in range(min(4, len(train)))]
    started = time.perf_counter()
    model, groups, config = _build(method, job["model_dir"], calibration)
    setup_s = time.perf_counter() - started
    trainable = [p for g in groups for p in g["params"]]
    evaluate = _Evaluator(task, data["eval"], job["model_dir"])
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
    if method["kind"] == "usaf":  # usaf's own AdamW (bf16 moments where the group is compact)
        from usaf.train.optim import CompactAdamW, base_lookup

        optimizer = CompactAdamW(
            groups, seed=seed, base_of=base_lookup(model), betas=(0.9, 0.999), weight_decay=0.0
        )
    else:
        optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.999), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(steps))
    reselector = None
    if config is not None and getattr(config, "reselect_every", 0):
        from usaf.selection.reselect import Reselector

        reselector = Reselector(model, config, steps)
    model.train()
    memory.reset()
    step_times, losses, elapsed = [], [], 0.0
    for step in range(steps):
        ids, labels = train[step]
        start = time.perf_counter()
        if reselector is not None:
            reselector.before_step(step + 1)
            reselector.set_observing(True)
        loss = usaf.causal_lm_loss(model, ids, labels)
        if reselector is not None:
            reselector.set_observing(False)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if reselector is not None:
            reselector.after_step(step + 1, optimizer)
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


def aggregate(task: str, methods: list[dict], runs: dict, errors: dict) -> dict:
    """Per method: means over seeds of every curve point, per-seed finals, times, memory; then the comparisons."""
    better = TASKS[task]["higher_is_better"]
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
    lora = sorted((r for r in rows.values() if r["kind"] == "lora"), key=lambda r: r["lr"])
    mid = lora[len(lora) // 2] if lora else None
    frontier = [(r["after"]["new"], r["after"]["old"]) for r in lora]
    full_frontier = [(r["after"]["new"], r["after"]["old"]) for r in rows.values() if r["kind"] == "full"]
    wall = mid["train_s"] if mid else None
    for _key, r in rows.items():
        if mid is not None and r["kind"] == "usaf":
            sign = -1 if better else 1  # compare as "lower is better"
            new, old = sign * r["after"]["new"], sign * r["after"]["old"]
            r["dominates_lora_mid"] = new < sign * mid["after"]["new"] and old < sign * mid["after"]["old"]
            at = _interp(frontier, r["after"]["new"])
            r["lora_frontier_old_at_same_new"] = at
            r["ahead_of_lora_frontier"] = None if at is None else old < sign * at
            at_full = _interp(full_frontier, r["after"]["new"])
            r["full_frontier_old_at_same_new"] = at_full
            r["reaches_full_frontier"] = None if at_full is None else old <= sign * at_full
        if wall is not None:
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


def _yes(value) -> str:
    return "–" if value is None else ("**yes**" if value else "no")


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
        "Every training run: the same batches in the same order per seed, AdamW (0.9/0.999, no weight decay), clip "
        "1.0, warm-up 10 % then cosine to 10 %, `usaf.causal_lm_loss`. Values are means over seeds, per-seed values "
        "in brackets. Step ms: median step time over all seeds (first 2 steps of each left out); train s: training "
        "seconds of the whole run (evaluation excluded). Peak MB: resident-set peak above the run's process "
        "baseline during training (model, optimizer state and activations); live MB: live-tensor peak of one more "
        "step (what a GPU allocator's peak counts). usaf routers train at lr × router_lr_multiplier; usaf rows use "
        "usaf's AdamW (`usaf.train.optim.CompactAdamW`: the values' moments in bf16 with stochastic rounding) unless a "
        "row says moments fp32.",
        "",
    ]
    if payload.get("reused_baselines"):
        reused = payload["reused_baselines"]
        lines += [
            f"Baseline runs reused from `{reused['file']}` (same mode, seeds, steps and batches; they do not run "
            f"usaf's code): {', '.join(reused['methods'])}. Their step times and peaks were measured in that run.",
            "",
        ]
    for task, data in payload["tasks"].items():
        info, rows = TASKS[task], data["methods"]
        facts = data["facts"]
        arrow = "higher is better" if info["higher_is_better"] else "lower is better"
        lines += [f"## Task: {info['title']}", ""]
        if task == "shift":
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
                + f". Domains (bytes): {json.dumps(facts['domains'])}. {facts['tokens_per_step']} tokens per step; "
                f"eval tokens {json.dumps(facts['eval_tokens'])}."
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
            lr = f"{r['lr']:g}" + (
                f" (routers ×{r['router_lr_multiplier']:g})" if r["kind"] == "usaf" else ""
            )
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
        steps = [p["step"] for p in next(iter(rows.values()))["curve"]] if rows else []
        trained = [r for r in rows.values() if r["kind"] != "inference"]
        if trained:
            steps = [p["step"] for p in trained[0]["curve"]]
            lines += [
                "",
                "### At equal steps: new / old along the run (means over seeds; training seconds in brackets)",
                "",
            ]
            curves = [
                [r["label"], f"{r['lr']:g}"]
                + [
                    f"{_metric(task, p['new'])} / {_metric(task, p['old'])} ({p['elapsed_s']:.0f} s)"
                    for p in r["curve"]
                ]
                for r in trained
            ]
            lines += table(["method", "lr", *(f"step {s}" for s in steps)], curves, align="lr")
        if data.get("wall_reference_s"):
            wall = data["wall_reference_s"]
            lines += [
                "",
                f"### At equal wall-clock: {wall:.0f} training seconds (LoRA at lr {data['lora_mid']['lr']:g}, its "
                "whole run); a method that finished sooner shows its final values",
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
        measured = [r for r in rows.values() if r["peak_mb"] is not None]
        lora_peak = _mean([r["peak_mb"] for r in rows.values() if r["kind"] == "lora"])
        if measured:
            lines += [
                "",
                "### At equal peak memory: methods by peak RSS; best new-domain result within each budget",
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
        usaf_rows = [r for r in rows.values() if r["kind"] == "usaf"]
        if usaf_rows and data.get("lora_mid"):
            mid = rows[data["lora_mid"]["key"]]
            lines += [
                "",
                f"### usaf against LoRA (middle lr {mid['lr']:g}: new {_metric(task, mid['after']['new'])}, old "
                f"{_metric(task, mid['after']['old'])})",
                "",
                "Dominates: better new AND better old than LoRA at its middle lr. Ahead of the frontier: better old "
                "than LoRA's frontier (linear between its learning rates) at the same new value; – when the new "
                "value lies outside LoRA's range. Reaches full fine-tuning's frontier: old no worse than full "
                "fine-tuning's (linear between its learning rates) at the same new value.",
                "",
            ]
            header = ["usaf", "lr", "new", "old", "dominates LoRA mid", "LoRA frontier's old at same new"]
            header += ["ahead of frontier", "full FT frontier's old at same new", "reaches full FT frontier"]
            against_lora = [
                [
                    r["label"],
                    f"{r['lr']:g}",
                    _metric(task, r["after"]["new"]),
                    _metric(task, r["after"]["old"]),
                    _yes(r.get("dominates_lora_mid")),
                    _metric(task, r.get("lora_frontier_old_at_same_new")),
                    _yes(r.get("ahead_of_lora_frontier")),
                    _metric(task, r.get("full_frontier_old_at_same_new")),
                    _yes(r.get("reaches_full_frontier")),
                ]
                for r in usaf_rows
            ]
            lines += table(header, against_lora, align="lrrrlrlrl")
        lines.append("")
    lines += ["## usaf specs", "", "```json", json.dumps(payload["usaf_specs"], indent=1), "```", ""]
    return "\n".join(lines)


def chart(payload: dict, path: Path) -> None:
    tasks = payload["tasks"]
    fig, axes = subplots(len(tasks), 1, figsize=(13, 6.5 * len(tasks)))
    colors = {"lora": "tab:blue", "full": "tab:red", "experts": "tab:orange", "usaf": "tab:green"}
    for ax, (task, data) in zip(axes[:, 0], tasks.items(), strict=True):
        info, rows = TASKS[task], data["methods"]
        scale = 100 if info["higher_is_better"] else 1
        lora = sorted((r for r in rows.values() if r["kind"] == "lora"), key=lambda r: r["after"]["new"])
        if lora:
            ax.plot(
                [r["after"]["new"] * scale for r in lora],
                [r["after"]["old"] * scale for r in lora],
                "-",
                color="tab:blue",
                alpha=0.6,
                label="LoRA frontier",
            )
        markers = {"lora": "o", "full": "s", "experts": "D", "usaf": "^", "inference": "*"}
        for i, r in enumerate(rows.values()):
            x, y = r["after"]["new"] * scale, r["after"]["old"] * scale
            ax.scatter(
                x,
                y,
                marker=markers[r["kind"]],
                s=90 if r["kind"] == "inference" else 50,
                color=colors.get(r["kind"], "black"),
                zorder=3,
            )
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
    fig.suptitle(f"usaf vs LoRA / full FT / experts: adaptation vs forgetting — {payload['machine']['date']}")
    save_figure(fig, path, right=0.66)  # room for the numbered legend on the right


# ---- main ------------------------------------------------------------------------------------------------------


def _reusable_baselines(path: Path, payload: dict) -> dict:
    """{(task, method key): per-seed runs} of the baseline methods in an earlier results file with the same mode,
    seeds, steps and sizes (refused otherwise: a different setting would compare unequal runs)."""
    old = json.loads(Path(path).read_text())
    for field in ("mode", "seeds"):
        if old.get(field) != payload[field]:
            raise SystemExit(f"{path}: {field} {old.get(field)!r} differs from this run's {payload[field]!r}")
    found = {}
    for task, sizes in payload["sizes"].items():
        if old.get("sizes", {}).get(task) != sizes:
            raise SystemExit(f"{path}: the {task} task's sizes differ from this run's")
        for key, method in old["tasks"][task]["methods"].items():
            if method["kind"] != "usaf" and len(method.get("runs", [])) == len(payload["seeds"]):
                found[(task, key)] = method["runs"]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_const", dest="mode", const="quick", help="a few minutes")
    mode.add_argument("--smoke", action="store_const", dest="mode", const="smoke", help="tiny shapes (tests)")
    parser.set_defaults(mode="full")
    parser.add_argument("--task", choices=["shift", "demo", "both"], default="both")
    parser.add_argument("--steps", type=int, default=None, help="training steps of every run (both tasks)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default: 0 1 (quick, smoke: 0)")
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
        help='one more usaf row: {"label", "select": {UsafConfig kwargs}, "lr", "router_lr_multiplier", '
        '"moments", "decay_to_base"}',
    )
    parser.add_argument(
        "--only-given-specs", action="store_true", help="of the usaf rows, run only those of --usaf-spec"
    )
    parser.add_argument(
        "--reuse-baselines",
        type=Path,
        default=None,
        help="a results JSON of the same mode, seeds and steps: take its LoRA, full fine-tuning, dense experts "
        "and inference runs instead of running them again (they do not depend on usaf's code)",
    )
    args = parser.parse_args(argv)
    sizes = copy.deepcopy(MODES[args.mode])
    seeds = args.seeds if args.seeds is not None else sizes["seeds"]
    if args.steps:
        for task in ("shift", "demo"):
            sizes[task]["steps"] = args.steps
            sizes[task]["eval_every"] = min(sizes[task]["eval_every"], args.steps)
    jobs = args.jobs or max(1, min(2, (os.cpu_count() or 1) // args.threads))
    methods = methods_for(args.mode, args.usaf_spec, builtin_usaf=not args.only_given_specs)
    if args.methods:
        kinds = set(args.methods.split(","))
        methods = [m for m in methods if m["kind"] in kinds]
    tasks = ["shift", "demo"] if args.task == "both" else [args.task]
    stem = "quality" if args.mode == "full" else f"quality-{args.mode}"

    import multiprocessing as mp

    context = mp.get_context("forkserver")
    context.set_forkserver_preload(
        ["torch", "transformers", "peft", "usaf", "usaf.demo.task", "recipe", "harness"]
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
    reused = _reusable_baselines(args.reuse_baselines, payload) if args.reuse_baselines else {}
    if reused:
        payload["reused_baselines"] = {
            "file": str(args.reuse_baselines),
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
                "data": prepared["data"],
                "threads": args.threads,
                "steps": sizes[task]["steps"],
                "eval_every": sizes[task]["eval_every"],
            }
            runs: dict[str, list] = {k: v for (t, k), v in reused.items() if t == task}
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
