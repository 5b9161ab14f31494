"""A Qwen3-30B-A3B-shaped model trained by usaf under an emulated 12 GB device: the frozen experts, quantized (nf4;
int4 where bitsandbytes has no kernels for the device), live in pinned host memory and are streamed to the device
one MoE layer at a time, the next layer's copy overlapping the current layer's compute (`usaf.store.offload`).

Random weights are generated on the device (no download, no checkpoint on disk): 48 layers, 128 experts top-8,
hidden 2048, expert width 768, vocab 151936 — about 30 B parameters, 29 B of them in experts (16 GB at nf4). The
budget is `torch.cuda.set_per_process_memory_fraction`, set before anything is built. usaf trains 0.5 % of the
expert entries (random selection: magnitude selection would dequantize all 29 B entries first) plus the routers,
with per-layer recomputation and the chunked loss. Figures: tokens/s, peak device memory (the allocator's), the
bytes streamed per step, and the share of the step the copy stream spends on host-to-device transfers (CUDA events
around each layer copy; they overlap compute, so the share says how close the step is to transfer-bound).

    python bench/gpu_offload.py --out DIR             # on a GPU; bench/gpu.sh runs it
    python bench/gpu_offload.py --out DIR --dry-run   # CPU, tiny shapes: every code path but the device
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig

import usaf
from usaf.model.hf import build_skeleton, compute_missing_buffers
from usaf.model.layout import find_moe_layers
from usaf.planner.shape import load_model_config
from usaf.planner.sizes import format_size
from usaf.quant import get_format, resolve_format
from usaf.store.dense import StoredExpertTensor
from usaf.store.offload import LayerStreamer, StreamedParts
from usaf.store.quantized import QuantizedStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

# The shipped planner preset (the published config.json), without its bookkeeping fields.
QWEN3_30B_A3B = {
    k: v
    for k, v in load_model_config("qwen3-30b-a3b")[1].items()
    if k not in ("_source", "model_type", "architectures", "transformers_version", "torch_dtype")
}
TINY = dict(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    moe_intermediate_size=32,
    intermediate_size=128,
    num_experts=8,
    num_experts_per_tok=2,
    vocab_size=512,
    norm_topk_prob=True,
    tie_word_embeddings=False,
    max_position_embeddings=256,
)
GB = 1 << 30


def build_offloaded_model(
    shape: dict, device: torch.device, dtype: torch.dtype, quant: str, cache_mb: int, seed: int = 0
):
    """The model skeleton with random dense weights on `device` and random quantized experts in (pinned) host
    memory behind one `LayerStreamer`; returns (model, stores, streamer, format name)."""
    config = AutoConfig.for_model("qwen3_moe", **shape)
    model = build_skeleton(config, dtype)
    fmt_name = resolve_format(quant, device)
    fmt = get_format(fmt_name)
    streamer = LayerStreamer(device, cache_mb << 20)
    generator = torch.Generator(device).manual_seed(seed)
    stores = {}
    pin = device.type == "cuda"
    for layer in find_moe_layers(model):
        for tensor in layer.tensors:
            if tensor.is_bias:
                continue
            name = f"{layer.experts_name}.{tensor.name}"
            experts, rows, cols = getattr(layer.experts, tensor.name).shape
            host = {
                part: torch.empty((experts, *part_shape), dtype=part_dtype, pin_memory=pin)
                for part, (part_dtype, part_shape) in fmt.layout(rows, cols, dtype).items()
            }
            chunk = max(1, (64 << 20) // (rows * cols))  # ~64 M values generated at a time on the device
            for first in range(0, experts, chunk):
                weights = torch.randn(
                    min(chunk, experts - first), rows, cols, device=device, dtype=dtype, generator=generator
                ).mul_(0.02)
                for offset, weight in enumerate(weights):
                    for part, value in fmt.quantize(weight).items():
                        host[part][first + offset].copy_(value.reshape(host[part].shape[1:]))
                del weights
            store = QuantizedStore(
                fmt_name, StreamedParts(host, streamer, layer.index), (experts, rows, cols), dtype
            )
            del layer.experts._parameters[tensor.name]  # the meta parameter goes; the store stands in for it
            setattr(layer.experts, tensor.name, StoredExpertTensor(store, name))
            stores[name] = store
    fill_random(model, dtype, device, generator)
    model.to(device)
    return model, stores, streamer, fmt_name


def fill_random(model, dtype: torch.dtype, device: torch.device, generator: torch.Generator) -> None:
    """Random frozen weights for a skeleton's parameters still on the meta device (norm weights 1, the rest
    N(0, 0.02)), made in `dtype` on `device`, then the buffers its own initialisation computes."""
    for module_name, module in model.named_modules():
        for param_name, param in list(module._parameters.items()):
            if param is None or param.device.type != "meta":
                continue
            value = torch.empty(param.shape, dtype=dtype, device=device)
            if "norm" in f"{module_name}.{param_name}" and value.dim() == 1:
                value.fill_(1.0)
            else:
                value.normal_(0.0, 0.02, generator=generator)
            module._parameters[param_name] = nn.Parameter(value, requires_grad=False)
            value._is_hf_initialized = True  # transformers' initialisation must leave it alone
    compute_missing_buffers(model)  # rotary frequencies, computed by the model's own initialisation


class TransferClock:
    """Time the streamer spends copying layers to the device: CUDA events on the stream each copy is issued on
    (the side stream, for prefetches), or wall time on a device without streams. Wraps the streamer's layer copy
    (`LayerStreamer._fill`), the one place every streamed byte goes through."""

    def __init__(self, streamer: LayerStreamer):
        self.device = streamer.device
        self.cuda = self.device.type == "cuda"
        self.events: list = []
        self.cpu_seconds = 0.0
        original = streamer._fill

        def timed_fill(layer, copy, non_blocking):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                original(layer, copy, non_blocking)
                end.record()
                self.events.append((start, end))
            else:
                began = time.perf_counter()
                original(layer, copy, non_blocking)
                self.cpu_seconds += time.perf_counter() - began

        streamer._fill = timed_fill

    def reset(self) -> None:
        self.events.clear()
        self.cpu_seconds = 0.0

    def seconds(self) -> float:
        if not self.cuda:
            return self.cpu_seconds
        torch.cuda.synchronize(self.device)
        return sum(start.elapsed_time(end) for start, end in self.events) / 1000.0


def train(model, streamer, device, batch: int, seq: int, steps: int, warmup: int, lr: float) -> dict:
    vocab = model.config.vocab_size
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(1)
    clock = TransferClock(streamer)
    times, transfer, streamed, losses = [], [], [], []
    for step in range(warmup + steps):
        ids = torch.randint(0, vocab, (batch, seq), generator=generator).to(device)
        clock.reset()
        before = streamer.bytes_streamed
        harness.sync()
        began = time.perf_counter()
        loss = usaf.causal_lm_loss(model, ids, ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        harness.sync()
        elapsed = time.perf_counter() - began
        losses.append(float(loss.detach()))
        if step >= warmup:
            times.append(elapsed)
            transfer.append(clock.seconds())
            streamed.append(streamer.bytes_streamed - before)
        print(
            f"step {step}: {elapsed:.2f} s, loss {losses[-1]:.3f}, transfers {clock.seconds():.2f} s, "
            f"{format_size(streamer.bytes_streamed - before)} streamed",
            flush=True,
        )
    step_s = statistics.median(times)
    transfer_s = statistics.median(transfer)
    return {
        "batch": batch,
        "seq": seq,
        "tokens_per_step": batch * seq,
        "step_times_s": times,
        "median_step_s": step_s,
        "tokens_per_s": batch * seq / step_s,
        "transfer_s_per_step": transfer_s,
        "transfer_share": transfer_s / step_s,
        "bytes_streamed_per_step": statistics.median(streamed),
        "transfer_gb_per_s": statistics.median(streamed) / GB / transfer_s if transfer_s else None,
        "losses": losses,
        "trainable": usaf.trainable_summary(model),
    }


def planned(args) -> dict:
    """--plan: what usaf's autos choose for Qwen3-30B-A3B on a card of --budget-gb (this host's RAM), by the
    functions `usaf train` and `usaf plan` call (`memory_plan.auto_settings`), for what this script trains (experts
    and routers, no reselection): the experts' storage, residency and cache, the density, and the planned device
    peak the run is measured against. The script streams from host memory whatever residency the plan takes."""
    from usaf import planner
    from usaf.config import RunConfig
    from usaf.train import memory_plan

    run_config = RunConfig.load(
        None,
        [
            f"data.max_seq_len={args.seq}",
            f"data.batch_size={args.batch}",
            "select.targets=[experts,routers]",
            "select.reselect_every=0",
        ],
    )
    shape = planner.model_shape(load_model_config("qwen3-30b-a3b")[1], "qwen3-30b-a3b")
    budget = int(args.budget_gb * GB)
    gpu = memory_plan.unnamed_gpu(f"a {args.budget_gb:g} GB GPU", budget)
    card = memory_plan.Card(gpu, budget, f"{args.budget_gb:g} GB (--budget-gb)")
    run_plan = memory_plan.RunPlan(shape, planner.PlanSettings(run_config, dtype="bf16"), card)
    chosen, lines = memory_plan.auto_settings(run_plan)
    s = chosen.settings.replace(recompute=True)
    p = planner.plan(shape, s, gpu, budget)
    return {
        "quant": s.quant,
        "residency": s.residency,
        "cache_mb": s.cache_mb,
        "density": s.density,
        "planned_device_peak": p.device_peak,
        "planned_host_peak": p.host_peak,
        "lines": lines,
    }


def run(args) -> dict:
    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    shape = TINY if args.dry_run else QWEN3_30B_A3B
    plan = planned(args) if args.plan else None
    if plan is not None:
        print("\n".join(plan["lines"]), flush=True)
        if not args.dry_run:  # tiny shapes keep the given settings: the plan is Qwen3-30B-A3B's
            args.quant, args.cache_mb, args.density = plan["quant"], plan["cache_mb"], plan["density"]
    result = {
        "plan": plan,
        "machine": harness.machine(),
        "device": str(device),
        "dry_run": args.dry_run,
        "shape": shape,
        "budget_gb": args.budget_gb,
        "cache_mb": args.cache_mb,
        "dtype": str(dtype).replace("torch.", ""),
        "recompute": True,
        "density": args.density,
    }
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        fraction = min(1.0, args.budget_gb * GB / total)
        torch.cuda.set_per_process_memory_fraction(
            fraction, device
        )  # before anything is built: the whole run
        result["budget_fraction"] = fraction
        result["device_name"] = torch.cuda.get_device_name(device)
    else:
        result["budget_note"] = "no device: the budget is not emulated on CPU"
    began = time.perf_counter()
    model, stores, streamer, fmt_name = build_offloaded_model(shape, device, dtype, args.quant, args.cache_mb)
    result["quant_format"] = fmt_name
    result["host_expert_bytes"] = sum(
        t.numel() * t.element_size() for s in stores.values() for t in s.parts.host.values()
    )
    result["parameters"] = sum(p.numel() for p in model.parameters()) + sum(
        math.prod(s.shape) for s in stores.values()
    )
    result["build_s"] = time.perf_counter() - began
    print(
        f"built: {result['parameters'] / 1e9:.3f} B parameters, experts {format_size(result['host_expert_bytes'])} "
        f"in host memory ({fmt_name}), {result['build_s']:.0f} s",
        flush=True,
    )
    began = time.perf_counter()
    usaf.prepare_model(model, usaf.UsafConfig(density=args.density, selection="random"), stores=stores)
    usaf.enable_recomputation(model)
    model.train()
    result["prepare_s"] = time.perf_counter() - began
    print(f"prepared: {usaf.trainable_summary(model)}, {result['prepare_s']:.0f} s", flush=True)
    attempts = []
    batch = args.batch
    while batch >= 1:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        try:
            measured = train(model, streamer, device, batch, args.seq, args.steps, args.warmup, args.lr)
        except torch.OutOfMemoryError as err:  # over the emulated budget: say so, try half the batch
            attempts.append({"batch": batch, "error": str(err).splitlines()[0]})
            print(f"batch {batch}: out of memory under the budget; trying {batch // 2}", flush=True)
            batch //= 2
            continue
        measured["peak_device_bytes"] = (
            torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        )
        result.update(measured)
        break
    result["attempts"] = attempts
    return result


def markdown(r: dict) -> str:
    lines = [
        f"# usaf: Qwen3-30B-A3B-shaped model, experts offloaded, under an emulated {r['budget_gb']} GB device "
        f"({r['machine']['date']})",
        "",
    ]
    lines.append(
        f"Device: {r.get('device_name', r['device'])}{' (DRY RUN: tiny shapes on CPU)' if r['dry_run'] else ''}; "
        f"torch {r['machine']['torch']}, transformers {r['machine']['transformers']}. {r['parameters'] / 1e9:.2f} B "
        f"parameters, experts {r['quant_format']} in {'pinned ' if r['device'] == 'cuda' else ''}host memory "
        f"({format_size(r['host_expert_bytes'])}), streamed per layer with prefetch; cache {r['cache_mb']} MB; "
        f"{r['dtype']}; usaf element {r['density']:.1%} (random) + routers; per-layer recomputation; AdamW."
    )
    lines.append("")
    if "tokens_per_s" not in r:
        lines += [
            "**No batch fit the budget:**",
            "",
            *[f"- batch {a['batch']}: {a['error']}" for a in r["attempts"]],
            "",
        ]
        return "\n".join(lines)
    peak = r["peak_device_bytes"]
    peak_text = format_size(peak) if peak is not None else "n/a (CPU)"
    if r.get("plan"):
        planned_peak = r["plan"]["planned_device_peak"]
        against = f", measured {peak / planned_peak - 1:+.1%} against it" if peak is not None else ""
        lines += [
            "The storage, cache and density are usaf's autos for this budget (`--plan`, the functions usaf train "
            f"calls): {r['plan']['quant']} experts, residency {r['plan']['residency']}, cache {r['plan']['cache_mb']} "
            f"MB, density {r['plan']['density']:.2%}; planned device peak {format_size(planned_peak)}{against}.",
            "",
        ]
    rate = f"{r['transfer_gb_per_s']:.1f} GB/s" if r["transfer_gb_per_s"] else "–"
    lines += [
        *harness.table(
            [
                "tokens/step",
                "median step s",
                "tokens/s",
                "peak device memory",
                "streamed per step",
                "transfer time per step",
                "share of step in transfers",
                "transfer rate",
            ],
            [
                [
                    f"{r['tokens_per_step']} ({r['batch']} x {r['seq']})",
                    f"{r['median_step_s']:.2f}",
                    f"{r['tokens_per_s']:.0f}",
                    peak_text,
                    format_size(r["bytes_streamed_per_step"]),
                    f"{r['transfer_s_per_step']:.2f} s",
                    f"{r['transfer_share']:.0%}",
                    rate,
                ]
            ],
            align="rrrrrrrr",
        ),
        "",
        f"Trainable: {r['trainable']['total'] / 1e6:.1f} M ({r['trainable']['expert_entries'] / 1e6:.1f} M expert "
        f"entries, {r['trainable']['routers'] / 1e6:.1f} M router weights). Build {r['build_s']:.0f} s, prepare "
        f"{r['prepare_s']:.0f} s. Steps timed: {len(r['step_times_s'])}.",
    ]
    for a in r["attempts"]:
        lines.append(f"- batch {a['batch']} did not fit: {a['error']}")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes")
    parser.add_argument("--budget-gb", type=float, default=12.0)
    parser.add_argument("--quant", default="nf4")
    parser.add_argument("--cache-mb", type=int, default=0, help="device memory for the most-routed experts")
    parser.add_argument("--density", type=float, default=0.005)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument(
        "--plan",
        action="store_true",
        help="take the storage, cache and density from usaf's autos for this budget (as usaf train resolves them) "
        "and report the planned device peak beside the measured one",
    )
    args = parser.parse_args(argv)
    args.batch = args.batch or (2 if args.dry_run else 4)
    args.seq = args.seq or (32 if args.dry_run else 1024)
    args.steps = args.steps or (2 if args.dry_run else 4)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA/ROCm device: run with --dry-run for the CPU check", file=sys.stderr)
        return 2
    if args.dry_run:
        torch.set_num_threads(1)  # a shared small CPU: OpenMP barriers stall under load
    torch.manual_seed(0)
    try:
        result = run(args)
    except Exception:
        result = {"error": traceback.format_exc(), "dry_run": args.dry_run}
        print(result["error"], file=sys.stderr)
    text = f"# offload run failed\n\n```\n{result['error']}\n```\n" if "error" in result else markdown(result)
    stem = f"offload{'-dry-run' if args.dry_run else ''}"
    json_path, _ = harness.write_results(stem, result, text, out_dir=args.out)
    if "error" not in result:
        print(text)
    print(f"wrote {json_path}", flush=True)
    return 1 if "error" in result or "tokens_per_s" not in result else 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
