"""The routers' health over a run, and the guard against their collapse.

- `RouterHealth`: per-layer load share, coefficient of variation, normalised entropy, dead experts over a window
  of steps, and drift from the base model's routing on a fixed reference batch.
- `CollapseGuard`: thresholds on that health and what to do when they are crossed (`router.guard`).

The logits and routed ids they read are captured by `usaf.engine.router.RouterCapture`.
"""

from __future__ import annotations

import math
from collections import deque

import torch
from torch import nn

from usaf.config import GUARD_ACTIONS
from usaf.engine.router import RouterCapture, RouterLoss
from usaf.errors import ConfigError, UsafError
from usaf.model.hf import decoder_body

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
    """Routing health over a sliding window of steps, plus drift from the base model on a fixed reference batch.

    Per step: `observe()` after each captured forward (adds the captured routed counts), `end_step()` after the
    optimizer step. Layers that received no tokens in the window (e.g. frozen layers skipped by a prefix cache)
    report no statistics rather than "all dead".
    """

    def __init__(self, capture: RouterCapture, window_steps: int = 20):
        if window_steps < 1:
            raise ConfigError(f"router health window must be >= 1 step, got {window_steps}.")
        self.capture = capture
        self.layer_numbers = [layer.layer_index for layer in capture.layers]
        self.num_experts = [layer.num_experts for layer in capture.layers]
        self.window: deque[torch.Tensor] = deque(maxlen=window_steps)
        self.pending = torch.zeros(len(capture.layers), max(self.num_experts), dtype=torch.long)
        self.base_logits: list[torch.Tensor | None] | None = None
        self.base_counts: torch.Tensor | None = None
        self.reference_counts: torch.Tensor | None = None
        self.drift: list[float | None] = [None] * len(capture.layers)

    # -- loads over the window
    def observe(self) -> None:
        self.pending += self.capture.routed_counts()

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

    # -- drift on a fixed reference batch
    def record_base(self, model: nn.Module, batch: dict, token_mask: torch.Tensor | None = None) -> None:
        """Record the base model's gate distributions (and loads) on the reference batch; call once, before training."""
        self.base_logits, self.base_counts = self._reference_forward(model, batch, token_mask)
        self.drift = [0.0 if logits is not None else None for logits in self.base_logits]

    def measure_drift(self, model: nn.Module, batch: dict, token_mask: torch.Tensor | None = None) -> list:
        """Per-layer mean KL(base || now) of the gate distributions on the same reference batch."""
        if self.base_logits is None:
            raise UsafError("RouterHealth.measure_drift needs record_base first.")
        logits, self.reference_counts = self._reference_forward(model, batch, token_mask)
        self.drift = [
            routing_drift(base, now) if base is not None and now is not None else None
            for base, now in zip(self.base_logits, logits, strict=True)
        ]
        return self.drift

    def _reference_forward(self, model: nn.Module, batch: dict, token_mask):
        body = decoder_body(model)
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), self.capture.capture(token_mask):
                body(**inputs, use_cache=False)
        finally:
            model.train(was_training)
        logits = [self.capture.logits(i) for i in range(len(self.layer_numbers))]
        logits = [x.detach().cpu() if x is not None else None for x in logits]
        counts = self.capture.routed_counts()
        self.capture.clear()
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
            raise ConfigError(f"router guard action must be one of {GUARD_ACTIONS}, got {action!r}.")
        if action == "raise_balance" and loss is None:
            raise ConfigError("router guard action 'raise_balance' needs the RouterLoss it should raise.")
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
