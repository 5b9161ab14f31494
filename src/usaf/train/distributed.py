"""Data-parallel training on torch.distributed: `torchrun --nproc_per_node=N -m usaf train ...`.

Semantics (issue 13): N processes with accumulation k train exactly what one process with accumulation N*k
trains, up to floating-point reassociation.

- Joining: `init(config)` joins the job only when torchrun's WORLD_SIZE is above 1 (RANK, LOCAL_RANK,
  MASTER_ADDR/PORT from torchrun's environment). The backend is NCCL on CUDA (RCCL on ROCm builds, which torch
  also names "nccl") and gloo on CPU; `train.distributed_backend` or USAF_DISTRIBUTED_BACKEND overrides it.
- Data: every rank walks the same global order (the same seeded `Batches`); an optimizer step takes N*k
  micro-batches from it and rank r trains micro-batches r, r+N, r+2N, ... of them (`take_micro_batches`), so the
  data position after a step is the same on every rank and in a 1-process run with accumulation N*k.
- Loss: each micro-batch's summed loss is divided by the step's supervised tokens over all ranks and the
  auxiliary router loss by the step's N*k micro-batches; the gradients are then summed across ranks, which is
  the 1-process gradient: `GradientReducer` sends each bucket (one dtype, about 64 MiB) as soon as the step's last
  backward has completed its gradients, overlapping the all-reduce with the rest of that backward.
  Only trainable tensors (sparse values, routers) have gradients, so that is all that moves.
- Selection: every rank calibrates on the same (whole) calibration stream, and rank 0's selection and
  trained values are then broadcast (`usaf.selection.ranks.broadcast_trainable`, at the end of `prepare_model`),
  so the selection is the 1-process one whatever N; the same module holds the rank basics used here.
- Reselection: its statistics (neuron importance, row scores, probe scores) are sums over micro-batches; rank 0
  keeps the running sum and the other ranks only their share since the last step (`before_step` clears it),
  and `after_backward` sums them, so every rank holds the global statistics and takes the same decisions.
- Router health and auxiliary-loss parts are summed before the step's metrics (`reduce_router_stats`); loss,
  tokens and tokens/s are global (`sum_scalars`). A stop request on any rank stops every rank (`agree_stop`).
- Files: only rank 0 writes (checkpoints, metrics, progress, summary, exports) and only rank 0 prints; every
  rank reads a checkpoint on resume. Resume needs the world size the run was trained with (`check_world_size`):
  another one would change the global batch of every later step, so it is refused rather than re-sharded.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed as dist

from usaf.errors import UsafError
from usaf.selection.ranks import active, comm_device, is_main, rank, world_size

BACKEND_ENV = "USAF_DISTRIBUTED_BACKEND"
BACKENDS = ("auto", "nccl", "gloo")
BUCKET_BYTES = 64 * 2**20

# bytes moved by the gradient all-reduce: the latest step's, and the run's total (bench/distributed.py reads them)
traffic = {"last_step_bytes": 0, "total_bytes": 0, "steps": 0}


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0")) if active() else 0


def choose_backend(requested: str | None, device_type: str) -> str:
    """The backend for `device_type`: `requested` (or $USAF_DISTRIBUTED_BACKEND) unless auto; else nccl on CUDA
    and ROCm, gloo on everything else."""
    requested = os.environ.get(BACKEND_ENV) or requested or "auto"
    if requested not in BACKENDS:
        raise UsafError(
            f"distributed backend {requested!r} is not one of {', '.join(BACKENDS)} "
            f"(train.distributed_backend or ${BACKEND_ENV})."
        )
    if requested != "auto":
        return requested
    return "nccl" if device_type == "cuda" else "gloo"


def _wanted_device_type(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name).type


def init(config) -> bool:
    """Join the torchrun job when WORLD_SIZE > 1 (once; a no-op otherwise). True when data-parallel."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1 or not dist.is_available():
        return False
    if dist.is_initialized():
        return active()
    missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
    if missing:
        raise UsafError(
            f"WORLD_SIZE={world} but {', '.join(missing)} unset: start data-parallel runs with "
            "torchrun --nproc_per_node=N -m usaf train ..."
        )
    device_type = _wanted_device_type(config.model.device)
    backend = choose_backend(getattr(config.train, "distributed_backend", "auto"), device_type)
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    if dist.get_rank() != 0 and not os.environ.get("USAF_ALL_RANKS_PRINT"):
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process): rank 0 prints
    return True


def local_device(device: torch.device) -> torch.device:
    """This rank's device: cuda -> cuda:LOCAL_RANK under data parallelism."""
    if active() and device.type == "cuda":
        return torch.device("cuda", local_rank())
    return device


# ------------------------------------------------------------------------------------------------------ checks


def check_world_size(saved: int | None, where) -> None:
    """Refuse a resume with another world size than the checkpoint's (None: a checkpoint from before, 1)."""
    saved, now = int(saved or 1), world_size()
    if saved != now:
        raise UsafError(
            f"cannot resume {where}: it was trained with world size {saved} and this job has world size {now}; "
            f"resume with the same number of processes (torchrun --nproc_per_node={saved} ...), since another "
            "would change the global batch of every later step."
        )


def check_supported(config) -> None:
    """What data-parallel training does not do yet."""
    if active() and config.train.prefix_cache != "off":
        raise UsafError(
            "train.prefix_cache is not supported with more than one process yet; set train.prefix_cache=off."
        )


# ------------------------------------------------------------------------------------------------------ data


def take_micro_batches(batches, accumulation: int) -> list[tuple[dict, list[int]]]:
    """This rank's micro-batches of one optimizer step, with their dataset rows: micro-batches r, r+N, ... of the
    step's N*accumulation from the one global order (every rank advances `batches` by all of them)."""
    world, me = world_size(), rank()
    taken = []
    for index in range(world * accumulation):
        batch = next(batches)
        if index % world == me:
            taken.append((batch, list(batches.last_indices)))
    return taken


def global_count(local: int) -> int:
    """Micro-batches of a step over all ranks (every rank has the same number)."""
    return local * world_size()


def sum_scalars(*values):
    """Each value summed over the ranks (ints stay ints)."""
    if not active():
        return values if len(values) > 1 else values[0]
    summed = torch.tensor([float(v) for v in values], dtype=torch.float64, device=comm_device())
    dist.all_reduce(summed)
    out = tuple(
        round(s) if isinstance(v, int) else float(s) for v, s in zip(values, summed.tolist(), strict=True)
    )
    return out if len(out) > 1 else out[0]


# ------------------------------------------------------------------------------------------------------ gradients


def _buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` cut into buckets of one dtype and device, each closed once it holds BUCKET_BYTES; buckets in the
    order they were opened (the same on every rank for the same list)."""
    buckets: list[list[torch.Tensor]] = []
    open_buckets: dict[tuple, tuple[list, list[int]]] = {}  # (dtype, device) -> (bucket, [bytes in it])
    for t in tensors:
        key = (t.dtype, t.device)
        if key not in open_buckets:
            open_buckets[key] = ([], [0])
            buckets.append(open_buckets[key][0])
        bucket, size = open_buckets[key]
        bucket.append(t)
        size[0] += t.numel() * t.element_size()
        if size[0] >= BUCKET_BYTES:
            del open_buckets[key]
    return buckets


def _all_reduce_flat(tensors: list[torch.Tensor]) -> int:
    """Sum `tensors` in place across ranks, bucketed by dtype and device; the bytes moved."""
    moved = 0
    for bucket in _buckets(tensors):
        flat = torch.cat([b.reshape(-1) for b in bucket])
        dist.all_reduce(flat)
        moved += flat.numel() * flat.element_size()
        offset = 0
        for b in bucket:
            b.copy_(flat[offset : offset + b.numel()].view_as(b))
            offset += b.numel()
    return moved


def all_reduce_gradients(model_or_params) -> int:
    """Sum the gradients of the trainable parameters across ranks after the backward (a parameter without a
    gradient on every rank keeps none, as in one process); `GradientReducer` does it overlapped. The bytes of
    gradient moved."""
    if not active():
        return 0
    if isinstance(model_or_params, torch.nn.Module):
        params = [p for p in model_or_params.parameters() if p.requires_grad]
    else:
        params = list(model_or_params)
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=comm_device())
    dist.all_reduce(present)
    grads = []
    for param, anywhere in zip(params, present.tolist(), strict=True):
        if not anywhere:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grads.append(param.grad)
    moved = _all_reduce_flat(grads)
    _count_traffic(moved)
    return moved


def _count_traffic(moved: int) -> None:
    traffic["last_step_bytes"] = moved
    traffic["total_bytes"] += moved
    traffic["steps"] += 1


class GradientReducer:
    """Sums the trainable gradients across ranks while the step's last backward is still running, as DDP does.

    The parameters are cut into buckets (one dtype and device, about BUCKET_BYTES, in reverse order of definition:
    roughly the order backward completes them). Once `arm()` is called before the last backward, a parameter's
    post-accumulate-grad hook marks it done, and every bucket whose gradients are all done starts its all-reduce
    (async), buckets always in the same order on every rank, so the collectives match. `finish()` starts the
    buckets left (parameters no hook reached: unused on this rank), waits, and writes the sums back. Each bucket
    carries a presence flag per parameter, so a parameter with no gradient on any rank keeps none, as in one
    process. A gradient changed after its bucket left (nothing in usaf does that) makes every rank redo the whole
    sum synchronously, so the result never depends on the overlap."""

    def __init__(self, model: torch.nn.Module):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buckets = _buckets(self.params[::-1])
        self.bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.armed = False
        self.hooks = [p.register_post_accumulate_grad_hook(self._done) for p in self.params]

    def arm(self) -> None:
        """Before the step's last backward: from now on a completed gradient may leave."""
        self.armed = True
        self.done: list[set[int]] = [set() for _ in self.buckets]
        self.sent: list[tuple[torch.Tensor, object, list]] = []  # (flat, work, [(grad, version) per param])

    def _done(self, param: torch.nn.Parameter) -> None:
        if not self.armed:
            return
        self.done[self.bucket_of[id(param)]].add(id(param))
        while len(self.sent) < len(self.buckets) and len(self.done[len(self.sent)]) == len(
            self.buckets[len(self.sent)]
        ):
            self._send(len(self.sent))

    def _send(self, index: int) -> None:
        bucket = self.buckets[index]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
        flags = torch.tensor(
            [p.grad is not None for p in bucket], dtype=bucket[0].dtype, device=grads[0].device
        )
        flat = torch.cat([*(g.reshape(-1) for g in grads), flags]).to(comm_device())
        work = dist.all_reduce(flat, async_op=True)
        self.sent.append(
            (flat, work, [(p.grad, p.grad._version if p.grad is not None else -1) for p in bucket])
        )

    def finish(self) -> int:
        """Send what is left, wait, write the sums back; the bytes moved."""
        while len(self.sent) < len(self.buckets):
            self._send(len(self.sent))
        self.armed = False
        for _, work, _ in self.sent:
            work.wait()
        stale = any(
            p.grad is not grad or (grad is not None and grad._version != version)
            for bucket, (_, _, recorded) in zip(self.buckets, self.sent, strict=True)
            for p, (grad, version) in zip(bucket, recorded, strict=True)
        )
        if sum_scalars(int(stale)):  # some rank's gradient moved after it left: sum again, all ranks together
            return all_reduce_gradients(self.params)
        moved = 0
        for bucket, (flat, _, _) in zip(self.buckets, self.sent, strict=True):
            moved += flat.numel() * flat.element_size()
            offset, flags = 0, flat[-len(bucket) :]
            for param, present in zip(bucket, flags.tolist(), strict=True):
                summed = flat[offset : offset + param.numel()].view_as(param)
                offset += param.numel()
                if not present:
                    param.grad = None
                elif param.grad is None:
                    param.grad = summed.to(param.device).clone()
                else:
                    param.grad.copy_(summed)
        _count_traffic(moved)
        self.sent = []
        return moved


# ------------------------------------------------------------------------------------------------------ reselection


def _reselection_slots(reselector, with_keep: bool = False) -> list[tuple]:
    """(holder, attribute) of every statistic reselection sums over micro-batches, in the same order on every rank;
    `with_keep` adds whether the holder keeps its tensor (a probe's score: zeroed, never dropped)."""
    slots: list[tuple[object, str, bool]] = [(imp, "score", False) for imp in reselector.importance.values()]
    slots += [(state, "row_score", False) for state in reselector.weights.values()]
    for state in [*reselector.states.values(), *reselector.weights.values()]:
        slots += [(state.probes[name], "score", True) for name in sorted(state.probes)]
    return slots if with_keep else [(holder, attr) for holder, attr, _ in slots]


def before_step(reselector) -> None:
    """Before a step's micro-batches: ranks other than 0 start their reselection statistics from zero (rank 0 holds
    the global running sum), so that `after_backward`'s sum is the global one."""
    if not active() or reselector is None or is_main():
        return
    for holder, attr, keep in _reselection_slots(reselector, with_keep=True):
        value = getattr(holder, attr)
        if value is not None:
            if keep:
                value.zero_()
            else:
                setattr(holder, attr, None)


def sync_reselection(reselector) -> None:
    """Sum the reselection statistics across ranks (after `before_step`'s clearing): every rank holds the global
    ones. A statistic no rank has stays None; one some ranks lack starts from zeros there."""
    if not active() or reselector is None:
        return
    device = comm_device()
    slots = _reselection_slots(reselector)
    if not slots:
        return
    shapes = torch.zeros(len(slots), 5, dtype=torch.int64, device=device)
    where = None
    for i, (holder, attr) in enumerate(slots):
        value = getattr(holder, attr)
        if value is not None:
            where = value.device
            shapes[i, 0] = value.dim() + 1
            shapes[i, 1 : 1 + value.dim()] = torch.tensor(value.shape, dtype=torch.int64)
    dist.all_reduce(shapes, op=dist.ReduceOp.MAX)
    tensors = []
    for (holder, attr), row in zip(slots, shapes.tolist(), strict=True):
        if row[0] == 0:
            continue
        if getattr(holder, attr) is None:
            if where is None:
                where = comm_device() if device.type == "cuda" else torch.device("cpu")
            setattr(holder, attr, torch.zeros(row[1 : row[0]], device=where))
        tensors.append(getattr(holder, attr))
    _all_reduce_flat(tensors)


def after_backward(reducer: GradientReducer | None, reselector=None) -> None:
    """After a step's backward passes: gradients and reselection statistics summed over the ranks."""
    if reducer is not None:
        reducer.finish()
    sync_reselection(reselector)


# ------------------------------------------------------------------------------------------------------ routers


def reduce_router_stats(routers) -> None:
    """Sum this step's routed counts and auxiliary-loss parts across ranks before the step's metrics."""
    if not active():
        return
    health = routers.health
    pending = health.pending.to(comm_device())
    dist.all_reduce(pending)
    health.pending = pending.to(health.pending.device)
    keys = sorted(routers.parts)
    if keys:
        parts = torch.stack([torch.as_tensor(routers.parts[k]).float().reshape(()) for k in keys])
        device = parts.device
        parts = parts.to(comm_device())
        dist.all_reduce(parts)
        routers.parts = dict(zip(keys, parts.to(device).unbind(0), strict=True))


# ------------------------------------------------------------------------------------------------------ selection


def agree_stop(stop) -> bool:
    """Whether any rank was asked to stop (SIGINT/SIGTERM); every rank then stops after the same step."""
    if not active():
        return stop.requested
    flag = torch.tensor([int(stop.requested)], device=comm_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() and not stop.requested:
        stop.requested, stop.signal_name, stop.signal_number = True, "SIGTERM (another rank)", signal.SIGTERM
    return bool(flag.item())


class NullLog:
    """MetricsLog's interface for ranks other than 0: nothing written, nothing shown."""

    def __init__(self, *args, **kwargs):
        pass

    def log(self, *args, **kwargs) -> None:
        pass

    def message(self, *args, **kwargs) -> None:
        pass

    def advance(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass
