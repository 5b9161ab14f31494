"""`usaf train --list-options`: every option with its default, documentation, choices and range."""

from __future__ import annotations

from dataclasses import MISSING, fields

from usaf.config.options import bounds_text, plain
from usaf.config.run import SECTIONS
from usaf.config.values import choice_text


def describe() -> str:
    """Every option with its default and documentation, for `--help`-style listings."""
    lines = []
    for name, section_cls in SECTIONS.items():
        for f in fields(section_cls):
            default = f.default if f.default is not MISSING else f.default_factory()
            choices, bounds = f.metadata.get("choices"), f.metadata.get("bounds")
            doc = f.metadata.get("doc", "")
            extra = f" (one of {', '.join(choice_text(c) for c in choices)})" if choices else ""
            extra += f" (allowed: {bounds_text(bounds).removeprefix('in ')})" if bounds else ""
            extra += f" (at most {f.metadata['most']})" if f.metadata.get("most") else ""
            lines.append(f"{name}.{f.name} = {plain(default)!r}  {doc}{extra}")
    return "\n".join(lines)
