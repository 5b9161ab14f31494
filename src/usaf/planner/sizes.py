"""Sizes as people write them (12GB, 512MiB) and as the planner prints them."""

from __future__ import annotations

import re

from usaf.errors import UsafError

GiB = 1 << 30
MiB = 1 << 20


_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


_SIZE_FORMS = "a number with an optional unit, e.g. 12GB, 12GiB, 12G, 512MB, 1.5TB, or bytes (12884901888)"


def parse_size(text: str | int) -> int:
    """Bytes from '12GB', '12GiB', '12G', '512MB', '1.5T', '4096B' or a plain number of bytes.

    Units are binary (12GB = 12 GiB = 12 * 2**30 bytes), as memory cards and modules are sized.
    """
    if isinstance(text, int) and not isinstance(text, bool) and text >= 0:
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])(?:i?b)?|b)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise UsafError(f"Cannot read the size {text!r}; write {_SIZE_FORMS}.")
    return int(float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").lower()])


def format_size(num_bytes: float) -> str:
    if num_bytes <= 0:
        return "-"
    if num_bytes >= 0.95 * GiB:
        return f"{num_bytes / GiB:.2f} GB"
    if num_bytes >= 0.95 * MiB:
        return f"{num_bytes / MiB:.0f} MB"
    return f"{num_bytes / 1024:.0f} KB"


def format_count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(int(n))
