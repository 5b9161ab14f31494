"""The real training step of a plan, run on fake tensors: what the card would hold and how often the host waits.

`simulate(config, plan)` builds the model at its full shape on fake tensors (`usaf.simulate.fake_model`), stored
as the plan chose (quant, residency, density, workspace, recomputation), prepares it with usaf's own
`prepare_model` (its calibration batch runs forward and backward through the engine with the gradient probes),
then runs usaf train's step (`usaf.train.loop.TrainingRun`'s: the objective's loss, backward, clipping, the
optimizer step) twice: the first warms up (optimizer moments, cached groupings), the second is measured.

The card is simulated on fake tensors of the `meta` device under `FakeTensorMode`, not fake `cuda` ones: a
CPU-only torch aborts the process in autograd on fake CUDA tensors (its device guard is not set). A tensor left
on the CPU still meets the card's tensors and raises `FakeTensorDeviceMismatchError`; a raw read of tensor data
(`.item()`, `.tolist()`) raises `DataDependentOutputException`. usaf's intended host reads go through
`usaf.kernels.host`, which the simulation answers with balanced values (every expert routed tokens x top-k / E
rows) and counts: a read of a card tensor is a host sync, and `.cpu()` copies are counted by
`usaf.testing.launches`' sync mode. The selection's choice itself (top-k over calibration scores, on the host) is
data-dependent: the simulation's strategy takes the plan's count of entries of every tensor, spread evenly over
its experts.

Under expert parallelism one rank is simulated on torch.distributed's `fake` process group (rank r of N):
the all-to-alls move nothing, and every rank is taken to send and receive the same rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections import Counter
from typing import ClassVar, NamedTuple

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorDeviceMismatchError,
    FakeTensorMode,
)

from usaf import kernels
from usaf.config import RunConfig
from usaf.engine import expert_parallel, loss
from usaf.engine.installed import row_observers, sparse_experts
from usaf.errors import ConfigError
from usaf.kernels import host
from usaf.model.layout import find_moe_layers
from usaf.model.targets import find_target_weights
from usaf.planner.sizes import format_size
from usaf.prepare import enable_recomputation, prepare_model
from usaf.registry import STRATEGIES
from usaf.selection import across_ranks, calibrate, reselect
from usaf.selection.budget import weight_budgets
from usaf.selection.reselect import Reselector
from usaf.selection.saved import Chosen
from usaf.selection.strategies import BaseStrategy, Needs
from usaf.simulate import fake_model
from usaf.simulate.memory import ACTIVATIONS, DEVICE, HOST, MemoryTracker
from usaf.store.offload import LayerStreamer
from usaf.store.quantized import QuantizedStore
from usaf.testing.launches import Counts, _SyncMode
from usaf.train import runtime
from usaf.train.objectives import OBJECTIVES
from usaf.train.optim import build_optimizer, clip_gradients, router_params

CARD = torch.device("meta")  # the simulated card (see the module's docstring: why not fake cuda)
STRATEGY = "simulated"

# the simulation's lines, each the ledger lines it stands for (usaf.planner.ledger's names)
FROZEN, CONSTANTS, DENSE = "frozen experts", "quantization constants", "dense weights"
SPARSE, ROUTERS, WORKSPACE = "sparse state + optimizer", "routers (trainable)", "dequant workspace"
PROBES, RESELECTION = "reselection probes", "reselection temporaries"
OFFLOAD, LOGITS, STEP, EXCHANGE = (
    "offload buffers",
    "logits chunk",
    "optimizer step temporaries",
    "all-to-all",
)
LEDGER_LINES = {
    FROZEN: ("frozen experts",),
    CONSTANTS: ("quantization constants",),
    DENSE: ("dense weights", "dense weights (FSDP2)"),
    SPARSE: ("sparse state + optimizer", "sparse state beyond the experts"),
    PROBES: ("reselection probes",),
    ROUTERS: ("routers (trainable)",),
    ACTIVATIONS: ("activations: layer inputs", "activations: one layer", "activations: all layers"),
    LOGITS: ("logits chunk",),
    WORKSPACE: ("dequant workspace",),
    OFFLOAD: ("offload buffers", "expert cache"),
    STEP: ("optimizer step temporaries",),
    EXCHANGE: ("all-to-all buffers", "all-reduce buckets"),
}


class SimulatedSelection(BaseStrategy):
    """The simulation's selection: the count of entries the density gives each tensor, spread evenly over its
    experts (the real choice reads calibration scores on the host, which fake tensors do not have)."""

    name, needs = STRATEGY, Needs()
    chosen: ClassVar[dict] = {}  # set by `simulate` before it prepares the model
    batches: ClassVar[list] = []

    def domains(self, units, budgets, context):
        raise NotImplementedError("the simulated selection loads its choice")

    def load(self, context):
        # the calibration pass runs as usaf train's does: forward and backward with the probes, nothing trained yet
        calibrate.calibrate(context.model, self.batches, len(self.batches), with_gradients=True)
        return self.chosen


@dataclasses.dataclass
class Simulation:
    """What the simulated step measured (bytes on the card and in host memory are live tensor bytes)."""

    device_peak: float  # live tensor bytes at the measured step's peak on the card
    device_lines: dict  # the simulation's lines at that peak
    device_line_max: dict  # each line's own largest live bytes in the measured step (not all at one moment)
    host_peak: float
    host_lines: dict
    calibration_peak: float  # the card's peak while preparing (the calibration batch)
    step_syncs: int
    layer_steps: int  # MoE layers run in the step (forward; a layer's backward is the same layer-step)
    sync_sites: Counter
    mismatches: list  # findings that stopped the step: a CPU tensor on the card, a raw read
    kernels: str  # which kernels ran, and why
    seconds: float
    rank: str
    reselection: str
    notes: list = dataclasses.field(default_factory=list)

    @property
    def layer_syncs(self) -> int:
        """The step's reads made inside an MoE layer (routing counts, expert parallelism's exchange counts)."""
        return sum(n for site, n in self.sync_sites.items() if site.endswith(", in a layer)"))

    @property
    def syncs_per_layer_step(self) -> float:
        """Layer reads / MoE layers: a layer's forward, its recomputation and its backward are one layer-step."""
        return self.layer_syncs / max(1, self.layer_steps)

    @property
    def per_step_syncs(self) -> int:
        """Reads made once a step, outside the layers (the loss's count, the gradient norm, the packed check)."""
        return self.step_syncs - self.layer_syncs


class _Reads:
    """The simulation's answer to usaf's intended host reads (`usaf.kernels.host`): the balanced value, counted."""

    def __init__(self, counts: Counts):
        self.counts = counts

    def __call__(self, tensor, kind, plausible):
        if tensor.device.type != "cpu":  # a read of the card's data: the host waits for the device
            self.counts.syncs += 1
            where = ", in a layer" if _in_layer() else ""
            self.counts.sync_sites[f"{_site()} (usaf.kernels.host {kind}{where})"] += 1
        return plausible()


# an MoE layer's forward (usaf's experts, expert parallelism's dispatch): the reads made within are a layer's
LAYER_FUNCTIONS = frozenset({"usaf_experts_forward", "expert_parallel_forward"})


def _in_layer() -> bool:
    import inspect

    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name in LAYER_FUNCTIONS:
            return True
        frame = frame.f_back
    return False


def _site() -> str:
    import inspect
    import os

    frame = inspect.currentframe().f_back.f_back
    here = os.path.dirname(os.path.abspath(host.__file__))
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if "usaf" in path and not path.startswith(here) and "simulate" not in path:
            return f"{path.rsplit('/src/', 1)[-1]}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _even_selection(model, select) -> dict:
    """{tensor key: Chosen}: every targeted tensor's count of entries (the experts' tensors and the other targeted
    weights: attention, embeddings, lm_head..., budgeted as `usaf.selection.budget.weight_budgets` budgets them),
    as flat indices evenly spread."""
    layers = find_moe_layers(model)
    units = []
    if "experts" in select.targets:
        for layer in layers:
            if select.layers is not None and layer.index not in select.layers:
                continue
            for t in layer.tensors:
                if not t.is_bias:
                    shape = getattr(layer.experts, t.name).shape
                    units.append(
                        _Unit(f"{layer.experts_name}.{t.name}", math.prod(shape), "experts", shape[0])
                    )
    for w in find_target_weights(model, layers, select.targets):
        if select.layers is None or w.layer_index in select.layers:
            units.append(_Unit(w.key, w.module.weight.numel(), w.target))
    budgets = weight_budgets(units, select)
    ep, chosen = expert_parallel.layout(), {}
    for u in units:
        start, stop, count = 0, u.numel, budgets[u.key]
        if ep is not None and u.experts:  # this rank's share: the entries of its own experts
            owned, per_expert = ep.owned(u.experts), u.numel // u.experts
            start, stop = owned.start * per_expert, owned.stop * per_expert
            count = round(count * len(owned) / u.experts)
        if count:
            chosen[u.key] = Chosen(None, torch.linspace(start, stop - 1, count).long())
    return chosen


class _Unit(NamedTuple):
    key: str
    numel: int
    target: str
    experts: int = 0  # an expert stack's experts (0: another weight)


class _OutputsOnly:
    """The gradient kernels as the simulation runs them: Triton's cannot run on fake tensors, nor can the torch
    path's sparse CSR products on the meta device, so their outputs stand in, at their shapes: what the Triton
    path holds on a GPU (no padded rows, no sparsity pattern)."""

    tracker: ClassVar[MemoryTracker | None] = None  # their outputs are the trained entries' gradients

    @classmethod
    def sampled_dots(cls, U, V, rows, local, entries, width):
        with cls.tracker.tagged(SPARSE):
            return torch.zeros(local.numel(), dtype=torch.float32, device=U.device)

    @classmethod
    def line_dots(cls, fixed, spanning, rows, lines, entries):
        with cls.tracker.tagged(SPARSE):
            return torch.zeros(lines.numel(), spanning.shape[1], dtype=torch.float32, device=fixed.device)


def _fused_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """`scaled_dot_product_attention` as a GPU runs it: one fused kernel (flash; memory-efficient with a mask or
    unequal head sizes) that keeps only its output and log-sum-exp, where the meta device, having no fused kernel,
    would take the math path and materialise the [batch, heads, seq, seq] scores and their softmax."""
    aten = torch.ops.aten
    if attn_mask is None and query.shape[-1] == key.shape[-1] == value.shape[-1]:
        # flash attends grouped key/value heads as they are (enable_gqa)
        flash = aten._scaled_dot_product_flash_attention
        return flash(query, key, value, dropout_p, is_causal, scale=scale)[0]
    if enable_gqa and key.shape[1] != query.shape[1]:
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~attn_mask, float("-inf")
            )
        attn_mask = attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    return aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale
    )[0]


KERNELS = (
    "gradient kernels (sampled_dots, line_dots): Triton's cannot run on fake tensors, nor can the torch path's "
    "sparse CSR products on the meta device: their outputs stand in at their shapes (the Triton path's memory); "
    "attention through scaled_dot_product_attention runs the GPU's fused op (flash, or memory-efficient with a "
    "mask), not the math path the meta device would take; grouped products and everything else run usaf's torch "
    "code"
)


FINDINGS = (FakeTensorDeviceMismatchError, DataDependentOutputException, DynamicOutputShapeException)


def _finding(err: Exception) -> str:
    """What stopped the step, where in usaf: a tensor on the wrong device, a raw read of tensor data, an output
    whose size depends on the data (each a host sync, or a failure, on a GPU)."""
    import traceback

    frames = [
        f
        for f in traceback.extract_tb(err.__traceback__)
        if "/usaf/" in f.filename and "/simulate/" not in f.filename and "/testing/" not in f.filename
    ]
    where = f"{frames[-1].filename.rsplit('/src/', 1)[-1]}:{frames[-1].lineno}" if frames else "?"
    kind = {
        FakeTensorDeviceMismatchError: "a tensor on another device than the card's",
        DataDependentOutputException: "a read of tensor data outside usaf.kernels.host (a hidden host sync)",
        DynamicOutputShapeException: "an output whose size depends on the data (a hidden host sync)",
    }[type(err)]
    return f"{where}: {kind} ({str(err).splitlines()[0][:160]})"


def _batch(vocab: int, batch: int, seq: int) -> dict:
    """A batch of synthetic token ids on the host, every position supervised (as a loader gives it)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, max(4, vocab), (batch, seq), generator=generator)
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(seq).repeat(batch, 1)}


def run_config(plan) -> RunConfig:
    """The run the plan planned: its sections, the autos resolved as the plan resolved them."""
    s = plan.settings
    run = RunConfig(**{f.name: getattr(s.run, f.name) for f in dataclasses.fields(s.run)})
    return run.replace(
        {
            "select.density": s.density if s.num_entries is None else run.select.density,
            "select.workspace_mb": s.workspace_mb,
            "train.recompute": bool(s.recompute),
            # a published checkpoint's format (mxfp4, fp8) is the checkpoint's, not a model.quant choice
            "model.quant": run.model.quant if s.published else s.quant,
            "model.residency": s.residency,
        }
    )


@contextlib.contextmanager
def _rank(gpus: int, ep: int, rank: int):
    """Rank `rank` of a `gpus`-process job on the fake process group, expert parallel over `ep` (none: 1 GPU)."""
    if gpus <= 1:
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=gpus, store=FakeStore())
    try:
        expert_parallel.join(ep)
        yield
    finally:
        expert_parallel.set_layout(None)
        dist.destroy_process_group()


PACKED_CHECK = "transformers masking_utils.find_packed_sequence_indices (is the batch packed? .all())"


def _patched(tracker: MemoryTracker, counts: Counts):
    """Tags for what the engine makes inside its own functions: each wrapped for the simulation only; attention as
    the GPU's fused kernel runs it (`_fused_attention`); transformers' packed-sequence check answered."""
    stack = contextlib.ExitStack()
    from transformers import masking_utils

    packed_check = masking_utils.find_packed_sequence_indices

    def unpacked(position_ids):
        # on a GPU transformers reads whether the position ids restart (a host sync, once a forward) and, when
        # they do not, attends with no mask (is_causal: the flash kernel); on fake tensors it cannot read them
        # and would build a [batch, 1, seq, seq] mask instead. The simulated batch is not packed: the answer is None
        if position_ids.device.type != "cpu":
            counts.syncs += 1
            counts.sync_sites[PACKED_CHECK] += 1
        return None

    masking_utils.find_packed_sequence_indices = unpacked
    stack.callback(setattr, masking_utils, "find_packed_sequence_indices", packed_check)

    # the fake process group stands for NCCL: collectives run on the card (under gloo they would run on the host,
    # and the copies there would be syncs a GPU job does not make, where its reads of the exchanged counts are)
    comm, ranks_comm = expert_parallel._comm_device, across_ranks.comm_device
    expert_parallel._comm_device = lambda group, like: CARD
    across_ranks.comm_device = lambda: CARD
    stack.callback(setattr, expert_parallel, "_comm_device", comm)
    stack.callback(setattr, across_ranks, "comm_device", ranks_comm)

    # expert parallelism: the stand-in selection is already this rank's share (`_even_selection`); the real
    # restriction is host work on the host's indices, which the fake ones cannot index by a mask
    keep_owned = expert_parallel.keep_owned
    expert_parallel.keep_owned = lambda chosen, stores: chosen
    stack.callback(setattr, expert_parallel, "keep_owned", keep_owned)

    def read(kind):
        counts.syncs += 1
        counts.sync_sites[
            f"usaf/selection/candidates.py {kind} (a score read on the host, once a probe window)"
        ] += 1

    def best_neurons(score, wanted):
        # the real one drops candidates scored -inf (a boolean index, its size the data's): balanced data scores
        # every neuron, so the `wanted` best stand
        read("best_neurons")
        return torch.topk(score.reshape(-1).cpu(), min(wanted, score.numel()), sorted=False).indices

    def best_rows(row_score, rows, wanted):
        if row_score is not None and wanted < rows:
            read("best_rows")
        return original_rows(row_score, rows, wanted)

    original_neurons, original_rows = reselect.best_neurons, reselect.best_rows
    reselect.best_neurons, reselect.best_rows = best_neurons, best_rows
    stack.callback(setattr, reselect, "best_neurons", original_neurons)
    stack.callback(setattr, reselect, "best_rows", original_rows)

    def wrap(owner, name, tag):
        original = getattr(owner, name)

        def tagged(*args, **kwargs):
            with tracker.tagged(tag):
                return original(*args, **kwargs)

        setattr(owner, name, tagged)
        stack.callback(setattr, owner, name, original)

    swap = torch.utils.swap_tensors

    def same_or_swap(t1, t2):
        # `Module.to` swaps each parameter with a new one even when nothing moves, and a fake tensor cannot be
        # swapped (the fake mode holds a weakref to it): where nothing changes there is nothing to swap
        unchanged = (t1.device, t1.dtype, t1.shape) == (t2.device, t2.dtype, t2.shape)
        if unchanged and t1.untyped_storage() is t2.untyped_storage():
            return None
        return swap(t1, t2)

    torch.utils.swap_tensors = same_or_swap
    stack.callback(setattr, torch.utils, "swap_tensors", swap)
    original = kernels._implementation
    _OutputsOnly.tracker = tracker
    kernels._implementation = lambda tensor: _OutputsOnly
    stack.callback(setattr, kernels, "_implementation", original)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = _fused_attention
    stack.callback(setattr, torch.nn.functional, "scaled_dot_product_attention", sdpa)
    wrap(QuantizedStore, "materialize", WORKSPACE)
    wrap(LayerStreamer, "_copy", OFFLOAD)
    wrap(LayerStreamer, "fetch", OFFLOAD)
    wrap(loss, "_chunk_loss_with_grads", LOGITS)
    wrap(expert_parallel.AllToAll, "forward", EXCHANGE)
    return stack


def _reselector(model, config, notes: list) -> tuple:
    """usaf train's Reselector (`usaf.train.parts.Reselection`'s), observing from the warm-up step on, or None
    with why not."""
    select = config.select
    if not select.reselect_every:
        return None, "off (select.reselect_every=0)"
    if config.optim.eight_bit:
        return None, "not simulated (8-bit optimizer state: usaf train refuses reselection with it)"
    return Reselector(model, select, config.schedule.max_steps, config.optim.eight_bit), "not reached"


def _reselect(reselector, step: int, optimizer, tracker: MemoryTracker, counts: Counts) -> str:
    """The reselection after the measured step (`Reselector.after_step`, usaf train's), its own peak on the card
    and host reads; where a data-dependent op stops it, what it reached and where it stopped."""
    tracker.reset_peak()
    before = counts.syncs
    try:
        with tracker.tagged(RESELECTION):
            done = reselector.after_step(step, optimizer)
    except FINDINGS as err:
        return (
            f"the probe window simulated (its probes live through the measured step); the reselection after it "
            f"stopped at {_finding(err)}"
        )
    return (
        f"simulated after the measured step ({done}): its peak {format_size(tracker.peak[DEVICE])} live on the "
        f"card, {counts.syncs - before} host reads"
    )


def _persistent(tracker: MemoryTracker, model, optimizer=None) -> None:
    """The model's own tensors under their lines: stores' parts, dense weights, trained values and their state."""
    routers = {id(p) for p in router_params(model)}
    trained = {id(p) for p in model.parameters() if p.requires_grad}
    for _, state in sparse_experts(model):
        for store in state.stores.values():
            holder = store.parts if isinstance(store, QuantizedStore) else None
            parts = getattr(holder, "parts", None) or getattr(holder, "host", None) or {}
            for part, t in parts.items():
                tracker.retag(t, FROZEN if part in ("data", "blocks") else CONSTANTS)
    for name, p in model.named_parameters():
        if id(p) in routers:
            tracker.retag(p, ROUTERS)
        elif id(p) in trained:
            tracker.retag(p, SPARSE)
        elif "experts" in name and p.dim() == 3:
            tracker.retag(p, FROZEN)
        else:
            tracker.retag(p, DENSE)
        if p.grad is not None:
            tracker.retag(p.grad, ROUTERS if id(p) in routers else SPARSE)
    for _, state in [*sparse_experts(model), *row_observers(model).items()]:
        for probe in state.probes.values():
            tracker.retag(probe.score, PROBES)
    for name, b in model.named_buffers():
        tracker.retag(b, SPARSE if ".usaf." in name or "usaf" in name.split(".")[-1] else DENSE)
    if optimizer is not None:
        for p, state in optimizer.state.items():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    tracker.retag(value, ROUTERS if id(p) in routers else SPARSE)


def simulate(plan, config_json: dict, rank: int = 0) -> Simulation:
    """Run the plan's training step on fake tensors (see the module's docstring)."""
    s = plan.settings
    config = run_config(plan)
    if config.select.granularity != "element":
        raise ConfigError("--simulate covers select.granularity=element only (neurons are chosen by score).")
    started = time.perf_counter()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[s.dtype]
    counts = Counts(method="simulated")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    tracker = MemoryTracker(CARD.type)
    objective = OBJECTIVES[config.train.objective]
    kernels.use("torch")  # Triton's kernels do not run on fake tensors (see `kernels`)
    # the stand-in selection, registered while the simulation runs (never a choice a run's config sees)
    registered = STRATEGY not in STRATEGIES
    if registered:
        STRATEGIES.register(SimulatedSelection())
    mismatches: list[str] = []
    notes: list[str] = []
    step = Counts()
    calibration_peak = 0
    device_peak, device_lines, line_max, reselection = 0, {}, {}, "not simulated"
    layers = 0
    try:
        with (
            _rank(s.gpus, s.expert_parallel, rank),
            mode,
            tracker,
            host.reading_with(_Reads(counts)),
            _patched(tracker, counts),
        ):
            model = fake_model.skeleton(config_json, dtype)
            fake_model.fake_weights(model, CARD)
            stores = fake_model.install_stores(model, s.quant, s.residency, CARD, s.cache_mb or 0)
            if config.train.recompute:
                enable_recomputation(model)
            vocab = model.get_input_embeddings().weight.shape[0]
            batch = _batch(vocab, config.data.batch_size, config.data.max_seq_len)
            select = dataclasses.replace(
                config.select, strategy=STRATEGY, density=float(config.select.density)
            )
            SimulatedSelection.chosen = _even_selection(model, select)
            SimulatedSelection.batches = [batch]
            _persistent(tracker, model)
            # the skeleton's experts were made on the card at the model's dtype before the stores replaced them
            # (58 GB at Qwen3-30B): the simulation's scaffolding, not what loading does, so the peak starts here
            tracker.reset_peak()
            # the trained values start from the source checkpoint's weights, read from disk to the card
            prepare_model(
                model,
                select,
                stores=stores,
                calibration_batches=[batch],
                original_values=lambda key, flat: torch.empty(flat.shape, dtype=dtype, device=flat.device),
            )
            calibration_peak = tracker.peak[DEVICE]
            optimizer = build_optimizer(model, config)
            _persistent(tracker, model, optimizer)
            layers = len(find_moe_layers(model))
            model.train()  # as the loop does before its steps: recomputation acts in training mode only
            # the meta device has no autocast: the forward computes in the model's dtype (the routers' fp32 masters
            # then compute in fp32, where autocast would cast them down)
            autocast = contextlib.nullcontext()
            if runtime.autocast_dtype(config.train.precision, dtype) is not None:
                notes.append(
                    "autocast is not simulated (the meta device has none): the forward runs in the model dtype"
                )
            reselector, reselection = _reselector(model, config, notes)
            # the measured step is the last of the first reselection's probe window (select.reselect_probe_steps
            # before it): the probes live through it, as the plan counts them
            step_number = config.select.reselect_every
            for index in range(2):  # a warm-up step, then the measured one
                if index:
                    if reselector is not None:
                        reselector.before_step(
                            step_number
                        )  # the probe window opens: probes on candidate lines
                    _persistent(tracker, model, optimizer)
                    tracker.reset_peak()
                    before = dataclasses.replace(counts, sync_sites=Counter(counts.sync_sites))
                with _SyncMode(counts, profiled=False, device=CARD):
                    device_batch = {k: v.to(CARD) for k, v in batch.items()}
                    if reselector is not None:
                        reselector.set_observing(True)
                    with autocast:
                        loss_sum, _ = objective.loss_sum(model, device_batch, config.train)
                    if reselector is not None:
                        reselector.set_observing(False)  # recomputation re-runs forwards: counted once
                    (loss_sum / device_batch["input_ids"].numel()).backward()
                    if reselector is not None:
                        reselector.after_backward()
                    _persistent(tracker, model)
                    clip_gradients(model, config.optim.clip_grad_norm)
                    with tracker.tagged(STEP):
                        optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            step = counts - before
            device_peak, device_lines = tracker.peak[DEVICE], dict(tracker.at_peak[DEVICE])
            line_max = {tag: n for (where, tag), n in tracker.line_max.items() if where == DEVICE and n}
            if reselector is not None:
                reselection = _reselect(reselector, step_number, optimizer, tracker, counts)
    except FINDINGS as err:
        mismatches.append(_finding(err))
    finally:
        if registered:
            STRATEGIES.unregister(STRATEGY)
    if not step.syncs and mismatches:  # stopped before the measured step's end: what was reached
        device_peak, device_lines = tracker.peak[DEVICE], dict(tracker.at_peak[DEVICE])
        line_max = {tag: n for (where, tag), n in tracker.line_max.items() if where == DEVICE and n}
    return Simulation(
        device_peak=device_peak,
        device_lines=device_lines,
        device_line_max=line_max,
        host_peak=tracker.peak[HOST],
        host_lines=dict(tracker.at_peak[HOST]),
        calibration_peak=calibration_peak,
        step_syncs=step.syncs,
        layer_steps=layers,
        sync_sites=step.sync_sites,
        mismatches=mismatches,
        kernels=KERNELS,
        seconds=time.perf_counter() - started,
        rank=f"rank {rank} of {s.gpus}" if s.gpus > 1 else "one GPU",
        reselection=reselection,
        notes=notes,
    )
