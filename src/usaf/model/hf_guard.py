"""The private names of transformers (and one of torch) that usaf relies on, in one table, each checked once when
usaf is imported against the installed version: a release that drops one is named in one line with the versions
that work, instead of an AttributeError deep in a training step.

A missing name warns at import and raises ModelError where it is used (`require`, called by `usaf.model.hf`):
importing usaf must not fail for what never touches these names (`usaf --help`, `plan`, `report`, `export --delta`,
reading a delta from Python), and an exception at import would reach a user as a traceback rather than the
command's one line. The supported ranges are pyproject.toml's, read from the installed package's metadata.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from transformers import PretrainedConfig, PreTrainedModel
from transformers import initialization as hf_init
from transformers.integrations.moe import ExpertsInterface, use_experts_implementation
from transformers.utils import chat_template_utils

from usaf.errors import ModelError
from usaf.version import __version__


@dataclass(frozen=True)
class Internal:
    package: str  # the distribution that owns it
    name: str  # as the one line names it
    attr: str  # the private attribute usaf reads or writes (tests/package/test_layers.py matches src's uses to it)
    present: Callable[[], bool]  # a cheap probe: lookups on classes and modules, no model built


def _callable(owner, attr: str) -> Callable[[], bool]:
    return lambda: callable(getattr(owner, attr, None))


def _gate_of_decorated_experts() -> bool:
    """transformers' experts decorator gives every fused experts class an `_apply_gate` (usaf's forward calls it)."""

    @use_experts_implementation
    class Probe(nn.Module):
        def forward(self, hidden):
            return hidden

    return callable(getattr(Probe, "_apply_gate", None))


def _marked_tensor_left_alone() -> bool:
    """transformers' initialisation skips a tensor flagged `_is_hf_initialized` (what `mark_loaded` sets)."""
    tensor = torch.ones(1)
    tensor._is_hf_initialized = True
    hf_init.zeros_(tensor)
    return bool(tensor.item() == 1)


def _ddp_reads_ignore_list() -> bool:
    """DDP reads the module's `_ddp_params_and_buffers_to_ignore` when it wraps it (usaf.prepare sets it)."""
    return (
        "_ddp_params_and_buffers_to_ignore"
        in inspect.unwrap(DistributedDataParallel.__init__).__code__.co_names
    )


INTERNALS = (
    Internal(
        "transformers",
        "ExpertsInterface._global_mapping",
        "_global_mapping",
        # its own (GeneralInterface, its base, has an empty one)
        lambda: isinstance(vars(ExpertsInterface).get("_global_mapping"), dict),
    ),
    Internal(
        "transformers",
        "PretrainedConfig._experts_implementation",
        "_experts_implementation",
        lambda: isinstance(getattr(PretrainedConfig, "_experts_implementation", None), property),
    ),
    Internal(
        "transformers",
        "PretrainedConfig()._experts_implementation_internal",
        "_experts_implementation_internal",
        lambda: hasattr(PretrainedConfig(), "_experts_implementation_internal"),
    ),
    Internal("transformers", "the experts classes' _apply_gate", "_apply_gate", _gate_of_decorated_experts),
    Internal(
        "transformers",
        "PreTrainedModel._init_weights",
        "_init_weights",
        _callable(PreTrainedModel, "_init_weights"),
    ),
    Internal(
        "transformers", "the tensor flag _is_hf_initialized", "_is_hf_initialized", _marked_tensor_left_alone
    ),
    Internal(
        "transformers",
        "chat_template_utils._compile_jinja_template",
        "_compile_jinja_template",
        _callable(chat_template_utils, "_compile_jinja_template"),
    ),
    Internal(
        "transformers",
        "chat_template_utils._cached_compile_jinja_template",
        "_cached_compile_jinja_template",
        _callable(chat_template_utils, "_cached_compile_jinja_template"),
    ),
    Internal(
        "torch",
        "DistributedDataParallel's _ddp_params_and_buffers_to_ignore",
        "_ddp_params_and_buffers_to_ignore",
        _ddp_reads_ignore_list,
    ),
)
VERSIONS = {"transformers": transformers.__version__, "torch": torch.__version__}


def supported(package: str) -> str:
    """`package` with the version range usaf declares for it (pyproject.toml's dependencies, as installed), e.g.
    'transformers>=5.24,<6'; the bare name where usaf runs from a source tree it was not installed from."""
    try:
        requirements = importlib.metadata.requires("usaf") or []
    except importlib.metadata.PackageNotFoundError:
        requirements = []
    for line in requirements:
        requirement = Requirement(line)
        if requirement.name == package and requirement.marker is None:
            # lower bounds first, as pyproject.toml writes them (the metadata sorts them the other way)
            specs = sorted(map(str, requirement.specifier), key=lambda spec: not spec.startswith(">"))
            return package + ",".join(specs)
    return package


def in_range(package: str, version: str) -> bool:
    """Whether `version` of `package` lies in usaf's declared range (a local or development build counts)."""
    return SpecifierSet(supported(package)[len(package) :]).contains(version, prereleases=True)


def missing_line(internal: Internal) -> str:
    """The one line that says `internal` is missing: the version found, the name, the versions that work."""
    wanted = supported(internal.package)
    return (
        f"usaf {__version__} supports {wanted}; found {internal.package} {VERSIONS[internal.package]} "
        f"which lacks {internal.name}: pip install '{wanted}'"
    )


def outside_range_line(package: str, version: str) -> str:
    wanted = supported(package)
    return (
        f"usaf {__version__} supports {wanted}; found {package} {version}, outside that range (untested; if it "
        f"fails: pip install '{wanted}')"
    )


def _probe(internal: Internal) -> bool:
    try:
        return internal.present()
    except Exception:  # a probe that cannot run (its own helper moved) finds the name as good as missing
        return False


def check() -> dict[str, str]:
    """{private attribute: its one line} for every internal the installed versions lack."""
    return {internal.attr: missing_line(internal) for internal in INTERNALS if not _probe(internal)}


def warn_at_import() -> None:
    for package, version in VERSIONS.items():
        if not in_range(package, version):
            warnings.warn(outside_range_line(package, version), stacklevel=2)
    for line in MISSING.values():
        warnings.warn(line, stacklevel=2)


def require(*attrs: str) -> None:
    """Raise the one line (ModelError) of the first of `attrs` the installed version lacks."""
    for attr in attrs:
        if attr in MISSING:
            raise ModelError(MISSING[attr])


MISSING = check()  # once, at import
warn_at_import()
