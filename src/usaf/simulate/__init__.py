"""`usaf plan --simulate`: a plan's training step run on fake tensors at the model's full shape (docs/simulate.md).

`simulate(plan, config)` (`usaf.simulate.step`) measures it; `usaf.simulate.report` sets it beside the plan."""

from usaf.simulate.report import format_report, summary
from usaf.simulate.step import Simulation, simulate

__all__ = ["Simulation", "format_report", "simulate", "summary"]
