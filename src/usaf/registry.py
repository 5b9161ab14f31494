"""Named plug-ins of one kind: every plug-in point of usaf is a `Registry` checked against a runtime-checkable
Protocol, read by the config for its choices and by the code that runs them.

The plug-in points: selection strategies and scorers, target kinds and trackers (declared here), quantization
formats (`usaf.quant.FORMATS`, `PUBLISHED`), the forwards of target kinds (`usaf.engine.sparse_weights.FORWARDS`)
and the command line's commands (`usaf.cli.COMMANDS`). The registries the config offers as choices are declared
here, at the bottom of the package, with their Protocols (string annotations for the higher stages' types); the
built-in plug-ins register themselves where they are implemented (`usaf.selection.strategies`,
`usaf.selection.scorers`, `usaf.model.targets`, `usaf.train.trackers`), which `import usaf` always loads before any
config is made. A plug-in written outside the package registers the same way (`STRATEGIES.register(MyStrategy())`),
or is passed to the config as an object, which registers it under its `name`. A Protocol's optional members are
declared like the others: the kind's small base class (`BaseStrategy`, `BaseScorer`, `Tracker`) gives their no-op
default.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from usaf.errors import ConfigError

T = TypeVar("T")


def _article(noun: str) -> str:
    return "an" if noun[:1].lower() in "aeiou" else "a"


def protocol_members(protocol: type) -> tuple[str, ...]:
    """The members a runtime-checkable Protocol declares (methods and annotated attributes, its bases' too)."""
    names: list[str] = []
    for cls in reversed(protocol.__mro__):
        if cls in (object, Protocol, Generic) or not getattr(cls, "_is_protocol", False):
            continue
        for name in [*getattr(cls, "__annotations__", {}), *vars(cls)]:
            if not name.startswith("_") and name not in names:
                names.append(name)
    return tuple(names)


class Registry(Generic[T]):
    """Plug-ins of one kind by name, in registration order, each checked against the kind's Protocol when it is
    registered (a missing member is named then, not found missing in the middle of a run). `key`: a plug-in's
    name (its `name` attribute unless the kind names its plug-ins otherwise)."""

    def __init__(self, kind: str, protocol: type[T], key: Callable[[T], str] | None = None):
        if not getattr(protocol, "_is_runtime_protocol", False):
            raise TypeError(f"{protocol!r} is not a runtime-checkable Protocol")
        self.kind, self.protocol = kind, protocol
        self._key = key or (lambda plugin: plugin.name)
        self._plugins: dict[str, T] = {}
        self._rules: list[Callable[[T], None]] = []

    def register(self, plugin: T, replace: bool = False) -> T:
        """Make `plugin` (an object with the registry's protocol) known by its name; returns it. Registering the
        same object again is a no-op; another object under a taken name needs `replace=True`."""
        missing = [m for m in protocol_members(self.protocol) if not hasattr(plugin, m)]
        if missing or not isinstance(plugin, self.protocol):
            raise ConfigError(
                f"{plugin!r} is not {_article(self.kind)} {self.kind}: it lacks {', '.join(missing) or 'members'} "
                f"(see {self.protocol.__module__}.{self.protocol.__qualname__})."
            )
        name = self.key(plugin)
        if not isinstance(name, str) or not name:
            raise ConfigError(f"A {self.kind}'s name must be a non-empty string, got {name!r}.")
        for rule in self._rules:
            rule(plugin)
        known = self._plugins.get(name)
        if known is not None and known is not plugin and not replace:
            raise ConfigError(
                f"A {self.kind} named {name!r} is registered already ({known!r}); choose another name or "
                "pass replace=True."
            )
        self._plugins[name] = plugin
        return plugin

    def key(self, plugin: T) -> str:
        """The name `plugin` is (or would be) registered under."""
        return self._key(plugin)

    def require(self, rule: Callable[[T], None]) -> None:
        """Add a check every plug-in must pass (it raises a one-line UsafError), for a constraint a later stage
        owns (the engine: every target kind has a forward); the plug-ins registered already are checked now."""
        for plugin in self._plugins.values():
            rule(plugin)
        self._rules.append(rule)

    def unregister(self, name: str) -> None:
        self._plugins.pop(name, None)

    def __setitem__(self, name: str, plugin: T) -> None:
        """`registry[name] = plugin`: register (replacing) under its own name, so that `monkeypatch.setitem` adds
        a plug-in for one test and takes it away after."""
        if self.key(plugin) != name:
            raise ConfigError(f"A {self.kind} named {self.key(plugin)!r} cannot be registered as {name!r}.")
        self.register(plugin, replace=True)

    def __delitem__(self, name: str) -> None:
        del self._plugins[name]

    def __getitem__(self, name: str) -> T:
        try:
            return self._plugins[name]
        except KeyError:
            raise ConfigError(f"No {self.kind} named {name!r}; known: {', '.join(self._plugins)}.") from None

    def get(self, name: str, default: T | None = None) -> T | None:
        return self._plugins.get(name, default)

    def items(self) -> list[tuple[str, T]]:
        return list(self._plugins.items())

    def __contains__(self, name) -> bool:
        return isinstance(name, str) and name in self._plugins

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._plugins))

    def __len__(self) -> int:
        return len(self._plugins)

    def choices(self, *extra: str) -> Choices:
        """A live view of the names (after `extra`, e.g. "auto"), for a config option's choices."""
        return Choices(self, extra)

    def __repr__(self) -> str:
        return f"Registry({self.kind}: {', '.join(self._plugins)})"


class Choices:
    """The names of a registry's plug-ins after some fixed names: read at each check, so a plug-in registered
    later is a valid choice. A value that is not a string but has the registry's protocol is registered."""

    def __init__(self, registry: Registry, extra: tuple[str, ...]):
        self.registry, self.extra = registry, extra

    def __iter__(self) -> Iterator[str]:
        return iter((*self.extra, *self.registry))

    def __contains__(self, name) -> bool:
        return name in self.extra or name in self.registry

    def __len__(self) -> int:
        return len(self.extra) + len(self.registry)

    def check(self, names) -> None:
        """Refuse the first of `names` that is not a choice, in one line (a list option's check that keeps the
        list's order and allows it empty, as log.report_to does)."""
        unknown = [name for name in names if name not in self]
        if unknown:
            raise ConfigError(f"unknown {self.registry.kind} {unknown[0]!r}; known: {', '.join(self)}.")


@runtime_checkable
class Strategy(Protocol):
    """How a selection spreads its budget (`usaf.selection.strategies` has the protocol's prose; its
    `BaseStrategy` gives `load`'s default)."""

    name: str
    needs: Any

    def domains(self, units, budgets, context) -> list: ...

    def load(self, context) -> dict | None: ...


@runtime_checkable
class Scorer(Protocol):
    """How entries are chosen inside a budget (`usaf.selection.scorers`; its `BaseScorer` gives `begin`'s
    default)."""

    name: str
    needs: Any

    def pick(self, domain, context) -> dict: ...

    def neuron_scores(self, unit, context) -> Any: ...

    def begin(self, domains, context) -> None: ...


@runtime_checkable
class TargetRole(Protocol):
    """A role a weight beyond the experts plays (`usaf.model.targets.TargetKind`)."""

    name: str
    kind: str
    claims: Callable


@runtime_checkable
class Tracker(Protocol):
    """An experiment tracker of `log.report_to`: a class, started once per run (`usaf.train.trackers` has the
    protocol's prose; its base class `Tracker` gives the defaults of `available`, `check`, `hint` and `close`)."""

    name: str
    package: str
    install: str

    def available(self) -> bool: ...

    def check(self) -> None: ...

    def hint(self) -> str: ...

    def start(self, run_dir, config: dict, start_step: int) -> None: ...

    def log(self, step: int, scalars: dict) -> None: ...

    def close(self) -> None: ...


# how a selection spreads its budget over tensors, experts or the whole model (usaf.selection.strategies)
STRATEGIES: Registry[Strategy] = Registry("selection strategy", Strategy)
# how entries are chosen inside a budget (usaf.selection.scorers)
SCORERS: Registry[Scorer] = Registry("selection scorer", Scorer)
# which weights beyond the experts may hold trained entries (usaf.model.targets)
TARGET_KINDS: Registry[TargetRole] = Registry("target kind", TargetRole)
# the experiment trackers of log.report_to (usaf.train.trackers): classes, started by the run
TRACKERS: Registry[type[Tracker]] = Registry("tracker", Tracker)


@runtime_checkable
class Objective(Protocol):
    """What a run minimizes, chosen by `train.objective` (`usaf.train.objectives` has the built-ins and the
    protocol's prose). Declared here, with its registry, so that the config offers its names as choices."""

    name: str
    pairs: bool  # trains on preference pairs: a batch's chosen rows, then its rejected rows
    # the forwards without gradients each step runs besides its own, over as many rows (DPO's reference: True, 1;
    # KTO's reference and KL rows: 3); what `usaf plan` counts of a step's time
    reference_forward: bool | int
    # optim.lr when it is auto (the default): the peak rate this objective was measured best at
    default_lr: float

    def check(self, train) -> None: ...

    def loss_sum(self, model, batch: dict, train) -> tuple: ...

    def supervised_units(self, batch: dict) -> int: ...

    def step_metrics(self, extras: list, supervised: int, total: Callable) -> dict: ...


# what a run minimizes (usaf.train.objectives)
OBJECTIVES: Registry[Objective] = Registry("objective", Objective)
