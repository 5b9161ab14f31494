"""A config section: a frozen dataclass of options, each read and checked as its `option()` declares."""

from __future__ import annotations

import copy
from dataclasses import fields
from typing import ClassVar

from usaf.config.values import check_option
from usaf.errors import ConfigError, unknown_names


class Section:
    """A config section: every option is read and checked as its `option()` declares (type, choices, range) when
    the section is made, from Python or a file. Sections are frozen: a changed one is a new one (`replaced`,
    `RunConfig.replace`), checked as a file's values are."""

    NAME: ClassVar[str]  # what messages call the section made in Python; a file's messages name its YAML key

    def __post_init__(self) -> None:
        self.validate(self.NAME)

    def validate(self, where: str) -> None:
        """Every option read and checked (the values kept as read: `~` expanded, "0.1" a float, ...); the section
        is frozen, so only its own checks set them, before anyone else holds it."""
        for spec in fields(self):
            object.__setattr__(
                self, spec.name, check_option(spec, getattr(self, spec.name), f"{where}.{spec.name}")
            )
        self.check_together(where)

    def check_together(self, where: str) -> None:
        """Rules between options, which no single declaration states (none by default)."""

    def replaced(self, values: dict, where: str):
        """A copy with `values` ({option: value}) in place of its own, checked together as a file's section is:
        messages name `where` and the option (`run.yaml: optim.lr`)."""
        if not isinstance(values, dict):
            raise ConfigError(f"{where} must be a mapping of keys to values.")
        known = {f.name for f in fields(self)}
        unknown = sorted(set(values) - known, key=str)
        if unknown:
            raise ConfigError(f"{where}: {unknown_names('key', unknown, known)}")
        changed = copy.copy(self)
        for name, value in values.items():
            object.__setattr__(changed, name, value)
        changed.validate(where)
        return changed
