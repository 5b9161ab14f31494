"""The routers during training: what they score, and the losses that keep them balanced.

- `RouterCapture` captures, during a forward, each MoE layer's RAW router logits and the expert ids it routed to.
  Several families (Mixtral, Qwen2/3-MoE, OLMoE) hand back already-softmaxed `router_logits`, and transformers'
  own load-balancing loss softmaxes them a second time, which flattens its gradient to almost nothing; so the
  logits are recomputed from the input of the module that owns the router's [E, hidden] weight.
- `RouterLoss`: a Switch-style load-balancing loss and a router z-loss on those raw logits.
- `make_routers_fp32`: fp32 master weights (and fp32 compute) for the routers of a bf16/fp16 model.

Their health over a run (`RouterHealth`) and what to do when they collapse (`CollapseGuard`) are
`usaf.train.router_health`; a training run puts it all together (and sums it across ranks) in
`usaf.train.router_training.RouterTraining`.

DeepSeek-style sigmoid routers (DeepSeek-V3, GLM-4-MoE) choose experts by `sigmoid(logits) +
e_score_correction_bias`. That bias is a buffer which usaf never trains or edits, so the router stays consistent
with the bias the base model was trained with; the losses here use the raw logits (softmax over them for the
balancing term, as in Switch) and the routed ids the model actually chose (bias and group limits included), so
the balancing signal counts the real loads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from usaf.errors import ModelError
from usaf.model.layout import MoELayer, find_moe_layers, hidden_size

# ----------------------------------------------------------------------------------------------------------
# capturing raw logits and routed ids
# ----------------------------------------------------------------------------------------------------------


@dataclass
class ScoreProjection:
    """The module inside a router that owns the [E, hidden] scoring weight (and its [E] bias, if a parameter)."""

    module: nn.Module
    weight: nn.Parameter
    bias: nn.Parameter | None


def score_projection(layer: MoELayer) -> ScoreProjection:
    """Found from the module tree: the router itself (qwen, mixtral, gpt-oss, deepseek ...) or a submodule of it
    (gemma4's `router.proj`) whose own parameter has shape [E, hidden]."""
    if layer.router is None:
        raise ModelError(f"MoE layer at '{layer.experts_name}' has no router module.")
    hidden = hidden_size(layer.experts)
    for module in layer.router.modules():
        for param in module.parameters(recurse=False):
            if tuple(param.shape) == (layer.num_experts, hidden):
                bias = getattr(module, "bias", None)
                real_bias = isinstance(bias, nn.Parameter) and tuple(bias.shape) == (layer.num_experts,)
                return ScoreProjection(module, param, bias if real_bias else None)
    raise ModelError(
        f"No [{layer.num_experts}, {hidden}] scoring weight inside the router '{layer.router_name}' "
        f"({type(layer.router).__name__})."
    )


class RouterCapture:
    """Captures per MoE layer the raw router logits [tokens, E] (with their autograd graph) and the routed expert
    ids [tokens, k] of the forwards run inside `with capture.capture():`.

    Outside `capture()` nothing is kept. That matters under activation checkpointing: backward re-runs each
    layer's forward (and so these hooks); the recomputation must not append duplicates, so run backward outside
    the context. The logits are still recomputed there when grad is enabled, because non-reentrant
    checkpointing requires the recomputation to save exactly the tensors the original forward saved.
    """

    def __init__(self, model: nn.Module):
        self.layers = [layer for layer in find_moe_layers(model) if layer.router is not None]
        self.projections = [score_projection(layer) for layer in self.layers]
        self.capturing = False
        self.token_mask: torch.Tensor | None = None
        self._logits: list[list[torch.Tensor]] = [[] for _ in self.layers]
        self._routed: list[list[torch.Tensor]] = [[] for _ in self.layers]
        self._handles = []
        for i, (layer, projection) in enumerate(zip(self.layers, self.projections, strict=True)):
            self._handles.append(
                projection.module.register_forward_hook(self._logits_hook(i, projection), with_kwargs=True)
            )
            self._handles.append(
                layer.experts.register_forward_pre_hook(self._routed_hook(i), with_kwargs=True)
            )

    @contextlib.contextmanager
    def capture(self, token_mask: torch.Tensor | None = None) -> Iterator[RouterCapture]:
        """Capture the forwards run inside (earlier captures are dropped). `token_mask` ([batch, seq] bool) keeps
        only those tokens' rows, e.g. to leave out padding."""
        self.clear()
        self.token_mask = token_mask
        self.capturing = True
        try:
            yield self
        finally:
            self.capturing = False

    def clear(self) -> None:
        self._logits = [[] for _ in self.layers]
        self._routed = [[] for _ in self.layers]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def logits(self, i: int) -> torch.Tensor | None:
        """Raw fp32 logits [tokens, E] of captured layer i (None if it did not run, e.g. behind a prefix cache)."""
        return self._gather(self._logits[i])

    def routed(self, i: int) -> torch.Tensor | None:
        """Routed expert ids [tokens, k] of captured layer i."""
        return self._gather(self._routed[i])

    def routed_counts(self) -> torch.Tensor:
        """[layers, E] routed slots per expert in the captured forwards (int64, on the CPU)."""
        width = max(layer.num_experts for layer in self.layers)
        counts = torch.zeros(len(self.layers), width, dtype=torch.long)
        for i, layer in enumerate(self.layers):
            ids = self.routed(i)
            if ids is not None:
                counts[i, : layer.num_experts] = torch.bincount(
                    ids.reshape(-1), minlength=layer.num_experts
                ).cpu()
        return counts

    def _gather(self, pieces: list[torch.Tensor]) -> torch.Tensor | None:
        if not pieces:
            return None
        rows = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        mask = self.token_mask
        if mask is not None and mask.numel() == rows.shape[0]:
            rows = rows[mask.reshape(-1).to(rows.device)]
        return rows

    def _logits_hook(self, i: int, projection: ScoreProjection):
        def hook(module, args, kwargs, output):
            # computed (and dropped) outside capture too when grad is on: a checkpoint's recomputation must save
            # the same tensors as the original forward did, or backward fails
            if not (self.capturing or torch.is_grad_enabled()):
                return
            x = args[0] if args else next(iter(kwargs.values()), None)
            if not isinstance(x, torch.Tensor):
                return
            weight, bias = projection.weight, projection.bias
            # fp32 for the losses; autocast off so the value does not depend on the surrounding precision
            with torch.autocast(device_type=x.device.type, enabled=False):
                x = x.reshape(-1, weight.shape[1]).float()
                logits = F.linear(x, weight.float(), None if bias is None else bias.float())
            if self.capturing:
                self._logits[i].append(logits)

        return hook

    def _routed_hook(self, i: int):
        def hook(module, args, kwargs):
            if self.capturing:
                ids = args[1] if len(args) > 1 else kwargs["top_k_index"]
                self._routed[i].append(ids.detach().reshape(-1, ids.shape[-1]))

        return hook


# ----------------------------------------------------------------------------------------------------------
# losses
# ----------------------------------------------------------------------------------------------------------


def load_balancing_loss(logits: torch.Tensor, routed: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss, E * sum_e f_e * P_e: f_e the share of routed slots that went to
    expert e (counted, no gradient), P_e the mean softmax probability of e over the raw logits. 1 when balanced."""
    counts = torch.bincount(routed.reshape(-1), minlength=num_experts).to(logits.device, torch.float32)
    share = counts / counts.sum().clamp_min(1)
    mean_prob = logits.float().softmax(dim=-1).mean(dim=0)
    return num_experts * (share * mean_prob).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's z-loss, mean over tokens of logsumexp(logits)^2: keeps the logits small (numerically stable)."""
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


class RouterLoss:
    """balance_coef x (load balancing, averaged over layers) + z_coef x (z-loss, averaged over layers).

    The coefficients are attributes so the collapse guard can raise the balancing one during a run.
    """

    def __init__(self, balance_coef: float = 0.01, z_coef: float = 0.001):
        self.balance_coef, self.z_coef = float(balance_coef), float(z_coef)

    def __call__(self, capture: RouterCapture) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(weighted total, {"balance": ..., "z": ...} detached), averaged over the layers `capture` holds.

        Layers whose logits carry no gradient (frozen routers below the trained layers, e.g. run on a prefix-cache
        miss) are left out when any layer's logits do carry one, so they neither dilute the coefficients nor
        change the loss between batches; without gradients (evaluation) every captured layer counts.
        """
        captured = []
        for i, layer in enumerate(capture.layers):
            logits, routed = capture.logits(i), capture.routed(i)
            if logits is not None and routed is not None and logits.shape[0] > 0:
                captured.append((logits, routed, layer.num_experts))
        if any(logits.requires_grad for logits, _, _ in captured):
            captured = [c for c in captured if c[0].requires_grad]
        balance = [load_balancing_loss(logits, routed, num) for logits, routed, num in captured]
        z = [router_z_loss(logits) for logits, _, _ in captured]
        if not balance:
            zero = torch.zeros(())
            return zero, {"balance": zero, "z": zero}
        mean_balance, mean_z = torch.stack(balance).mean(), torch.stack(z).mean()
        total = self.balance_coef * mean_balance + self.z_coef * mean_z
        return total, {"balance": mean_balance.detach(), "z": mean_z.detach()}


# ----------------------------------------------------------------------------------------------------------
# fp32 routers
# ----------------------------------------------------------------------------------------------------------


def make_routers_fp32(model: nn.Module) -> list[nn.Module]:
    """fp32 master weights for routers stored in bf16/fp16, computing in fp32 too; returns the converted routers.

    A router update is tiny next to its weights; in bf16 (8 bits of mantissa) most of it rounds away. Inputs are
    cast to fp32 by a forward pre-hook, so the routing weights come out fp32 (usaf's experts forward multiplies
    by them and casts its result back to the hidden dtype). Routers already in fp32 (DeepSeek's) are left as
    they are. Call before building the optimizer (and before restoring a checkpoint into the model).
    """
    converted = []
    for layer in find_moe_layers(model):
        router = layer.router
        if router is None or _fp32_inputs(router):
            continue
        params = [p for p in router.parameters() if p.is_floating_point()]
        if all(p.dtype == torch.float32 for p in params):
            continue
        router.float()  # in place: the same Parameter objects, so requires_grad and references survive
        router.register_forward_pre_hook(_floating_inputs_to_fp32, with_kwargs=True)
        converted.append(router)
    return converted


def _fp32_inputs(router: nn.Module) -> bool:
    """Whether `router` computes in fp32 already (its pre-hook is the mark: no attribute on the module)."""
    return any(hook is _floating_inputs_to_fp32 for hook in router._forward_pre_hooks.values())


def _floating_inputs_to_fp32(module, args, kwargs):
    cast = lambda v: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v  # noqa: E731
    return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}
