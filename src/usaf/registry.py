"""Named plug-ins of one kind (selection strategies, scorers, target kinds): a registry each, read by the config
for its choices and by the code that runs them.

The registries are declared here, at the bottom of the package, so that `usaf.config` can offer their names as
choices; the built-in plug-ins register themselves where they are implemented (`usaf.selection.strategies`,
`usaf.selection.scorers`, `usaf.model.targets`), which `import usaf` always loads before any config is made. A
plug-in written outside the package registers the same way (`STRATEGIES.register(MyStrategy())`), or is passed to
the config as an object, which registers it under its `name`.
"""

from __future__ import annotations

from collections.abc import Iterator

from usaf.errors import UsafError


class Registry:
    """Plug-ins by name, in registration order. `required`: the attributes a plug-in must have."""

    def __init__(self, kind: str, required: tuple[str, ...] = ()):
        self.kind = kind
        self.required = ("name", *required)
        self._plugins: dict[str, object] = {}

    def register(self, plugin, replace: bool = False):
        """Make `plugin` (an object with the registry's attributes) known by `plugin.name`; returns it.
        Registering the same object again is a no-op; another object under a taken name needs `replace=True`."""
        missing = [a for a in self.required if not hasattr(plugin, a)]
        if missing:
            raise UsafError(
                f"{plugin!r} is not a {self.kind}: it lacks {', '.join(missing)} (see {self.kind}'s protocol)."
            )
        name = plugin.name
        if not isinstance(name, str) or not name:
            raise UsafError(f"A {self.kind}'s name must be a non-empty string, got {name!r}.")
        known = self._plugins.get(name)
        if known is not None and known is not plugin and not replace:
            raise UsafError(
                f"A {self.kind} named {name!r} is registered already ({known!r}); choose another name or "
                "pass replace=True."
            )
        self._plugins[name] = plugin
        return plugin

    def unregister(self, name: str) -> None:
        self._plugins.pop(name, None)

    def __getitem__(self, name: str):
        try:
            return self._plugins[name]
        except KeyError:
            raise UsafError(f"No {self.kind} named {name!r}; known: {', '.join(self._plugins)}.") from None

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


# how a selection spreads its budget over tensors, experts or the whole model (usaf.selection.strategies)
STRATEGIES = Registry("selection strategy", ("needs", "domains"))
# how entries are chosen inside a budget (usaf.selection.scorers)
SCORERS = Registry("selection scorer", ("needs", "pick", "neuron_scores"))
# which weights beyond the experts may hold trained entries (usaf.model.targets)
TARGET_KINDS = Registry("target kind", ("kind", "claims"))
