"""Dynamic reselection (SpIEL/RigL-style): every K steps, drop the trained entries whose values moved least
from the base and grow as many where the task's gradient is largest, with a drop share that decays to zero.
Every target is reselected: the experts' entries (or neurons), and the entries of the other targeted weights.

Decisions (tested in tests/selection/test_reselect.py):
- A dropped entry is reverted to its base value, in the weights the forward uses as well as in every later
  checkpoint and export, so what is evaluated in-run is exactly what resume and export produce. The entries
  dropped are the ones that moved least, so reverting them costs the least.
- Kept entries keep their values and their Adam moments; grown entries start at their original value with zero
  moments; the optimizer's step count (and so its bias correction) is untouched. The `values` parameters keep
  their identity, so the optimizer needs no rebuilding.
- Where to grow: neurons are ranked by first-order importance (h * dL/dh)^2 summed since the last reselection
  (cheap, [E, I] per layer); for element granularity the entries of the best candidate neurons are then scored
  exactly by gradient probes over the last `reselect_probe_steps` steps. The other targets' rows are ranked by
  `SparseWeight.row_score` (a linear layer's sum_t g^2 |x|^2 per output row, an embedding row's squared gradient
  norm) and their best rows probed the same way. Nothing dense is ever scored.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from usaf.engine import expert_parallel
from usaf.engine.installed import row_observers, sparse_experts
from usaf.engine.sparse import LineProbe, line_flat_indices
from usaf.engine.state import model_state
from usaf.errors import ConfigError
from usaf.kernels.host import balanced, read_int, read_ints
from usaf.model.layout import ExpertGeometry, find_moe_layers
from usaf.selection import across_ranks
from usaf.selection.candidates import NeuronImportance, best_neurons, best_rows, lines_wanted


class Reselector:
    def __init__(self, model: torch.nn.Module, config, total_steps: int, optimizer_eight_bit: bool = False):
        if optimizer_eight_bit:
            raise ConfigError(
                "select.reselect_every needs 32-bit optimizer state: set optim.eight_bit=false."
            )
        self.model, self.config, self.total_steps = model, config, total_steps
        self.states = dict(sparse_experts(model))
        # the other targets' weights: entries (never neurons) reselected the same way, rows ranked by
        # SparseWeight.row_score; an output layer tied to the embedding is the embedding's state
        self.weights = row_observers(model)
        self.geometry = {
            layer.experts_name: ExpertGeometry.of(layer.experts) for layer in find_moe_layers(model)
        }
        self.importance = {path: NeuronImportance() for path in self.states}
        for path, state in self.states.items():
            state.observers.append(self.importance[path])
        self.reselections = 0

    # -------------------------------------------------------------------------------------------- schedule
    def fraction(self, step: int) -> float:
        """Share of each tensor's entries replaced at `step`: cosine decay to 0 at `reselect_until`."""
        end = self.config.reselect_until * self.total_steps
        if step >= end:
            return 0.0
        return self.config.reselect_fraction * 0.5 * (1 + math.cos(math.pi * step / end))

    def is_reselection_step(self, step: int) -> bool:
        every = self.config.reselect_every
        return every > 0 and step % every == 0 and self.fraction(step) > 0

    def set_observing(self, active: bool) -> None:
        for importance in self.importance.values():
            importance.active = active
        for state in self.weights.values():
            state.observing = active

    def before_step(self, step: int) -> None:
        """`step` is the optimizer step about to run (1-based): open the probe window before a reselection (from
        the global statistics), then start this rank's share of the step's."""
        self._open_probe_window(step)
        self._clear_rank_share()

    def _open_probe_window(self, step: int) -> None:
        every = self.config.reselect_every
        if every <= 0:
            return
        upcoming = math.ceil(step / every) * every
        window_open = upcoming - step < self.config.reselect_probe_steps
        probing = any(s.probes for s in [*self.states.values(), *self.weights.values()])
        if (
            self.config.granularity == "element"
            and self.is_reselection_step(upcoming)
            and window_open
            and not probing
        ):
            self._install_probes(upcoming)

    def after_step(self, step: int, optimizer: torch.optim.Optimizer) -> dict | None:
        if not self.is_reselection_step(step):
            return None
        fraction = self.fraction(step)
        moved = 0
        for path, state in self.states.items():
            if self.config.granularity == "element":
                for name, entries in list(state.items()):
                    if name in state.probes:
                        moved += self._reselect_elements(state, name, entries, fraction, optimizer)
            else:
                moved += self._reselect_neurons(path, state, fraction, optimizer)
            state.probes.clear()
            self.importance[path].score = None
        for state in self.weights.values():
            if "weight" in state.probes and state.entries is not None:
                moved += self._reselect_elements(state, "weight", state.entries, fraction, optimizer)
            state.probes.clear()
            state.row_score = None
        self.reselections += 1
        return {"reselected_entries": moved, "reselect_fraction": fraction}

    # ------------------------------------------------------------------------------------------- element
    def _install_probes(self, step: int) -> None:
        """Probes on the candidate lines of every tensor (`usaf.selection.candidates`) for the reselection at
        `step`: `oversample` x the entries it will grow. Under expert parallelism the candidates are the job's (from
        the global statistics) and each rank probes those of its own experts: the probes of an expert stack are
        sharded as its entries are (every EP rank holds one for each tensor, empty where it owns no candidate)."""
        fraction, oversample = self.fraction(step), self.config.oversample
        for path, state in self.states.items():
            geometry, score = self.geometry[path], self.importance[path].score
            if score is None:
                continue
            for name, axis in geometry.axes.items():
                entries = state[name] if name in state else None  # noqa: SIM401 (ModuleDict has no .get)
                # the job's (a collective under expert parallelism)
                trained = across_ranks.job_expert_count(0 if entries is None else entries.numel())
                if trained == 0:
                    continue
                store = state.stores[name]
                grow = max(1, round(fraction * trained))
                line_length = geometry.entries_per_line_group(name, store.shape)
                neurons = best_neurons(score, lines_wanted(oversample, grow, line_length, score.numel()))
                lines = geometry.line_ids(name, neurons, store.shape[axis])
                owned, ep = None, expert_parallel.layout()
                if ep is not None:  # of the job's candidates, this rank's experts'
                    owned = ep.owned(store.shape[0])
                    lines = _lines_among(lines, store.shape, axis, owned)
                state.probes[name] = LineProbe(store.shape, axis, lines.to(store.device), owned)
        for state in self.weights.values():
            entries, store = state.entries, state.stores["weight"]
            if entries is None or entries.numel() == 0:
                continue
            rows, width = store.shape[1:]
            if state.kind == "vector":  # a norm: its one line
                lines = torch.zeros(1, dtype=torch.int64)
            elif state.row_score is None:
                continue
            else:
                grow = max(1, round(fraction * entries.numel()))
                lines = best_rows(state.row_score, rows, lines_wanted(oversample, grow, width, rows))
            state.probes["weight"] = LineProbe(store.shape, 1, lines.to(store.device))

    def _reselect_elements(self, state, name, entries, fraction, optimizer) -> int:
        """Drop the `fraction` of the tensor's entries that moved least, grow as many of the best probed
        candidates; the entries replaced. Under expert parallelism an expert stack's decision is the job's: each
        rank holds its experts' entries and candidates (the job's, in rank order, are the one-process order), and
        the job's first `count` of each are found from every rank's own first `count` (`_job_first`); each rank
        applies its share of the drops and grows."""
        probe, store = state.probes[name], state.stores[name]
        flat = entries.flat_indices  # int64, derived: one tensor's transient
        # what dropping an entry changes in the weight the forward reads: back to the kept base on a resident
        # store, to the dequantized base on a quantized one (which keeps no base: it reads it back)
        base = entries.base_values if entries.keeps_base else store.read(flat)
        moved = (entries.values.detach() - base.float()).abs()
        sharded = state.is_expert_stack and expert_parallel.layout() is not None
        candidates = probe.flat_indices()
        # a trained candidate is no entry to grow (a candidate's expert is this rank's: so are its trained entries);
        # scores are sums of magnitudes (>= 0), so -inf ranks after every fresh one
        fresh = ~torch.isin(candidates, flat)
        scores = probe.score.reshape(-1).masked_fill(~fresh, float("-inf"))
        n, available = _job_counts(flat.numel(), fresh, sharded)
        count = min(round(fraction * n), n, available)
        if count == 0:
            return 0
        # ties (entries that never moved, candidates without gradient) broken by position: a total order, so the
        # decision does not hang on how a kernel orders equal values
        drop = _job_first(moved, count, descending=False, sharded=sharded)
        grow = candidates[_job_first(scores, count, descending=True, sharded=sharded)]
        self._replace(state, name, flat, base, drop, grow, optimizer)
        return count

    def _replace(self, state, name, flat, base, drop, grow, optimizer) -> None:
        """The entries at positions `drop` of tensor `name` reverted and replaced by `grow` (flat indices); the
        others keep their values and moments."""
        entries, store = state[name], state.stores[name]
        dropped = torch.zeros(flat.numel(), dtype=torch.uint8, device=flat.device)
        dropped[drop] = 1
        # the kept positions, ascending: their count is known, so no read of the mask (a host sync) is needed
        keep = torch.argsort(dropped, stable=True)[: flat.numel() - drop.numel()]
        del dropped
        if store.resident:  # revert the dropped entries in the weights the forward reads
            store.full().view(-1).index_copy_(0, flat[drop], base[drop].to(store.dtype))
        grow_base = self._original(state, name, store, grow)
        merged = torch.cat([flat[keep], grow])
        order = torch.argsort(merged)
        old_position = torch.cat([keep, torch.full((grow.numel(),), -1, device=merged.device)])[order]
        values = torch.cat([entries.values.detach()[keep], grow_base.float()])[order]
        kept_base = None
        if entries.keeps_base:
            kept_base = torch.cat([base[keep], grow_base.to(base.dtype)])[order]
        del base, flat
        _remap_optimizer_state(optimizer, entries.values, old_position)
        entries.set_selection(merged[order], kept_base, values)

    def _original(self, state, name, store, flat) -> torch.Tensor:
        prepared = model_state(self.model)
        original = prepared.original_values if prepared is not None else None
        path = next(p for p, s in self._all().items() if s is state)
        return original(f"{path}.{name}", flat) if original is not None else store.read(flat)

    # -------------------------------------------------------------------------------------------- neuron
    def _reselect_neurons(self, path, state, fraction, optimizer) -> int:
        geometry = self.geometry[path]
        axes = geometry.axes
        score = self.importance[path].score
        if score is None or any(name not in state for name in axes):
            return 0
        # a neuron's movement: summed |value - base| over its lines in every tensor
        first = next(iter(axes))
        lines_first = state.stores[first].shape[axes[first]]
        neurons = torch.unique(geometry.owners(first, state[first].line_ids, lines_first))
        movement = torch.zeros(neurons.numel(), device=score.device)
        for name in axes:
            e = state[name]
            per_line = (e.values.detach() - e.base_values.float()).abs().sum(1)
            owner = geometry.owners(name, e.line_ids, state.stores[name].shape[axes[name]])
            movement.index_add_(0, torch.searchsorted(neurons, owner), per_line.to(movement.device))
        count = min(round(fraction * neurons.numel()), neurons.numel())
        flat_score = score.reshape(-1).clone()
        flat_score[neurons] = float("-inf")
        count = min(count, int((flat_score > float("-inf")).sum()))
        if count == 0:
            return 0
        drop = neurons[torch.topk(movement, count, largest=False, sorted=False).indices]
        grow = torch.topk(flat_score, count, sorted=False).indices
        new_neurons = torch.cat([neurons[~torch.isin(neurons, drop)], grow]).sort().values
        for name, axis in axes.items():
            e, store = state[name], state.stores[name]
            lines = geometry.line_ids(name, new_neurons, store.shape[axis])
            old = e.line_ids
            kept = torch.isin(lines, old)
            old_position = torch.full_like(lines, -1)
            old_position[kept] = torch.searchsorted(old, lines[kept])
            dropped = ~torch.isin(old, lines)
            if store.resident and dropped.any():
                flat = line_flat_indices(store.shape, axis, old[dropped])
                store.full().view(-1).index_copy_(0, flat, e.base_values[dropped].reshape(-1))
            new_lines = lines[~kept]
            grow_base = self._original(state, name, store, line_flat_indices(store.shape, axis, new_lines))
            grow_base = grow_base.view(new_lines.numel(), -1)
            values = torch.empty(lines.numel(), e.values.shape[1], device=e.values.device)
            base = torch.empty(
                lines.numel(), e.values.shape[1], dtype=e.base_values.dtype, device=e.values.device
            )
            values[kept], base[kept] = (
                e.values.detach()[old_position[kept]],
                e.base_values[old_position[kept]],
            )
            values[~kept], base[~kept] = grow_base.float(), grow_base.to(base.dtype)
            _remap_optimizer_state(optimizer, e.values, old_position)
            e.set_selection(lines, base, values)
        return count * sum(geometry.entries_per_line_group(n, state.stores[n].shape) for n in axes)

    # ------------------------------------------------------------------------------------------ across ranks
    # The statistics are sums over micro-batches: one rank keeps the running sum, the others only their share since
    # the last step, and `after_backward` sums them, so every rank holds the global statistics and takes the same
    # decisions (the 1-process ones). Under expert parallelism an expert stack's probes are an EP rank's share (its
    # experts' candidates): they are summed over its DP group only (the ranks holding the same experts), whose
    # first rank keeps the running sum; the rest (the importance of neurons and rows, other probes) over all ranks.
    def _statistics(self) -> list[tuple[object, str, bool, bool]]:
        """(holder, attribute, kept, sharded) of every summed statistic, in the same order on every rank; `kept`: a
        probe's score, zeroed rather than dropped; `sharded`: an EP rank's share, summed over its DP group."""
        ep = expert_parallel.layout() is not None
        slots: list[tuple[object, str, bool, bool]] = [
            (imp, "score", False, False) for imp in self.importance.values()
        ]
        slots += [(state, "row_score", False, False) for state in self.weights.values()]
        for state in [*self.states.values(), *self.weights.values()]:
            sharded = ep and state.is_expert_stack
            slots += [(state.probes[name], "score", True, sharded) for name in sorted(state.probes)]
        return slots

    def _clear_rank_share(self) -> None:
        """Before a step's micro-batches: the ranks that do not keep a statistic's running sum start it from zero
        (rank 0 keeps it; a sharded probe's, the first rank of its DP group)."""
        if not across_ranks.active():
            return
        ep = expert_parallel.layout()
        for holder, attr, kept, sharded in self._statistics():
            if (ep.dp_rank == 0) if sharded else across_ranks.is_main():
                continue
            value = getattr(holder, attr)
            if value is not None:
                if kept:
                    value.zero_()
                else:
                    setattr(holder, attr, None)

    def after_backward(self) -> None:
        """After a step's backward passes: the statistics summed across ranks (a sharded probe's over its DP
        group). One no rank has stays None; one some ranks lack starts from zeros there."""
        if not across_ranks.active():
            return
        slots = self._statistics()
        # every rank of a DP group holds the same probes, from the same global statistics
        shards = [getattr(h, a) for h, a, _, sharded in slots if sharded and getattr(h, a).numel()]
        ep = expert_parallel.layout()
        if shards and ep.dp > 1:
            across_ranks.all_reduce_flat(shards, group=ep.dp_group)
        slots = [slot for slot in slots if not slot[3]]
        if not slots:
            return
        device = across_ranks.comm_device()
        shapes = torch.zeros(len(slots), 5, dtype=torch.int64, device=device)
        where = None
        for i, (holder, attr, _, _) in enumerate(slots):
            value = getattr(holder, attr)
            if value is not None:
                where = value.device
                shapes[i, 0] = value.dim() + 1
                shapes[i, 1 : 1 + value.dim()] = torch.tensor(value.shape, dtype=torch.int64)
        dist.all_reduce(shapes, op=dist.ReduceOp.MAX)
        # one read a step (a host sync under NCCL); where every rank holds every statistic, its own shapes
        flat = read_ints(shapes.reshape(-1), lambda: _shape_rows(slots))
        rows = [flat[i : i + 5] for i in range(0, len(flat), 5)]
        tensors = []
        for (holder, attr, _, _), row in zip(slots, rows, strict=True):
            if row[0] == 0:
                continue
            if getattr(holder, attr) is None:
                if where is None:
                    where = device if device.type == "cuda" else torch.device("cpu")
                setattr(holder, attr, torch.zeros(row[1 : row[0]], device=where))
            tensors.append(getattr(holder, attr))
        across_ranks.all_reduce_flat(tensors)

    # -------------------------------------------------------------------------------------------- resume
    def _all(self) -> dict:
        return {**self.states, **self.weights}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The statistics every rank holds alike (what rank 0 checkpoints); under expert parallelism without the
        expert stacks' probes, which are each rank's own (`shard_state_dict`)."""
        tensors = {}
        for path, importance in self.importance.items():
            if importance.score is not None:
                tensors[f"importance/{path}"] = importance.score.cpu()
        for path, state in self.weights.items():
            if state.row_score is not None:
                tensors[f"rows/{path}"] = state.row_score.cpu()
        sharded = expert_parallel.layout() is not None
        for path, state in self._all().items():
            if not (sharded and state.is_expert_stack):
                tensors.update(_probe_tensors(path, state))
        return tensors

    def shard_state_dict(self) -> dict[str, torch.Tensor]:
        """Under expert parallelism, this rank's share: the probes of its experts' candidates (what its shard of a
        checkpoint holds; the same keys on every EP rank, in rank order the job's lines); else nothing."""
        if expert_parallel.layout() is None:
            return {}
        tensors = {}
        for path, state in self.states.items():
            tensors.update(_probe_tensors(path, state))
        return tensors

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """`state_dict` and `shard_state_dict` put back. A probe of an expert stack holding lines of experts this
        rank does not own (a checkpoint of another EP size, gathered, or one written before the probes were
        sharded: rank 0 held the job's) keeps its experts' lines."""
        ep = expert_parallel.layout()
        for key, value in tensors.items():
            kind, rest = key.split("/", 1)
            if kind == "importance":
                self.importance[rest].score = value.to(next(iter(self.states[rest].stores.values())).device)
            elif kind == "rows":
                self.weights[rest].row_score = value.to(self.weights[rest].stores["weight"].device)
            elif kind == "probe" and key.endswith("/lines"):
                path, name, _ = rest.rsplit("/", 2)
                state = self._all()[path]
                store = state.stores[name]
                axis = int(tensors[f"probe/{path}/{name}/axis"])
                lines, score, owned = value, tensors[f"probe/{path}/{name}/score"], None
                if ep is not None and state.is_expert_stack:
                    owned = ep.owned(store.shape[0])
                    mine = expert_parallel.owned_mask(store.shape, axis, lines, owned)
                    lines, score = lines[mine], score[mine]
                probe = LineProbe(store.shape, axis, lines.to(store.device), owned)
                probe.score.copy_(score)
                state.probes[name] = probe


def _probe_tensors(path: str, state) -> dict[str, torch.Tensor]:
    """A state's probes as checkpoint tensors: each one's line ids, scores and axis."""
    tensors = {}
    for name, probe in state.probes.items():
        tensors[f"probe/{path}/{name}/lines"] = probe.line_ids.cpu()
        tensors[f"probe/{path}/{name}/score"] = probe.score.cpu()
        tensors[f"probe/{path}/{name}/axis"] = torch.tensor(probe.axis)
    return tensors


def _lines_among(lines: torch.Tensor, shape, axis: int, owned: range) -> torch.Tensor:
    """The line ids (sorted, on the host) of `lines` that lie in the `owned` experts: a slice, since the experts'
    lines are consecutive (two positions read on the host; balanced data spreads them evenly)."""
    per_expert = shape[axis]
    bounds = torch.tensor([owned.start * per_expert, owned.stop * per_expert], dtype=lines.dtype)
    n, experts = lines.numel(), shape[0]
    start, stop = read_ints(
        torch.searchsorted(lines, bounds.to(lines.device)),
        lambda: [n * owned.start // experts, n * owned.stop // experts],
    )
    return lines[start:stop]


def _job_counts(trained: int, fresh: torch.Tensor, sharded: bool) -> tuple[int, int]:
    """(the tensor's trained entries, its candidates not yet trained), the job's: under expert parallelism summed
    over the EP group (one collective); one host read."""
    counts = torch.stack([torch.tensor(trained, dtype=torch.int64, device=fresh.device), fresh.sum()])
    ep = expert_parallel.layout() if sharded else None
    if ep is not None:
        expert_parallel.expert_sum(counts, from_every_rank=False)
    ranks = 1 if ep is None else ep.ep
    n, available = read_ints(counts, lambda: [trained * ranks, fresh.numel() * ranks])
    return n, available


def _job_first(keys: torch.Tensor, count: int, descending: bool, sharded: bool) -> torch.Tensor:
    """Positions in `keys` (1-d) of this rank's share of the job's first `count` keys in key order (ascending, or
    `descending`), ties by position: a total order. `sharded`: the job's keys are every EP rank's, concatenated in
    rank order (the one-process order). Each rank sends only its own first `count` (values): the job's first
    `count` lie among them, and a rank's share of them is a prefix of its own (one gather, one host read)."""
    first = torch.argsort(keys, descending=descending, stable=True)[:count]
    if not sharded:
        return first
    ep = expert_parallel.layout()
    merged, sizes = expert_parallel.gather_ragged(keys[first])
    # a stable sort of the concatenation breaks ties by rank, then by a rank's own order: by position
    picked = torch.argsort(merged, descending=descending, stable=True)[:count]
    start = sum(sizes[: ep.ep_rank])
    mine = read_int(
        ((picked >= start) & (picked < start + first.numel())).sum(),
        lambda: min(first.numel(), balanced(count, ep.ep)[ep.ep_rank]),
    )
    return first[:mine]


def _shape_rows(slots) -> list[int]:
    """`after_backward`'s shape table of this rank's statistics, flat: per slot its dimensions + 1, then its sizes
    (zeros for one this rank lacks)."""
    flat = []
    for holder, attr, *_ in slots:
        value = getattr(holder, attr)
        row = [0] * 5 if value is None else [value.dim() + 1, *value.shape, *[0] * (4 - value.dim())]
        flat += row
    return flat


def _remap_optimizer_state(optimizer, param: torch.nn.Parameter, old_position: torch.Tensor) -> None:
    """Carry per-entry optimizer state to the new selection: kept entries keep theirs, new ones start at zero."""
    state = optimizer.state.get(param)
    if not state:
        return
    kept = old_position >= 0
    for key, value in list(state.items()):
        if isinstance(value, torch.Tensor) and value.shape == param.shape:
            shape = (old_position.numel(), *value.shape[1:])
            if value.shape[0] == 0:  # nothing was kept
                state[key] = torch.zeros(shape, dtype=value.dtype, device=value.device)
                continue
            # a select, not a masked write: no size read from the data
            carried = value[old_position.clamp_min(0)]
            state[key] = torch.where(kept.view(-1, *[1] * (value.dim() - 1)), carried, 0).to(value.dtype)
