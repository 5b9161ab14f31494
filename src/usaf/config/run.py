"""The whole job's configuration: one typed tree of sections (`RunConfig`), from a YAML file plus `--set
section.key=value` overrides."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field

from usaf.config import sections
from usaf.config.options import plain
from usaf.config.overrides import apply_override
from usaf.config.select import UsafConfig
from usaf.config.yaml import read_yaml
from usaf.errors import ConfigError, unknown_names

SECTIONS = {
    "model": sections.ModelSection,
    "select": UsafConfig,
    "router": sections.RouterSection,
    "optim": sections.OptimSection,
    "schedule": sections.ScheduleSection,
    "data": sections.DataSection,
    "checkpoint": sections.CheckpointSection,
    "log": sections.LogSection,
    "train": sections.TrainSection,
    "distributed": sections.DistributedSection,
}


@dataclass(frozen=True)
class RunConfig:
    """Every option of a `usaf train` run, by section (see `usaf train --print-config`). Frozen, as its sections
    are: a changed run is a new one (`replace`). Each stage below `usaf.train` is handed only the sections it
    reads."""

    model: sections.ModelSection = field(default_factory=sections.ModelSection)
    select: UsafConfig = field(default_factory=UsafConfig)
    router: sections.RouterSection = field(default_factory=sections.RouterSection)
    optim: sections.OptimSection = field(default_factory=sections.OptimSection)
    schedule: sections.ScheduleSection = field(default_factory=sections.ScheduleSection)
    data: sections.DataSection = field(default_factory=sections.DataSection)
    checkpoint: sections.CheckpointSection = field(default_factory=sections.CheckpointSection)
    log: sections.LogSection = field(default_factory=sections.LogSection)
    train: sections.TrainSection = field(default_factory=sections.TrainSection)
    distributed: sections.DistributedSection = field(default_factory=sections.DistributedSection)

    def to_dict(self) -> dict:
        """The sections as plain values (AUTO as the word auto), as config.yaml holds them."""
        return plain(asdict(self))

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, data: dict | None, source: str = "config") -> RunConfig:
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: the top level must be a mapping of sections {sorted(SECTIONS)}.")
        unknown = sorted(set(data) - set(SECTIONS), key=str)  # YAML keys need not be strings
        if unknown:
            raise ConfigError(f"{source}: {unknown_names('section', unknown, SECTIONS)}")
        built = {}
        for name, section_cls in SECTIONS.items():
            values = data.get(name)
            # the defaults, then the file's values, checked together under the file's names
            built[name] = section_cls().replaced({} if values is None else values, f"{source}: {name}")
        return cls(**built)

    def replace(self, changes: dict, source: str = "config") -> RunConfig:
        """A copy with `changes` ({"section.key": value}) in place, each value read and checked as --set's is (a
        bad one is a ConfigError naming its key); the sections nothing changes are shared."""
        by_section: dict[str, dict] = {}
        for key, value in changes.items():
            section, _, name = str(key).partition(".")
            if section not in SECTIONS or not name:
                raise ConfigError(
                    f"{source}: {key!r} is not a section.key option; allowed sections: {sorted(SECTIONS)}."
                )
            by_section.setdefault(section, {})[name] = value
        built = {
            section: getattr(self, section).replaced(values, f"{source}: {section}")
            for section, values in by_section.items()
        }
        return dataclasses.replace(self, **built)

    def check(self, source: str = "config") -> None:
        """Every option's choices and range, and the rules between them, checked again (a config made in Python was
        checked when made, under its classes' names; this names its sections)."""
        for name in SECTIONS:
            getattr(self, name).validate(f"{source}: {name}")

    @classmethod
    def load(cls, path: str | None = None, overrides: list | None = None) -> RunConfig:
        """A YAML file (optional) with overrides applied on top: `section.key=value` text (the value read as
        YAML, as `--set` gives it) or ("section.key", value) pairs taken as typed (`apply_override`)."""
        data = _read_config_file(path) if path else {}
        for item in overrides or []:
            apply_override(data, item)
        return cls.from_dict(data, source=path or "config")

    @classmethod
    def load_saved(cls, path: str, overrides: list | None = None) -> RunConfig:
        """A run's own config.yaml (every option written out): an option it lacks did not exist when the run
        started, so it takes the value that run trained with (EARLIER_DEFAULTS), not today's default."""
        data = _read_config_file(path)
        for (section, key), value in EARLIER_DEFAULTS.items():
            if isinstance(data.get(section), dict):
                data[section].setdefault(key, value)
        for item in overrides or []:
            apply_override(data, item)
        return cls.from_dict(data, source=path)


def _read_config_file(path: str) -> dict:
    """The sections of a YAML config file, or a ConfigError naming the file and what to do."""
    try:
        with open(path, encoding="utf-8") as f:
            data = read_yaml(f, path)
    except FileNotFoundError:
        raise ConfigError(f"Config file {path} does not exist.") from None
    except IsADirectoryError:
        raise ConfigError(f"Config file {path} is a directory; give a YAML file.") from None
    except UnicodeDecodeError:
        raise ConfigError(f"Config file {path} is not a text (UTF-8) file.") from None
    data = {} if data is None else data  # an empty file: all defaults
    if not isinstance(data, dict):
        # checked before the overrides go in: a list has no sections to put them into
        raise ConfigError(
            f"Config file {path}: the top level is a {type(data).__name__}, not a mapping of sections "
            f"(e.g. 'optim:' with 'lr: 3e-4' under it); allowed sections: {sorted(SECTIONS)}."
        )
    return data


# Options added with a default that changes training: what a run saved before they existed trained with.
EARLIER_DEFAULTS = {
    ("optim", "decay_to_base"): 0.0,
    # alpaca records were plain text before data.alpaca_format: a resumed run keeps the rows it trained on
    ("data", "alpaca_format"): "plain",
}
