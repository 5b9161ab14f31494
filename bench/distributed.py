"""Data-parallel traffic and step time: usaf's summed gradients against PEFT LoRA and full fine-tuning under torch
DDP, on one random Qwen3-MoE-shaped model, with 1 and 2 processes (issue 13); on CPU with gloo, or one process per
GPU with NCCL (RCCL on ROCm) under `--device cuda` (bench/gpu.sh --multi-gpu).

usaf's bytes are what `usaf.train.distributed.GradientReducer` moves (the training loop's, overlapped with the
backward); LoRA's and full fine-tuning's are what DDP's communication hook is handed (its gradient buckets),
counted, not computed. Expected for usaf: 4 B x (trained entries + router weights) in fp32, plus a 4 B presence
flag per trained tensor.

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/distributed.py [--smoke] [--worlds 1,2] [--steps N] [--device cuda]

`--expert-parallel EP [--gpus N]` (issue 37) measures an expert-parallel `usaf train` instead: `torchrun
--nproc_per_node=N -m usaf train ... --set distributed.expert_parallel=EP` (EP x N/EP ranks, gloo) on a random
Qwen3-MoE-shaped model with 16 experts, each rank run through this script so that it reports its own peak resident
set (ru_maxrss, imports included, MALLOC_MMAP_THRESHOLD_=131072 as bench/plan_accuracy.py) and the all-to-all bytes
`usaf.engine.expert_parallel.traffic` counted. Against them: the per-rank peak `usaf plan --config RUN/config.yaml
--device cpu --gpus N` predicts (within 15 %?), and the planner's all-to-all bytes per step (2 exchanges per MoE
layer in each of forward, recomputation and backward, T x k x h x 4 B, the (EP-1)/EP of pairs sent elsewhere).

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/distributed.py --expert-parallel 2 [--gpus 4] [--steps N] [--smoke]
"""

from __future__ import annotations

import argparse
import json
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


# ---- expert parallel: a torchrun job of `usaf train`, each rank's peak and all-to-all bytes against the planner ----

EP_SHAPE = (
    dict(  # 16 experts of 3 x 512 x 512 in 4 layers: 201 MB of fp32 experts, the largest term of the peak
        hidden_size=512,
        intermediate_size=1024,
        moe_intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=1024,
        num_experts=16,
        num_experts_per_tok=4,
    )
)
EP_SMOKE_SHAPE = dict(hidden_size=64, moe_intermediate_size=64, intermediate_size=128, head_dim=8)
EP_SETTINGS = [  # one micro-batch of exactly seq x batch tokens a step; nothing but training moves tokens
    "schedule.grad_accum=1",
    "schedule.warmup_steps=0",
    "select.density=0.02",
    "select.selection=magnitude",
    "select.reselect_every=0",
    "select.workspace_mb=64",
    "train.recompute=true",
    "router.health_every_steps=0",
    "log.progress=false",
    "log.tensorboard=false",
    "checkpoint.every_steps=0",
]
TOLERANCE = 0.15


def _ep_workspace(root: Path, shape: dict, seq: int, records: int) -> tuple[Path, Path]:
    """The model folder (random weights, the character tokenizer) and a text file whose every record is longer than
    `seq` characters, so that every micro-batch is seq x batch tokens."""
    import random

    from usaf.testing.tiny import tiny_model
    from usaf.train.tokenizer import char_tokenizer

    tokenizer = char_tokenizer()
    model_dir, data = root / "model", root / "train.jsonl"
    tiny_model("qwen3_moe", seed=0, vocab_size=len(tokenizer), **shape).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    rnd = random.Random(0)
    with open(data, "w") as f:
        for _ in range(records):
            f.write(json.dumps({"text": "".join(rnd.choice("abcdefgh ") for _ in range(2 * seq))}) + "\n")
    return model_dir, data


def ep_rank(out: Path, argv: list[str]) -> None:
    """One torchrun rank: `usaf train ARGV` in this process, then its peak and the traffic counters to OUT. The peak
    is taken above the resident set once the libraries are imported, as bench/plan_accuracy.py takes it (the
    planner's imports line is a constant of the machine, not of the run)."""
    from harness import lifetime_peak_rss, proc_status_bytes, reset_peak_rss

    from usaf.cli import main as usaf_main
    from usaf.engine import expert_parallel
    from usaf.train import distributed
    from usaf.train.loop import TrainingRun

    can_reset = reset_peak_rss()
    baseline = proc_status_bytes("VmRSS") if can_reset else 0
    setup = {}
    trains = TrainingRun.train

    def train_from_a_fresh_peak(run):  # the peak of loading and selecting apart from the training steps'
        setup["peak"] = proc_status_bytes("VmHWM") - baseline
        setup["held"] = proc_status_bytes("VmRSS") - baseline
        reset_peak_rss()
        return trains(run)

    TrainingRun.train = train_from_a_fresh_peak
    code = usaf_main(argv)
    if code != 0:  # stopped before training: usaf said why
        sys.exit(code)
    rank = int(os.environ.get("RANK", "0"))
    training = proc_status_bytes("VmHWM") - baseline
    report = {
        "rank": rank,
        "code": code,
        "peak_rss": lifetime_peak_rss(),
        "peak_above_imports": max(setup["peak"], training) if can_reset else None,
        "setup_peak": setup["peak"] if can_reset else None,
        "held_before_training": setup["held"] if can_reset else None,
        "training_peak": training if can_reset else None,
        "all_to_all": dict(
            expert_parallel.traffic
        ),  # counted by the EP runtime (usaf.engine.expert_parallel)
        "all_reduce": dict(distributed.traffic),
    }
    (out / f"rank-{rank}.json").write_text(json.dumps(report))
    sys.exit(code)


def _ep_job(ep: int, gpus: int, steps: int, smoke: bool, root: Path, quant: str) -> dict:
    """Launch the job, read every rank's report, plan the same run."""
    import subprocess

    seq, batch = (32, 2) if smoke else (256, 2)
    shape = {**EP_SHAPE, **(EP_SMOKE_SHAPE if smoke else {})}
    model_dir, data = _ep_workspace(root, shape, seq, records=gpus * batch * (steps + 2))
    run_dir, reports = root / "run", root / "ranks"
    reports.mkdir()
    sets = [
        *EP_SETTINGS,
        f"data.max_seq_len={seq}",
        f"data.batch_size={batch}",
        f"schedule.max_steps={steps}",
    ]
    sets += [f"model.quant={quant}", f"distributed.expert_parallel={ep}"]
    train = ["train", f"--model={model_dir}", f"--data={data}", f"--out={run_dir}"]
    train += [f"--set={x}" for x in sets]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"]
    launch += [__file__, "--ep-rank", str(reports), "--", *train]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[1] / "src"), env.get("PYTHONPATH", "")]
    )
    started = time.perf_counter()
    done = subprocess.run(launch, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:  # usaf's own one-line errors first, then the end of the log
        said = "\n".join(x for x in done.stderr.splitlines() if "usaf:" in x)
        raise SystemExit(f"the EP job failed ({done.returncode}):\n{said}\n{done.stderr[-3000:]}")
    ranks = [json.loads((reports / f"rank-{r}.json").read_text()) for r in range(gpus)]
    return {
        "ep": ep,
        "gpus": gpus,
        "seq": seq,
        "batch": batch,
        "steps": steps,
        "shape": shape,
        "wall_s": time.perf_counter() - started,
        "ranks": ranks,
        "plan": _ep_plan(run_dir, model_dir, gpus),
        "command": " ".join(["torchrun", "--standalone", f"--nproc_per_node={gpus}", "-m", "usaf", *train]),
    }


def _ep_plan(run_dir: Path, model_dir: Path, gpus: int) -> dict:
    """What the planner says of the run's own configuration on `gpus` CPU ranks (`usaf plan --config`)."""
    from usaf import planner
    from usaf.config import RunConfig

    run = RunConfig.load_saved(str(run_dir / "config.yaml"))
    name, config = planner.load_model_config(str(model_dir))
    shape = planner.model_shape(config, name)
    settings = planner.settings_for_run(planner.PlannedRun.of(run), "fp32").replace(gpus=gpus)
    p = planner.plan(shape, settings, planner.DEVICES["cpu"])
    return {
        "peak": p.device_peak,
        "peak_above_imports": p.device_peak - p.imports,
        "all_to_all_per_step": p.traffic.all_to_all_sent,
        "all_reduce_per_step": p.traffic.all_reduce_buffer,
        "expert_parallel": settings.expert_parallel,
        "command": f"usaf plan --config {run_dir / 'config.yaml'} --device cpu --gpus {gpus}",
        "table": planner.format_plan(p),
    }


def ep_markdown(jobs: list[dict], command: str) -> str:
    lines = [
        "# Expert parallel: per-rank peak and all-to-all bytes against the planner (CPU, gloo)",
        "",
        f"Command: `{command}`  ",
        f"Model: random Qwen3-MoE {jobs[0]['shape']}; fp32; seq {jobs[0]['seq']} x batch {jobs[0]['batch']} a "
        f"micro-batch, one a step, {jobs[0]['steps']} steps. Measured: each rank's peak resident set "
        "(ru_maxrss, what `usaf train` records as peak_memory_mb on the CPU; MALLOC_MMAP_THRESHOLD_=131072), and "
        "apart from its imports (above the resident set once `usaf train`'s modules are imported): the peak while "
        "loading and selecting, what that leaves held, the peak of the training steps. All-to-all: the bytes that "
        "left the rank in the last step (`usaf.engine.expert_parallel.traffic`). Planned: `usaf plan --config "
        "RUN/config.yaml --device cpu --gpus N` (its imports line apart in the second column).",
        "",
    ]
    header = ["EP x DP", "rank", "measured peak", "planned peak", "error"]
    header += ["apart from imports: measured, planned", "loading / held after / training"]
    header += ["all-to-all, last step", "planned", "error"]
    rows, within = [], True
    for job in jobs:
        plan = job["plan"]
        for r in job["ranks"]:
            error = plan["peak"] / r["peak_rss"] - 1
            within &= abs(error) <= TOLERANCE or job["gpus"] == 1  # the one-process baseline is a reference
            sent = r["all_to_all"].get("last_step_bytes")
            a2a_error = f"{plan['all_to_all_per_step'] / sent - 1:+.1%}" if sent else "not counted"
            apart = ("setup_peak", "held_before_training", "training_peak")
            rows.append(
                [
                    f"{job['ep']} x {job['gpus'] // job['ep']}",
                    r["rank"],
                    f"{r['peak_rss'] / 2**20:.0f} MB",
                    f"{plan['peak'] / 2**20:.0f} MB",
                    f"{error:+.1%}",
                    f"{r['peak_above_imports'] / 2**20:.0f} MB, {plan['peak_above_imports'] / 2**20:.0f} MB",
                    " / ".join(f"{r[k] / 2**20:.0f} MB" for k in apart),
                    f"{sent:,}" if sent else "-",
                    f"{plan['all_to_all_per_step']:,.0f}",
                    a2a_error,
                ]
            )
    lines += table(header, rows, align="lrrrrrrrrr")
    verdict = (
        f"Every expert-parallel rank's peak within {TOLERANCE:.0%} of the plan: {'yes' if within else 'NO'}."
    )
    lines += ["", verdict, ""]
    for job in jobs:
        lines += [f"## EP {job['ep']} x DP {job['gpus'] // job['ep']}", "", f"`{job['command']}`", ""]
        lines += [f"`{job['plan']['command']}`:", "", "```", job["plan"]["table"], "```", ""]
    return "\n".join(lines)


def main_expert_parallel(args) -> None:
    import tempfile

    steps = 2 if args.smoke else args.steps
    jobs = []
    meshes = [(args.expert_parallel, int(n)) for n in (args.gpus or str(args.expert_parallel)).split(",")]
    if args.baseline:  # one process of the same run: what the planner misses without expert parallelism
        meshes.insert(0, (1, 1))
    for ep, gpus in meshes:
        with tempfile.TemporaryDirectory() as root:
            jobs.append(_ep_job(ep, gpus, steps, args.smoke, Path(root), args.quant))
        print(json.dumps({k: v for k, v in jobs[-1].items() if k != "plan"}, default=str), flush=True)
    command = "OMP_NUM_THREADS=1 PYTHONPATH=src python bench/distributed.py " + " ".join(sys.argv[1:])
    text = ep_markdown(jobs, command)
    print(text)
    if args.out is not None or not args.smoke:
        kwargs = {"out_dir": args.out} if args.out is not None else {}
        print(
            *write_results(
                "distributed-ep" + ("-smoke" if args.smoke else ""),
                {"jobs": jobs, "machine": machine()},
                text,
                **kwargs,
            )
        )


def main() -> None:
    if "--ep-rank" in sys.argv:  # a rank of the expert-parallel job: --ep-rank OUT -- usaf's arguments
        at = sys.argv.index("--ep-rank")
        ep_rank(Path(sys.argv[at + 1]), sys.argv[sys.argv.index("--") + 1 :])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, 2 steps (a test of the script)")
    parser.add_argument("--worlds", default="1,2")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="results folder (default bench/results)")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one process per GPU, NCCL"
    )
    parser.add_argument(
        "--expert-parallel",
        type=int,
        default=0,
        metavar="EP",
        help="measure an expert-parallel usaf train job instead (EP x --gpus/EP ranks)",
    )
    parser.add_argument(
        "--gpus", default="", help="with --expert-parallel: the ranks of each job, e.g. 2,4 (default: EP)"
    )
    parser.add_argument(
        "--quant", default="nf4", help="with --expert-parallel: the experts' store format (model.quant)"
    )
    parser.add_argument(
        "--baseline", action="store_true", help="with --expert-parallel: one process of the same run first"
    )
    args = parser.parse_args()
    if args.expert_parallel:
        main_expert_parallel(args)
        return
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
