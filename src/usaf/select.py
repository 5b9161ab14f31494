"""Choosing which entries to train: budgets per tensor, and random or magnitude selection inside a tensor.

Selection is data (flat indices or line ids per tensor), so later strategies (routing statistics, gradient
importance, a user's file) plug in by producing the same data. Memory stays bounded by one expert matrix plus
the selection itself: nothing here builds a score tensor of a whole stack.
"""

from __future__ import annotations

import zlib

import torch

from .errors import UsafError


def generator_for(seed: int, name: str) -> torch.Generator:
    """A generator seeded by (seed, tensor name): a tensor's selection does not depend on iteration order."""
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))


def split_budget(total: int, weights: dict[str, int]) -> dict[str, int]:
    """Split `total` in proportion to `weights`, exactly (largest remainders), never above a weight."""
    whole = sum(weights.values())
    if total > whole:
        raise UsafError(f"A budget of {total:,} entries exceeds the {whole:,} trainable expert entries.")
    shares = {k: total * w / whole for k, w in weights.items()}
    counts = {k: int(s) for k, s in shares.items()}
    leftover = total - sum(counts.values())
    for k in sorted(shares, key=lambda k: shares[k] - counts[k], reverse=True)[:leftover]:
        counts[k] += 1
    return counts


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
