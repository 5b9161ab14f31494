"""AdamW whose moments for the sparse values are stored in bfloat16 with stochastic rounding.

Adam's two moments are 8 of the bytes each trained entry costs in fp32. Stored in bf16 they cost 4, but plain
rounding to nearest stalls the second moment: a decay of beta2 = 0.999 changes it by 0.1 % a step, below bf16's
resolution (0.4 %), so after a gradient spike it would never come back down. Rounding stochastically (up with the
probability of the remainder) keeps every moment unbiased. The update itself is computed in fp32 from the
moments before they are rounded, and the rounding noise comes from a generator seeded by the step and the
parameter's position, so a resumed run draws the same noise as an uninterrupted one (nothing extra is saved).

Groups with `compact=False` (the routers: few, dense, sensitive) keep torch's own AdamW, bit for bit.

`decay_to_base` (optim.decay_to_base) is a decoupled decay toward the frozen base instead of toward zero, AdamW's
weight decay with the pretrained weights as its centre (L2-SP): value -= lr x c x (value - base). On the shift
benchmark it kept more of the old domain at the same new-domain loss (bench/results/quality-decay-to-base-*).
"""

from __future__ import annotations

import itertools
import math
import weakref

import torch

from usaf import kernels
from usaf.config import AUTO, RunConfig
from usaf.engine import expert_parallel
from usaf.engine.base_weights import starting_values
from usaf.engine.costs import MOMENT_DTYPES, bucket_limit
from usaf.engine.installed import sparse_modules
from usaf.errors import UsafError
from usaf.kernels.host import read_float
from usaf.model.hf import transformers_scheduler
from usaf.model.layout import find_moe_layers
from usaf.train.objectives import OBJECTIVES

COMPACT_DTYPE = MOMENT_DTYPES["bf16"]
_MOMENTS = ("exp_avg", "exp_avg_sq")


def _flat(tensors: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """`tensors` flattened and joined: into `out` when given (converted to its dtype on the way, one op), else a
    new tensor (no op for one 1-D tensor)."""
    flat = [t if t.dim() == 1 else t.reshape(-1) for t in tensors]  # no view op for the usual 1-D values
    if out is not None:
        return torch.cat(flat, out=out)
    return torch.cat(flat) if len(flat) > 1 else flat[0]


def _shaped(pieces, like: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p if t.dim() == 1 else p.view_as(t) for p, t in zip(pieces, like, strict=True)]


def round_stochastic(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """fp32 -> bf16, rounding up or down with probabilities that make the result unbiased."""
    return round_with_noise(x, _rounding_noise(x.shape, generator, x.device))


def _rounding_noise(shape, generator: torch.Generator, device) -> torch.Tensor:
    return torch.randint(0, 1 << 16, shape, generator=generator, device=device, dtype=torch.int32)


_MIX = (-7046029254386353131, -4658895280553007687, -7723592293110705685)  # splitmix64's, as signed int64


def position_noise(keys: list[int], firsts: list[int], sizes: list[int], device) -> torch.Tensor:
    """int32 in [0, 2^16): for the `sizes[i]` entries of piece i, a hash (splitmix64) of `keys[i]` and each entry's
    position, counted from `firsts[i]`. A fixed number of ops for all the pieces; a function of (key, position)
    alone, so any split of the entries draws the same noise for each."""
    counts = torch.tensor(sizes, device=device)
    offsets = torch.tensor(
        [f - s for f, s in zip(firsts, [0, *itertools.accumulate(sizes)][:-1], strict=True)]
    )
    at = torch.arange(sum(sizes), device=device, dtype=torch.int64)
    at += torch.repeat_interleave(offsets.to(device), counts, output_size=sum(sizes))
    z = (
        at * 0x2545F4914F6CDD1D
        + torch.repeat_interleave(
            torch.tensor(keys, device=device),
            counts,
            output_size=sum(sizes),  # known: no read of its size
        )
        + _MIX[0]
    )
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * _MIX[1]
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * _MIX[2]
    z = z ^ ((z >> 31) & ((1 << 33) - 1))
    return ((z >> 16) & 0xFFFF).to(torch.int32)


def round_with_noise(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """`round_stochastic` with its noise drawn already (int32 in [0, 2^16), x's shape)."""
    bits = (x if x.is_contiguous() else x.contiguous()).view(torch.int32)  # an op only where needed
    noise = noise if noise.shape == bits.shape else noise.view(bits.shape)
    # adding below the 16 kept bits carries into them with the probability of the dropped remainder
    return ((bits + noise) & -65536).view(torch.float32).to(COMPACT_DTYPE)


# how the bf16 moments' stochastic rounding draws its noise (a param group's "rounding_noise", saved with it)
POSITION_NOISE, GENERATOR_NOISE = "position", "generator"


class CompactAdamW(torch.optim.AdamW):
    """torch.optim.AdamW, except that groups marked `compact` keep bf16 moments (see the module docstring)."""

    def __init__(self, params, *, seed: int = 0, base_of=None, sharded=(), **kwargs):
        super().__init__(params, **kwargs)
        self.seed = seed
        # expert parallelism: the parameters whose entries are split over the ranks (the experts' values), in the
        # same order on every rank; their rounding noise is keyed by the entries' one-process positions
        self.sharded = list(sharded)
        # parameter -> the base values at its entries, or None (see `base_lookup`): what `decay_to_base` pulls
        # toward; looked up every step, since reselection replaces a selection's base values
        self.base_of = base_of
        self._host_steps: dict[int, int] = {}  # parameter index -> its step count (see `_next_step`)
        for group in self.param_groups:
            group.setdefault("compact", False)
            group.setdefault("decay_to_base", 0.0)
            group.setdefault("rounding_noise", POSITION_NOISE)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.param_groups
        if self.base_of is not None:  # toward the base before the update (fp32 moments too: plain groups)
            decay_groups(groups, self.base_of)
        plain = [g for g in groups if not g["compact"]]
        if plain:  # torch's own update for these groups: swap the list in for one call
            self.param_groups = plain
            try:
                super().step()
            finally:
                self.param_groups = groups
        pending, index = [], 0
        for group in groups:
            for param in group["params"]:
                if group["compact"] and param.grad is not None:
                    pending.append((param, group, index))
                index += 1
        # where this rank's entries of each sharded parameter start in the one-process order (a collective)
        starts = expert_parallel.entry_offsets(self.sharded) if self.sharded else {}
        for bucket in self._buckets(pending):
            self._compact_update(bucket, starts)
        return loss

    def _buckets(self, pending):
        """Consecutive parameters of one group and one step count, up to `usaf.engine.costs.bucket_limit` values
        together (the planner's bound on the step's temporaries): each bucket is updated as one flat vector, a fixed
        number of ops for many parameters."""
        limit = bucket_limit(max((param.numel() for param, _, _ in pending), default=0))
        bucket, size, key = [], 0, None
        for param, group, index in pending:
            step = self._next_step(param, index)
            if bucket and ((id(group), step) != key or size + param.numel() > limit):
                yield bucket
                bucket, size = [], 0
            bucket.append((param, group, index, step))
            size += param.numel()
            key = (id(group), step)
        if bucket:
            yield bucket

    def _next_step(self, param: torch.Tensor, index: int) -> int:
        """The step `param` is about to take, its state made on its first. A host integer: its CPU tensor is read
        once per parameter after a start or a load, so a step reads no tensor per parameter."""
        if param.grad.is_sparse:
            raise RuntimeError("CompactAdamW does not take sparse gradients.")
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            for name in _MOMENTS:
                state[name] = torch.zeros_like(
                    param, dtype=COMPACT_DTYPE, memory_format=torch.preserve_format
                )
        known = self._host_steps.get(index)
        step = known + 1 if known is not None else int(state["step"].item()) + 1
        self._host_steps[index] = step
        return step

    def _compact_update(self, bucket, starts: dict[int, int]) -> None:
        params = [param for param, _, _, _ in bucket]
        _, group, _, step = bucket[0]
        states = [self.state[param] for param in params]
        torch._foreach_add_([state["step"] for state in states], 1)
        beta1, beta2 = group["betas"]
        lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
        if decay:
            torch._foreach_mul_(params, 1 - lr * decay)
        grad = kernels.cast(_flat([param.grad for param in params]), torch.float32)
        # both moments in one fp32 buffer, each read from its bf16 store by one conversion into its half and
        # rounded back in one pass: the bucket's ops do not double with its two moments
        moments = torch.empty(2 * grad.numel(), dtype=torch.float32, device=grad.device)
        exp_avg, exp_avg_sq = moments.split(grad.numel())
        _flat([state["exp_avg"] for state in states], out=exp_avg).lerp_(grad, 1 - beta1)
        _flat([state["exp_avg_sq"] for state in states], out=exp_avg_sq).mul_(beta2)
        exp_avg_sq.addcmul_(grad, grad, value=1 - beta2)
        del grad
        denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
        sizes = [param.numel() for param in params]
        torch._foreach_addcdiv_(
            params,
            _shaped(exp_avg.split(sizes), params),
            _shaped(denom.split(sizes), params),
            value=-lr / (1 - beta1**step),
        )
        del denom
        stored = [state[name] for name in _MOMENTS for state in states]  # the order of `moments`
        if group["rounding_noise"] == GENERATOR_NOISE:
            noise = self._generator_noise(bucket, step)
        else:
            noise = self._position_noise(bucket, step, sizes, starts, moments.device)
        rounded = round_with_noise(moments, noise)
        torch._foreach_copy_(stored, _shaped(rounded.split(sizes + sizes), stored))

    def _position_noise(self, bucket, step: int, sizes: list[int], starts: dict, device) -> torch.Tensor:
        """Each entry's noise a hash of (seed, the parameter's position, the step, the moment) and the entry's
        position in the one-process order: the same bits whatever the bucket, on resume, and however expert
        parallelism splits a parameter's entries over the ranks."""
        keys, firsts = [], []
        for moment in range(len(_MOMENTS)):
            for param, _, index, _ in bucket:
                keys.append(
                    ((self.seed * 1_000_003 + index * 7_919 + step * 104_729) * 2 + moment) % (1 << 62)
                )
                firsts.append(starts.get(id(param), 0))
        return position_noise(keys, firsts, sizes + sizes, device)

    def _generator_noise(self, bucket, step: int) -> torch.Tensor:
        """usaf 0.1's noise (a run resumed from its checkpoint): each parameter's own generator, seeded by its
        position and the step, drawn for the first moment then the second."""
        noise = {name: [] for name in _MOMENTS}
        for param, _, index, _ in bucket:
            generator = torch.Generator(device=param.device)
            generator.manual_seed((self.seed * 1_000_003 + index * 7_919 + step * 104_729) % (1 << 62))
            for name in _MOMENTS:
                noise[name].append(_rounding_noise(param.shape, generator, param.device))
        return _flat(noise["exp_avg"] + noise["exp_avg_sq"])

    def load_state_dict(self, state_dict) -> None:
        # decay_to_base is the run's setting, not the checkpoint's (a checkpoint of 0.1.x has none)
        decays = [group.get("decay_to_base", 0.0) for group in self.param_groups]
        super().load_state_dict(state_dict)
        for group, decay in zip(self.param_groups, decays, strict=True):
            group["decay_to_base"] = decay
            # a checkpoint of usaf before 0.2's position noise drew its rounding noise from a generator: its run
            # continues with the noise it started with (the checkpoint's scheme, not this version's)
            group.setdefault("rounding_noise", GENERATOR_NOISE)
        self._host_steps = {}
        # torch casts loaded floating-point state to the parameter's dtype: bring compact moments back to bf16
        # (exact: they were bf16 before the cast)
        for group in self.param_groups:
            if group.get("compact"):
                for param in group["params"]:
                    state = self.state.get(param, {})
                    for key in _MOMENTS:
                        if key in state:
                            state[key] = state[key].to(COMPACT_DTYPE)


def peak_lr(config: RunConfig) -> float:
    """optim.lr as a number: auto is the objective's own rate (`Objective.default_lr`)."""
    return OBJECTIVES[config.train.objective].default_lr if config.optim.lr is AUTO else config.optim.lr


def with_peak_lr(config: RunConfig) -> RunConfig:
    """`config` with optim.lr=auto resolved, before the run's config.yaml records it (a resume takes that)."""
    return config.replace({"optim.lr": peak_lr(config)})


def apply_resumed_schedule(optimizer, scheduler, config: RunConfig, saved: dict) -> None:
    """A resume with a new peak lr or length: the schedule's base rates take the new peak and the current rates
    follow the new curve at once (the checkpoint's param groups hold the old ones)."""
    ratio = peak_lr(config) / saved["optim"]["lr"]
    if ratio == 1 and config.schedule.max_steps == saved["schedule"]["max_steps"]:
        return  # unchanged: the restored rates stand, bit for bit
    scheduler.base_lrs = [base * ratio for base in scheduler.base_lrs]
    for group, base, factor in zip(
        optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
    ):
        group["initial_lr"] = base
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def decay_groups(groups: list[dict], base_of) -> None:
    """optim.decay_to_base for every group that asks, on the values that have a gradient (that step)."""
    for group in groups:
        if group.get("decay_to_base"):
            with_grad = [p for p in group["params"] if p.grad is not None]
            decay_toward_base(with_grad, group["lr"] * group["decay_to_base"], base_of)


def decay_toward_base(params: list[torch.Tensor], rate: float, base_of) -> None:
    """value -= rate x (value - centre) for the values whose centre `base_of` knows, in pieces of at most a
    bucket's entries (the temporaries stay the update's); a centre kept in host memory comes to the device one
    piece at a time."""
    pairs = [(p, centre) for p in params if (centre := base_of(p)) is not None]
    limit = bucket_limit(max((p.numel() for p, _ in pairs), default=0))
    start, size = 0, 0
    for end, (param, _) in enumerate(pairs, start=1):
        size += param.numel()
        if end == len(pairs) or size + pairs[end][0].numel() > limit:
            piece = pairs[start:end]
            values = [p for p, _ in piece]
            # a centre in host memory comes over; its dtype is left to the subtraction's promotion (a cast per
            # parameter would be an op each)
            centres = [c if c.device == p.device else c.to(p.device, non_blocking=True) for p, c in piece]
            torch._foreach_add_(values, torch._foreach_sub(values, centres), alpha=-rate)
            start, size = end, 0


def base_lookup(model: torch.nn.Module):
    """values parameter -> the values its entries started from (`usaf.engine.base_weights.starting_values`): what
    optim.decay_to_base pulls toward. A resident store's entries keep them on the device already; a quantized
    store keeps none, so they are read once per selection (the recorded full-precision originals, else the
    dequantized base) and held in host memory, in the store's dtype (the planner's "decay centres" line)."""
    owners = {
        id(entries.values): (path, state, name)
        for path, state in sparse_modules(model)
        for name, entries in state.items()
    }
    held: dict[int, tuple] = {}  # parameter id -> (a reference to the selection it was read for, host values)

    def base_of(param):
        if id(param) not in owners:
            return None
        path, state, name = owners[id(param)]
        entries = state[name]
        if entries.keeps_base:
            return entries.base_values
        selection = entries.stored_selection
        read_for, centre = held.get(id(param), (None, None))
        if read_for is None or read_for() is not selection:  # a new selection (a reselection, a resume)
            centre = starting_values(model, path, state, name).to("cpu")
            if param.device.type == "cuda":
                centre = centre.pin_memory()  # so that the step's copy to the device does not wait
            held[id(param)] = (weakref.ref(selection), centre)
        return centre

    return base_of


def build_optimizer(model: torch.nn.Module, config: RunConfig) -> torch.optim.Optimizer:
    routers = {id(p) for p in router_params(model)}
    values = [p for p in model.parameters() if p.requires_grad and id(p) not in routers]
    compact, lr = config.optim.moments == "bf16", peak_lr(config)
    groups = [
        {
            "params": values,
            "lr": lr,
            "weight_decay": config.optim.weight_decay,
            "compact": compact,
            "decay_to_base": config.optim.decay_to_base,
        }
    ]
    router_list = [p for p in model.parameters() if p.requires_grad and id(p) in routers]
    if router_list:
        groups.append({"params": router_list, "lr": lr * config.router.lr_multiplier, "weight_decay": 0.0})
    kwargs = {"betas": (config.optim.beta1, config.optim.beta2), "eps": config.optim.eps}
    base_of = base_lookup(model) if config.optim.decay_to_base else None
    if config.optim.eight_bit:
        try:
            import bitsandbytes as bnb

            optimizer = bnb.optim.AdamW8bit(groups, **kwargs)
        except (ImportError, RuntimeError) as err:
            raise UsafError(
                f"optim.eight_bit needs bitsandbytes with kernels for this device: {err}"
            ) from None
        if base_of is not None:  # before each update, as CompactAdamW does it
            optimizer.register_step_pre_hook(
                torch.no_grad()(lambda opt, *_: decay_groups(opt.param_groups, base_of))
            )
        return optimizer
    # torch's multi-tensor AdamW for the plain groups (the routers): a fixed number of ops for all of them
    experts = expert_parallel.expert_parameters(model) if expert_parallel.layout() is not None else set()
    sharded = [p for p in model.parameters() if id(p) in experts]
    return CompactAdamW(
        groups, seed=config.train.seed, base_of=base_of, sharded=sharded, foreach=True, **kwargs
    )


def warmup_steps(config: RunConfig) -> int:
    """The warm-up in steps: schedule.warmup_ratio of max_steps (rounded up, as transformers does) when given."""
    schedule = config.schedule
    if schedule.warmup_ratio > 0:
        return math.ceil(schedule.warmup_ratio * schedule.max_steps)
    return schedule.warmup_steps


def schedule_notes(config: RunConfig) -> list[str]:
    """What the first lines say about a schedule that cannot do what it is set to (never silently)."""
    warmup, total = warmup_steps(config), config.schedule.max_steps
    if warmup >= total:
        return [
            f"the warm-up ({warmup} steps) does not end before schedule.max_steps={total}: the learning rate never "
            f"reaches optim.lr; lower schedule.warmup_steps or use schedule.warmup_ratio (e.g. 0.1)"
        ]
    return []


def build_scheduler(optimizer, config: RunConfig):
    """transformers' get_scheduler under schedule.name (a LambdaLR: its factors are what resume adjusts, see
    `apply_resumed_schedule`). usaf's default `cosine` is transformers' cosine_with_min_lr after usaf's own
    warm-up (`_warmed_up`)."""
    schedule = config.schedule
    warmup, total, floor = warmup_steps(config), max(1, schedule.max_steps), schedule.min_lr_ratio
    name = "cosine_with_min_lr" if schedule.name == "cosine" else schedule.name
    extra = {
        "cosine_with_min_lr": {"min_lr_rate": floor},
        "warmup_stable_decay": {
            "num_decay_steps": round(schedule.decay_ratio * total),
            "min_lr_ratio": floor,
        },
    }.get(name)
    scheduler = transformers_scheduler(name, optimizer, warmup, total, extra)
    if schedule.name != "cosine":
        return scheduler
    # a second LambdaLR over the same groups: their initial_lr (the peak) stands, their lr is set anew
    factors = [_warmed_up(decay, warmup, total) for decay in scheduler.lr_lambdas]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factors)


def _warmed_up(decay, warmup: int, total: int):
    """A decay's factors after usaf's warm-up, (step + 1) / (warmup + 1): its first step trains at a share of the
    peak where transformers' warm-up starts at 0 (a step that trains nothing), as usaf's cosine always has, so
    that a run saved before resumes on the same rates (after the warm-up they are transformers' own, bit for bit);
    held at the floor once the decay has ended, where transformers' cosine would rise again (a resume that
    shortened the run; a warm-up as long as the run)."""
    end = max(total, warmup + 1)  # where transformers' decay reaches its floor

    def factor(step: int) -> float:
        return (step + 1) / (warmup + 1) if step < warmup else decay(min(step, end))

    return factor


def router_params(model) -> list[torch.nn.Parameter]:
    return [
        p
        for layer in find_moe_layers(model)
        if layer.router is not None
        for p in layer.router.parameters()
        if p.requires_grad
    ]


def clip_gradients(model, max_norm: float) -> float:
    """Clip the gradients to `max_norm` (0: do not) by their norm over the whole model; the norm."""
    params = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
    if expert_parallel.layout() is not None:
        return _clip_expert_parallel(model, params, max_norm)
    if not params:
        return 0.0
    # the step's one read of its gradients (the skip policy needs the norm on the host)
    if max_norm and max_norm > 0:
        return read_float(torch.nn.utils.clip_grad_norm_(params, max_norm, error_if_nonfinite=False), 1.0)
    return read_float(
        torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params])), 1.0
    )


def _clip_expert_parallel(model, params: list, max_norm: float) -> float:
    """Expert parallelism: a rank holds only its experts' gradients, so their squared norm is summed over the EP
    group (the rest is the same on every rank): the norm and the clipping one process would compute."""
    experts = expert_parallel.expert_parameters(model)
    squares = torch.zeros(2, dtype=torch.float32)  # [experts, the rest]
    if params:  # each gradient's norm, read from the device at once
        at = params[0].grad.device
        norms = torch.stack([torch.linalg.vector_norm(p.grad.float()).to(at) for p in params]).cpu()
        for p, norm in zip(params, norms, strict=True):
            squares[0 if id(p) in experts else 1] += norm.pow(2)
    squares[0] = expert_parallel.expert_sum(squares[:1], from_every_rank=False)[0]
    norm = read_float(squares.sum().sqrt(), 1.0)  # on the host: the norms came in one read
    if max_norm and max_norm > 0 and norm > max_norm and math.isfinite(norm):
        for p in params:
            p.grad.mul_(max_norm / (norm + 1e-6))
    return norm
