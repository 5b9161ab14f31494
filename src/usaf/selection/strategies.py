"""Selection strategies: how a budget of trained entries (or neurons) is spread over the targeted tensors.

A strategy turns the units of a selection (a weight tensor's entries, or an experts layer's neurons) and each
unit's budget into `Domain`s: shares of the budget that a scorer (`usaf.selection.scorers`) then fills with the
best entries of the share. The protocol, for a strategy written outside usaf:

    class MyStrategy(BaseStrategy):     # its `load` by default (below)
        name = "mine"                       # select.strategy's value
        needs = Needs(routing=True)         # the calibration statistics `domains` reads
        def domains(self, units, budgets, context) -> list[Domain]: ...
        # a complete selection that replaces choosing (a saved file), else None
        def load(self, context) -> dict[str, Chosen] | None: ...

    usaf.registry.STRATEGIES.register(MyStrategy())   # or UsafConfig(strategy=MyStrategy())

Every member is the protocol's (`usaf.registry.Strategy`), checked when the strategy is registered;
`BaseStrategy` gives `load` its default (None: choose), for the built-ins and for a strategy written outside that
subclasses it.

A unit has `key` (the tensor's or layer's name), `layer` (its `MoELayer`; None for a weight beyond the experts),
`per_expert` (the budget one expert can hold) and `num_experts`; `context.calibration` holds the statistics asked
for (`Calibration.share(path)`: each expert's share of the routed tokens).
"""

from __future__ import annotations

from typing import NamedTuple

from usaf.errors import ConfigError
from usaf.registry import STRATEGIES
from usaf.selection.budget import hot_experts, split_capped
from usaf.selection.saved import load_selection


class Needs(NamedTuple):
    """Calibration statistics a strategy or scorer reads: per-expert routing counts, gradient importance."""

    routing: bool = False
    gradient: bool = False


class Domain(NamedTuple):
    """One share of the budget: `count` entries (neurons) among `units`, restricted to `experts` (None: all)."""

    units: list
    experts: list[int] | None
    count: int


class BaseStrategy:
    """The defaults of a strategy's optional members: no saved selection, so the entries are chosen."""

    def load(self, context):
        return None


class Uniform(BaseStrategy):
    """Every tensor (layer) keeps its own budget, spread over all its experts."""

    name, needs = "uniform", Needs()

    def domains(self, units, budgets, context) -> list[Domain]:
        return [Domain([u], None, budgets[u.key]) for u in units]


class Routing(BaseStrategy):
    """Experts covering `routing_coverage` of the task's routed tokens share their layer's budget in proportion
    to their share (cold experts get nothing); weights beyond the experts keep their own budget."""

    name, needs = "routing", Needs(routing=True)

    def domains(self, units, budgets, context) -> list[Domain]:
        out = []
        for u in units:
            if u.layer is None:  # a native weight beyond the experts: no routing to follow
                out.append(Domain([u], None, budgets[u.key]))
                continue
            share = context.calibration.share(u.layer.experts_name)
            hot = hot_experts(share, context.config.routing_coverage, budgets[u.key], u.per_expert)
            counts = split_capped(
                budgets[u.key], {e: float(share[e]) for e in hot}, dict.fromkeys(hot, u.per_expert)
            )
            out += [Domain([u], [e], n) for e, n in counts.items() if n]
        return out


class GlobalGradient(BaseStrategy):
    """One global top-k by gradient importance across every unit decides where the budget goes."""

    name, needs = "gradient", Needs(gradient=True)

    def domains(self, units, budgets, context) -> list[Domain]:
        return [Domain(list(units), None, sum(budgets[u.key] for u in units))]


class SavedFile(BaseStrategy):
    """A selection saved by a run or `usaf select` (select.file), used as it is."""

    name, needs = "file", Needs()

    def domains(self, units, budgets, context) -> list[Domain]:
        raise ConfigError("strategy='file' loads a saved selection; it spreads no budget.")

    def load(self, context):
        return load_selection(context.config.file)


for _strategy in (Uniform(), Routing(), GlobalGradient(), SavedFile()):
    STRATEGIES.register(_strategy)
