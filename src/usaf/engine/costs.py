"""The engine's memory rules, one function each, called by the engine where it allocates and by the planner's
ledger where it counts (`usaf.planner.ledger`): `select.density=auto` and `select.workspace_mb=auto` trust the
ledger, so a rule restated there and drifting here would be an out-of-memory error on a user's card, or an idle one.

| rule | the engine | the ledger's line |
|---|---|---|
| `VALUE_DTYPE`, `index_dtype`, `MOMENT_DTYPES` | `usaf.engine.sparse` (values, indices), `usaf.train.optim` (moments) | through `entry_bytes` |
| `keeps_base` | `usaf.prepare` and `usaf.export.apply_delta` (which entries keep their base) | through `entry_bytes`, "decay centres" |
| `entry_bytes`, `moment_bytes` | (the dtypes above) | "sparse state + optimizer", "sparse state beyond the experts", "routers (trainable)" |
| `bucket_limit` | `CompactAdamW._buckets`, `decay_toward_base` (`usaf.train.optim`) | "optimizer step temporaries" |
| `experts_per_chunk`, `chunk_experts` | `RoutingPlan.chunking`, `Chunking` (`usaf.engine.experts`) | "dequant workspace" |
| `decay_centre_bytes` | `base_lookup` (`usaf.train.optim`) holds what `keeps_base` leaves out | "decay centres" |

Activations have no rule of the engine's own: what a layer saves is autograd's business (and transformers'
checkpointing, `usaf.prepare.enable_recomputation`), so the ledger's "activations" lines stay its estimate
(`usaf.planner.ledger._layer_working_set`), checked against measured peaks by `bench/plan_accuracy.py`.
`tests/plan/test_planner_vs_engine.py` compares each line above with what a tiny model's training allocates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from usaf.config import OPTIMIZER_BUCKET_ENTRIES

VALUE_DTYPE = torch.float32  # trained values, and so their gradients: fp32 whatever the model's dtype
MOMENT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # optim.moments: Adam's moments of the values
EIGHT_BIT_MOMENT_BYTES = (
    1  # bitsandbytes' AdamW8bit: one byte a moment (its per-block scales are left out: 1/64 B)
)


def index_dtype(per_expert: int) -> torch.dtype:
    """The dtype of an element entry's index within its expert: int32 when a matrix has fewer than 2^31 entries
    (every known model), else int64."""
    return torch.int32 if per_expert < 2**31 else torch.int64


def keeps_base(element: bool, resident: bool) -> bool:
    """Whether trained entries keep their base values beside them: a resident store is overwritten with the
    trained values, so its entries must; whole lines (neuron granularity) always do; element entries of a quantized
    store do not (a dropped entry reads as its dequantized base again)."""
    return resident or not element


def moment_bytes(moments: str, eight_bit: bool, compact: bool = True) -> int:
    """Bytes of Adam's two moments per trained entry: 8-bit AdamW's, a compact group's at optim.moments, a plain
    group's (the routers: torch's AdamW) in fp32."""
    if eight_bit:
        return 2 * EIGHT_BIT_MOMENT_BYTES
    return 2 * (MOMENT_DTYPES[moments] if compact else torch.float32).itemsize


@dataclass(frozen=True)
class EntryBytes:
    """Bytes one trained entry costs, by component."""

    value: int
    index: int  # 0 for whole lines: one line id serves a whole row or column
    grad: int
    moments: int
    base: int  # the base value kept beside it (`keeps_base`), in the store's dtype; else 0

    @property
    def total(self) -> int:
        return self.value + self.index + self.grad + self.moments + self.base


def entry_bytes(element: bool, moments: str, eight_bit: bool, base_bytes: int) -> EntryBytes:
    """What a trained entry holds: its fp32 value and gradient, its index (element granularity), Adam's moments,
    and `base_bytes` of base value (0 where it keeps none)."""
    value = VALUE_DTYPE.itemsize
    index = index_dtype(0).itemsize if element else 0
    return EntryBytes(value, index, value, moment_bytes(moments, eight_bit), base_bytes)


def bucket_limit(largest: int) -> int:
    """Entries the optimizer updates together (and decays toward the base together): OPTIMIZER_BUCKET_ENTRIES, or
    two of the largest parameter (a layer's worth), so that a density that grows the parameters does not multiply
    the buckets. A bucket is never larger; its fp32 temporaries are the optimizer step's."""
    return max(OPTIMIZER_BUCKET_ENTRIES, 2 * largest)


def experts_per_chunk(workspace_bytes: int, bytes_per_expert: int) -> int:
    """Experts a workspace of `workspace_bytes` (select.workspace_mb) dequantizes at once, at least one."""
    return max(1, workspace_bytes // max(1, bytes_per_expert))


def chunk_experts(per_chunk: int, routed: float, num_experts: int) -> float:
    """Experts the largest chunk of a projection materializes when `routed` of its `num_experts` experts received
    tokens (the planner's is an expectation): up to `per_chunk - 1` routed ones and a scratch expert, so two at least,
    or every expert in order when all are routed and fit (see `usaf.engine.experts.Chunking`); none without rows."""
    if not routed:
        return 0
    return min(num_experts, min(routed_per_chunk(per_chunk), routed) + 1)


def routed_per_chunk(per_chunk: int) -> int:
    """Routed experts in a chunk that also holds the scratch expert."""
    return max(1, per_chunk - 1)


def decay_centre_bytes(entries: float, kept_base: bool, store_bytes: int) -> float:
    """Host bytes `optim.decay_to_base` holds for the centres of `entries` trained entries: none where they keep
    their base (it is the centre), else their starting values in the store's dtype, read once per selection."""
    return 0 if kept_base else entries * store_bytes
