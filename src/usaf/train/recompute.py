"""`train.recompute=auto`: recompute exactly when the planner's ledger says the activations would not fit.

The run's configuration is planned twice by `usaf.planner.ledger` (the ledger `usaf plan` prints): once without
recomputation (every layer's saved tensors) and, for the message, once with it. Recomputation goes on when the peak
without it exceeds the memory budget: `train.memory_limit` when given, else the GPU's memory, or on the CPU the
machine's RAM. The choice is for the whole model (every decoder layer or none); recomputing only as many layers as
the budget needs is not done.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from usaf import planner
from usaf.errors import UsafError, first_line
from usaf.model.hf import load_config
from usaf.planner.shape import load_model_config
from usaf.planner.sizes import format_size
from usaf.train import distributed

_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclasses.dataclass(frozen=True)
class RecomputeChoice:
    recompute: bool
    line: str  # one line for the run's log: what was chosen and why


def choose_recompute(config, device: torch.device, dtype: torch.dtype) -> RecomputeChoice:
    """Resolve `config.train.recompute` (a RunConfig's): true and false as given, auto from the planner."""
    setting = config.train.recompute
    if setting is True or setting is False:
        return RecomputeChoice(
            setting, f"recompute: {'on' if setting else 'off'} (train.recompute={str(setting).lower()})"
        )

    try:
        budget, where, planned_device = _budget(config, device, planner)
    except UsafError as err:
        return RecomputeChoice(True, f"recompute: on (train.recompute=auto: {err})")
    try:
        shape = planner.model_shape(_model_config(config.model.path), Path(config.model.path).name)
        # under torchrun each rank also holds the gradient buckets it sums with the others
        settings = planner.settings_for_run(config, _DTYPES.get(dtype, "fp32")).replace(
            gpus=distributed.world_size()
        )
    except Exception as err:
        return RecomputeChoice(
            True,
            f"recompute: on (train.recompute=auto: the planner cannot read this model: {first_line(err)})",
        )
    vram, ram = (budget, None) if planned_device.is_gpu else (None, budget)
    without = planner.plan(shape, settings.replace(recompute=False), planned_device, vram=vram, ram=ram)
    return decide(without.device_peak, _activations(without), budget, where)


def decide(peak_without: float, activations: float, budget: int, where: str) -> RecomputeChoice:
    """The rule: recompute when the planned peak without recomputation exceeds the budget."""

    planned = f"the planned peak without recomputation, {format_size(peak_without)} "
    planned += f"({format_size(activations)} of it activations),"
    if peak_without <= budget:
        return RecomputeChoice(False, f"recompute: off (train.recompute=auto: {planned} fits {where})")
    return RecomputeChoice(
        True, f"recompute: on, every layer (train.recompute=auto: {planned} exceeds {where})"
    )


def _budget(config, device: torch.device, planner) -> tuple[int, str, object]:
    """(bytes, how the budget reads, the planner's Device) for the run's device."""
    limit = planner.parse_size(config.train.memory_limit) if config.train.memory_limit else None
    if device.type == "cpu":
        ram = limit if limit is not None else planner.machine_ram()
        where = "train.memory_limit" if limit is not None else "the machine's RAM"
        return ram, f"{planner.format_size(ram)} ({where})", planner.DEVICES["cpu"]
    if limit is None:
        if device.type != "cuda":  # torch.cuda also drives ROCm (HIP) devices
            raise UsafError(f"the memory of {device} is not known; give train.memory_limit")
        limit = torch.cuda.get_device_properties(device).total_memory
        where = f"{planner.format_size(limit)} of {torch.cuda.get_device_name(device)}"
    else:
        where = f"{planner.format_size(limit)} (train.memory_limit)"
    # throughput figures do not enter the memory ledger: any positive ones
    return limit, where, planner.Device(str(device), limit, 1.0, 1.0, 1.0, is_gpu=True)


def _model_config(path: str) -> dict:
    """config.json of a local model folder or prepared store, else the hub id's cached config."""
    folder = Path(path).expanduser()
    if (folder / "config.json").is_file():
        return load_model_config(str(folder))[1]
    # the cache only: a hub id that is not there is the session's to report, at once, not after the hub's retries
    return load_config(path, local_files_only=True).to_dict()


def _activations(p) -> float:
    return sum(line.device for line in p.lines if line.name.startswith("activations"))
