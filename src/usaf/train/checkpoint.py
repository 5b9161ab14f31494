"""Atomic checkpoints of a run: trained entries, routers, optimizer, scheduler, RNG, data position, config.

Layout: RUN_DIR/checkpoints/step-00000010/{trainable,optimizer,rng}.safetensors + state.json. A checkpoint is
written into a temporary folder, every file fsynced, and renamed into place: a folder named step-* is always
complete. Only safetensors and JSON: nothing is unpickled on resume. state.json records the sha256 of every other
file ("files") and state.sha256, written last, the sha256 of state.json itself (its data position, counters and
config are run state too); loading verifies them all, so a damaged or truncated file is named as such.

Under expert parallelism (`usaf.engine.expert_parallel.layout()`) the entries of expert tensors, and their
optimizer state, live only on the ranks owning their experts: every EP rank of DP group 0 writes its shard
(TRAINABLE_SHARD_FILE, OPTIMIZER_SHARD_FILE, and EXTRA_SHARD_FILE: its components' own tensors, the reselector's
probes of its experts) into rank 0's temporary folder, rank 0 writes the replicated rest as
above and, once every shard is there (a barrier), records them in state.json ("expert_parallel": the EP size, each
shard's files and experts, the optimizer index of each expert tensor) with their sha256, and renames the folder into
place. Indices stay global, so a reader gathers the shards by concatenation (a single-process export) or keeps the
entries of the experts a rank owns (a resume, at the same EP size or another: re-sharded).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from usaf.engine import expert_parallel
from usaf.engine.expert_parallel import ExpertLayout, owned_mask
from usaf.engine.installed import sparse_experts, sparse_modules
from usaf.errors import ConfigError, RunStateError, UsafError
from usaf.files import (
    EXTRA_FILE,
    EXTRA_SHARD_FILE,
    OPTIMIZER_FILE,
    OPTIMIZER_SHARD_FILE,
    RNG_FILE,
    STATE_FILE,
    STATE_SUM_FILE,
    TRAINABLE_FILE,
    TRAINABLE_SHARD_FILE,
)
from usaf.io.atomic import atomic_dir, atomic_file, fsync_file, make_shareable, remove_dead_writers
from usaf.io.guard import inside
from usaf.selection.across_ranks import comm_device
from usaf.train import distributed
from usaf.version import __version__

PREFIX = "step-"
_STEP_NAME = re.compile(r"step-(\d+)")
TENSOR_FILES = (TRAINABLE_FILE, OPTIMIZER_FILE, RNG_FILE, EXTRA_FILE)
# state.json's copy of the run's settings as its config.yaml states them: what a resume compares config.yaml and
# its command line with
RUN_CONFIG_KEY = "run_config"
# a nested optimizer state (bitsandbytes' 8-bit state keeps its tensors in one dict per parameter) is flattened to
# "INDEX.OUTER/INNER": torch's own state names never hold a "/"
_NESTED = "/"
# state.json's record of an expert-parallel checkpoint's shards
EXPERT_PARALLEL_KEY = "expert_parallel"
# state.json's record of the run's best evaluation so far (usaf.train.best): its step, value, and whether its
# checkpoint is kept (checkpoint.keep_best)
BEST_KEY = "best_evaluation"


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    folder = checkpoints_dir(run_dir)
    if not folder.is_dir():
        return []
    found = [  # step-NNN folders only: anything else there (step-foo, a user's copy) is not a checkpoint
        p
        for p in folder.iterdir()
        if _STEP_NAME.fullmatch(p.name) and p.is_dir() and (p / STATE_FILE).exists()
    ]
    return sorted(found, key=step_of)


def step_of(path: Path) -> int:
    """The step of a checkpoint folder: step-00000020 -> 20."""
    return int(Path(path).name[len(PREFIX) :])


def folder_name(step: int) -> str:
    """The name of step `step`'s checkpoint folder: 20 -> step-00000020."""
    return f"{PREFIX}{step:08d}"


def latest(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def best(run_dir: Path) -> Path:
    """The checkpoint of the run's best evaluation (checkpoint.keep_best), as its latest checkpoint records it."""
    run_dir = Path(run_dir)
    newest = latest(run_dir)
    if newest is None:
        raise RunStateError(
            f"{run_dir} has no finished checkpoint (checkpoints/step-*/state.json): train it first, or resume it "
            "with `usaf train --resume` until it saves one."
        )
    record = read_state(newest).get(BEST_KEY) or {}
    if not record.get("kept") or record.get("step") is None:
        raise RunStateError(
            f"{run_dir} kept no best checkpoint ({newest.name} records none): train with --set "
            "checkpoint.keep_best=true and log.eval_every_steps=N (the best is chosen among those evaluations)."
        )
    found = checkpoints_dir(run_dir) / folder_name(int(record["step"]))
    if not (found / STATE_FILE).is_file():
        raise RunStateError(
            f"the best checkpoint of {run_dir}, {found.name}, is missing (removed by hand?); export the latest "
            "checkpoint instead (without --best)."
        )
    return found


def trainable_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter plus the sparse selection (indices and base values) it belongs to."""
    tensors = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
    for path, state in sparse_modules(model):
        for tensor_name, entries in state.items():
            for buffer_name, buffer in entries.saved_tensors().items():
                tensors[f"{path}.usaf.{tensor_name}.{buffer_name}"] = buffer
    return tensors


def selection_layout(model: torch.nn.Module) -> dict[str, dict]:
    """How to read each selection in `trainable_tensors`: element flat indices, or whole lines along an axis
    of the [E, A, B] tensor (the tensor's name in the model is the key without `.usaf`)."""
    layout = {}
    for path, state in sparse_modules(model):
        for tensor_name, entries in state.items():
            layout[f"{path}.{tensor_name}"] = {
                "kind": "lines" if hasattr(entries, "axis") else "elements",
                "axis": getattr(entries, "axis", None),
                "shape": list(entries.shape),
                "prefix": f"{path}.usaf.{tensor_name}.",
            }
    return layout


def _written(path: Path, write) -> None:
    write(path)
    make_shareable(path)
    fsync_file(path)


def save(
    run_dir: Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    state: dict,
    keep_last: int,
    extra_tensors: dict[str, torch.Tensor] | None = None,
    expert_layout: ExpertLayout | None = None,
    spare: int | None = None,
    shard_tensors: dict[str, torch.Tensor] | None = None,
) -> Path | None:
    """Write checkpoint `step` atomically and keep the newest `keep_last`, and checkpoint `spare` (the best, a
    whole folder: its expert-parallel shards are in it). Under expert parallelism
    (`expert_layout`) every rank calls it: rank 0 writes the checkpoint, the other ranks their shards into it (or
    nothing: DP groups past the first) and get None; `shard_tensors`: the components' tensors of this rank's own
    (its shard's; `extra_tensors` are rank 0's, replicated)."""
    folder = checkpoints_dir(run_dir)
    final = folder / folder_name(step)
    if expert_layout is not None and not distributed.is_main():
        tmp = folder / f".tmp-{final.name}-{_writer_pid()}"
        if expert_layout.dp_rank == 0:
            write_shard(tmp, model, optimizer, expert_layout, shard_tensors=shard_tensors)
        _shards_written()
        return None
    folder.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(folder)
    # a full disk, a second Ctrl-C: nothing half-written stays behind
    with atomic_dir(final, tmp=folder / f".tmp-{final.name}-{os.getpid()}") as tmp:
        shards, flat = None, None
        if expert_layout is not None:
            _writer_pid()  # the folder exists: the other ranks may write into it
            flat = _flatten_optimizer(optimizer)  # once: its shard's part here, the replicated rest in _write
            write_shard(tmp, model, optimizer, expert_layout, flat[0], shard_tensors)
            _shards_written()
            shards = shard_record(tmp, model, optimizer, expert_layout)
        _write(
            tmp, model, flat or _flatten_optimizer(optimizer), scheduler, state, step, extra_tensors, shards
        )
    for old in list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
        if step_of(old) != spare:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _writer_pid() -> int:
    """Rank 0's process id, which names the temporary folder of a checkpoint: sent by rank 0 once it made it."""
    pid = torch.tensor([os.getpid()], dtype=torch.int64, device=comm_device())
    if distributed.active():
        dist.broadcast(pid, 0)
    return int(pid.item())


def _shards_written() -> None:
    """Every rank has written its shard into the temporary folder (a barrier of the world group)."""
    if distributed.active():
        dist.barrier()


def remove_stale_temporaries(folder: Path) -> None:
    """.tmp-step-N-PID folders of checkpoints whose writer is gone (killed mid-save)."""
    remove_dead_writers(folder, ".tmp-*", lambda name: name.rsplit("-", 1)[1])


def _write(
    tmp: Path,
    model,
    flat_optimizer: tuple[dict, dict],
    scheduler,
    state: dict,
    step: int,
    extra_tensors,
    shards: dict | None,
) -> None:
    """The replicated part of a checkpoint (all of it without expert parallelism, `shards` None) and state.json;
    `flat_optimizer`: `_flatten_optimizer`'s tensors and metadata."""
    in_shards = {} if shards is None else shards["optimizer_params"]  # {prefix: optimizer index}
    tensors = {
        k: v.contiguous().cpu() for k, v in trainable_tensors(model).items() if _prefix_of(k) not in in_shards
    }
    _written(tmp / TRAINABLE_FILE, lambda p: save_file(tensors, str(p)))
    opt_tensors, opt_meta = flat_optimizer
    sharded_params = {str(index) for index in in_shards.values()}
    opt_tensors = {k: v for k, v in opt_tensors.items() if k.split(".", 1)[0] not in sharded_params}
    _written(tmp / OPTIMIZER_FILE, lambda p: save_file(opt_tensors, str(p)))
    rng = state.pop("rng")
    rng_tensors = {"torch": rng.pop("torch")}
    for i, t in enumerate(rng.pop("cuda", [])):
        rng_tensors[f"cuda.{i}"] = t
    _written(tmp / RNG_FILE, lambda p: save_file(rng_tensors, str(p)))
    extra = {k: v.contiguous().cpu() for k, v in (extra_tensors or {}).items()}
    _written(tmp / EXTRA_FILE, lambda p: save_file(extra, str(p)))
    files = [*TENSOR_FILES, *(name for shard in (shards or {}).get("shards", []) for name in shard["files"])]
    meta = {
        "usaf_version": __version__,
        "step": step,
        "files": {name: file_sha256(tmp / name) for name in files},
        "optimizer": opt_meta,
        "scheduler": scheduler.state_dict(),
        "rng": rng,
        "selection": selection_layout(model),
        **({EXPERT_PARALLEL_KEY: shards} if shards is not None else {}),
        **state,
    }
    _written(tmp / STATE_FILE, lambda p: p.write_text(json.dumps(meta, indent=1)))
    _written(tmp / STATE_SUM_FILE, lambda p: p.write_text(file_sha256(tmp / STATE_FILE) + "\n"))


# ---- expert-parallel shards ------------------------------------------------------------------------------------


def _prefix_of(key: str) -> str:
    """`<module>.usaf.<tensor>.` of a trainable tensor's key `<module>.usaf.<tensor>.<buffer>`."""
    return key.rsplit(".", 1)[0] + "."


def shard_files(ep_rank: int, size: int) -> list[str]:
    """The files of EP rank `ep_rank`'s shard: its experts' trained entries, their optimizer state, its components'
    own tensors (a shard's record in state.json lists its files: one written before EXTRA_SHARD_FILE has two)."""
    names = (TRAINABLE_SHARD_FILE, OPTIMIZER_SHARD_FILE, EXTRA_SHARD_FILE)
    return [name.format(rank=ep_rank, size=size) for name in names]


def expert_optimizer_params(model: torch.nn.Module, optimizer) -> dict[str, int]:
    """{key prefix of an expert tensor's entries: the index of its values in the optimizer's state}: what a shard
    holds (the index as `optimizer.state_dict()` numbers the parameters, group after group)."""
    index_of = {
        id(p): i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])
    }
    params = dict(model.named_parameters())
    return {
        prefix: index_of[id(params[prefix + "values"])]
        for prefix in (f"{path}.usaf.{name}." for path, state in sparse_experts(model) for name in state)
    }


def write_shard(
    folder: Path,
    model: torch.nn.Module,
    optimizer,
    expert_layout: ExpertLayout,
    opt_tensors: dict | None = None,
    shard_tensors: dict[str, torch.Tensor] | None = None,
) -> None:
    """This EP rank's shard into the checkpoint folder `folder`: the entries of the expert tensors it holds (its
    experts'), their optimizer state (`opt_tensors`: the optimizer's tensors `_flatten_optimizer` gave, if
    already flattened), and the components' tensors of its own (`shard_tensors`)."""
    indices = expert_optimizer_params(model, optimizer)
    tensors = {
        k: v.contiguous().cpu() for k, v in trainable_tensors(model).items() if _prefix_of(k) in indices
    }
    if opt_tensors is None:
        opt_tensors = _flatten_optimizer(optimizer)[0]
    mine = {str(index) for index in indices.values()}
    opt_tensors = {k: v for k, v in opt_tensors.items() if k.split(".", 1)[0] in mine}
    trainable_name, optimizer_name, extra_name = shard_files(expert_layout.ep_rank, expert_layout.ep)
    _written(folder / trainable_name, lambda p: save_file(tensors, str(p)))
    _written(folder / optimizer_name, lambda p: save_file(opt_tensors, str(p)))
    extra = {k: v.contiguous().cpu() for k, v in (shard_tensors or {}).items()}
    _written(folder / extra_name, lambda p: save_file(extra, str(p)))


def shard_record(folder: Path, model: torch.nn.Module, optimizer, expert_layout: ExpertLayout) -> dict:
    """state.json's record of the shards in `folder` (all written: checked), for `load` to gather or re-shard."""
    counts = sorted({state.num_experts for _, state in sparse_experts(model)})
    shards = []
    for ep_rank in range(expert_layout.ep):
        files = shard_files(ep_rank, expert_layout.ep)
        for name in files:
            if not (folder / name).is_file():
                raise RunStateError(
                    f"checkpoint {folder}: EP rank {ep_rank} did not write its shard {name}; the checkpoint is "
                    "not saved (see that rank's error)."
                )
        owner = replace(expert_layout, ep_rank=ep_rank)
        experts = {str(n): [owner.owned(n).start, owner.owned(n).stop] for n in counts}
        shards.append({"files": files, "experts": experts})
    return {
        "size": expert_layout.ep,
        "shards": shards,
        "optimizer_params": expert_optimizer_params(model, optimizer),
    }


def _flatten_optimizer(optimizer) -> tuple[dict, dict]:
    state_dict = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, per_param in state_dict["state"].items():
        for key, value in _flat_items(per_param):
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{key}"] = value.contiguous().cpu()
            elif isinstance(value, bool | int | float | str) or value is None:
                scalars[f"{index}.{key}"] = value
            else:
                raise ConfigError(
                    f"the optimizer's state '{key}' is a {type(value).__name__}, which a checkpoint cannot hold; "
                    "use the default optimizer (optim.eight_bit=false)."
                )
    return tensors, {"param_groups": state_dict["param_groups"], "scalars": scalars}


def _flat_items(state: dict, prefix: str = ""):
    for key, value in state.items():
        if isinstance(value, dict):
            yield from _flat_items(value, f"{prefix}{key}{_NESTED}")
        else:
            yield f"{prefix}{key}", value


def _nest(state: dict, name: str, value) -> None:
    *outer, last = name.split(_NESTED)
    for key in outer:
        state = state.setdefault(key, {})
    state[last] = value


def file_sha256(path: Path) -> str:
    hasher = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(16 << 20):
            hasher.update(block)
    return hasher.hexdigest()


def _damaged(file: Path, path: Path) -> UsafError:
    return RunStateError(
        f"Checkpoint file {file} is damaged: its sha256 differs from the one recorded when it was written "
        f"({file.stat().st_size:,} bytes now); delete {path} to fall back to an earlier checkpoint of the run."
    )


def read_state(path: Path) -> dict:
    """A checkpoint's state.json, verified against state.sha256 (checkpoints written before usaf recorded it are
    not checked): its data position, counters and config are trusted by a resume."""
    path = Path(path)
    state_file, sum_file = path / STATE_FILE, path / STATE_SUM_FILE
    try:
        if sum_file.exists():
            recorded = sum_file.read_text(errors="replace").strip()
            if not re.fullmatch(r"[0-9a-f]{64}", recorded):
                raise RunStateError(
                    f"Checkpoint file {sum_file} is damaged (not a sha256); delete {path} to fall back to an "
                    "earlier checkpoint of the run."
                )
            if file_sha256(state_file) != recorded:
                raise _damaged(state_file, path)
        meta = json.loads(state_file.read_text())
        if not isinstance(meta, dict):
            raise ValueError("state.json is not a mapping")
    except (OSError, ValueError) as err:
        raise RunStateError(
            f"Checkpoint {path} is unreadable ({err}); delete it to resume from an earlier one."
        ) from None
    return meta


def verify(path: Path, meta: dict, names=None) -> None:
    """The files of checkpoint `path` (`names`, default every one) against the sha256 its state.json recorded
    (checkpoints written before usaf recorded them are not checked)."""
    recorded = meta.get("files") or {}
    # every name it lists must lie in the folder, whether or not this reader opens it (a forged state.json)
    files = {name: inside(path, name, f"{path / STATE_FILE}'s files") for name in recorded}
    for name in recorded if names is None else [n for n in names if n in recorded]:
        file = files[name]
        if not file.is_file():
            raise RunStateError(
                f"Checkpoint {path} is incomplete: {name} is missing; delete {path} to fall back to an earlier "
                "checkpoint of the run."
            )
        if file_sha256(file) != recorded[name]:
            raise _damaged(file, path)


def load(path: Path, expert_layout: ExpertLayout | None = None) -> dict:
    """Everything in a checkpoint folder (tensors on CPU), its files verified against their recorded sha256. The
    shards of an expert-parallel checkpoint are gathered (`expert_layout` None: every expert's entries, as a
    single process saves them) or kept to the experts `expert_layout` gives this rank (its own shard at the same EP
    size, else re-sharded)."""
    path = Path(path)
    meta = read_state(path)
    sharded = meta.get(EXPERT_PARALLEL_KEY)
    if sharded is None and expert_layout is not None:
        raise RunStateError(
            f"cannot resume {path} with distributed.expert_parallel={expert_layout.ep}: it was trained without "
            "expert parallelism; resume it with --set distributed.expert_parallel=1."
        )
    shards = _shards_to_read(sharded, expert_layout)
    try:
        verify(path, meta, [*TENSOR_FILES, *(name for shard in shards for name in shard["files"])])
        meta["trainable"] = load_file(str(path / TRAINABLE_FILE))
        meta["optimizer_tensors"] = load_file(str(path / OPTIMIZER_FILE))
        rng = load_file(str(path / RNG_FILE))
        meta["extra"] = load_file(str(path / EXTRA_FILE))
        if shards:
            trainable, optimizer, extra = _gathered(path, shards)
            if expert_layout is not None and expert_layout.ep != sharded["size"]:  # re-sharded
                _keep_owned(meta, trainable, optimizer, expert_layout, path)
            meta["trainable"].update(trainable)
            meta["optimizer_tensors"].update(optimizer)
            # the components' own tensors of the shards read (gathered: every rank's, in rank order; a component
            # keeps its experts' share, as the reselector its probes)
            meta["extra"].update(extra)
    except UsafError:
        raise
    except (OSError, ValueError) as err:
        raise RunStateError(
            f"Checkpoint {path} is unreadable ({err}); delete it to resume from an earlier one."
        ) from None
    meta["rng"]["torch"] = rng["torch"]
    cuda = sorted(k for k in rng if k.startswith("cuda."))
    if cuda:
        meta["rng"]["cuda"] = [rng[k] for k in cuda]
    return meta


def _shards_to_read(sharded: dict | None, expert_layout: ExpertLayout | None) -> list[dict]:
    """The shards a reader needs: its own at the same EP size, else all of them (in EP rank order)."""
    if sharded is None:
        return []
    if expert_layout is not None and expert_layout.ep == sharded["size"]:
        return [sharded["shards"][expert_layout.ep_rank]]
    return sharded["shards"]


def _gathered(path: Path, shards: list[dict]) -> tuple[dict, dict, dict]:
    """The trained entries, optimizer state and components' tensors of `shards`, concatenated in EP rank order: the
    experts' blocks are contiguous and in order, so the global indices (and a probe's line ids) stay sorted.
    Per-entry tensors are concatenated, scalars (an optimizer's step, a probe's axis) are the same in every shard.
    A shard written before EXTRA_SHARD_FILE has no components' tensors (its checkpoint's EXTRA_FILE holds them)."""
    parts: list[tuple[dict, dict, dict]] = []
    for shard in shards:
        trainable_name, optimizer_name, *extra_name = shard["files"]
        extra = load_file(str(path / extra_name[0])) if extra_name else {}
        parts.append((load_file(str(path / trainable_name)), load_file(str(path / optimizer_name)), extra))
    return tuple(
        {
            key: torch.cat([part[which][key] for part in parts]) if tensor.dim() else tensor
            for key, tensor in parts[0][which].items()
        }
        for which in (0, 1, 2)
    )


def _keep_owned(
    meta: dict, trainable: dict, optimizer: dict, expert_layout: ExpertLayout, path: Path
) -> None:
    """Every expert's gathered entries -> those of the experts `expert_layout` gives this rank, in place; the
    optimizer moments follow their entries."""
    indices = meta[EXPERT_PARALLEL_KEY]["optimizer_params"]
    for name, selection in (meta.get("selection") or {}).items():
        prefix = selection["prefix"]
        if prefix not in indices:
            continue  # not an expert tensor: replicated
        kind_key = "line_ids" if selection["kind"] == "lines" else "flat_indices"
        shape = selection["shape"]
        keep = owned_mask(
            shape, selection["axis"], trainable[prefix + kind_key], expert_layout.owned(shape[0])
        )
        for key in [k for k in trainable if k.startswith(prefix)]:
            trainable[key] = trainable[key][keep]
        for key in [k for k in optimizer if k.split(".", 1)[0] == str(indices[prefix])]:
            if optimizer[key].dim() == 0:
                continue
            if optimizer[key].shape[0] != keep.numel():
                raise RunStateError(
                    f"cannot re-shard {path} (distributed.expert_parallel={meta[EXPERT_PARALLEL_KEY]['size']}) "
                    f"to distributed.expert_parallel={expert_layout.ep}: the optimizer state of {name} is not one "
                    "value per entry; resume with the EP size it was trained with."
                )
            optimizer[key] = optimizer[key][keep]


def restore_optimizer(optimizer, checkpoint: dict) -> None:
    meta = checkpoint["optimizer"]
    state: dict = {}
    for key, value in [*checkpoint["optimizer_tensors"].items(), *meta["scalars"].items()]:
        index, name = key.split(".", 1)
        _nest(state.setdefault(int(index), {}), name, value)
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def restore_trainable(model: torch.nn.Module, saved: dict[str, torch.Tensor], where: Path) -> None:
    """Load trained values, routers and the selection from a checkpoint; refuse a different base model."""
    for path, state in sparse_modules(model):
        for name, entries in state.items():
            prefix = f"{path}.usaf.{name}."
            selection = saved.get(prefix + entries.selection_name)
            if selection is None:
                raise RunStateError(
                    f"checkpoint {where} has no selection for {path}.{name}: different model or config."
                )
            current = getattr(entries, entries.selection_name)
            saved_base = saved.get(prefix + "base_values")
            if entries.keeps_base != (saved_base is not None):
                raise RunStateError(
                    f"checkpoint {where} keeps the base values of {path}.{name} differently from this run (a "
                    "quantized base against an unquantized one): resume with the run's own configuration."
                )
            if entries.keeps_base:  # a different base shows in the original weights at the shared entries
                same = torch.isin(selection, current.cpu())
                base_now = entries.base_values.cpu()[torch.isin(current.cpu(), selection)]
                if not torch.equal(base_now, saved_base[same].to(base_now.dtype)):
                    raise RunStateError(
                        f"checkpoint {where} was trained on a different base model: the original weights of "
                        f"{path}.{name} differ. Resume with the model the run started from."
                    )
            if not torch.equal(selection, current.cpu()):
                entries.set_selection(selection, saved_base, saved[prefix + "values"])
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in params.items():
            if param.requires_grad:
                if name not in saved:
                    raise RunStateError(
                        f"checkpoint {where} lacks '{name}': it was made with another configuration."
                    )
                param.copy_(saved[name])


class Checkpointer:
    """The run's checkpoints. `save(step)` writes one when it is due (every `checkpoint.every_steps`; 0: only
    when forced: the final one, a stop's, a failure's); `collect()` gives what it holds (model, optimizer,
    scheduler, state, extra_tensors). Only rank 0 writes, with the world size a resume must match (under expert
    parallelism the ranks of DP group 0 write their shards too); every rank reads. A file given to
    `write_with_next` is written after the next checkpoint, which records the same. `keep_best(step)`: the
    checkpoint of `step` is saved at that step and spared by the rotation."""

    def __init__(self, run_dir: Path, section, collect):
        self.run_dir, self.every_steps, self.keep_last = run_dir, section.every_steps, section.keep_last
        self.collect = collect
        self.pending: dict[Path, str] = {}
        self.best_step: int | None = None

    def should_save(self, step: int) -> bool:
        return (bool(self.every_steps) and step % self.every_steps == 0) or step == self.best_step

    def keep_best(self, step: int | None) -> None:
        """The checkpoint of `step` (the step just taken, or a restored run's best) is the run's best."""
        self.best_step = step

    def save(self, step: int, force: bool = False) -> Path | None:
        if not (force or self.should_save(step)):
            return None
        expert_layout = expert_parallel.layout()  # its shards are written by the ranks holding them
        if not distributed.is_main() and expert_layout is None:  # [usaf.distributed]
            return None
        parts = self.collect()
        parts["state"]["world_size"] = distributed.world_size()  # a resume must match it
        saved = save(
            self.run_dir,
            step,
            keep_last=self.keep_last,
            expert_layout=expert_layout,
            spare=self.best_step,
            **parts,
        )
        if saved is None:
            return None  # another rank's shard
        for path, text in self.pending.items():
            atomic_file(path, lambda tmp, text=text: tmp.write_text(text))
        self.pending.clear()
        return saved

    def write_with_next(self, path: Path, text: str) -> None:
        self.pending[path] = text

    def load_latest(self) -> tuple[Path, dict] | None:
        """The latest checkpoint and what it holds (None: there is none), refused under another world size."""
        saved = latest(self.run_dir)
        if saved is None:
            return None
        # the world size first: a job of another size holds other layouts, whose shards it need not read
        distributed.check_world_size(read_state(saved).get("world_size"), saved)  # [usaf.distributed]
        restored = load(saved, expert_parallel.layout())
        return saved, restored
