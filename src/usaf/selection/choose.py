"""Choosing which entries to train: budgets per tensor, and random or magnitude selection inside a tensor.

Selection is data (flat indices or line ids per tensor), so later strategies (routing statistics, gradient
importance, a user's file) plug in by producing the same data. Memory stays bounded by one expert matrix plus
the selection itself: nothing here builds a score tensor of a whole stack.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import zlib
from pathlib import Path
from typing import NamedTuple

import torch

from usaf.errors import UsafError
from usaf.io.atomic import atomic_file, atomic_json
from usaf.model.layout import entries_per_neuron, intermediate_size, neuron_axes
from usaf.selection import calibrate
from usaf.selection.strategies import needs_gradient, needs_routing


def generator_for(seed: int, name: str) -> torch.Generator:
    """A generator seeded by (seed, tensor name): a tensor's selection does not depend on iteration order."""
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))


def proportional(total: int, weights: dict) -> dict:
    """Split `total` in proportion to `weights` exactly (largest remainders; equal shares if all weights are 0)."""
    whole = sum(weights.values())
    shares = {k: total * (w / whole if whole > 0 else 1 / len(weights)) for k, w in weights.items()}
    counts = {k: int(v) for k, v in shares.items()}
    leftover = total - sum(counts.values())
    for k in sorted(shares, key=lambda k: shares[k] - counts[k], reverse=True)[:leftover]:
        counts[k] += 1
    return counts


def split_capped(total: int, weights: dict, caps: dict) -> dict:
    """Split `total` in proportion to `weights`, never giving a key more than its cap; exact."""
    if total > sum(caps[k] for k in weights):
        raise UsafError(
            f"A budget of {total:,} entries exceeds the {sum(caps[k] for k in weights):,} available."
        )
    counts = dict.fromkeys(weights, 0)
    remaining = total
    while remaining > 0:
        room = [k for k in weights if counts[k] < caps[k]]
        offer = proportional(remaining, {k: weights[k] for k in room})
        for k in room:
            given = min(offer[k], caps[k] - counts[k])
            counts[k] += given
            remaining -= given
    return counts


def split_budget(total: int, sizes: dict[str, int]) -> dict[str, int]:
    """Split a budget of entries over tensors in proportion to their sizes, exactly."""
    return split_capped(total, sizes, sizes)


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
    """The `count` entries of largest |w| in a store, merged expert by expert; sorted."""
    num_experts, a, b = store.shape
    best_scores = torch.empty(0)
    best_index = torch.empty(0, dtype=torch.int64)
    for e in range(num_experts):
        scores = store.materialize([e]).reshape(-1).float().abs().cpu()
        k = min(count, scores.numel())
        top = torch.topk(scores, k, sorted=False)
        best_scores = torch.cat([best_scores, top.values])
        best_index = torch.cat([best_index, top.indices + e * a * b])
        if best_scores.numel() > count:
            keep = torch.topk(best_scores, count, sorted=False).indices
            best_scores, best_index = best_scores[keep], best_index[keep]
    return best_index.sort().values


def neuron_lines(
    neurons: torch.Tensor, intermediate: int, gate_lines: bool, concatenated: bool
) -> torch.Tensor:
    """Line indices within an expert for neurons j: gate and up lines (j, I+j or 2j, 2j+1), else j itself."""
    if not gate_lines:
        return neurons
    if concatenated:
        return torch.cat([neurons, neurons + intermediate])
    return torch.cat([2 * neurons, 2 * neurons + 1])


# --------------------------------------------------------------------------------------------------------------
# Strategies: spread one global budget over units (tensors, experts, or everything), then pick inside each unit
# --------------------------------------------------------------------------------------------------------------


def hot_experts(share: torch.Tensor, coverage: float, needed: int = 0, capacity: int = 1) -> list[int]:
    """The fewest experts whose routed share adds up to `coverage`, widened (hottest first) until they can
    hold `needed` entries at `capacity` each. Experts that received no tokens are never included."""
    order = [e for e in torch.argsort(share, descending=True, stable=True).tolist() if share[e] > 0]
    chosen, total = [], 0.0
    for e in order:
        if total >= coverage - 1e-12 and len(chosen) * capacity >= needed:
            break
        chosen.append(e)
        total += float(share[e])
    if len(chosen) * capacity < needed:
        raise UsafError(
            f"The routing strategy cannot place {needed:,} entries: only {len(chosen)} experts received tokens "
            "in calibration. Lower the budget, calibrate on more data, or use strategy='uniform'."
        )
    return sorted(chosen)


def neuron_line_ids(experts, name: str, neurons: torch.Tensor, lines_per_expert: int) -> torch.Tensor:
    """Sorted line ids (expert * lines_per_expert + line) of neurons (expert * I + j) in tensor `name`."""
    size = intermediate_size(experts)
    expert, j = neurons // size, neurons % size
    gate = name == "gate_up_proj"
    lines = neuron_lines(j, size, gate, experts.is_concatenated)
    owners = torch.cat([expert, expert]) if gate else expert
    return (owners * lines_per_expert + lines).sort().values


def magnitude_neuron_scores(experts, stores, axes) -> torch.Tensor:
    """[E, I]: squared norm of each neuron's gate, up and down lines (one expert matrix at a time)."""
    size = intermediate_size(experts)
    scores = torch.zeros(stores["down_proj"].shape[0], size)
    for name, axis in axes.items():
        for e in range(stores[name].shape[0]):
            w = stores[name].materialize([e])[0].float().cpu()
            line_norms = w.pow(2).sum(dim=2 - axis)
            if name == "gate_up_proj":
                pair = (
                    (line_norms[:size], line_norms[size:])
                    if experts.is_concatenated
                    else (line_norms[0::2], line_norms[1::2])
                )
                line_norms = pair[0] + pair[1]
            scores[e] += line_norms
    return scores


def top_indices(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the `count` largest scores, sorted by index (ties broken by lower index)."""
    if count >= scores.numel():
        return torch.arange(scores.numel())
    return torch.topk(scores, count, sorted=False).indices.sort().values


def resolved_selection(config, has_data: bool) -> str:
    """selection="auto": gradient importance when calibration data is given (usaf train always gives it), else
    magnitude (largest |w|), the best choice that needs no data."""
    if config.selection != "auto":
        return config.selection
    return "gradient" if has_data else "magnitude"


def with_resolved_selection(config, has_data: bool):
    if config.selection != "auto":
        return config
    resolved = copy.copy(config)
    resolved.selection = resolved_selection(config, has_data)
    return resolved


class Chosen(NamedTuple):
    """A selection for one expert tensor: flat indices (axis None) or line ids along `axis`."""

    axis: int | None
    indices: torch.Tensor


def weight_budgets(units: list, config) -> dict[str, int]:
    """Entries per targeted weight tensor from a density or a global budget: in proportion to size, weighed by
    `config.density_ratios` per target (the total is the same whatever the ratios)."""
    sizes = {u.key: u.numel for u in units}
    ratios = {u.key: float(config.density_ratios.get(u.target, 1.0)) for u in units}
    weighed = {k: sizes[k] * ratios[k] for k in sizes}
    if config.num_entries is not None:
        return split_capped(config.num_entries, weighed, sizes)
    if len(set(ratios.values())) <= 1:
        return {k: min(n, max(1, round(config.density * n))) for k, n in sizes.items()}
    return split_capped(round(config.density * sum(sizes.values())), weighed, sizes)


class TensorUnit(NamedTuple):
    key: str
    layer: object  # arch.MoELayer, None beyond the experts
    name: str
    store: object
    numel: int
    target: str = "experts"


def choose(
    layers: list, stores: dict, config, batches=None, model=None, weight_stores: dict | None = None
) -> tuple[dict[str, Chosen], object]:
    """The selection for every expert tensor of the trained `layers` (when "experts" is in `config.targets`) and
    every other targeted weight in `weight_stores` ({"<module path>.weight": (target, store)}), by
    `config.strategy` and `config.selection`, with the calibration it used (None without one). `stores`:
    {experts path: {tensor name: store}}. Data-driven choices run calibration batches through `model` (prepared
    with an empty selection)."""

    if config.strategy == "file":
        return load_selection(config.file), None
    config = with_resolved_selection(config, batches is not None and model is not None)
    train_experts = "experts" in config.targets
    experts = [
        TensorUnit(
            f"{layer.experts_name}.{t.name}",
            layer,
            t.name,
            stores[layer.experts_name][t.name],
            int(torch.Size(stores[layer.experts_name][t.name].shape).numel()),
        )
        for layer in (layers if train_experts else [])
        for t in layer.tensors
        if not t.is_bias
    ]
    weights = [
        TensorUnit(key, None, "weight", store, int(torch.Size(store.shape).numel()), target)
        for key, (target, store) in (weight_stores or {}).items()
    ]
    with_routing = needs_routing(config) and bool(experts)
    with_gradients = needs_gradient(config)
    calibration = None
    if with_routing or with_gradients:
        if batches is None or model is None:
            raise UsafError(
                f"strategy={config.strategy!r} / selection={config.selection!r} needs calibration data: pass "
                "calibration_batches to prepare_model (usaf train does this from the training data)."
            )
        batches = list(itertools.islice(iter(batches), config.calibration_batches))
        calibration = calibrate.calibrate(model, batches, len(batches), with_gradients=with_gradients)

    if config.granularity == "neuron":
        # whole neurons in the experts; the other weights train elements at the same density (or their share of
        # the budget, by size and density_ratios)
        neuron_config = weights_config = config
        if (config.num_entries is not None or config.density_ratios) and weights:
            budgets = weight_budgets(experts + weights, config)
            neuron_config = copy.copy(config)
            neuron_config.num_entries = max(1, sum(budgets[u.key] for u in experts))
            weights_config = copy.copy(config)
            weights_config.num_entries = max(1, sum(budgets[u.key] for u in weights))
        chosen = _choose_neurons(layers, stores, neuron_config, calibration) if train_experts else {}
        if weights:
            chosen.update(_choose_elements(weights, weights_config, calibration, batches, model))
    else:
        chosen = _choose_elements(experts + weights, config, calibration, batches, model)
    if train_experts:
        chosen.update(_choose_biases(layers, stores, config))
    return chosen, calibration


def _domains(weights: list, config, calibration) -> list[tuple[list[TensorUnit], list[int] | None, int]]:
    """(tensors, experts or None for all, entries) per unit of the budget."""
    budgets = weight_budgets(weights, config)
    if config.strategy == "gradient":
        return [(weights, None, sum(budgets.values()))]
    if config.strategy == "uniform":
        return [([u], None, budgets[u.key]) for u in weights]
    units = []  # routing: hot experts get the layer's budget in proportion to their share
    for u in weights:
        if u.layer is None:  # a native weight beyond the experts: no routing to follow
            units.append(([u], None, budgets[u.key]))
            continue
        share = calibration.share(u.layer.experts_name)
        per_expert = u.numel // u.store.shape[0]
        hot = hot_experts(share, config.routing_coverage, budgets[u.key], per_expert)
        counts = split_capped(
            budgets[u.key], {e: float(share[e]) for e in hot}, dict.fromkeys(hot, per_expert)
        )
        units += [([u], [e], n) for e, n in counts.items() if n]
    return units


def _choose_elements(weights, config, calibration, batches, model) -> dict[str, Chosen]:

    picked: dict[str, list[torch.Tensor]] = {u.key: [] for u in weights}
    domains = _domains(weights, config, calibration)
    if needs_gradient(config):
        candidates = _candidate_lines(domains, config, calibration)
        scores = calibrate.probe_lines(model, candidates, batches, len(batches))
        for tensors, experts, count in domains:
            flat_all, score_all, owner = [], [], []
            for u in tensors:
                flat, score = scores[u.key]
                if experts is not None:
                    per_expert = u.numel // u.store.shape[0]
                    keep = torch.isin(flat // per_expert, torch.tensor(experts))
                    flat, score = flat[keep], score[keep]
                flat_all.append(flat)
                score_all.append(score)
                owner += [u.key] * flat.numel()
            flat, score = torch.cat(flat_all), torch.cat(score_all)
            best = top_indices(score, min(count, score.numel()))
            owners = [owner[i] for i in best.tolist()]
            for key in set(owners):
                mask = torch.tensor([o == key for o in owners])
                picked[key].append(flat[best[mask]])
    else:
        for tensors, experts, count in domains:
            (u,) = tensors
            picked[u.key].append(_pick_elements(u, experts, count, config))
    return {
        k: Chosen(None, torch.unique(torch.cat(v)) if v else torch.empty(0, dtype=torch.int64))
        for k, v in picked.items()
    }


def _pick_elements(u: TensorUnit, experts, count: int, config) -> torch.Tensor:
    if experts is None:
        if config.selection == "random":
            return random_flat_indices(u.numel, count, generator_for(config.seed, u.key))
        return magnitude_flat_indices(u.store, count)
    (e,) = experts
    per_expert = u.numel // u.store.shape[0]
    if config.selection == "random":
        local = random_flat_indices(per_expert, count, generator_for(config.seed, f"{u.key}/{e}"))
    else:
        local = top_indices(u.store.materialize([e]).reshape(-1).float().abs().cpu(), count)
    return local + e * per_expert


def _candidate_lines(domains, config, calibration) -> dict[str, tuple[int, torch.Tensor]]:
    """Lines of the neurons with the highest first-order importance: `oversample` x the budget in entries."""
    lines: dict[str, list[torch.Tensor]] = {}
    axes: dict[str, int] = {}
    for tensors, _, count in domains:
        for u in tensors:
            if u.layer is None:  # a native weight: its rows of highest importance (a norm: its one line)
                rows, width = u.store.shape[1:]
                score = calibration.row_score.get(u.key) if calibration is not None else None
                wanted = min(rows, math.ceil(config.oversample * count / width) + 1)
                if score is None or wanted >= rows:
                    lines[u.key] = [torch.arange(rows)]
                else:
                    lines[u.key] = [torch.topk(score, wanted, sorted=False).indices]
                axes[u.key] = 1
    for tensors, experts, count in domains:
        tensors = [u for u in tensors if u.layer is not None]
        if not tensors:
            continue
        layers = {u.layer.experts_name: u.layer for u in tensors}
        pool_scores, pool_ids = [], []
        for path, layer in layers.items():
            score = calibration.neuron_score.get(path)
            if score is None:  # no gradient reached this layer
                score = torch.zeros(layer.num_experts, intermediate_size(layer.experts))
            if experts is not None:
                mask = torch.zeros_like(score, dtype=torch.bool)
                mask[experts] = True
                score = score.masked_fill(~mask, float("-inf"))
            pool_scores.append(score.reshape(-1))
            pool_ids += [(path, i) for i in range(score.numel())]
        per_neuron = max(
            1,
            sum(u.numel for u in tensors)
            // sum(layer.num_experts * intermediate_size(layer.experts) for layer in layers.values()),
        )
        wanted = min(math.ceil(config.oversample * count / per_neuron) + 1, len(pool_ids))
        scores = torch.cat(pool_scores)
        best = torch.topk(scores, wanted, sorted=False).indices.tolist()
        best = [i for i in best if scores[i] > float("-inf")]
        for u in tensors:
            axis = neuron_axes(u.layer.experts)[u.name]
            neurons = torch.tensor(
                [pool_ids[i][1] for i in best if pool_ids[i][0] == u.layer.experts_name], dtype=torch.int64
            )
            ids = neuron_line_ids(u.layer.experts, u.name, neurons, u.store.shape[axis])
            lines.setdefault(u.key, []).append(ids)
            axes[u.key] = axis
    return {key: (axes[key], torch.unique(torch.cat(ids))) for key, ids in lines.items()}


class _NeuronLayer(NamedTuple):
    """One expert layer's neuron facts for _choose_neurons."""

    layer: object
    axes: dict
    size: int  # neurons per expert
    stores: dict
    numel: int  # entries of its gate/up/down tensors
    entries_per_neuron: int


def _choose_neurons(layers, stores, config, calibration) -> dict[str, Chosen]:
    """Whole neurons: budgets per layer (or per hot expert, or global) in neurons, then lines per tensor."""
    per_layer = {}
    for layer in layers:
        axes = neuron_axes(layer.experts)
        size = intermediate_size(layer.experts)
        layer_stores = stores[layer.experts_name]
        numel = sum(int(torch.Size(layer_stores[n].shape).numel()) for n in axes)
        per_layer[layer.experts_name] = _NeuronLayer(
            layer,
            axes,
            size,
            layer_stores,
            numel,
            entries_per_neuron(layer_stores, axes),
        )
    if config.num_entries is not None:
        entry_budget = split_budget(config.num_entries, {k: v.numel for k, v in per_layer.items()})
    else:
        entry_budget = {k: round(config.density * v.numel) for k, v in per_layer.items()}
    neurons = {
        k: min(v.layer.num_experts * v.size, max(1, entry_budget[k] // v.entries_per_neuron))
        for k, v in per_layer.items()
    }

    def score_of(path):
        layer, axes, size, layer_stores, _, _ = per_layer[path]
        if needs_gradient(config):
            return calibration.neuron_score.get(path, torch.zeros(layer.num_experts, size)).cpu()
        if config.selection == "magnitude":
            return magnitude_neuron_scores(layer.experts, layer_stores, axes)
        return torch.rand(layer.num_experts, size, generator=generator_for(config.seed, path))

    chosen_neurons: dict[str, torch.Tensor] = {}
    if config.strategy == "gradient":
        scores = {p: score_of(p).reshape(-1) for p in per_layer}
        flat = torch.cat(list(scores.values()))
        best = top_indices(flat, sum(neurons.values()))
        start = 0
        for path, s in scores.items():
            mine = best[(best >= start) & (best < start + s.numel())] - start
            chosen_neurons[path] = mine
            start += s.numel()
    else:
        for path, (_, _, size, _, _, _) in per_layer.items():
            score = score_of(path)
            if config.strategy == "routing":
                share = calibration.share(path)
                hot = hot_experts(share, config.routing_coverage, neurons[path], size)
                counts = split_capped(
                    neurons[path], {e: float(share[e]) for e in hot}, dict.fromkeys(hot, size)
                )
                picks = [top_indices(score[e], n) + e * size for e, n in counts.items() if n]
                chosen_neurons[path] = (
                    torch.cat(picks).sort().values if picks else torch.empty(0, dtype=torch.int64)
                )
            else:
                chosen_neurons[path] = top_indices(score.reshape(-1), neurons[path])
    chosen = {}
    for path, picked in chosen_neurons.items():
        layer, axes, _, layer_stores, _, _ = per_layer[path]
        for name, axis in axes.items():
            ids = neuron_line_ids(layer.experts, name, picked, layer_stores[name].shape[axis])
            chosen[f"{path}.{name}"] = Chosen(axis, ids)
    return chosen


def _choose_biases(layers, stores, config) -> dict[str, Chosen]:
    chosen = {}
    if not config.train_biases:
        return chosen
    for layer in layers:
        for t in layer.tensors:
            if t.is_bias:
                store = stores[layer.experts_name][t.name]
                numel = store.shape[0] * store.shape[2]
                count = min(numel, max(1, round(config.density * numel)))
                key = f"{layer.experts_name}.{t.name}"
                if config.selection == "random":
                    flat = random_flat_indices(numel, count, generator_for(config.seed, key))
                else:
                    flat = magnitude_flat_indices(store, count)
                chosen[key] = Chosen(None, flat)
    return chosen


# --------------------------------------------------------------------------------------------------------------
# Saved selections: safetensors (indices) + JSON (what they mean and a summary)
# --------------------------------------------------------------------------------------------------------------


def save_selection(path: str | Path, chosen: dict[str, Chosen], summary: dict | None = None) -> None:
    """Write `<path>` (.safetensors) and its `.json` companion, atomically."""
    from safetensors.torch import save_file

    path = Path(path)
    tensors = {key: c.indices.contiguous().cpu() for key, c in chosen.items()}
    meta = {"axes": {key: c.axis for key, c in chosen.items()}, "summary": summary or {}}
    atomic_file(path, lambda tmp: save_file(tensors, str(tmp)))
    atomic_json(path.with_suffix(".json"), meta)


def load_selection(path: str | Path) -> dict[str, Chosen]:
    from safetensors.torch import load_file

    path = Path(path)
    try:
        tensors = load_file(str(path))
        meta = json.loads(path.with_suffix(".json").read_text())
    except (OSError, ValueError) as err:
        raise UsafError(f"Cannot read the selection file {path} (and its .json companion): {err}") from None
    return {key: Chosen(meta["axes"].get(key), t.to(torch.int64)) for key, t in tensors.items()}
