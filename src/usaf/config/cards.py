"""The cards a run can name (`train.card`, `usaf plan --device`): each one's memory and datasheet speed figures.

Here, before the planner, so that a config naming a card is checked when it is read."""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30


@dataclass(frozen=True)
class Device:
    """Datasheet figures of a compute device; the planner's step-time model applies its efficiencies to them."""

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

    @property
    def has_figures(self) -> bool:
        """Whether the datasheet's speed figures are known (a card named by its memory alone has none)."""
        return self.tflops > 0


CARDS: dict[str, Device] = {
    "rtx-3060-12gb": Device("rtx-3060-12gb", 12 * GiB, 51.0, 360.0, 25.0),
    "rtx-3090": Device("rtx-3090", 24 * GiB, 71.0, 936.0, 25.0),
    "rtx-4090": Device("rtx-4090", 24 * GiB, 165.0, 1008.0, 25.0),
    # RTX 4060 Ti 16 GB (AD106, 34 SMs): 16 GB GDDR6 at 288 GB/s, ~44 TFLOPS dense bf16 tensor with fp32 accumulate
    # (the 4090's 165 scaled by SMs and clock); PCIe 4.0 x8, half the others' host link
    "rtx-4060-ti-16gb": Device("rtx-4060-ti-16gb", 16 * GiB, 44.2, 288.0, 12.5),
    # RTX 6000 Ada (AD102): 48 GB GDDR6 at 960 GB/s, 364.2 TFLOPS dense bf16 tensor (728.5 with sparsity); PCIe 4.0
    # x16, no NVLink: peers talk through PCIe
    "rtx-6000-ada": Device("rtx-6000-ada", 48 * GiB, 364.2, 960.0, 25.0),
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
