"""The run's memory plan, which the autos read: `train.recompute`, `model.quant`, `model.residency`, `model.cache_mb`,
`select.density` and `select.workspace_mb`.

The budget is `train.memory_limit` when given, else the GPU's memory, or on the CPU the machine's RAM. The run is
what `usaf plan --config` plans: the same model shape, settings and ledger (`usaf.planner`).
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from pathlib import Path

import torch

from usaf import planner
from usaf.config import AUTO, DEFAULT_DENSITY, DEFAULT_WORKSPACE_MB, RunConfig
from usaf.errors import ConfigError, ModelError, UsafError, first_line
from usaf.model.hf import load_config
from usaf.planner.shape import load_model_config
from usaf.train import distributed, runtime

_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
TORCH_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}

# how the autos' chosen values read in their lines
SHOW_DENSITY, SHOW_WORKSPACE = (lambda d: f"{d:.2%}"), (lambda mb: f"{mb} MB")


@dataclasses.dataclass(frozen=True)
class Card:
    """What a run is planned against: the planner's device (its memory and, where known, its speed figures), the
    memory budget in bytes, how the budget reads in messages, and a GPU's host RAM (None: this machine's)."""

    device: planner.Device
    budget: int
    where: str
    ram: int | None = None

    @property
    def memory(self) -> tuple[int | None, int | None]:
        """(vram, ram) as the planner takes them: the budget is the GPU's, or on the CPU the host's."""
        return (self.budget, self.ram) if self.device.is_gpu else (None, self.budget)

    @property
    def line(self) -> str:
        """The card as the effective settings name it."""
        figures = "" if self.device.has_figures else "; no speed figures (name one: train.card)"
        return f"{self.device.name}, budget {self.where}{figures}"


@dataclasses.dataclass(frozen=True)
class RunPlan:
    shape: planner.ModelShape
    settings: planner.PlanSettings
    card: Card

    @property
    def device(self) -> planner.Device:
        return self.card.device

    @property
    def budget(self) -> int:
        return self.card.budget

    @property
    def where(self) -> str:
        return self.card.where

    @property
    def memory(self) -> tuple[int | None, int | None]:
        return self.card.memory

    def plan(self, settings: planner.PlanSettings) -> planner.Plan:
        return planner.plan(self.shape, settings, self.device, *self.memory)


def run_plan(config: RunConfig, device: torch.device, dtype: torch.dtype) -> RunPlan:
    """The planner's view of the run on `device`, or a UsafError saying why there is none."""
    card = run_card(config, device)
    try:
        with (
            warnings.catch_warnings()
        ):  # "planning from formulas": the model's own loading says what is wrong
            warnings.simplefilter("ignore")
            shape = planner.model_shape(_model_config(config.model.path), Path(config.model.path).name)
        # under torchrun each rank also holds the gradient buckets it sums with the others
        settings = planner.settings_for_run(planner.PlannedRun.of(config), planner_dtype(dtype)).replace(
            gpus=distributed.world_size()
        )
    except Exception as err:
        raise ModelError(f"the planner cannot read this model: {first_line(err)}") from None
    return RunPlan(shape, settings, card)


def effective_settings(config: RunConfig, device: torch.device, dtype: torch.dtype, recompute: bool) -> str:
    """The run's effective settings as `usaf train` prints them at its start: `planner.effective_settings`, the
    block `usaf plan` prints for the same configuration."""
    settings = planner.settings_for_run(planner.PlannedRun.of(config), planner_dtype(dtype))
    try:
        card = run_card(config, device).line
    except UsafError as err:
        card = f"none ({err})"
    return planner.effective_settings(
        settings.replace(recompute=recompute), precision_name(config.train.precision, dtype), card
    )


def precision_name(precision: str, dtype: torch.dtype) -> str:
    """train.precision as the run computes it (`runtime.autocast_dtype`): the forward's autocast dtype, or none."""
    autocast = runtime.autocast_dtype(precision, dtype)
    return "none" if autocast is None else planner_dtype(autocast)


def planner_dtype(dtype: torch.dtype) -> str:
    """The planner's name of a compute dtype."""
    return _DTYPES.get(dtype, "fp32")


# each auto the plan resolves: (section.key, how its value reads, what it reads as where no plan resolves it)
AUTOS = (
    ("model.quant", str, "none"),
    ("model.residency", str, "device"),
    ("select.density", SHOW_DENSITY, DEFAULT_DENSITY),
    ("select.workspace_mb", SHOW_WORKSPACE, DEFAULT_WORKSPACE_MB),
    ("model.cache_mb", SHOW_WORKSPACE, 0),
)


def _value(config, key: str):
    section, name = key.split(".")
    return getattr(getattr(config, section), name)


def _is_auto(config, key: str) -> bool:
    if key == "select.density" and config.select.num_entries is not None:  # a number of entries: no density
        return False
    return _value(config, key) == "auto"


def auto_choice(
    run: RunPlan, key: str, choose, shown, residency: str
) -> tuple[planner.PlanSettings, str | None]:
    """The run's settings with select.<key>=auto chosen by the planner's `choose` against the run's card, and the
    line that says what and why (None: nothing worth a line)."""
    chosen, why = choose(run.shape, run.settings, run.device, *run.memory, residency=residency)
    line = why and f"select.{key}=auto: {shown(getattr(chosen, key))}, {why}; budget: {run.where}"
    return chosen, line


def auto_settings(run: RunPlan) -> tuple[RunPlan, list[str]]:
    """`run` with its settings' autos resolved in their order, and their lines: the experts' storage and
    residency (`planner.auto_storage`), the density unless a number of entries is given, the workspace at it, then
    the expert cache (`planner.auto_cache`). What `usaf plan` plans and `resolve_auto` gives `usaf train`."""
    model, select = run.settings.run.model, run.settings.run.select
    settings, lines = planner.auto_storage(
        run.shape,
        run.settings,
        run.device,
        *run.memory,
        quant=model.quant == "auto",
        residency=model.residency == "auto",
    )
    lines = [f"{line}; budget: {run.where}" for line in lines]
    run = dataclasses.replace(run, settings=settings)
    for key, choose, shown, wanted in (
        ("density", planner.auto_density, SHOW_DENSITY, select.num_entries is None),
        ("workspace_mb", planner.auto_workspace, SHOW_WORKSPACE, True),
    ):
        if wanted and getattr(select, key) is AUTO:
            settings, line = auto_choice(run, key, choose, shown, run.settings.residency)
            run = dataclasses.replace(run, settings=settings)
            lines += [line] if line else []
    if model.cache_mb is AUTO:
        settings, line = planner.auto_cache(run.shape, run.settings, run.device, *run.memory)
        run = dataclasses.replace(run, settings=settings)
        lines += [f"{line}; budget: {run.where}"] if line else []
    return run, lines


def resolve_auto(config: RunConfig, device: torch.device, dtype: torch.dtype) -> tuple[RunConfig, list[str]]:
    """`config` with the memory plan's autos resolved (`auto_settings`: the storage and residency, the density,
    the workspace at it, the expert cache) and their lines; where the planner cannot read the model, each auto
    takes what it reads as unplanned, and its line says why."""
    autos = [(key, shown, fallback) for key, shown, fallback in AUTOS if _is_auto(config, key)]
    if not autos:
        return config, []
    try:
        run, lines = auto_settings(run_plan(config, device, dtype))
    except UsafError as err:
        changes = {key: fallback for key, _, fallback in autos}
        return config.replace(changes), [f"{key}=auto: {shown(value)}, {err}" for key, shown, value in autos]
    s = run.settings
    chosen = {
        "model.quant": "none" if s.published else s.quant,  # "none": a published format asks for nothing
        "model.residency": s.residency,
        "select.density": s.density,
        "select.workspace_mb": s.workspace_mb,
        "model.cache_mb": s.cache_mb,
    }
    return config.replace({key: chosen[key] for key, _, _ in autos}), lines


def resolve_storage(config: RunConfig, device: torch.device, dtype: torch.dtype) -> RunConfig:
    """`config` with the experts' storage autos resolved for a command that runs the model outside a run (eval,
    generate, chat), by the training plan (which needs more than inference: what it fits, inference fits); a
    choice other than the model as transformers loads it is said on stderr."""
    if not config.model.storage_is_auto:
        return config
    resolved, lines = resolve_auto(config, device, dtype)
    model = resolved.model
    keep = {"select.density": config.select.density, "select.workspace_mb": config.select.workspace_mb}
    if (model.quant, model.residency) != ("none", "device"):
        print("\n".join(line for line in lines if line.startswith("model.")), file=sys.stderr)
    return resolved.replace(keep)


def run_card(config: RunConfig, device: torch.device) -> Card:
    """What the run on `device` is planned against: train.card where the config names one, else the device itself
    (a GPU's memory, or on the CPU the machine's RAM); train.memory_limit, when given, is the budget either way."""
    limit = planner.parse_size(config.train.memory_limit) if config.train.memory_limit else None
    if config.train.card:
        card = planner.DEVICES[config.train.card]
        memory = card.memory if card.is_gpu else planner.machine_ram()
        source = f"train.card={card.name}" if card.is_gpu else "the machine's RAM"
    elif device.type == "cpu":
        card, memory, source = planner.DEVICES["cpu"], planner.machine_ram(), "the machine's RAM"
    elif device.type == "cuda":  # torch.cuda also drives ROCm (HIP) devices
        memory = torch.cuda.get_device_properties(device).total_memory
        card, source = unnamed_gpu(torch.cuda.get_device_name(device), memory), None
    elif limit is None:
        raise ConfigError(f"the memory of {device} is not known; give train.memory_limit or train.card")
    else:
        card, memory, source = unnamed_gpu(str(device), limit), limit, None
    if limit is not None:
        memory, source = limit, "train.memory_limit"
    where = (
        f"{planner.format_size(memory)} ({source})"
        if source
        else f"{planner.format_size(memory)} of {card.name}"
    )
    return Card(dataclasses.replace(card, memory=memory) if card.is_gpu else card, memory, where)


def unnamed_gpu(name: str, memory: int) -> planner.Device:
    """A GPU known by its memory alone: no speed figures (the step-time estimate says it has none)."""
    return planner.Device(name, memory, 0.0, 0.0, 0.0)


def _model_config(path: str) -> dict:
    """config.json of a local model folder or prepared store, else the hub id's cached config."""
    folder = Path(path).expanduser()
    if (folder / "config.json").is_file():
        return load_model_config(str(folder))[1]
    # the cache only: a hub id that is not there is the session's to report, at once, not after the hub's retries
    return load_config(path, local_files_only=True).to_dict()
