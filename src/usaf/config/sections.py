"""The sections of a `usaf train` run beside `select` (usaf.config.select): model, router, optim, schedule, data,
checkpoint, log and train."""

from __future__ import annotations

from dataclasses import dataclass

from usaf.config.cards import CARDS
from usaf.config.options import (
    AUTO,
    DEFAULT_LOGITS_CHUNK,
    GUARD_ACTIONS,
    RESIDENCIES,
    SCHEDULES,
    TOKENS_MOST,
    Auto,
    option,
)
from usaf.config.section import Section
from usaf.config.values import parse_size
from usaf.errors import ConfigError
from usaf.quant import FORMATS
from usaf.registry import OBJECTIVES, TRACKERS


def parse_weights(weights: list) -> None:
    """data.weights: positive numbers (their sum need not be 1: they are normalized); a list option's items
    arrive as text."""
    try:
        positive = all(float(w) > 0 for w in weights)
    except (TypeError, ValueError):
        positive = False
    if not positive:
        raise ConfigError(f"the weights must be positive numbers, e.g. [0.7, 0.3], got {weights!r}")


def parse_numbers(values: list) -> None:
    """train.reward_weights: numbers, any sign (as TRL's); a list option's items arrive as text."""
    try:
        [float(v) for v in values]
    except (TypeError, ValueError):
        raise ConfigError(f"the weights must be numbers, e.g. [1.0, 0.5], got {values!r}") from None


@dataclass(frozen=True)
class ModelSection(Section):
    NAME = "model"

    path: str = option(
        "", "model directory, prepared store, or hub id (the hub needs the network)", path=True
    )
    dtype: str = option("auto", "weights and compute dtype", ("auto", "float32", "bfloat16", "float16"))
    # a live view of the registry: a format registered later (usaf.quant.register_format) is a choice too. The
    # three autos are resolved by the memory plan against the card, in this order (usaf.planner.storage): the least
    # lossy storage that fits, then where it lives, then (after the density) the expert cache
    quant: str = option(
        "auto",
        "frozen expert storage; auto: the least lossy that fits the card (none, int8, nf4, ...; a published "
        "MXFP4/FP8 checkpoint keeps its own)",
        FORMATS.choices("auto"),
    )
    residency: str = option(
        "auto",
        "where frozen experts live; auto: the device if they fit, else pinned host memory, else memory-mapped",
        ("auto", *RESIDENCIES),
    )
    cache_mb: int | Auto = option(
        AUTO,
        "with residency host/mmap: device memory (MB) keeping the most-routed experts resident; auto: what the "
        "plan leaves free on the card",
        bounds="[0, inf)",
        most=1 << 30,
    )
    device: str = option("auto", "compute device: auto, cpu, cuda, cuda:1, mps, xpu ...")

    @property
    def storage_is_auto(self) -> bool:
        """Whether a memory plan still has to choose the experts' storage, residency or cache."""
        return "auto" in (self.quant, self.residency) or self.cache_mb is AUTO

    # what the autos read as where no memory plan resolved them (a library caller's section): the model as
    # transformers loads it, on the device
    @property
    def fixed_quant(self) -> str:
        return "none" if self.quant == "auto" else self.quant

    @property
    def fixed_residency(self) -> str:
        return "device" if self.residency == "auto" else self.residency

    @property
    def fixed_cache_mb(self) -> int:
        return 0 if self.cache_mb is AUTO else self.cache_mb


@dataclass(frozen=True)
class RouterSection(Section):
    NAME = "router"

    lr_multiplier: float = option(
        0.1, "router learning rate = optim.lr x this (with routers in select.targets)"
    )
    freeze_steps: int = option(0, "keep routers frozen for the first N optimizer steps")
    balance_coef: float = option(0.01, "Switch load-balancing loss coefficient, raw router logits (0: off)")
    z_coef: float = option(0.001, "router z-loss coefficient (0: off)")
    health_every_steps: int = option(
        10, "router health (loads, cv, entropy, dead, drift) every N steps (0: off)"
    )
    health_window_steps: int = option(
        20, "steps of routed tokens the load statistics cover", bounds="[1, inf)"
    )
    guard_max_cv: float = option(2.0, "collapse guard: max coefficient of variation of layer loads (0: off)")
    guard_min_entropy: float = option(
        0.5, "collapse guard: min normalised entropy of layer loads (0: off)", bounds="[0, 1]"
    )
    guard_max_dead_share: float = option(
        0.5, "collapse guard: max share of experts without tokens (1: off)", bounds="[0, 1]"
    )
    guard_action: str = option("warn", "collapse guard action", GUARD_ACTIONS)
    guard_balance_cap: float = option(0.1, "raise_balance doubles balance_coef up to this")


@dataclass(frozen=True)
class OptimSection(Section):
    NAME = "optim"

    # lr > 0: a zero or negative rate would silently not train, or climb the loss
    lr: float | Auto = option(
        AUTO,
        "peak learning rate of trained values (sparse entries move far from few), or auto: the objective's own "
        "(1e-2; dpo 3e-3), written as a number into the run's config.yaml",
        bounds="(0, inf)",
    )
    weight_decay: float = option(0.0, "AdamW decoupled weight decay (towards zero, applied to values)")
    # 8, not 4 (issue 26's choice): on the arithmetic shift 4 forgot 0.181 nats apart across seeds and one seed lay
    # behind full fine-tuning's frontier; 8 forgets far less there (0.057 apart, every seed past; 0.020 with 64 k
    # calibration tokens) and lies further past the frontier on the man pages, adapting less at the same rate
    # (bench/results/quality-cal32k-2026-12-06*, quality-decay4-*)
    decay_to_base: float = option(
        8.0,
        "decoupled decay of each trained value toward its base value, value -= lr x this x (value - base): "
        "forgets less of what the model knew (a quantized base's are read once into host memory; 0: off)",
    )
    beta1: float = option(0.9, "AdamW beta1", bounds="[0, 1)")
    beta2: float = option(0.999, "AdamW beta2", bounds="[0, 1)")
    eps: float = option(1e-8, "AdamW epsilon", bounds="(0, inf)")
    moments: str = option(
        "bf16",
        "how AdamW keeps the trained values' moments: bf16 with stochastic rounding (4 B an entry) or fp32 (8 B)",
        choices=("bf16", "fp32"),
    )
    eight_bit: bool = option(False, "8-bit optimizer state via bitsandbytes (where it has kernels)")
    clip_grad_norm: float = option(1.0, "clip the global gradient norm to this (0: off)")


@dataclass(frozen=True)
class ScheduleSection(Section):
    NAME = "schedule"

    # at least one step: a run of zero steps would look finished without having trained
    max_steps: int = option(100, "optimizer steps to run", bounds="[1, inf)")
    name: str = option(
        "cosine",
        "learning-rate schedule after the warm-up: cosine (down to min_lr_ratio; usaf's default), or one of "
        "transformers' get_scheduler: linear, constant_with_warmup, cosine_with_min_lr, warmup_stable_decay",
        choices=SCHEDULES,
    )
    warmup_steps: int = option(10, "linear warm-up steps (0: none)")
    warmup_ratio: float = option(
        0.0, "warm-up as a share of max_steps, rounded up; above 0 it replaces warmup_steps", bounds="[0, 1)"
    )
    min_lr_ratio: float = option(
        0.1,
        "final learning rate as a share of the peak (cosine, cosine_with_min_lr, warmup_stable_decay)",
        bounds="[0, 1]",
    )
    decay_ratio: float = option(
        0.1, "warmup_stable_decay: the share of max_steps that decays at the end", bounds="[0, 1]"
    )
    grad_accum: int = option(1, "micro-batches per optimizer step", bounds="[1, inf)")
    epochs: float = option(
        0.0,
        "passes over the training data; above 0 it sets max_steps from the data and the global batch (said on the "
        "first lines)",
    )
    # as transformers' EarlyStoppingCallback (early_stopping_patience, early_stopping_threshold), on the metric of
    # checkpoint.best_metric
    early_stopping_patience: int = option(
        0,
        "stop when checkpoint.best_metric did not improve for N evaluations in a row (0: off); needs evaluations "
        "during training (log.eval_every_steps) on held-out data",
    )
    early_stopping_threshold: float = option(
        0.0, "how much an evaluation must beat the best so far to count as an improvement for early stopping"
    )


@dataclass(frozen=True)
class DataSection(Section):
    NAME = "data"

    train: list = option(
        [],
        "training data: files (jsonl, json, csv, tsv, parquet, arrow, txt, md; also .gz/.bz2/.xz/.zst), "
        "datasets save_to_disk folders or hub dataset ids (downloaded by datasets when not cached; NAME:SPLIT picks a "
        "split); "
        "records: text, messages (OpenAI or sharegpt), prompt/completion (plain or conversational), "
        "prompt/chosen/rejected, alpaca instruction/input/output, input_ids",
        path=True,
    )
    eval: list = option(
        [], "held-out data (as train); empty: split eval_fraction off the training data", path=True
    )
    # two tokens at least: a causal LM learns from next-token pairs
    max_seq_len: int = option(
        512,
        "tokens per sequence; longer records are split into windows or truncated (long_documents), and counted",
        bounds="[2, inf)",
        most=TOKENS_MOST,
    )
    pack: bool = option(True, "pack short records into full sequences (no attention across records)")
    batch_size: int = option(4, "sequences per micro-batch", bounds="[1, inf)", most=TOKENS_MOST)
    eval_fraction: float = option(
        0.05, "share of training records held out when no eval file is given (0: none)", bounds="[0, 1)"
    )
    eval_batches: int = option(0, "batches per evaluation (0: all)")
    split: str = option("train", "split of a save_to_disk DatasetDict or a hub dataset")
    columns: dict = option(
        {}, "usaf record keys from other column names, e.g. {prompt: question, completion: answer}"
    )
    long_documents: str = option(
        "split",
        "records longer than max_seq_len: split text and input_ids records into windows, or truncate them "
        "(chat and prompt/completion records are always truncated)",
        ("split", "truncate"),
    )
    stride: int = option(
        0,
        "tokens a window repeats from the one before as context (at least 1; never supervised twice)",
        most=TOKENS_MOST,
    )
    num_proc: int = option(0, "processes that tokenize (0: one; the result is cached either way)", most=1024)
    skip_bad_records: bool = option(False, "skip malformed records (and report how many) instead of failing")
    chat_template: str = option(
        "",
        "chat template of 'messages' records: a .jinja file or a name of TRL's templates (qwen3, llama3, chatml, "
        "...); empty: the tokenizer's own (TRL's training variant of it when it has no generation markers)",
        path=True,
    )
    # intake like the peers' (issue 38): hub downloads through datasets, mixing weights, streaming, alpaca as chat
    alpaca_format: str = option(
        "auto",
        "alpaca records (instruction/input/output): chat renders them through the chat template as a user turn "
        "(instruction and input) and a supervised assistant reply, as LLaMA-Factory does; plain keeps them as "
        "text (the parts apart by blank lines); auto: chat when the tokenizer (or data.chat_template) has a template",
        ("auto", "chat", "plain"),
    )
    weights: list = option(
        [],
        "mixing weights of the data.train entries, in order (as LLaMA-Factory's interleave_probs): records are "
        "drawn from the sources with these probabilities, seeded by train.seed (datasets.interleave_datasets); "
        "empty: every record of every source, in order",
        parse=parse_weights,
    )
    mix_stopping: str = option(
        "first_exhausted",
        "with data.weights: stop when the first source runs out (first_exhausted), or when every source has been "
        "used whole at least once, the others repeating (all_exhausted)",
        ("first_exhausted", "all_exhausted"),
    )
    streaming: bool = option(
        False,
        "read data.train as a datasets IterableDataset and tokenize it on the fly (bounded memory and disk: no "
        "cache, no packing, no shuffling: records in source order or the weighted mix, no eval split (give data.eval); set schedule.max_steps)",
    )


@dataclass(frozen=True)
class CheckpointSection(Section):
    NAME = "checkpoint"

    every_steps: int = option(
        50,
        "save a checkpoint every N optimizer steps (0: off; the last step and SIGINT/SIGTERM always save)",
    )
    keep_last: int = option(2, "checkpoints to keep (0: all)")
    # as transformers' load_best_model_at_end / metric_for_best_model / greater_is_better
    keep_best: bool = option(
        False,
        "also keep the checkpoint of the best evaluation (best_metric), beside the newest keep_last: "
        "`usaf export RUN --best` exports it; needs evaluations during training (log.eval_every_steps)",
    )
    best_metric: str = option(
        "loss",
        "the evaluation's number that ranks checkpoints (keep_best) and early stopping, as metrics.jsonl's eval/ "
        "keys name it: loss, perplexity; DPO: margin, accuracy",
    )
    greater_is_better: str | bool = option(
        "auto",
        "whether a larger best_metric is better; auto: false for a loss or perplexity",
        ("auto", True, False),
    )


@dataclass(frozen=True)
class DistributedSection(Section):
    NAME = "distributed"

    expert_parallel: int = option(
        1,
        "under torchrun: ranks that split every MoE layer's experts among them (1: data parallel only); the world "
        "size is expert_parallel x the data-parallel replicas, and expert_parallel must divide it and the experts",
        bounds="[1, inf)",
        most=4096,
    )
    shard_dense: str | bool = option(
        "auto",
        "under torchrun: shard the frozen dense weights (attention, norms, embeddings, lm_head, shared experts) over "
        "the ranks with FSDP2, trained entries and routers staying whole on every rank; auto: on exactly when the "
        "planner says the dense weights whole on every rank do not fit train.memory_limit (else the device)",
        ("auto", True, False),
    )
    timeout_s: float = option(
        600.0,
        "under torchrun: seconds a collective waits for the other ranks before it fails and stops the job (a rank "
        "that died or hangs); above the longest a rank may wait for another, e.g. rank 0 writing a checkpoint",
        bounds="(0, inf)",
    )


@dataclass(frozen=True)
class LogSection(Section):
    NAME = "log"

    every_steps: int = option(1, "write metrics every N steps (0: off; evaluations are still written)")
    eval_every_steps: int = option(0, "evaluate every N steps (0: only before and after)")
    progress: bool = option(True, "live progress bar")
    report_to: list = option(
        ["tensorboard"],
        "experiment trackers, as transformers' report_to: tensorboard, wandb, mlflow, or any other that "
        "accelerate.tracking knows or that is registered (each given the scalars of metrics.jsonl and the run's "
        "configuration), or none; a tracker that is not installed is an error at start",
        # each name a registered tracker's (usaf.train.trackers registers the built-ins), [] allowed, order kept
        parse=TRACKERS.choices("none").check,
    )
    tensorboard: bool = option(True, "false leaves tensorboard out of report_to (the older switch for it)")


@dataclass(frozen=True)
class TrainSection(Section):
    NAME = "train"

    seed: int = option(
        0,
        "seed of the data order, the eval split, calibration batches, the optimizer's stochastic rounding and "
        "torch's RNG (select.seed seeds a random selection)",
    )
    precision: str = option("auto", "autocast dtype", ("auto", "none", "bf16", "fp16"))
    recompute: str | bool = option(
        "auto",
        "per-layer recomputation (activation checkpointing); auto: on exactly when the planner's ledger says the "
        "activations without it would not fit train.memory_limit",
        ("auto", True, False),
    )
    memory_limit: str = option(
        "",
        "memory recompute=auto plans against, e.g. 12GB (empty: the GPU's memory, or the machine's RAM on CPU)",
        parse=lambda text: parse_size(text),  # "lots" fails when the config is read, not when planned
    )
    card: str = option(
        "",
        "the card the run is planned for (the autos: storage, residency, cache, density, workspace, recompute; usaf "
        "plan reads it too): its memory "
        "(train.memory_limit overrides it) and its speed figures; empty: the device the run computes on",
        ("", *CARDS),
    )
    max_bad_steps: int = option(10, "stop after this many steps with NaN/Inf loss or gradients")
    logits_chunk_tokens: int = option(
        DEFAULT_LOGITS_CHUNK,
        "tokens per chunk of the output layer in the loss",
        bounds="[1, inf)",
        most=TOKENS_MOST,
    )
    prefix_cache: str = option(
        "off", "cache hidden states entering the lowest trained layer", ("off", "ram", "disk")
    )
    objective: str = option(
        "sft",
        "sft: next-token loss on the supervised tokens; dpo: preference tuning on prompt/chosen/rejected pairs, the "
        "base itself the reference (no second model: one extra forward without gradients); orpo, simpo: TRL's "
        "ORPO and SimPO on the same pairs, no reference; kto: TRL's KTO on prompt/completion/label records (or "
        "pairs unpaired: chosen desirable, rejected not), the base itself the reference; grpo: completions "
        "of {prompt} records generated and scored by train.reward_functions",
        OBJECTIVES.choices(),
    )
    dpo_beta: float = option(
        0.1, "dpo: the strength of the pull toward the reference (DPO's beta)", bounds="(0, inf)"
    )
    # grpo (usaf.train.grpo): the names and defaults of TRL's GRPOConfig, but for max_completion_length (512)
    reward_functions: list = option(
        [],
        "grpo: reward functions by import path, module:function, each called as TRL calls them: "
        "fn(prompts=..., completions=..., completion_ids=..., **the records' other columns) -> list of floats",
    )
    reward_weights: list = option(
        [], "grpo: a weight per reward function (empty: 1 each)", parse=parse_numbers
    )
    num_generations: int = option(
        8, "grpo: completions generated per prompt (a group: its rewards are compared)", bounds="[2, inf)"
    )
    max_completion_length: int = option(
        256,
        "grpo: the most tokens a completion gets (less where the model's context ends)",
        bounds="[1, inf)",
    )
    temperature: float = option(1.0, "grpo: sampling temperature of the completions", bounds="(0, inf)")
    grpo_beta: float = option(
        0.0,
        "grpo: the KL penalty toward the reference, the base itself (TRL's beta; 0: no reference forward)",
        bounds="[0, inf)",
    )
    # each objective's own settings, named and defaulted as TRL's configs name them (ORPOConfig, CPOConfig, KTOConfig)
    orpo_beta: float = option(
        0.1,
        "orpo: the weight of the odds-ratio term against the NLL term (ORPOConfig.beta)",
        bounds="(0, inf)",
    )
    simpo_beta: float = option(
        0.1, "simpo: the scale of the reward margin (CPOConfig.beta)", bounds="(0, inf)"
    )
    simpo_gamma: float = option(
        0.5, "simpo: the target reward margin (CPOConfig.simpo_gamma)", bounds="[0, inf)"
    )
    cpo_alpha: float = option(
        1.0,
        "simpo: the weight of the chosen answers' NLL term, 0 for pure SimPO (CPOConfig.cpo_alpha)",
        bounds="[0, inf)",
    )
    kto_beta: float = option(
        0.1, "kto: the strength of the pull toward the reference (KTOConfig.beta)", bounds="(0, inf)"
    )
    kto_desirable_weight: float = option(
        1.0, "kto: the weight of the desirable rows' losses (KTOConfig.desirable_weight)", bounds="(0, inf)"
    )
    kto_undesirable_weight: float = option(
        1.0,
        "kto: the weight of the undesirable rows' losses (KTOConfig.undesirable_weight)",
        bounds="(0, inf)",
    )
    kernels: str = option(
        "auto",
        "the engine's gradient kernels: auto is Triton on CUDA/ROCm when Triton is installed, else PyTorch; triton "
        "insists (an error when it is not installed); torch never uses Triton",
        ("auto", "triton", "torch"),
    )
    distributed_backend: str = option(
        "auto",
        "torch.distributed backend under torchrun (WORLD_SIZE > 1): auto is nccl on CUDA/ROCm, gloo on CPU; "
        "$USAF_DISTRIBUTED_BACKEND overrides it",
        ("auto", "nccl", "gloo"),
    )
