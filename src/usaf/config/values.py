"""An option's value read and checked as its `option()` declares: the type conversion every way of making a config
shares (a file, --set, Python), and the readers of paths and sizes that options and command-line flags use."""

from __future__ import annotations

import os
import re
from dataclasses import MISSING

from usaf.config.options import AUTO, INT_MOST, bounds_text, check_bounds
from usaf.errors import ConfigError, UsafError
from usaf.registry import Choices


def check_option(spec, value, where: str):
    """One option's value, read and checked as declared (its type, choices, range, ceiling, path expansion):
    the value to keep, or a ConfigError naming `where`. Every way a config is made (a file, --set, Python) comes
    here, so each fault has one message."""
    choices = spec.metadata.get("choices")
    # a boolean choice of a string-valued option (train.recompute: auto, true or false)
    if isinstance(value, bool) and choices and any(c is value for c in choices):
        return value
    if isinstance(choices, Choices) and not isinstance(value, (str, list, dict, tuple, type(None))):
        # a plug-in object given from Python (a strategy or scorer): registered under its name, which is kept
        try:
            value = choices.registry.key(choices.registry.register(value))
        except UsafError as err:
            raise ConfigError(f"{where}: {err}") from None
    value = _coerce(value, spec, where)
    if isinstance(value, (list, dict)) and (choices or spec.metadata.get("bounds")):
        return _check_collection(value, choices, spec.metadata.get("bounds"), where)
    if choices and value not in choices:
        raise ConfigError(f"{where} = {value!r} is not allowed; allowed values: {choices_text(choices)}.")
    check_bounds(value, spec.metadata.get("bounds"), where)
    integers = value if isinstance(value, list) else [value]
    most = spec.metadata.get("most") or INT_MOST
    for number in integers:
        if isinstance(number, int) and not isinstance(number, bool) and number > most:
            raise ConfigError(f"{where} must be at most {most}, got {number!r}.")
    if spec.metadata.get("path") and value:
        value = [expand_path(v) for v in value] if isinstance(value, list) else expand_path(value)
    parse = spec.metadata.get("parse")
    if parse is not None and value not in ("", None):
        try:
            parse(value)
        except UsafError as err:
            raise ConfigError(f"{where}: {err}") from None
    return value


def _check_collection(value, choices, bounds: str | None, where: str):
    """A list option with choices is some of them (kept in their order); a dict option maps some of them to
    numbers in `bounds` (select.targets, select.density_ratios)."""
    if isinstance(value, list):
        if not value or any(item not in choices for item in value):
            raise ConfigError(f"{where} must be a non-empty list of {choices_text(choices)}, got {value!r}.")
        return [c for c in choices if c in value]
    numbers = all(not isinstance(v, bool) and isinstance(v, (int, float)) for v in value.values())
    if not numbers or any(key not in choices for key in value):
        raise ConfigError(
            f"{where} must map some of {choices_text(choices)} to numbers {bounds_text(bounds)}, got {value!r}."
        )
    for key, number in value.items():
        check_bounds(number, bounds, f"{where}[{key!r}]")
    return value


def expand_path(text: str) -> str:
    """`~` and `$VAR` / `${VAR}` expanded as a shell would, for every path usaf is given (options and command-line
    arguments); a variable that is not set is left as written, so the error names it."""
    return os.path.expanduser(os.path.expandvars(text)) if isinstance(text, str) else text


def split_paths(text: str) -> list[str]:
    """Comma-separated paths (`--data a.jsonl,b.jsonl`); a file whose own name holds a comma stays whole: when the
    whole text names a file or folder and one of its pieces does not, it is that one path."""
    pieces = [p.strip() for p in text.split(",") if p.strip()]
    whole = expand_path(text.strip())
    if len(pieces) > 1 and os.path.exists(whole) and not all(os.path.exists(expand_path(p)) for p in pieces):
        return [text.strip()]
    return pieces


_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE_FORMS = "a number with an optional unit, e.g. 12GB, 12GiB, 12G, 512MB, 1.5TB, or bytes (12884901888)"


def parse_size(text: str | int) -> int:
    """Bytes from '12GB', '12GiB', '12G', '512MB', '1.5T', '4096B' or a plain number of bytes (train.memory_limit,
    `usaf plan --vram`).

    Units are binary (12GB = 12 GiB = 12 * 2**30 bytes), as memory cards and modules are sized.
    """
    if isinstance(text, int) and not isinstance(text, bool) and text >= 0:
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])(?:i?b)?|b)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ConfigError(f"Cannot read the size {text!r}; write {_SIZE_FORMS}.")
    return int(float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").lower()])


def choice_text(choice) -> str:
    return str(choice).lower() if isinstance(choice, bool) else str(choice)


def choices_text(choices) -> str:
    return "[" + ", ".join(repr(c) if isinstance(c, str) else choice_text(c) for c in choices) + "]"


def _declared_type(spec) -> str:
    """The option's type: its default's, or, for a None default, the annotation's ("int | None" is int)."""
    annotation = str(spec.type).replace(" ", "")
    if annotation in ("float|Auto", "int|Auto"):  # a number or auto (select.density: a share or auto)
        return annotation.replace("|", " | ")
    default = spec.default if spec.default is not MISSING else spec.default_factory()
    if default is not None:
        return "bool" if isinstance(default, bool) else type(default).__name__
    return "list[int]" if annotation.startswith("list[int]") else annotation.split("|")[0]


def _coerce(value, spec, where: str):
    """Check a value against the option's declared type (ints accepted for floats, scalars for lists)."""
    if value is None:
        default = spec.default if spec.default is not MISSING else spec.default_factory()
        if default is None:
            return None
        raise ConfigError(f"{where} needs a value (null is not one).")
    coerce = _COERCERS.get(_declared_type(spec))
    return coerce(value, spec, where) if coerce is not None else value


def _as_bool(value, spec, where: str) -> bool:
    if isinstance(value, bool):
        return value
    raise ConfigError(f"{where} must be true or false, got {value!r}.")


def _as_int(value, spec, where: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ConfigError(f"{where} must be an integer, got {value!r}.")


def _as_float(value, spec, where: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:  # YAML 1.1 reads "3e-4" (no dot) as a string
            return float(value)
        except ValueError:
            pass
    raise ConfigError(f"{where} must be a number, got {value!r}.")


def _as_layer_numbers(value, spec, where: str) -> list[int] | None:
    """Layer numbers: a list, one number, "0,2", or "all" (the same as null)."""
    if isinstance(value, str) and value.strip().lower() == "all":
        return None
    value = list(value) if isinstance(value, (tuple, range)) else value
    items = value if isinstance(value, list) else str(value).split(",") if isinstance(value, str) else [value]
    numbers = []
    for item in items:
        item = item.strip() if isinstance(item, str) else item
        if isinstance(item, str) and item.lstrip("-").isdigit():
            item = int(item)
        if isinstance(item, bool) or not isinstance(item, int):
            raise ConfigError(
                f"{where} must be a list of layer numbers (e.g. [0, 2]), or null (or all) for every layer, "
                f"got {value!r}."
            )
        numbers.append(item)
    return numbers


def _as_names(value, spec, where: str) -> list[str]:
    """Names or paths: a list, one, or several comma separated (a path option's own commas kept)."""
    value = list(value) if isinstance(value, (tuple, set)) else value
    if isinstance(value, list):
        items = value
    elif spec.metadata.get("path") and isinstance(value, str):
        items = split_paths(value)
    else:
        items = [v.strip() for v in str(value).split(",") if v.strip()]
    if isinstance(value, dict) or any(isinstance(v, (list, dict)) or v is None for v in items):
        raise ConfigError(
            f"{where} must be a list of names or paths (or one, or several comma separated), got {value!r}."
        )
    return [str(v) for v in items]


def _as_mapping(value, spec, where: str) -> dict:
    if isinstance(value, dict):
        return value
    raise ConfigError(f"{where} must be a mapping (e.g. {{key: value}}), got {value!r}.")


def _as_text(value, spec, where: str) -> str:
    if isinstance(value, os.PathLike):  # a pathlib.Path from Python
        return os.fspath(value)
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{where} must be a string, got {value!r}.")


# an option's declared type (`_declared_type`) -> what reads a value of it
def _or_auto(read, kind: str):
    """A reader of `read`'s values or the word auto (select.density: a share or auto)."""

    def read_or_auto(value, spec, where: str):
        if value is AUTO or (isinstance(value, str) and value.strip().lower() == "auto"):
            return AUTO
        try:
            return read(value, spec, where)
        except UsafError:
            raise ConfigError(f"{where} must be {kind} or auto, got {value!r}.") from None

    return read_or_auto


_COERCERS = {
    "bool": _as_bool,
    "int": _as_int,
    "float": _as_float,
    "float | Auto": _or_auto(_as_float, "a number"),
    "int | Auto": _or_auto(_as_int, "an integer"),
    "list[int]": _as_layer_numbers,
    "list": _as_names,
    "dict": _as_mapping,
    "str": _as_text,
}
