"""Choosing which entries to train: a strategy spreads the budget (`usaf.selection.strategies`), a scorer fills
each share (`usaf.selection.scorers`), both plug-ins by name from `usaf.registry`.

Selection is data (flat indices or line ids per tensor, `usaf.selection.saved.Chosen`), whatever made it.
Memory stays bounded by one expert matrix plus the selection itself: nothing here builds a score tensor of a
whole stack.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from usaf.engine.loss import IGNORE_INDEX
from usaf.errors import ConfigError
from usaf.kernels.host import read_int
from usaf.model.layout import ExpertGeometry
from usaf.registry import SCORERS, STRATEGIES
from usaf.selection import calibrate
from usaf.selection.budget import at_density, split_budget, top_indices, weight_budgets
from usaf.selection.saved import Chosen
from usaf.selection.strategies import Domain


class TensorUnit(NamedTuple):
    """A weight tensor whose entries are chosen: an expert tensor (`layer` its MoE layer) or another targeted
    weight (`layer` None, a [1, rows, cols] store)."""

    key: str
    layer: object  # usaf.model.layout.MoELayer, None beyond the experts
    name: str
    store: object
    numel: int
    target: str = "experts"

    @property
    def num_experts(self) -> int:
        return self.store.shape[0]

    @property
    def per_expert(self) -> int:
        return self.numel // self.num_experts

    @property
    def geometry(self) -> ExpertGeometry | None:
        return ExpertGeometry.of(self.layer.experts) if self.layer is not None else None


class NeuronUnit(NamedTuple):
    """An experts layer whose whole neurons are chosen (granularity "neuron"): budgets count neurons."""

    key: str  # the experts module's path
    layer: object
    geometry: ExpertGeometry
    stores: dict
    numel: int  # entries of its gate/up/down tensors

    @property
    def num_experts(self) -> int:
        return self.layer.num_experts

    @property
    def per_expert(self) -> int:
        return self.geometry.intermediate

    @property
    def entries_per_neuron(self) -> int:
        return sum(self.geometry.entries_per_line_group(n, self.stores[n].shape) for n in self.geometry.axes)


@dataclass
class SelectionContext:
    """What strategies and scorers may read: the config (select.*), the calibration statistics they asked for,
    the calibration batches and the prepared model; `cache` holds a scorer's work between `begin` and `pick`."""

    config: object
    calibration: object = None
    batches: list | None = None
    model: object = None
    cache: dict = field(default_factory=dict)


def resolved_selection(config, has_data: bool) -> str:
    """selection="auto": gradient importance when calibration data is given (usaf train always gives it), else
    magnitude (largest |w|), the best choice that needs no data."""
    if config.selection != "auto":
        return config.selection
    return "gradient" if has_data else "magnitude"


def with_resolved_selection(config, has_data: bool):
    if config.selection != "auto":
        return config
    return dataclasses.replace(config, selection=resolved_selection(config, has_data))


def choose(
    layers: list, stores: dict, config, batches=None, model=None, weight_stores: dict | None = None
) -> tuple[dict[str, Chosen], object]:
    """The selection for every expert tensor of the trained `layers` (when "experts" is in `config.targets`) and
    every other targeted weight in `weight_stores` ({"<module path>.weight": (target, store)}), by
    `config.strategy` and `config.selection`, with the calibration it used (None without one). `stores`:
    {experts path: {tensor name: store}}. Data-driven choices run calibration batches through `model` (prepared
    with an empty selection)."""
    config = with_resolved_selection(config, batches is not None and model is not None)
    strategy, scorer = STRATEGIES[config.strategy], SCORERS[config.selection]
    context = SelectionContext(config, model=model)
    saved = strategy.load(context)
    if saved is not None:
        return saved, None
    train_experts = "experts" in config.targets
    experts = [
        _tensor_unit(f"{layer.experts_name}.{t.name}", layer, t.name, stores[layer.experts_name][t.name])
        for layer in (layers if train_experts else [])
        for t in layer.tensors
        if not t.is_bias
    ]
    weights = [
        _tensor_unit(key, None, "weight", store, target)
        for key, (target, store) in (weight_stores or {}).items()
    ]
    with_routing = strategy.needs.routing or scorer.needs.routing
    with_gradients = strategy.needs.gradient or scorer.needs.gradient
    if (with_routing and experts) or with_gradients:
        if batches is None or model is None:
            raise ConfigError(
                f"strategy={config.strategy!r} / selection={config.selection!r} needs calibration data: pass "
                "calibration_batches to prepare_model (usaf train does this from the training data)."
            )
        started = time.perf_counter()
        context.batches = calibration_sample(batches, config)
        context.calibration = calibrate.calibrate(
            model, context.batches, len(context.batches), with_gradients=with_gradients
        )
        context.calibration.supervised_tokens = sum(map(supervised_tokens, context.batches))
        context.calibration.seconds = time.perf_counter() - started

    if config.granularity == "neuron":
        # whole neurons in the experts; the other weights train elements at the same density (or their share of
        # the budget, by size and density_ratios)
        neuron_context = weights_context = context
        if (config.num_entries is not None or config.density_ratios) and weights:
            budgets = weight_budgets(experts + weights, config)
            neuron_context = _with_budget(context, sum(budgets[u.key] for u in experts))
            weights_context = _with_budget(context, sum(budgets[u.key] for u in weights))
        chosen = _choose_neurons(layers, stores, strategy, scorer, neuron_context) if train_experts else {}
        if weights:
            chosen.update(_choose_elements(weights, strategy, scorer, weights_context))
    else:
        chosen = _choose_elements(experts + weights, strategy, scorer, context)
    if train_experts:
        chosen.update(_choose_biases(layers, stores, scorer, context))
    return chosen, context.calibration


def calibration_sample(batches, config) -> list:
    """The batches calibration runs: `calibration_batches` of them, and more until `calibration_tokens` supervised
    tokens are in, or until `batches` ends (usaf train gives one pass over the data). Few tokens make the choice
    hang on which batches were drawn, that is on the seed."""
    taken, tokens = [], 0
    for batch in batches:
        taken.append(batch)
        tokens += supervised_tokens(batch)
        if len(taken) >= config.calibration_batches and tokens >= config.calibration_tokens:
            break
    return taken


def supervised_tokens(batch) -> int:
    labels = batch["labels"]
    return read_int((labels != IGNORE_INDEX).sum(), labels.numel())


def _tensor_unit(key, layer, name, store, target="experts") -> TensorUnit:
    return TensorUnit(key, layer, name, store, int(torch.Size(store.shape).numel()), target)


def _with_budget(context: SelectionContext, entries: int) -> SelectionContext:
    config = dataclasses.replace(context.config, num_entries=max(1, entries))
    return SelectionContext(config, context.calibration, context.batches, context.model)


def _choose_elements(units: list[TensorUnit], strategy, scorer, context) -> dict[str, Chosen]:
    domains = strategy.domains(units, weight_budgets(units, context.config), context)
    scorer.begin(domains, context)
    picked: dict[str, list[torch.Tensor]] = {u.key: [] for u in units}
    for domain in domains:
        for key, flat in scorer.pick(domain, context).items():
            picked[key].append(flat)
    return {
        k: Chosen(None, torch.unique(torch.cat(v)) if v else torch.empty(0, dtype=torch.int64))
        for k, v in picked.items()
    }


def _choose_neurons(layers, stores, strategy, scorer, context) -> dict[str, Chosen]:
    """Whole neurons: the strategy spreads a budget in neurons over layers (or hot experts, or all of them), the
    scorer ranks each layer's neurons, the best of each share are trained; then their lines per tensor."""
    config = context.config
    units = []
    for layer in layers:
        geometry = ExpertGeometry.of(layer.experts)
        layer_stores = stores[layer.experts_name]
        numel = sum(int(torch.Size(layer_stores[n].shape).numel()) for n in geometry.axes)
        units.append(NeuronUnit(layer.experts_name, layer, geometry, layer_stores, numel))
    if config.num_entries is not None:
        entry_budget = split_budget(config.num_entries, {u.key: u.numel for u in units})
    else:
        entry_budget = {u.key: at_density(config, u.numel) for u in units}
    neurons = {
        u.key: min(u.num_experts * u.per_expert, max(1, entry_budget[u.key] // u.entries_per_neuron))
        for u in units
    }
    scores = {u.key: scorer.neuron_scores(u, context) for u in units}
    picked: dict[str, list[torch.Tensor]] = {u.key: [] for u in units}
    for domain in strategy.domains(units, neurons, context):
        if domain.experts is not None:  # the best neurons of these experts of one layer
            (u,) = domain.units
            experts = torch.tensor(domain.experts)
            best = top_indices(scores[u.key][experts].reshape(-1), domain.count)
            picked[u.key].append(experts[best // u.per_expert] * u.per_expert + best % u.per_expert)
            continue
        flat = torch.cat([scores[u.key].reshape(-1) for u in domain.units])
        best = top_indices(flat, domain.count)
        start = 0
        for u in domain.units:
            size = u.num_experts * u.per_expert
            picked[u.key].append(best[(best >= start) & (best < start + size)] - start)
            start += size
    chosen = {}
    for u in units:
        neurons_of = (
            torch.cat(picked[u.key]).sort().values if picked[u.key] else torch.empty(0, dtype=torch.int64)
        )
        for name, axis in u.geometry.axes.items():
            ids = u.geometry.line_ids(name, neurons_of, u.stores[name].shape[axis])
            chosen[f"{u.key}.{name}"] = Chosen(axis, ids)
    return chosen


def _choose_biases(layers, stores, scorer, context) -> dict[str, Chosen]:
    """Expert biases at the same density; they have no gradient statistics: a scorer that needs them gives way
    to magnitude."""
    if not context.config.train_biases:
        return {}
    if scorer.needs.gradient or scorer.needs.routing:
        scorer = SCORERS["magnitude"]
    chosen = {}
    for layer in layers:
        for t in layer.tensors:
            if t.is_bias:
                key = f"{layer.experts_name}.{t.name}"
                unit = _tensor_unit(key, layer, t.name, stores[layer.experts_name][t.name])
                count = at_density(context.config, unit.numel)
                chosen[key] = Chosen(None, scorer.pick(Domain([unit], None, count), context)[key])
    return chosen
