"""Expert parallelism, a prototype (issue 13 item 6; the design is docs/distributed.md's "Beyond one device").

Each of N ranks owns E/N experts of every MoE layer, experts r*E/N ... (r+1)*E/N - 1. Everything else runs
data-parallel: every rank routes its own tokens with its own copy of the router. In each MoE layer the (token,
expert) pairs travel all-to-all to the ranks owning their experts, the owner runs usaf's engine on them
(`usaf_experts_forward`: dequantize-and-matmul with the trained entries written in, value gradients only at trained
entries), and a second all-to-all brings the outputs home, where the router weights combine them. Backward runs the
same two exchanges in reverse (`AllToAll`), so the value gradients of an expert arise only on its owner: the trained
entries of experts are never all-reduced. Router and non-expert gradients are summed over ranks as in data
parallelism.

What the prototype leaves out, and a production version needs: every rank still holds every expert's store (a
non-resident store only ever materializes the routed ones, so only its own are dequantized, but the memory is not
yet divided: `usaf prepare --expert-shard r/N` would stream only a rank's experts); the observers of reselection see
router weights of 1 at the owner (the weighting happens at home); no capacity limit or overlap of the exchange with
compute. On gloo (CPU) `all_to_all_single` with uneven splits works, which is all this needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from usaf.engine.experts import usaf_experts_forward
from usaf.engine.sparse import line_flat_indices
from usaf.engine.state import owned_state
from usaf.errors import ConfigError, ModelError, UsafError
from usaf.model.hf import register_experts_implementation, use_experts_implementation
from usaf.model.layout import find_moe_layers

IMPLEMENTATION_NAME = "usaf-expert-parallel"


class AllToAll(torch.autograd.Function):
    """Rows sent in blocks of `send` rows to each rank, `recv` rows received from each; backward sends the gradients
    back the way the rows came."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = rows.new_empty(sum(recv), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad = grad_out.new_empty(sum(ctx.send), *grad_out.shape[1:])
        dist.all_to_all_single(grad, grad_out.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return grad, None, None, None


@dataclass(frozen=True)
class ExpertLayout:
    """Where this rank sits in an expert-parallel job: world = ep x dp ranks, as a (dp, ep) device mesh. The ranks
    g*ep ... g*ep + ep - 1 form EP group g and split every MoE layer's experts among them (EP rank e owns the
    contiguous block e*E/ep ... (e+1)*E/ep - 1); the ranks with the same EP rank form a DP group and hold the same
    experts (replicas, whose gradients are summed). `ep_group`/`dp_group`: their process groups."""

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


class Placement:
    """Which rank owns which experts: a contiguous block of E/N experts each."""

    def __init__(self, num_experts: int, group=None):
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if num_experts % self.world:
            raise ConfigError(
                f"expert parallelism over {self.world} ranks needs a number of experts divisible by it; "
                f"this model has {num_experts} experts per layer: use a world size that divides {num_experts}."
            )
        self.per_rank = num_experts // self.world

    def owned(self) -> range:
        return range(self.rank * self.per_rank, (self.rank + 1) * self.per_rank)

    def exchange_counts(self, send: torch.Tensor) -> list[int]:
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return recv.tolist()


def expert_parallel_forward(self, hidden_states, top_k_index, top_k_weights):
    """Drop-in for the experts forward: this rank's tokens in, their combined expert outputs out."""
    placement: Placement = self.usaf.placement
    top_k = top_k_index.shape[-1]
    experts = top_k_index.reshape(-1)
    owner = torch.div(experts, placement.per_rank, rounding_mode="floor")
    order = torch.argsort(owner, stable=True)  # pairs grouped by the rank that owns their expert
    token = torch.div(order, top_k, rounding_mode="floor")
    send = torch.bincount(owner, minlength=placement.world)
    recv = placement.exchange_counts(send)
    send = send.tolist()
    # out: each pair's token state and its expert; in: the pairs this rank's experts serve
    rows = AllToAll.apply(hidden_states.index_select(0, token), send, recv, placement.group)
    served = AllToAll.apply(experts[order], send, recv, placement.group)
    ones = rows.new_ones(rows.shape[0], 1)
    outputs = usaf_experts_forward(self, rows, served.unsqueeze(-1), ones)
    home = AllToAll.apply(outputs, recv, send, placement.group)
    weights = top_k_weights.reshape(-1)[order].unsqueeze(-1).to(home.dtype)
    combined = hidden_states.new_zeros(hidden_states.shape[0], home.shape[-1], dtype=home.dtype)
    return combined.index_add(0, token, home * weights).to(hidden_states.dtype)


def enable(model: nn.Module, group=None) -> None:
    """Switch a prepared model's experts to expert-parallel dispatch over the ranks of `group` (default: all).
    Call after `usaf.prepare_model` on every rank, with the same selection everywhere."""
    if not dist.is_available() or not dist.is_initialized():
        raise UsafError("expert parallelism needs torch.distributed initialized (start with torchrun).")
    layers = find_moe_layers(model)
    for layer in layers:
        state = owned_state(layer.experts)
        if state is None or not state.is_expert_stack:
            raise ModelError(
                "expert parallelism runs usaf's engine: call usaf.prepare_model on the model first."
            )
        state.placement = Placement(state.num_experts, group)
    register_experts_implementation(IMPLEMENTATION_NAME, expert_parallel_forward)
    use_experts_implementation(model, [layer.experts for layer in layers], IMPLEMENTATION_NAME)


# ---- what a rank keeps ------------------------------------------------------------------------------------------


def owned_mask(shape, axis: int | None, indices: torch.Tensor, owned: range) -> torch.Tensor:
    """Which of a selection's `indices` (flat indices, or line ids along `axis`) of an [E, A, B] tensor lie in the
    `owned` experts."""
    flat = indices if axis is None else line_flat_indices(shape, axis, indices)
    per_expert = shape[1] * shape[2]
    expert = torch.div(flat, per_expert, rounding_mode="floor")
    if axis is not None:  # one expert per line: its first entry's
        expert = expert.view(indices.numel(), -1)[:, 0] if indices.numel() else expert
    return (expert >= owned.start) & (expert < owned.stop)
