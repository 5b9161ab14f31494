"""`--set section.key=value`: an override read (its value as YAML) into a config file's nested dict."""

from __future__ import annotations

from usaf.config.yaml import YamlRefusedError, read_yaml
from usaf.errors import ConfigError, UsafError


def apply_override(data: dict, item: str | tuple[str, object]) -> None:
    """`section.key=value` (value parsed as YAML: numbers, booleans, lists) into a nested dict; or a
    ("section.key", value) pair, whose value is already typed and taken as it is (a path from the command line is
    a string verbatim: YAML would read ` #` as a comment and `: ` as a mapping)."""
    if isinstance(item, tuple):
        (key, value), item = item, f"{item[0]}={item[1]}"
    else:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. --set optim.lr=3e-4.")
        key, raw = item.split("=", 1)
        try:
            value = read_yaml(raw, f"--set {key}") if raw != "" else ""
        except YamlRefusedError:
            raise
        except UsafError:
            value = raw  # not YAML: the text as given
    section, name = key.split(".", 1)
    if data.get(section) is None:  # absent, or an empty `section:` line in the file
        data[section] = {}
    if not isinstance(data[section], dict):
        raise ConfigError(f"--set {item!r}: '{section}' is not a section.")
    data[section][name] = value
