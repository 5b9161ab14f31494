"""The selection across data-parallel ranks: every rank trains rank 0's selection and values.

`prepare_model` ends with `broadcast_trainable`, whoever runs the ranks: usaf's own loop
(`usaf.train.distributed`, which builds on the rank basics here) or torch's DDP under transformers.Trainer and
Accelerate, which `selection_buffers` keeps from broadcasting the selection again before every forward. Under a
launcher the process group must exist before the model is prepared (`check_joined`). It also holds the bucketed
in-place sum (`all_reduce_flat`) that the gradient reducer and the Reselector's statistics share.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from usaf.engine import expert_parallel
from usaf.engine.installed import sparse_modules
from usaf.errors import UsafError
from usaf.kernels.host import read_int, read_ints


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def is_main() -> bool:
    return rank() == 0


def job_expert_count(local: int) -> int:
    """A count of the expert entries this rank trains, made the job's: under expert parallelism it is summed over
    the EP group (every rank of the group must ask, whatever it holds); otherwise `local`."""
    if expert_parallel.layout() is None:
        return local
    summed = torch.tensor([float(local)], dtype=torch.float64)
    summed = expert_parallel.expert_sum(summed, from_every_rank=False)
    # balanced: every rank of the group trains as many
    return read_int(summed.sum(), local * expert_parallel.layout().ep)


def main_first(make):
    """`make()` run by rank 0 while the other ranks wait, then by them (what it leaves in a cache, they find there):
    ranks building one cache entry at once (a prepared store, a tokenized dataset) would race on it. One process:
    just `make()`."""
    if not active():
        return make()
    made = make() if is_main() else None
    dist.barrier()
    return made if is_main() else make()


def comm_device() -> torch.device:
    """Where collectives run: the current CUDA device under NCCL, else the CPU (gloo)."""
    if active() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


BUCKET_BYTES = 64 * 2**20


def buckets(tensors: list[torch.Tensor], limit: int = BUCKET_BYTES) -> list[list[torch.Tensor]]:
    """`tensors` cut into buckets of one dtype and device, each closed once it holds `limit` bytes; buckets in the
    order they were opened (the same on every rank for the same list)."""
    found: list[list[torch.Tensor]] = []
    open_buckets: dict[tuple, tuple[list, list[int]]] = {}  # (dtype, device) -> (bucket, [bytes in it])
    for t in tensors:
        key = (t.dtype, t.device)
        if key not in open_buckets:
            open_buckets[key] = ([], [0])
            found.append(open_buckets[key][0])
        bucket, size = open_buckets[key]
        bucket.append(t)
        size[0] += t.numel() * t.element_size()
        if size[0] >= limit:
            del open_buckets[key]
    return found


def all_reduce_flat(tensors: list[torch.Tensor], limit: int = BUCKET_BYTES, group=None) -> int:
    """Sum `tensors` in place across the ranks of `group` (None: all), bucketed by dtype and device; the bytes
    moved."""
    moved = 0
    for bucket in buckets(tensors, limit):
        flat = torch.cat([b.reshape(-1) for b in bucket])
        dist.all_reduce(flat, group=group)
        moved += flat.numel() * flat.element_size()
        offset = 0
        for b in bucket:
            b.copy_(flat[offset : offset + b.numel()].view_as(b))
            offset += b.numel()
    return moved


def check_joined() -> None:
    """Under a multi-process launch (torchrun or `accelerate launch` set WORLD_SIZE > 1) the process group must
    be up before a model is prepared: `prepare_model` then makes rank 0's selection every rank's. Without it,
    ranks that calibrate differently (nondeterministic GPU kernels) would train different entries under one
    all-reduce."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1 and dist.is_available() and not dist.is_initialized():
        raise UsafError(
            f"prepare_model runs in a job of {world} processes whose process group is not started yet: create "
            "TrainingArguments (or accelerate.PartialState()) before prepare_model, so every rank trains rank 0's "
            "selection."
        )


def _same(chosen: torch.Tensor, selection: torch.Tensor) -> bool:
    """Whether rank 0's selection is this rank's (on the host: the comparison's one read goes through
    usaf.kernels.host, where a simulation answers that the ranks calibrated alike)."""
    if chosen.shape != selection.shape:
        return False
    return not read_int((chosen.cpu() != selection.cpu()).any(), 0)


def selection_buffers(model: torch.nn.Module) -> list[str]:
    """Names of the buffers that hold the selection (indices, base values): identical on every rank once
    `broadcast_trainable` ran, so torch's DDP must not broadcast them again before every forward."""
    own = {id(b) for _, state in sparse_modules(model) for e in state.values() for b in e.buffers()}
    return [name for name, b in model.named_buffers() if id(b) in own]


@torch.no_grad()
def broadcast_trainable(model: torch.nn.Module) -> None:
    """Rank 0's selection, base values and trained values on every rank, then its trainable parameters."""
    if not active():
        return

    comm = comm_device()
    # expert parallelism: each rank trains only its own experts' entries, which differ by rank (and are the same
    # on the replicas of a DP group, chosen from the same global statistics): only the rest is made rank 0's
    experts = expert_parallel.layout() is not None
    for _, state in sparse_modules(model):
        if experts and state.is_expert_stack:
            continue
        for _, entries in state.items():
            selection = getattr(entries, entries.selection_name)
            sizes = torch.tensor(list(selection.shape) + [0] * (3 - selection.dim()), device=comm)
            dist.broadcast(sizes, 0)
            shape = [s for s in read_ints(sizes, list(selection.shape)) if s]
            if is_main():
                chosen = selection.to(comm)
            else:
                chosen = torch.empty(shape, dtype=selection.dtype, device=comm)
            dist.broadcast(chosen, 0)
            differs = torch.tensor([int(not is_main() and not _same(chosen, selection))], device=comm)
            dist.all_reduce(differs, op=dist.ReduceOp.MAX)
            if not read_int(differs, 0):  # (the ranks calibrated alike)
                continue
            # some rank calibrated to another selection (a nondeterministic kernel): rank 0's is taken, with its
            # base and trained values
            values = (
                entries.values.detach()
                if is_main()
                else torch.empty((chosen.shape[0], *entries.values.shape[1:]), dtype=entries.values.dtype)
            ).to(comm)
            dist.broadcast(values, 0)
            base = None
            if entries.keeps_base:
                base = (
                    entries.base_values
                    if is_main()
                    else torch.empty(values.shape, dtype=entries.base_values.dtype)
                ).to(comm)
                dist.broadcast(base, 0)
            if not is_main():
                entries.set_selection(chosen, base, values)
    skip = expert_parallel.expert_parameters(model) if experts else set()
    for param in [p for p in model.parameters() if p.requires_grad and id(p) not in skip]:
        buffer = param.data.to(comm)
        dist.broadcast(buffer, 0)
        param.data.copy_(buffer)
