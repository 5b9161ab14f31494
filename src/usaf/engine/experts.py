"""The experts implementation usaf registers with transformers' ExpertsInterface.

One forward for every fused-experts family: route, run the up (or gate+up) projection, the family's own gate or
activation, the down projection, the optional post-expert norm, and weight by the router. Each projection is a
`SparseGroupedLinear`: a grouped matmul over the routed experts' effective weights (frozen base with the trained
values written in), whose backward gives the input gradient through those weights and value gradients only at
the trained entries.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from usaf import kernels
from usaf.engine.costs import experts_per_chunk, routed_per_chunk
from usaf.engine.sparse import ElementEntries
from usaf.engine.state import SparseState
from usaf.kernels import Segments
from usaf.model.hf import gated_activation, register_experts_implementation
from usaf.model.layout import input_projection

IMPLEMENTATION_NAME = "usaf"


class RoutingPlan:
    """Token-expert pairs sorted by expert: which token each row is, and how many rows each expert has."""

    def __init__(
        self,
        top_k_index: torch.Tensor,
        num_experts: int,
        sources: list[int] | None = None,
        owned: range | None = None,
        counts: list[int] | None = None,
    ):
        flat = top_k_index.reshape(-1)
        self.num_tokens, self.num_top_k = flat.numel() // top_k_index.shape[-1], top_k_index.shape[-1]
        self.expert_of_row, self.order = torch.sort(flat, stable=True)
        self.token_of_row = torch.div(self.order, self.num_top_k, rounding_mode="floor")
        self._inverse: torch.Tensor | None = None
        # the one host sync of a layer: padding, chunking and the portable grouped product need the counts
        # (`owned`: the only experts the ids can name, an expert-parallel rank's: where balanced data puts rows)
        # (`counts`: the rows per expert where the caller already read them: expert parallelism's exchange)
        self.rows = Segments.of(self.expert_of_row, num_experts, owned, counts)
        self._chunkings: dict[int | None, Chunking] = {}
        # expert parallelism: the pairs came from several ranks, `sources[s]` consecutive ones from rank s
        self.sources = sources
        self._source_masks: list[torch.Tensor] | None = None

    def source_masks(self) -> list[torch.Tensor | None]:
        """[rows, 1] masks of the rows from each source rank (expert parallelism), or [None]: one source. A
        gradient probe sums magnitudes per micro-batch, and each rank's rows are its own micro-batch's. Made on
        first use, once per plan: every projection's backward shares them."""
        if self.sources is None:
            return [None]
        if self._source_masks is None:
            device = self.order.device
            ranks = torch.arange(len(self.sources), device=device)
            counts = torch.tensor(self.sources, device=device)
            # output_size: its size is known (every row came from one source), or torch reads it back to the host
            source_of_row = torch.repeat_interleave(ranks, counts, output_size=self.order.numel())[self.order]
            self._source_masks = [(source_of_row == s).unsqueeze(-1) for s in range(len(self.sources))]
        return self._source_masks

    @property
    def inverse(self) -> torch.Tensor:
        """Each token-expert pair's row (the inverse of `order`): made on first use, which only a GPU's
        deterministic sum makes (see `sum_rows_into_tokens`)."""
        if self._inverse is None:
            self._inverse = torch.empty_like(self.order)
            self._inverse[self.order] = torch.arange(self.order.numel(), device=self.order.device)
        return self._inverse

    def chunking(self, resident: bool, bytes_per_expert: int, workspace_bytes: int) -> Chunking:
        """How a projection's routed experts are materialized: a resident store is used whole (grouped matmul
        skips empty experts); otherwise only experts that received tokens, as many at a time as fit the
        workspace. Made once per plan and workspace: the forward and the backward share it."""
        per_chunk = None if resident else experts_per_chunk(workspace_bytes, bytes_per_expert)
        if per_chunk not in self._chunkings:
            self._chunkings[per_chunk] = Chunking(self.rows, per_chunk)
        return self._chunkings[per_chunk]


@dataclass
class Chunk:
    """Routed experts materialized together: `expert_ids` (None: the whole resident stack), their rows r0:r1 of
    the plan, grouped per materialized expert (`matmul_rows`), and `slots` (None: `expert_ids` is every expert in
    order): [E] on the device, each expert's position among `expert_ids`, or the scratch expert's for experts not
    in the chunk (see `Chunking`)."""

    expert_ids: list[int] | None
    r0: int
    r1: int
    matmul_rows: Segments
    slots: torch.Tensor | None = None


class Chunking:
    """A plan's routed experts cut into chunks of at most `per_chunk` experts (None: one chunk, the whole resident
    stack).

    Where every expert is routed and they all fit, the one chunk is the whole stack in order, and trained values are
    written as into a resident stack. Otherwise each chunk is up to `per_chunk - 1` routed experts and one scratch
    expert (a copy of a routed expert's data, so its fetch stays a slice where the routed experts are consecutive):
    a tensor's trained values are written into a chunk with one scatter over all of them, each landing in its
    expert's slot or, for an expert not in the chunk, in the scratch one. That costs a fixed number of ops per
    chunk, whatever the routing (no ragged gather of a chunk's entries), and the scratch expert has no rows.

    Everything the chunks need is made here once, for the forward and the backward: row offsets and slot tables
    travel to the device in one transfer. The chunks partition the plan's rows in order (experts without rows are
    not materialized), so chunk outputs join with one concatenation."""

    def __init__(self, rows: Segments, per_chunk: int | None):
        if per_chunk is None:
            self.chunks = [Chunk(None, 0, rows.total, rows)]
            return
        experts = rows.num_segments
        active = [e for e, c in enumerate(rows.counts) if c]
        if len(active) == experts and per_chunk >= experts:
            self.chunks = [Chunk(active, 0, rows.total, rows)]
            return
        if not active:  # no rows at all: nothing to materialize
            self.chunks = []
            return
        take = routed_per_chunk(per_chunk)  # with the scratch expert
        groups = [active[i : i + take] for i in range(0, len(active), take)]
        counts = [[rows.counts[e] for e in group] + [0] for group in groups]
        host = [o for c in counts for o in (0, *itertools.accumulate(c))]
        for group in groups:
            slot = dict(zip(group, range(len(group)), strict=True))
            host.extend(slot.get(e, len(group)) for e in range(experts))
        pieces = kernels.host_ints_to_device(host, rows.offsets.device).split(
            [len(c) + 1 for c in counts] + [experts] * len(groups)
        )
        scratch = [later[0] for later in groups[1:]] + [groups[-1][-1]]  # the next chunk's first, else a copy
        offsets, slots = pieces[: len(groups)], pieces[len(groups) :]
        self.chunks = [
            Chunk([*group, extra], rows.start(group[0]), rows.start(group[-1] + 1), Segments(o, c), s)
            for group, extra, c, o, s in zip(groups, scratch, counts, offsets, slots, strict=True)
        ]

    def split(self, t: torch.Tensor) -> list[torch.Tensor]:
        """t's rows per chunk (views)."""
        if len(self.chunks) == 1:
            return [t]
        return list(t.split([c.r1 - c.r0 for c in self.chunks]))

    @staticmethod
    def join(parts: list[torch.Tensor], empty) -> torch.Tensor:
        """The chunks' outputs as one [rows, ...] tensor (`empty()` when there are no rows at all)."""
        return empty() if not parts else parts[0] if len(parts) == 1 else torch.cat(parts)


class Projection:
    """One projection of an experts module: its frozen store, trained entries, and optional bias."""

    def __init__(
        self, store, entries, bias_store, bias_entries, transposed: bool, workspace_bytes: int, probe=None
    ):
        self.store, self.entries, self.probe = store, entries, probe
        self.bias_store, self.bias_entries = bias_store, bias_entries
        self.transposed = transposed
        self.workspace_bytes = workspace_bytes

    def weights(self, chunk: Chunk) -> torch.Tensor:
        """Effective weights [k, A, B] of a chunk (the whole patched stack for a resident store)."""
        if chunk.expert_ids is None:
            return self.store.full()  # already patched once per forward, see `SparseGroupedLinear.forward`
        weight = self.store.materialize(chunk.expert_ids)
        if self.entries is not None:
            self.entries.write_into(weight, chunk.slots)
        return weight

    def chunking(self, plan: RoutingPlan) -> Chunking:
        _, a, b = self.store.shape
        bytes_per_expert = a * b * self.store.dtype.itemsize
        return plan.chunking(self.store.resident, bytes_per_expert, self.workspace_bytes)


def sum_rows_into_tokens(rows: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """[rows, H] in routing order -> [tokens, H], each token the sum of its top-k rows."""
    if rows.device.type == "cpu":  # one pass, and deterministic on the CPU
        return rows.new_zeros(plan.num_tokens, rows.shape[1]).index_add_(0, plan.token_of_row, rows)
    # index_add_ on CUDA sums in a racing order: gather by the inverse permutation, then sum the k copies
    return rows.index_select(0, plan.inverse).view(plan.num_tokens, plan.num_top_k, -1).sum(dim=1)


class TokensToRows(torch.autograd.Function):
    """rows = tokens[token_of_row]: each token's hidden state once per routed expert, grouped by expert.

    Autograd's own backward for indexing is a generic scatter-add; knowing each token has exactly k rows, the
    backward is `sum_rows_into_tokens`, and the two classes here are each other's adjoint.
    """

    @staticmethod
    def forward(ctx, tokens, plan: RoutingPlan):
        ctx.plan = plan
        return tokens.index_select(0, plan.token_of_row)

    @staticmethod
    def backward(ctx, grad_rows):
        return sum_rows_into_tokens(grad_rows, ctx.plan), None


class RowsToTokens(torch.autograd.Function):
    """tokens = the sum of each token's rows (the experts' outputs, already weighted by routing)."""

    @staticmethod
    def forward(ctx, rows, plan: RoutingPlan):
        ctx.plan = plan
        return sum_rows_into_tokens(rows, plan)

    @staticmethod
    def backward(ctx, grad_tokens):
        return grad_tokens.index_select(0, ctx.plan.token_of_row), None


class SparseGroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, values, bias_values, proj: Projection, plan: RoutingPlan):
        ctx.x_dtype = x.dtype
        x = kernels.cast(x, proj.store.dtype)
        if proj.store.resident and proj.entries is not None:
            proj.entries.write_into(proj.store.full(), None)
        out_dim = proj.store.shape[2] if proj.transposed else proj.store.shape[1]
        out = _through_chunks(proj, plan, x, backward=False, empty=lambda: x.new_zeros(0, out_dim))
        if proj.bias_store is not None:
            bias = proj.bias_store.full()
            if proj.bias_entries is not None:
                proj.bias_entries.write_into(bias, None)
            out = out + bias.view(bias.shape[0], -1)[plan.expert_of_row]
        ctx.proj, ctx.plan = proj, plan
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        proj, plan = ctx.proj, ctx.plan
        need_x, need_values, need_bias = ctx.needs_input_grad[:3]
        gy = kernels.cast(grad_out, x.dtype)
        grad_x = grad_values = None
        if need_x:
            if proj.store.regathered and proj.store.resident and proj.entries is not None:
                proj.entries.write_into(
                    proj.store.full(), None
                )  # gathered afresh (see DenseStore.regathered)
            grad_x = _through_chunks(proj, plan, gy, backward=True, empty=lambda: torch.zeros_like(x))
        # the trained entries' gradients need no weights: one call over every expert's rows, whatever the chunks
        U, V = (x, gy) if proj.transposed else (gy, x)
        if need_values:
            grad_values = proj.entries.add_grad(None, U, V, plan.rows, 0)
            if grad_values is None:  # no entries among the routed experts
                grad_values = torch.zeros_like(proj.entries.values)
        if proj.probe is not None:
            for mask in plan.source_masks():
                proj.probe.accumulate(U if mask is None else U * mask, V, plan.rows, 0)
        grad_bias = None
        if need_bias:
            entries: ElementEntries = proj.bias_entries
            per_expert = gy.new_zeros(entries.shape[0], gy.shape[1], dtype=torch.float32)
            per_expert.index_add_(0, plan.expert_of_row, kernels.cast(gy, torch.float32))
            grad_bias = per_expert.view(-1)[entries.flat_indices]
        if grad_x is not None:
            grad_x = kernels.cast(grad_x, ctx.x_dtype)
        return grad_x, grad_values, grad_bias, None, None


def _through_chunks(
    proj: Projection, plan: RoutingPlan, rows: torch.Tensor, backward: bool, empty
) -> torch.Tensor:
    """`rows` (grouped by expert) times each routed expert's effective weights, chunk by chunk: the forward
    product, or (backward) the input gradient's through the transposed weights; `empty()` when no rows."""
    chunking = proj.chunking(plan)
    parts = []
    for chunk, part in zip(chunking.chunks, chunking.split(rows), strict=True):
        weight = proj.weights(chunk)
        # [k, in, out] forward, [k, out, in] for the input gradient
        oriented = weight.transpose(1, 2) if proj.transposed == backward else weight
        parts.append(kernels.grouped_matmul(part, oriented, chunk.matmul_rows))
    return Chunking.join(parts, empty)


class ObserveGradient(torch.autograd.Function):
    """Identity that hands the intermediate activation and its gradient to observers in backward.

    The activation is saved through autograd, not held by a hook's closure: under per-layer recomputation it is
    recomputed with its layer instead of staying alive from the forward to the backward (which held every
    layer's [rows, I] activation and undid recomputation for it). The node is inserted whenever observers exist,
    active or not, so that a recomputed forward saves the same tensors as the original."""

    @staticmethod
    def forward(ctx, h, on_grad):
        ctx.on_grad = on_grad
        ctx.save_for_backward(h)  # always: the original forward and its recomputation save alike
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad_h):
        if ctx.on_grad:
            (h,) = ctx.saved_tensors
            for fn in ctx.on_grad:
                fn(h, grad_h)
        return grad_h, None


class SparseExperts(SparseState):
    """usaf's state on one experts module: trained entries per tensor (as submodules) and the frozen stores."""

    is_expert_stack, observes_rows, target = True, False, "experts"

    def __init__(self, stores: dict, entries: dict, transposed: bool, workspace_bytes: int):
        # Trainer and save_pretrained read (and restore) the experts' own parameters: SparseState keeps them the
        # effective weights (written before a state dict is taken, and after one is loaded).
        super().__init__(stores, entries)
        # callables (state, plan, top_k_weights, intermediate) run in each forward; one may return a function
        # (intermediate, its gradient) that the backward calls (see `ObserveGradient`)
        self.observers: list = []
        self.transposed = transposed
        self.workspace_bytes = workspace_bytes
        self.num_experts = next(iter(stores.values())).shape[0]
        self.placement = None  # expert parallelism's `usaf.engine.expert_parallel.ExpertLayout`, when enabled

    def projection(self, name: str) -> Projection:
        bias = name + "_bias"
        return Projection(
            self.stores[name],
            self.entries_of(name),
            self.stores.get(bias),
            self.entries_of(bias),
            self.transposed,
            self.workspace_bytes,
            self.probes.get(name),
        )

    def project(self, name: str, x: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
        proj = self.projection(name)
        values = proj.entries.values if proj.entries is not None else None
        bias_values = proj.bias_entries.values if proj.bias_entries is not None else None
        return SparseGroupedLinear.apply(x, values, bias_values, proj, plan)


def usaf_experts_forward(
    self, hidden_states, top_k_index, top_k_weights, sources: list[int] | None = None, counts=None
):
    """Drop-in for transformers' experts forward (same signature and result as `grouped_mm`). `sources`: under
    expert parallelism, how many consecutive pairs came from each rank; `counts`: the rows per expert, already
    read there."""
    state: SparseExperts = self.usaf
    owned = state.placement.owned(state.num_experts) if state.placement is not None else None
    plan = RoutingPlan(top_k_index, state.num_experts, sources, owned, counts)
    x = TokensToRows.apply(hidden_states, plan)
    h = state.project(input_projection(self), x, plan)
    h = gated_activation(self, h) if self.has_gate else self.act_fn(h)
    if state.observers:
        on_grad = [
            f for observe in state.observers if (f := observe(state, plan, top_k_weights, h)) is not None
        ]
        if h.requires_grad:
            h = ObserveGradient.apply(h, on_grad)
    routing_weights = top_k_weights.reshape(-1, 1)[plan.order]  # [rows, 1]
    linear_down = "down_proj_bias" not in state.stores and not self.has_post_expert_norm
    if linear_down and h.shape[-1] <= hidden_states.shape[-1]:
        # weighting a linear map's input is weighting its output, and the input is the narrower (I <= H)
        y = state.project("down_proj", h * routing_weights, plan)
    else:
        y = state.project("down_proj", h, plan)
        if self.has_post_expert_norm:
            y = self.post_expert_norm(y)
        y = y * routing_weights
    out = RowsToTokens.apply(y, plan)
    return kernels.cast(out, hidden_states.dtype)


def register() -> None:
    """Make "usaf" a valid `experts_implementation` (idempotent)."""
    register_experts_implementation(IMPLEMENTATION_NAME, usaf_experts_forward)
