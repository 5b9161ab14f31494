"""Kernel launches and host syncs per decoder layer of a usaf training step (issue 22, "Measure it").

At Qwen3-30B-A3B's layer shape (hidden 2048, experts of width 768, top-8, 32 query / 4 key-value heads of 128; a
small vocabulary, which only the embedding and output layer see), batch 1 x seq 512, one torch thread: a step is
`usaf.causal_lm_loss` + backward + `usaf.CompactAdamW` step on a model made by `usaf.prepare_model` (random
selection at the density, default targets). One step warms up, the second is counted by
`usaf.testing.launches.count_launches` (top-level aten ops from torch.profiler; host reads of tensor data from a
TorchFunctionMode); per layer = the 2-layer model's counts minus the 1-layer model's. "nf4" is the NF4 base with host
residency (`bench/gpu_offload.build_offloaded_model`: quantized experts in host memory behind a `LayerStreamer`).

    .venv/bin/python bench/launches.py                       # the whole grid (E 32/64/128 x 0.5/1/4 % x fp32/bf16
                                                             # x none/nf4): long on a CPU
    .venv/bin/python bench/launches.py --experts 32,128 --densities 1 --dtypes fp32,bf16 --quant none
    .venv/bin/python bench/launches.py --quick               # E=8, tiny shapes: seconds
    python bench/launches.py --device cuda --speed --out DIR # bench/gpu.sh --launches: counts plus tokens/s

--speed adds tokens/s at the layer shape (2 layers, E=128 unless --quick): the usaf step, transformers' inference
forward (grouped_mm, no grad) and a PEFT LoRA step, each timed with CUDA events (wall time on the CPU) after a
warm-up, the median of --steps steps.
"""

from __future__ import annotations

import argparse
import gc
import shlex
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import table  # noqa: E402

TARGET_OPS, TARGET_SYNCS, TARGET_SPREAD = 400, 2, 0.10
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def shape_for(experts: int, layers: int, args) -> dict:
    import gpu_offload

    if args.quick:
        base = {**gpu_offload.TINY, "vocab_size": 256}
    else:
        base = {
            **gpu_offload.QWEN3_30B_A3B,
            "vocab_size": args.vocab,
            "max_position_embeddings": 4096,
            "bos_token_id": None,  # the published ids lie outside a small vocabulary
            "eos_token_id": None,
        }
    return {**base, "num_experts": experts, "num_hidden_layers": layers, "max_window_layers": layers}


def build(shape: dict, device: torch.device, dtype: torch.dtype, quant: str, seed: int = 0):
    """(model, stores or None): random weights, made chunk by chunk in `dtype` (the whole model never exists in
    fp32 when it is bf16)."""
    import gpu_offload
    from transformers import AutoConfig

    if quant != "none":
        model, stores, _, _ = gpu_offload.build_offloaded_model(shape, device, dtype, quant, 0, seed=seed)
        return model, stores
    from usaf.model.hf import build_skeleton

    model = build_skeleton(AutoConfig.for_model("qwen3_moe", **shape), dtype)
    gpu_offload.fill_random(model, dtype, device, torch.Generator(device).manual_seed(seed))
    return model.to(device), None


# the cards whose memory plan sets the NF4 rows' workspace (select.workspace_mb=auto): the first one the row's
# configuration fits on, with this much host RAM (4 % of a 128-expert model does not fit 24 GB at all)
WORKSPACE_CARDS, WORKSPACE_RAM = ("rtx-4090", "h100"), 64 << 30


def planned_workspace(experts: int, dtype_name: str, density_pct: float, args) -> tuple[int, str]:
    """(MB, card): the workspace usaf train's select.workspace_mb=auto takes for this layer shape in a 48-layer
    model, experts NF4 in host memory, on the first of WORKSPACE_CARDS the plan fits (`planner.auto_workspace`,
    as `usaf plan` shows it)."""
    from usaf import planner

    config = {**shape_for(experts, 48, args), "model_type": "qwen3_moe"}
    shape = planner.model_shape(config, f"qwen3-30b-a3b-shaped, {experts} experts")
    settings = planner.PlanSettings(quant="nf4", seq=args.seq, batch=args.batch, dtype=dtype_name)
    settings = settings.replace(density=density_pct / 100, residency="host")
    for name in WORKSPACE_CARDS:
        card = planner.DEVICES[name]
        if planner.plan(shape, settings, card, card.memory, WORKSPACE_RAM).fits:
            break
    chosen, _ = planner.auto_workspace(shape, settings, card, card.memory, WORKSPACE_RAM, residency="host")
    return chosen.workspace_mb, name


def usaf_step(model, stores, density: float, ids, workspace_mb: int | None = None):
    import usaf
    from usaf.config import DEFAULT_WORKSPACE_MB, RunConfig
    from usaf.train.optim import build_optimizer

    config = usaf.UsafConfig(
        density=density, selection="random", workspace_mb=workspace_mb or DEFAULT_WORKSPACE_MB
    )
    usaf.prepare_model(model, config, stores=stores)
    model.train()
    # the optimizer `usaf train` builds: bf16 moments for the trained values, torch's foreach AdamW for the routers
    optimizer = build_optimizer(model, RunConfig())

    def step():
        loss = usaf.causal_lm_loss(model, ids, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def measure(experts: int, density_pct: float, dtype_name: str, quant: str, args) -> dict:
    from usaf.testing.launches import per_layer

    device = torch.device(args.device)
    ids = torch.randint(
        0, shape_for(experts, 1, args)["vocab_size"], (args.batch, args.seq), generator=torch.Generator()
    ).to(device)

    def make(layers: int):
        model, stores = build(shape_for(experts, layers, args), device, DTYPES[dtype_name], quant)
        return usaf_step(model, stores, density_pct / 100, ids, workspace_mb)

    workspace_mb = card = None  # unquantized experts on the device: no workspace
    if quant != "none":
        workspace_mb = args.workspace_mb
        if workspace_mb is None:
            with warnings.catch_warnings():  # "planning from formulas": the shape is known, not loadable
                warnings.simplefilter("ignore")
                workspace_mb, card = planned_workspace(experts, dtype_name, density_pct, args)

    began = time.perf_counter()
    counts = per_layer(make, device=device)
    return {
        "experts": experts,
        "density_pct": density_pct,
        "dtype": dtype_name,
        "quant": quant,
        "seq": args.seq,
        "batch": args.batch,
        "workspace_mb": workspace_mb,
        "workspace_card": card,
        "ops_per_layer": counts.ops,
        "syncs_per_layer": counts.syncs,
        "shape_syncs_per_layer": counts.shape_syncs,
        "cpu_only_syncs_per_layer": counts.cpu_only_syncs,
        "top_ops": dict(counts.names.most_common(8)),
        "sync_sites": dict(counts.sync_sites.most_common(8)),
        "shape_sync_ops": dict(counts.shape_sync_ops.most_common(8)),
        "seconds": time.perf_counter() - began,
    }


# ---- tokens/s against the inference forward and PEFT LoRA ------------------------------------------------------


def _timed(fn, device: torch.device, steps: int) -> float:
    """Median seconds of `fn` after one warm-up: CUDA events on a GPU, wall time elsewhere."""
    fn()
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def speed(args) -> list[dict]:
    import recipe

    device = torch.device(args.device)
    experts = 8 if args.quick else args.speed_experts
    shape = shape_for(experts, 2, args)
    ids = torch.randint(0, shape["vocab_size"], (args.batch, args.seq), generator=torch.Generator()).to(
        device
    )
    tokens = args.batch * args.seq
    rows = []

    def lora_step(model):
        model = recipe.stock_baseline(model, "lora")
        model.train()
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-4, foreach=True)

        def step():
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    def inference(model):
        model = recipe.stock_baseline(model, "inference")

        def forward():
            with torch.no_grad():
                model(input_ids=ids)

        return forward

    methods = {
        "usaf step": lambda model: usaf_step(model, None, args.speed_density / 100, ids),
        "inference forward (grouped_mm, no grad)": inference,
        f"PEFT LoRA r={recipe.LORA_RANK} step (grouped_mm)": lora_step,
    }
    wanted = [m for m in args.speed_methods.split(",") if m]
    for dtype_name in args.speed_dtype.split(","):  # side by side: fp32 and bf16 steps in one run
        for name, wrap in methods.items():
            if wanted and not any(m in name for m in wanted):
                continue
            model, _ = build(shape, device, DTYPES[dtype_name], "none")
            row = {"method": name, "dtype": dtype_name, "experts": experts}
            try:
                seconds = _timed(wrap(model), device, args.steps)
                rows.append({**row, "step_s": seconds, "tokens_per_s": tokens / seconds})
            except Exception as err:
                rows.append({**row, "error": f"{type(err).__name__}: {err}"})
            print(rows[-1], flush=True)
            del model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


# ---- report -----------------------------------------------------------------------------------------------------


def verdicts(rows: list[dict], top: int) -> list[dict]:
    """The issue's targets at E=`top` (ops and syncs per layer-step) and the spread between the smallest E and
    `top`, per (density, dtype, quant) measured."""
    out = []
    keys = sorted({(r["density_pct"], r["dtype"], r["quant"]) for r in rows})
    for density, dtype, quant in keys:
        same = {
            r["experts"]: r
            for r in rows
            if (r["density_pct"], r["dtype"], r["quant"]) == (density, dtype, quant)
        }
        where = f"{density:g} % {dtype} {quant}"
        if top in same:
            r = same[top]
            out.append(
                {
                    "target": f"<= {TARGET_OPS} ops per layer-step at E={top}, {where}",
                    "value": r["ops_per_layer"],
                    "met": r["ops_per_layer"] <= TARGET_OPS,
                }
            )
            out.append(
                {
                    "target": f"<= {TARGET_SYNCS} host syncs per layer-step at E={top}, {where}",
                    "value": r["syncs_per_layer"],
                    "met": r["syncs_per_layer"] <= TARGET_SYNCS,
                }
            )
            low = min(same)
            if low != top:
                spread = same[top]["ops_per_layer"] / max(1, same[low]["ops_per_layer"]) - 1
                out.append(
                    {
                        "target": f"ops within {TARGET_SPREAD:.0%} between E={low} and E={top}, {where}",
                        "value": round(spread, 3),
                        "met": abs(spread) <= TARGET_SPREAD,
                    }
                )
    return out


def markdown(payload: dict) -> str:
    lines = [
        "# Launches and host syncs per layer-step (issue 22)",
        "",
        f"`{payload['command']}`",
        "",
        f"torch {payload['machine']['torch']}, transformers {payload['machine']['transformers']}, device "
        f"{payload['device']}, {payload['machine']['torch_threads']} torch thread(s), batch {payload['batch']} x seq "
        f"{payload['seq']}, vocab {payload['vocab']}; ops: {payload['method']}. Per layer = 2-layer model minus "
        "1-layer model, second step counted. Syncs: host reads of tensor data (tolist, item, bool, int, float, "
        "index, cpu, numpy, to(cpu)), counted on any device because each is a sync on a GPU; shape syncs: ops "
        "with data-dependent output sizes (nonzero, unique, masked_select), which sync on CUDA "
        "as well (reported, not in the target); CPU-only syncs: host reads inside `_grouped_mm`'s CPU loop over "
        "groups, which CUDA's kernel does on the device (issue 22's `_local_scalar_dense` count included them), and "
        "torch AdamW's reads of its step counters, which live on the host on a GPU as well; not in syncs/layer.",
        "",
    ]
    if payload.get("note"):
        lines += [payload["note"], ""]
    rows = []
    for r in payload["rows"]:
        config = [r["experts"], f"{r['density_pct']:g} %", r["dtype"]]
        if "error" in r:
            rows.append([*config, r["quant"], r["seq"], f"error: {r['error']}", *[None] * 5])
            continue
        top = ", ".join(f"{k.removeprefix('aten::')} {v}" for k, v in list(r["top_ops"].items())[:5])
        quant = r["quant"] + (f", workspace {r['workspace_mb']} MB" if r.get("workspace_mb") else "")
        quant += f" ({r['workspace_card']}'s auto)" if r.get("workspace_card") else ""
        counts = [r["ops_per_layer"], r["syncs_per_layer"], r["shape_syncs_per_layer"]]
        counts += [r.get("cpu_only_syncs_per_layer", 0)]
        rows.append([*config, quant, r["seq"], *(f"{c:,}" for c in counts), top, f"{r['seconds']:.0f}"])
    header = ["E", "density", "dtype", "quant", "seq", "ops/layer", "syncs/layer", "shape syncs/layer"]
    lines += table([*header, "CPU-only syncs/layer", "top ops", "s"], rows, align="rrllrrrrrlr")
    verdicts = [
        [
            v["target"],
            f"{v['value']:+.1%}" if "within" in v["target"] else f"{v['value']:,}",
            "met" if v["met"] else "MISSED",
        ]
        for v in payload["verdicts"]
    ]
    if not payload["verdicts"]:
        verdicts.append(["(no E=128 row measured)", None, None])
    lines += ["", "## Targets", "", *table(["target", "value", "verdict"], verdicts, align="lr")]
    sites = [r for r in payload["rows"] if r.get("sync_sites")]
    if sites:
        lines += ["", "## Where the syncs are (per layer, first rows)", ""]
        for r in sites[:4]:
            lines.append(f"- E={r['experts']} {r['density_pct']:g} % {r['dtype']} {r['quant']}:")
            lines += [f"  - `{k}`: {v}" for k, v in r["sync_sites"].items()]
            lines += [f"  - shape sync `{k}`: {v}" for k, v in r.get("shape_sync_ops", {}).items()]
    if payload.get("speed"):
        lines += [
            "",
            "## Tokens/s at the layer shape (2 layers)",
            "",
        ]
        speed = []
        for s in payload["speed"]:
            head = [s["method"], s.get("dtype", ""), s.get("experts", "")]
            if "error" in s:
                speed.append([*head, f"error: {s['error']}", None])
            else:
                speed.append([*head, f"{s['step_s'] * 1e3:.1f}", f"{s['tokens_per_s']:,.0f}"])
        lines += table(["method", "dtype", "E", "step ms", "tokens/s"], speed, align="llrrr")
    return "\n".join(lines) + "\n"


def numbers(text: str, kind=float) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", default="32,64,128")
    parser.add_argument("--densities", default="0.5,1,4", help="percent of the default targets' entries")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--quant", default="none,nf4", help="none and/or nf4 (host residency)")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--workspace-mb",
        type=int,
        default=None,
        help="select.workspace_mb for the NF4 rows (default: what select.workspace_mb=auto takes on the first "
        f"of {', '.join(WORKSPACE_CARDS)} the row fits, with {WORKSPACE_RAM >> 30} GB of RAM): how many routed "
        "experts one chunk holds",
    )
    parser.add_argument("--quick", action="store_true", help="E=8, tiny shapes: a smoke run in seconds")
    parser.add_argument("--speed", action="store_true", help="tokens/s against inference and PEFT LoRA")
    parser.add_argument(
        "--speed-dtype", default="bf16", help="comma-separated: each dtype's steps side by side"
    )
    parser.add_argument("--speed-experts", type=int, default=128)
    parser.add_argument(
        "--speed-methods", default="", help="substrings of the methods to time (default: all)"
    )
    parser.add_argument("--speed-density", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=5, help="--speed: timed steps after one warm-up")
    parser.add_argument("--stem", default="launches", help="result files: <out>/<stem>-<date>.{json,md}")
    parser.add_argument("--out", default=None, help="folder (default bench/results)")
    parser.add_argument("--note", default="", help="a line for the report (e.g. why seq was cut)")
    parser.add_argument(
        "--merge",
        default=None,
        help="a previous run's .json: its rows and speed come first, its command is kept",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import harness

    if args.quick:
        args.experts = "8" if args.experts == parser.get_default("experts") else args.experts
        args.densities = "1" if args.densities == parser.get_default("densities") else args.densities
        args.seq = min(args.seq, 64)
    grid = [
        (e, d, t, q)
        for q in args.quant.split(",")
        for t in args.dtypes.split(",")
        for d in numbers(args.densities)
        for e in numbers(args.experts, int)
    ]
    payload = {
        "command": shlex.join([Path(sys.argv[0]).as_posix(), *(sys.argv[1:] if argv is None else argv)]),
        "machine": harness.machine(),
        "device": args.device,
        "seq": args.seq,
        "batch": args.batch,
        "vocab": shape_for(8, 1, args)["vocab_size"],
        "method": "top-level aten ops from torch.profiler (no aten parent)",
        "note": args.note,
        "rows": [],
        "verdicts": [],
        "speed": [],
    }
    if args.merge:  # one report from runs made one after another (a CPU grid is long)
        import json

        previous = json.loads(Path(args.merge).read_text())
        payload["rows"] = previous["rows"]
        payload["speed"] = previous.get("speed", [])
        payload["command"] = f"{previous['command']}; then {payload['command']}"
        payload["note"] = " ".join(x for x in (previous.get("note", ""), args.note) if x)
    top = 8 if args.quick else 128

    def write():
        payload["verdicts"] = verdicts([r for r in payload["rows"] if "error" not in r], top)
        kw = {"out_dir": Path(args.out)} if args.out else {}
        return harness.write_results(args.stem, payload, markdown(payload), **kw)

    if args.speed:  # first: a grid stopped by a time limit must not lose it
        payload["speed"] = speed(args)
        write()
    for experts, density, dtype_name, quant in grid:
        print(f"E={experts} {density:g} % {dtype_name} {quant} seq {args.seq} ...", flush=True)
        try:
            row = measure(experts, density, dtype_name, quant, args)
        except Exception as err:
            row = {
                "experts": experts,
                "density_pct": density,
                "dtype": dtype_name,
                "quant": quant,
                "seq": args.seq,
                "error": f"{type(err).__name__}: {err}",
            }
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        payload["rows"].append(row)
        print(
            {k: v for k, v in row.items() if k not in ("sync_sites",)},
            flush=True,
        )
        write()  # after every row: a long run that is stopped keeps what it measured
    json_path, md_path = write()
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
