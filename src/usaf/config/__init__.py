"""The engine's and the run's configuration, by job: what an option is and the shared constants (`options`), a
value read and checked as declared (`values`), the sections (`section`, `select`, `sections`), the whole run
(`run`), config files read safely (`yaml`), `--set` (`overrides`) and the option listing (`listing`). Every name
other modules use is here, so they import `usaf.config`."""

from usaf.config.listing import describe
from usaf.config.options import (
    AUTO,
    AUTO_DENSITIES,
    DEFAULT_DENSITY,
    DEFAULT_LOGITS_CHUNK,
    DEFAULT_RESELECT_EVERY,
    DEFAULT_TARGETS,
    DEFAULT_WORKSPACE_MB,
    GRANULARITIES,
    GUARD_ACTIONS,
    INT_MOST,
    NON_NEGATIVE,
    OPTIMIZER_BUCKET_ENTRIES,
    RATIO_TARGETS,
    RESIDENCIES,
    RESOLVED_AT_START,
    SCHEDULES,
    SELECTIONS,
    STRATEGIES,
    TARGETS,
    TOKENS_MOST,
    Auto,
    bounds_text,
    check_bounds,
    option,
    plain,
)
from usaf.config.overrides import apply_override
from usaf.config.run import EARLIER_DEFAULTS, SECTIONS, RunConfig
from usaf.config.section import Section
from usaf.config.sections import (
    CheckpointSection,
    DataSection,
    LogSection,
    ModelSection,
    OptimSection,
    RouterSection,
    ScheduleSection,
    TrainSection,
)
from usaf.config.select import UsafConfig
from usaf.config.values import check_option, expand_path, parse_size, split_paths
from usaf.config.yaml import YAML_MAX_NODES, YamlRefusedError, read_yaml

__all__ = [
    "AUTO",
    "AUTO_DENSITIES",
    "DEFAULT_DENSITY",
    "DEFAULT_LOGITS_CHUNK",
    "DEFAULT_RESELECT_EVERY",
    "DEFAULT_TARGETS",
    "DEFAULT_WORKSPACE_MB",
    "EARLIER_DEFAULTS",
    "GRANULARITIES",
    "GUARD_ACTIONS",
    "INT_MOST",
    "NON_NEGATIVE",
    "OPTIMIZER_BUCKET_ENTRIES",
    "RATIO_TARGETS",
    "RESIDENCIES",
    "RESOLVED_AT_START",
    "SCHEDULES",
    "SECTIONS",
    "SELECTIONS",
    "STRATEGIES",
    "TARGETS",
    "TOKENS_MOST",
    "YAML_MAX_NODES",
    "Auto",
    "CheckpointSection",
    "DataSection",
    "LogSection",
    "ModelSection",
    "OptimSection",
    "RouterSection",
    "RunConfig",
    "ScheduleSection",
    "Section",
    "TrainSection",
    "UsafConfig",
    "YamlRefusedError",
    "apply_override",
    "bounds_text",
    "check_bounds",
    "check_option",
    "describe",
    "expand_path",
    "option",
    "parse_size",
    "plain",
    "read_yaml",
    "split_paths",
]
