"""Splitting a budget of trained entries exactly: over tensors by size, over experts by routed share."""

from __future__ import annotations

import torch

from usaf.errors import ConfigError


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
        raise ConfigError(
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


def at_density(config, numel: int) -> int:
    """The entries select.density gives a tensor (or layer) of `numel` entries, at least one: the one place the
    density becomes a count (auto reads as the default where no memory plan resolved it)."""
    return min(numel, max(1, round(config.fixed_density * numel)))


def weight_budgets(units: list, config) -> dict[str, int]:
    """Entries per targeted weight tensor from a density or a global budget: in proportion to size, weighed by
    `config.density_ratios` per target (the total is the same whatever the ratios)."""
    sizes = {u.key: u.numel for u in units}
    ratios = {u.key: float(config.density_ratios.get(u.target, 1.0)) for u in units}
    weighed = {k: sizes[k] * ratios[k] for k in sizes}
    if config.num_entries is not None:
        return split_capped(config.num_entries, weighed, sizes)
    if len(set(ratios.values())) <= 1:
        return {k: at_density(config, n) for k, n in sizes.items()}
    return split_capped(at_density(config, sum(sizes.values())), weighed, sizes)


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
        raise ConfigError(
            f"The routing strategy cannot place {needed:,} entries: only {len(chosen)} experts received tokens "
            "in calibration. Lower the budget, calibrate on more data, or use strategy='uniform'."
        )
    return sorted(chosen)


def top_indices(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the `count` largest scores, sorted by index (ties broken by lower index)."""
    if count >= scores.numel():
        return torch.arange(scores.numel())
    return torch.topk(scores, count, sorted=False).indices.sort().values
