"""Memory and step-time planner: will a sparse fine-tune of this MoE fit, where, and how fast - from config.json alone.

Parameter shapes come from the transformers skeleton built on the meta device (exact and generic: the engine's own
`find_moe_layers` tells experts and routers apart); model types transformers does not know fall back to formulas
over the config's fields. The ledger models what the usaf engine allocates, with the engine's own rules where it
has them (`usaf.engine.costs`: bytes per entry, optimizer buckets, workspace chunks, decay centres):

- frozen experts at the stores' own layouts (`usaf.quant`), where the residency keeps them (device, pinned host
  memory, memory map), and their quantization constants;
- dense weights in the compute dtype (`--quant-dense` stores them as int8 on disk; loading dequantizes them);
- the sparse state: per trained entry the fp32 value, its int32 index within its expert, the fp32 gradient and
  the optimizer moments (bf16 by default, `usaf.train.optim`): 16 B; entries of a resident (unquantized) weight also
  keep their base value, the only copy left once the trained values are written into it;
- routers, trained densely in fp32 as the engine trains them (`make_routers_fp32`: an fp32 master weight in place
  of the model-dtype one, fp32 gradient and moments);
- activations with per-layer recomputation: every layer's input, plus one layer's working set (what autograd saves
  in the recomputed layer: frozen linear layers save nothing, so it is attention's q/k/v/output and the routed
  experts' gathered input, gate/up output, activation, product and down output);
- one chunk of logits (the loss is computed chunk by chunk and recomputed in backward);
- the dequantized routed-expert workspace and, when streaming, two layers of quantized experts on the device;
- the framework: the CUDA context and allocator slack on a GPU; the runtime's first-step warm-up on the CPU.

Transient items live in phases (a layer's backward, the loss chunk, the optimizer step); the peak is the persistent
sum plus the largest phase. `bench/plan_accuracy.py` checks the CPU model against measured peaks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from usaf.engine.costs import (
    VALUE_DTYPE,
    EntryBytes,
    bucket_limit,
    chunk_experts,
    decay_centre_bytes,
    entry_bytes,
    experts_per_chunk,
    keeps_base,
    moment_bytes,
)
from usaf.errors import ConfigError
from usaf.kernels.torch_path import MIN_PADDED_ROWS, PADDING_FACTOR
from usaf.planner.settings import (
    COMPUTE_EFFICIENCY,
    CPU_IMPORTS,
    CPU_WARMUP,
    CUDA_CONTEXT,
    DISK_GBPS,
    DTYPE_BYTES,
    GPU_ALLOCATOR_SLACK,
    GPU_HOST_FRAMEWORK,
    MEMORY_EFFICIENCY,
    Device,
    PlanSettings,
)
from usaf.planner.shape import ModelShape
from usaf.planner.sizes import GiB, MiB, format_count, format_size
from usaf.quant import descriptor, get_format
from usaf.registry import TARGET_KINDS

# ---- the ledger -----------------------------------------------------------------------------------------------

PERSISTENT = frozenset()
# the experts' rows padded to the longest expert's: its rows at twice the mean (measured with a91143d; the engine's
# bound, 16x, caps one group of experts and is reached only by routing far more uneven)
ROUTING_SPREAD = 2
DENSE_WEIGHTS = "dense weights"
SHARDED_DENSE_WEIGHTS = "dense weights (FSDP2)"  # distributed.shard_dense: what a rank holds of them
LAYER, LOSS, STEP = "layer backward", "loss chunk", "optimizer step"


@dataclass
class LedgerLine:
    name: str
    device: float = 0.0  # bytes on the compute device (RAM on the CPU)
    host: float = 0.0  # bytes of host RAM besides (GPU devices only)
    detail: str = ""
    phases: frozenset = PERSISTENT  # transient items: the phases they are alive in; empty: always

    @property
    def persistent(self) -> bool:
        return not self.phases


@dataclass
class StepTime:
    compute_s: float
    memory_s: float
    streaming_s: float
    flops: float

    @property
    def seconds(self) -> float:
        return max(self.compute_s, self.memory_s, self.streaming_s)  # prefetching overlaps the three

    @property
    def dominant(self) -> str:
        terms = {
            "compute": self.compute_s,
            "memory traffic": self.memory_s,
            "host->device streaming": self.streaming_s,
        }
        return max(terms, key=terms.get)


@dataclass
class Traffic:
    """Bytes one rank exchanges per optimizer step with several GPUs (zero with one)."""

    all_reduce_buffer: float = 0.0  # the trained gradients summed across ranks
    all_reduce_sent: float = 0.0  # what a ring all-reduce sends (and receives) of it per rank
    all_to_all_sent: float = 0.0  # expert parallel: token states and expert outputs leaving the rank
    peer_gbps: float = 0.0  # the GPU-to-GPU rate the times below assume
    expert_all_reduce: float = (
        0.0  # the part of all_reduce_buffer that is expert entries, summed over DP replicas
    )

    @property
    def all_reduce_s(self) -> float:
        return self.all_reduce_sent / (self.peer_gbps * 1e9) if self.peer_gbps else 0.0

    @property
    def all_to_all_s(self) -> float:
        return self.all_to_all_sent / (self.peer_gbps * 1e9) if self.peer_gbps else 0.0


@dataclass
class Plan:
    shape: ModelShape
    settings: PlanSettings
    device: Device
    vram: int
    ram: int
    lines: list[LedgerLine]
    step: StepTime
    imports: float = 0.0  # the part of the device peak that is the imported libraries (CPU)
    notes: list[str] = field(default_factory=list)
    traffic: Traffic = field(default_factory=Traffic)
    host_ram: int = 0  # the whole host's RAM, which `ram` (this rank's share) was cut from; 0: the same

    @property
    def device_peak(self) -> float:
        return _peak(self.lines, "device")[0]

    @property
    def peak_phase(self) -> str:
        return _peak(self.lines, "device")[1]

    @property
    def host_peak(self) -> float:
        return _peak(self.lines, "host")[0]

    @property
    def device_budget(self) -> int:
        return self.vram if self.device.is_gpu else self.ram

    @property
    def fits(self) -> bool:
        host_ok = not self.device.is_gpu or self.host_peak <= self.ram
        return self.device_peak <= self.device_budget and host_ok

    @property
    def replicated_dense(self) -> float:
        """The device bytes every rank holds whatever it trains or offloads: the whole dense weights (FSDP2 would
        shard them) and, on a GPU, the runtime's context."""
        dense = sum(line.device for line in self.lines if line.name == DENSE_WEIGHTS)
        return dense + (CUDA_CONTEXT if self.device.is_gpu else 0)


def _peak(lines: list[LedgerLine], where: str) -> tuple[float, str]:
    persistent = sum(getattr(line, where) for line in lines if line.persistent)
    best, best_phase = 0.0, ""
    for phase in sorted({p for line in lines for p in line.phases}):
        size = sum(getattr(line, where) for line in lines if phase in line.phases)
        if size > best:
            best, best_phase = size, phase
    return persistent + best, best_phase


def stored_bytes(matrices, quant: str, dtype_bytes: int) -> tuple[float, float]:
    """(payload, constants) of matrices ((count, rows, cols), ...) in a usaf store format."""
    import torch

    if quant == "none":
        return float(sum(n * r * c for n, r, c in matrices) * dtype_bytes), 0.0
    payload = constants = 0.0
    for count, rows, cols in matrices:
        for part, (dtype, shape) in get_format(quant).layout(rows, cols, torch.bfloat16).items():
            numel = 1
            for size in shape:
                numel *= size
            nbytes = count * numel * torch.empty((), dtype=dtype).element_size()
            if part in ("data", "blocks"):  # the values (codes); the rest are their constants
                payload += nbytes
            else:
                constants += nbytes
    return payload, constants


def trained_entries(shape: ModelShape, settings: PlanSettings) -> int:
    """Trained entries in the targeted weights of the trained layers (neuron granularity rounds each layer's expert
    budget to whole neurons: about the same)."""
    return sum(_entries_by_kind(shape, settings))


def _entries_by_kind(shape: ModelShape, s: PlanSettings) -> tuple[int, int]:
    """(expert entries, entries of the other targets): `density` of each, or `num_entries` split by size (as
    `usaf.prepare` spreads a global budget), over the layers `layers` names."""
    experts, others = _eligible(shape, s)
    density = _density(shape, s)
    return round(density * experts), round(density * others)


def _eligible(shape: ModelShape, s: PlanSettings) -> tuple[float, float]:
    """(expert weights, weights of the other targets) that the selection chooses among."""
    moe_share, decoder_share = _layer_shares(shape, s)
    experts = (shape.expert_weights + shape.expert_biases) * moe_share if "experts" in s.targets else 0
    others = 0.0
    for target, params in shape.target_params.items():
        if target in s.targets:
            # the embedding and the output layer lie outside the decoder layers: frozen when layers are named
            outside = TARGET_KINDS[target].outside_layers
            others += params * (
                0.0 if outside and s.layers is not None else 1.0 if outside else decoder_share
            )
    return experts, others


def _density(shape: ModelShape, s: PlanSettings) -> float:
    """The share of every eligible weight trained: `density`, or `num_entries` over all of them."""
    if s.num_entries is None:
        return s.density
    eligible = sum(_eligible(shape, s))
    return min(1.0, s.num_entries / eligible) if eligible else 0.0


def _largest_trained_tensor(shape: ModelShape, s: PlanSettings) -> float:
    """Entries of the largest trained values tensor (the optimizer's bucket rule reads it): one layer's largest
    fused expert tensor, or the embedding or the output layer where they are trained (not when `layers` is set)."""
    candidates = (
        [shape.num_experts * shape.largest_expert_matrix * _expert_share(s)] if "experts" in s.targets else []
    )
    if s.layers is None:
        candidates += [shape.target_params.get(t, 0) for t in ("embeddings", "lm_head") if t in s.targets]
    return _density(shape, s) * max(candidates, default=0)


def _layer_shares(shape: ModelShape, s: PlanSettings) -> tuple[float, float]:
    """The shares of the MoE layers and of all decoder layers that `layers` trains (both 1 when unset)."""
    if s.layers is None:
        return 1.0, 1.0
    named = len({i for i in s.layers if 0 <= i < shape.num_layers})  # usaf train refuses non-MoE numbers
    return min(1.0, named / max(1, shape.num_moe_layers)), named / max(1, shape.num_layers)


def trained_router_params(shape: ModelShape, settings: PlanSettings) -> int:
    if "routers" not in settings.targets:
        return 0
    return round(shape.router_params * _layer_shares(shape, settings)[0])


class _Ledger:
    """The lines and notes of one plan as its sections add them."""

    def __init__(self, gpu: bool):
        self.gpu = gpu
        self.lines: list[LedgerLine] = []
        self.notes: list[str] = []

    def add(self, name, size, detail, where="device", phases=PERSISTENT) -> None:
        on_host = self.gpu and where == "host"  # on the CPU, host memory is the device's own
        self.lines.append(
            LedgerLine(name, 0.0 if on_host else size, size if on_host else 0.0, detail, phases)
        )


def plan(
    shape: ModelShape, settings: PlanSettings, device: Device, vram: int | None = None, ram: int | None = None
) -> Plan:
    """The ledger (per rank, with several GPUs), peak, step time and traffic of one configuration."""
    s, gpu = settings, device.is_gpu
    vram = (device.memory if vram is None else vram) if gpu else 0
    ram = machine_ram() if ram is None else ram
    ep = s.expert_parallel
    if shape.num_experts % ep:
        raise ConfigError(
            f"--expert-parallel over {ep} GPUs needs a number of experts divisible by {ep}; "
            f"{shape.name} has {shape.num_experts} experts per layer: give an --expert-parallel that divides "
            f"{shape.num_experts}."
        )
    residency = s.residency if gpu or s.residency != "host" else "device"  # host memory is the CPU's own
    ledger, host_ram = _Ledger(gpu), ram
    if s.gpus > 1 and gpu:  # the ranks of one host share its RAM: each plans against its share
        sharing = s.ranks_per_host
        ledger.notes.append(
            f"host RAM {format_size(ram)} is shared by the {sharing} ranks of a host: {format_size(ram // sharing)} "
            "a rank (--gpus-per-host)"
        )
        ram //= sharing
    stored = _frozen_weights(ledger, shape, s, residency, _shards_dense(shape, s, gpu, vram if gpu else ram))
    trained = _sparse_state(ledger, shape, s)
    _activations(ledger, shape, s)
    _workspace(ledger, shape, s, residency, stored)
    _gradient_kernels(ledger, shape, s, trained)
    traffic = _parallel(ledger, shape, s, trained, device)
    _framework(ledger, shape, s, residency, trained)
    result = Plan(
        shape,
        s.replace(residency=residency),
        device,
        vram,
        ram,
        ledger.lines,
        _step_time(shape, s, device, residency, ram),
        notes=ledger.notes,
        traffic=traffic,
        host_ram=host_ram,
    )
    result.imports = 0.0 if gpu else CPU_IMPORTS
    return result


def _expert_share(s: PlanSettings) -> float:
    """The share of every expert a rank holds: 1/EP under expert parallelism, else all of them."""
    return 1 / s.expert_parallel


def _shards_dense(shape: ModelShape, s: PlanSettings, gpu: bool, budget: int) -> bool:
    """Whether FSDP2 shards the dense weights over the ranks (`usaf.train.shard_dense`): distributed.shard_dense,
    where auto is on exactly when the dense weights whole on every rank (and a GPU's context) exceed the budget."""
    if s.gpus == 1 or s.shard_dense is False:
        return False
    whole = (shape.dense_params + shape.router_params) * DTYPE_BYTES[s.dtype]
    return s.shard_dense is True or whole + (CUDA_CONTEXT if gpu else 0) > budget


def _sharded_dense(shape: ModelShape, s: PlanSettings) -> tuple[float, str]:
    """(parameters, detail) a rank holds of the dense weights FSDP2 shards over the `gpus` ranks: 1/N of them, the
    largest unit gathered whole while it runs (a decoder layer, the input embeddings or the output layer), and
    what stays whole on every rank (the routers, and embeddings tied to the output layer)."""
    head = shape.target_params.get("lm_head", 0)
    tied = shape.embedding_params if not head else 0  # a tied table serves two units: whole on every rank
    sharded = shape.dense_params - tied
    layer = max(0, shape.dense_params - shape.embedding_params - head) / max(1, shape.num_layers)
    gathered = max(layer, head, shape.embedding_params - tied)
    held = sharded / s.gpus + gathered + tied + shape.router_params
    detail = (
        f"{format_count(sharded)} attention/embedding/norm/shared parameters sharded over {s.gpus} GPUs by FSDP2 "
        f"(distributed.shard_dense), {format_count(sharded / s.gpus)} a rank, + {format_count(gathered)} of "
        f"the largest unit gathered while it runs + {format_count(tied + shape.router_params)} whole on every "
        f"rank (routers{', tied embeddings' if tied else ''}), {s.dtype}"
    )
    return held, detail


def _frozen_weights(
    ledger: _Ledger, shape: ModelShape, s: PlanSettings, residency: str, sharded: bool
) -> float:
    """Frozen experts (where the residency keeps them) and dense weights; the experts' stored bytes on this rank."""
    d, share = DTYPE_BYTES[s.dtype], _expert_share(s)
    payload, constants = stored_bytes(shape.expert_matrices, s.quant, d)
    payload += shape.expert_biases * d  # biases stay in the dtype
    bits = 8 * (payload + constants) / max(1, shape.expert_weights)
    payload, constants = payload * share, constants * share
    held = (
        f"{shape.num_experts // s.expert_parallel} of {shape.num_experts} experts (expert parallel over "
        f"{s.expert_parallel} GPUs)"
        if s.expert_parallel > 1
        else f"{shape.num_experts} experts"
    )
    experts_detail = (
        f"{shape.num_moe_layers} layers x {held}, {format_count(shape.expert_weights * share)} "
        f"weights, {descriptor(s.quant).summary} ({bits:.2f} bits/weight)"
    )
    if residency == "mmap":
        ledger.add(
            "frozen experts",
            0,
            experts_detail + f"; memory-mapped ({format_size(payload + constants)} on disk)",
        )
    else:
        where = "host" if residency == "host" else "device"
        pinned = ", pinned host memory" if where == "host" else ""
        ledger.add("frozen experts", payload, experts_detail + pinned, where)
        if constants:
            ledger.add(
                "quantization constants", constants, descriptor(s.quant).summary.split(", ", 1)[1], where
            )

    name, dense = DENSE_WEIGHTS, shape.dense_params + shape.router_params
    dense_detail = f"{format_count(dense)} attention/embedding/norm/shared parameters and routers, {s.dtype}"
    if sharded:
        name, (dense, dense_detail) = SHARDED_DENSE_WEIGHTS, _sharded_dense(shape, s)
    elif s.gpus > 1:
        dense_detail += ", whole on every rank (distributed.shard_dense shards them with FSDP2)"
    if s.quant_dense:
        dense_detail += " (--quant-dense stores linear layers as int8 on disk; loading dequantizes them)"
    ledger.add(name, dense * d, dense_detail)
    return payload + constants


@dataclass
class _Trained:
    """What this rank trains: expert entries, entries of other weights, router weights."""

    experts: float
    beyond: int
    routers: int


def _entry_cost(s: PlanSettings, element: bool, resident: bool) -> EntryBytes:
    """What one trained entry costs in this run (`usaf.engine.costs.entry_bytes`): resident weights keep the base."""
    base = DTYPE_BYTES[s.dtype] if keeps_base(element, resident) else 0
    return entry_bytes(element, s.run.optim.moments, s.run.optim.eight_bit, base)


def _cost_detail(cost: EntryBytes) -> str:
    index = f", int32 index {cost.index}" if cost.index else ""
    return f"value {cost.value}{index}, grad {cost.grad}, moments {cost.moments}"


def _sparse_state(ledger: _Ledger, shape: ModelShape, s: PlanSettings) -> _Trained:
    """The trained values with their indices, gradients and moments; reselection's probes; the routers."""
    entries, beyond = _entries_by_kind(shape, s)
    if beyond:  # entries of attention, embeddings, ...: elements of resident weights, which keep their base
        cost = _entry_cost(s, element=True, resident=True)
        targets = ", ".join(
            t
            for t in s.targets
            if t in TARGET_KINDS and not (s.layers is not None and TARGET_KINDS[t].outside_layers)
        )
        ledger.add(
            "sparse state beyond the experts",
            beyond * cost.total,
            f"{format_count(beyond)} entries of {targets} x {cost.total} B ({_cost_detail(cost)}, base "
            f"{cost.base}: resident weights are written into)",
        )
    entries = entries * _expert_share(s)  # expert entries live with their experts
    _expert_state(ledger, s, entries)
    if s.reselect:
        # a probe window (select.reselect_probe_steps before each reselection) sums |gradient| over candidate
        # lines: oversample x the share regrown x the entries, fp32, largest at the first reselection
        share = s.run.select.oversample * s.run.select.reselect_fraction
        ledger.add(
            "reselection probes",
            int(4 * share * (entries + beyond)),
            f"candidates' gradient sums during a probe window: {share:g} x the trained entries x 4 B "
            "(select.oversample x select.reselect_fraction, at the first reselection)",
        )
    routers = trained_router_params(shape, s)
    d, router_moments = DTYPE_BYTES[s.dtype], moment_bytes("fp32", s.run.optim.eight_bit, compact=False)
    master = VALUE_DTYPE.itemsize
    ledger.add(
        "routers (trainable)",
        routers * (master - d + master + router_moments),
        f"{format_count(routers)} parameters in fp32: master weight +{master - d} B over the dense weights' {d} B, "
        f"grad {master} B, moments {router_moments} B",
    )
    return _Trained(entries, beyond, routers)


def _expert_state(ledger: _Ledger, s: PlanSettings, entries: float) -> None:
    """The expert entries' state and, where they keep no base, the centres optim.decay_to_base holds for them."""
    d, element, resident = DTYPE_BYTES[s.dtype], s.granularity == "element", s.quant == "none"
    cost = _entry_cost(s, element, resident)
    if not cost.base:
        kept = ", no base (the quantized store gives it back)"
    else:
        kept = f", base {cost.base}" + ("" if element else "; whole neurons need no per-entry index")
    ledger.add(
        "sparse state + optimizer",
        entries * cost.total,
        f"{format_count(entries)} entries x {cost.total} B ({_cost_detail(cost)}{kept})",
    )
    if s.run.optim.decay_to_base and (centres := decay_centre_bytes(entries, bool(cost.base), d)):
        ledger.add(
            "decay centres",
            centres,
            f"{format_count(entries)} entries x {d} B: the starting values optim.decay_to_base pulls toward, read "
            "once per selection from the quantized base and kept in host memory",
            where="host",
        )
    if element and entries:
        old_bytes = 4 + d + 8 + 8 + 4 + (2 if s.optimizer == "adamw8bit" else 8)
        ledger.notes.append(
            f"{cost.total} B per trained expert entry where usaf 0.1.0 kept {old_bytes} (an int64 flat index, "
            f"cached int32 rows and columns, a base copy, fp32 moments): "
            f"{format_size(entries * (old_bytes - cost.total))} freed at this density"
        )


def _activations(ledger: _Ledger, shape: ModelShape, s: PlanSettings) -> None:
    """Saved activations (with or without per-layer recomputation) and the loss's logits chunk."""
    d, tokens = DTYPE_BYTES[s.dtype], s.seq * s.batch
    inputs = (shape.num_layers + 1) * tokens * shape.hidden_size * d
    working = tokens * _layer_working_set(shape, d)
    if s.recompute:
        ledger.add(
            "activations: layer inputs",
            inputs,
            f"{shape.num_layers + 1} x {tokens} tokens x {shape.hidden_size} x {d} B, kept for recomputation",
            phases=frozenset({LAYER, LOSS}),
        )
        ledger.add(
            "activations: one layer",
            working,
            f"what a recomputed layer saves for backward: attention q/k/v/output, {shape.experts_per_token} routed "
            "experts' gathered input, gate/up, activation, product and output",
            phases=frozenset({LAYER}),
        )
    else:
        ledger.add(
            "activations: all layers",
            inputs + shape.num_layers * working,
            f"{shape.num_layers} layers' saved tensors (no recomputation)",
            phases=frozenset({LAYER, LOSS}),
        )
    chunk = min(s.logits_chunk, s.batch * (s.seq - 1))
    # the chunk's fp32 log-softmax, its incoming gradient and its input gradient (12 B per logit), and
    # the final hidden states sliced, masked and their gradient
    ledger.add(
        "logits chunk",
        chunk * shape.vocab_size * 12 + 3 * tokens * shape.hidden_size * d,
        f"{chunk} tokens x {shape.vocab_size} vocab x 12 B, its backward run at once (usaf.engine.loss)",
        phases=frozenset({LOSS}),
    )


def _workspace(ledger: _Ledger, shape: ModelShape, s: PlanSettings, residency: str, stored: float) -> None:
    """The dequantized routed-expert workspace and the streaming buffers."""
    d, tokens = DTYPE_BYTES[s.dtype], s.seq * s.batch
    if s.quant != "none" or residency != "device":
        routed, workspace = _routed_experts(shape, s, tokens), s.workspace_mb * MiB
        held = shape.num_experts // s.expert_parallel
        # each projection's largest chunk as the engine cuts it (usaf.engine.costs), the largest of them
        elements = max(
            chunk_experts(experts_per_chunk(workspace, rows * cols * d), routed, held) * rows * cols
            for _, rows, cols in shape.expert_matrices
        )
        ledger.add(
            "dequant workspace",
            # the last chunk (d) and the one being built: its dequantization's peak, its output included (the
            # output alone for a kernel that writes it directly)
            elements * (d + max(d, descriptor(s.quant).temporaries)),
            f"routed experts of one projection in chunks of <= {s.workspace_mb} MB (one expert at least, and a "
            "scratch expert): the chunk being built at its dequantization's peak while the last is alive",
            phases=frozenset({LAYER}),
        )
    if residency in ("host", "mmap"):
        ledger.add(
            "offload buffers",
            2 * stored / max(1, shape.num_moe_layers),
            "two layers of quantized experts: the current and the prefetched",
        )
        if s.cache_mb:
            ledger.add(
                "expert cache",
                _cached(s, stored),
                f"model.cache_mb={s.cache_mb}: the most-routed experts kept on the device, not streamed again "
                "(usaf.store.offload)",
            )


def _cached(s: PlanSettings, stored: float) -> float:
    """Bytes of this rank's stored experts that model.cache_mb keeps on the device (with host or mmap residency)."""
    return min(s.cache_mb * MiB, stored)


def _gradient_kernels(ledger: _Ledger, shape: ModelShape, s: PlanSettings, trained: _Trained) -> None:
    """What usaf.kernels' PyTorch path adds (a CPU's; a GPU with Triton has neither): each expert's rows padded to
    the longest in fp32, and each element selection's block-diagonal pattern."""
    if ledger.gpu:
        return
    rows = s.seq * s.batch * shape.experts_per_token
    # the experts x the longest expert's rows: ROUTING_SPREAD x the rows, within the bound on one group of experts
    # (usaf.kernels.torch_path), which only routing far more uneven reaches
    padded = min(ROUTING_SPREAD * rows, max(MIN_PADDED_ROWS, PADDING_FACTOR * rows))
    width = shape.hidden_size + 2 * shape.moe_intermediate  # gate/up's two sides, the widest pair
    ledger.add(
        "sampled-gradient padding",
        padded * width * 4,
        f"~ {padded} padded rows ({ROUTING_SPREAD} x the routed rows) x ({shape.hidden_size} + 2 x "
        f"{shape.moe_intermediate}) x 4 B: one projection's routed rows laid out per expert for one sampled product",
        phases=frozenset({LAYER}),
    )
    if s.granularity == "element":
        entries = trained.experts + trained.beyond
        ledger.add(
            "sampled-gradient patterns",
            4 * entries,
            f"{format_count(entries)} entries x 4 B: each selection's int32 columns, derived once, kept until it changes",
        )


def _parallel(
    ledger: _Ledger, shape: ModelShape, s: PlanSettings, trained: _Trained, device: Device
) -> Traffic:
    """With several GPUs: the buffers each rank adds and the bytes it exchanges per optimizer step."""
    if s.gpus == 1:
        return Traffic()
    d, tokens, ep, dp = DTYPE_BYTES[s.dtype], s.seq * s.batch, s.expert_parallel, s.data_parallel
    # the gradients summed in fp32 (usaf.train.distributed.GradientReducer): routers and the entries of other
    # weights over every rank; a rank's expert entries over the DP group holding the same experts (all ranks
    # without expert parallelism, none but the owner without data parallelism)
    everywhere = trained.beyond + trained.routers + (trained.experts if ep == 1 else 0)
    replicas = trained.experts if ep > 1 and dp > 1 else 0
    reduced = everywhere + replicas
    detail = f"{format_count(reduced)} trained gradients in fp32 flat buckets"
    if replicas:
        detail += f" ({format_count(replicas)} of this rank's experts, summed over their {dp} replicas)"
    ledger.add(
        "all-reduce buckets",
        4 * reduced,
        detail + ", sent as the last backward completes them",
        phases=frozenset({LAYER, LOSS}),
    )
    all_to_all = 0.0
    if ep > 1:
        # each (token, expert) pair's hidden state out and its expert output home, activations in the compute dtype
        pairs = tokens * shape.experts_per_token
        ledger.add(
            "all-to-all buffers",
            2 * pairs * shape.hidden_size * d,
            f"{pairs} (token, expert) pairs x {shape.hidden_size} x {d} B, sent and received in one MoE layer",
            phases=frozenset({LAYER}),
        )
        passes = 3 if s.recompute else 2  # forward, backward, and the recomputed forward
        all_to_all = 2 * passes * shape.num_moe_layers * pairs * shape.hidden_size * d * (ep - 1) / ep
    sent = _ring(s.gpus) * 4 * everywhere + _ring(dp) * 4 * replicas
    return Traffic(4 * reduced, sent, all_to_all, device.peer_gbps, 4 * replicas)


def _ring(ranks: int) -> float:
    """The share of its buffer a ring all-reduce over `ranks` sends (and receives) per rank."""
    return 2 * (ranks - 1) / ranks


def _framework(
    ledger: _Ledger, shape: ModelShape, s: PlanSettings, residency: str, trained: _Trained
) -> None:
    """Optimizer-step temporaries, the runtime's own memory, load staging."""
    d = DTYPE_BYTES[s.dtype]
    if not ledger.gpu:
        ledger.add("framework: imports", CPU_IMPORTS, "Python, torch and transformers after import")
        ledger.add(
            "framework: warm-up", CPU_WARMUP, "first step: model code, thread pools, oneDNN/MKL buffers"
        )
        ledger.notes.append(
            "CPU: glibc's malloc keeps freed memory mapped when its mmap threshold grows; set "
            "MALLOC_MMAP_THRESHOLD_=131072 for the peak above (the default can hold up to twice as much)"
        )
        return
    values = trained.experts + trained.beyond
    if s.optimizer == "adamw":  # a bucket at a time: fp32 moments, denominator, rounding noise
        # the largest bucket usaf.train.optim may cut
        bucket = min(values, bucket_limit(round(_largest_trained_tensor(shape, s))))
        step_bytes = 16 * bucket + 4 * trained.routers
        step_detail = (
            f"bf16 moments widened to fp32 for a bucket of <= {format_count(bucket)} values at a time; the routers' "
            "foreach square roots"
        )
    else:
        step_bytes = 4 * (values + trained.routers)
        step_detail = "AdamW's foreach kernels copy the moments' square roots of a whole group"
    ledger.add("optimizer step temporaries", step_bytes, step_detail, phases=frozenset({STEP}))
    transient = _peak([line for line in ledger.lines if not line.persistent], "device")[0]
    ledger.add(
        "framework overhead",
        CUDA_CONTEXT + GPU_ALLOCATOR_SLACK * transient,
        f"CUDA/HIP context and kernels {format_size(CUDA_CONTEXT)} + caching-allocator slack "
        f"{GPU_ALLOCATOR_SLACK:.0%} of the transients",
    )
    ledger.add("framework (host)", GPU_HOST_FRAMEWORK, "Python, torch, transformers, GPU runtime", "host")
    if residency == "mmap":
        ledger.notes.append(
            "mmap: the experts page in from the prepared store; host memory beyond this ledger speeds "
            "streaming as page cache"
        )
    _, rows, cols = max(shape.expert_matrices, key=lambda m: m[1] * m[2])
    largest_part = sum(stored_bytes(((shape.num_experts, rows, cols),), s.quant, d)) * _expert_share(s)
    ledger.add(
        "load staging",
        2 * largest_part,
        "loading: one stored tensor read and its device or pinned copy",
        "host",
        phases=frozenset({"load"}),
    )


def _routed_experts(shape: ModelShape, s: PlanSettings, tokens: int) -> float:
    """Expected distinct experts of this rank that receive tokens in one layer (uniform routing): of all of them
    from the rank's `tokens`, or under expert parallelism of its E/EP from the `tokens` of every rank of its group."""
    e, k, ep = shape.num_experts, shape.experts_per_token, s.expert_parallel
    return e / ep * (1 - (1 - k / e) ** (tokens * ep))


def _layer_working_set(shape: ModelShape, d: int) -> float:
    """Bytes per token a recomputed decoder layer holds at its peak: the end of its recomputed forward, with the
    gradient of its output already there (usaf.engine.experts' forward, non-reentrant checkpointing):

    - attention: q and k before and after rotary embedding, v, the attention output; the residual sum and the
      post-attention norm's output (the trained router's input); fp32 copies where the norms upcast a narrower dtype;
    - router: logits and fp32 probabilities;
    - per routed pair: the gathered input, gate/up output, activation and product, the down output, the weighted
      output, its gather back to token order and the incoming gradient (5 hidden + 4 expert widths), four int64
      routing indices and the routing weight;
    - shared experts, or a dense layer's MLP: gate, up and activation outputs.
    """
    h = shape.hidden_size
    attention = (2 * shape.q_width + 2 * shape.k_width + shape.v_width + shape.o_width + 2 * h) * d
    if d < 4:
        attention += 4 * (2 * h + ((shape.q_width + shape.k_width) if shape.qk_norm else 0))
    router = shape.num_experts * (d + 4)
    routed = shape.experts_per_token * ((5 * h + 4 * shape.moe_intermediate) * d + 4 * 8 + d)
    moe_layer = attention + router + routed + 3 * shape.shared_intermediate * d
    dense_layer = (
        attention + 3 * shape.dense_intermediate * d if shape.num_layers > shape.num_moe_layers else 0
    )
    return max(moe_layer, dense_layer)


def _step_time(shape: ModelShape, s: PlanSettings, device: Device, residency: str, ram: int) -> StepTime:
    """Three forward-equivalents (forward, recomputation, input-gradient backward: the frozen base has no weight
    gradients) at a share of peak throughput, against the bytes each pass moves and the streaming of experts."""
    tokens, d = s.seq * s.batch, DTYPE_BYTES[s.dtype]
    active = shape.dense_matmul + shape.expert_weights * shape.experts_per_token / max(1, shape.num_experts)
    full_context = s.seq / 2  # causal: a query sees half the sequence on average
    window = min(full_context, shape.sliding_window or s.seq)
    attention = (
        2
        * (shape.q_width + shape.o_width)
        * (
            (shape.softmax_attention_layers - shape.sliding_layers) * full_context
            + shape.sliding_layers * window
        )
    )
    forward = tokens * (2 * active + attention)
    sparse_grads = (
        2 * trained_entries(shape, s) * tokens * shape.experts_per_token / max(1, shape.num_experts)
    )
    # an objective's forwards without gradients (DPO's reference log-probabilities; KTO's three): on the same weights
    passes = 3 + s.reference_forward
    flops = passes * forward + sparse_grads
    if not device.has_figures:  # a card known by its memory alone: no time is quoted for it
        return StepTime(0.0, 0.0, 0.0, flops)
    compute_s = flops / (device.tflops * 1e12 * COMPUTE_EFFICIENCY)
    # each pass reads the routed experts' weights: quantized ones are read, written in the dtype and read again
    payload, constants = stored_bytes(shape.expert_matrices, s.quant, d)
    per_weight = ((payload + constants) / shape.expert_weights + 2 * d) if s.quant != "none" else d
    routed = _routed_experts(shape, s, tokens) / max(1, shape.num_experts) * shape.expert_weights
    memory_s = (
        passes
        * (routed * per_weight + shape.dense_matmul * d)
        / (device.memory_gbps * 1e9 * MEMORY_EFFICIENCY)
    )
    streaming_s = 0.0
    if residency in ("host", "mmap") and device.is_gpu:
        rate = device.link_gbps
        if (
            residency == "mmap" and payload + constants > ram / 2
        ):  # the page cache cannot hold them: disk reads
            rate = min(rate, DISK_GBPS)
        # forward, then backward (recomputation shares it), and DPO's reference forward: the rank's experts, but
        # those model.cache_mb keeps on the device (uniform routing: the cache's share of them, no more)
        held = (payload + constants) * _expert_share(s)
        streaming_s = (passes - 1) * (held - _cached(s, held)) / (rate * 1e9)
    return StepTime(compute_s, memory_s, streaming_s, flops)


def machine_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GiB


# ---- verdict and the search for settings that fit ------------------------------------------------------------
