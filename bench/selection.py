"""Which entries to train: random vs uniform-gradient vs routing-guided selection, each with and without dynamic
reselection and with and without router training, on the demo model and task at one equal budget.

    .venv/bin/python bench/selection.py                 # 12 settings x 3 seeds, ~5 min on 2 CPU cores
    .venv/bin/python bench/selection.py --steps 20 --out /tmp/sel   # a quick look

Every run: the demo's settings (usaf/demo.py) but for the selection and the budget, the same seed, data order and
number of steps. Figures: eval loss on the held-out records (usaf's own evaluation, same tokens for all), and the
shift task's exact-match accuracy of the exported model (greedy decoding, as `usaf demo` measures it).
Results: bench/results/selection-<date>.{md,json}.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from harness import RESULTS, machine, table, write_results

STRATEGIES = {  # label -> (strategy, selection inside the budget)
    "random": ("uniform", "random"),
    "uniform-gradient": ("uniform", "gradient"),
    "routing-guided": ("routing", "gradient"),
}


def run_one(name: str, reselect: bool, router: bool, seed: int, args, scratch: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from usaf.config import RunConfig
    from usaf.demo.run import DEMO_SETTINGS, assets
    from usaf.demo.task import read_jsonl, task_accuracy
    from usaf.export.merged import export_merged
    from usaf.train.loop import train

    strategy, selection = STRATEGIES[name]
    model_dir, data_dir = assets() / "model", assets() / "data"
    overrides = [
        f"model.path={model_dir}",
        f"data.train={data_dir / 'train.jsonl'}",
        f"data.eval={data_dir / 'eval.jsonl'}",
        *DEMO_SETTINGS,
        f"select.density={args.density}",
        f"select.strategy={strategy}",
        f"select.selection={selection}",
        f"select.reselect_every={args.reselect_every if reselect else 0}",
        f"select.routing_coverage={args.routing_coverage}",
        f"select.seed={seed}",
        f"train.seed={seed}",
        f"select.train_router={str(router).lower()}",
        f"router.lr_multiplier={args.router_lr_multiplier}",
        f"schedule.max_steps={args.steps}",
        f"checkpoint.every_steps={args.steps}",
        "log.progress=false",
    ]
    run_dir = scratch / f"{name}-{int(reselect)}-{int(router)}-{seed}"
    started = time.perf_counter()
    summary = train(RunConfig.load(None, overrides), run_dir / "run")
    merged = export_merged(run_dir / "run", run_dir / "model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    accuracy = task_accuracy(
        AutoModelForCausalLM.from_pretrained(merged), tokenizer, read_jsonl(data_dir / "eval.jsonl")
    )
    return {
        "selection": name,
        "reselection": reselect,
        "router": router,
        "seed": seed,
        "eval_loss_before": summary["eval_loss_before"],
        "eval_loss_after": summary["eval_loss_after"],
        "accuracy": accuracy,
        "trained_expert_entries": summary["trained_expert_entries"],
        "trained_router_weights": summary["trained_router_weights"],
        "seconds": round(time.perf_counter() - started, 1),
    }


def aggregate(runs: list[dict]) -> list[dict]:
    """One row per setting: means over seeds, with each seed's accuracy."""
    rows: dict[tuple, dict] = {}
    for run in runs:
        key = (run["selection"], run["reselection"], run["router"])
        rows.setdefault(key, {"selection": key[0], "reselection": key[1], "router": key[2], "runs": []})
        rows[key]["runs"].append(run)
    for row in rows.values():
        runs_ = row.pop("runs")
        row.update(
            {
                k: sum(r[k] for r in runs_) / len(runs_)
                for k in ("eval_loss_before", "eval_loss_after", "accuracy", "seconds")
            },
            accuracies=[r["accuracy"] for r in runs_],
            trained_expert_entries=runs_[0]["trained_expert_entries"],
            trained_router_weights=runs_[0]["trained_router_weights"],
        )
    return list(rows.values())


def markdown(rows: list[dict], args, facts: dict) -> str:
    lines = [
        f"# Selection strategies on the demo task ({facts['date']})",
        "",
        f"Demo model and shift task, {args.steps} steps of the demo's settings, expert density {args.density} "
        f"(element granularity) for every row; reselection every {args.reselect_every} steps when on; "
        f"routing-guided gives budget to the experts covering {args.routing_coverage:.0%} of the routed mass; "
        f"router learning rate {args.router_lr_multiplier}x the values' when trained. "
        f"Means over seeds {args.seeds} (selection, data order). "
        "Eval loss: held-out records, before → after. Accuracy: exact match of the exported model's greedy answers "
        "on the held-out words (before training: 0 %).",
        "",
    ]
    header = ["selection", "reselection", "router trained", "eval loss before → after", "accuracy (mean)"]
    header += ["per seed", "expert entries", "router weights", "seconds"]
    cells = [
        [
            r["selection"],
            "yes" if r["reselection"] else "no",
            "yes" if r["router"] else "no",
            f"{r['eval_loss_before']:.4f} → {r['eval_loss_after']:.4f}",
            f"{r['accuracy']:.1%}",
            " / ".join(f"{a:.0%}" for a in r["accuracies"]),
            f"{r['trained_expert_entries']:,}",
            f"{r['trained_router_weights']:,}",
            f"{r['seconds']:.0f}",
        ]
        for r in rows
    ]
    lines += table(header, cells)
    lines += ["", f"Machine: {json.dumps(facts)}", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--reselect-every", type=int, default=25)
    parser.add_argument("--routing-coverage", type=float, default=0.5)
    parser.add_argument("--router-lr-multiplier", type=float, default=1.0)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1 is fastest on a busy 2-core CPU)"
    )
    parser.add_argument("--out", help="write the table here instead of bench/results/")
    parser.add_argument("--name", default="selection", help="file stem of the results")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    facts = machine()
    runs = []
    with tempfile.TemporaryDirectory(prefix="usaf-selection-") as scratch:
        for name, reselect, router, seed in itertools.product(
            args.strategies, (False, True), (False, True), args.seeds
        ):
            runs.append(run_one(name, reselect, router, seed, args, Path(scratch)))
            r = runs[-1]
            print(
                f"{name:>16}  reselect={reselect!s:<5}  router={router!s:<5}  seed={seed}  eval loss "
                f"{r['eval_loss_before']:.4f} -> {r['eval_loss_after']:.4f}  accuracy {r['accuracy']:.1%}  "
                f"({r['seconds']:.0f} s)",
                flush=True,
            )
    rows = aggregate(runs)
    payload = {"machine": facts, "settings": vars(args), "rows": rows, "runs": runs}
    text = markdown(rows, args, facts)
    for path in write_results(args.name, payload, text, out_dir=Path(args.out) if args.out else RESULTS):
        print(f"wrote {path}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
