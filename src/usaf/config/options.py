"""What an option is: `option()` declares a config field (its documentation, choices, range, ceiling); the
numbers and choice lists the options share; `AUTO`, the value of a number option that a memory plan resolves."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import field

from usaf.errors import ConfigError
from usaf.registry import SCORERS, TARGET_KINDS
from usaf.registry import STRATEGIES as STRATEGY_REGISTRY

RESIDENCIES = ("device", "host", "mmap")  # where a quantized base's experts live (see usaf.store.offload)
GUARD_ACTIONS = (
    "warn",
    "raise_balance",
    "freeze_router",
    "stop",
)  # see usaf.train.router_health.CollapseGuard

GRANULARITIES = ("element", "neuron")
# the plug-ins' registries (usaf.selection.strategies and .scorers register the built-ins; users may add theirs)
SELECTIONS = SCORERS.choices("auto")
STRATEGIES = STRATEGY_REGISTRY.choices()
# usaf's own cosine (its warm-up never starts at a rate of 0), then transformers' get_scheduler names
SCHEDULES = ("cosine", "linear", "constant_with_warmup", "cosine_with_min_lr", "warmup_stable_decay")
# which native weights may hold trained entries: the experts, the routers (trained whole), and the roles of
# weights beyond them that usaf.model.targets registers (attention, dense_mlp, norms, embeddings, lm_head)
TARGETS = TARGET_KINDS.choices("experts", "routers")
# chosen on bench/quality.py (README, "Fine-tunes against LoRA"): routers add forgetting, not adaptation
DEFAULT_TARGETS = ("experts", "attention", "embeddings", "lm_head")
RATIO_TARGETS = TARGET_KINDS.choices("experts")  # routers train whole: no density to weigh
# The defaults (select.density=auto, reselection every 10 steps, optim.lr 1e-2, optim.decay_to_base 8, 64 k
# calibration tokens: README, "The defaults on both shifts") are the best
# practical point of bench/quality.py (README, "Fine-tunes against LoRA"): at 2 % they lie ahead of full
# fine-tuning's frontier on the shift task; at 16 bytes an entry 1 % fits Qwen3-30B-A3B on a 12 GB card
# (`usaf plan --model qwen3-30b-a3b --vram 12GB --ram 32GB`), 2 % does not: auto takes what the card fits.
DEFAULT_DENSITY = 0.01  # what select.density=auto reads as where no memory plan resolves it (prepare_model)
# select.density=auto: usaf train takes the largest of these that its memory plan fits (quality rose with density
# up to here on bench/quality.py; each step down halves the trained entries' memory)
AUTO_DENSITIES = (0.02, 0.01, 0.005, 0.0025, 0.001)
DEFAULT_RESELECT_EVERY = 10
# 512 tokens x a 151 k vocabulary is 0.9 GB of logits (fp32 with their gradient): what keeps Qwen3-30B-A3B at 1 % with
# reselection's probe windows within 12 GB; the loss is the same for any chunk, and 512 rows still fill a GPU's matmul
DEFAULT_LOGITS_CHUNK = 512
# values the optimizer updates as one flat vector (at least two of the largest parameters): bounds the step's fp32
# temporaries, 16 B a value, while many parameters share a fixed number of ops (usaf.train.optim, the planner)
OPTIMIZER_BUCKET_ENTRIES = 1 << 24
DEFAULT_WORKSPACE_MB = 256  # select.workspace_mb: one projection's dequantized routed-expert workspace
# the options whose auto a new run resolves before its config.yaml records it (the memory plan's, the objective's
# rate): a resume takes what they resolved to, never resolves them again
RESOLVED_AT_START = (
    "model.quant",
    "model.residency",
    "model.cache_mb",
    "select.density",
    "select.workspace_mb",
    "optim.lr",
)


# the largest integer any option takes (torch, numpy and the files' int64 fields hold no more); options whose size
# is memory or time declare a smaller `most`
INT_MOST = (1 << 63) - 1
# a sequence, a batch or a chunk of tokens this long is a typo, not a request: 1 Mi tokens (the longest contexts)
TOKENS_MOST = 1 << 20


NON_NEGATIVE = "[0, inf)"


def option(
    default,
    doc: str,
    choices: Collection | None = None,
    bounds: str | None = None,
    most: int | None = None,
    path: bool = False,
    parse=None,
):
    """A documented config field. `choices`: a tuple, or a registry's live `keys()`. `bounds`: an interval such as
    "(0, inf)" or "[0, 1)" (a square bracket includes the end; inf is never allowed); a number without bounds is
    NON_NEGATIVE. `most`: the largest integer allowed (INT_MOST for every integer option). All are enforced on load
    and shown by `--list-options`. `path`: a file or folder, whose `~` and `$VAR` are expanded as a shell would;
    `parse`: a function that reads the value (raising ConfigError)."""
    factory = (lambda d=default: type(d)(d)) if isinstance(default, (list, dict)) else None
    if bounds is None and isinstance(default, (int, float)) and not isinstance(default, bool):
        bounds = NON_NEGATIVE
    if bounds is not None:
        _parse_bounds(bounds)  # a malformed spec fails at import, not when a user's value is checked
    meta = {"doc": doc, "choices": choices, "bounds": bounds, "most": most, "path": path, "parse": parse}
    return field(default_factory=factory, metadata=meta) if factory else field(default=default, metadata=meta)


def _parse_bounds(spec: str) -> tuple[float, float, bool, bool]:
    """Parse "[0, inf)" into (low, high, low included, high included)."""
    low, high = (float(part) for part in spec[1:-1].split(","))
    if spec[0] not in "[(" or spec[-1] not in "])":
        raise ValueError(f"bad bounds {spec!r}")
    return low, high, spec[0] == "[", spec[-1] == "]"


def bounds_text(spec: str) -> str:
    """How a range reads in messages: "> 0", ">= 1", "in [0, 1)"."""
    low, high, low_in, _ = _parse_bounds(spec)
    if high == float("inf"):
        shown = int(low) if low.is_integer() else low
        return f"{'>=' if low_in else '>'} {shown}"
    return f"in {spec}"


def check_bounds(value, spec: str | None, where: str) -> None:
    """Raise a ConfigError naming `where` when a number lies outside `spec` (NaN and infinities never pass)."""
    if spec is None or value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    low, high, low_in, high_in = _parse_bounds(spec)
    above = low <= value if low_in else low < value
    below = value <= high if high_in else value < high
    if not (above and below and math.isfinite(value)):
        raise ConfigError(f"{where} must be {bounds_text(spec)}, got {value!r}.")


class Auto:
    """The value of a number option that usaf train's memory plan resolves (select.density, select.workspace_mb):
    one object, `AUTO`, checked with `is AUTO`; files and --set write it as the word auto, and it equals "auto" so
    that code comparing with the word keeps working."""

    _one = None

    def __new__(cls):
        if cls._one is None:
            cls._one = super().__new__(cls)
        return cls._one

    def __repr__(self) -> str:
        return "auto"

    __str__ = __repr__

    def __eq__(self, other) -> bool:
        return other is self or (isinstance(other, str) and other == "auto")

    def __hash__(self) -> int:
        return hash("auto")

    def __reduce__(self) -> str:
        return "AUTO"  # copies and pickles are the one object


AUTO = Auto()


def plain(value):
    """A value as a file writes it: AUTO as the word auto, lists and dicts walked."""
    if value is AUTO:
        return "auto"
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain(item) for item in value]
    return value
