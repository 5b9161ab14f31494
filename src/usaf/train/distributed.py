"""Data-parallel training on torch.distributed: `torchrun --nproc_per_node=N -m usaf train ...`.

Semantics (issue 13): N processes with accumulation k train exactly what one process with accumulation N*k
trains, up to floating-point reassociation.

- Joining: `init(config)` joins the job only when torchrun's WORLD_SIZE is above 1 (RANK, LOCAL_RANK,
  MASTER_ADDR/PORT from torchrun's environment). The backend is NCCL on CUDA (RCCL on ROCm builds, which torch
  also names "nccl") and gloo on CPU; `train.distributed_backend` or USAF_DISTRIBUTED_BACKEND overrides it.
- Data: every rank walks the same global order (the same seeded `Batches`); an optimizer step takes N*k
  micro-batches from it and rank r trains micro-batches r, r+N, r+2N, ... of them (`StepShare`), so the
  data position after a step is the same on every rank and in a 1-process run with accumulation N*k.
- Loss: each micro-batch's summed loss is divided by the step's supervised tokens over all ranks and the
  auxiliary router loss by the step's N*k micro-batches; the gradients are then summed across ranks, which is
  the 1-process gradient: `GradientReducer` sends each bucket (one dtype, about 64 MiB) as soon as the step's last
  backward has completed its gradients, overlapping the all-reduce with the rest of that backward.
  Only trainable tensors (sparse values, routers) have gradients, so that is all that moves.
- Selection: every rank calibrates on the same (whole) calibration stream, and rank 0's selection and
  trained values are then broadcast (`usaf.selection.across_ranks.broadcast_trainable`, at the end of `prepare_model`),
  so the selection is the 1-process one whatever N; the same module holds the rank basics used here.
- Reselection: its statistics (neuron importance, row scores, probe scores) are sums over micro-batches; rank 0
  keeps the running sum and the other ranks only their share since the last step, and the Reselector's
  `after_backward` sums them, so every rank holds the global statistics and takes the same decisions.
- Router health and auxiliary-loss parts are summed before the step's metrics (RouterTraining.after_step); loss,
  tokens and tokens/s are global (`StepShare.total`). A stop request on any rank stops every rank
  (`StopRequest.agreed`).
- Each of these lives in the component that owns the state (usaf.train.loop holds no collective): this module
  holds joining, the data share and the gradient sum.
- Files: only rank 0 writes (checkpoints, metrics, progress, summary, exports) and only rank 0 prints; every
  rank reads a checkpoint on resume. Resume needs the world size the run was trained with (`check_world_size`,
  from the Checkpointer):
  another one would change the global batch of every later step, so it is refused rather than re-sharded.
- Faults: every collective times out after `distributed.timeout_s` (init_process_group's timeout), so a rank that
  died or hangs stops the job rather than hanging it; `peer_failure` recognises the job's communication failing,
  which the command line says in one line on each rank left (docs/distributed.md, "When a rank dies").
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from usaf.engine import expert_parallel
from usaf.errors import ConfigError, RunStateError, UsafError, first_line
from usaf.selection.across_ranks import (
    BUCKET_BYTES,
    active,
    all_reduce_flat,
    buckets,
    comm_device,
    rank,
    world_size,
)
from usaf.selection.across_ranks import is_main as is_main  # the rank basics, for the train package
from usaf.train.runtime import resolve_device

BACKEND_ENV = "USAF_DISTRIBUTED_BACKEND"
BACKENDS = ("auto", "nccl", "gloo")

# bytes moved by the gradient all-reduce: the latest step's, and the run's total (bench/distributed.py reads them)
traffic = {"last_step_bytes": 0, "total_bytes": 0, "steps": 0}


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0")) if active() else 0


def choose_backend(requested: str | None, device_type: str) -> str:
    """The backend for `device_type`: `requested` (or $USAF_DISTRIBUTED_BACKEND) unless auto; else nccl on CUDA
    and ROCm, gloo on everything else."""
    requested = os.environ.get(BACKEND_ENV) or requested or "auto"
    if requested not in BACKENDS:
        raise ConfigError(
            f"distributed backend {requested!r} is not one of {', '.join(BACKENDS)} "
            f"(train.distributed_backend or ${BACKEND_ENV})."
        )
    if requested != "auto":
        return requested
    return "nccl" if device_type == "cuda" else "gloo"


def _wanted_device_type(name: str) -> str:
    return resolve_device(name).type  # the one resolver of model.device


def init(config) -> bool:
    """Join the torchrun job when WORLD_SIZE > 1 (once; a no-op otherwise). True when data-parallel."""
    check_expert_parallel(config)
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
    backend = choose_backend(config.train.distributed_backend, device_type)
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # bounded: a collective that waits longer for a rank that died or hangs fails (gloo raises; NCCL's watchdog ends
    # the process), so the job stops instead of hanging (see docs/distributed.md, "When a rank dies")
    dist.init_process_group(backend, timeout=timedelta(seconds=config.distributed.timeout_s))
    if dist.get_rank() != 0 and not os.environ.get("USAF_ALL_RANKS_PRINT"):
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process): rank 0 prints
    expert_parallel.join(config.distributed.expert_parallel, timedelta(seconds=config.distributed.timeout_s))
    return True


def leave() -> None:
    """The end of a torchrun job that went well: every rank waits for the others, then the process group is torn
    down, rather than by the interpreter's exit (where gloo's threads, destroyed still joinable, aborted a rank with
    "terminate called without an active exception" after its run had finished)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        expert_parallel.set_layout(None)


def check_expert_parallel(config) -> None:
    """distributed.expert_parallel > 1 needs as many processes (or a multiple): said before anything loads."""
    ep, world = config.distributed.expert_parallel, int(os.environ.get("WORLD_SIZE", "1") or 1)
    if ep > 1 and config.select.reselect_every and config.select.granularity == "neuron":
        raise ConfigError(
            f"select.reselect_every={config.select.reselect_every} with select.granularity=neuron and "
            f"distributed.expert_parallel={ep}: reselecting whole neurons is not available under expert parallelism "
            "yet; set select.granularity=element (the default) or select.reselect_every=0."
        )
    if ep > 1 and world % ep:
        raise ConfigError(
            f"distributed.expert_parallel={ep} splits the experts over {ep} processes, and this job has {world}: "
            f"start it with torchrun --nproc_per_node={ep} -m usaf train ... (or a multiple of {ep} processes)."
        )


# what torch.distributed's backends say when a peer is gone or a collective timed out (they raise RuntimeError)
_PEER_FAILURES = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "processgroup")
_SOURCE_PREFIX = re.compile(r"^\[[^\]]+:\d+\]\s*")  # gloo's "[.../pair.cc:553] " before what it says


def peer_failure(err: BaseException) -> str | None:
    """Under torchrun, when `err` is the job's communication failing (another rank died or stopped answering, so a
    collective raised or timed out): which collective failed, where, and what the backend said, e.g. "all_reduce
    (in usaf.train.stop) failed: Connection closed by peer ..."; None for any other error."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1 or not dist.is_available():
        return None
    # its first sentence: gloo goes on with advice and an emoji
    said = _SOURCE_PREFIX.sub("", first_line(err)).split(". ")[0]
    if not isinstance(err, dist.DistError) and not (
        isinstance(err, RuntimeError) and any(m in said.lower() for m in _PEER_FAILURES)
    ):
        return None
    frames = traceback.extract_tb(err.__traceback__)
    collectives = [f.name for f in frames if f.filename.endswith("distributed_c10d.py")]
    usaf_frames = [f for f in frames if f"{os.sep}usaf{os.sep}" in f.filename]
    where = _module_of(usaf_frames[-1].filename) if usaf_frames else "usaf"
    if collectives:  # the first is the one usaf called (the rest are its internals)
        return f"{collectives[0]} (in {where}) failed: {said}"
    # an asynchronous collective's wait() (the gradient reducer's), or a backend error outside the Python API
    name = usaf_frames[-1].name if usaf_frames else "?"
    return f"a collective waited on in {where}.{name} failed: {said}"


def _module_of(filename: str) -> str:
    parts = filename.removesuffix(".py").split(os.sep)
    return ".".join(parts[len(parts) - 1 - parts[::-1].index("usaf") :])


# A test hook (tests/distributed/test_rank_faults.py): USAF_TEST_DIE_AT_STEP=STEP[@RANK] ends this process (the given
# rank's, else any) as a crashed GPU process ends, no clean-up, when the loop starts optimizer step STEP.
_DIE_AT = os.environ.get("USAF_TEST_DIE_AT_STEP", "")


def die_if_asked(step: int) -> None:
    if not _DIE_AT:
        return
    at, _, on_rank = _DIE_AT.partition("@")
    if int(at) == step and (not on_rank or int(on_rank) == int(os.environ.get("RANK", "0"))):
        os._exit(1)


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
        raise RunStateError(
            f"cannot resume {where}: it was trained with world size {saved} and this job has world size {now}; "
            f"resume with the same number of processes (torchrun --nproc_per_node={saved} ...), since another "
            "would change the global batch of every later step."
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


class StepShare:
    """This rank's share of each optimizer step and the step's totals over all ranks, so the loop asks for a
    step's micro-batches and its sums without knowing how many processes run."""

    def __init__(self, batches, accumulation: int):
        self.batches, self.accumulation = batches, accumulation
        self.micro_batches = global_count(accumulation)  # the step's micro-batches over all ranks

    def take(self) -> list[tuple[dict, list[int]]]:
        return take_micro_batches(self.batches, self.accumulation)

    def total(self, *values: float) -> tuple:
        return sum_scalars(*values)


def sum_scalars(*values: float) -> tuple:
    """Each value summed over the ranks (ints stay ints), always as a tuple: `(total,) = sum_scalars(x)`."""
    if not active():
        return values
    summed = torch.tensor([float(v) for v in values], dtype=torch.float64, device=comm_device())
    dist.all_reduce(summed)
    return tuple(
        round(s) if isinstance(v, int) else float(s) for v, s in zip(values, summed.tolist(), strict=True)
    )


def per_rank(values: list[float]) -> list[list[float]]:
    """Every rank's `values` (the same length on each), in rank order; one process: its own."""
    if not active():
        return [list(values)]
    mine = torch.tensor(values, dtype=torch.float64, device=comm_device())
    found = [torch.empty_like(mine) for _ in range(world_size())]
    dist.all_gather(found, mine)
    return [f.tolist() for f in found]


# ------------------------------------------------------------------------------------------------------ gradients


def all_reduce_gradients(model_or_params, group=None) -> int:
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
    dist.all_reduce(present, group=group)
    grads = []
    for param, anywhere in zip(params, present.tolist(), strict=True):
        if not anywhere:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grads.append(param.grad)
    moved = all_reduce_flat(grads, BUCKET_BYTES, group)
    _count_traffic(moved)
    return moved


def _count_traffic(moved: int) -> None:
    traffic["last_step_bytes"] = moved
    traffic["total_bytes"] += moved
    traffic["steps"] += 1


def gradient_reducer(model: torch.nn.Module):
    """The run's gradient sum across ranks: a GradientReducer under data parallelism, else one that does nothing.
    Under expert parallelism the experts' trained values are complete on their owner after the backward: they are
    summed only over their DP replicas (a second reducer, when there are replicas), the rest over every rank."""
    if not active():
        return LocalGradients()
    ep, params = expert_parallel.layout(), [p for p in model.parameters() if p.requires_grad]
    if ep is None:
        return GradientReducer(params)
    experts = expert_parallel.expert_parameters(model)
    reducers = [GradientReducer([p for p in params if id(p) not in experts])]
    if ep.dp > 1:
        reducers.append(GradientReducer([p for p in params if id(p) in experts], ep.dp_group))
    return ExpertParallelGradients(reducers)


class ExpertParallelGradients:
    """GradientReducer's interface over the reducers of an expert-parallel job, in the same order on every rank;
    it closes each step's all-to-all count too."""

    def __init__(self, reducers: list[GradientReducer]):
        self.reducers = reducers

    def arm(self) -> None:
        for reducer in self.reducers:
            reducer.arm()

    def finish(self) -> int:
        moved = sum(reducer.finish() for reducer in self.reducers)
        expert_parallel.close_step()
        return moved


class LocalGradients:
    """GradientReducer's interface for one process: the gradients are already the step's."""

    def arm(self) -> None:
        pass

    def finish(self) -> int:
        return 0


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

    def __init__(self, params: list[torch.nn.Parameter], group=None):
        self.params, self.group = params, group  # group: the ranks that sum (None: all)
        self.buckets = buckets(self.params[::-1], BUCKET_BYTES)
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
        work = dist.all_reduce(flat, async_op=True, group=self.group)
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
        (stale_ranks,) = sum_scalars(int(stale))
        if stale_ranks:  # some rank's gradient moved after it left: sum again, all ranks together
            # the sent buckets' work handles go now: kept until the process exits, gloo's handle outlived its
            # process group and aborted the process ("terminate called without an active exception")
            self.sent = []
            return all_reduce_gradients(self.params, self.group)
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
