"""What the config, the prepared store and the planner need to know of a frozen storage format, one per format."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Descriptor:
    name: str
    summary: str  # "<format>, <its constants>": the planner prints both halves
    bits: float  # stored bits per weight, codes and constants together
    # bytes per element a dequantization holds at its peak, its output included where it is alive then (int8's
    # fp32 codes and product, before the output; 0: the output alone, written directly by a kernel)
    temporaries: int
    published: bool = False  # read as a checkpoint publishes it; usaf never quantizes into it
    constants: dict = field(default_factory=dict)  # the format's block / group sizes
