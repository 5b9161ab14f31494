"""model.quant=auto, model.residency=auto and model.cache_mb=auto: how and where the frozen experts are stored, chosen
against the card as select.density=auto is, in one order (`usaf plan` and `usaf train` both call these):

1. the least lossy storage whose plan fits somewhere in memory, with room for the plan's error (STORAGE_HEADROOM;
   the first that fits at all where none leaves room): unquantized, then int8, nf4, ... (a published
   MXFP4/FP8 checkpoint keeps its own format; a store, the format it was prepared in);
2. for it, the residency: the device, else pinned host memory (a GPU's host); only where no storage fits in memory
   at all, the experts memory-mapped from disk (their bytes read again every step: the slowest way to fit);
3. then the density and the workspace (`usaf.planner.search`), then the cache: with the experts off the device,
   the device memory the plan leaves free keeps the most-routed ones resident.

"Fits" is judged at the run's density, or at the least that density=auto takes: the storage is what makes a run
possible at all, and the density is then the largest that fits on it. An unquantized base trains from the model's
own weights on the device: off the device its experts are a quantized store's (`usaf.base.load`)."""

from __future__ import annotations

from usaf.config import AUTO, AUTO_DENSITIES
from usaf.planner.ledger import Plan, plan, stored_bytes
from usaf.planner.settings import DEVICES, DTYPE_BYTES, Device, PlanSettings
from usaf.planner.sizes import GiB, MiB, format_size
from usaf.quant import by_precision

IN_MEMORY = ("device", "host")
# the host RAM sizes a "smallest machine" line names (a workstation's steps)
RAM_STEPS = tuple(n * GiB for n in (16, 32, 64, 128, 256, 512, 1024, 2048))
# what the expert cache leaves free on the card: room for the plan's error (bench/plan_accuracy.py,
# bench/results/simulate-*: -10 % to +4 % at full size) beyond its slack
CACHE_HEADROOM = 0.10
# a storage whose plan at the least density fills the card to within this share is passed over for the next where
# one leaves room (the plan's error, as above): gpt-oss-20b's experts on a 16 GB card peak at 15.95 GB planned and
# 16.10 GB simulated at 0.10 %; in pinned host memory 2 % fits
STORAGE_HEADROOM = 0.10


def residencies(quant: str, device: Device) -> tuple[str, ...]:
    """Where experts stored as `quant` can live on `device`: unquantized ones on the device only (see the module);
    a CPU's host memory is its device memory."""
    if quant == "none":
        return ("device",)
    return ("device", "host", "mmap") if device.is_gpu else ("device", "mmap")


def _candidates(settings: PlanSettings, device: Device, quant_auto: bool, residency_auto: bool) -> list:
    """(quant, residency) pairs in the order of the module: in memory first, storage before residency."""
    quants = by_precision() if quant_auto and settings.published is None else (settings.quant,)
    if not residency_auto:  # where the run says: any storage that can live there
        r = settings.residency
        return [(q, r) for q in quants if r == "device" or q != "none"] or [(quants[-1], r)]
    pairs = [(q, r) for q in quants for r in residencies(q, device)]
    return [p for p in pairs if p[1] in IN_MEMORY] + [p for p in pairs if p[1] not in IN_MEMORY]


def _least(settings: PlanSettings, *, given: bool = True) -> PlanSettings:
    """The settings at the least density that density=auto takes: where density is auto, or (`given` False) even
    where the run sets one; a number of entries is kept."""
    if settings.num_entries is None and (settings.run.select.density is AUTO or not given):
        return settings.replace(density=AUTO_DENSITIES[-1])
    return settings


def _with(settings: PlanSettings, quant: str, residency: str) -> PlanSettings:
    changes = {"residency": residency}
    if settings.published is None:  # a published format is kept: never re-quantized
        changes["quant"] = quant
    return settings.replace(**changes)


def _first_fitting(shape, settings: PlanSettings, device: Device, vram, ram, candidates: list):
    """The first of `candidates` whose plan of `settings` fits with STORAGE_HEADROOM of the device budget to spare
    (else the first that fits at all), its plan, and the plans tried before it (None for the first two where none
    fits)."""
    plans = [plan(shape, _with(settings, q, r), device, vram, ram) for q, r in candidates]
    for roomy in (True, False):
        for i, p in enumerate(plans):
            if p.fits and (not roomy or p.device_peak <= p.device_budget * (1 - STORAGE_HEADROOM)):
                return candidates[i], p, plans[:i]
    return None, None, plans


def auto_storage(
    shape, settings: PlanSettings, device: Device, vram=None, ram=None, *, quant: bool, residency: bool
) -> tuple[PlanSettings, list[str]]:
    """`settings` with the experts' storage (`quant`: model.quant is auto) and residency (`residency`:
    model.residency is auto) chosen in the module's order, and a line for each auto saying what and why. Where
    nothing fits at the run's own density, the storage that fits at the least one (the verdict's suggestion then
    says at which); where nothing fits at all, the most compact, with the smallest card and RAM that would do."""
    if not (quant or residency):
        return settings, []
    candidates = _candidates(settings, device, quant, residency)
    wanted = [i for i, asked in enumerate((quant, residency)) if asked]
    keys = "/".join(("model.quant", "model.residency")[i] for i in wanted)

    def chosen_text(pair) -> str:
        return "/".join(pair[i] for i in wanted)

    pair, chosen, tried = _first_fitting(shape, _least(settings), device, vram, ram, candidates)
    if pair is not None:
        return _with(settings, *pair), _lines(chosen, tried, quant, residency)
    why = f"nothing fits: even {_storage(tried[-1])} peaks at {_peaks(tried[-1])}"
    lowest = _least(settings, given=False)
    pair, chosen, _ = _first_fitting(shape, lowest, device, vram, ram, candidates)
    if pair is not None:
        at = f"{lowest.density:.2%}"
        return _with(settings, *pair), [
            f"{keys}=auto: {chosen_text(pair)}, {why}; this storage fits at density {at}"
        ]
    smallest = smallest_machine(shape, lowest, device, quant, residency)
    pair = candidates[-1]  # the most compact: what the run will try
    return _with(settings, *pair), [f"{keys}=auto: {chosen_text(pair)}, {why}; {smallest}"]


def _lines(chosen: Plan, tried: list[Plan], quant: bool, residency: bool) -> list[str]:
    s, lines = chosen.settings, []
    if quant:
        if s.published is not None:
            lines.append(
                f"model.quant=auto: {s.quant}, the checkpoint's published format (kept as published)"
            )
        else:
            lossier = [p for p in tried if p.settings.quant != s.quant]
            why = "the least lossy storage" + (" that fits" if lossier else "")
            if lossier:
                best = lossier[0]
                why += f": {_storage(best)} would peak at {_peaks(best)}{_no_room(best)}"
            lines.append(f"model.quant=auto: {s.quant}, {why}")
    if residency:
        here = f"peak {_peaks(chosen)}"
        before = [p for p in tried if p.settings.quant == s.quant]
        if before:
            here += f"; {_where(before[-1].settings.residency)} they would peak at {_peaks(before[-1])}"
            here += _no_room(before[-1])
        lines.append(f"model.residency=auto: {s.residency}, {_where(s.residency)}: {here}")
    return lines


def _no_room(p: Plan) -> str:
    """Why a plan that fits was passed over: it leaves the card less than STORAGE_HEADROOM for the plan's error."""
    return f" (less than {STORAGE_HEADROOM:.0%} of the card to spare for the plan's error)" if p.fits else ""


def _storage(p: Plan) -> str:
    s = p.settings
    name = "unquantized experts" if s.quant == "none" else f"{s.quant} experts"
    return f"{name} {_where(s.residency)}"


def _where(residency: str) -> str:
    return {"device": "on the device", "host": "in pinned host memory", "mmap": "memory-mapped from disk"}[
        residency
    ]


def _peaks(p: Plan) -> str:
    text = f"{format_size(p.device_peak)} of {format_size(p.device_budget)}"
    if p.device.is_gpu and p.settings.residency != "device":
        text += f" (host {format_size(p.host_peak)} of {format_size(p.ram)})"
    return text


def smallest_machine(shape, settings: PlanSettings, device: Device, quant: bool, residency: bool) -> str:
    """The line naming the smallest card (by its memory; a CPU: RAM alone) and host RAM whose plan of `settings`
    fits at some storage the autos may take."""
    cards = (
        sorted((d for d in DEVICES.values() if d.is_gpu), key=lambda d: d.memory)
        if device.is_gpu
        else [device]
    )
    for card in cards:
        for ram in RAM_STEPS:
            candidates = _candidates(settings, card, quant, residency)
            if any(plan(shape, _with(settings, q, r), card, card.memory, ram).fits for q, r in candidates):
                if not card.is_gpu:
                    return f"the smallest machine that would do: {format_size(ram)} of RAM"
                return f"the smallest that would do: a {format_size(card.memory)} card ({card.name}) with {format_size(ram)} of host RAM"
    return (
        "no card usaf knows would do (the largest with 2 TB of RAM); see usaf plan --gpus N --expert-parallel"
    )


def auto_cache(
    shape, settings: PlanSettings, device: Device, vram=None, ram=None
) -> tuple[PlanSettings, str | None]:
    """model.cache_mb=auto: with the experts off a GPU, the device memory the plan leaves free (less
    CACHE_HEADROOM of the budget), at most the rank's stored experts; 0 where they are on the device. The line
    (None: nothing cached, nothing to say)."""
    p = plan(shape, settings.replace(cache_mb=0), device, vram, ram)
    if not device.is_gpu or p.settings.residency == "device" or not p.fits:
        return settings.replace(cache_mb=0), None
    payload, constants = stored_bytes(shape.expert_matrices, settings.quant, DTYPE_BYTES[settings.dtype])
    stored = (payload + constants) / settings.expert_parallel  # this rank's experts
    free = p.device_budget * (1 - CACHE_HEADROOM) - p.device_peak
    mb = int(max(0.0, min(free, stored)) // MiB)
    if mb == 0:
        return settings.replace(cache_mb=0), None
    cached = plan(shape, settings.replace(cache_mb=mb), device, vram, ram)
    share = f", {mb * MiB / stored:.0%} of them"
    return settings.replace(cache_mb=mb), (
        f"model.cache_mb=auto: {mb} MB, the most-routed experts kept on the device{share}: peak "
        f"{format_size(cached.device_peak)} of {format_size(cached.device_budget)}"
    )
