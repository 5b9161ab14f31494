"""What each selection strategy (how the budget is spread) and scorer (how entries are chosen inside it) needs
from calibration, declared once so choose() asks here instead of repeating `strategy == ... or selection == ...`."""

from __future__ import annotations

from typing import NamedTuple


class Needs(NamedTuple):
    """Calibration statistics a strategy or scorer reads: per-expert routing counts, gradient importance."""

    routing: bool = False
    gradient: bool = False


# name -> what it needs; the names are config.py's STRATEGIES and SELECTIONS ("auto" is resolved before lookup)
STRATEGY_NEEDS: dict[str, Needs] = {
    "uniform": Needs(),
    "routing": Needs(routing=True),
    "gradient": Needs(gradient=True),
    "file": Needs(),
}
SCORER_NEEDS: dict[str, Needs] = {
    "random": Needs(),
    "magnitude": Needs(),
    "gradient": Needs(gradient=True),
}


def needs_gradient(config) -> bool:
    """Whether the chosen strategy or scorer reads gradient importance (config.selection already resolved)."""
    return STRATEGY_NEEDS[config.strategy].gradient or SCORER_NEEDS[config.selection].gradient


def needs_routing(config) -> bool:
    """Whether the chosen strategy or scorer reads per-expert routing counts."""
    return STRATEGY_NEEDS[config.strategy].routing or SCORER_NEEDS[config.selection].routing
