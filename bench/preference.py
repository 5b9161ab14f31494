"""Preference quality: usaf DPO at its defaults against PEFT LoRA DPO and full-parameter DPO (TRL's DPOTrainer) at
equal steps, pairs per step and beta, the base the reference of all; every method judged the same way from its
saved folder in plain transformers (issue 39).

The task (the bundled demo model, which knows `copy` and `upper`): the Caesar shift as near-miss pairs, the shifted
word chosen over the same word with one letter left unshifted (copied, what the base does), so the contrast is one
token. The training pairs contrast only letters a-m; the held-out pairs are words never seen in training that
contrast only letters n-z: a method must learn the shift, not a rule about the contrasted letters. The base
prefers the rejected answer of most held-out pairs (reported).

Judged on the held-out pairs: the implicit reward r = beta (log pi(y|x) - log pi_base(y|x)) summed over the answer
tokens (and <eos>): reward accuracy (share with r_chosen > r_rejected) and mean margin r_chosen - r_rejected;
forgetting: KL(tuned || base) per token along the reference answers of held-out copy/upper prompts, and the
held-out SFT loss (nats/token) on those records. Frontiers: full DPO's and LoRA's, piecewise-linear through their
learning rates' means (accuracy and margin against KL).

    OMP_NUM_THREADS=1 .venv/bin/python bench/preference.py            # make bench-preference; ~4 min on 2 cores
    OMP_NUM_THREADS=1 .venv/bin/python bench/preference.py --usaf-lrs 1e-3 3e-3   # usaf at other rates too
    OMP_NUM_THREADS=1 .venv/bin/python bench/preference.py --smoke --out /tmp/x   # seconds
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import multiprocessing as mp
import os
import random
import shlex
import string
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "src"))

from harness import (  # noqa: E402
    RESULTS,
    fmt,
    machine,
    map_in_forks,
    run_commands,
    save_figure,
    subplots,
    table,
    write_results,
)
from recipe import LORA_ALPHA, LORA_RANK, stock_baseline  # noqa: E402

DEMO_MODEL = ROOT / "src" / "usaf" / "demo_assets" / "model"
BETA = 0.1  # usaf's train.dpo_beta default, given to TRL's DPOConfig(beta=...) too
# usaf's default schedule (schedule.name=cosine, warmup_steps=10, min_lr_ratio=0.1), given to TRL as well
WARMUP_STEPS, MIN_LR_RATIO = 10, 0.1
TRAIN_LETTERS, HELDOUT_LETTERS = string.ascii_lowercase[:13], string.ascii_lowercase[13:]
TRAIN_PAIRS, HELDOUT_PAIRS, OLD_RECORDS = 200, 100, 64  # OLD_RECORDS: per old skill (copy, upper)
LORA_LRS = [3e-4, 1e-3, 3e-3]
FULL_LRS = [1e-4, 3e-4, 1e-3]


# ---- the task: deterministic pairs from the demo task's own generators ----------------------------------------


def near_miss_pairs(records: list[dict], letters: str, n: int, seed: int) -> list[dict]:
    """{prompt, chosen: the shifted word, rejected: it with one letter of `letters` left as in the prompt}."""
    rng, pairs = random.Random(f"usaf-bench-preference/{seed}"), []
    for record in records:
        word = record["prompt"].split(": ", 1)[1].removesuffix(" -> ")
        where = [i for i, ch in enumerate(word) if ch in letters]
        if where and len(pairs) < n:
            i, chosen = rng.choice(where), record["completion"]
            pairs.append(
                {
                    "prompt": record["prompt"],
                    "chosen": chosen,
                    "rejected": chosen[:i] + word[i] + chosen[i + 1 :],
                }
            )
    return pairs


def write_task(folder: Path, train_pairs: int, heldout_pairs: int, old_records: int) -> dict:
    """train.jsonl (pairs), heldout.jsonl (pairs on unseen words), old.jsonl (copy/upper records), eval.jsonl (a
    few held-out pairs: usaf's own evaluation, which costs the run time); their paths."""
    from usaf.demo.task import PRETRAIN_KINDS, demo_splits, make_examples, write_jsonl

    train, heldout = demo_splits("shift", train_size=4 * train_pairs, eval_size=4 * heldout_pairs)
    pairs = near_miss_pairs(train, TRAIN_LETTERS, train_pairs, seed=1)
    held = near_miss_pairs(heldout, HELDOUT_LETTERS, heldout_pairs, seed=2)
    old = [r for kind in PRETRAIN_KINDS for r in make_examples(kind, old_records, seed=39)]
    folder.mkdir(parents=True, exist_ok=True)
    return {
        "train": str(write_jsonl(folder / "train.jsonl", pairs)),
        "heldout": str(write_jsonl(folder / "heldout.jsonl", held)),
        "old": str(write_jsonl(folder / "old.jsonl", old)),
        "eval": str(write_jsonl(folder / "eval.jsonl", held[:8])),
    }


# ---- the methods: each trains, saves a merged Hugging Face folder, and is judged from it -------------------------


def methods_for(smoke: bool, usaf_lrs: list[float]) -> list[dict]:
    """usaf at its defaults (and at `usaf_lrs`, its other settings the defaults), LoRA and full DPO at their rates."""
    lora, full = (LORA_LRS[1:2], FULL_LRS[1:]) if smoke else (LORA_LRS, FULL_LRS)
    return [
        {"key": "usaf", "kind": "usaf", "label": "usaf DPO (defaults)", "lr": None},
        *(
            {"key": f"usaf@{lr:g}", "kind": "usaf", "label": "usaf DPO (defaults, optim.lr)", "lr": lr}
            for lr in usaf_lrs
        ),
        *(
            {"key": f"lora@{lr:g}", "kind": "lora", "label": f"PEFT LoRA r={LORA_RANK} DPO", "lr": lr}
            for lr in lora
        ),
        *({"key": f"full@{lr:g}", "kind": "full", "label": "full DPO", "lr": lr} for lr in full),
    ]


def train_usaf(task: dict, seed: int, steps: int, batch: int, out: Path, lr: float | None) -> dict:
    """`usaf train` at its defaults (objective dpo, the run's seed, steps and pairs per step; optim.lr where `lr`
    is given), then `usaf export`."""
    run, merged = out / "run", out / "merged"
    train = [
        sys.executable, "-m", "usaf", "train", f"--model={DEMO_MODEL}", f"--data={task['train']}", f"--out={run}",
        "--set=train.objective=dpo", f"--set=train.seed={seed}", f"--set=schedule.max_steps={steps}",
        f"--set=data.batch_size={batch}", f"--set=data.eval={task['eval']}", f"--set=checkpoint.every_steps={steps}",
        "--set=log.progress=false", "--set=log.report_to=none", *([f"--set=optim.lr={lr:g}"] if lr else []),
    ]  # fmt: skip
    export = [sys.executable, "-m", "usaf", "export", str(run), f"--merged={merged}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    began = time.perf_counter()
    run_commands([train, export], env)
    return {
        "folder": str(merged),
        "seconds": time.perf_counter() - began,
        "train_seconds": json.loads((run / "summary.json").read_text())["train_seconds"],
        "commands": [shlex.join(["python", *train[1:]]), shlex.join(["python", *export[1:]])],
    }


def usaf_schedule(steps: int):
    """usaf's default learning-rate factors (schedule.name=cosine): warm-up (step + 1) / (warmup + 1), then the
    cosine of transformers' cosine_with_min_lr down to MIN_LR_RATIO of the peak."""

    def factor(step: int) -> float:
        if step < WARMUP_STEPS:
            return (step + 1) / (WARMUP_STEPS + 1)
        progress = min(1.0, (step - WARMUP_STEPS) / max(1, steps - WARMUP_STEPS))
        return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def train_trl(method: dict, task: dict, seed: int, steps: int, batch: int, out: Path) -> dict:
    """TRL's DPOTrainer on the recipe's PEFT LoRA (the reference: the adapter switched off) or on every parameter
    (the reference: TRL's own copy of the base), at usaf's schedule and beta; merged and saved to a folder."""
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(1)
    set_seed(seed)  # the LoRA adapters' initialisation
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    model = stock_baseline(AutoModelForCausalLM.from_pretrained(DEMO_MODEL), method["kind"])
    config = DPOConfig(
        output_dir=str(out / "trainer"), max_steps=steps, per_device_train_batch_size=batch,
        gradient_accumulation_steps=1, learning_rate=method["lr"], beta=BETA, seed=seed, data_seed=seed,
        save_strategy="no", report_to="none", logging_steps=max(1, steps // 4), use_cpu=True, disable_tqdm=True,
        dataloader_num_workers=0, gradient_checkpointing=False,
        router_aux_loss_coef=0.0,  # the DPO loss alone, as usaf's (TRL adds a MoE's load-balancing loss otherwise)
    )  # fmt: skip
    # AdamW as Trainer builds it (no weight decay), on usaf's schedule: Trainer's warm-up starts at 0, usaf's not
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=method["lr"], weight_decay=0.0
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, usaf_schedule(steps))
    pairs = load_dataset("json", data_files=task["train"], split="train")
    trainer = DPOTrainer(
        model=model,
        args=config,
        train_dataset=pairs,
        processing_class=tokenizer,
        optimizers=(optimizer, scheduler),
    )
    began = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - began
    tuned = trainer.model.merge_and_unload() if method["kind"] == "lora" else trainer.model
    tuned.save_pretrained(out / "merged")
    tokenizer.save_pretrained(out / "merged")
    return {"folder": str(out / "merged"), "train_seconds": train_seconds}


def run_method(
    method: dict, task: dict, seed: int = 0, steps: int = 0, batch: int = 0, workdir: str = ""
) -> dict:
    """One method at one seed in its own process: train, save, judge from the folder (the base: judged only)."""
    if method["kind"] == "base":
        return base_facts(task)
    out = Path(workdir) / f"{method['key']}-s{seed}"
    began = time.perf_counter()
    if method["kind"] == "usaf":
        done = train_usaf(task, seed, steps, batch, out, method["lr"])
    else:
        done = train_trl(method, task, seed, steps, batch, out)
    done.setdefault("seconds", time.perf_counter() - began)
    return {**done, "seed": seed, "steps": steps, **judge(done["folder"], task)}


# ---- the judge: plain transformers on the saved folders, usaf not involved ---------------------------------------


def encode(tokenizer, prompt: str, answer: str) -> tuple[list[int], int]:
    """`<bos> prompt answer <eos>` and the index of the answer's first token."""
    head = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    tail = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return head + tail, len(head)


def read_records(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def answer_logprobs(model, tokenizer, items: list[tuple[str, str]]):
    """Per item: the [answer tokens, vocab] log-probabilities predicting the answer and <eos>, and those tokens."""
    import torch

    out = []
    with torch.no_grad():
        for prompt, answer in items:
            ids, start = encode(tokenizer, prompt, answer)
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
            out.append((logits[start - 1 : -1].log_softmax(-1), torch.tensor(ids[start:])))
    return out


def sequence_logps(model, tokenizer, pairs: list[dict], side: str):
    """[pairs] log pi(answer | prompt) of each pair's `side` ("chosen" or "rejected"), summed over its tokens."""
    import torch

    scored = answer_logprobs(model, tokenizer, [(p["prompt"], p[side]) for p in pairs])
    return torch.stack([lp.gather(1, t[:, None]).sum() for lp, t in scored])


def judge(folder: str, task: dict) -> dict:
    """Reward accuracy and margin on the held-out pairs, KL to the base and SFT loss on the old skills."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    tuned = AutoModelForCausalLM.from_pretrained(folder).eval()
    base = AutoModelForCausalLM.from_pretrained(DEMO_MODEL).eval()
    pairs, old = read_records(task["heldout"]), read_records(task["old"])
    rewards = {
        side: BETA
        * (sequence_logps(tuned, tokenizer, pairs, side) - sequence_logps(base, tokenizer, pairs, side))
        for side in ("chosen", "rejected")
    }
    margins = rewards["chosen"] - rewards["rejected"]
    items = [(r["prompt"], r["completion"]) for r in old]
    mine, theirs = answer_logprobs(tuned, tokenizer, items), answer_logprobs(base, tokenizer, items)
    kl = torch.cat([(lp.exp() * (lp - lb)).sum(-1) for (lp, _), (lb, _) in zip(mine, theirs, strict=True)])
    nll = torch.cat([-lp.gather(1, t[:, None]).squeeze(1) for lp, t in mine])
    return {
        "accuracy": float((margins > 0).float().mean()),
        "margin": float(margins.mean()),
        "kl": float(kl.mean()),
        "sft_loss": float(nll.mean()),
    }


def base_facts(task: dict) -> dict:
    """The base judged as a method (zero reward, zero KL) and the share of held-out pairs whose chosen answer it
    already finds likelier: how far from favouring the preferred answer it starts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    base = AutoModelForCausalLM.from_pretrained(DEMO_MODEL).eval()
    pairs = read_records(task["heldout"])
    chosen, rejected = (sequence_logps(base, tokenizer, pairs, side) for side in ("chosen", "rejected"))
    return {**judge(str(DEMO_MODEL), task), "prefers_chosen": float((chosen > rejected).float().mean())}


# ---- aggregation and the frontiers ---------------------------------------------------------------------------


def spread(values: list[float]) -> float:
    return max(values) - min(values)


def aggregate(methods: list[dict], runs: dict) -> dict:
    """Per method: means over seeds of every judged number, per-seed values and spreads, steps and seconds."""
    rows = {}
    for m in methods:
        seeds = runs.get(m["key"], [])
        if not seeds:
            continue
        row = {**m, "seeds": [s["seed"] for s in seeds], "steps": seeds[0]["steps"], "runs": seeds}
        for k in ("accuracy", "margin", "kl", "sft_loss", "train_seconds", "seconds"):
            values = [s[k] for s in seeds]
            row[k], row[f"{k}_per_seed"], row[f"{k}_spread"] = (
                sum(values) / len(values),
                values,
                spread(values),
            )
        rows[m["key"]] = row
    return rows


def frontier_at(points: list[tuple[float, float]], x: float) -> float | None:
    """The piecewise-linear frontier through (forgetting, quality) points at forgetting `x`; None outside."""
    points = sorted(points)
    if not points or not points[0][0] - 1e-12 <= x <= points[-1][0] + 1e-12:
        return None
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[0][1]


def versus_frontier(x: float, y: float, points: list[tuple[float, float]]) -> dict:
    """Where (forgetting x, quality y) stands against a frontier: its quality at x and the gap (y minus it); on
    or past it (gap >= 0); outside the frontier's range, past it if the point dominates its nearest end (less
    forgetting and at least its quality), behind if dominated by it, undetermined (None) otherwise."""
    at = frontier_at(points, x)
    if at is not None:
        return {"frontier": at, "gap": y - at, "on_or_past": y >= at - 1e-9}
    if not points:
        return {"frontier": None, "gap": None, "on_or_past": None}
    end = min(points) if x < min(points)[0] else max(points)
    if x < end[0] and y >= end[1]:
        verdict = True
    elif x > end[0] and y <= end[1]:
        verdict = False
    else:
        verdict = None
    return {"frontier": None, "gap": None, "on_or_past": verdict, "nearest_end": end}


def frontiers(rows: dict) -> dict:
    """{usaf row: {"kind:quality:forgetting": its verdict}}: each usaf row against full DPO's and LoRA's frontiers,
    accuracy and margin against KL and against the SFT loss, its mean and every seed."""
    peers = {
        kind: sorted((r for r in rows.values() if r["kind"] == kind), key=lambda r: r["lr"])
        for kind in ("full", "lora")
    }
    out = {}
    for key, usaf in rows.items():
        if usaf["kind"] != "usaf":
            continue
        out[key] = {}
        for kind, family in peers.items():
            for quality, forgetting in itertools.product(("accuracy", "margin"), ("kl", "sft_loss")):
                points = [(r[forgetting], r[quality]) for r in family]
                out[key][f"{kind}:{quality}:{forgetting}"] = {
                    "points": points,
                    "lrs": [r["lr"] for r in family],
                    "usaf": (usaf[forgetting], usaf[quality]),
                    **versus_frontier(usaf[forgetting], usaf[quality], points),
                    "per_seed": [
                        versus_frontier(s[forgetting], s[quality], points)["on_or_past"] for s in usaf["runs"]
                    ],
                }
    return out


# ---- reporting -------------------------------------------------------------------------------------------------


def chart(payload: dict, path: Path) -> None:
    rows = payload["methods"]
    fig, axes = subplots(1, 2, (12, 4.5))
    colours = {"usaf": "tab:red", "lora": "tab:blue", "full": "tab:green"}
    for ax, quality in zip(axes[0], ("accuracy", "margin"), strict=True):
        for kind, colour in colours.items():
            mine = sorted((r for r in rows.values() if r["kind"] == kind), key=lambda r: r["kl"])
            if not mine:
                continue
            label = {"usaf": "usaf DPO", "lora": mine[0]["label"], "full": "full DPO"}[kind]
            ax.plot(
                [r["kl"] for r in mine],
                [r[quality] for r in mine],
                "o-",
                color=colour,
                label=f"{label} (mean)",
            )
            for r in mine:
                ax.scatter(r["kl_per_seed"], r[f"{quality}_per_seed"], color=colour, alpha=0.35, s=14)
                if r["lr"] is not None:
                    ax.annotate(
                        f"{r['lr']:g}",
                        (r["kl"], r[quality]),
                        fontsize=7,
                        xytext=(3, 3),
                        textcoords="offset points",
                    )
        ax.set_xlabel("KL(tuned || base) per token, held-out copy/upper (nats)")
        ax.set_ylabel(f"held-out reward {quality}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"Preference quality at {payload['steps']} steps, {len(payload['seeds'])} seeds (small: per seed)"
    )
    save_figure(fig, path)


def verdict(value) -> str:
    return {True: "yes", False: "no", None: "outside the frontier's range"}[value]


def markdown(payload: dict) -> str:
    base = payload["base"]
    lines = [
        f"# Preference quality: usaf DPO vs PEFT LoRA DPO vs full DPO ({payload['date']})",
        "",
        f"Command: `{payload['command']}`; {payload['machine']['cpus']} CPUs, one torch thread a run, "
        f"{payload['jobs']} runs at once, {payload['wall_seconds']:.0f} s in all. Every method: {payload['steps']} steps of {payload['batch']} pairs, "
        f"beta {BETA}, the base the reference, seeds {payload['seeds']} (data order and initialisation; the same "
        f"pairs). Task: {payload['sizes']['train']} near-miss shift pairs contrasting letters a-m; judged on "
        f"{payload['sizes']['heldout']} held-out pairs (unseen words) contrasting letters n-z, and "
        f"{payload['sizes']['old']} held-out copy/upper records. The base finds the chosen answer likelier on "
        f"{base['prefers_chosen']:.0%} of the held-out pairs; its SFT loss on copy/upper {base['sft_loss']:.4f}.",
        "",
        "Judged from each method's saved folder in plain transformers: reward accuracy and mean margin of "
        "r = beta (log pi - log pi_base) over the answer tokens; KL(tuned || base) per token and the SFT loss "
        "(nats/token) along the copy/upper reference answers. Means over seeds; spread = max - min over seeds.",
        "",
        *results_tables(payload),
        "",
        "## usaf against the frontiers",
        "",
        *frontier_table(payload),
        "",
        "Outside a frontier's range the verdict compares with its nearest end: past it when usaf forgets less and "
        "scores at least as well, behind when it forgets more and scores no better.",
        "",
        f"![accuracy and margin against KL]({payload['chart']})",
        "",
        *commands_section(payload),
    ]
    if payload["errors"]:
        lines += [
            "",
            "## Errors",
            "",
            *(f"- {k}: {v.splitlines()[-1]}" for k, v in payload["errors"].items()),
        ]
    return "\n".join(lines) + "\n"


def results_tables(payload: dict) -> list[str]:
    """Means and spreads per method and rate, then every seed's numbers."""
    rows = payload["methods"]
    header = [
        "method",
        "lr",
        "accuracy",
        "margin",
        "KL",
        "SFT loss",
        "spread acc / margin / KL",
        "train s",
        "run s",
    ]
    body = []
    for r in rows.values():
        body.append([
            r["label"], "defaults" if r["lr"] is None else f"{r['lr']:g}", f"{r['accuracy']:.1%}",
            f"{r['margin']:.3f}", f"{r['kl']:.4f}", f"{r['sft_loss']:.4f}",
            f"{r['accuracy_spread']:.1%} / {r['margin_spread']:.3f} / {r['kl_spread']:.4f}",
            f"{r['train_seconds']:.1f}", f"{r['seconds']:.1f}",
        ])  # fmt: skip
    lines = table(header, body, align="llrrrrlrr")
    lines += ["", "Per seed (accuracy, margin, KL, SFT loss):", ""]
    per_seed = [
        [r["label"], fmt(r["lr"], "{:g}"), *(
            f"{s['accuracy']:.0%}, {s['margin']:.3f}, {s['kl']:.4f}, {s['sft_loss']:.4f}" for s in r["runs"]
        )]
        for r in rows.values()
    ]  # fmt: skip
    return lines + table(["method", "lr", *(f"seed {s}" for s in payload["seeds"])], per_seed)


def frontier_table(payload: dict) -> list[str]:
    """Each usaf row's point against each frontier, each quality and forgetting axis: the gap and the verdicts."""
    body = []
    for usaf, verdicts in payload["frontiers"].items():
        for key, f in verdicts.items():
            kind, quality, forgetting = key.split(":")
            body.append([
                usaf, {"full": "full DPO", "lora": "PEFT LoRA DPO"}[kind], quality, forgetting,
                fmt(f["usaf"][1], "{:.4f}"), fmt(f["frontier"], "{:.4f}"), fmt(f["gap"], "{:+.4f}"),
                verdict(f["on_or_past"]), " ".join(verdict(v) for v in f["per_seed"]),
            ])  # fmt: skip
    header = ["usaf row", "frontier", "quality", "against", "usaf", "frontier at usaf's forgetting", "gap"]
    return table([*header, "on or past", "per seed"], body)


def commands_section(payload: dict) -> list[str]:
    """usaf's exact command lines and the baselines' python calls."""
    return [
        "## Commands",
        "",
        "usaf (per seed S; the paths are the run's scratch folder):",
        "",
        *(f"- `{c}`" for c in payload["usaf_commands"]),
        "",
        "PEFT LoRA and full DPO (python, in the benchmark's worker processes: `bench/preference.py:train_trl`): "
        f"`trl.DPOTrainer(model=recipe.stock_baseline(model, kind), args=DPOConfig({payload['trl_args']}), "
        "train_dataset=the pairs, processing_class=the demo tokenizer, optimizers=(torch.optim.AdamW(trainable, "
        "lr=LR, weight_decay=0.0), LambdaLR(usaf_schedule(steps))))`: usaf's default schedule (warm-up "
        f"{WARMUP_STEPS} steps, cosine to {MIN_LR_RATIO:g} of the peak); then `merge_and_unload()` (LoRA: "
        f"r={LORA_RANK}, alpha={LORA_ALPHA}, attention + fused experts) and `save_pretrained`.",
    ]


def run_all(methods: list[dict], args, sizes: dict) -> tuple[dict, dict, dict]:
    """Every method at every seed, `args.jobs` processes at a time, and the base judged: (base, {method key:
    [per-seed results]}, {run: traceback})."""
    context = mp.get_context("forkserver")
    # every run's process forks from a server that imported these once (TRL alone takes seconds to import)
    context.set_forkserver_preload(["torch", "transformers", "peft", "datasets", "trl"])
    runs, errors = {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        task = write_task(Path(scratch) / "task", sizes["train"], sizes["heldout"], sizes["old"] // 2)
        base_call = {"method": {"key": "base", "kind": "base"}, "task": task}
        calls = [
            {"method": m, "task": task, "seed": s, "steps": args.steps, "batch": args.batch, "workdir": scratch}
            for m in methods
            for s in args.seeds
        ]  # fmt: skip
        for call, result, error, took in map_in_forks(
            context, "preference", "run_method", [base_call, *calls], args.jobs
        ):
            if call is base_call:
                if error:
                    raise SystemExit(f"judging the base failed:\n{error}")
                base = result
                continue
            key = f"{call['method']['key']}/seed {call['seed']}"
            if error:
                errors[key] = error
                print(f"  {key}: FAILED\n{error}", flush=True)
                continue
            runs.setdefault(call["method"]["key"], []).append(result)
            print(f"  {key}: acc {result['accuracy']:.0%} margin {result['margin']:.3f} KL {result['kl']:.4f} "
                  f"({took:.0f} s)", flush=True)  # fmt: skip
    return base, runs, errors


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=4, help="pairs per step")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (one torch thread each)")
    parser.add_argument("--out", default=None, help="folder for the result files (default bench/results)")
    parser.add_argument(
        "--usaf-lrs",
        type=float,
        nargs="*",
        default=[],
        help="usaf rows at these optim.lr besides its defaults",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny: 2 steps, one seed, fewer pairs and rates")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.seeds = 2, args.seeds[:1]
    sizes = {"train": TRAIN_PAIRS, "heldout": HELDOUT_PAIRS, "old": 2 * OLD_RECORDS}
    if args.smoke:
        sizes = {"train": 16, "heldout": 8, "old": 8}
    stem = "preference-smoke" if args.smoke else "preference"
    out_dir = Path(args.out) if args.out else RESULTS
    methods = methods_for(args.smoke, args.usaf_lrs)
    began = time.perf_counter()
    base, runs, errors = run_all(methods, args, sizes)
    rows = aggregate(methods, runs)
    date = datetime.date.today().isoformat()  # as write_results names the files
    payload = {
        "date": date,
        "machine": machine(),
        "command": shlex.join(["bench/preference.py", *(argv if argv is not None else sys.argv[1:])]),
        "steps": args.steps,
        "batch": args.batch,
        "seeds": args.seeds,
        "jobs": args.jobs,
        "sizes": sizes,
        "beta": BETA,
        "wall_seconds": time.perf_counter() - began,
        "base": base,
        "methods": rows,
        "frontiers": frontiers(rows),
        "errors": errors,
        "usaf_commands": rows["usaf"]["runs"][0]["commands"] if "usaf" in rows else [],
        "trl_args": (
            f"max_steps={args.steps}, per_device_train_batch_size={args.batch}, learning_rate=LR, beta={BETA}, "
            "seed=S, data_seed=S, router_aux_loss_coef=0.0, gradient_checkpointing=False, use_cpu=True"
        ),
        "chart": f"{stem}-{date}.png",
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    chart(payload, out_dir / payload["chart"])
    text = markdown(payload)
    write_results(stem, payload, text, out_dir)
    print(text)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
