"""Qwen3-30B-A3B's real layer shapes, trained by usaf with its experts in host memory, against the planner.

The model is Qwen3-30B-A3B's published config (hidden 2048, 32 query and 4 key/value heads of 128, 128 experts of
width 768, top-8, vocabulary 151,936) with fewer of its 48 layers: as many as a ten-minute CPU run holds. Weights
are random and deterministic (seeded), made one chunk at a time and quantized straight into the NF4 store
(`gpu_offload.build_offloaded_model`: the whole bf16 model never exists), the experts behind one `LayerStreamer`
(host residency: routed-only backward, `usaf.store.offload`). usaf trains the default density of its default targets
(random selection: magnitude selection would dequantize every expert first) with CompactAdamW, the chunked loss at
train.logits_chunk_tokens and recomputation as train.recompute=auto chooses it from the planner's ledger.

Reported, per layer count (each in its own process, so that peaks do not mix):
- peak host memory (VmHWM, restarted after the imports; MALLOC_MMAP_THRESHOLD_=131072 so freed memory returns to
  the system, as bench/plan_accuracy.py measures) against `usaf plan` for exactly that configuration;
- the step's time split by torch.profiler (one profiled step; the timed steps run without it) into dequantization,
  matmuls, sampled gradients, routing/gathers, streaming, other ops and Python overhead (wall time outside ops);
- bytes streamed host -> device per step (`LayerStreamer.bytes_streamed`), and what whole-layer copies would be;
- a linear fit over the layer counts, extrapolated to 48 layers.
`--correctness` adds a short check against transformers (logits and value gradients, bf16 on the device).

    .venv/bin/python bench/scale.py                       # CPU: writes bench/results/scale-<date>.{json,md}
    .venv/bin/python bench/scale.py --device cuda --budget-gb 12 --correctness --out DIR   # bench/gpu.sh
    .venv/bin/python bench/scale.py --dry-run --out DIR   # tiny shapes (tests/package/test_bench_scripts.py)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import table  # noqa: E402

RETURNING_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "131072"}
TOLERANCE = 0.15
FULL_LAYERS = 48
GB = 1 << 30
MATMULS = {
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::_grouped_mm",
    "aten::grouped_mm",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_flash_attention_forward",
    "aten::_flash_attention_backward",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
}
CATEGORIES = (
    "dequantization",
    "matmuls",
    "sampled gradients",
    "routing/gathers",
    "streaming",
    "other ops",
    "python",
)


# ---- what the step spends its time on --------------------------------------------------------------------------


def _labelled(category: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(f"usaf::{category}"):
            return fn(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def labels():
    """record_function labels around usaf's own pieces, so that the profiler can tell them apart."""
    from usaf.engine import experts, sparse
    from usaf.store import offload
    from usaf.store import quantized as store

    patches = [
        (experts.Projection, "weights", "dequantization"),  # dequantize a chunk, write the trained values in
        (store.QuantizedStore, "read", "dequantization"),
        (offload.LayerStreamer, "fetch", "streaming"),
        (offload.LayerStreamer, "_fill", "streaming"),
        (sparse.ElementEntries, "add_grad", "sampled gradients"),
        (sparse.LineEntries, "add_grad", "sampled gradients"),
        (experts.RoutingPlan, "__init__", "routing/gathers"),
        (experts.TokensToRows, "forward", "routing/gathers"),
        (experts.TokensToRows, "backward", "routing/gathers"),
        (experts.RowsToTokens, "forward", "routing/gathers"),
        (experts.RowsToTokens, "backward", "routing/gathers"),
    ]
    saved = []
    for owner, name, category in patches:
        original = owner.__dict__[name]
        fn = original.__func__ if isinstance(original, staticmethod) else original
        wrapped = _labelled(category, fn)
        setattr(owner, name, staticmethod(wrapped) if isinstance(original, staticmethod) else wrapped)
        saved.append((owner, name, original))
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def split(events, wall_s: float) -> dict:
    """Seconds per category: each op's self time goes to its innermost usaf label, else matmuls or other ops;
    what no op accounts for is Python (transformers' modules, autograd's engine, usaf's bookkeeping)."""
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CPU:
            continue
        category, up = None, event
        while up is not None:
            if up.name.startswith("usaf::"):
                category = up.name[len("usaf::") :]
                break
            up = up.cpu_parent
        if category is None:
            category = "matmuls" if event.name in MATMULS else "other ops"
        seconds[category] += event.self_cpu_time_total / 1e6
    seconds["python"] = max(0.0, wall_s - sum(seconds.values()))
    return seconds


# ---- one configuration, in its own process ---------------------------------------------------------------------


def shape_for(layers: int, dry_run: bool) -> dict:
    import gpu_offload

    base = gpu_offload.TINY if dry_run else gpu_offload.QWEN3_30B_A3B
    return {**base, "num_hidden_layers": layers, "max_window_layers": layers}


def planned(shape: dict, args, fmt_name: str, recompute: bool, gpu: bool) -> dict:
    from usaf import planner

    config = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], **shape}
    model_shape = planner.model_shape(config, f"qwen3-30b-a3b-{shape['num_hidden_layers']}l")
    settings = planner.PlanSettings(
        seq=args.seq,
        batch=args.batch,
        density=args.density,
        quant=fmt_name,
        residency="host",
        recompute=recompute,
        reselect=False,  # the benchmark's steps do not reselect
        dtype="bf16" if gpu else "fp32",
    )
    device = planner.DEVICES["rtx-3060-12gb" if gpu else "cpu"]
    p = planner.plan(
        model_shape, settings, device, vram=int(args.budget_gb * GB) if gpu else None, ram=64 * GB
    )
    return {
        "config": config,
        "peak": p.host_peak if gpu else p.device_peak,
        "device_peak": p.device_peak if gpu else None,
        "imports": p.imports,
        "peak_phase": p.peak_phase,
        "ledger": {line.name: line.device + line.host for line in p.lines},
        "table": planner.format_plan(p),
        "bytes_per_entry": _bytes_per_entry(p),
    }


def _bytes_per_entry(p) -> float:
    from usaf import planner

    entries = planner.trained_entries(p.shape, p.settings.replace(targets=("experts",)))
    line = next(line for line in p.lines if line.name == "sparse state + optimizer")
    return (line.device + line.host) / max(1, entries)


def child(args) -> dict:
    import harness

    import usaf
    from usaf.config import DEFAULT_LOGITS_CHUNK
    from usaf.planner.sizes import format_size

    torch.set_num_threads(args.threads)
    gpu = args.device != "cpu"
    device = torch.device(args.device)
    dtype = torch.bfloat16 if gpu else torch.float32
    result = {"layers": args.layers, "device": str(device), "dtype": str(dtype).replace("torch.", "")}
    if gpu:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.budget_gb * GB / total), device)
        result["device_name"] = torch.cuda.get_device_name(device)
    import gpu_offload

    can_reset = harness.reset_peak_rss()  # after the imports: the planner's imports line stands for them
    result["baseline_host_bytes"] = harness.proc_status_bytes("VmRSS")
    result["peak_source"] = "VmHWM after clear_refs" if can_reset else "ru_maxrss"
    shape = shape_for(args.layers, args.dry_run)
    began = time.perf_counter()
    model, stores, streamer, fmt_name = gpu_offload.build_offloaded_model(
        shape, device, dtype, "nf4", 0, seed=0
    )
    result["quant_format"] = fmt_name
    result["build_s"] = time.perf_counter() - began
    result["host_expert_bytes"] = sum(
        t.numel() * t.element_size() for s in stores.values() for t in s.parts.host.values()
    )
    print(
        f"{args.layers} layers built in {result['build_s']:.0f} s: experts {format_size(result['host_expert_bytes'])}"
    )
    # train.recompute=auto: recomputation exactly when the ledger without it exceeds the budget
    budget = int(args.budget_gb * GB) if gpu else common_ram()
    without = planned(shape, args, fmt_name, recompute=False, gpu=gpu)
    recompute = (without["device_peak"] if gpu else without["peak"]) > budget
    plan = without if not recompute else planned(shape, args, fmt_name, recompute=True, gpu=gpu)
    result["recompute"] = recompute
    began = time.perf_counter()
    usaf.prepare_model(model, usaf.UsafConfig(density=args.density, selection="random"), stores=stores)
    if recompute:
        usaf.enable_recomputation(model)
    model.train()
    result["prepare_s"] = time.perf_counter() - began
    result["trainable"] = usaf.trainable_summary(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = usaf.CompactAdamW(trainable, lr=1e-4)
    generator = torch.Generator().manual_seed(1)
    vocab = shape["vocab_size"]

    def step():
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=generator).to(device)
        loss = usaf.causal_lm_loss(model, ids, ids, chunk_tokens=DEFAULT_LOGITS_CHUNK)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    times, streamed, losses = [], [], []
    for i in range(args.warmup + args.steps):
        before = streamer.bytes_streamed
        harness.sync()
        began = time.perf_counter()
        losses.append(step())
        harness.sync()
        elapsed = time.perf_counter() - began
        if i >= args.warmup:
            times.append(elapsed)
            streamed.append(streamer.bytes_streamed - before)
        print(
            f"step {i}: {elapsed:.2f} s, loss {losses[-1]:.3f}, streamed {format_size(streamer.bytes_streamed - before)}"
        )
    peak = harness.proc_status_bytes("VmHWM") if can_reset else harness.lifetime_peak_rss()
    # the same step with every layer copied whole (what streaming cost before routed-only backward)
    streamer.routed_only = False
    before = streamer.bytes_streamed
    step()
    result["whole_layer_bytes_per_step"] = streamer.bytes_streamed - before
    streamer.routed_only = True
    with labels(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        began = time.perf_counter()
        step()
        profiled_s = time.perf_counter() - began
    shares = split(prof.events(), profiled_s)
    step_s = statistics.median(times)
    result.update(
        {
            "seq": args.seq,
            "batch": args.batch,
            "density": args.density,
            "step_times_s": times,
            "step_seconds": step_s,
            "tokens_per_s": args.batch * args.seq / step_s,
            "losses": losses,
            "bytes_streamed_per_step": statistics.median(streamed),
            "profiled_step_s": profiled_s,
            "split_profiled_s": shares,
            # the profiled step's shares applied to the unprofiled median step
            "split_s": {k: v / profiled_s * step_s for k, v in shares.items()},
            "measured_peak_host_bytes": peak,
            "planned_peak_host_bytes": plan["peak"],
            "planned_peak_phase": plan["peak_phase"],
            "planner_error": plan["peak"] / peak - 1,
            "measured_above_baseline_bytes": peak - result["baseline_host_bytes"],
            "planned_above_imports_bytes": plan["peak"] - plan["imports"],
            "bytes_per_entry": plan["bytes_per_entry"],
            "ledger": plan["ledger"],
            "plan_table": plan["table"],
            "config": plan["config"],
        }
    )
    if gpu:
        result["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
        result["planned_device_peak_bytes"] = plan["device_peak"]
    return result


def common_ram() -> int:
    from usaf.planner.ledger import machine_ram

    return machine_ram()


# ---- correctness against transformers ---------------------------------------------------------------------------


def correctness(device: str) -> dict:
    """usaf against transformers on `device` in bf16: logits with perturbed trained values against the plain model
    patched with the same values, and the trained values' gradients against the dense gradients at their entries."""
    import usaf
    from usaf.testing.tiny import tiny_model

    torch.manual_seed(0)
    reference = tiny_model(
        "qwen3_moe",
        dtype=torch.bfloat16,
        hidden_size=256,
        moe_intermediate_size=128,
        num_experts=16,
        num_experts_per_tok=4,
        num_hidden_layers=2,
        vocab_size=512,
        max_position_embeddings=256,
    ).to(device)
    model = usaf.prepare_model(
        copy.deepcopy(reference),
        usaf.UsafConfig(density=0.05, selection="random", targets=["experts", "routers"]),
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".values"):
                param.add_(torch.randn_like(param) * 0.02)
    patched = copy.deepcopy(reference)
    params = dict(patched.named_parameters())
    with torch.no_grad():
        for name, delta in usaf.get_delta(model).items():
            params[name].view(-1)[delta.flat_indices] = (
                delta.values.detach().reshape(-1).to(params[name].dtype)
            )
    for p in patched.parameters():
        p.requires_grad_(True)
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1)).to(device)
    target = torch.randn(2, 64, 512, generator=torch.Generator().manual_seed(2)).to(device, torch.bfloat16)

    def run(m):
        logits = m(ids).logits
        (logits.float() * target.float()).sum().backward()
        return logits.detach().float()

    ours, theirs = run(model), run(patched)
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))  # noqa: E731
    grads = {
        name: rel(delta.values.grad.reshape(-1), params[name].grad.reshape(-1)[delta.flat_indices])
        for name, delta in usaf.get_delta(model).items()
    }
    result = {
        "device": str(device),
        "dtype": "bfloat16",
        "logits_max_abs_diff": float((ours - theirs).abs().max()),
        "logits_rel_error": rel(ours, theirs),
        "value_grad_rel_error_max": max(grads.values()),
        "tensors": len(grads),
    }
    result["ok"] = result["logits_rel_error"] < 2e-2 and result["value_grad_rel_error_max"] < 5e-2
    return result


# ---- the driver -------------------------------------------------------------------------------------------------


def extrapolate(rows: list[dict]) -> dict | None:
    """Least-squares line over the layer counts (fixed part + per layer), at 48 layers."""
    if len({r["layers"] for r in rows}) < 2:
        return None
    xs = [r["layers"] for r in rows]

    def at48(key):
        ys = [r[key] for r in rows]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
        return {"per_layer": slope, "fixed": my - slope * mx, "at_48": my + slope * (FULL_LAYERS - mx)}

    out = {k: at48(k) for k in ("step_seconds", "measured_peak_host_bytes", "bytes_streamed_per_step")}
    out["split_s"] = {}
    for category in CATEGORIES:
        for r in rows:
            r[f"_split_{category}"] = r["split_s"][category]
        out["split_s"][category] = at48(f"_split_{category}")
        for r in rows:
            del r[f"_split_{category}"]
    return out


def planned_48(args, fmt_name: str, dry_run: bool, gpu: bool) -> dict:
    """The planner at 48 layers (6 in a dry run), with recomputation off (as the rows ran) and on."""
    shape = shape_for(FULL_LAYERS if not dry_run else 6, dry_run)
    out = {"layers": shape["num_hidden_layers"]}
    for recompute in (False, True):
        p = planned(shape, args, fmt_name, recompute=recompute, gpu=gpu)
        key = "recompute" if recompute else "no_recompute"
        out[key] = {"planned_peak_host_bytes": p["peak"], "peak_phase": p["peak_phase"]}
    return out


def markdown(result: dict) -> str:
    from usaf.planner.sizes import format_size

    rows = result["rows"]
    head = rows[-1]
    lines = [
        f"# usaf at Qwen3-30B-A3B's layer shapes, experts in host memory ({result['machine']['date'][:10]})",
        "",
        f"{'DRY RUN (tiny shapes). ' if result['dry_run'] else ''}Device {head.get('device_name', head['device'])}, "
        f"{result['machine']['processor']}, {result['machine']['cpus']} cores, torch {result['machine']['torch']} "
        f"({result['threads']} thread(s)), transformers {result['machine']['transformers']}. Random deterministic "
        f"weights, experts {head['quant_format']} in host memory behind the LayerStreamer, {head['dtype']} compute, "
        f"density {head['density']:g} of the default targets (random selection), CompactAdamW, batch "
        f"{head['batch']} x seq {head['seq']}, recompute {'on' if head['recompute'] else 'off'} "
        "(train.recompute=auto's choice). Command:",
        "",
        f"    {result['command']}",
        "",
    ]
    header = ["layers", "step s", "tokens/s", "measured peak host", "planned peak host", "planner error"]
    header += ["above imports: measured / planned", "streamed per step", "whole-layer copies would be"]
    cells = [
        [
            r["layers"],
            f"{r['step_seconds']:.2f}",
            f"{r['tokens_per_s']:.0f}",
            format_size(r["measured_peak_host_bytes"]),
            format_size(r["planned_peak_host_bytes"]),
            f"{r['planner_error']:+.1%}",
            f"{format_size(r['measured_above_baseline_bytes'])} / {format_size(r['planned_above_imports_bytes'])}",
            format_size(r["bytes_streamed_per_step"]),
            format_size(r["whole_layer_bytes_per_step"]),
            f"{r['bytes_per_entry']:.0f}",
        ]
        for r in rows
    ]
    lines += table([*header, "B per entry"], cells, align="r" * 10)
    lines += [
        "",
        "Time per step by kind (profiled step's shares applied to the median unprofiled step), seconds:",
        "",
    ]
    split = [[r["layers"], *(f"{r['split_s'][c]:.2f}" for c in CATEGORIES)] for r in rows]
    ex = result.get("extrapolated")
    if ex:
        split.append(["**48 (linear fit)**", *(f"{ex['split_s'][c]['at_48']:.1f}" for c in CATEGORIES)])
    lines += table(["layers", *CATEGORIES], split, align="r" * (1 + len(CATEGORIES)))
    if ex:
        lines += [
            "",
            f"Extrapolated to {FULL_LAYERS} layers (a line through the layer counts above): step "
            f"{ex['step_seconds']['at_48']:.1f} s ({ex['step_seconds']['per_layer']:.2f} s per layer + "
            f"{ex['step_seconds']['fixed']:.2f} s fixed), peak host {format_size(ex['measured_peak_host_bytes']['at_48'])} "
            f"measured-extrapolated against {format_size(result['planned_48']['no_recompute']['planned_peak_host_bytes'])}"
            f" planned without recomputation (as the rows ran; "
            f"{format_size(result['planned_48']['recompute']['planned_peak_host_bytes'])} with it), streamed "
            f"{format_size(ex['bytes_streamed_per_step']['at_48'])} per step.",
        ]
    lines += [
        "",
        "Categories: dequantization = building the routed experts' effective weights (NF4 decode + trained values "
        "written in); sampled gradients = the trained entries' gradients (`ElementEntries.add_grad`); routing/"
        "gathers = routing plans and token<->row gathers; streaming = the LayerStreamer's copies; matmuls = "
        "mm/addmm/bmm/grouped_mm/attention kernels outside those; other ops = every other op (norms, softmax, "
        "loss, optimizer, elementwise); python = wall time outside any op. On a device the split counts host "
        "time only (kernels run asynchronously). The planner treats host residency on the CPU as the device "
        "(its ledger says residency device) and has no line for the LayerStreamer's layer copies (up to two "
        "layers of quantized experts), so its other lines over-count by about as much.",
    ]
    check = result.get("correctness")
    if check:
        lines += [
            "",
            f"Correctness against transformers ({check['device']}, bf16): logits relative error "
            f"{check['logits_rel_error']:.2e} (max abs {check['logits_max_abs_diff']:.2e}), value gradients "
            f"relative error at most {check['value_grad_rel_error_max']:.2e} over {check['tensors']} tensors: "
            f"{'ok' if check['ok'] else 'FAILED'}.",
        ]
    lines += ["", f"## Planner ledger, {head['layers']} layers", "", "```", head["plan_table"], "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=None, help="layer counts, one process each")
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=None, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--density", type=float, default=None, help="default: usaf's (select.density)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--budget-gb", type=float, default=12.0, help="emulated device memory (GPU only)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--correctness", action="store_true", help="also check against transformers, bf16")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, CPU")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from usaf.config import DEFAULT_DENSITY

    args.density = args.density or DEFAULT_DENSITY
    args.seq = args.seq or (32 if args.dry_run else 512)
    args.steps = args.steps or 2
    args.layers = args.layers or ([1, 2] if args.dry_run else [1, 3])
    if args.child is not None:
        args.layers = args.child
        try:
            print("RESULT " + json.dumps(child(args), default=str))
        except Exception:
            print("RESULT " + json.dumps({"error": traceback.format_exc()}))
        return 0
    if args.device != "cpu" and not torch.cuda.is_available():
        print("no CUDA/ROCm device: run with --device cpu or --dry-run", file=sys.stderr)
        return 2
    import harness

    torch.set_num_threads(args.threads)
    command = "python bench/scale.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {
        "machine": harness.machine(),
        "dry_run": args.dry_run,
        "threads": args.threads,
        "command": command,
    }
    rows, errors = [], []
    for layers in args.layers:
        forwarded = [a for a in (argv if argv is not None else sys.argv[1:]) if a not in ("--correctness",)]
        forwarded = _without_option(_without_option(forwarded, "--layers"), "--out")
        out = subprocess.run(
            [sys.executable, __file__, *forwarded, "--child", str(layers)],
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": str(args.threads), **RETURNING_ALLOCATOR},
        )
        sys.stderr.write(out.stderr[-2000:])
        found = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        print(
            "\n".join(line for line in out.stdout.splitlines() if not line.startswith("RESULT ")), flush=True
        )
        row = json.loads(found[-1][len("RESULT ") :]) if found else {"error": out.stderr[-3000:]}
        if "error" in row:
            errors.append({"layers": layers, "error": row["error"]})
            print(row["error"], file=sys.stderr)
            continue
        rows.append(row)
        print(
            f"{layers} layers: step {row['step_seconds']:.2f} s, peak host measured "
            f"{row['measured_peak_host_bytes'] / GB:.2f} GB vs planned {row['planned_peak_host_bytes'] / GB:.2f} GB "
            f"({row['planner_error']:+.1%}), streamed {row['bytes_streamed_per_step'] / GB:.3f} GB/step "
            f"(whole layers: {row['whole_layer_bytes_per_step'] / GB:.3f}), split "
            + ", ".join(f"{k} {v:.2f}" for k, v in row["split_s"].items()),
            flush=True,
        )
    result["rows"], result["errors"] = rows, errors
    if args.correctness:
        try:
            result["correctness"] = correctness(args.device)
        except Exception:
            errors.append({"correctness": traceback.format_exc()})
        print(f"correctness: {result.get('correctness')}", flush=True)
    if rows:
        head = rows[-1]
        result.update(
            {
                k: head[k]
                for k in (
                    "layers",
                    "measured_peak_host_bytes",
                    "planned_peak_host_bytes",
                    "bytes_per_entry",
                    "step_seconds",
                    "planner_error",
                    "bytes_streamed_per_step",
                )
            }
        )
        result["within_tolerance"] = all(abs(r["planner_error"]) <= TOLERANCE for r in rows)
        result["extrapolated"] = extrapolate(rows)
        result["planned_48"] = planned_48(args, head["quant_format"], args.dry_run, args.device != "cpu")
    stem = "scale-dry-run" if args.dry_run else ("scale" if args.device == "cpu" else "scale-device")
    text = (
        markdown(result) if rows else "# scale run failed\n\n```\n" + json.dumps(errors, indent=1) + "\n```\n"
    )
    json_path, _ = harness.write_results(stem, result, text, out_dir=args.out)
    print(f"wrote {json_path}", flush=True)
    ok = bool(rows) and not errors and result.get("correctness", {"ok": True})["ok"]
    return 0 if ok else 1


def _without_option(args: list[str], name: str) -> list[str]:
    """`args` without `name` and the values that follow it (up to the next option)."""
    out, skipping = [], False
    for a in args:
        if a == name:
            skipping = True
            continue
        if skipping and not a.startswith("--"):
            continue
        skipping = False
        out.append(a)
    return out


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
