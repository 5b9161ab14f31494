"""The run's memory plan, which `train.recompute=auto`, `select.density=auto` and `select.workspace_mb=auto` read.

The budget is `train.memory_limit` when given, else the GPU's memory, or on the CPU the machine's RAM. The run is
what `usaf plan --config` plans: the same model shape, settings and ledger (`usaf.planner`).
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import torch

from usaf import planner
from usaf.config import AUTO, DEFAULT_DENSITY, DEFAULT_WORKSPACE_MB, RunConfig
from usaf.errors import ConfigError, ModelError, UsafError, first_line
from usaf.model.hf import load_config
from usaf.planner.shape import load_model_config
from usaf.train import distributed

_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclasses.dataclass(frozen=True)
class RunPlan:
    shape: planner.ModelShape
    settings: planner.PlanSettings
    device: planner.Device
    budget: int  # bytes
    where: str  # how the budget reads in messages

    @property
    def memory(self) -> tuple[int | None, int | None]:
        """(vram, ram) as the planner takes them: the budget is the GPU's, or on the CPU the host's."""
        return (self.budget, None) if self.device.is_gpu else (None, self.budget)

    def plan(self, settings: planner.PlanSettings) -> planner.Plan:
        return planner.plan(self.shape, settings, self.device, *self.memory)


def run_plan(config: RunConfig, device: torch.device, dtype: torch.dtype) -> RunPlan:
    """The planner's view of the run on `device`, or a UsafError saying why there is none."""
    budget, where, planned_device = _budget(config, device)
    try:
        with (
            warnings.catch_warnings()
        ):  # "planning from formulas": the model's own loading says what is wrong
            warnings.simplefilter("ignore")
            shape = planner.model_shape(_model_config(config.model.path), Path(config.model.path).name)
        # under torchrun each rank also holds the gradient buckets it sums with the others
        settings = planner.settings_for_run(
            planner.PlannedRun.of(config), _DTYPES.get(dtype, "fp32")
        ).replace(gpus=distributed.world_size())
    except Exception as err:
        raise ModelError(f"the planner cannot read this model: {first_line(err)}") from None
    return RunPlan(shape, settings, planned_device, budget, where)


def choose_density(
    config: RunConfig, device: torch.device, dtype: torch.dtype
) -> tuple[RunConfig, str | None]:
    """`config` with select.density=auto resolved (the largest of AUTO_DENSITIES the plan fits, recomputing
    where train.recompute allows it), and the line that says what was chosen and why; as given otherwise."""
    if config.select.num_entries is not None:  # a number of entries: no density
        return config, None
    return _resolved(
        config, device, dtype, "density", planner.auto_density, DEFAULT_DENSITY, lambda d: f"{d:.2%}"
    )


def choose_workspace(
    config: RunConfig, device: torch.device, dtype: torch.dtype
) -> tuple[RunConfig, str | None]:
    """`config` with select.workspace_mb=auto resolved (`planner.auto_workspace`, at the run's density: resolve
    that first), and the line that says what was chosen and why; as given otherwise."""
    return _resolved(
        config,
        device,
        dtype,
        "workspace_mb",
        planner.auto_workspace,
        DEFAULT_WORKSPACE_MB,
        lambda mb: f"{mb} MB",
    )


def _resolved(
    config: RunConfig, device, dtype, key: str, choose, fallback, shown
) -> tuple[RunConfig, str | None]:
    """`config` with select.<key>=auto resolved by the planner's `choose` (else `fallback`, with the reason the
    plan failed), and the line that says so; as given where it is not auto."""
    if getattr(config.select, key) is not AUTO:
        return config, None
    try:
        run = run_plan(config, device, dtype)
        chosen, why = choose(
            run.shape, run.settings, run.device, *run.memory, residency=config.model.residency
        )
        value, why = getattr(chosen, key), why and f"{why}; budget: {run.where}"
    except UsafError as err:
        value, why = fallback, str(err)
    line = why and f"select.{key}=auto: {shown(value)}, {why}"  # None: nothing worth a line (unused)
    return config.replace({f"select.{key}": value}), line


def resolve_auto(config: RunConfig, device: torch.device, dtype: torch.dtype) -> tuple[RunConfig, list[str]]:
    """`config` with the memory plan's autos resolved (the density, then the workspace at it), and their lines."""
    config, density = choose_density(config, device, dtype)
    config, workspace = choose_workspace(config, device, dtype)
    return config, [line for line in (density, workspace) if line]


def _budget(config: RunConfig, device: torch.device) -> tuple[int, str, planner.Device]:
    """(bytes, how the budget reads, the planner's Device) for the run's device."""
    limit = planner.parse_size(config.train.memory_limit) if config.train.memory_limit else None
    if device.type == "cpu":
        ram = limit if limit is not None else planner.machine_ram()
        where = "train.memory_limit" if limit is not None else "the machine's RAM"
        return ram, f"{planner.format_size(ram)} ({where})", planner.DEVICES["cpu"]
    if limit is None:
        if device.type != "cuda":  # torch.cuda also drives ROCm (HIP) devices
            raise ConfigError(f"the memory of {device} is not known; give train.memory_limit")
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
