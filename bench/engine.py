"""One Qwen3-MoE-shaped layer: usaf's sparse training step against transformers' dense grouped_mm step and
against forward-only, timed side by side. `make bench` runs it; results go to bench/results/engine-<date>.*.

Targets (issue 2): usaf step <= 1.0x the dense training step, and <= 2.3x forward-only.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from transformers import AutoConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

import usaf


def build_block(experts: int, hidden: int, intermediate: int, top_k: int, seed: int = 0):
    config = AutoConfig.for_model(
        "qwen3_moe",
        hidden_size=hidden,
        moe_intermediate_size=intermediate,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
    )
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(seed)
    block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    return block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    dense = build_block(args.experts, args.hidden, args.intermediate, args.top_k)
    frozen = copy.deepcopy(dense).requires_grad_(False)
    element = usaf.prepare_model(
        copy.deepcopy(dense), usaf.UsafConfig(density=0.005, granularity="element", targets=["experts"])
    )
    neuron = usaf.prepare_model(
        copy.deepcopy(dense), usaf.UsafConfig(density=0.05, granularity="neuron", targets=["experts"])
    )
    x = torch.randn(1, args.tokens, args.hidden)
    grad_out = torch.randn(1, args.tokens, args.hidden)

    def train_step(block):
        def step():
            inp = x.clone().requires_grad_(True)
            out = block(inp)
            out = out[0] if isinstance(out, tuple) else out
            out.backward(grad_out)
            for p in block.parameters():
                p.grad = None

        return step

    def forward_only():
        with torch.no_grad():
            frozen(x)

    results = harness.interleaved_medians(
        {
            "forward_only (grouped_mm, no grad)": forward_only,
            "dense train step (grouped_mm, all experts trainable)": train_step(dense),
            "usaf train step, element 0.5%": train_step(element),
            "usaf train step, neuron 5%": train_step(neuron),
        },
        repeats=args.repeats,
    )
    fwd = results["forward_only (grouped_mm, no grad)"]["median_s"]
    dense_t = results["dense train step (grouped_mm, all experts trainable)"]["median_s"]
    rows = []
    for name, r in results.items():
        r["vs_forward"] = r["median_s"] / fwd
        r["vs_dense_train"] = r["median_s"] / dense_t
        rows.append(
            [
                name,
                f"{r['median_s'] * 1000:.0f}",
                f"{r['min_s'] * 1000:.0f}–{r['max_s'] * 1000:.0f}",
                f"{r['vs_forward']:.2f}x",
                f"{r['vs_dense_train']:.2f}x",
            ]
        )
    shape = vars(args)
    machine = harness.machine()
    md = "\n".join(
        [
            f"# Engine benchmark ({machine['date']})",
            "",
            f"Layer: Qwen3-MoE block, E={args.experts}, H={args.hidden}, I={args.intermediate}, top-{args.top_k}, "
            f"{args.tokens} tokens, fp32, {machine['torch_threads']} threads on {machine['processor']} "
            f"(torch {machine['torch']}, transformers {machine['transformers']}). Median of {args.repeats} "
            "interleaved runs.",
            "",
            *harness.table(["method", "median ms", "range ms", "÷ forward-only", "÷ dense train step"], rows),
            "",
            "Targets: usaf step <= 1.0x dense train step and <= 2.3x forward-only.",
            "",
        ]
    )
    json_path, md_path = harness.write_results(
        "engine", {"machine": machine, "shape": shape, "results": results}, md
    )
    print(md)
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
