"""The routers during training: what they score, the losses that keep them balanced, and their health.

- `RouterProbe` captures, during a forward, each MoE layer's RAW router logits and the expert ids it routed to.
  Several families (Mixtral, Qwen2/3-MoE, OLMoE) hand back already-softmaxed `router_logits`, and transformers'
  own load-balancing loss softmaxes them a second time, which flattens its gradient to almost nothing; so the
  logits are recomputed from the input of the module that owns the router's [E, hidden] weight.
- `RouterLoss`: a Switch-style load-balancing loss and a router z-loss on those raw logits.
- `make_routers_fp32`: fp32 master weights (and fp32 compute) for the routers of a bf16/fp16 model.
- `RouterHealth`: per-layer load share, coefficient of variation, normalised entropy, dead experts over a window
  of steps, and drift from the base model's routing on a fixed probe batch.
- `CollapseGuard`: thresholds on that health and what to do when they are crossed.

A training run puts them together (and sums them across ranks) in usaf.train.router_training.RouterTraining.

DeepSeek-style sigmoid routers (DeepSeek-V3, GLM-4-MoE) choose experts by `sigmoid(logits) +
e_score_correction_bias`. That bias is a buffer which usaf never trains or edits, so the router stays consistent
with the bias the base model was trained with; the losses here use the raw logits (softmax over them for the
balancing term, as in Switch) and the routed ids the model actually chose (bias and group limits included), so
the balancing signal counts the real loads.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from usaf.config import GUARD_ACTIONS
from usaf.errors import UsafError
from usaf.model.hf import decoder_body
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
        raise UsafError(f"MoE layer at '{layer.experts_name}' has no router module.")
    hidden = hidden_size(layer.experts)
    for module in layer.router.modules():
        for param in module.parameters(recurse=False):
            if tuple(param.shape) == (layer.num_experts, hidden):
                bias = getattr(module, "bias", None)
                real_bias = isinstance(bias, nn.Parameter) and tuple(bias.shape) == (layer.num_experts,)
                return ScoreProjection(module, param, bias if real_bias else None)
    raise UsafError(
        f"No [{layer.num_experts}, {hidden}] scoring weight inside the router '{layer.router_name}' "
        f"({type(layer.router).__name__})."
    )


class RouterProbe:
    """Captures per MoE layer the raw router logits [tokens, E] (with their autograd graph) and the routed expert
    ids [tokens, k] of the forwards run inside `with probe.capture():`.

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
    def capture(self, token_mask: torch.Tensor | None = None) -> Iterator[RouterProbe]:
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
        """Raw fp32 logits [tokens, E] of probed layer i (None if it did not run, e.g. behind a prefix cache)."""
        return self._gather(self._logits[i])

    def routed(self, i: int) -> torch.Tensor | None:
        """Routed expert ids [tokens, k] of probed layer i."""
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

    def __call__(self, probe: RouterProbe) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(weighted total, {"balance": ..., "z": ...} detached), averaged over the layers captured by `probe`.

        Layers whose logits carry no gradient (frozen routers below the trained layers, e.g. run on a prefix-cache
        miss) are left out when any layer's logits do carry one, so they neither dilute the coefficients nor
        change the loss between batches; without gradients (evaluation) every captured layer counts.
        """
        captured = []
        for i, layer in enumerate(probe.layers):
            logits, routed = probe.logits(i), probe.routed(i)
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
        if router is None or getattr(router, "_usaf_fp32", False):
            continue
        params = [p for p in router.parameters() if p.is_floating_point()]
        if all(p.dtype == torch.float32 for p in params):
            continue
        router.float()  # in place: the same Parameter objects, so requires_grad and references survive
        router.register_forward_pre_hook(_floating_inputs_to_fp32, with_kwargs=True)
        router._usaf_fp32 = True
        converted.append(router)
    return converted


def _floating_inputs_to_fp32(module, args, kwargs):
    cast = lambda v: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v  # noqa: E731
    return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}


# ----------------------------------------------------------------------------------------------------------
# health
# ----------------------------------------------------------------------------------------------------------


def load_statistics(counts: torch.Tensor) -> dict:
    """Load share, coefficient of variation, normalised entropy and dead experts of one layer's counts [E]."""
    counts = counts.double()
    num_experts = counts.numel()
    share = counts / counts.sum()
    cv = float(counts.std(unbiased=False) / counts.mean())
    nonzero = share[share > 0]
    entropy = float(-(nonzero * nonzero.log()).sum()) / math.log(num_experts) if num_experts > 1 else 1.0
    dead = int((counts == 0).sum())
    return {
        "load": [round(float(s), 6) for s in share],
        "cv": cv,
        "entropy": entropy,
        "dead": dead,
        "dead_share": dead / num_experts,
    }


def routing_drift(base_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean over tokens of KL(softmax(base) || softmax(now)) of the gate distributions."""
    base_log = base_logits.float().log_softmax(dim=-1)
    now_log = logits.float().log_softmax(dim=-1)
    return float((base_log.exp() * (base_log - now_log)).sum(dim=-1).mean())


class RouterHealth:
    """Routing health over a sliding window of steps, plus drift from the base model on a fixed probe batch.

    Per step: `observe()` after each captured forward (adds the probe's routed counts), `end_step()` after the
    optimizer step. Layers that received no tokens in the window (e.g. frozen layers skipped by a prefix cache)
    report no statistics rather than "all dead".
    """

    def __init__(self, probe: RouterProbe, window_steps: int = 20):
        if window_steps < 1:
            raise UsafError(f"router health window must be >= 1 step, got {window_steps}.")
        self.probe = probe
        self.layer_numbers = [layer.layer_index for layer in probe.layers]
        self.num_experts = [layer.num_experts for layer in probe.layers]
        self.window: deque[torch.Tensor] = deque(maxlen=window_steps)
        self.pending = torch.zeros(len(probe.layers), max(self.num_experts), dtype=torch.long)
        self.base_logits: list[torch.Tensor | None] | None = None
        self.base_counts: torch.Tensor | None = None
        self.probe_counts: torch.Tensor | None = None
        self.drift: list[float | None] = [None] * len(probe.layers)

    # -- loads over the window
    def observe(self) -> None:
        self.pending += self.probe.routed_counts()

    def end_step(self) -> None:
        self.window.append(self.pending)
        self.pending = torch.zeros_like(self.pending)

    @property
    def window_is_full(self) -> bool:
        return len(self.window) == self.window.maxlen

    def counts(self) -> torch.Tensor:
        """[layers, E] routed slots per expert over the window."""
        return torch.stack(list(self.window)).sum(dim=0) if self.window else torch.zeros_like(self.pending)

    def per_layer(self) -> list[dict]:
        """Full detail per layer: decoder layer number, routed tokens, load share per expert, cv, normalised
        entropy, dead experts (count and share) over the window, and drift from the base model."""
        counts = self.counts()
        rows = []
        for i, layer_number in enumerate(self.layer_numbers):
            row = counts[i, : self.num_experts[i]]
            entry = {"layer": layer_number, "routed": int(row.sum())}
            if entry["routed"]:
                entry.update(load_statistics(row))
            entry["drift"] = self.drift[i]
            rows.append(entry)
        return rows

    def summary(self, rows: list[dict] | None = None) -> dict:
        """Short numbers for the progress bar: worst layer's cv and entropy, dead experts in all, mean drift
        (from `rows` of `per_layer()` when the caller has them)."""
        observed = [r for r in (self.per_layer() if rows is None else rows) if r["routed"]]
        drifts = [d for d in self.drift if d is not None]
        out = {}
        if observed:
            out["cv_max"] = max(r["cv"] for r in observed)
            out["entropy_min"] = min(r["entropy"] for r in observed)
            out["dead"] = sum(r["dead"] for r in observed)
        if drifts:
            out["drift"] = sum(drifts) / len(drifts)
        return out

    def metrics(self, rows: list[dict] | None = None) -> dict:
        """For metrics.jsonl (and `usaf report`): the summary as router/<key> scalars, the detail as router/layers."""
        rows = self.per_layer() if rows is None else rows
        return {**{f"router/{k}": v for k, v in self.summary(rows).items()}, "router/layers": rows}

    def load_matrix(self, counts: torch.Tensor | None = None) -> torch.Tensor:
        """[layers, E] load shares (of the window, or of `counts`); NaN for unobserved layers/absent experts."""
        counts = (self.counts() if counts is None else counts).double()
        matrix = torch.full(counts.shape, float("nan"), dtype=torch.float64)
        for i, num in enumerate(self.num_experts):
            total = counts[i, :num].sum()
            if total > 0:
                matrix[i, :num] = counts[i, :num] / total
        return matrix

    # -- drift on a fixed probe batch
    def record_base(self, model: nn.Module, batch: dict, token_mask: torch.Tensor | None = None) -> None:
        """Record the base model's gate distributions (and loads) on the probe batch; call once, before training."""
        self.base_logits, self.base_counts = self._probe_forward(model, batch, token_mask)
        self.drift = [0.0 if logits is not None else None for logits in self.base_logits]

    def measure_drift(self, model: nn.Module, batch: dict, token_mask: torch.Tensor | None = None) -> list:
        """Per-layer mean KL(base || now) of the gate distributions on the same probe batch."""
        if self.base_logits is None:
            raise UsafError("RouterHealth.measure_drift needs record_base first.")
        logits, self.probe_counts = self._probe_forward(model, batch, token_mask)
        self.drift = [
            routing_drift(base, now) if base is not None and now is not None else None
            for base, now in zip(self.base_logits, logits, strict=True)
        ]
        return self.drift

    def _probe_forward(self, model: nn.Module, batch: dict, token_mask):
        body = decoder_body(model)
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), self.probe.capture(token_mask):
                body(**inputs, use_cache=False)
        finally:
            model.train(was_training)
        logits = [self.probe.logits(i) for i in range(len(self.layer_numbers))]
        logits = [x.detach().cpu() if x is not None else None for x in logits]
        counts = self.probe.routed_counts()
        self.probe.clear()
        return logits, counts


# ----------------------------------------------------------------------------------------------------------
# collapse guard
# ----------------------------------------------------------------------------------------------------------


class RouterCollapse(UsafError):
    """Routing collapsed past the guard's thresholds and the configured action is "stop"."""


class CollapseGuard:
    """Checks the health against thresholds once the window is full; on crossing, acts:

    warn: only report. raise_balance: balancing coefficient x `balance_factor` (from 0: to 0.01), up to
    `balance_cap`. freeze_router: routers stop training (requires_grad False, gradients dropped). stop: raise
    `RouterCollapse` for the training run to checkpoint and stop.
    A threshold of max_cv <= 0 is off; min_entropy <= 0 and max_dead_share >= 1 can never be crossed.
    """

    def __init__(
        self,
        max_cv: float,
        min_entropy: float,
        max_dead_share: float,
        action: str = "warn",
        loss: RouterLoss | None = None,
        router_params: list[nn.Parameter] | None = None,
        balance_factor: float = 2.0,
        balance_cap: float = 0.1,
    ):
        if action not in GUARD_ACTIONS:
            raise UsafError(f"router guard action must be one of {GUARD_ACTIONS}, got {action!r}.")
        if action == "raise_balance" and loss is None:
            raise UsafError("router guard action 'raise_balance' needs the RouterLoss it should raise.")
        self.max_cv, self.min_entropy, self.max_dead_share = max_cv, min_entropy, max_dead_share
        self.action, self.loss = action, loss
        self.router_params = list(router_params or [])
        self.balance_factor, self.balance_cap = balance_factor, balance_cap
        self.frozen = False
        self.trips = 0

    @classmethod
    def from_config(cls, section, loss: RouterLoss | None, router_params) -> CollapseGuard:
        return cls(
            section.guard_max_cv,
            section.guard_min_entropy,
            section.guard_max_dead_share,
            section.guard_action,
            loss,
            router_params,
            balance_cap=section.guard_balance_cap,
        )

    def crossings(self, health: RouterHealth, rows: list[dict] | None = None) -> list[str]:
        """A line per threshold crossed, per layer ([] while the window is filling)."""
        if not health.window_is_full:
            return []
        found = []
        for row in health.per_layer() if rows is None else rows:
            if not row["routed"]:
                continue
            where = f"layer {row['layer']}"
            if self.max_cv > 0 and row["cv"] > self.max_cv:
                found.append(f"{where}: load cv {row['cv']:.2f} > {self.max_cv}")
            if row["entropy"] < self.min_entropy:
                found.append(f"{where}: entropy {row['entropy']:.2f} < {self.min_entropy}")
            if row["dead_share"] > self.max_dead_share:
                found.append(f"{where}: {row['dead']} dead experts > {self.max_dead_share:.0%}")
        return found

    def check(self, health: RouterHealth, step: int, rows: list[dict] | None = None) -> str | None:
        """Act on crossings; returns a message for the log (None when healthy). Raises `RouterCollapse` on stop."""
        found = self.crossings(health, rows)
        if not found:
            return None
        self.trips += 1
        shown = "; ".join(found[:4]) + (f"; +{len(found) - 4} more" if len(found) > 4 else "")
        message = f"step {step}: router collapse guard: {shown}"
        if self.action == "stop":
            raise RouterCollapse(
                f"{message}. Stopped (router.guard_action=stop): raise router.balance_coef, lower "
                "router.lr_multiplier, or train with more varied data."
            )
        if self.action == "raise_balance":
            old = self.loss.balance_coef
            self.loss.balance_coef = min(self.balance_cap, old * self.balance_factor if old > 0 else 0.01)
            message += f" -> balance_coef {old:g} -> {self.loss.balance_coef:g}"
        elif self.action == "freeze_router" and not self.frozen:
            self.freeze()
            message += " -> routers frozen"
        return message

    def freeze(self) -> None:
        # grads dropped, not zeroed: Adam would still move a parameter with a zero gradient (its momentum)
        for param in self.router_params:
            param.requires_grad_(False)
            param.grad = None
        self.frozen = True
