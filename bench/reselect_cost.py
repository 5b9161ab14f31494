"""What a dynamic reselection costs, in training steps (issue 5's target: no more than three).

A random Qwen3-MoE-shaped model trains with `select.reselect_every`; each step is timed, and so is the surgery
after it. A reselection costs its surgery (drop, grow, optimizer-state moves) plus what the steps before it pay to
gather candidate gradients (element granularity probes candidate neurons' lines for `reselect_probe_steps` steps;
neuron granularity needs only the importance per neuron, gathered every step). The cost is
surgery + sum over the probing steps of (their time - a plain step's), in units of a plain step (the median of
the steps that neither probe nor follow a reselection).

    .venv/bin/python bench/reselect_cost.py      # writes bench/results/reselect_cost-<date>.{json,md}
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, sync, table, write_results

import usaf
from usaf.engine.loss import causal_lm_loss
from usaf.selection.reselect import Reselector
from usaf.testing.tiny import tiny_model

SHAPE = dict(
    hidden_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    moe_intermediate_size=512,
    num_experts=32,
    num_experts_per_tok=4,
    vocab_size=8192,
)
TARGET = 3.0


def measure(granularity: str, density: float, args) -> dict:
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe", **SHAPE)
    config = usaf.UsafConfig(
        density=density,
        granularity=granularity,
        reselect_every=args.every,
        reselect_fraction=0.3,
        reselect_until=1.0,
        reselect_probe_steps=args.probe_steps,
    )
    usaf.prepare_model(model, config)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    reselector = Reselector(model, config, total_steps=args.steps)
    ids = torch.randint(
        0, SHAPE["vocab_size"], (args.batch, args.seq), generator=torch.Generator().manual_seed(1)
    )
    step_times, probing, surgeries = {}, set(), []
    for step in range(1, args.steps + 1):
        reselector.before_step(step)
        if any(state.probes for state in reselector.states.values()):
            probing.add(step)
        sync()
        start = time.perf_counter()
        reselector.set_observing(True)
        loss = causal_lm_loss(model, ids, ids)
        reselector.set_observing(False)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        step_times[step] = time.perf_counter() - start
        start = time.perf_counter()
        done = reselector.after_step(step, optimizer)
        sync()
        if done is not None:
            surgeries.append({"step": step, "seconds": time.perf_counter() - start, **done})
    reselected = {s["step"] for s in surgeries}
    plain = [t for s, t in step_times.items() if s > 2 and s not in probing and s - 1 not in reselected]
    plain_s = statistics.median(plain)
    probe_extra = [step_times[s] - plain_s for s in sorted(probing) if s > 2]
    per_reselection_probe = sum(probe_extra) / max(len(surgeries), 1)
    surgery_s = statistics.median(s["seconds"] for s in surgeries)
    cost = (surgery_s + max(per_reselection_probe, 0.0)) / plain_s
    return {
        "granularity": granularity,
        "density": density,
        "trained_entries": sum(p.numel() for n, p in model.named_parameters() if n.endswith("values")),
        "plain_step_s": plain_s,
        "probing_steps_per_reselection": len(probing) / max(len(surgeries), 1),
        "probe_extra_s_per_reselection": per_reselection_probe,
        "surgery_s": surgery_s,
        "reselections": surgeries,
        "cost_in_steps": cost,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=6)
    parser.add_argument("--probe-steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [measure("element", 0.005, args), measure("neuron", 0.05, args)]
    facts = machine()
    lines = [
        f"# Cost of a dynamic reselection ({facts['date']})",
        "",
        f"Random Qwen3-MoE ({SHAPE['num_hidden_layers']} layers, hidden {SHAPE['hidden_size']}, "
        f"{SHAPE['num_experts']} experts of width {SHAPE['moe_intermediate_size']}, top-"
        f"{SHAPE['num_experts_per_tok']}), batch {args.batch} x {args.seq} tokens, fp32 on "
        f"{facts['processor']} ({facts['torch_threads']} threads); {args.steps} steps, a reselection every "
        f"{args.every} (30 % of the entries), probes over {args.probe_steps} steps for element granularity.",
        "",
        *table(
            [
                "granularity",
                "trained entries",
                "plain step s",
                "surgery s",
                "probing extra s per reselection",
                "cost in steps (target <= 3)",
            ],
            [
                [
                    f"{r['granularity']} {r['density']:.1%}",
                    f"{r['trained_entries']:,}",
                    f"{r['plain_step_s']:.3f}",
                    f"{r['surgery_s']:.3f}",
                    f"{r['probe_extra_s_per_reselection']:.3f}",
                    f"{r['cost_in_steps']:.2f}",
                ]
                for r in rows
            ],
        ),
        "",
    ]
    markdown = "\n".join(lines)
    paths = write_results("reselect_cost", {"machine": facts, "settings": vars(args), "rows": rows}, markdown)
    print(markdown)
    print("wrote", *paths)


if __name__ == "__main__":
    main()
