"""usaf: fine-tune a Mixture-of-Experts model's own expert weights, sparsely, on a frozen base.

The public API lives in `usaf.api` and is imported here, with torch and transformers, when a program imports usaf.
In the `usaf` command's own process (`usaf.startup.is_the_command`) it is not: `usaf --help` and a mistyped
option answer at once, and `usaf.cli` imports the API when a command runs; a name asked for before then
(a plug-in module's `usaf.UsafConfig`) imports it on first use (PEP 562)."""

import importlib
import importlib.util

import usaf.startup  # first: Ctrl-C while the API's imports run ends `usaf` in one line
from usaf.version import __version__ as __version__


def __getattr__(name: str):
    # the import system's and tools' probes (__path__, __wrapped__...) are not the API
    if name.startswith("__"):
        raise AttributeError(f"module 'usaf' has no attribute {name!r}")
    # `from usaf import planner` asks the package for the attribute first: a module of the package is itself,
    # imported alone, not a reason to import the whole API (and torch) in the command's process
    if importlib.util.find_spec(f"usaf.{name}") is not None:
        return importlib.import_module(f"usaf.{name}")
    try:
        return getattr(importlib.import_module("usaf.api"), name)
    except AttributeError:
        raise AttributeError(f"module 'usaf' has no attribute {name!r}") from None


if not usaf.startup.is_the_command():  # a program that imports usaf: the whole API at once, as always
    _api = importlib.import_module("usaf.api")
    __all__ = _api.__all__
    globals().update({name: getattr(_api, name) for name in __all__})
