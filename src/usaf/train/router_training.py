"""Everything a training run does with routers, in one place: capture, auxiliary losses, health, the collapse guard
(usaf.engine.router's parts), their sum across ranks, and the progress bar's router fields."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from usaf.engine.router import RouterCapture, RouterLoss
from usaf.selection.across_ranks import active, comm_device
from usaf.train.router_health import CollapseGuard, RouterHealth


def progress_fields(summary: dict) -> dict[str, str]:
    """The progress bar's router fields from a health summary: worst load cv, lowest entropy, drift, dead."""
    show = {
        k: f"{v:.2f}"
        for k, v in (("cv", summary["cv_max"]), ("ent", summary["entropy_min"]), ("kl", summary["drift"]))
        if v is not None
    }
    show["dead"] = str(summary["dead"])
    return show


class RouterTraining:
    """Probe + losses + health + guard for one run, so the training loop calls four methods:
    `capture()` around each micro-batch forward, `aux_loss(step)` inside it, `after_micro_batch()` after its
    backward, and `after_step(step)` after each optimizer step (metrics, health, the guard)."""

    def __init__(
        self,
        model: nn.Module,
        section,
        router_params: list[nn.Parameter],
        reference_batch: dict,
        micro_batches: int = 1,
    ):
        self.section = section
        self.micro_batches = micro_batches  # a step's micro-batches over all ranks: the aux-loss parts' mean
        self.model = model
        self.captured = RouterCapture(model)
        self.loss = RouterLoss(section.balance_coef, section.z_coef)
        self.health = RouterHealth(self.captured, section.health_window_steps)
        self.guard = CollapseGuard.from_config(section, self.loss, router_params)
        self.router_params = router_params
        self.reference_batch = reference_batch
        # the base's routing on the reference batch, what drift and the load heatmaps compare against: a forward
        # over the whole model (minutes at full size on a CPU), so only where router health is on
        self.measures = bool(section.health_every_steps)
        if self.measures:
            self.health.record_base(model, reference_batch)
        self.parts: dict[str, torch.Tensor] = {}  # summed on the device; read once per step

    def capture(self):
        return self.captured.capture()

    def training_routers(self, step: int) -> bool:
        """Routers learn from step `freeze_steps` on (0-based count of finished steps) unless the guard froze them."""
        return bool(self.router_params) and step >= self.section.freeze_steps and not self.guard.frozen

    def aux_loss(self, step: int):
        """The weighted balancing + z-loss of the current capture (0 while routers do not train)."""
        if not self.training_routers(step) or (self.loss.balance_coef == 0 and self.loss.z_coef == 0):
            return 0.0
        total, parts = self.loss(self.captured)
        for key, value in parts.items():
            self.parts[key] = self.parts.get(key, 0.0) + value.detach()
        return total

    def after_micro_batch(self) -> None:
        self.health.observe()
        self.captured.clear()

    def after_step(self, step: int) -> tuple[dict, dict, str | None]:
        """(metrics, progress-bar fields, a message for the log or None), over all ranks. Raises RouterCollapse on
        'stop'."""
        self._sum_across_ranks()
        self.health.end_step()
        record = {f"router/{k}_loss": float(v) / self.micro_batches for k, v in self.parts.items()}
        record["router/balance_coef"] = self.loss.balance_coef
        self.parts = {}
        show, message = {}, None
        every = self.section.health_every_steps
        if every and step % every == 0:
            self.health.measure_drift(self.model, self.reference_batch)
            rows = (
                self.health.per_layer()
            )  # once: the metrics, the progress bar and the guard read the same rows
            record.update(self.health.metrics(rows))
            show = progress_fields(self.health.summary(rows))
            message = self.guard.check(self.health, step, rows)
        return record, show, message

    def _sum_across_ranks(self) -> None:
        """This step's routed counts and auxiliary-loss parts summed over the ranks (a no-op in one process)."""
        if not active():
            return
        health = self.health
        pending = health.pending.to(comm_device())
        dist.all_reduce(pending)
        health.pending = pending.to(health.pending.device)
        keys = sorted(self.parts)
        if keys:
            parts = torch.stack([torch.as_tensor(self.parts[k]).float().reshape(()) for k in keys])
            device = parts.device
            parts = parts.to(comm_device())
            dist.all_reduce(parts)
            self.parts = dict(zip(keys, parts.to(device).unbind(0), strict=True))

    def state_dict(self) -> dict:
        return {"balance_coef": self.loss.balance_coef, "frozen": self.guard.frozen}

    def load_state_dict(self, state: dict) -> None:
        self.loss.balance_coef = float(state["balance_coef"])
        if state["frozen"]:
            self.guard.freeze()

    def tensor_state(self) -> dict[str, torch.Tensor]:
        """The health window's per-step counts, so the guard judges the same window after a resume."""
        window = self.health.window
        return {"router/health_window": torch.stack(list(window))} if window else {}

    def load_tensor_state(self, tensors: dict[str, torch.Tensor]) -> None:
        saved = tensors.get("router/health_window")
        self.health.window.clear()
        if saved is not None:
            self.health.window.extend(saved.unbind(0))

    def load_before_after(self) -> tuple[torch.Tensor, torch.Tensor, list[int]] | None:
        """Per-layer expert loads on the reference batch: at the start and now (for `usaf report` heatmaps); None
        with router health off (router.health_every_steps=0: no reference forward at the start, none here)."""
        if not self.measures:
            return None
        self.health.measure_drift(self.model, self.reference_batch)
        return (
            self.health.load_matrix(self.health.base_counts),
            self.health.load_matrix(self.health.reference_counts),
            self.health.layer_numbers,
        )
