"""Causal-LM loss computed in chunks of tokens, so the [tokens, vocab] logits never exist in full.

In training each chunk's backward runs right after its forward, inside the forward pass (as fused linear
cross-entropy kernels do): what outlives the chunk is its loss and the gradients of its input and of the output
layer's trained values, never its logits, so at most one chunk of logits is alive at a time and nothing is
recomputed in backward (recomputing the output layer's product cost about as much as a third of the model's
forward on a 16 k vocabulary). Positions without a label are dropped before the output head: prompt tokens cost
nothing there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from usaf.kernels.host import read_int
from usaf.model.hf import decoder_body

IGNORE_INDEX = -100


def _chunk_loss_sum(hidden: torch.Tensor, labels: torch.Tensor, head: Callable) -> torch.Tensor:
    logits = head(hidden)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16/fp16 logits: fp32 softmax
    return F.cross_entropy(logits, labels, reduction="sum")


class _ChunkLoss(torch.autograd.Function):
    """A chunk's loss whose gradients (for an upstream gradient of 1) were computed in the forward: the backward
    only scales them."""

    @staticmethod
    def forward(ctx, loss, hidden, grads, *leaves):
        ctx.grads = grads
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        # in fp32, then back: a bf16 copy of the upstream gradient (1 / supervised tokens x loss scale) would
        # be off by up to 0.4 %
        scaled = [None if g is None else _scaled(g, grad_loss) for g in ctx.grads]
        return None, scaled[0], None, *scaled[1:]


def _scaled(grad: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    wide = torch.promote_types(grad.dtype, torch.float32)
    return (grad.to(wide) * factor.to(wide)).to(grad.dtype)


def _trainable_leaves(loss: torch.Tensor) -> list[torch.Tensor]:
    """The leaves requiring a gradient that `loss` depends on (its input and the output layer's trained values,
    wherever the output layer keeps them: a tied output layer's live with the embedding)."""
    leaves, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad
        if variable is not None:
            leaves.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


def _chunk_loss_with_grads(hidden: torch.Tensor, labels: torch.Tensor, head: Callable) -> torch.Tensor:
    """`_chunk_loss_sum`, its backward done now: the chunk's logits are freed before the next chunk starts."""
    with torch.enable_grad():
        piece = hidden.detach().requires_grad_()
        loss = _chunk_loss_sum(piece, labels, head)
        leaves = [leaf for leaf in _trainable_leaves(loss) if leaf is not piece]
        grads = torch.autograd.grad(loss, [piece, *leaves], allow_unused=True)
    return _ChunkLoss.apply(loss.detach(), hidden, grads, *leaves)


def chunked_causal_lm_loss(
    hidden_states: torch.Tensor,
    labels: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    chunk_tokens: int = 1024,
    reduction: str = "mean",
) -> torch.Tensor:
    """Next-token cross entropy of `head(hidden_states)` against `labels` ([batch, seq], -100 = no loss).

    `labels` are aligned with the inputs (as transformers expects); the shift happens here.
    reduction: "mean" over supervised tokens, or "sum".
    """
    hidden = hidden_states[:, :-1, :].reshape(-1, hidden_states.shape[-1])
    targets = labels[:, 1:].reshape(-1)
    keep = targets != IGNORE_INDEX
    # the one host read of the loss (a boolean index would make it too, hidden in nonzero): how many positions
    # are supervised, then their rows gathered at a size known on the host
    supervised = read_int(keep.sum(), keep.numel())
    if supervised < keep.numel():
        index = torch.nonzero_static(keep, size=supervised).squeeze(1)
        hidden, targets = hidden.index_select(0, index), targets.index_select(0, index)
    total = hidden_states.new_zeros((), dtype=torch.promote_types(hidden_states.dtype, torch.float32))
    for start in range(0, targets.numel(), chunk_tokens):
        piece = slice(start, start + chunk_tokens)
        if torch.is_grad_enabled() and hidden.requires_grad:
            total = total + _chunk_loss_with_grads(hidden[piece], targets[piece], head)
        else:
            total = total + _chunk_loss_sum(hidden[piece], targets[piece], head)
    if reduction == "sum":
        return total
    return total / targets.numel() if targets.numel() else total


def output_head(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The model's output layer with the logit transforms some families apply after it."""
    head = model.get_output_embeddings()
    config = getattr(model, "config", None)
    scaling = getattr(config, "logits_scaling", None)  # granite families divide logits
    softcap = getattr(getattr(config, "get_text_config", lambda: config)(), "final_logit_softcapping", None)

    def apply(hidden: torch.Tensor) -> torch.Tensor:
        logits = head(hidden)
        if scaling:
            logits = logits / scaling
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

    return apply


def causal_lm_loss(
    model: torch.nn.Module,
    input_ids,
    labels,
    attention_mask=None,
    chunk_tokens: int = 1024,
    reduction: str = "mean",
    **kw,
):
    """Run the decoder and the chunked loss: the training forward that never builds full logits.

    No KV cache: a cache is useless in training and disables transformers' detection of packed sequences
    (restarting position_ids), which keeps packed documents from attending to each other.
    """
    body = decoder_body(model)
    out = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kw)
    return chunked_causal_lm_loss(out.last_hidden_state, labels, output_head(model), chunk_tokens, reduction)
