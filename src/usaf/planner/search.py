"""The verdict on a plan, and the search for settings that fit when it does not (cheapest changes first)."""

from __future__ import annotations

from dataclasses import dataclass

from usaf.config import (
    AUTO_DENSITIES,
    DEFAULT_WORKSPACE_MB,
    RESIDENCIES,
)
from usaf.planner.ledger import Plan, plan, stored_bytes
from usaf.planner.settings import DEVICES, DTYPE_BYTES, Device, PlanSettings, default_dtype
from usaf.planner.shape import ModelShape
from usaf.planner.sizes import MiB, format_size
from usaf.planner.storage import residencies as storable
from usaf.quant import by_precision


@dataclass
class Verdict:
    """The requested settings' plan, the one chosen, and what to change when it does not fit."""

    requested: Plan  # the requested settings, experts on the device (or at the requested residency)
    chosen: Plan  # the requested settings at the first residency that fits (else `requested`)
    status: str  # "fits on device" | "needs host offload" | "does not fit"
    suggestion: Plan | None = None  # the nearest settings that fit, when nothing requested does
    on_device: Plan | None = None  # when offloading: the nearest settings that fit on the device alone


def decide(
    shape: ModelShape,
    settings: PlanSettings,
    device: Device,
    vram: int | None = None,
    ram: int | None = None,
    residency: str = "auto",
) -> Verdict:
    """Plan at `residency` ("auto": the device, else host memory, else a memory map) and search when it fails."""
    machine = _Machine(shape, device, vram, ram)
    order = _residencies(device, residency)
    plans = [machine.plan(settings.replace(residency=r)) for r in order]
    fitting = [p for p in plans if p.fits]
    if fitting:
        chosen = fitting[0]
        on_device = chosen.settings.residency == "device"
        verdict = Verdict(plans[0], chosen, "fits on device" if on_device else "needs host offload")
        if not on_device:
            verdict.on_device = search(machine, settings, residencies=("device",))
        return verdict
    verdict = Verdict(plans[0], plans[0], "does not fit")
    verdict.suggestion = search(machine, settings, residencies=order) or search(machine, settings)
    return verdict


def _residencies(device: Device, residency: str) -> tuple[str, ...]:
    """The residencies to try, in order: the one asked for, or for "auto" the device, else host memory (a GPU's
    host), else a memory map."""
    return (RESIDENCIES if device.is_gpu else ("device", "mmap")) if residency == "auto" else (residency,)


@dataclass(frozen=True)
class _Machine:
    """The model and the memory that every plan of one search is made for."""

    shape: ModelShape
    device: Device
    vram: int | None
    ram: int | None

    def plan(self, settings: PlanSettings) -> Plan:
        return plan(self.shape, settings, self.device, self.vram, self.ram)


def auto_density(
    shape: ModelShape, settings: PlanSettings, device: Device, vram=None, ram=None, residency: str = "device"
) -> tuple[PlanSettings, str]:
    """select.density=auto: `settings` at the largest of AUTO_DENSITIES whose plan fits at `residency` ("auto":
    any residency `decide` would take; vram and ram as `plan` takes them), and why, in words for the run's first
    lines."""
    machine = _Machine(shape, device, vram, ram)
    order = _residencies(device, residency)
    over = None  # the plan of the density above the chosen one
    for density in AUTO_DENSITIES:
        candidate = settings.replace(density=density)
        plans = [machine.plan(candidate.replace(residency=r)) for r in order]
        fitting = next((p for p in plans if p.fits), None)
        if fitting is not None:
            why = f"peak {format_size(fitting.device_peak)} of {format_size(fitting.device_budget)}"
            if over is None:
                return candidate, f"the most auto takes; {why}"
            above = f"{over.settings.density:.2%} would peak at {format_size(over.device_peak)}"
            return candidate, f"the largest that fits: {why}; {above}"
        over = plans[0]
    least = AUTO_DENSITIES[-1]
    return settings.replace(density=least), (
        f"even {least:.2%} does not fit: peak {format_size(over.device_peak)} of "
        f"{format_size(over.device_budget)}; see usaf plan for settings that do"
    )


def auto_workspace(
    shape: ModelShape, settings: PlanSettings, device: Device, vram=None, ram=None, residency: str = "device"
) -> tuple[PlanSettings, str | None]:
    """select.workspace_mb=auto: one chunk of every expert of a projection where the plan still fits at the
    residency the smallest workspace (DEFAULT_WORKSPACE_MB) fits at, else the largest halving of that which
    fits: fewer chunks are fewer kernel launches and larger grouped products. DEFAULT_WORKSPACE_MB where even it
    does not fit, or where nothing is dequantized (unquantized experts on the device). And why, in words (None
    where nothing is dequantized)."""
    machine = _Machine(shape, device, vram, ram)
    least = settings.replace(workspace_mb=DEFAULT_WORKSPACE_MB)
    plans = [machine.plan(least.replace(residency=r)) for r in _residencies(device, residency)]
    at = next((p.settings.residency for p in plans if p.fits), None)
    if at is None:
        return least, "the least auto takes: the plan does not fit"
    if settings.quant == "none" and at == "device":
        return least, None  # the experts are used in place: nothing to say
    whole = -(-shape.num_experts * shape.largest_expert_matrix * DTYPE_BYTES[settings.dtype] // MiB)
    for mb in _halvings(whole, DEFAULT_WORKSPACE_MB):
        candidate = settings.replace(workspace_mb=mb)
        fitting = machine.plan(candidate.replace(residency=at))
        if fitting.fits:
            chunks = "every expert of a projection at once" if mb == whole else f"1/{whole // mb} of them"
            why = f"peak {format_size(fitting.device_peak)} of {format_size(fitting.device_budget)}"
            return candidate, f"{chunks}; {why}"
    return least, "no larger workspace fits"


def _halvings(value: int, floor: int) -> list[int]:
    values = [value]
    while values[-1] // 2 >= floor:
        values.append(values[-1] // 2)
    return values


# Cost of each change away from the requested settings: streaming the experts, coarser quantization and lower
# density change speed or quality; a smaller batch is recovered by gradient accumulation; a shorter sequence
# changes what the model sees; a smaller logits chunk only costs speed.
COSTS = {"residency": 1.0, "quant": 1.0, "batch": 0.5, "seq": 2.0, "density": 1.5, "logits_chunk": 0.25}


def search(machine: _Machine, settings: PlanSettings, residencies=RESIDENCIES) -> Plan | None:
    """The fitting settings nearest to `settings` (least total cost of changes, then the fastest step), over
    residency, quantization, batch, sequence length, density and logits chunk."""
    if not machine.device.is_gpu:
        residencies = tuple(r for r in residencies if r != "host") or ("device",)
    # a published checkpoint's experts are what it publishes: never re-quantized
    order = by_precision()
    quants = order[order.index(settings.quant) :] if settings.quant in order else (settings.quant,)
    best, best_key = None, None
    for r_cost, residency in enumerate(residencies):
        for q_cost, quant in enumerate(quants):
            if residency not in storable(quant, machine.device):  # what usaf train would refuse
                continue
            for b_cost, batch in enumerate(_halvings(settings.batch, 1)):
                for s_cost, seq in enumerate(_halvings(settings.seq, 128)):
                    for d_cost, budget in enumerate(_budgets(settings)):
                        for c_cost, chunk in enumerate(_halvings(settings.logits_chunk, 64)):
                            cost = (
                                COSTS["residency"] * r_cost
                                + COSTS["quant"] * q_cost
                                + COSTS["batch"] * b_cost
                                + COSTS["seq"] * s_cost
                                + COSTS["density"] * d_cost
                                + COSTS["logits_chunk"] * c_cost
                            )
                            if best_key is not None and cost > best_key[0]:
                                continue
                            candidate = settings.replace(
                                residency=residency,
                                quant=quant,
                                batch=batch,
                                seq=seq,
                                **budget,
                                logits_chunk=chunk,
                            )
                            p = machine.plan(candidate)
                            key = (cost, p.step.seconds)
                            if p.fits and (best_key is None or key < best_key):
                                best, best_key = p, key
    return best


SMALL_CARD = "rtx-3060-12gb"


def _budgets(settings: PlanSettings) -> list[dict]:
    """Smaller budgets of trained entries to try: the density halved, or `num_entries` where the run sets it."""
    if settings.num_entries is not None:
        return [{"num_entries": max(1, settings.num_entries >> n)} for n in range(8)]
    return [{"density": settings.density / 2**n} for n in range(8)]


def published_line(shape: ModelShape, settings: PlanSettings, device: Device, ram, residency: str) -> str:
    """One line on a published checkpoint's experts: their real size, and whether the run fits a 12 GB card."""
    payload, constants = stored_bytes(shape.expert_matrices, settings.quant, DTYPE_BYTES[settings.dtype])
    bits = 8 * (payload + constants) / max(1, shape.expert_weights)
    card = DEVICES[SMALL_CARD]
    small = settings if device.is_gpu else settings.replace(dtype=default_dtype(card))
    verdict = decide(shape, small, card, card.memory, ram, residency=residency)
    where = {"fits on device": "fits", "needs host offload": "fits with the experts in host memory"}
    return (
        f"published {settings.quant.upper()} experts, kept as published: {format_size(payload + constants)} "
        f"({bits:.2f} bits/weight); on a 12 GB card ({SMALL_CARD}) this run "
        f"{where.get(verdict.status, 'does not fit')}"
    )
