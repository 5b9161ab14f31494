"""The engine's configuration: what to train and how to choose it."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Collection
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import ClassVar

from usaf.errors import UsafError, first_line
from usaf.quant import FORMATS
from usaf.registry import OBJECTIVES, SCORERS, TARGET_KINDS, Choices
from usaf.registry import STRATEGIES as STRATEGY_REGISTRY

RESIDENCIES = ("device", "host", "mmap")  # where a quantized base's experts live (see usaf.store.offload)
GUARD_ACTIONS = (
    "warn",
    "raise_balance",
    "freeze_router",
    "stop",
)  # see usaf.train.router_health.CollapseGuard

GRANULARITIES = ("element", "neuron")
# the plug-ins' registries (usaf.selection.strategies and .scorers register the built-ins; users may add theirs)
SELECTIONS = SCORERS.choices("auto")
STRATEGIES = STRATEGY_REGISTRY.choices()
# usaf's own cosine (its warm-up never starts at a rate of 0), then transformers' get_scheduler names
SCHEDULES = ("cosine", "linear", "constant_with_warmup", "cosine_with_min_lr", "warmup_stable_decay")
# which native weights may hold trained entries: the experts, the routers (trained whole), and the roles of
# weights beyond them that usaf.model.targets registers (attention, dense_mlp, norms, embeddings, lm_head)
TARGETS = TARGET_KINDS.choices("experts", "routers")
# chosen on bench/quality.py (README, "Fine-tunes against LoRA"): routers add forgetting, not adaptation
DEFAULT_TARGETS = ("experts", "attention", "embeddings", "lm_head")
RATIO_TARGETS = TARGET_KINDS.choices("experts")  # routers train whole: no density to weigh
# The defaults (select.density=auto, reselection every 10 steps, optim.lr 1e-2, optim.decay_to_base 4) are the best
# practical point of bench/quality.py (README, "Fine-tunes against LoRA"): at 2 % they lie ahead of full
# fine-tuning's frontier on the shift task; at 16 bytes an entry 1 % fits Qwen3-30B-A3B on a 12 GB card
# (`usaf plan --model qwen3-30b-a3b --vram 12GB --ram 32GB`), 2 % does not: auto takes what the card fits.
DEFAULT_DENSITY = 0.01  # what select.density=auto reads as where no memory plan resolves it (prepare_model)
# select.density=auto: usaf train takes the largest of these that its memory plan fits (quality rose with density
# up to here on bench/quality.py; each step down halves the trained entries' memory)
AUTO_DENSITIES = (0.02, 0.01, 0.005, 0.0025, 0.001)
DEFAULT_RESELECT_EVERY = 10
# 512 tokens x a 151 k vocabulary is 0.9 GB of logits (fp32 with their gradient): what keeps Qwen3-30B-A3B at 1 % with
# reselection's probe windows within 12 GB; the loss is the same for any chunk, and 512 rows still fill a GPU's matmul
DEFAULT_LOGITS_CHUNK = 512
# values the optimizer updates as one flat vector (at least two of the largest parameters): bounds the step's fp32
# temporaries, 16 B a value, while many parameters share a fixed number of ops (usaf.train.optim, the planner)
OPTIMIZER_BUCKET_ENTRIES = 1 << 24
DEFAULT_WORKSPACE_MB = 256  # select.workspace_mb: one projection's dequantized routed-expert workspace


# the largest integer any option takes (torch, numpy and the files' int64 fields hold no more); options whose size
# is memory or time declare a smaller `most`
INT_MOST = (1 << 63) - 1
# a sequence, a batch or a chunk of tokens this long is a typo, not a request: 1 Mi tokens (the longest contexts)
TOKENS_MOST = 1 << 20


NON_NEGATIVE = "[0, inf)"


def option(
    default,
    doc: str,
    choices: Collection | None = None,
    bounds: str | None = None,
    most: int | None = None,
    path: bool = False,
    parse=None,
):
    """A documented config field. `choices`: a tuple, or a registry's live `keys()`. `bounds`: an interval such as
    "(0, inf)" or "[0, 1)" (a square bracket includes the end; inf is never allowed); a number without bounds is
    NON_NEGATIVE. `most`: the largest integer allowed (INT_MOST for every integer option). All are enforced on load
    and shown by `--list-options`. `path`: a file or folder, whose `~` and `$VAR` are expanded as a shell would;
    `parse`: a function that reads the value (raising UsafError)."""
    factory = (lambda d=default: type(d)(d)) if isinstance(default, (list, dict)) else None
    if bounds is None and isinstance(default, (int, float)) and not isinstance(default, bool):
        bounds = NON_NEGATIVE
    if bounds is not None:
        _parse_bounds(bounds)  # a malformed spec fails at import, not when a user's value is checked
    meta = {"doc": doc, "choices": choices, "bounds": bounds, "most": most, "path": path, "parse": parse}
    return field(default_factory=factory, metadata=meta) if factory else field(default=default, metadata=meta)


def _parse_bounds(spec: str) -> tuple[float, float, bool, bool]:
    """Parse "[0, inf)" into (low, high, low included, high included)."""
    low, high = (float(part) for part in spec[1:-1].split(","))
    if spec[0] not in "[(" or spec[-1] not in "])":
        raise ValueError(f"bad bounds {spec!r}")
    return low, high, spec[0] == "[", spec[-1] == "]"


def bounds_text(spec: str) -> str:
    """How a range reads in messages: "> 0", ">= 1", "in [0, 1)"."""
    low, high, low_in, _ = _parse_bounds(spec)
    if high == float("inf"):
        shown = int(low) if low.is_integer() else low
        return f"{'>=' if low_in else '>'} {shown}"
    return f"in {spec}"


def check_bounds(value, spec: str | None, where: str) -> None:
    """Raise a UsafError naming `where` when a number lies outside `spec` (NaN and infinities never pass)."""
    if spec is None or value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    low, high, low_in, high_in = _parse_bounds(spec)
    above = low <= value if low_in else low < value
    below = value <= high if high_in else value < high
    if not (above and below and math.isfinite(value)):
        raise UsafError(f"{where} must be {bounds_text(spec)}, got {value!r}.")


class Section:
    """A config section: every option is read and checked as its `option()` declares (type, choices, range) when
    the section is made, from Python or a file, and again by `RunConfig.check` after changes made in Python."""

    NAME: ClassVar[str]  # what messages call the section made in Python; a file's messages name its YAML key

    def __post_init__(self) -> None:
        self.validate(self.NAME)

    def validate(self, where: str) -> None:
        for spec in fields(self):
            setattr(self, spec.name, check_option(spec, getattr(self, spec.name), f"{where}.{spec.name}"))
        self.check_together(where)

    def check_together(self, where: str) -> None:
        """Rules between options, which no single declaration states (none by default)."""


@dataclass
class UsafConfig(Section):
    """What `prepare_model` makes trainable.

    density: share of each expert tensor's entries to train, in (0, 1].
    num_entries: a global budget of trained expert entries; overrides `density` when set.
    granularity: "element" (arbitrary entries) or "neuron" (row j of gate and up, column j of down).
    strategy: how the budget is spread: "uniform" (every expert tensor alike), "routing" (experts covering
        `routing_coverage` of the task's routed tokens, in proportion to their share; cold experts get nothing),
        "gradient" (global top-k by gradient importance across layers), or "file" (a saved selection, `file`);
        or a strategy registered from Python (`usaf.selection.strategies`), by name or as the object.
    selection: how entries are chosen inside the budget: "random", "magnitude" (largest |w|), "gradient"
        (importance from calibration batches), or "auto": gradient when calibration batches are given (usaf train
        always gives them), else magnitude; seeded by `seed`; or a scorer registered from Python
        (`usaf.selection.scorers`), by name or as the object.
    calibration_batches: batches of the task used by "routing", "gradient" (and selection="gradient").
    oversample: candidate entries scored exactly per trained entry (gradient selection), >= 1.
    reselect_every: every K optimizer steps drop the entries that moved least and grow where the gradient is
        largest (0: never); `reselect_fraction` of the entries at first, decaying (cosine) to zero at
        `reselect_until` (a share of the run); gradients of candidates are gathered over `reselect_probe_steps`.
    targets: which native weights may hold trained entries: "experts" (the fused expert tensors), "routers"
        (trained whole, in fp32), "attention" (q/k/v/o and fused variants), "dense_mlp" (dense layers of hybrid
        models, shared experts), "norms", "embeddings" (input embedding rows), "lm_head" (output layer rows).
        `density` (or `num_entries`, split by size) applies to every targeted weight alike unless
        `density_ratios` weighs targets against each other (the total stays the same); with
        strategy="gradient" one global top-k over all of them decides where the budget goes.
    train_router: deprecated (0.1.x configs): routers' weights (and real biases) train when "routers" is in
        `targets`; false takes "routers" out of `targets` when the config is made.
    train_biases: expert biases (gpt-oss) get trainable entries at the same density.
    layers: numbers of the MoE decoder layers to train (None: all, and the weights outside the decoder layers:
        embedding, final norm, output layer); the others stay frozen.
    workspace_mb: bound on the dequantized routed-expert workspace of one projection (quantized bases), or
        "auto" (resolved by usaf train's memory plan; DEFAULT_WORKSPACE_MB where nothing plans).
    """

    density: float | str = option(
        "auto",
        "share of the targeted weights' entries to train, or auto: the largest of 2 %, 1 %, 0.5 % ... that usaf "
        "train's memory plan fits (1 % in prepare_model, which plans nothing)",
        bounds="(0, 1]",
    )
    num_entries: int | None = option(
        None, "global budget of trained entries (split by size); overrides density", bounds="[1, inf)"
    )
    density_ratios: dict = option(
        {},
        "per-target density relative to the others' (e.g. {attention: 10}); the total stays density x the "
        "eligible entries (or num_entries)",
        RATIO_TARGETS,
        bounds="(0, inf)",
    )
    granularity: str = option("element", "expert entries: arbitrary elements or whole neurons", GRANULARITIES)
    strategy: str = option(
        "uniform",
        "how the budget is spread: every tensor alike, routed experts, global gradient top-k, a saved file",
        STRATEGIES,
    )
    selection: str = option(
        "auto", "how entries are chosen inside the budget (auto: gradient given calibration data)", SELECTIONS
    )
    routing_coverage: float = option(
        0.5, "strategy=routing: share of routed tokens the chosen experts cover", bounds="(0, 1]"
    )
    calibration_batches: int = option(
        8,
        "batches of the training data used to calibrate the selection",
        bounds="[1, inf)",
        most=TOKENS_MOST,
    )
    oversample: float = option(
        4.0, "gradient selection: candidate entries scored per trained entry", bounds="[1, inf)"
    )
    file: str | None = option(
        None, "strategy=file: a selection.safetensors saved by a run or `usaf select`", path=True
    )
    reselect_every: int = option(
        DEFAULT_RESELECT_EVERY,
        "every N steps drop entries that moved least and grow where gradients are large (0: off; usaf train)",
    )
    reselect_fraction: float = option(
        0.3, "share of entries replaced at the first reselection, decaying", bounds="[0, 1)"
    )
    reselect_until: float = option(0.75, "share of the run after which reselection stops", bounds="(0, 1]")
    reselect_probe_steps: int = option(
        2, "steps of gradients gathered for the candidates before a reselection", bounds="[1, inf)"
    )
    seed: int = option(0, "seed of random selection")
    targets: list = option(
        list(DEFAULT_TARGETS), "weights that hold trained entries (some of the names)", TARGETS
    )
    train_router: bool = option(
        True, "deprecated: routers train when 'routers' is in targets; false takes them out of targets"
    )
    train_biases: bool = option(True, "expert biases (gpt-oss) get entries at the same density")
    layers: list[int] | None = option(
        None, "decoder layer numbers to train (None: all, with the embedding and output layer)"
    )
    workspace_mb: int | str = option(
        "auto",
        "bound (MB) on one projection's dequantized routed-expert workspace (quantized or streamed experts), or "
        "auto: all of a projection's routed experts at once where usaf train's memory plan fits them, else the "
        f"largest half of that which fits, at least {DEFAULT_WORKSPACE_MB} ({DEFAULT_WORKSPACE_MB} in "
        "prepare_model, which plans nothing)",
        bounds="[1, inf)",
        most=1 << 30,
    )

    NAME = "UsafConfig"

    def check_together(self, where: str) -> None:
        if self.strategy == "file" and not self.file:
            raise UsafError(f"{where}.strategy='file' needs `file`: a selection.safetensors saved by a run.")
        # the deprecated alias (0.1.x configs): train_router=false takes routers out of the targets
        if not self.train_router and "routers" in self.targets:
            if self.targets == ["routers"]:
                raise UsafError(
                    f"{where}: nothing to train: select.targets is [routers] with select.train_router=false: set "
                    "train_router=true or add targets."
                )
            self.targets = [t for t in self.targets if t != "routers"]

    @property
    def trains_routers(self) -> bool:
        return "routers" in self.targets

    @property
    def fixed_density(self) -> float:
        """The density as a number: auto that no memory plan resolved (`usaf.train.memory_plan` does for usaf
        train) reads as DEFAULT_DENSITY."""
        return DEFAULT_DENSITY if self.density == "auto" else self.density

    @property
    def fixed_workspace_mb(self) -> int:
        """The workspace bound as a number: auto that no memory plan resolved reads as DEFAULT_WORKSPACE_MB."""
        return DEFAULT_WORKSPACE_MB if self.workspace_mb == "auto" else self.workspace_mb

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> UsafConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UsafError(f"Unknown UsafConfig keys {unknown}; allowed keys: {sorted(known)}.")
        return cls(**data)


# --------------------------------------------------------------------------------------------------------------
# The whole job's configuration: one typed tree, from a YAML file plus `--set section.key=value` overrides.
# --------------------------------------------------------------------------------------------------------------


@dataclass
class ModelSection(Section):
    NAME = "model"

    path: str = option(
        "", "model directory, prepared store, or hub id (the hub needs the network)", path=True
    )
    dtype: str = option("auto", "weights and compute dtype", ("auto", "float32", "bfloat16", "float16"))
    # a live view of the registry: a format registered later (usaf.quant.register_format) is a choice too
    quant: str = option("none", "frozen expert storage", FORMATS.keys())
    residency: str = option("device", "where frozen experts live", RESIDENCIES)
    cache_mb: int = option(
        0,
        "with residency host/mmap: device memory (MB) keeping the most-routed experts resident",
        most=1 << 30,
    )
    device: str = option("auto", "compute device: auto, cpu, cuda, cuda:1, mps, xpu ...")


@dataclass
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


@dataclass
class OptimSection(Section):
    NAME = "optim"

    # lr > 0: a zero or negative rate would silently not train, or climb the loss
    lr: float = option(
        1e-2, "peak learning rate of trained values (sparse entries move far from few)", bounds="(0, inf)"
    )
    weight_decay: float = option(0.0, "AdamW decoupled weight decay (towards zero, applied to values)")
    decay_to_base: float = option(
        4.0,
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


@dataclass
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


@dataclass
class DataSection(Section):
    NAME = "data"

    train: list = option(
        [],
        "training data: files (jsonl, json, csv, tsv, parquet, arrow, txt, md; also .gz/.bz2/.xz/.zst), "
        "datasets save_to_disk folders or hub dataset ids from the local cache (NAME:SPLIT picks a split); "
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


@dataclass
class CheckpointSection(Section):
    NAME = "checkpoint"

    every_steps: int = option(
        50,
        "save a checkpoint every N optimizer steps (0: off; the last step and SIGINT/SIGTERM always save)",
    )
    keep_last: int = option(2, "checkpoints to keep (0: all)")


@dataclass
class LogSection(Section):
    NAME = "log"

    every_steps: int = option(1, "write metrics every N steps (0: off; evaluations are still written)")
    eval_every_steps: int = option(0, "evaluate every N steps (0: only before and after)")
    progress: bool = option(True, "live progress bar")
    report_to: list = option(
        ["tensorboard"],
        "experiment trackers, as transformers' report_to: tensorboard, wandb, mlflow (each given the scalars of "
        "metrics.jsonl and the run's configuration), or none; a tracker that is not installed is an error at start",
    )
    tensorboard: bool = option(True, "false leaves tensorboard out of report_to (the older switch for it)")


@dataclass
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
        "base itself the reference (no second model: one extra forward without gradients)",
        OBJECTIVES.choices(),
    )
    dpo_beta: float = option(
        0.1, "dpo: the strength of the pull toward the reference (DPO's beta)", bounds="(0, inf)"
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


SECTIONS = {
    "model": ModelSection,
    "select": UsafConfig,
    "router": RouterSection,
    "optim": OptimSection,
    "schedule": ScheduleSection,
    "data": DataSection,
    "checkpoint": CheckpointSection,
    "log": LogSection,
    "train": TrainSection,
}


@dataclass
class RunConfig:
    """Every option of a `usaf train` run, by section (see `usaf train --print-config`)."""

    model: ModelSection = field(default_factory=ModelSection)
    select: UsafConfig = field(default_factory=UsafConfig)
    router: RouterSection = field(default_factory=RouterSection)
    optim: OptimSection = field(default_factory=OptimSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    data: DataSection = field(default_factory=DataSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    log: LogSection = field(default_factory=LogSection)
    train: TrainSection = field(default_factory=TrainSection)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, data: dict | None, source: str = "config") -> RunConfig:
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise UsafError(f"{source}: the top level must be a mapping of sections {sorted(SECTIONS)}.")
        unknown = sorted(set(data) - set(SECTIONS), key=str)  # YAML keys need not be strings
        if unknown:
            raise UsafError(f"{source}: unknown section(s) {unknown}; allowed sections: {sorted(SECTIONS)}.")
        built = {}
        for name, section_cls in SECTIONS.items():
            values = data.get(name)
            built[name] = _build_section(section_cls, {} if values is None else values, f"{source}: {name}")
        return cls(**built)

    def check(self, source: str = "config") -> None:
        """Every option's choices and range, and the rules between them (for configs changed in Python)."""
        for name in SECTIONS:
            getattr(self, name).validate(f"{source}: {name}")

    @classmethod
    def load(cls, path: str | None = None, overrides: list | None = None) -> RunConfig:
        """A YAML file (optional) with overrides applied on top: `section.key=value` text (the value read as
        YAML, as `--set` gives it) or ("section.key", value) pairs taken as typed (`apply_override`)."""
        data = _read_config_file(path) if path else {}
        for item in overrides or []:
            apply_override(data, item)
        return cls.from_dict(data, source=path or "config")

    @classmethod
    def load_saved(cls, path: str, overrides: list | None = None) -> RunConfig:
        """A run's own config.yaml (every option written out): an option it lacks did not exist when the run
        started, so it takes the value that run trained with (EARLIER_DEFAULTS), not today's default."""
        data = _read_config_file(path)
        for (section, key), value in EARLIER_DEFAULTS.items():
            if isinstance(data.get(section), dict):
                data[section].setdefault(key, value)
        for item in overrides or []:
            apply_override(data, item)
        return cls.from_dict(data, source=path)


def _read_config_file(path: str) -> dict:
    """The sections of a YAML config file, or a UsafError naming the file and what to do."""
    try:
        with open(path, encoding="utf-8") as f:
            data = read_yaml(f, path)
    except FileNotFoundError:
        raise UsafError(f"Config file {path} does not exist.") from None
    except IsADirectoryError:
        raise UsafError(f"Config file {path} is a directory; give a YAML file.") from None
    except UnicodeDecodeError:
        raise UsafError(f"Config file {path} is not a text (UTF-8) file.") from None
    data = {} if data is None else data  # an empty file: all defaults
    if not isinstance(data, dict):
        # checked before the overrides go in: a list has no sections to put them into
        raise UsafError(
            f"Config file {path}: the top level is a {type(data).__name__}, not a mapping of sections "
            f"(e.g. 'optim:' with 'lr: 3e-4' under it); allowed sections: {sorted(SECTIONS)}."
        )
    return data


# Options added with a default that changes training: what a run saved before they existed trained with.
EARLIER_DEFAULTS = {("optim", "decay_to_base"): 0.0}


# ---- YAML, bounded -------------------------------------------------------------------------------------------------
# PyYAML builds an alias once and shares it, but whatever walks the result (the checks' messages, the run's
# config.yaml, a deep copy) expands it: a 475-byte "billion laughs" is 10^9 strings. A config is a few dozen
# values, so a document is refused when its expansion would exceed YAML_MAX_NODES, before anything is built. A key
# given twice would silently keep the last value (a section given twice, the last section): refused too.
YAML_MAX_NODES = 10_000


def read_yaml(stream, source: str):
    """The YAML document in `stream` (a string or a text file) as Python values: safe tags only, aliases bounded,
    no duplicate keys; any problem is one line naming `source` and the line."""
    import yaml

    loader = _bounded_loader()(stream)
    try:
        return loader.get_single_data()
    except _YamlRefused as refused:
        raise YamlRefusedError(f"{source}:{refused.line}: {refused}") from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        problem = " ".join(str(err.problem or err.context or "").split())
        raise UsafError(f"{where}: not valid YAML: {first_line(ValueError(problem))}") from None
    except (yaml.YAMLError, RecursionError) as err:
        raise UsafError(f"{source} is not valid YAML: {first_line(err)}") from None
    finally:
        loader.dispose()


class YamlRefusedError(UsafError):
    """A YAML document refused for its shape (aliases expanding too far, a key given twice), not its syntax."""


class _YamlRefused(Exception):
    def __init__(self, message: str, line: int):
        super().__init__(message)
        self.line = line


_LOADER = None


def _bounded_loader():
    """yaml.SafeLoader (libyaml's when there is one) that sizes the document before building it, and refuses
    duplicate keys."""
    global _LOADER
    if _LOADER is not None:
        return _LOADER
    import yaml

    base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

    class BoundedLoader(base):
        def construct_document(self, node):
            _check_expansion(node)
            return super().construct_document(node)

        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                seen = set()
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = self.construct_object(key_node, deep=True)
                    try:
                        duplicate = key in seen
                        seen.add(key)
                    except TypeError:  # a list as a key: yaml reports it below
                        continue
                    if duplicate:
                        raise _YamlRefused(
                            f"key {key!r} appears twice in the same mapping (the first would be silently "
                            "dropped); give it once",
                            key_node.start_mark.line + 1,
                        )
            return super().construct_mapping(node, deep=deep)

    _LOADER = BoundedLoader
    return _LOADER


def _check_expansion(root) -> None:
    """Refuse a node graph whose expansion (aliases copied out) has over YAML_MAX_NODES nodes, or a cycle."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack = [(root, False)]
    while stack:  # iterative: a deeply nested document must not overflow Python's stack
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            children = _children(node)
            sizes[key] = 1 + sum(sizes[id(child)] for child in children)
            open_nodes.discard(key)
            if sizes[key] > YAML_MAX_NODES:
                raise _YamlRefused(
                    f"the document's aliases (*name) expand to over {YAML_MAX_NODES:,} values; a usaf config "
                    "needs no more: write the values out, or use fewer aliases",
                    node.start_mark.line + 1,
                )
            continue
        if key in sizes:
            continue
        if key in open_nodes:
            raise _YamlRefused(
                "an alias refers to a node that contains it (a cycle); aliases must not nest",
                node.start_mark.line + 1,
            )
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in sizes)


def _children(node) -> list:
    value = node.value
    if not isinstance(value, list):
        return []
    return [part for item in value for part in (item if isinstance(item, tuple) else (item,))]


def apply_override(data: dict, item: str | tuple[str, object]) -> None:
    """`section.key=value` (value parsed as YAML: numbers, booleans, lists) into a nested dict; or a
    ("section.key", value) pair, whose value is already typed and taken as it is (a path from the command line is
    a string verbatim: YAML would read ` #` as a comment and `: ` as a mapping)."""
    if isinstance(item, tuple):
        (key, value), item = item, f"{item[0]}={item[1]}"
    else:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise UsafError(f"--set {item!r}: expected section.key=value, e.g. --set optim.lr=3e-4.")
        key, raw = item.split("=", 1)
        try:
            value = read_yaml(raw, f"--set {key}") if raw != "" else ""
        except YamlRefusedError:
            raise
        except UsafError:
            value = raw  # not YAML: the text as given
    section, name = key.split(".", 1)
    if data.get(section) is None:  # absent, or an empty `section:` line in the file
        data[section] = {}
    if not isinstance(data[section], dict):
        raise UsafError(f"--set {item!r}: '{section}' is not a section.")
    data[section][name] = value


def _build_section(section_cls, values: dict, where: str):
    """A section from a file's values, its messages naming the file and the YAML keys (`run.yaml: optim.lr`)."""
    if not isinstance(values, dict):
        raise UsafError(f"{where} must be a mapping of keys to values.")
    known = {f.name for f in fields(section_cls)}
    unknown = sorted(set(values) - known, key=str)
    if unknown:
        raise UsafError(f"{where}: unknown key(s) {unknown}; allowed keys: {sorted(known)}.")
    section = section_cls()  # the defaults, then the file's values, checked together under the file's names
    for name, value in values.items():
        setattr(section, name, value)
    section.validate(where)
    return section


def check_option(spec, value, where: str):
    """One option's value, read and checked as declared (its type, choices, range, ceiling, path expansion):
    the value to keep, or a UsafError naming `where`. Every way a config is made (a file, --set, Python) comes
    here, so each fault has one message."""
    choices = spec.metadata.get("choices")
    # a boolean choice of a string-valued option (train.recompute: auto, true or false)
    if isinstance(value, bool) and choices and any(c is value for c in choices):
        return value
    if isinstance(choices, Choices) and not isinstance(value, (str, list, dict, tuple, type(None))):
        # a plug-in object given from Python (a strategy or scorer): registered under its name, which is kept
        try:
            value = choices.registry.register(value).name
        except UsafError as err:
            raise UsafError(f"{where}: {err}") from None
    value = _coerce(value, spec, where)
    if isinstance(value, (list, dict)) and (choices or spec.metadata.get("bounds")):
        return _check_collection(value, choices, spec.metadata.get("bounds"), where)
    if choices and value not in choices:
        raise UsafError(f"{where} = {value!r} is not allowed; allowed values: {_choices_text(choices)}.")
    check_bounds(value, spec.metadata.get("bounds"), where)
    integers = value if isinstance(value, list) else [value]
    most = spec.metadata.get("most") or INT_MOST
    for number in integers:
        if isinstance(number, int) and not isinstance(number, bool) and number > most:
            raise UsafError(f"{where} must be at most {most}, got {number!r}.")
    if spec.metadata.get("path") and value:
        value = [expand_path(v) for v in value] if isinstance(value, list) else expand_path(value)
    parse = spec.metadata.get("parse")
    if parse is not None and value not in ("", None):
        try:
            parse(value)
        except UsafError as err:
            raise UsafError(f"{where}: {err}") from None
    return value


def _check_collection(value, choices, bounds: str | None, where: str):
    """A list option with choices is some of them (kept in their order); a dict option maps some of them to
    numbers in `bounds` (select.targets, select.density_ratios)."""
    if isinstance(value, list):
        if not value or any(item not in choices for item in value):
            raise UsafError(f"{where} must be a non-empty list of {_choices_text(choices)}, got {value!r}.")
        return [c for c in choices if c in value]
    numbers = all(not isinstance(v, bool) and isinstance(v, (int, float)) for v in value.values())
    if not numbers or any(key not in choices for key in value):
        raise UsafError(
            f"{where} must map some of {_choices_text(choices)} to numbers {bounds_text(bounds)}, got {value!r}."
        )
    for key, number in value.items():
        check_bounds(number, bounds, f"{where}[{key!r}]")
    return value


def expand_path(text: str) -> str:
    """`~` and `$VAR` / `${VAR}` expanded as a shell would, for every path usaf is given (options and command-line
    arguments); a variable that is not set is left as written, so the error names it."""
    return os.path.expanduser(os.path.expandvars(text)) if isinstance(text, str) else text


def split_paths(text: str) -> list[str]:
    """Comma-separated paths (`--data a.jsonl,b.jsonl`); a file whose own name holds a comma stays whole: when the
    whole text names a file or folder and one of its pieces does not, it is that one path."""
    pieces = [p.strip() for p in text.split(",") if p.strip()]
    whole = expand_path(text.strip())
    if len(pieces) > 1 and os.path.exists(whole) and not all(os.path.exists(expand_path(p)) for p in pieces):
        return [text.strip()]
    return pieces


_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE_FORMS = "a number with an optional unit, e.g. 12GB, 12GiB, 12G, 512MB, 1.5TB, or bytes (12884901888)"


def parse_size(text: str | int) -> int:
    """Bytes from '12GB', '12GiB', '12G', '512MB', '1.5T', '4096B' or a plain number of bytes (train.memory_limit,
    `usaf plan --vram`).

    Units are binary (12GB = 12 GiB = 12 * 2**30 bytes), as memory cards and modules are sized.
    """
    if isinstance(text, int) and not isinstance(text, bool) and text >= 0:
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])(?:i?b)?|b)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise UsafError(f"Cannot read the size {text!r}; write {_SIZE_FORMS}.")
    return int(float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").lower()])


def _choice_text(choice) -> str:
    return str(choice).lower() if isinstance(choice, bool) else str(choice)


def _choices_text(choices) -> str:
    return "[" + ", ".join(repr(c) if isinstance(c, str) else _choice_text(c) for c in choices) + "]"


def _declared_type(spec) -> str:
    """The option's type: its default's, or, for a None default, the annotation's ("int | None" is int)."""
    annotation = str(spec.type).replace(" ", "")
    if annotation in ("float|str", "int|str"):  # a number or a word (select.density: a share or auto)
        return annotation.replace("|", " | ")
    default = spec.default if spec.default is not MISSING else spec.default_factory()
    if default is not None:
        return "bool" if isinstance(default, bool) else type(default).__name__
    return "list[int]" if annotation.startswith("list[int]") else annotation.split("|")[0]


def _coerce(value, spec, where: str):
    """Check a value against the option's declared type (ints accepted for floats, scalars for lists)."""
    if value is None:
        default = spec.default if spec.default is not MISSING else spec.default_factory()
        if default is None:
            return None
        raise UsafError(f"{where} needs a value (null is not one).")
    coerce = _COERCERS.get(_declared_type(spec))
    return coerce(value, spec, where) if coerce is not None else value


def _as_bool(value, spec, where: str) -> bool:
    if isinstance(value, bool):
        return value
    raise UsafError(f"{where} must be true or false, got {value!r}.")


def _as_int(value, spec, where: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise UsafError(f"{where} must be an integer, got {value!r}.")


def _as_float(value, spec, where: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:  # YAML 1.1 reads "3e-4" (no dot) as a string
            return float(value)
        except ValueError:
            pass
    raise UsafError(f"{where} must be a number, got {value!r}.")


def _as_layer_numbers(value, spec, where: str) -> list[int] | None:
    """Layer numbers: a list, one number, "0,2", or "all" (the same as null)."""
    if isinstance(value, str) and value.strip().lower() == "all":
        return None
    value = list(value) if isinstance(value, (tuple, range)) else value
    items = value if isinstance(value, list) else str(value).split(",") if isinstance(value, str) else [value]
    numbers = []
    for item in items:
        item = item.strip() if isinstance(item, str) else item
        if isinstance(item, str) and item.lstrip("-").isdigit():
            item = int(item)
        if isinstance(item, bool) or not isinstance(item, int):
            raise UsafError(
                f"{where} must be a list of layer numbers (e.g. [0, 2]), or null (or all) for every layer, "
                f"got {value!r}."
            )
        numbers.append(item)
    return numbers


def _as_names(value, spec, where: str) -> list[str]:
    """Names or paths: a list, one, or several comma separated (a path option's own commas kept)."""
    value = list(value) if isinstance(value, (tuple, set)) else value
    if isinstance(value, list):
        items = value
    elif spec.metadata.get("path") and isinstance(value, str):
        items = split_paths(value)
    else:
        items = [v.strip() for v in str(value).split(",") if v.strip()]
    if isinstance(value, dict) or any(isinstance(v, (list, dict)) or v is None for v in items):
        raise UsafError(
            f"{where} must be a list of names or paths (or one, or several comma separated), got {value!r}."
        )
    return [str(v) for v in items]


def _as_mapping(value, spec, where: str) -> dict:
    if isinstance(value, dict):
        return value
    raise UsafError(f"{where} must be a mapping (e.g. {{key: value}}), got {value!r}.")


def _as_text(value, spec, where: str) -> str:
    if isinstance(value, os.PathLike):  # a pathlib.Path from Python
        return os.fspath(value)
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise UsafError(f"{where} must be a string, got {value!r}.")


# an option's declared type (`_declared_type`) -> what reads a value of it
def _or_auto(read, kind: str):
    """A reader of `read`'s values or the word auto (select.density: a share or auto)."""

    def read_or_auto(value, spec, where: str):
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        try:
            return read(value, spec, where)
        except UsafError:
            raise UsafError(f"{where} must be {kind} or auto, got {value!r}.") from None

    return read_or_auto


_COERCERS = {
    "bool": _as_bool,
    "int": _as_int,
    "float": _as_float,
    "float | str": _or_auto(_as_float, "a number"),
    "int | str": _or_auto(_as_int, "an integer"),
    "list[int]": _as_layer_numbers,
    "list": _as_names,
    "dict": _as_mapping,
    "str": _as_text,
}


def describe() -> str:
    """Every option with its default and documentation, for `--help`-style listings."""
    lines = []
    for name, section_cls in SECTIONS.items():
        for f in fields(section_cls):
            default = f.default if f.default is not MISSING else f.default_factory()
            choices, bounds = f.metadata.get("choices"), f.metadata.get("bounds")
            doc = f.metadata.get("doc", "")
            extra = f" (one of {', '.join(_choice_text(c) for c in choices)})" if choices else ""
            extra += f" (allowed: {bounds_text(bounds).removeprefix('in ')})" if bounds else ""
            extra += f" (at most {f.metadata['most']})" if f.metadata.get("most") else ""
            lines.append(f"{name}.{f.name} = {default!r}  {doc}{extra}")
    return "\n".join(lines)
