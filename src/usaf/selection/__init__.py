"""Choosing what to train: calibration, strategies and scorers (plug-ins, see `usaf.registry`), reselection."""

# the built-in strategies and scorers register themselves when their modules load
from usaf.selection import scorers, strategies  # noqa: F401
