"""Plans and verdicts as text: the ledger table, the step-time estimate, and the command line that fits."""

from __future__ import annotations

import yaml

from usaf.config import plain
from usaf.planner.ledger import Plan
from usaf.planner.search import Verdict
from usaf.planner.settings import DEVICES, PlanSettings, default_dtype
from usaf.planner.shape import list_presets, load_model_config
from usaf.planner.sizes import GiB, MiB, format_count, format_size


def _size_arg(num_bytes: int) -> str:
    for unit, scale in (("GB", GiB), ("MB", MiB), ("KB", 1024)):
        if num_bytes % scale == 0:
            return f"{num_bytes // scale}{unit}"
    return f"{num_bytes}B"  # sizes are always given with a unit (a bare number is refused)


def command_line(model: str, p: Plan) -> str:
    """`usaf plan` arguments that reproduce this plan."""
    s, defaults = p.settings, PlanSettings()
    known = p.device.name in DEVICES  # a GPU known by its memory alone is --vram only
    parts = [f"usaf plan --model {model}" + (f" --device {p.device.name}" if known else "")]
    if p.device.is_gpu:
        parts.append(f"--vram {_size_arg(p.vram)}")
    parts += [
        f"--ram {_size_arg(p.host_ram or p.ram)}",
        f"--seq {s.seq}",
        f"--batch {s.batch}",
        f"--density {s.density:g}",
        f"--quant {s.quant}",
        f"--residency {s.residency}",
        f"--logits-chunk {s.logits_chunk}",
    ]
    flags = [
        (s.num_entries is not None, f"--num-entries {s.num_entries}"),
        (s.layers is not None, f"--layers {','.join(map(str, s.layers or []))}"),
        (s.granularity != defaults.granularity, f"--granularity {s.granularity}"),
        (s.quant_dense, "--quant-dense"),
        (not s.recompute, "--no-recompute"),
        (s.optimizer != defaults.optimizer, f"--optimizer {s.optimizer}"),
        (s.dtype != default_dtype(p.device), f"--dtype {s.dtype}"),
        (s.workspace_mb != defaults.workspace_mb, f"--workspace-mb {s.workspace_mb}"),
        (s.gpus > 1, f"--gpus {s.gpus}"),
        (s.expert_parallel == s.gpus > 1, "--expert-parallel"),
        (1 < s.expert_parallel < s.gpus, f"--expert-parallel {s.expert_parallel}"),
        (s.gpus_per_host > 0, f"--gpus-per-host {s.gpus_per_host}"),
    ]
    return " ".join(parts + [flag for wanted, flag in flags if wanted])


_RUN_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def run_config(model: str, p: Plan) -> str:
    """The settings of plan `p` as a run configuration for `usaf train --config` (YAML): the options of the run the
    plan wraps (`PlanSettings.run`) that a plan decides, in the keys a run reads."""
    run = p.settings.run
    if model in list_presets():  # a preset's name is the planner's; a run loads its Hugging Face repository
        model = load_model_config(model)[1].get("_source", model)
    select = run.select
    sections = {
        "model": {
            "path": model,
            "quant": run.model.quant,
            "residency": run.model.residency,
            "dtype": _RUN_DTYPES.get(p.settings.dtype, p.settings.dtype),
        },
        "data": {"max_seq_len": run.data.max_seq_len, "batch_size": run.data.batch_size},
        "select": {
            key: plain(getattr(select, key))  # auto as the word
            for key in ("density", "num_entries", "layers", "granularity", "workspace_mb", "targets")
            if getattr(select, key) is not None
        },
        "optim": {"moments": run.optim.moments, "eight_bit": run.optim.eight_bit},
        "train": {
            "recompute": p.settings.recompute,  # what the plan planned (auto resolved)
            "logits_chunk_tokens": run.train.logits_chunk_tokens,
            "objective": run.train.objective,
        },
    }
    if run.distributed.expert_parallel > 1:
        sections["distributed"] = {"expert_parallel": run.distributed.expert_parallel}
    return yaml.safe_dump(sections, sort_keys=False, default_flow_style=False).rstrip()


def _as_run_config(model: str, p: Plan) -> list[str]:
    return ["as a run configuration (save it as run.yaml, then usaf train --config run.yaml ...):"] + [
        "  " + line for line in run_config(model, p).splitlines()
    ]


def _objective(s) -> str:
    """What the settings line says of an objective that changes the plan: its pairs, its reference forward."""
    said = [
        *(["batch counts the chosen and rejected rows"] if s.pairs else []),
        *(["the reference forward is a fourth pass"] if s.reference_forward == 1 else []),
        *(
            [f"{s.reference_forward} forwards without gradients are passes 4 to {3 + s.reference_forward}"]
            if s.reference_forward > 1
            else []
        ),
    ]
    return f", {s.objective} ({'; '.join(said)})" if said else ""


def _budget(s) -> str:
    """The trained entries' budget as the run gives it, and the layers it trains when they are named."""
    budget = f"density {s.density:g}" if s.num_entries is None else f"{format_count(s.num_entries)} entries"
    return budget if s.layers is None else f"{budget} in layers {s.layers}"


def effective_settings(s: PlanSettings, precision: str, card: str) -> str:
    """The block `usaf train` prints at its start and `usaf plan` in its output, for one run alike: the settings
    with every auto resolved (`s`), the forward's autocast dtype and the card it is planned for."""
    run = s.run
    workspace = f", workspace {s.workspace_mb} MB" if s.quant != "none" or s.residency != "device" else ""
    reselect = f"every {run.select.reselect_every} steps" if s.reselect else "off"
    rows = {
        "data": f"seq {s.seq} x batch {run.data.batch_size}",
        "select": f"{_budget(s)} ({s.granularity}) of {','.join(s.targets)}{workspace}, reselect {reselect}",
        "base": f"experts {s.quant}, residency {s.residency}, cache_mb {s.cache_mb}",
        "compute": f"{s.dtype}, precision {precision}, recompute {'on' if s.recompute else 'off'}, "
        f"logits chunk {s.logits_chunk}",
        "objective": f"{s.objective}, {s.optimizer}",
        "card": card,
    }
    return "\n".join(["effective settings:", *(f"  {key + ':':10} {value}" for key, value in rows.items())])


def format_plan(p: Plan) -> str:
    """The ledger as a table: device and host columns (one memory column on the CPU), peak marks, totals."""
    shape, s, gpu = p.shape, p.settings, p.device.is_gpu
    out = [
        f"{shape.name} ({shape.model_type}): {format_count(shape.total_params)} parameters, "
        f"{format_count(shape.active_params)} active per token (shapes from the {shape.shapes_from})",
        f"settings: seq {s.seq} x batch {s.batch}, {_budget(s)} ({s.granularity}), experts {s.quant}, "
        f"compute {s.dtype}, residency {s.residency}, recompute {'on' if s.recompute else 'off'}, "
        f"logits chunk {s.logits_chunk}, {s.optimizer}" + _objective(s),
    ]
    if s.gpus > 1:
        how = "data parallel"
        if s.data_parallel > 1 and s.expert_parallel > 1:
            how = f"expert parallel {s.expert_parallel} x data parallel {s.data_parallel}: each holds 1/{s.expert_parallel} of every layer's experts"
        elif s.expert_parallel > 1:
            how = f"expert parallel: each holds 1/{s.gpus} of every layer's experts"
        out.append(
            f"{s.gpus} GPUs, {how}; the ledger is one rank's, each rank training its own seq x batch tokens"
        )
    width = max(len(line.name) for line in p.lines) + 2
    columns = ("device", "host") if gpu else ("memory",)
    out.append(" " * width + "".join(f"{c:>10}" for c in columns) + "  at peak           detail")
    for line in p.lines:
        values = (line.device, line.host) if gpu else (line.device,)
        when = (
            "yes" if line.persistent or p.peak_phase in line.phases else f"({', '.join(sorted(line.phases))})"
        )
        out.append(
            f"{line.name:{width}}"
            + "".join(f"{format_size(v):>10}" for v in values)
            + f"  {when:17} {line.detail}"
        )
    peaks = (p.device_peak, p.host_peak) if gpu else (p.device_peak,)
    budgets = (p.vram, p.ram) if gpu else (p.ram,)
    out.append(
        f"{'peak':{width}}"
        + "".join(f"{format_size(v):>10}" for v in peaks)
        + f"  during the {p.peak_phase or 'whole run'}"
    )
    out.append(f"{'available':{width}}" + "".join(f"{format_size(v):>10}" for v in budgets))
    out.append(_step_line(p))
    out += _traffic_lines(p)
    out += [f"note: {note}" for note in p.notes]
    return "\n".join(out)


def _step_line(p: Plan) -> str:
    """The step-time estimate, from the planned card's own figures, or that it has none (never another card's)."""
    st = p.step
    if not p.device.has_figures:
        return (
            f"step time: no speed figures for {p.device.name} ({st.flops / 1e12:.1f} TFLOP a step); name its card "
            "(train.card, or --device) for an estimate"
        )
    return (
        f"step ~ {st.seconds:.2f} s on {p.device.name}: compute {st.compute_s:.2f} s ({st.flops / 1e12:.1f} "
        f"TFLOP), memory traffic {st.memory_s:.2f} s, streaming {st.streaming_s:.2f} s -> {st.dominant} "
        "dominates"
    )


def _step(p: Plan) -> str:
    """The step time in a verdict's suggestion: seconds on a card with figures."""
    return f", step ~ {p.step.seconds:.2f} s" if p.device.has_figures else ""


def _traffic_lines(p: Plan) -> list[str]:
    t, s = p.traffic, p.settings
    if s.gpus == 1:
        return []
    rate = f"{t.peer_gbps:g} GB/s per direction between GPUs"
    experts = (
        f" ({format_size(t.expert_all_reduce)} of them expert entries, over their {s.data_parallel} replicas)"
        if t.expert_all_reduce
        else ""
    )
    lines = [
        f"all-reduce per step: {format_size(t.all_reduce_buffer)} of fp32 gradients{experts}, "
        f"{format_size(t.all_reduce_sent)} sent per rank in a ring, ~ {t.all_reduce_s:.3f} s at {rate}; overlapped "
        "with the last backward"
    ]
    if s.expert_parallel > 1:
        passes = "forward, recomputation and backward" if s.recompute else "forward and backward"
        lines.append(
            f"all-to-all per step: {format_size(t.all_to_all_sent)} leaving each rank (2 exchanges per MoE layer in "
            f"each of {passes}, the {s.expert_parallel - 1}/{s.expert_parallel} of pairs whose expert lives "
            "elsewhere), "
            f"~ {t.all_to_all_s:.2f} s at {rate}, on top of the step"
        )
    return lines


def format_verdict(model: str, v: Verdict) -> str:
    """The ledger of the configuration that fits (or of the request, when nothing does), the verdict, and the
    command line of the settings to use instead."""
    chosen = v.chosen
    if v.status == "fits on device":
        spare = format_size(chosen.device_budget - chosen.device_peak)
        return f"{format_plan(chosen)}\n\nverdict: fits on device ({spare} to spare)"
    if v.status == "needs host offload":
        lines = [
            format_plan(chosen),
            "",
            f"verdict: needs host offload - the experts live in {'host memory' if chosen.settings.residency == 'host' else 'a memory map'} "
            f"and stream to the device per layer (on the device alone: {format_size(v.requested.device_peak)} "
            f"of {format_size(v.requested.device_budget)})",
        ]
        if v.on_device is not None:
            lines.append(
                f"to fit on the device instead ({format_size(v.on_device.device_peak)}{_step(v.on_device)}):"
                f"\n  {command_line(model, v.on_device)}"
            )
            lines += _as_run_config(model, v.on_device)
        return "\n".join(lines)
    need = f"{format_size(chosen.device_peak)} of {format_size(chosen.device_budget)}"
    if chosen.device.is_gpu and chosen.host_peak > chosen.ram:
        need += f" on the device, {format_size(chosen.host_peak)} of {format_size(chosen.ram)} host"
    lines = [format_plan(chosen), "", f"verdict: does not fit (needs {need})"]
    if chosen.settings.gpus > 1 and chosen.replicated_dense > chosen.device_budget:
        lines.append(
            f"the dense weights, whole on every rank, and the runtime's context alone take "
            f"{format_size(chosen.replicated_dense)} of the {format_size(chosen.device_budget)} card: shard them "
            "over the GPUs with FSDP2 (distributed.shard_dense=true, or auto)"
        )
    if v.suggestion is None:
        lines.append(
            "nothing searched fits (residency, quantization, batch, sequence, density, logits chunk): "
            "a larger device or more host memory is needed"
        )
    else:
        sp = v.suggestion
        lines += [
            f"settings that fit ({format_size(sp.device_peak)} on the device{_step(sp)}):",
            f"  {command_line(model, sp)}",
            *_as_run_config(model, sp),
            "",
            format_plan(sp),
        ]
    return "\n".join(lines)
