"""Sizes as people write them (12GB, 512MiB) and as the planner prints them."""

from __future__ import annotations

from usaf.config import parse_size  # noqa: F401  (sizes as people write them: read where options are)

GiB = 1 << 30
MiB = 1 << 20


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
