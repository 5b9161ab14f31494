"""Whole models, side by side: usaf against PEFT LoRA, full fine-tuning, dense experts+routers, routers only and
inference, on the same model, the same batches and the same data order. `make bench-compare` runs it; results go
to bench/results/compare-<date>.{md,json,png}.

    .venv/bin/python bench/compare.py            # CPU: the demo model + a ~200 M-parameter Qwen3-MoE (~15 min)
    .venv/bin/python bench/compare.py --quick    # fewer steps, a smaller random model (~5 min)
    .venv/bin/python bench/compare.py --smoke --out DIR   # tiny shapes, seconds of work (tests, gpu.sh --dry-run)
    .venv/bin/python bench/compare.py --device cuda --out DIR   # what bench/gpu.sh runs

How it measures
- Every method runs in its own process, so its peak memory is its own: the peak resident set above the process's
  baseline on CPU (VmHWM, reset after loading), the allocator's peak (`torch.cuda.max_memory_allocated`) on a GPU.
  The processes are forked from a server that imported torch/transformers/peft once (imports cost seconds each).
- All methods' processes stay alive and train in interleaved rounds: in each round every method runs its next
  steps (starting from a rotated method each round), so a noisy machine slows all methods alike. After each
  training step, the same process times a forward-only pass (no grad) on the same batch: step ÷ own forward is
  measured side by side in one process.
- Every training method: the same batches in the same order (seeded), `usaf.causal_lm_loss` (chunked logits),
  AdamW (betas 0.9/0.999, no weight decay), gradient clipping at 1.0, linear warm-up over 10 % of the steps then
  cosine to 10 % of the peak learning rate, the same recomputation setting (off unless --recompute).
- The baselines (LoRA, full fine-tuning, experts+routers, routers only, inference) run transformers' stock
  `grouped_mm` experts implementation; usaf runs its own. "nf4" methods use a usaf prepared store
  (`usaf.base.writer.prepare_store` / `usaf.base.load.load_prepared`), whose inference row is usaf's engine with nothing trained.
- Learning rates, one per method (ROUTER AND VALUE LRs EQUAL), chosen on the demo task (see LEARNING_RATES).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import harness  # noqa: E402
from harness import (  # noqa: E402
    PeakMemory,
    TensorPeak,
    WorkerPool,
    call_in_fork,
    fmt,
    own_mapped_weights,
    params_label,
    save_figure,
    subplots,
    table,
    write_results,
)
from recipe import LORA_ALPHA, LORA_ATTENTION, LORA_EXPERTS, LORA_RANK, lr_factor, stock_baseline  # noqa: E402

RESULTS = BENCH / "results"

# Learning rates by method family: each the best of a sweep on the demo task (200 steps of 32 records, accuracy on
# the held-out records; bench/results/compare-<date>.md lists the sweep). usaf: 1e-2 -> 98.5 %, 2e-2 -> 99 %
# (neuron 5 %), element 5 % 99 % at 2e-2; element 0.5 % learns nothing at 5e-3, 1e-2, 3e-2 or 1e-1. LoRA: 1e-3 ->
# 64.5 %, 2e-3 -> 93 %, 3e-3 -> 99.5 %, 5e-3 -> 21.5 %. Full fine-tuning: 3e-4 -> 70.5 %, 1e-3 -> 100 %, 3e-3 ->
# 75 %. Experts+routers: 3e-4 -> 57 %, 1e-3 -> 99.5 %. Routers only: 0 % at 1e-2, 3e-2 and 1e-1 (routing alone
# cannot add a mapping). Router and value learning rates are equal within a method.
LEARNING_RATES = {
    "usaf": 2e-2,
    "lora": 3e-3,
    "full": 1e-3,
    "experts": 1e-3,
    "routers": 1e-2,
}

ELEMENT_DENSITY = 0.005  # the setting
NEURON_DENSITY = (
    0.05  # whole neurons: 0.5 % would leave a few neurons per layer; bench/engine.py uses 5 % too
)


@dataclass(frozen=True)
class Method:
    key: str
    label: str
    kind: str  # usaf | lora | full | experts | routers | inference
    quant: str = "none"  # none | nf4
    granularity: str = "element"
    router: bool = True
    density_override: float | None = None
    demo_only: bool = False  # a setting that matters for the demo task's accuracy, not for speed or memory

    @property
    def trains(self) -> bool:
        return self.kind != "inference"

    @property
    def lr(self) -> float:
        return LEARNING_RATES.get(self.kind, 0.0)

    @property
    def density(self) -> float:
        if self.density_override is not None:
            return self.density_override
        return ELEMENT_DENSITY if self.granularity == "element" else NEURON_DENSITY


METHODS = [
    Method("usaf-element", "usaf element 0.5 % + routers", "usaf"),
    Method("usaf-element-norouter", "usaf element 0.5 %, routers frozen", "usaf", router=False),
    Method("usaf-neuron", "usaf neuron 5 % + routers", "usaf", granularity="neuron"),
    Method(
        "usaf-element-5",
        "usaf element 5 % + routers (usaf demo's setting)",
        "usaf",
        density_override=0.05,
        demo_only=True,
    ),
    Method("usaf-nf4-element", "usaf nf4 element 0.5 % + routers", "usaf", quant="nf4"),
    Method(
        "usaf-nf4-element-norouter",
        "usaf nf4 element 0.5 %, routers frozen",
        "usaf",
        quant="nf4",
        router=False,
    ),
    Method("usaf-nf4-neuron", "usaf nf4 neuron 5 % + routers", "usaf", quant="nf4", granularity="neuron"),
    Method("lora-r16", "PEFT LoRA r=16 attn + experts (grouped_mm)", "lora"),
    Method("full-ft", "full fine-tuning (grouped_mm)", "full"),
    Method("experts-routers", "experts + routers, dense (grouped_mm)", "experts"),
    Method("routers-only", "routers only (grouped_mm)", "routers"),
    Method("inference", "inference, no grad (grouped_mm)", "inference"),
    Method("inference-nf4", "inference nf4, no grad (usaf engine)", "inference", quant="nf4"),
]
BY_KEY = {m.key: m for m in METHODS}

# Random Qwen3-MoE-shaped models. "full": ~200 M parameters (170 M in experts), short sequences so that the CPU
# run stays within ~15 minutes on 2 cores; "gpu": the same model with longer sequences.
RANDOM_SHAPES = {
    "full": dict(
        hidden_size=768,
        num_hidden_layers=6,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
        moe_intermediate_size=384,
        num_experts=32,
        num_experts_per_tok=4,
        vocab_size=16384,
    ),
    "quick": dict(
        hidden_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        moe_intermediate_size=256,
        num_experts=16,
        num_experts_per_tok=4,
        vocab_size=8192,
    ),
    "smoke": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        vocab_size=512,
    ),
}


@dataclass
class Run:
    """How one model is exercised: steps in rounds, batch shape, warm-up steps left out of the timings."""

    model: str  # "demo" | "random"
    steps: int
    rounds: int
    batch: int
    seq: int = 0  # random tokens per sequence (the demo's length comes from its records)
    warmup: int = 2
    eval_batches: int = 2
    shape: dict = field(default_factory=dict)
    accuracy_after_rounds: tuple = ()  # the demo task's accuracy also after these rounds (a point of the curve)


def runs_for(mode: str, device: str) -> list[Run]:
    gpu = device != "cpu"
    if mode == "smoke":
        return [
            Run("demo", steps=4, rounds=2, batch=16, warmup=1, eval_batches=1, accuracy_after_rounds=(1,)),
            Run(
                "random",
                steps=4,
                rounds=2,
                batch=2,
                seq=32,
                warmup=1,
                eval_batches=1,
                shape=RANDOM_SHAPES["smoke"],
            ),
        ]
    if mode == "quick":
        return [
            Run("demo", steps=100, rounds=2, batch=32, warmup=3, accuracy_after_rounds=(1,)),
            Run("random", steps=6, rounds=3, batch=2, seq=128, shape=RANDOM_SHAPES["quick"]),
        ]
    return [
        Run("demo", steps=200, rounds=4, batch=32, warmup=5, accuracy_after_rounds=(2,)),
        Run(
            "random",
            steps=40 if gpu else 9,
            rounds=4 if gpu else 3,
            batch=8 if gpu else 2,
            seq=1024 if gpu else 128,
            warmup=4 if gpu else 2,
            shape=RANDOM_SHAPES["full"],
        ),
    ]


# ---- the worker: one method, one model, one process -----------------------------------------------------------


def _exercise_libraries(method: Method, device) -> None:
    """One training step of a tiny model through the code path `method` uses, before the memory baseline is
    taken: lazily imported modules, kernel code pages and allocator pools then count for no method (they are the
    same for all). Every tensor of the model being compared is created after the baseline."""
    import torch

    import usaf
    from usaf.testing.tiny import tiny_model

    model = tiny_model("qwen3_moe").to(device)
    if method.kind == "usaf" or method.quant != "none":
        usaf.prepare_model(model, usaf.UsafConfig(density=0.1, granularity=method.granularity))
    else:
        model.set_experts_implementation("grouped_mm")
    if method.kind == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=2, target_modules=LORA_ATTENTION, target_parameters=LORA_EXPERTS)
        )
    if method.quant != "none":
        from usaf.quant import get_format, resolve_format

        fmt = get_format(resolve_format(method.quant, device))
        fmt.dequantize(
            {k: v[None] for k, v in fmt.quantize(torch.randn(64, 64, device=device)).items()},
            64,
            64,
            torch.float32,
        )
    ids = torch.randint(0, 97, (2, 8), device=device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    usaf.causal_lm_loss(model, ids, ids).backward()
    optimizer.step()
    with torch.no_grad():
        usaf.causal_lm_loss(model, ids, ids)
    del model, optimizer, trainable
    gc.collect()


class Worker:
    def __init__(self, job: dict):
        import torch

        self.torch = torch
        self.job = job
        self.method = BY_KEY[job["method"]]
        self.device = torch.device(job["device"])
        self.dtype = getattr(torch, job["dtype"])
        torch.set_num_threads(job["threads"])
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if job.get("exercise", True):  # smoke runs skip it: their memory figures mean nothing anyway
            _exercise_libraries(self.method, self.device)
        self.memory = PeakMemory(self.device)
        data = torch.load(job["batches"], weights_only=True)
        self.batches = data["train"]
        self.eval_batches = data["eval"]
        self.step = 0
        start = time.perf_counter()
        self.model = self._build()
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        if self.method.trains:
            self.model.train()
            if job["recompute"]:
                import usaf

                usaf.enable_recomputation(self.model)
            if (
                self.method.kind == "usaf"
            ):  # usaf's own AdamW: the values' moments in bf16, as `usaf train` keeps them
                from usaf.train.optim import CompactAdamW

                values = {id(p) for n, p in self.model.named_parameters() if n.endswith(".values")}
                groups = [
                    {"params": [p for p in self.trainable if id(p) in values], "compact": True},
                    {"params": [p for p in self.trainable if id(p) not in values], "compact": False},
                ]
                self.optimizer = CompactAdamW(
                    [g for g in groups if g["params"]],
                    lr=self.method.lr,
                    betas=(0.9, 0.999),
                    weight_decay=0.0,
                )
            else:
                self.optimizer = torch.optim.AdamW(
                    self.trainable, lr=self.method.lr, betas=(0.9, 0.999), weight_decay=0.0
                )
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(job["steps"]))
        else:
            self.model.eval()
        self._sync()
        self.setup_s = time.perf_counter() - start
        self.load_peak = self.memory.peak()
        self.memory.reset()
        self.step_times: list[float] = []
        self.forward_times: list[float] = []
        self.train_losses: list[float] = []
        self.curve: list[dict] = []

    def _build(self):
        from transformers import AutoModelForCausalLM

        import usaf

        m, job = self.method, self.job
        if m.quant != "none":
            from usaf.base.load import load_prepared

            if m.kind == "usaf":
                config = experts_config(m)
                source = job["model_dir"]  # trained values start from the original weights, as `usaf train`
            else:  # inference: the engine with nothing trained
                config, source = usaf.UsafConfig(layers=[], targets=["experts"], train_router=False), None
            return load_prepared(job["quant_dir"], source, config, device=self.device, dtype=self.dtype)

        model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=self.dtype).to(self.device)
        own_mapped_weights(model)
        if m.kind == "usaf":
            return usaf.prepare_model(model, experts_config(m))
        model = stock_baseline(model, m.kind)
        return model.to(self.device)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def _batch(self, index: int):
        ids, labels = self.batches[index % len(self.batches)]
        return ids.to(self.device), labels.to(self.device)

    def _loss(self, ids, labels):
        import usaf

        return usaf.causal_lm_loss(self.model, ids, labels)

    def run_steps(self, count: int) -> dict:
        torch = self.torch
        for _ in range(count):
            ids, labels = self._batch(self.step)
            if self.method.trains:
                self._sync()
                start = time.perf_counter()
                loss = self._loss(ids, labels)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.trainable, 1.0)
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                self._sync()
                self.step_times.append(time.perf_counter() - start)
                self.train_losses.append(float(loss.detach()))
            self._sync()
            start = time.perf_counter()
            with torch.no_grad():
                self._loss(ids, labels)
            self._sync()
            self.forward_times.append(time.perf_counter() - start)
            self.step += 1
        return {"done": self.step}

    def _tensor_peak(self) -> int:
        """CPU: one more step (or forward) counting live tensors, as a GPU allocator's peak counts them; RSS adds
        the C allocator's and oneDNN's caches. Run after every other figure is taken: the extra step changes none."""
        self.model.train(self.method.trains)
        with TensorPeak() as tensors:
            if self.method.trains:
                ids, labels = self._batch(self.step)
                self._loss(ids, labels).backward()
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            else:
                with self.torch.no_grad():
                    self._loss(*self._batch(self.step))
        return tensors.peak

    def accuracy(self) -> dict:
        """The demo task's exact-match accuracy on the held-out records now (None for random tokens)."""
        if not self.job["eval_records"]:
            return {"step": self.step, "accuracy": None}
        from transformers import AutoTokenizer

        from usaf.demo.task import read_jsonl, task_accuracy

        tokenizer = AutoTokenizer.from_pretrained(self.job["model_dir"])
        records = read_jsonl(self.job["eval_records"])
        accuracy = task_accuracy(self.model, tokenizer, records)  # greedy; leaves the model in its mode
        self.curve.append({"step": self.step, "accuracy": accuracy})
        return self.curve[-1]

    def finish(self) -> dict:
        torch = self.torch
        peak, current = self.memory.peak(), self.memory.now()
        self.model.eval()
        with torch.no_grad():
            losses = [
                float(self._loss(ids.to(self.device), labels.to(self.device)))
                for ids, labels in self.eval_batches
            ]
        accuracy = self.accuracy()["accuracy"]
        tensor_peak = self._tensor_peak() if self.device.type == "cpu" else None
        return {
            "method": self.method.key,
            "tensor_peak_bytes": tensor_peak,
            "setup_s": self.setup_s,
            "load_peak_bytes": self.load_peak,
            "peak_bytes": peak,
            "end_bytes": current,
            "trainable_params": sum(p.numel() for p in self.trainable),
            "total_params": _count_params(self.model),
            "step_times_s": self.step_times,
            "forward_times_s": self.forward_times,
            "train_losses": self.train_losses,
            "eval_loss": sum(losses) / len(losses),
            "accuracy": accuracy,
            "accuracy_curve": self.curve,
            "quant_format": _quant_format(self.model),
        }


def experts_config(m: Method):
    """The engine's cost is what this benchmark measures: expert entries (+ routers) chosen by magnitude, as in
    0.1.0, so that rows compare across versions at the same number of trained entries. Which weights to train
    for quality is bench/quality.py's question."""
    import usaf

    return usaf.UsafConfig(
        density=m.density,
        granularity=m.granularity,
        train_router=m.router,
        targets=["experts", "routers"],
        selection="magnitude",
    )


def _count_params(model) -> int:
    """Parameters of the model as stored (a quantized expert tensor counts its entries, not its bytes)."""
    from usaf.model.layout import find_moe_layers

    seen = {id(p) for p in model.parameters()}
    total = sum(p.numel() for p in model.parameters())
    with contextlib.suppress(Exception):
        for layer in find_moe_layers(model):
            for t in layer.tensors:
                tensor = getattr(layer.experts, t.name)
                if id(tensor) not in seen:
                    total += tensor.numel()
    return total


def _quant_format(model) -> str | None:
    from usaf.engine.state import model_state

    prepared = model_state(model)
    store = prepared.store if prepared is not None else None
    return store.metadata.get("quant") if store is not None else None


# ---- the parent: models, batches, the rounds ------------------------------------------------------------------


def prepare_model_dir(run: Run, workdir: Path, device: str, smoke: bool, threads: int = 1) -> dict | None:
    """{model_dir, quant_dir, batches, eval_records, dtype, tokens_per_step, params} for one model, or None when
    the demo assets are missing."""
    import torch

    from usaf.base.writer import prepare_store

    torch.set_num_threads(threads)
    root = workdir / run.model
    root.mkdir(parents=True, exist_ok=True)
    eval_records = None
    if run.model == "demo":
        model_dir, data_dir = _demo_assets(root, smoke)
        if model_dir is None:
            return None
        dtype = "float32"  # the demo checkpoint's dtype, on every device
        train_ids, eval_ids = _demo_batches(model_dir, data_dir, run)
        eval_records = str(data_dir / "eval.jsonl")
    else:
        model_dir = root / "model"
        dtype = "float32" if device == "cpu" else "bfloat16"
        _random_model(run.shape, model_dir, getattr(torch, dtype))
        train_ids, eval_ids = _random_batches(run)
    quant_dir = root / "nf4"
    prepare_store(model_dir, quant_dir, "nf4", device=device, force=True)
    batches = root / "batches.pt"
    torch.save({"train": train_ids, "eval": eval_ids}, batches)
    with open(model_dir / "config.json") as f:
        config = json.load(f)
    return {
        "model_dir": str(model_dir),
        "quant_dir": str(quant_dir),
        "batches": str(batches),
        "eval_records": eval_records,
        "dtype": dtype,
        "tokens_per_step": int(train_ids[0][0].numel()),
        "config": {
            **{
                k: config.get(k)
                for k in (
                    "model_type",
                    "hidden_size",
                    "num_hidden_layers",
                    "num_experts_per_tok",
                    "moe_intermediate_size",
                    "vocab_size",
                )
            },
            "num_experts": config.get("num_experts") or config.get("num_local_experts"),
        },
    }


def _demo_assets(root: Path, smoke: bool):
    """The bundled demo model and data; in smoke runs a random model of the demo's shape on generated data (the
    accuracy is then ~0, but every code path runs)."""
    from usaf.demo.run import assets as demo_assets

    assets = demo_assets()
    if not smoke:
        if (assets / "model" / "config.json").exists() and (assets / "data" / "train.jsonl").exists():
            return assets / "model", assets / "data"
        print(f"demo assets not found under {assets}; the demo model is skipped", flush=True)
        return None, None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from usaf.demo.task import write_demo_data
    from usaf.train.tokenizer import char_tokenizer

    tokenizer = char_tokenizer()
    torch.manual_seed(0)  # an untrained model of the bundled one's shape
    config = AutoConfig.from_pretrained(assets / "model")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    write_demo_data(root / "data", train_size=256, eval_size=16)
    return root / "model", root / "data"


def _demo_batches(model_dir: Path, data_dir: Path, run: Run):
    from transformers import AutoTokenizer

    from usaf.demo.task import encode_records, read_jsonl

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    records = read_jsonl(data_dir / "train.jsonl")
    order = random.Random(0)  # the data order: seeded, reshuffled each epoch, the same for every method
    train, pool = [], []
    while len(train) < run.steps:
        if len(pool) < run.batch:
            fresh = list(records)
            order.shuffle(fresh)
            pool += fresh
        train.append(encode_records(tokenizer, pool[: run.batch]))
        pool = pool[run.batch :]
    held_out = read_jsonl(data_dir / "eval.jsonl")
    eval_batches = [encode_records(tokenizer, held_out[i : i + 64]) for i in range(0, len(held_out), 64)]
    return (
        train,
        eval_batches,
    )  # all held-out records: the loss over the same records the accuracy is taken on


def _random_model(shape: dict, model_dir: Path, dtype) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_moe", max_position_embeddings=4096, tie_word_embeddings=False, norm_topk_prob=True, **shape
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(model_dir)
    del model
    gc.collect()


def _random_batches(run: Run):
    import torch

    generator = torch.Generator().manual_seed(0)
    vocab = run.shape["vocab_size"]

    def batch():
        ids = torch.randint(0, vocab, (run.batch, run.seq), generator=generator)
        return ids, ids.clone()

    return [batch() for _ in range(run.steps)], [batch() for _ in range(run.eval_batches)]


def environment(device: str, threads: int | None) -> dict:
    """The device to use, the torch threads per process, the machine and library versions."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    # One thread per process on CPU by default: on a shared 2-core machine, OpenMP barriers of 2-thread processes
    # stall whenever another process holds a core, making times several-fold slower and erratic.
    threads = threads or (1 if device == "cpu" else os.cpu_count() or 1)
    return {"device": device, "threads": threads, **harness.environment(threads)}


def run_model(context, run: Run, methods: list[Method], args, workdir: Path) -> dict | None:
    print(f"== {run.model} model: preparing", flush=True)
    began = time.perf_counter()
    prepared = call_in_fork(
        context,
        "compare",
        "prepare_model_dir",
        run=run,
        workdir=workdir,
        device=args.device,
        smoke=args.mode == "smoke",
        threads=args.threads,
    )
    if prepared is None:
        return None
    base_job = {
        **prepared,
        "model": run.model,
        "device": args.device,
        "threads": args.threads,
        "steps": run.steps,
        "recompute": args.recompute,
        "exercise": args.mode != "smoke",
        "worker": "compare:Worker",
    }
    print(f"  prepared ({time.perf_counter() - began:.0f} s)", flush=True)
    methods = [m for m in methods if run.model == "demo" or not m.demo_only]
    jobs = {
        m.key: {**base_job, "method": m.key, "log": str(workdir / f"{run.model}-{m.key}.log")}
        for m in methods
    }
    pool = WorkerPool(context, jobs, parallel=args.parallel_start)
    per_round = [
        run.steps // run.rounds + (1 if i < run.steps % run.rounds else 0) for i in range(run.rounds)
    ]
    started = time.perf_counter()
    for index, count in enumerate(per_round):
        pool.round(index, "run_steps", count=count)
        print(f"  round {index + 1}/{run.rounds} done ({time.perf_counter() - started:.0f} s)", flush=True)
        if index + 1 in run.accuracy_after_rounds and prepared["eval_records"]:
            pool.broadcast("accuracy", args.parallel_start)
            print(f"  accuracy after {sum(per_round[: index + 1])} steps taken", flush=True)
    results = pool.finish(args.parallel_start)
    print(
        f"  finished: held-out loss{' and accuracy' if prepared['eval_records'] else ''} "
        f"({time.perf_counter() - started:.0f} s)",
        flush=True,
    )
    rows = {key: summarize(BY_KEY[key], results[key], run.warmup) for key in results}
    add_relative(rows)
    return {
        "run": asdict(run),
        "model": prepared["config"],
        "params": next((r["total_params"] for r in results.values()), None),
        "tokens_per_step": prepared["tokens_per_step"],
        "dtype": prepared["dtype"],
        "methods": rows,
        "errors": pool.errors,
    }


def _stats(times: list[float]) -> dict:
    if not times:
        return {}
    ordered = sorted(times)
    quartile = statistics.quantiles(ordered, n=4) if len(ordered) >= 2 else [ordered[0]] * 3
    return {
        "median_s": statistics.median(ordered),
        "q1_s": quartile[0],
        "q3_s": quartile[2],
        "min_s": ordered[0],
        "max_s": ordered[-1],
        "runs": len(ordered),
    }


def summarize(method: Method, result: dict, warmup: int) -> dict:
    steps = result["step_times_s"][warmup:] or result["step_times_s"]
    forwards = result["forward_times_s"][warmup:] or result["forward_times_s"]
    row = {
        "label": method.label,
        "kind": method.kind,
        "quant": method.quant,
        "quant_format": result["quant_format"],
        "granularity": method.granularity if method.kind == "usaf" else None,
        "router": method.router if method.kind == "usaf" else None,
        "lr": method.lr if method.trains else None,
        "step": _stats(steps),
        "forward": _stats(forwards),
        **{
            k: result[k]
            for k in (
                "trainable_params",
                "total_params",
                "peak_bytes",
                "tensor_peak_bytes",
                "load_peak_bytes",
                "setup_s",
                "eval_loss",
                "accuracy",
                "accuracy_curve",
                "train_losses",
                "step_times_s",
                "forward_times_s",
            )
        },
    }
    if steps:
        # per step, over the same batch: the ratio is measured side by side in one process
        row["step_over_own_forward"] = statistics.median(s / f for s, f in zip(steps, forwards, strict=True))
        row["final_train_loss"] = result["train_losses"][-1]
    return row


def add_relative(rows: dict) -> None:
    """Ratios against the inference row of the same quantization and against LoRA."""
    for row in rows.values():
        reference = rows.get("inference-nf4" if row["quant"] == "nf4" else "inference")
        if reference and row["step"] and reference["forward"]:
            row["step_over_inference_forward"] = row["step"]["median_s"] / reference["forward"]["median_s"]
        if reference and row["kind"] != "inference" and reference["peak_bytes"] > 0:
            row["train_over_inference_memory"] = row["peak_bytes"] / reference["peak_bytes"]
        lora = rows.get("lora-r16")
        if lora and row["step"] and lora["step"]:
            row["step_over_lora"] = row["step"]["median_s"] / lora["step"]["median_s"]
        if lora and lora["peak_bytes"] > 0:
            row["memory_over_lora"] = row["peak_bytes"] / lora["peak_bytes"]
        if reference and row["kind"] != "inference" and reference.get("tensor_peak_bytes"):
            row["train_over_inference_tensors"] = row["tensor_peak_bytes"] / reference["tensor_peak_bytes"]
        if lora and lora.get("tensor_peak_bytes") and row.get("tensor_peak_bytes"):
            row["tensors_over_lora"] = row["tensor_peak_bytes"] / lora["tensor_peak_bytes"]


# ---- targets, tables, chart -----------------------------------------------------------------------------------


def targets(models: dict) -> list[dict]:
    """The issue's four targets, per model where they apply."""
    out = []

    def add(name, model, value, bound, comparison, detail):
        met = None if value is None else (value <= bound if comparison == "<=" else value >= bound)
        out.append(
            {
                "target": name,
                "model": model,
                "value": value,
                "bound": bound,
                "comparison": comparison,
                "met": met,
                "detail": detail,
            }
        )

    for model, data in models.items():
        rows = data["methods"]
        usaf_fp, usaf_nf4, lora = rows.get("usaf-element"), rows.get("usaf-nf4-element"), rows.get("lora-r16")
        if usaf_fp and lora and usaf_fp["step"] and lora["step"]:
            add(
                "usaf unquantized step <= 1.0x PEFT LoRA step",
                model,
                usaf_fp["step_over_lora"],
                1.0,
                "<=",
                f"{_ms(usaf_fp['step'])} vs {_ms(lora['step'])} ms",
            )
        if usaf_fp and "step_over_inference_forward" in usaf_fp:
            add(
                "usaf step <= 2.3x forward-only (inference) time",
                model,
                usaf_fp["step_over_inference_forward"],
                2.3,
                "<=",
                f"{_ms(usaf_fp['step'])} vs {_ms(rows['inference']['forward'])} ms; step ÷ own no-grad "
                f"forward {usaf_fp['step_over_own_forward']:.2f}x",
            )
        if usaf_nf4 and lora:
            add(
                "usaf nf4 peak memory <= 0.5x PEFT LoRA's",
                model,
                usaf_nf4["memory_over_lora"],
                0.5,
                "<=",
                f"{_mb(usaf_nf4['peak_bytes'])} vs {_mb(lora['peak_bytes'])} MB",
            )
        if usaf_nf4 and "train_over_inference_memory" in usaf_nf4:
            add(
                "usaf nf4 train ÷ inference memory <= 1.3",
                model,
                usaf_nf4["train_over_inference_memory"],
                1.3,
                "<=",
                f"{_mb(usaf_nf4['peak_bytes'])} vs {_mb(rows['inference-nf4']['peak_bytes'])} MB",
            )
        if usaf_nf4 and "tensors_over_lora" in usaf_nf4:
            add(
                "usaf nf4 peak memory <= 0.5x PEFT LoRA's (live tensors)",
                model,
                usaf_nf4["tensors_over_lora"],
                0.5,
                "<=",
                f"{_mb(usaf_nf4['tensor_peak_bytes'])} vs {_mb(lora['tensor_peak_bytes'])} MB",
            )
        if usaf_nf4 and "train_over_inference_tensors" in usaf_nf4:
            add(
                "usaf nf4 train ÷ inference memory <= 1.3 (live tensors)",
                model,
                usaf_nf4["train_over_inference_tensors"],
                1.3,
                "<=",
                f"{_mb(usaf_nf4['tensor_peak_bytes'])} vs {_mb(rows['inference-nf4']['tensor_peak_bytes'])} MB",
            )
        if usaf_fp and lora and usaf_fp["accuracy"] is not None and lora["accuracy"] is not None:
            add(
                "demo accuracy after N steps >= PEFT LoRA's",
                model,
                usaf_fp["accuracy"],
                lora["accuracy"],
                ">=",
                f"after {data['run']['steps']} steps; usaf nf4 {rows.get('usaf-nf4-element', {}).get('accuracy')}",
            )
    return out


def _ms(stats: dict) -> str:
    return f"{stats['median_s'] * 1000:.0f}" if stats else "–"


def _mb(value) -> str:
    return f"{value / 2**20:.0f}" if value is not None else "–"


def _curve(row: dict) -> str:
    """Accuracy along the run: "a @ s1 → b @ s2"; the last point is after all steps."""
    points = row.get("accuracy_curve") or []
    if not points:
        return "–"
    return " → ".join(f"{p['accuracy']:.1%}" for p in points)


def markdown(payload: dict) -> str:
    m = payload["machine"]
    lines = [
        f"# usaf against PEFT LoRA, full fine-tuning and inference ({m['date']})",
        "",
        f"Device {payload['device']} ({m['cuda'] or m['processor']}), {m['cpus']} CPUs, {payload['threads']} torch "
        f"threads; torch {m['torch']}, transformers {m['transformers']}, peft {payload['versions']['peft']}, "
        f"bitsandbytes {payload['versions']['bitsandbytes']}. Mode: {payload['mode']}. Recomputation: "
        f"{'on' if payload['recompute'] else 'off'} for every training method. AdamW, clip 1.0, warm-up + cosine.",
        "",
        "Each method ran in its own process; all processes trained in interleaved rounds (a rotated order each "
        "round), and each timed a forward-only pass after each step on the same batch. Step and forward times are "
        "medians over the steps after warm-up, with the interquartile range. Peak memory: "
        + (
            "the allocator's peak (max_memory_allocated)"
            if payload["device"] != "cpu"
            else "peak RSS above the process's post-import baseline, from after loading to the end of training; "
            "live-tensor peak: the bytes of live tensors at their highest during one more step (what a GPU "
            "allocator's peak counts; RSS adds the C allocator's and oneDNN's caches)"
        )
        + ". Train ÷ inference memory: against the inference row of the same quantization.",
        "",
    ]
    for name, data in payload["models"].items():
        if data is None:
            lines += [f"## {name} model: skipped (assets not found)", ""]
            continue
        cfg, run = data["model"], data["run"]
        steps_seen = sorted(
            {p["step"] for r in data["methods"].values() for p in r.get("accuracy_curve") or []}
        )
        accuracy_steps = f" after {' → '.join(map(str, steps_seen))} steps" if steps_seen else ""
        lines += [
            f"## {name} model: {cfg['model_type']}, {params_label(data['params'])} parameters, {cfg['num_hidden_layers']} "
            f"layers, {cfg['num_experts']} experts top-{cfg['num_experts_per_tok']}, hidden {cfg['hidden_size']}, "
            f"expert width {cfg['moe_intermediate_size']}, vocab {cfg['vocab_size']}; {data['dtype']}; "
            f"{data['tokens_per_step']} tokens per step, {run['steps']} steps in {run['rounds']} rounds "
            f"({run['warmup']} warm-up steps not timed)",
            "",
        ]
        rows = []
        for row in data["methods"].values():
            step = row["step"]
            step_text = f"{_ms(step)} ({step['q1_s'] * 1000:.0f}–{step['q3_s'] * 1000:.0f})" if step else "–"
            label = row["label"] + (
                f" [{row['quant_format']}]" if row["quant_format"] not in (None, "nf4") else ""
            )
            rows.append(
                [
                    label,
                    fmt(row["lr"], "{:g}"),
                    params_label(row["trainable_params"]),
                    step_text,
                    _ms(row["forward"]),
                    fmt(row.get("step_over_own_forward")),
                    fmt(row.get("step_over_inference_forward")),
                    fmt(row.get("step_over_lora")),
                    _mb(row["peak_bytes"]),
                    fmt(row.get("memory_over_lora")),
                    fmt(row.get("train_over_inference_memory")),
                    _mb(row.get("tensor_peak_bytes")),
                    fmt(row.get("train_over_inference_tensors")),
                    f"{row['eval_loss']:.3f}",
                    _curve(row),
                ]
            )
        for key, error in data["errors"].items():
            rows.append([BY_KEY[key].label, f"FAILED: {error.strip().splitlines()[-1][:120]}"])
        header = [
            "method",
            "lr",
            "trainable",
            "step ms (IQR)",
            "forward ms",
            "step ÷ own fwd",
            "step ÷ inference fwd",
            "step ÷ LoRA",
            "peak MB",
            "÷ LoRA",
            "train ÷ inference mem",
            "live-tensor peak MB",
            "train ÷ inference, live tensors",
            "held-out loss",
            f"accuracy{accuracy_steps}",
        ]
        lines += table(header, rows, align="ll" + "r" * 13)
        lines.append("")
    rows = []
    for t in payload["targets"]:
        verdict = "–" if t["met"] is None else ("met" if t["met"] else "MISSED")
        bound = (
            f"{t['comparison']} {t['bound']:.2f}"
            if t["target"].startswith("demo")
            else f"{t['comparison']} {t['bound']}"
        )
        rows.append([t["target"], t["model"], fmt(t["value"]), bound, verdict, t["detail"]])
    lines += [
        "## Targets",
        "",
        *table(["target", "model", "measured", "bound", "verdict", "detail"], rows, "llrr"),
    ]
    lines.append("")
    return "\n".join(lines)


def chart(payload: dict, path: Path) -> None:
    models = {k: v for k, v in payload["models"].items() if v}
    fig, axes = subplots(len(models), 3, figsize=(18, 4.6 * len(models)))
    for row_axes, (name, data) in zip(axes, models.items(), strict=True):
        rows = data["methods"]
        labels = [rows[k]["label"] for k in rows]
        y = list(range(len(labels)))
        colors = [
            "tab:green" if r["kind"] == "usaf" else "tab:gray" if r["kind"] == "inference" else "tab:blue"
            for r in rows.values()
        ]
        ax = row_axes[0]
        step = [r["step"]["median_s"] * 1000 if r["step"] else 0 for r in rows.values()]
        fwd = [r["forward"]["median_s"] * 1000 if r["forward"] else 0 for r in rows.values()]
        ax.barh(y, step, color=colors, label="train step")
        ax.barh(y, fwd, color="none", edgecolor="black", hatch="//", label="forward only (same process)")
        ax.set_title(f"{name}: median time per step (ms)")
        ax.legend(loc="lower right", fontsize=8)
        ax = row_axes[1]
        ax.barh(y, [r["peak_bytes"] / 2**20 for r in rows.values()], color=colors)
        ax.set_title(f"{name}: peak memory (MB)")
        ax = row_axes[2]
        if any(r["accuracy"] is not None for r in rows.values()):
            ax.barh(y, [(r["accuracy"] or 0) * 100 for r in rows.values()], color=colors)
            ax.set_title(f"{name}: demo task accuracy after {data['run']['steps']} steps (%)")
        else:
            ax.barh(y, [r["eval_loss"] for r in rows.values()], color=colors)
            ax.set_title(f"{name}: held-out loss after {data['run']['steps']} steps")
        for ax in row_axes:
            ax.set_yticks(y)
            ax.set_yticklabels(labels if ax is row_axes[0] else [], fontsize=8)
            ax.invert_yaxis()
            ax.grid(axis="x", alpha=0.3)
    fig.suptitle(
        f"usaf vs PEFT LoRA / full FT / inference — {payload['device']}, {payload['machine']['date']}"
    )
    save_figure(fig, path)


def write_outputs(payload: dict, out_dir: Path, stem: str) -> list[Path]:
    paths = write_results(stem, payload, markdown(payload), out_dir=out_dir)
    png = paths[0].with_suffix(".png")
    chart(payload, png)
    return [*paths, png]


def print_targets(payload: dict) -> None:
    print("\nTargets (issue 7):")
    for t in payload["targets"]:
        verdict = "n/a" if t["met"] is None else ("met" if t["met"] else "MISSED")
        print(
            f"  [{verdict:>6}] {t['target']} ({t['model']}): {fmt(t['value'])} (bound {t['comparison']} "
            f"{t['bound']:.2f}) — {t['detail']}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--quick", action="store_const", dest="mode", const="quick", help="a fast run (~5 min CPU)"
    )
    mode.add_argument("--smoke", action="store_const", dest="mode", const="smoke", help="tiny shapes (tests)")
    parser.set_defaults(mode="full")
    parser.add_argument("--device", default="auto", help="cpu, cuda (ROCm too), or auto")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for compare-<date>.{md,json,png}")
    parser.add_argument("--models", default="demo,random", help="comma-separated: demo, random")
    parser.add_argument(
        "--methods", default=",".join(m.key for m in METHODS), help="comma-separated method keys"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads per process (default: 1 on CPU)"
    )
    parser.add_argument("--recompute", action="store_true", help="per-layer recomputation for every method")
    parser.add_argument("--steps", type=int, default=None, help="override the steps of every model")
    parser.add_argument("--workdir", type=Path, default=None, help="keep models, stores and logs here")
    parser.add_argument(
        "--parallel-start",
        type=int,
        default=os.cpu_count() or 1,
        help="methods' processes set up at once (default: one per CPU)",
    )
    args = parser.parse_args(argv)

    methods = [BY_KEY[k] for k in args.methods.split(",")]
    stem = "compare" if args.mode == "full" else f"compare-{args.mode}"

    import multiprocessing as mp

    context = mp.get_context("forkserver")
    # imported once by the server; each method's process is a fork of it (no import cost, nothing computed yet)
    context.set_forkserver_preload(
        ["torch", "transformers", "peft", "usaf", "usaf.base.load", "usaf.demo.task"]
    )
    started = time.perf_counter()
    env = call_in_fork(context, "compare", "environment", device=args.device, threads=args.threads)
    print(
        f"device {env['device']}, {env['threads']} torch thread(s) per process "
        f"({time.perf_counter() - started:.0f} s to start)",
        flush=True,
    )
    args.device, args.threads = env["device"], env["threads"]
    runs = [r for r in runs_for(args.mode, args.device) if r.model in args.models.split(",")]
    if args.steps:
        for r in runs:
            r.steps, r.rounds = args.steps, min(r.rounds, args.steps)
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="usaf-compare-"))
        )
        workdir.mkdir(parents=True, exist_ok=True)
        models = {}
        for run in runs:
            models[run.model] = run_model(context, run, methods, args, workdir)
            gc.collect()
        payload = {
            "machine": env["machine"],
            "versions": env["versions"],
            "device": args.device,
            "threads": args.threads,
            "mode": args.mode,
            "recompute": args.recompute,
            "learning_rates": LEARNING_RATES,
            "densities": {"element": ELEMENT_DENSITY, "neuron": NEURON_DENSITY},
            "lora": {
                "r": LORA_RANK,
                "alpha": LORA_ALPHA,
                "target_modules": LORA_ATTENTION,
                "target_parameters": LORA_EXPERTS,
            },
            "wall_s": None,
            "models": models,
        }
        payload["targets"] = targets({k: v for k, v in models.items() if v})
        payload["wall_s"] = time.perf_counter() - started
        paths = write_outputs(payload, args.out, stem)
    print(markdown(payload))
    print_targets(payload)
    print(f"\nwrote {', '.join(str(p) for p in paths)} in {payload['wall_s']:.0f} s")
    failed = any(v and v["errors"] for v in models.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
