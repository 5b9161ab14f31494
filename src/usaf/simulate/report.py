"""The simulated step beside the plan: the device peak with the planner's fixed overheads, line by line where the
two differ by more than `TOLERANCE`, host syncs per step and per layer-step, and what was not simulated."""

from __future__ import annotations

from usaf.planner.ledger import LAYER, LOSS, STEP
from usaf.planner.settings import CUDA_CONTEXT, GPU_ALLOCATOR_SLACK
from usaf.planner.sizes import format_size
from usaf.simulate.step import ACTIVATIONS, EXCHANGE, LEDGER_LINES, LOGITS, OFFLOAD, WORKSPACE

TOLERANCE = 0.10
TRANSIENT = frozenset({ACTIVATIONS, LOGITS, WORKSPACE, EXCHANGE, "optimizer step temporaries"})


def simulated_peak(sim) -> float:
    """Live bytes at the simulated peak plus the planner's fixed overheads: the CUDA context and the caching
    allocator's slack over the transients (`usaf.planner.settings`)."""
    transient = sum(n for line, n in sim.device_lines.items() if line in TRANSIENT)
    return sim.device_peak + CUDA_CONTEXT + GPU_ALLOCATOR_SLACK * transient


def planned_lines(plan) -> dict[str, float]:
    """The plan's device bytes per simulation line, at the plan's peak phase (persistent lines and those alive in
    it)."""
    phase = plan.peak_phase
    out = {}
    for line, names in LEDGER_LINES.items():
        out[line] = sum(
            ledger.device
            for ledger in plan.lines
            if ledger.name in names and (ledger.persistent or phase in ledger.phases)
        )
    return out


def rows(plan, sim) -> list[tuple[str, float, float]]:
    """(line, planned, simulated) for every line either has."""
    planned = planned_lines(plan)
    names = [*LEDGER_LINES, *(n for n in sim.device_lines if n not in LEDGER_LINES)]
    return [
        (n, planned.get(n, 0.0), float(sim.device_lines.get(n, 0)))
        for n in names
        if planned.get(n, 0.0) or sim.device_lines.get(n, 0)
    ]


def differs(planned: float, simulated: float) -> bool:
    return abs(simulated - planned) > TOLERANCE * max(planned, simulated, 1.0)


def summary(plan, sim) -> dict:
    peak = simulated_peak(sim)
    return {
        "planned_peak": plan.device_peak,
        "simulated_peak": peak,
        "difference": (peak - plan.device_peak) / plan.device_peak if plan.device_peak else 0.0,
        "planned_phase": plan.peak_phase,
        "live_bytes_at_peak": sim.device_peak,
        "calibration_peak": sim.calibration_peak,
        "host_live_peak": sim.host_peak,
        "syncs_per_step": sim.step_syncs,
        "moe_layers": sim.layer_steps,
        "layer_syncs": sim.layer_syncs,
        "syncs_per_layer_step": sim.syncs_per_layer_step,
        "per_step_syncs": sim.per_step_syncs,
        "sync_sites": dict(sim.sync_sites),
        "mismatches": len(sim.mismatches),
        "findings": list(sim.mismatches),
        "lines": [
            {
                "line": n,
                "planned": p,
                "simulated": s,
                "largest": sim.device_line_max.get(n, 0),
                "differs": differs(p, s),
            }
            for n, p, s in rows(plan, sim)
        ],
        "seconds": sim.seconds,
        "rank": sim.rank,
        "notes": list(sim.notes),
    }


def format_report(plan, sim) -> list[str]:
    peak = simulated_peak(sim)
    diff = (peak - plan.device_peak) / plan.device_peak if plan.device_peak else 0.0
    out = [
        f"simulated step ({sim.rank}; the card simulated on fake `meta` tensors under FakeTensorMode, since "
        "autograd on fake cuda tensors aborts a CPU-only torch; no weight read):",
        f"  device peak: {format_size(peak)} simulated ({format_size(sim.device_peak)} live tensors + CUDA context "
        f"{format_size(CUDA_CONTEXT)} + allocator slack {GPU_ALLOCATOR_SLACK:.0%} of the transients) vs "
        f"{format_size(plan.device_peak)} planned ({diff:+.1%}; the plan's peak phase: {plan.peak_phase})",
    ]
    for name, planned, simulated in rows(plan, sim):
        if differs(planned, simulated):
            largest = sim.device_line_max.get(name, 0)
            own = f" (its own largest {format_size(largest)})" if differs(largest, simulated) else ""
            out.append(
                f"    {name}: {format_size(simulated)} simulated at the peak{own} vs {format_size(planned)} planned"
            )
    out += [
        f"  host syncs: {sim.step_syncs} a step: {sim.syncs_per_layer_step:.2f} a layer-step ({sim.layer_syncs} "
        f"in the layers over {sim.layer_steps} MoE layers) + {sim.per_step_syncs} once a step"
        + (
            ": " + ", ".join(f"{site} x{n}" for site, n in sorted(sim.sync_sites.items()))
            if sim.sync_sites
            else ""
        ),
        f"  device mismatches: {len(sim.mismatches)}" + "".join(f"\n    {m}" for m in sim.mismatches),
        f"  calibration batch: {format_size(sim.calibration_peak)} live at its peak",
        f"  kernels: {sim.kernels}",
        f"  routing: balanced (each expert gets tokens x top-k / E rows); the selection: the plan's entries spread "
        f"evenly; reselection: {sim.reselection}",
        *(f"  note: {n}" for n in sim.notes),
        f"  simulated in {sim.seconds:.1f} s",
    ]
    return out


__all__ = ["LAYER", "LOSS", "OFFLOAD", "STEP", "format_report", "simulated_peak", "summary"]
