"""The memory planner: a run's ledger, verdict and step-time estimate from a model's config alone.

sizes -> settings (devices, formats, PlanSettings) -> shape (a model's parameters by role) -> ledger (`plan`: where
every byte goes, in which phase) -> storage (the experts' format and residency autos) -> search (the verdict, and
settings that fit) -> format (the text)."""

from usaf.config import RESIDENCIES
from usaf.planner.format import command_line, effective_settings, format_plan, format_verdict
from usaf.planner.ledger import (
    LedgerLine,
    Plan,
    StepTime,
    machine_ram,
    plan,
    trained_entries,
    trained_router_params,
)
from usaf.planner.search import Verdict, auto_density, auto_workspace, decide, published_line
from usaf.planner.settings import (
    DEVICES,
    DTYPE_BYTES,
    OPTIMIZERS,
    Device,
    PlannedRun,
    PlanSettings,
    default_dtype,
    quant_formats,
    run_optimizer,
    settings_for_run,
)
from usaf.planner.shape import ModelShape, list_presets, load_model_config, model_shape
from usaf.planner.sizes import GiB, MiB, format_count, format_size, parse_size
from usaf.planner.storage import auto_cache, auto_storage, smallest_machine

__all__ = [
    "DEVICES",
    "DTYPE_BYTES",
    "OPTIMIZERS",
    "RESIDENCIES",
    "Device",
    "GiB",
    "LedgerLine",
    "MiB",
    "ModelShape",
    "Plan",
    "PlanSettings",
    "PlannedRun",
    "StepTime",
    "Verdict",
    "auto_cache",
    "auto_density",
    "auto_storage",
    "auto_workspace",
    "command_line",
    "decide",
    "default_dtype",
    "effective_settings",
    "format_count",
    "format_plan",
    "format_size",
    "format_verdict",
    "list_presets",
    "load_model_config",
    "machine_ram",
    "model_shape",
    "parse_size",
    "plan",
    "published_line",
    "quant_formats",
    "run_optimizer",
    "settings_for_run",
    "smallest_machine",
    "trained_entries",
    "trained_router_params",
]
