"""Data-parallel traffic and step time: usaf's summed gradients against PEFT LoRA and full fine-tuning under torch
DDP, on one random Qwen3-MoE-shaped model, with 1 and 2 processes (issue 13); on CPU with gloo, or one process per
GPU with NCCL (RCCL on ROCm) under `--device cuda` (bench/gpu.sh --multi-gpu).

usaf's bytes are what `usaf.train.distributed.GradientReducer` moves (the training loop's, overlapped with the
backward); LoRA's and full fine-tuning's are what DDP's communication hook is handed (its gradient buckets),
counted, not computed. Expected for usaf: 4 B x (trained entries + router weights) in fp32, plus a 4 B presence
flag per trained tensor.

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/distributed.py [--smoke] [--worlds 1,2] [--steps N] [--device cuda]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from harness import machine, table, write_results

SHAPE = dict(  # ~8 M parameters, 6 M of them in experts: the CPU's size, the real models' proportions
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    vocab_size=2048,
    max_position_embeddings=256,
    num_experts=16,
    num_experts_per_tok=4,
)
SMOKE_SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_experts=6, vocab_size=97, head_dim=8)
METHODS = ("usaf", "lora", "full")
DENSITY = 0.01


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(method: str, shape: dict, device: torch.device):
    from recipe import stock_baseline

    import usaf
    from usaf.testing.tiny import tiny_model

    model = tiny_model("qwen3_moe", seed=0, **shape).train().to(device)
    if method == "usaf":
        usaf.prepare_model(
            model,
            usaf.UsafConfig(density=DENSITY, targets=["experts", "routers"], selection="magnitude"),
        )
        return model, model
    model = stock_baseline(model, method)
    ids = [device.index] if device.type == "cuda" else None
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids) if dist.is_initialized() else model
    return model, ddp


def _worker(rank: int, world: int, port: int, job: dict, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    device = torch.device("cuda", rank) if job["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    from usaf.train import distributed

    shape, steps, batch, seq = job["shape"], job["steps"], job["batch"], job["seq"]
    results = {}
    for method in METHODS:
        model, runner = _model(method, shape, device)
        params = [p for p in model.parameters() if p.requires_grad]
        counted = {"bytes": 0}
        reducer = (
            distributed.GradientReducer([p for p in model.parameters() if p.requires_grad])
            if method == "usaf" and world > 1
            else None
        )
        if runner is not model:

            def hook(state, bucket, counted=counted):
                from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

                counted["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
                return allreduce_hook(state, bucket)

            runner.register_comm_hook(None, hook)
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        generator = torch.Generator().manual_seed(1000 + rank)
        times, moved = [], []
        for step in range(steps + 1):  # the first step warms up
            ids = torch.randint(0, shape["vocab_size"], (batch, seq), generator=generator).to(device)
            _synchronize(device)
            start = time.perf_counter()
            counted["bytes"] = 0
            if reducer is not None:
                reducer.arm()  # as the loop does before a step's last backward
            loss = runner(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            # usaf: the training loop's reducer; the others: what DDP's hook was handed
            step_bytes = reducer.finish() if reducer is not None else counted["bytes"]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            _synchronize(device)
            if step:
                times.append(time.perf_counter() - start)
                moved.append(step_bytes)
        trainable = sum(p.numel() for p in params)
        results[method] = {
            "trainable": trainable,
            "tensors": len(params),
            "bytes_per_step": statistics.median(moved),
            "step_s": statistics.median(times),
        }
        if method == "usaf":
            from usaf.prepare import trainable_summary

            summary = trainable_summary(model)
            results[method].update(entries=summary["expert_entries"], routers=summary["routers"])
        del model, runner, optimizer
    if rank == 0:
        queue.put(results)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(world: int, job: dict) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(_worker, args=(world, _free_port(), job, queue), nprocs=world, join=True)
    return queue.get()


def markdown(payload: dict) -> str:
    lines = [
        f"# Data-parallel traffic and step time ({payload['backend']})",
        "",
        f"Command: `{payload['command']}`  ",
        f"Model: random Qwen3-MoE {payload['shape']}; {payload['params']:,} parameters; batch "
        f"{payload['batch']} x {payload['seq']} tokens per process; median of {payload['steps']} steps; usaf at "
        f"density {DENSITY} (experts + routers, magnitude selection).",
        "",
    ]
    header = [
        "method",
        "processes",
        "trained values",
        "bytes all-reduced / step",
        "4 B x trained",
        "step (ms)",
    ]
    rows = [
        [
            method,
            world,
            f"{r['trainable']:,}",
            f"{r['bytes_per_step']:,.0f}",
            f"{4 * r['trainable']:,}",
            f"{r['step_s'] * 1e3:.1f}",
        ]
        for world, by_method in payload["worlds"].items()
        for method, r in by_method.items()
    ]
    lines += table(header, rows)
    two = payload["worlds"].get("2")
    if two:
        u = two["usaf"]["bytes_per_step"]
        lines += [
            "",
            f"usaf trains {two['usaf']['entries']:,} expert entries + {two['usaf']['routers']:,} router weights: "
            f"4 B x {two['usaf']['entries'] + two['usaf']['routers']:,} = "
            f"{4 * (two['usaf']['entries'] + two['usaf']['routers']):,} B expected, plus a 4 B presence flag for each "
            f"of its {two['usaf'].get('tensors', 0)} trained tensors "
            f"({4 * (two['usaf']['entries'] + two['usaf']['routers'] + two['usaf'].get('tensors', 0)):,} B).",
            f"With 2 processes usaf moves {u / 2**20:.3f} MiB a step: "
            f"{two['lora']['bytes_per_step'] / max(u, 1):.1f}x less than LoRA and "
            f"{two['full']['bytes_per_step'] / max(u, 1):.0f}x less than full fine-tuning. 1 process moves nothing. "
            "Step times on a 2-core machine shared with other work are indicative only.",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, 2 steps (a test of the script)")
    parser.add_argument("--worlds", default="1,2")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="results folder (default bench/results)")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one process per GPU, NCCL"
    )
    args = parser.parse_args()
    shape = {**SHAPE, **(SMOKE_SHAPE if args.smoke else {})}
    job = {
        "device": args.device,
        "shape": shape,
        "steps": 2 if args.smoke else args.steps,
        "batch": 2,
        "seq": 16 if args.smoke else 128,
    }
    from usaf.testing.tiny import tiny_model

    params = sum(p.numel() for p in tiny_model("qwen3_moe", **shape).parameters())
    worlds = {}
    for world in (int(w) for w in args.worlds.split(",")):
        worlds[str(world)] = run(world, job)
        print(world, worlds[str(world)], flush=True)
    payload = {
        "command": "OMP_NUM_THREADS=1 PYTHONPATH=src python bench/distributed.py " + " ".join(sys.argv[1:]),
        "machine": machine(),
        "backend": "GPU, NCCL" if args.device == "cuda" else "CPU, gloo",
        "shape": shape,
        "params": params,
        **{k: job[k] for k in ("batch", "seq", "steps")},
        "worlds": worlds,
    }
    text = markdown(payload)
    print(text)
    if args.out is not None or not args.smoke:
        kwargs = {"out_dir": args.out} if args.out is not None else {}
        json_path, md_path = write_results(
            "distributed" + ("-smoke" if args.smoke else ""), payload, text, **kwargs
        )
        print(json_path, md_path)


if __name__ == "__main__":
    main()
