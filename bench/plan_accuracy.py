"""The planner's predicted peak against the peak measured on this CPU, for a few small MoE configurations.

Each case trains in its own subprocess: a tiny-family model at larger dimensions, fp32, prepared by usaf (or saved,
prepared as an NF4 store in another subprocess, and loaded with `usaf.base.load.load_prepared`), with per-layer
recomputation, the chunked loss, backward and AdamW over the trainable parameters, for three steps (the optimizer
state exists from the second on).
Peak memory is the process's peak RSS above the baseline taken once everything is imported (VmHWM, reset through
/proc/self/clear_refs; ru_maxrss where that is not possible). The planner predicts the same peak from the model's
config alone, on the "cpu" device, less its line for the imported libraries.

glibc's malloc raises its mmap threshold as large blocks are freed, after which freed tensors stay mapped in the
heap: resident memory then depends on the order of frees, not on what is alive. The measurement the tolerance
applies to therefore runs with MALLOC_MMAP_THRESHOLD_=131072 (freed blocks go back to the system); each case also
runs with glibc's defaults, reported beside it.

    .venv/bin/python bench/plan_accuracy.py            # writes bench/results/plan_accuracy-<date>.{md,json}
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

TOLERANCE = 0.15
STEPS = 3
RETURNING_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "131072"}


QWEN = dict(
    hidden_size=512,
    moe_intermediate_size=512,
    num_experts=16,
    num_experts_per_tok=4,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=8192,
    max_position_embeddings=2048,
)
# Dimensions chosen so that experts, activations, logits and sparse state each take a visible share.
CASES = [
    {
        "name": "qwen3_moe h512 E16 k4",
        "family": "qwen3_moe",
        "model": QWEN,
        "seq": 1024,
        "batch": 2,
        "density": 0.02,
        "granularity": "element",
        "quant": "none",
    },
    {
        "name": "olmoe h384 E16 k8",
        "family": "olmoe",
        "model": dict(
            hidden_size=384,
            intermediate_size=768,
            num_experts=16,
            num_experts_per_tok=8,
            num_hidden_layers=6,
            num_attention_heads=6,
            num_key_value_heads=6,
            head_dim=None,
            vocab_size=16384,
            max_position_embeddings=2048,
        ),
        "seq": 512,
        "batch": 4,
        "density": 0.005,
        "granularity": "element",
        "quant": "none",
    },
    {
        "name": "mixtral h768 E8 k2",
        "family": "mixtral",
        "model": dict(
            hidden_size=768,
            intermediate_size=1024,
            num_experts=8,
            num_experts_per_tok=2,
            num_hidden_layers=3,
            num_attention_heads=12,
            num_key_value_heads=4,
            head_dim=64,
            vocab_size=16000,
            max_position_embeddings=4096,
        ),
        "seq": 2048,
        "batch": 1,
        "density": 0.05,
        "granularity": "element",
        "quant": "none",
    },
    {
        "name": "qwen3_moe h512 E16 k4, nf4 store",
        "family": "qwen3_moe",
        "model": QWEN,
        "seq": 1024,
        "batch": 2,
        "density": 0.02,
        "granularity": "element",
        "quant": "nf4",
    },
]


def prepare(case: dict, workdir: str) -> str:
    """Save the case's model as a checkpoint and prepare a store in the case's format (its own process, so that
    neither the saving nor the quantization warms up or fills the measured one); returns the store's path."""
    from usaf.base.writer import prepare_store
    from usaf.testing.tiny import tiny_model

    source = Path(workdir) / "source"
    tiny_model(case["family"], **case["model"]).save_pretrained(source)
    return str(prepare_store(source, Path(workdir) / "store", case["quant"], device="cpu"))


def child(case: dict, store: str | None) -> dict:
    """Train one case and report the peak RSS above the post-import baseline (runs in its own process)."""
    import torch
    from harness import lifetime_peak_rss, proc_status_bytes, reset_peak_rss

    import usaf
    from usaf.base.load import load_prepared
    from usaf.engine.loss import causal_lm_loss
    from usaf.prepare import enable_recomputation
    from usaf.testing.tiny import tiny_model

    torch.set_num_threads(2)
    torch.manual_seed(0)
    ids = torch.randint(0, case["model"]["vocab_size"], (case["batch"], case["seq"]))
    config = usaf.UsafConfig(density=case["density"], granularity=case["granularity"])
    can_reset = reset_peak_rss()
    baseline = proc_status_bytes("VmRSS") if can_reset else lifetime_peak_rss()

    if store is None:
        model = usaf.prepare_model(tiny_model(case["family"], **case["model"]), config)
    else:
        model = load_prepared(store, None, config, device="cpu", dtype=torch.float32, residency="device")
    model = enable_recomputation(model)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    losses = []
    for _ in range(STEPS):
        loss = causal_lm_loss(model, ids, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    peak = proc_status_bytes("VmHWM") if can_reset else lifetime_peak_rss()
    return {
        "peak_bytes": peak - baseline,
        "baseline_bytes": baseline,
        "peak_source": "VmHWM after clear_refs" if can_reset else "ru_maxrss",
        "losses": losses,
        "trainable": usaf.trainable_summary(model),
    }


def predict(case: dict) -> dict:
    from usaf import planner
    from usaf.testing.tiny import tiny_config

    config = tiny_config(case["family"], **case["model"]).to_dict()
    shape = planner.model_shape(config, case["name"])
    settings = planner.PlanSettings(
        seq=case["seq"],
        batch=case["batch"],
        density=case["density"],
        quant=case["quant"],
        granularity=case["granularity"],
        residency="device",
        dtype="fp32",
    )
    p = planner.plan(shape, settings, planner.DEVICES["cpu"], ram=64 << 30)
    return {
        "predicted_bytes": p.device_peak - p.imports,
        "peak_phase": p.peak_phase,
        "ledger": {line.name: line.device for line in p.lines},
        "parameters": shape.total_params,
        "table": planner.format_plan(p),
    }


def _run(args: list[str], env: dict) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, *args],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "2", "TRANSFORMERS_VERBOSITY": "error", **env},
    )
    if out.returncode != 0:
        raise RuntimeError(f"{args[:2]} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_case(case: dict, env: dict, store: str | None) -> dict:
    return _run(["--child", json.dumps(case), *(["--store", store] if store else [])], env)


def _mb(n: float) -> str:
    return f"{n / 2**20:.0f} MB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--prepare", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child), args.store)))
        return 0
    if args.prepare:
        print(json.dumps(prepare(json.loads(args.prepare), args.store)))
        return 0
    from harness import machine, table, write_results

    rows = []
    workdir = tempfile.TemporaryDirectory()
    for i, case in enumerate(CASES):
        store = None
        if case["quant"] != "none":
            store = _run(["--prepare", json.dumps(case), "--store", f"{workdir.name}/{i}"], {})
        measured = run_case(case, RETURNING_ALLOCATOR, store)
        default = run_case(case, {}, store)
        predicted = predict(case)
        error = predicted["predicted_bytes"] / measured["peak_bytes"] - 1
        rows.append(
            {
                "case": case,
                "measured": measured,
                "glibc_default": default,
                "predicted": predicted,
                "error": error,
            }
        )
        print(
            f"{case['name']}: measured {_mb(measured['peak_bytes'])} (glibc defaults "
            f"{_mb(default['peak_bytes'])}), predicted {_mb(predicted['predicted_bytes'])} ({error:+.1%})",
            flush=True,
        )

    facts = machine()
    header = [
        "case",
        "params",
        "seq x batch",
        "density",
        "experts",
        "measured peak",
        "predicted peak",
        "error",
    ]
    header += ["planner's peak phase", "measured, glibc defaults"]
    cases = [
        [
            r["case"]["name"],
            f"{r['predicted']['parameters'] / 1e6:.0f} M",
            f"{r['case']['seq']} x {r['case']['batch']}",
            f"{r['case']['density']:g}",
            r["case"]["quant"],
            _mb(r["measured"]["peak_bytes"]),
            _mb(r["predicted"]["predicted_bytes"]),
            f"{r['error']:+.1%}",
            r["predicted"]["peak_phase"],
            _mb(r["glibc_default"]["peak_bytes"]),
        ]
        for r in rows
    ]
    within = all(abs(r["error"]) <= TOLERANCE for r in rows)
    lines = [
        f"# Planner vs measured peak memory ({facts['date']})",
        "",
        f"CPU: {facts['processor']}, {facts['cpus']} cores, torch 2 threads; fp32 compute, per-layer recomputation, "
        f"chunked loss (1024 tokens), AdamW, {STEPS} steps. Measured: peak RSS above the baseline after imports, "
        "with MALLOC_MMAP_THRESHOLD_=131072 (freed memory returns to the system). Predicted: the planner's peak "
        "from the config alone, less its imports line.",
        "",
        *table(header, cases, align="lrrrlrrrlr"),
        "",
        f"All within {TOLERANCE:.0%}: {'yes' if within else 'NO'}.",
        "",
    ]
    for r in rows:
        lines += [f"## {r['case']['name']}", "", "```", r["predicted"]["table"], "```", ""]
    write_results(
        "plan_accuracy", {"machine": facts, "cases": rows}, "\n".join(lines), out_dir=Path(args.out)
    )
    print("\n".join([*table, "", f"All within {TOLERANCE:.0%}: {'yes' if within else 'NO'}."]))
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
