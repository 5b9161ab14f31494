"""Expert parallelism (EP): each rank of an EP group holds 1/ep of every MoE layer's experts (docs/distributed.md).

The job is a (dp, ep) mesh of ranks: world = ep x dp. The ranks g*ep ... g*ep + ep - 1 form EP group g and
split every MoE layer's experts among them, EP rank e owning the contiguous block e*E/ep ... (e+1)*E/ep - 1; the
ranks with the same EP rank form a DP group and hold the same experts (replicas, whose gradients are summed).

Every rank routes its own tokens with its own copy of the router (data parallel over tokens). In each MoE layer
the (token, expert) pairs, with their router weights, travel all-to-all to the ranks owning their experts; the
owner runs usaf's engine on them (`usaf_experts_forward`: dequantize-and-matmul of its own experts with the trained
entries written in, weighted by the router there, so observers see the true weights); a second all-to-all brings
the outputs home, where they are summed per token. Backward runs the exchanges in reverse (`AllToAll`), so an
expert's value gradients arise only on its owner: the trained entries of experts are never all-reduced over the EP
group (only over the DP replicas of them). Router and non-expert gradients are summed over all ranks as in data
parallelism.

A rank's frozen store holds only its experts (`QuantizedStore.owned`, read by slice in `usaf.base.load`), and its
sparse state only their trained entries (`keep_owned`), with global indices: keys and indices mean what they mean in
one process. Statistics that selection reads are made global with `expert_sum` (`usaf.selection`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from usaf.engine.experts import usaf_experts_forward
from usaf.engine.installed import sparse_experts
from usaf.engine.sparse import line_flat_indices
from usaf.engine.state import owned_state
from usaf.errors import ConfigError, ModelError
from usaf.kernels import offsets_of
from usaf.kernels.host import balanced, read_ints
from usaf.model.hf import register_experts_implementation, use_experts_implementation
from usaf.model.layout import find_moe_layers

IMPLEMENTATION_NAME = "usaf-expert-parallel"

# bytes of token states and expert outputs (and their gradients) that left this rank in the all-to-alls: the
# latest optimizer step's and the run's (bench/distributed.py reads them); routing ids and weights apart
traffic = {"last_step_bytes": 0, "total_bytes": 0, "routing_bytes": 0, "steps": 0, "_at_step_start": 0}


@dataclass(frozen=True)
class ExpertLayout:
    """Where this rank sits in an expert-parallel job: world = ep x dp ranks, as a (dp, ep) device mesh (global
    rank = dp_rank * ep + ep_rank). `ep_group`/`dp_group`: their process groups."""

    ep: int
    dp: int
    ep_rank: int
    dp_rank: int
    ep_group: object = None
    dp_group: object = None

    def owned(self, num_experts: int) -> range:
        """The experts of a layer with `num_experts` this rank holds."""
        per_rank = num_experts // self.ep
        return range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank)

    def owner(self, expert: int, num_experts: int) -> int:
        """The EP rank holding `expert`."""
        return expert // (num_experts // self.ep)


_LAYOUT: ExpertLayout | None = None


def layout() -> ExpertLayout | None:
    """The expert-parallel layout of this process (None: no expert parallelism, every rank holds every expert)."""
    return _LAYOUT


def set_layout(new: ExpertLayout | None) -> None:
    """Install (or, with None, drop) this process's layout; `join` does it for a torchrun job."""
    global _LAYOUT
    _LAYOUT = new


def join(ep: int, timeout: timedelta | None = None) -> ExpertLayout | None:
    """Carve the started process group into the (dp, ep) mesh and install this rank's layout (ep 1: none). Its
    groups wait `timeout` for a peer, as the job's own group does (None: torch's default)."""
    if ep <= 1:
        set_layout(None)
        return None
    world = dist.get_world_size()
    if world % ep:
        raise ConfigError(
            f"distributed.expert_parallel={ep} must divide the job's {world} processes (world = expert_parallel x "
            f"data-parallel replicas): use torchrun --nproc_per_node={ep} (or a multiple of {ep})."
        )
    rank, dp = dist.get_rank(), world // ep
    mesh = torch.arange(world).view(dp, ep)  # rows: EP groups; columns: DP groups
    # every rank creates every group, in the same order (torch.distributed requires it)
    ep_groups = [dist.new_group(row.tolist(), timeout=timeout) for row in mesh]
    dp_groups = [dist.new_group(column.tolist(), timeout=timeout) for column in mesh.T]
    found = ExpertLayout(ep, dp, rank % ep, rank // ep, ep_groups[rank // ep], dp_groups[rank % ep])
    set_layout(found)
    return found


def check_experts(num_experts: int, where: str) -> None:
    """The layout's EP size must divide a layer's experts."""
    ep = layout()
    if ep is not None and num_experts % ep.ep:
        raise ConfigError(
            f"distributed.expert_parallel={ep.ep} must divide the experts of every MoE layer; {where} has "
            f"{num_experts}: choose an expert_parallel that divides {num_experts}."
        )


# ---- the exchange ---------------------------------------------------------------------------------------------


class AllToAll(torch.autograd.Function):
    """Rows sent in blocks of `send` rows to each rank, `recv` rows received from each; backward sends the gradients
    back the way the rows came. `counted`: whether the bytes leaving this rank go to `traffic`."""

    @staticmethod
    def forward(
        ctx, rows: torch.Tensor, send: list[int], recv: list[int], group, counted: bool
    ) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group, ctx.counted = send, recv, group, counted
        _count(rows, send, group, counted)
        out = rows.new_empty(sum(recv), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        _count(grad_out, ctx.recv, ctx.group, ctx.counted)
        grad = grad_out.new_empty(sum(ctx.send), *grad_out.shape[1:])
        dist.all_to_all_single(grad, grad_out.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return grad, None, None, None, None


def _count(rows: torch.Tensor, send: list[int], group, counted: bool) -> None:
    me = dist.get_rank(group)
    leaving = (sum(send) - send[me]) * (rows[0].numel() if rows.shape[0] else 0) * rows.element_size()
    traffic["total_bytes" if counted else "routing_bytes"] += leaving


def close_step() -> None:
    """At the end of an optimizer step: the step's all-to-all bytes become `traffic["last_step_bytes"]`."""
    traffic["last_step_bytes"] = traffic["total_bytes"] - traffic["_at_step_start"]
    traffic["_at_step_start"] = traffic["total_bytes"]
    traffic["steps"] += 1


def _exchange_counts(experts: torch.Tensor, num_experts: int, ep: ExpertLayout, group) -> tuple:
    """(send, recv, served): the pairs this rank sends each rank of the group, the pairs each rank sends it, and
    how many of the pairs it serves each of its own experts gets, from one host read: the pairs per expert are
    exchanged (each rank receives the counts of its own experts from every rank), then this rank's counts and the
    received ones are read at once (balanced routing: every rank routes alike)."""
    per_rank = num_experts // ep.ep
    counts, _ = offsets_of(experts, num_experts)  # this rank's pairs per (global) expert
    counts = counts.to(_comm_device(group, experts))
    received = torch.empty_like(counts)  # [source rank, own expert]
    dist.all_to_all_single(received, counts, group=group)
    owned = ep.owned(num_experts)

    def plausible():
        mine = balanced(experts.numel(), num_experts)
        return mine + [mine[e] for _ in range(ep.ep) for e in owned]

    both = read_ints(torch.cat([counts, received]), plausible)
    mine, got = both[:num_experts], both[num_experts:]
    send = [sum(mine[r * per_rank : (r + 1) * per_rank]) for r in range(ep.ep)]
    recv = [sum(got[s * per_rank : (s + 1) * per_rank]) for s in range(ep.ep)]
    served = [0] * num_experts
    for j, e in enumerate(owned):
        served[e] = sum(got[s * per_rank + j] for s in range(ep.ep))
    return send, recv, served


def expert_parallel_forward(self, hidden_states, top_k_index, top_k_weights):
    """Drop-in for the experts forward: this rank's tokens in, their combined expert outputs out."""
    ep: ExpertLayout = self.usaf.placement
    group, per_rank = ep.ep_group, self.usaf.num_experts // ep.ep
    top_k = top_k_index.shape[-1]
    experts = top_k_index.reshape(-1)
    owner = torch.div(experts, per_rank, rounding_mode="floor")
    order = torch.argsort(owner, stable=True)  # pairs grouped by the rank that owns their expert
    token = torch.div(order, top_k, rounding_mode="floor")
    # one host read a layer's forward: what goes where, and the rows each of this rank's experts will serve
    send, recv, served = _exchange_counts(experts, self.usaf.num_experts, ep, group)
    # out: each pair's token state, its expert and its router weight; in: the pairs this rank's experts serve
    rows = AllToAll.apply(hidden_states.index_select(0, token), send, recv, group, True)
    experts_in = AllToAll.apply(experts[order], send, recv, group, False)
    weights = AllToAll.apply(top_k_weights.reshape(-1)[order], send, recv, group, False)
    outputs = usaf_experts_forward(self, rows, experts_in.unsqueeze(-1), weights.unsqueeze(-1), recv, served)
    home = AllToAll.apply(outputs, recv, send, group, True)
    combined = hidden_states.new_zeros(hidden_states.shape[0], home.shape[-1], dtype=home.dtype)
    return combined.index_add(0, token, home).to(hidden_states.dtype)


def _comm_device(group, like: torch.Tensor) -> torch.device:
    """Where the group's collectives run: a CUDA device under NCCL (which takes no CPU tensor: a statistic kept on
    the host travels through this rank's GPU), the CPU under gloo."""
    if dist.get_backend(group) != "nccl":
        return torch.device("cpu")
    return like.device if like.device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())


def enable(model: nn.Module) -> None:
    """Switch a prepared model's experts to expert-parallel dispatch over the EP group of this rank's `layout()`
    (`prepare_model` does it when a layout is installed; call it yourself only on a model prepared without one)."""
    ep = layout()
    if ep is None:
        raise ModelError(
            "expert parallelism needs a layout: join the job first (usaf.engine.expert_parallel.join)."
        )
    layers = find_moe_layers(model)
    for layer in layers:
        state = owned_state(layer.experts)
        if state is None or not state.is_expert_stack:
            raise ModelError(
                "expert parallelism runs usaf's engine: call usaf.prepare_model on the model first."
            )
        check_experts(state.num_experts, layer.experts_name)
        state.placement = ep
    register_experts_implementation(IMPLEMENTATION_NAME, expert_parallel_forward)
    use_experts_implementation(model, [layer.experts for layer in layers], IMPLEMENTATION_NAME)


# ---- what a rank keeps, and statistics made global ------------------------------------------------------------


def owned_mask(shape, axis: int | None, indices: torch.Tensor, owned: range) -> torch.Tensor:
    """Which of a selection's `indices` (flat indices, or line ids along `axis`) of an [E, A, B] tensor lie in the
    `owned` experts."""
    flat = indices if axis is None else line_flat_indices(shape, axis, indices)
    per_expert = shape[1] * shape[2]
    expert = torch.div(flat, per_expert, rounding_mode="floor")
    if axis is not None:  # one expert per line: its first entry's
        expert = expert.view(indices.numel(), -1)[:, 0] if indices.numel() else expert
    return (expert >= owned.start) & (expert < owned.stop)


def keep_owned(chosen: dict, expert_stores: dict) -> dict:
    """A selection ({key: Chosen(axis, indices)}) with the expert tensors' entries restricted to this rank's
    experts (`expert_stores`: {key: store} of the expert stacks; other keys are kept whole)."""
    ep = layout()
    if ep is None:
        return chosen
    kept = dict(chosen)
    for key, (axis, indices) in chosen.items():
        if key in expert_stores:
            store = expert_stores[key]
            mask = owned_mask(store.shape, axis, indices, ep.owned(store.shape[0]))
            kept[key] = type(chosen[key])(axis, indices[mask])
    return kept


def expert_sum(tensor: torch.Tensor, from_every_rank: bool = True) -> torch.Tensor:
    """A statistic of the experts that each EP rank computed for its own experts (zeros elsewhere), summed over the
    group: the one-process statistic on every rank. `from_every_rank`: every rank of the group ran the whole
    calibration stream, so an owner saw each token ep times, and the sum is divided by ep. In place; returned."""
    ep = layout()
    if ep is None:
        return tensor
    moved = tensor.to(_comm_device(ep.ep_group, tensor))
    dist.all_reduce(moved, group=ep.ep_group)
    tensor.copy_(moved.div_(ep.ep) if from_every_rank else moved)
    return tensor


def gather_over_experts(tensor: torch.Tensor) -> torch.Tensor:
    """Every EP rank's `tensor` (the same shape on each), concatenated in rank order: candidates each rank found
    among its own experts, merged by the caller."""
    ep = layout()
    if ep is None:
        return tensor
    moved = tensor.to(_comm_device(ep.ep_group, tensor)).contiguous()
    found = [torch.empty_like(moved) for _ in range(ep.ep)]
    dist.all_gather(found, moved, group=ep.ep_group)
    return torch.cat(found).to(tensor.device)


def gather_ragged(values: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Every EP rank's 1-d `values` (of any length), concatenated in rank order, and the lengths. A rank's trained
    entries are sorted and the ranks own ascending blocks of experts, so its entries' concatenation is in the
    one-process order."""
    ep = layout()
    if ep is None:
        return values, [values.numel()]
    device = _comm_device(ep.ep_group, values)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(ep.ep)]
    dist.all_gather(sizes, torch.tensor([values.numel()], device=device), group=ep.ep_group)
    sizes = read_ints(torch.cat(sizes), [values.numel()] * ep.ep)  # (balanced: every rank holds as many)
    padded = torch.zeros(max(sizes), dtype=values.dtype, device=device)
    padded[: values.numel()] = values.reshape(-1).to(device)
    found = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(found, padded, group=ep.ep_group)
    return torch.cat([f[:n] for f, n in zip(found, sizes, strict=True)]).to(values.device), sizes


def gather_owned(indices: torch.Tensor) -> torch.Tensor:
    """The union over the EP group of each rank's share of a selection (disjoint, as `keep_owned` left them),
    sorted: the one-process selection on every rank."""
    return gather_ragged(indices)[0].sort().values


def entry_offsets(params: list[torch.Tensor]) -> dict[int, int]:
    """{id(param): where this rank's entries of `param` start in the one-process order} for the experts' trained
    values (the same list on every rank): the entries of lower EP ranks come first. One collective."""
    ep = layout()
    if ep is None:
        return {}
    device = _comm_device(ep.ep_group, params[0])
    sizes = torch.tensor([p.numel() for p in params], dtype=torch.int64, device=device)
    found = [torch.empty_like(sizes) for _ in range(ep.ep)]
    dist.all_gather(found, sizes, group=ep.ep_group)
    before = torch.stack(found[: ep.ep_rank]).sum(0) if ep.ep_rank else torch.zeros_like(sizes)
    # read once; where the ranks hold alike (balanced), the lower ranks' entries are this rank's count each
    plausible = [ep.ep_rank * p.numel() for p in params]
    return {id(p): int(n) for p, n in zip(params, read_ints(before, plausible), strict=True)}


def expert_parameters(model: nn.Module) -> set[int]:
    """ids of the trained parameters that belong to expert stacks (their values live on their owner only)."""
    return {id(p) for _, state in sparse_experts(model) for p in state.parameters() if p.requires_grad}


def frozen_expert_bytes(model: nn.Module) -> int:
    """The bytes of frozen expert weight matrices this process holds (a rank's share under expert parallelism;
    the experts' biases, a few KB, are whole on every rank)."""
    return sum(
        store.nbytes
        for _, state in sparse_experts(model)
        for name, store in state.stores.items()
        if not name.endswith("_bias")
    )
