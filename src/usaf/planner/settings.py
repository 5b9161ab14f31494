"""What a plan is for: the device (memory, compute, bandwidth presets), the formats and optimizers, the run's
settings (`PlanSettings`, or a run's own configuration)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from usaf.config import (
    DEFAULT_DENSITY,
    DEFAULT_LOGITS_CHUNK,
    DEFAULT_RESELECT_EVERY,
    DEFAULT_TARGETS,
    DEFAULT_WORKSPACE_MB,
    RESIDENCIES,
    TARGETS,
    RunConfig,
)
from usaf.errors import UsafError
from usaf.io.published import checkpoint_method
from usaf.planner.sizes import GiB, MiB
from usaf.quant import PUBLISHED, by_precision


@dataclass(frozen=True)
class Device:
    """Datasheet figures of a compute device; the step-time model applies the efficiencies below to them."""

    name: str
    memory: int  # bytes of device memory (0 for the CPU: it uses --ram)
    tflops: float  # dense matmul peak at the compute dtype (bf16 tensor cores; fp32 SIMD on the CPU)
    memory_gbps: float  # device memory bandwidth
    link_gbps: float  # host -> device copy rate from pinned memory
    is_gpu: bool = True
    fast_bf16: bool = True  # bf16 matrix units; without them `usaf train` computes in fp16 with loss scaling
    peer_gbps: float = (
        0.0  # GPU-to-GPU rate per direction (NVLink, Infinity Fabric); 0: through PCIe (link_gbps)
    )

    def __post_init__(self):
        if not self.peer_gbps:
            object.__setattr__(self, "peer_gbps", self.link_gbps)


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


VALUE_MOMENT_BYTES = {"adamw": 4, "adamw-fp32": 8, "adamw8bit": 2}


@dataclass(frozen=True)
class PlanSettings:
    seq: int = 2048
    batch: int = 1
    density: float = DEFAULT_DENSITY
    quant: str = "nf4"
    quant_dense: bool = False
    granularity: str = "element"
    residency: str = "device"  # device | host | mmap
    recompute: bool = True
    reselect: bool = (
        DEFAULT_RESELECT_EVERY > 0
    )  # select.reselect_every: probe windows hold candidates' gradients
    logits_chunk: int = DEFAULT_LOGITS_CHUNK  # train.logits_chunk_tokens
    optimizer: str = "adamw"
    dtype: str = "bf16"
    workspace_mb: int = DEFAULT_WORKSPACE_MB  # select.workspace_mb
    targets: tuple = DEFAULT_TARGETS  # select.targets: which weights hold trained entries
    gpus: int = 1  # processes of a data-parallel (or expert-parallel) job, one GPU each
    expert_parallel: bool = False  # each GPU holds E/gpus experts of every layer; tokens travel all-to-all
    gpus_per_host: int = 0  # ranks sharing one host's RAM (0: min(gpus, 8), one 8-GPU box after another)

    def __post_init__(self):

        checks = [
            (
                bool(self.targets) and all(t in TARGETS for t in self.targets),
                f"--targets must name some of {', '.join(TARGETS)}, got {','.join(self.targets)!r}",
            ),
            (self.seq >= 2, f"--seq must be at least 2, got {self.seq}"),
            (self.batch >= 1, f"--batch must be at least 1, got {self.batch}"),
            (0 < self.density <= 1, f"--density must be in (0, 1], got {self.density}"),
            (
                self.quant in quant_formats(),
                f"--quant must be one of {', '.join(quant_formats())}, got {self.quant!r}",
            ),
            (
                self.granularity in ("element", "neuron"),
                f"--granularity must be element or neuron, got {self.granularity!r}",
            ),
            (
                self.residency in RESIDENCIES,
                f"--residency must be one of {', '.join(RESIDENCIES)}, got {self.residency!r}",
            ),
            (self.logits_chunk >= 1, f"--logits-chunk must be at least 1, got {self.logits_chunk}"),
            (
                self.optimizer in OPTIMIZERS,
                f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}",
            ),
            (
                self.dtype in DTYPE_BYTES,
                f"--dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}",
            ),
            (self.workspace_mb >= 1, f"--workspace-mb must be at least 1, got {self.workspace_mb}"),
            (self.gpus >= 1, f"--gpus must be at least 1, got {self.gpus}"),
            (
                self.gpus_per_host >= 0,
                f"--gpus-per-host must be at least 1 (or 0: up to 8), got {self.gpus_per_host}",
            ),
            (
                self.gpus > 1 or not self.expert_parallel,
                "--expert-parallel divides the experts among GPUs: give --gpus 2 or more",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise UsafError(message + ".")

    @property
    def ranks_per_host(self) -> int:
        return min(self.gpus, self.gpus_per_host or 8)

    def replace(self, **changes) -> PlanSettings:
        return dataclasses.replace(self, **changes)


def default_dtype(device: Device) -> str:
    """What `usaf train` picks (`usaf.train.runtime.resolve_dtype`): bf16 on accelerators with bf16 matrix units, fp16 on
    those without (AMD RDNA2), fp32 on the CPU (bf16 matmuls are slow on most CPUs)."""
    if not device.is_gpu:
        return "fp32"
    return "bf16" if device.fast_bf16 else "fp16"


def settings_for_run(config: RunConfig, dtype: str) -> PlanSettings:
    """The plan of a run's configuration (`usaf plan --config run.yaml`, and `train.recompute=auto`): the same
    sequence, batch, selection, storage, chunking and optimizer state the run will have."""
    return PlanSettings(
        seq=config.data.max_seq_len,
        batch=config.data.batch_size,
        density=config.select.density,
        quant=checkpoint_method(config.model.path) or config.model.quant,  # a published one keeps its own
        granularity=config.select.granularity,
        residency=config.model.residency,
        recompute=config.train.recompute is not False,
        logits_chunk=config.train.logits_chunk_tokens,
        optimizer=run_optimizer(config),
        reselect=config.select.reselect_every > 0,
        dtype=dtype,
        workspace_mb=config.select.workspace_mb,
        targets=tuple(config.select.targets),
    )


def run_optimizer(config: RunConfig) -> str:
    """The planner's name for a run's optimizer state (`usaf.train.optim.build_optimizer`)."""
    if config.optim.eight_bit:
        return "adamw8bit"
    return "adamw" if config.optim.moments == "bf16" else "adamw-fp32"


DEVICES: dict[str, Device] = {
    "rtx-3060-12gb": Device("rtx-3060-12gb", 12 * GiB, 51.0, 360.0, 25.0),
    "rtx-3090": Device("rtx-3090", 24 * GiB, 71.0, 936.0, 25.0),
    "rtx-4090": Device("rtx-4090", 24 * GiB, 165.0, 1008.0, 25.0),
    # H100 SXM: NVLink 4, 900 GB/s both directions together
    "h100": Device("h100", 80 * GiB, 989.0, 3350.0, 50.0, peer_gbps=450.0),
    # AMD (ROCm), from amd.com product specifications. RX 6750 XT (RDNA2, gfx1031): 12 GB GDDR6 at 432 GB/s,
    # 13.3 TFLOPS fp32 and 26.6 fp16 (packed, twice fp32), no bf16 matrix units; PCIe 4.0 x16
    "rx-6750-xt": Device("rx-6750-xt", 12 * GiB, 26.6, 432.0, 25.0, fast_bf16=False),
    # RX 7900 XTX (RDNA3, gfx1100): 24 GB at 960 GB/s, 122.8 TFLOPS fp16/bf16 (WMMA, dual issue); PCIe 4.0 x16
    "rx-7900-xtx": Device("rx-7900-xtx", 24 * GiB, 122.8, 960.0, 25.0),
    # Instinct MI300X (CDNA3, gfx942): 192 GB HBM3 at 5.3 TB/s, 1307.4 TFLOPS dense bf16; PCIe 5.0 x16 host link
    # and 7 Infinity Fabric links of 64 GB/s each way to its peers on an 8-GPU platform
    "mi300x": Device("mi300x", 192 * GiB, 1307.4, 5300.0, 50.0, peer_gbps=448.0),
    "cpu": Device("cpu", 0, 0.2, 20.0, 0.0, is_gpu=False),
}
