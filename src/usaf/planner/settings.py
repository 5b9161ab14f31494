"""What a plan is for: the device (memory, compute, bandwidth presets), the formats and optimizers, the run's
settings (`PlanSettings`, or a run's own configuration)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from usaf.config import (
    DEFAULT_RESELECT_EVERY,
    SECTIONS,
    DataSection,
    ModelSection,
    OptimSection,
    TrainSection,
    UsafConfig,
    check_option,
)
from usaf.config.cards import CARDS, Device
from usaf.config.sections import DistributedSection
from usaf.errors import ConfigError
from usaf.files import STORE_FILE
from usaf.io.model_source import read_store_metadata
from usaf.io.published import METHODS, checkpoint_method, keeps_published
from usaf.planner.sizes import GiB, MiB
from usaf.quant import PUBLISHED, by_precision
from usaf.registry import OBJECTIVES

DEVICES: dict[str, Device] = CARDS  # the cards a plan knows: the ones a run can name (train.card)

# Shares of the datasheet peaks MoE training reaches: grouped matmuls over a few hundred tokens per expert and
# gather-heavy routing keep matmul units far from peak; streaming copies run near the link rate.
COMPUTE_EFFICIENCY = 0.35


MEMORY_EFFICIENCY = 0.7


DISK_GBPS = 3.0  # NVMe reads for memory-mapped experts that the page cache cannot hold


CUDA_CONTEXT = GiB // 2  # CUDA/HIP context and kernel images resident on the card


GPU_ALLOCATOR_SLACK = 0.10  # caching-allocator fragmentation, as a share of the transient peak


GPU_HOST_FRAMEWORK = 3 * GiB  # Python, torch, transformers and the GPU runtime in host memory


# Measured on Linux x86-64 (torch 2.13 CPU, transformers 5.24): resident memory of the imported libraries, and what
# the first training step adds whatever the model size (the family's modeling code, thread pools, oneDNN/MKL).
CPU_IMPORTS = 600 * MiB


CPU_WARMUP = 85 * MiB


DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def quant_formats() -> tuple[str, ...]:
    """The frozen experts' formats a plan knows (`usaf.quant`'s registry): usaf's own, most to least precise, then
    the published ones (kept as they are)."""
    return (*by_precision(), *PUBLISHED)


OPTIMIZERS = {
    "adamw": "AdamW, the values' moments in bf16 with stochastic rounding (4 B per value; routers fp32)",
    "adamw-fp32": "AdamW with fp32 moments (8 B per value; optim.moments=fp32)",
    "adamw8bit": "8-bit AdamW (2 B per value)",
}


# the run options (section, key) that a plan's settings of the same meaning read and set
RUN_OPTIONS = {
    "seq": ("data", "max_seq_len"),
    "batch": ("data", "batch_size"),
    "density": ("select", "density"),
    "num_entries": ("select", "num_entries"),
    "layers": ("select", "layers"),
    "granularity": ("select", "granularity"),
    "targets": ("select", "targets"),
    "workspace_mb": ("select", "workspace_mb"),
    "residency": ("model", "residency"),
    "cache_mb": ("model", "cache_mb"),
    "logits_chunk": ("train", "logits_chunk_tokens"),
    "recompute": ("train", "recompute"),
    "expert_parallel": ("distributed", "expert_parallel"),
    "shard_dense": ("distributed", "shard_dense"),
}


@dataclass(frozen=True)
class PlannedRun:
    """The sections of a run the planner reads: a run's own (`PlannedRun.of(run_config)`), or `usaf plan`'s
    defaults. Only these travel into the planner, never the whole run configuration."""

    model: ModelSection = field(default_factory=ModelSection)
    select: UsafConfig = field(default_factory=UsafConfig)
    optim: OptimSection = field(default_factory=OptimSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)

    @classmethod
    def of(cls, run) -> PlannedRun:
        """The planner's sections of `run` (a run configuration, or a PlannedRun)."""
        return cls(**{spec.name: getattr(run, spec.name) for spec in dataclasses.fields(cls)})


def _run_option(name: str) -> property:
    """A plan setting that is the run option RUN_OPTIONS names, read from the run."""
    section, key = RUN_OPTIONS[name]
    return property(lambda self: getattr(getattr(self.run, section), key), doc=f"the run's {section}.{key}")


@dataclass(frozen=True, init=False)
class PlanSettings:
    """A run as the planner sees it: the sections of the run's own configuration (`PlannedRun`, read through the
    properties below) and what only a plan is told: the compute dtype, a published checkpoint's format, the
    GPUs, --quant-dense.

    With several GPUs the job is `expert_parallel` (the run's distributed.expert_parallel, EP) x `data_parallel`
    (DP) ranks: each EP group splits every MoE layer's experts, the DP groups replicate them. `expert_parallel=True`
    means EP = `gpus`.

    `PlanSettings(run)` plans a run's configuration (a run's or a PlannedRun); `PlanSettings(seq=4096,
    quant="int4", ...)` sets the run options those flags stand for on a run with `usaf train`'s defaults (one set:
    the planner has none of its own)."""

    run: PlannedRun
    dtype: str = "bf16"
    published: str | None = None  # a published checkpoint's expert format (mxfp4, fp8), kept as published
    quant_dense: bool = False
    gpus: int = 1  # processes of a torchrun job (expert parallel x data parallel), one GPU each
    gpus_per_host: int = 0  # ranks sharing one host's RAM (0: min(gpus, 8), one 8-GPU box after another)

    def __init__(
        self,
        run=None,
        *,
        dtype: str = "bf16",
        published: str | None = None,
        quant_dense: bool = False,
        gpus: int = 1,
        gpus_per_host: int = 0,
        **options,
    ):
        run = PlannedRun.of(run or PlannedRun())  # a run's own sections, or a run's defaults
        if isinstance(options.get("expert_parallel"), bool):  # the bare flag: every GPU in one EP group
            if options["expert_parallel"] and gpus == 1:
                raise ConfigError("--expert-parallel divides the experts among GPUs: give --gpus 2 or more.")
            options["expert_parallel"] = gpus if options["expert_parallel"] else 1
        if "quant" in options:
            quant = options.pop("quant")
            if quant not in (*quant_formats(), "auto"):
                raise ConfigError(
                    f"--quant must be one of {', '.join(quant_formats())} or auto, got {quant!r}."
                )
            published = quant if quant in PUBLISHED else None
            options["model_quant"] = run.model.quant if published else quant
        own = {"dtype": dtype, "published": published, "quant_dense": quant_dense, "gpus": gpus}
        own["gpus_per_host"] = gpus_per_host
        for name, value in {"run": _with_options(run, options), **own}.items():
            object.__setattr__(self, name, value)
        self._check()

    def _check(self) -> None:
        checks = [
            (
                self.dtype in DTYPE_BYTES,
                f"--dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}",
            ),
            (self.gpus >= 1, f"--gpus must be at least 1, got {self.gpus}"),
            (
                self.gpus_per_host >= 0,
                f"--gpus-per-host must be at least 1 (or 0: up to 8), got {self.gpus_per_host}",
            ),
            (
                self.gpus % self.expert_parallel == 0,
                f"--expert-parallel {self.expert_parallel} must divide --gpus {self.gpus} (the job is expert "
                f"parallel x data parallel ranks): give --gpus {self.expert_parallel} or a multiple of it",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message + ".")

    # ---- the run's options, as the ledger reads them ----

    seq = _run_option("seq")

    @property
    def density(self) -> float:
        """The run's select.density; auto is resolved before planning (`planner.auto_density`), and where it is
        not, reads as what prepare_model takes (UsafConfig.fixed_density)."""
        return self.run.select.fixed_density

    num_entries = _run_option("num_entries")
    layers = _run_option("layers")
    granularity = _run_option("granularity")

    @property
    def workspace_mb(self) -> int:
        """The run's select.workspace_mb; auto is resolved before planning (`planner.auto_workspace`), and where
        it is not, reads as what prepare_model takes (UsafConfig.fixed_workspace_mb)."""
        return self.run.select.fixed_workspace_mb

    @property
    def residency(self) -> str:
        """The run's model.residency; auto is resolved before planning (`planner.auto_storage`), and where it is
        not, reads as the device (ModelSection.fixed_residency)."""
        return self.run.model.fixed_residency

    @property
    def cache_mb(self) -> int:
        """The run's model.cache_mb; auto is resolved after the density (`planner.auto_cache`), and reads as 0
        before."""
        return self.run.model.fixed_cache_mb

    logits_chunk = _run_option("logits_chunk")
    expert_parallel = _run_option("expert_parallel")
    shard_dense = _run_option(
        "shard_dense"
    )  # auto: on where the dense weights whole on every rank do not fit

    @property
    def data_parallel(self) -> int:
        """Replicas of each expert: the job's ranks over its expert-parallel groups' size."""
        return self.gpus // self.expert_parallel

    @property
    def objective(self) -> str:
        return self.run.train.objective

    @property
    def pairs(self) -> bool:
        """The objective trains on preference pairs (a chosen and a rejected row each)."""
        return OBJECTIVES[self.objective].pairs

    @property
    def reference_forward(self) -> int:
        """The forwards without gradients the objective runs a step besides its own (0: none)."""
        return int(OBJECTIVES[self.objective].reference_forward)

    @property
    def batch(self) -> int:
        """Rows per micro-batch: data.batch_size, twice over for an objective's pairs."""
        return self.run.data.batch_size * (2 if self.pairs else 1)

    @property
    def targets(self) -> tuple:
        return tuple(self.run.select.targets)

    @property
    def recompute(self) -> bool:
        return self.run.train.recompute is not False  # auto recomputes where the ledger says it must

    @property
    def reselect(self) -> bool:
        return self.run.select.reselect_every > 0  # probe windows hold candidates' gradients

    @property
    def quant(self) -> str:
        """A published checkpoint's format, else the run's model.quant (auto, before `planner.auto_storage`
        resolves it, reads as unquantized: ModelSection.fixed_quant)."""
        return self.published or self.run.model.fixed_quant

    @property
    def optimizer(self) -> str:
        return run_optimizer(self.run.optim)

    @property
    def ranks_per_host(self) -> int:
        return min(self.gpus, self.gpus_per_host or 8)

    def replace(self, **changes) -> PlanSettings:
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "run"}
        if "quant" in changes:
            own.pop("published")
        return PlanSettings(self.run, **{**own, **changes})


def _with_options(run: PlannedRun, options: dict) -> PlannedRun:
    """A copy of `run` with plan settings set on the run options they stand for (each checked as that option
    declares, under its flag's name: --density, --logits-chunk); sections nothing changes are shared."""
    changes: dict[str, dict] = {}
    for name, value in options.items():
        if name == "reselect":  # on: the run's own interval, or the default one
            every = run.select.reselect_every or DEFAULT_RESELECT_EVERY
            changes.setdefault("select", {})["reselect_every"] = every if value else 0
        elif name == "optimizer":
            if value not in OPTIMIZERS:
                raise ConfigError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {value!r}.")
            moments = "fp32" if value == "adamw-fp32" else "bf16"
            changes.setdefault("optim", {}).update(eight_bit=value == "adamw8bit", moments=moments)
        elif name == "model_quant":
            changes.setdefault("model", {})["quant"] = value
        elif name in RUN_OPTIONS:
            section, key = RUN_OPTIONS[name]
            spec = {f.name: f for f in dataclasses.fields(SECTIONS[section])}[key]
            changes.setdefault(section, {})[key] = check_option(spec, value, "--" + name.replace("_", "-"))
        else:
            raise TypeError(f"PlanSettings has no setting {name!r}")
    sections = {name: dataclasses.replace(getattr(run, name), **kw) for name, kw in changes.items()}
    return dataclasses.replace(run, **sections)


def default_dtype(device: Device) -> str:
    """What `usaf train` picks (`usaf.train.runtime.resolve_dtype`): bf16 on accelerators with bf16 matrix units, fp16 on
    those without (AMD RDNA2), fp32 on the CPU (bf16 matmuls are slow on most CPUs)."""
    if not device.is_gpu:
        return "fp32"
    return "bf16" if device.fast_bf16 else "fp16"


def settings_for_run(run: PlannedRun, dtype: str) -> PlanSettings:
    """The plan of a run's sections (`usaf plan --config run.yaml`, and `train.recompute=auto`): the same
    sequence, batch, selection, storage, chunking and optimizer state the run will have; a published checkpoint's
    experts keep their own format unless model.quant names another. On the smallest job the run can be: distributed.expert_parallel GPUs."""
    published = _published_format(run.model.path) if keeps_published(run.model.quant) else None
    return PlanSettings(run, dtype=dtype, published=published, gpus=run.distributed.expert_parallel)


def _published_format(path: str) -> str | None:
    """The published format of the experts at `path`: a checkpoint's, or a prepared store's when it kept them
    (its config.json is the checkpoint's, but a store converted with `usaf prepare --quant` holds usaf's format)."""
    if path and (Path(path) / STORE_FILE).is_file():
        quant = read_store_metadata(path)["quant"]
        return quant if quant in METHODS else None
    return checkpoint_method(path)


def run_optimizer(optim: OptimSection) -> str:
    """The planner's name for a run's optimizer state (`usaf.train.optim.build_optimizer`)."""
    if optim.eight_bit:
        return "adamw8bit"
    return "adamw" if optim.moments == "bf16" else "adamw-fp32"
