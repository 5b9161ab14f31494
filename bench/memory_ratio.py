"""Peak training memory ÷ peak inference memory, same model, quantization and sequence length.

A small MoE (tiny Qwen3-MoE at larger dimensions, saved as a bf16 checkpoint) is prepared at nf4, then loaded in two
fresh subprocesses from the same store, on the CPU:
- inference: a no-grad prefill of the sequence (last token's logits only, as generation does);
- training: per-layer recomputation, the chunked causal-LM loss, backward, and AdamW over the trainable parameters
  (two steps, so the optimizer state exists at the peak).
Peak memory is each process's peak RSS (VmHWM). The ratio is reported gross (whole process) and net: above the
baseline taken after every library and the model's code are imported and initialised by a tiny warm-up step (VmHWM
reset through /proc/self/clear_refs).

    .venv/bin/python bench/memory_ratio.py            # writes bench/results/memory_ratio-<date>.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET = 1.3
MODEL = dict(
    hidden_size=512,
    moe_intermediate_size=512,
    num_experts=16,  # usaf.testing.tiny sets the families' other names for it
    num_experts_per_tok=4,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=8192,
    max_position_embeddings=4096,
)


def child(args) -> None:
    """One measured run; prints a JSON line."""
    import torch
    from transformers import AutoConfig

    import usaf
    from usaf.base.load import load_prepared
    from usaf.engine.loss import causal_lm_loss
    from usaf.model.hf import build_skeleton

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from harness import TensorPeak, proc_status_bytes, reset_peak_rss

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    build_skeleton(AutoConfig.from_pretrained(args.store))  # imports the model's code before the baseline
    _warm_up(dtype)
    baseline = proc_status_bytes("VmRSS")
    reset_peak_rss()  # the peak (VmHWM) restarts here
    model = load_prepared(args.store, args.source, usaf.UsafConfig(), device="cpu", dtype=dtype)
    loaded = proc_status_bytes("VmRSS")
    ids = torch.randint(0, MODEL["vocab_size"], (1, args.seq), generator=torch.Generator().manual_seed(0))
    if args.child == "inference":

        def run():
            with torch.no_grad():
                model(input_ids=ids, logits_to_keep=1)

    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

        def run():
            causal_lm_loss(model, ids, ids, chunk_tokens=256).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    start = time.perf_counter()
    for _ in range(2):  # training: the second step has the optimizer state
        run()
    seconds = (time.perf_counter() - start) / 2
    peak = proc_status_bytes("VmHWM")
    with TensorPeak() as tensors:  # one more, counting live tensors (as a GPU allocator's peak does)
        run()
    top = sorted(tensors.at_peak.items(), key=lambda kv: -kv[1])[:8]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(
        json.dumps(
            {
                "baseline": baseline,
                "loaded": loaded,
                "peak": peak,
                "seconds": seconds,
                "trainable": trainable,
                "tensor_resident": tensors.resident_bytes,
                "tensor_peak": tensors.peak,
                "tensor_top_at_peak": top,
            }
        )
    )


def _warm_up(dtype) -> None:
    """One training step and one prefill of a tiny model, in both runs alike: one-time library initialisation
    (bitsandbytes' native library, oneDNN's kernels) then sits in the baseline, not in either peak."""
    import contextlib
    import ctypes
    import gc

    import torch

    import usaf
    from usaf.engine.loss import causal_lm_loss
    from usaf.quant import nf4
    from usaf.testing.tiny import tiny_model

    nf4.dequantize({k: v[None] for k, v in nf4.quantize(torch.randn(64, 64)).items()}, 64, 64, dtype)
    model = usaf.prepare_model(tiny_model("qwen3_moe", dtype=dtype), usaf.UsafConfig())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, 97, (1, 16))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    causal_lm_loss(model, ids, ids).backward()
    optimizer.step()
    with torch.no_grad():
        model(input_ids=ids, logits_to_keep=1)
    del model, optimizer
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# CPU allocator settings that return freed memory: glibc keeps freed blocks mapped once its mmap threshold has grown,
# and oneDNN caches a primitive (with its buffers) per matmul shape, and routed experts make many shapes.
CPU_KNOBS = {"MALLOC_MMAP_THRESHOLD_": "131072", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"}


def measure(kind: str, store: Path, source: Path, args, env: dict | None = None) -> dict:
    command = [sys.executable, __file__, "--child", kind, "--store", str(store), "--source", str(source)]
    command += ["--seq", str(args.seq), "--dtype", args.dtype, "--threads", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if done.returncode:
        raise SystemExit(f"{kind} run failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["net"] = result["peak"] - result["baseline"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=512, help="tokens per sequence (default 512)")
    parser.add_argument("--quant", default="nf4")
    parser.add_argument("--dtype", default="bfloat16", help="checkpoint and compute dtype (default bfloat16)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", choices=["inference", "training"], help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--source", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from harness import machine, table, write_results

    from usaf.base.load import read_store_metadata
    from usaf.base.writer import prepare_store
    from usaf.testing.tiny import tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        source, store = Path(tmp, "model"), Path(tmp, f"store-{args.quant}")
        model = tiny_model("qwen3_moe", dtype=getattr(torch, args.dtype), **MODEL)
        parameters = sum(p.numel() for p in model.parameters())
        model.save_pretrained(source)
        del model
        start = time.perf_counter()
        prepare_store(source, store, args.quant, device="cpu")
        prepare_seconds = time.perf_counter() - start
        metadata = read_store_metadata(store)
        store_bytes = sum(f["size"] for f in metadata["files"].values())
        source_bytes = sum(p.stat().st_size for p in source.glob("*.safetensors"))
        inference = measure("inference", store, source, args)
        training = measure("training", store, source, args)
        inference_knobs = measure("inference", store, source, args, CPU_KNOBS)
        training_knobs = measure("training", store, source, args, CPU_KNOBS)

    ratio_gross = training["peak"] / inference["peak"]
    ratio_net = training["net"] / inference["net"]
    knobs_gross = training_knobs["peak"] / inference_knobs["peak"]
    tensor_ratio = training["tensor_peak"] / inference["tensor_peak"]
    knobs_net = training_knobs["net"] / inference_knobs["net"]
    payload = {
        "machine": machine(),
        "model": {"family": "qwen3_moe", **MODEL, "parameters": parameters},
        "quant": metadata["quant"],
        "dtype": args.dtype,
        "seq": args.seq,
        "source_bytes": source_bytes,
        "store_bytes": store_bytes,
        "prepare_seconds": prepare_seconds,
        "inference": inference,
        "training": training,
        "ratio_net": ratio_net,
        "ratio_gross": ratio_gross,
        "cpu_knobs": CPU_KNOBS,
        "inference_knobs": inference_knobs,
        "training_knobs": training_knobs,
        "knobs_ratio_net": knobs_net,
        "knobs_ratio_gross": knobs_gross,
        "tensor_ratio": tensor_ratio,
        "target": TARGET,
    }
    mb = 1 << 20
    markdown = "\n".join(
        [
            f"# Peak training ÷ peak inference memory ({payload['machine']['date']})",
            "",
            f"Model: qwen3_moe, {parameters / 1e6:.0f} M parameters (hidden {MODEL['hidden_size']}, "
            f"{MODEL['num_experts']} experts of width {MODEL['moe_intermediate_size']}, top-"
            f"{MODEL['num_experts_per_tok']}, {MODEL['num_hidden_layers']} layers, vocab {MODEL['vocab_size']}); "
            f"{args.dtype} checkpoint {source_bytes / mb:.0f} MB, {metadata['quant']} store {store_bytes / mb:.0f} MB "
            f"(prepared in {prepare_seconds:.0f} s). Sequence {args.seq} tokens, batch 1, CPU, "
            f"{args.threads} threads.",
            "",
            *table(
                ["run", "peak RSS MB", "above baseline MB", "after load MB", "time s"],
                [
                    [
                        name,
                        f"{r['peak'] / mb:.0f}",
                        f"{r['net'] / mb:.0f}",
                        f"{(r['loaded'] - r['baseline']) / mb:.0f}",
                        f"{r['seconds']:.1f}",
                    ]
                    for name, r in (
                        ("inference (no-grad prefill)", inference),
                        ("training step", training),
                        ("inference, CPU knobs", inference_knobs),
                        ("training step, CPU knobs", training_knobs),
                    )
                ],
            ),
            "",
            f"**Training ÷ inference: {ratio_net:.2f}x above the baseline** (target <= {TARGET}); "
            f"{ratio_gross:.2f}x for the whole process. Trainable parameters: {training['trainable']:,}.",
            "",
            f"With the CPU knobs ({' '.join(f'{k}={v}' for k, v in CPU_KNOBS.items())}, both runs): "
            f"**{knobs_net:.2f}x above the baseline**, {knobs_gross:.2f}x for the whole process.",
            "",
            "Live tensors (what a GPU's caching allocator counts as its peak, without the C allocator's and oneDNN's "
            "caches; resident = weights, quantized stores, sparse and optimizer state before the step): "
            f"inference {inference['tensor_peak'] / mb:.0f} MB (resident {inference['tensor_resident'] / mb:.0f}), "
            f"training {training['tensor_peak'] / mb:.0f} MB (resident {training['tensor_resident'] / mb:.0f}): "
            f"**{tensor_ratio:.2f}x**.",
            "",
            "Largest tensors live at the training peak: "
            + ", ".join(f"{name} {nbytes / mb:.1f} MB" for name, nbytes in training["tensor_top_at_peak"])
            + ".",
            "",
            "Baseline: the process after importing torch, transformers, bitsandbytes, usaf and the model's code, and "
            "after one training step and one prefill of a tiny model (one-time library initialisation).",
            "",
        ]
    )
    json_path, md_path = write_results("memory_ratio", payload, markdown)
    print(markdown)
    print(f"peak training / peak inference memory: {ratio_net:.2f} (net), {ratio_gross:.2f} (gross)")
    print(f"with the CPU knobs: {knobs_net:.2f} (net), {knobs_gross:.2f} (gross)")
    print(f"live tensors: {tensor_ratio:.2f}")
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
