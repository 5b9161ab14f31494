"""Selection scorers: which entries fill a share of the budget (a `Domain` from a strategy).

The protocol, for a scorer written outside usaf:

    class MyScorer(BaseScorer):          # its `begin` by default (below)
        name = "mine"                        # select.selection's value
        needs = Needs(gradient=False)        # the calibration statistics it reads
        def pick(self, domain, context) -> dict[str, torch.Tensor]: ...
            # element granularity: sorted flat indices into each unit's tensor, `domain.count` in all, only in
            # `domain.experts` when given
        def neuron_scores(self, unit, context) -> torch.Tensor: ...
            # neuron granularity: [E, I] scores of an experts layer's neurons (the best are trained)
        # called once with every domain before any pick (the gradient scorer probes candidates here)
        def begin(self, domains, context) -> None: ...

    usaf.registry.SCORERS.register(MyScorer())        # or UsafConfig(selection=MyScorer())

Every member is the protocol's (`usaf.registry.Scorer`), checked when the scorer is registered; `BaseScorer` gives
`begin` its default (nothing to prepare), for the built-ins and for a scorer written outside that subclasses it.

`PerTensorScorer` is a base for scorers that pick inside one tensor at a time: it splits a domain's count over
its tensors by size and asks `pick_in(unit, expert, count, context)` (expert None: the whole tensor) for local
flat indices. Memory stays bounded by one expert matrix plus the selection: nothing builds a score tensor of a
whole stack.
"""

from __future__ import annotations

import zlib

import torch

from usaf.engine import expert_parallel
from usaf.registry import SCORERS
from usaf.selection import calibrate
from usaf.selection.budget import split_capped, top_indices
from usaf.selection.candidates import best_neurons, best_rows, lines_wanted
from usaf.selection.strategies import Needs


def generator_for(seed: int, name: str) -> torch.Generator:
    """A generator seeded by (seed, tensor name): a tensor's selection does not depend on iteration order."""
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))


def random_flat_indices(numel: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """`count` distinct indices below `numel`, uniformly at random, sorted; memory O(count)."""
    if count >= numel // 2 or numel <= 1 << 22:
        return torch.randperm(numel, generator=generator)[:count].sort().values
    picked = torch.empty(0, dtype=torch.int64)
    while picked.numel() < count:
        draw = torch.randint(numel, (int((count - picked.numel()) * 1.1) + 16,), generator=generator)
        picked = torch.unique(torch.cat([picked, draw]))
    keep = torch.randperm(picked.numel(), generator=generator)[:count]
    return picked[keep].sort().values


def magnitude_flat_indices(store, count: int) -> torch.Tensor:
    """The `count` entries of largest |w| in a store, merged expert by expert; sorted. A store holding only some
    experts (expert parallelism) finds the best of its own, and the ranks' candidates are merged."""
    num_experts, a, b = store.shape
    best_scores = torch.empty(0)
    best_index = torch.empty(0, dtype=torch.int64)
    for e in store.owned:
        scores = store.materialize([e]).reshape(-1).float().abs().cpu()
        k = min(count, scores.numel())
        top = torch.topk(scores, k, sorted=False)
        best_scores = torch.cat([best_scores, top.values])
        best_index = torch.cat([best_index, top.indices + e * a * b])
        if best_scores.numel() > count:
            best_scores, best_index = _best(best_scores, best_index, count)
    if (
        len(store.owned) < num_experts
    ):  # every EP rank's candidates (the same number on each) hold the global best
        gathered = expert_parallel.gather_over_experts
        best_scores, best_index = _best(gathered(best_scores), gathered(best_index), count)
    return best_index.sort().values


def _best(scores: torch.Tensor, index: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `count` best candidates, ties broken by lower index: a total order, so the result does not depend on
    how the candidates were merged (expert by expert, or rank by rank)."""
    by_index = torch.argsort(index)
    scores, index = scores[by_index], index[by_index]
    keep = torch.argsort(scores, descending=True, stable=True)[:count]
    return scores[keep], index[keep]


class BaseScorer:
    """The defaults of a scorer's optional members: nothing to prepare before the picks."""

    def begin(self, domains, context) -> None:
        pass


class PerTensorScorer(BaseScorer):
    """A scorer that picks inside one tensor (or one expert of it) at a time; see the module docstring."""

    needs = Needs()

    def pick(self, domain, context) -> dict[str, torch.Tensor]:
        sizes = {u.key: u.numel for u in domain.units}
        counts = (
            {domain.units[0].key: domain.count}
            if len(domain.units) == 1
            else split_capped(domain.count, sizes, sizes)
        )
        picked = {}
        for u in domain.units:
            if domain.experts is None:
                picked[u.key] = self.pick_in(u, None, counts[u.key], context)
                continue
            per_expert = u.numel // u.num_experts
            shares = split_capped(
                counts[u.key], dict.fromkeys(domain.experts, 1), dict.fromkeys(domain.experts, per_expert)
            )
            picked[u.key] = torch.cat(
                [self.pick_in(u, e, n, context) + e * per_expert for e, n in shares.items() if n]
                or [torch.empty(0, dtype=torch.int64)]
            )
        return picked

    def pick_in(self, unit, expert: int | None, count: int, context) -> torch.Tensor:
        raise NotImplementedError


class Random(PerTensorScorer):
    """Uniformly at random, seeded by select.seed and the tensor's name."""

    name = "random"

    def pick_in(self, unit, expert, count, context) -> torch.Tensor:
        if expert is None:
            return random_flat_indices(unit.numel, count, generator_for(context.config.seed, unit.key))
        per_expert = unit.numel // unit.num_experts
        return random_flat_indices(
            per_expert, count, generator_for(context.config.seed, f"{unit.key}/{expert}")
        )

    def neuron_scores(self, unit, context) -> torch.Tensor:
        generator = generator_for(context.config.seed, unit.key)
        return torch.rand(unit.num_experts, unit.per_expert, generator=generator)


class Magnitude(PerTensorScorer):
    """The entries (neurons) of largest |w|: no data needed."""

    name = "magnitude"

    def pick_in(self, unit, expert, count, context) -> torch.Tensor:
        if expert is None:
            return magnitude_flat_indices(unit.store, count)
        if expert not in unit.store.owned:  # expert parallelism: its owner picks its entries
            return torch.empty(0, dtype=torch.int64)
        return top_indices(unit.store.materialize([expert]).reshape(-1).float().abs().cpu(), count)

    def neuron_scores(self, unit, context) -> torch.Tensor:
        """[E, I]: squared norm of each neuron's gate, up and down lines (one expert matrix at a time)."""
        geometry = unit.geometry
        scores = torch.zeros(unit.num_experts, geometry.intermediate)
        for name, axis in geometry.axes.items():
            store = unit.stores[name]
            for e in store.owned:
                w = store.materialize([e])[0].float().cpu()
                scores[e] += geometry.per_neuron(name, w.pow(2).sum(dim=2 - axis))
        # expert parallelism: each rank scored its own experts
        return expert_parallel.expert_sum(scores, from_every_rank=False)


class Gradient(BaseScorer):
    """Exact gradient magnitudes over calibration batches, probed only on candidate lines: the neurons (rows of
    other weights) of highest first-order importance (`usaf.selection.candidates`), `oversample` x the budget."""

    name, needs = "gradient", Needs(gradient=True)

    def begin(self, domains, context) -> None:
        candidates = _candidate_lines(domains, context)
        context.cache["probed"] = calibrate.probe_lines(
            context.model, candidates, context.batches, len(context.batches)
        )

    def pick(self, domain, context) -> dict[str, torch.Tensor]:
        probed = context.cache["probed"]
        flat_all, score_all, owner = [], [], []
        for u in domain.units:
            flat, score = probed[u.key].flat_indices, probed[u.key].score
            if domain.experts is not None:
                per_expert = u.numel // u.num_experts
                keep = torch.isin(flat // per_expert, torch.tensor(domain.experts))
                flat, score = flat[keep], score[keep]
            flat_all.append(flat)
            score_all.append(score)
            owner.append(torch.full((flat.numel(),), len(owner)))
        flat, score, owner = torch.cat(flat_all), torch.cat(score_all), torch.cat(owner)
        best = top_indices(score, min(domain.count, score.numel()))
        return {u.key: flat[best[owner[best] == i]] for i, u in enumerate(domain.units)}

    def neuron_scores(self, unit, context) -> torch.Tensor:
        score = context.calibration.neuron_score.get(unit.key)
        return torch.zeros(unit.num_experts, unit.per_expert) if score is None else score.cpu()


def _candidate_lines(domains, context) -> dict[str, tuple[int, torch.Tensor]]:
    """{tensor key: (axis, sorted line ids)} to probe for every domain: the best rows of weights beyond the
    experts, and the lines of the best neurons of the domain's expert layers (pooled across its layers)."""
    config, calibration = context.config, context.calibration
    lines: dict[str, list[torch.Tensor]] = {}
    axes: dict[str, int] = {}
    for domain in domains:
        for u in domain.units:
            if u.layer is None:  # a native weight: its rows of highest importance (a norm: its one line)
                rows, width = u.store.shape[1:]
                wanted = lines_wanted(config.oversample, domain.count, width, rows)
                lines[u.key] = [best_rows(calibration.row_score.get(u.key), rows, wanted)]
                axes[u.key] = 1
        tensors = [u for u in domain.units if u.layer is not None]
        if not tensors:
            continue
        layers = {
            u.layer.experts_name: u for u in tensors
        }  # one unit of each layer: its geometry and experts
        pooled = []
        for path, u in layers.items():
            score = calibration.neuron_score.get(path)
            if score is None:  # no gradient reached this layer
                score = torch.zeros(u.num_experts, u.geometry.intermediate)
            if domain.experts is not None:
                mask = torch.zeros_like(score, dtype=torch.bool)
                mask[domain.experts] = True
                score = score.masked_fill(~mask, float("-inf"))
            pooled.append(score.reshape(-1).cpu())
        neurons_total = sum(p.numel() for p in pooled)
        per_neuron = max(1, sum(u.numel for u in tensors) // neurons_total)
        best = best_neurons(
            torch.cat(pooled), lines_wanted(config.oversample, domain.count, per_neuron, neurons_total)
        )
        start = 0
        for path, score in zip(layers, pooled, strict=True):
            neurons = best[(best >= start) & (best < start + score.numel())] - start
            start += score.numel()
            for u in tensors:
                if u.layer.experts_name != path:
                    continue
                axis = u.geometry.axes[u.name]
                lines.setdefault(u.key, []).append(u.geometry.line_ids(u.name, neurons, u.store.shape[axis]))
                axes[u.key] = axis
    return {key: (axes[key], torch.unique(torch.cat(ids))) for key, ids in lines.items()}


for _scorer in (Random(), Magnitude(), Gradient()):
    SCORERS.register(_scorer)
