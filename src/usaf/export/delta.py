"""Sparse delta files: a run's trained entries and routers, written against the base they were trained on, and read
back and checked against a base."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import safetensors.torch
import torch

from usaf.base.checkpoint import BaseCheckpoint
from usaf.base.record import read_run_base_record, run_base_dir, structural_difference, tensor_facts
from usaf.engine.sparse import line_flat_indices
from usaf.errors import ModelError, RunStateError, UsafError
from usaf.files import DELTA_FORMAT, SUMMARY_FILE
from usaf.io import shards
from usaf.io.atomic import atomic_file
from usaf.io.guard import DELTA, check_output
from usaf.prepare import TensorChange
from usaf.train import checkpoint
from usaf.version import __version__

DELTA_FORMAT_VERSION = 1
_CHUNK_BYTES = 64 << 20


_INT32_LIMIT = 2**31 - 1


@dataclass
class Delta:
    """What a training run changed, by model parameter name, and what is known about where it came from."""

    changes: dict[str, TensorChange]
    info: dict = field(default_factory=dict)
    # the identity of the base the values were trained against ({"model_type", "config_sha256", "files": {shard:
    # size}, "tensors": {key: {"file", "dtype", "shape", "sample_sha256", and "sha256" for the tensors that can
    # hold trained entries}}}; records of older usaf: every tensor's sha256, no samples): a delta file's "base", a
    # run's base.json; None when nothing was recorded
    base_record: dict | None = None
    origin: str = "the delta"  # how messages name where the delta came from


# ---- deltas: from a run, from a file -----------------------------------------------------------------------------


def delta_from_run(run_dir: str | Path, best: bool = False) -> Delta:
    """The trained entries and routers of a run's latest finished checkpoint, or (`best`) of the checkpoint of its
    best evaluation (checkpoint.keep_best); an expert-parallel run's shards gathered by `checkpoint.load`: the
    entries a single process would hold."""
    run_dir = Path(run_dir)
    if run_dir.is_file():
        raise RunStateError(
            f"{run_dir} is a file, not a run directory; pass the --out folder of `usaf train`."
        )
    if not run_dir.is_dir():
        raise RunStateError(f"Run directory {run_dir} does not exist; pass the --out folder of `usaf train`.")
    if best:
        latest = checkpoint.best(run_dir)
        saved = checkpoint.load(latest)
    else:
        latest, saved = _load_latest(run_dir)
    trainable = saved["trainable"]
    changes: dict[str, TensorChange] = {}
    claimed: set[str] = set()
    for name, layout in (saved.get("selection") or {}).items():
        prefix = layout["prefix"]
        values = trainable[prefix + "values"].reshape(-1)
        if layout["kind"] == "lines":
            flat = line_flat_indices(layout["shape"], layout["axis"], trainable[prefix + "line_ids"])
        else:
            flat = trainable[prefix + "flat_indices"]
        changes[name] = sorted_change(flat, values)
        claimed.update(k for k in trainable if k.startswith(prefix))
    for key, value in trainable.items():
        if key in claimed:
            continue
        if ".usaf." in key:
            raise RunStateError(
                f"Checkpoint {latest} holds '{key}' but no selection layout for it (made by an older usaf); "
                "resume the run for one step with this version to re-save it."
            )
        changes[key] = TensorChange(None, value.reshape(-1))  # a router (or other dense trainable parameter)
    for name, layout in (saved.get("selection") or {}).items():
        check_change(changes[name], name, layout["shape"], f"checkpoint {latest}", "resume the run")
    for name, change in changes.items():
        if change.flat_indices is None:
            check_change(change, name, list(change.values.shape), f"checkpoint {latest}", "resume the run")
    summary_file = run_dir / SUMMARY_FILE
    info = {
        "source": {"run_dir": str(run_dir.resolve()), "checkpoint": latest.name, "step": saved.get("step")},
        "training": _read_summary(summary_file) if summary_file.exists() else None,
    }
    return Delta(changes, info, base_record=read_run_base_record(run_dir), origin=f"the run {run_dir}")


def _load_latest(run_dir: Path) -> tuple[Path, dict]:
    """The run's latest checkpoint, loaded. A run still training rotates its checkpoints (checkpoint.keep_last):
    one that disappears while it is read was replaced by a newer one, which is read instead."""
    for _ in range(5):
        latest = checkpoint.latest(run_dir)
        if latest is None:
            raise RunStateError(
                f"{run_dir} has no finished checkpoint (checkpoints/step-*/state.json): train it first, or resume "
                "it with `usaf train --resume` until it saves one."
            )
        try:
            return latest, checkpoint.load(latest)
        except UsafError:
            if checkpoint.latest(run_dir) == latest:
                raise  # still the latest: damaged, not rotated away
    raise RunStateError(
        f"the checkpoints of {run_dir} were rotated away while this export read them (the run is still training "
        "and keeps only the newest, checkpoint.keep_last); nothing is wrong with them: run the export again, or "
        "once the run has finished."
    )


def _read_summary(path: Path) -> dict:
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        summary = err
    if not isinstance(summary, dict):
        raise RunStateError(
            f"{path} is damaged (not the JSON object `usaf train` writes); delete it and run `usaf train --resume "
            f"{path.parent}` to rewrite it."
        )
    return summary


def sorted_change(flat: torch.Tensor, values: torch.Tensor) -> TensorChange:
    flat = flat.reshape(-1).to(torch.int64).cpu()
    values = values.reshape(-1).detach().cpu()
    order = torch.argsort(flat)
    return TensorChange(flat[order], values[order])


def write_delta(
    delta: Delta, base: BaseCheckpoint, out_path: str | Path, *, fp32: bool = False, force: bool = False
) -> Path:
    """Write `delta` as one safetensors file: per changed parameter its flat indices (int32 where every index of the
    tensor fits, else int64) and values (the base's dtype, or float32), whole tensors for routers, and metadata."""
    out_path = Path(out_path)
    check_output(
        out_path, DELTA, flag="--delta", force=force, inputs=written_from(delta, base), noun="output file"
    )
    tensors: dict[str, torch.Tensor] = {}
    described: dict[str, dict] = {}
    checksums: dict[str, dict] = {}
    for name in sorted(delta.changes):
        described[name] = _put_change(name, delta.changes[name], base, fp32, tensors)
        for key in described[name]["source_tensors"]:
            checksums[key] = _checked_source(key, base, delta)
    # the other tensors by their cheap facts, so that `usaf apply` refuses another model with the same shapes
    # even where the delta changes nothing
    facts = {key: tensor_facts(entry) for key, entry in sorted(base.source.entries.items())}
    files = {name: (base.dir / name).stat().st_size for name in base.shard_files()}
    info = {
        "format": DELTA_FORMAT,
        "format_version": DELTA_FORMAT_VERSION,
        "usaf_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "base": {
            **base.identity(),
            "files": files,
            "tensors": {key: {**facts[key], **checksums.get(key, {})} for key in facts},
        },
        "changes": described,
        **delta.info,
        "payload_sha256": _payload_digest(tensors),
    }
    metadata = {"format": DELTA_FORMAT, "format_version": str(DELTA_FORMAT_VERSION), "usaf": json.dumps(info)}
    atomic_file(out_path, lambda tmp: safetensors.torch.save_file(tensors, str(tmp), metadata=metadata))
    return out_path


def _put_change(name: str, change, base: BaseCheckpoint, fp32: bool, tensors: dict) -> dict:
    """One changed parameter's tensors into `tensors` (its indices and values, or the whole tensor); what the
    metadata says of it."""
    shape, base_dtype = base.shape(name), base.dtype(name)
    numel = torch.Size(shape).numel()
    values_dtype = torch.float32 if fp32 else base_dtype
    flat = change.flat_indices if change.flat_indices is not None else torch.arange(numel)
    if change.count != flat.numel() or (flat.numel() and int(flat.max()) >= numel):
        raise ModelError(f"The trained entries of '{name}' do not fit its shape {list(shape)} in {base.dir}.")
    entry = {"kind": "full" if change.flat_indices is None else "entries", "shape": list(shape)}
    if change.flat_indices is None:
        tensors[f"{name}:full"] = change.values.to(values_dtype).reshape(shape).contiguous()
    else:
        index_dtype = torch.int32 if numel <= _INT32_LIMIT else torch.int64
        tensors[f"{name}:flat_indices"] = change.flat_indices.to(index_dtype).contiguous()
        tensors[f"{name}:values"] = change.values.to(values_dtype).contiguous()
        entry["index_dtype"] = shards.DTYPE_NAMES[index_dtype]
    entry.update(
        count=change.count,
        base_dtype=shards.DTYPE_NAMES[base_dtype],
        values_dtype=shards.DTYPE_NAMES[values_dtype],
    )
    entry["source_tensors"] = sorted({key for key, _, _ in base.locate(name, flat)})
    return entry


def _checked_source(key: str, base: BaseCheckpoint, delta: Delta) -> dict:
    """A source tensor the delta changes, by its facts and checksum; refused when it is not the tensor the run
    trained on (the base record's checksum)."""
    source_entry = base.source.entries[key]
    facts = {
        "file": source_entry.file.name,
        "dtype": shards.DTYPE_NAMES[source_entry.dtype],
        "shape": list(source_entry.shape),
        "sha256": base.sha256(key),
    }
    want = ((delta.base_record or {}).get("tensors") or {}).get(key, {}).get("sha256")
    if want is not None and facts["sha256"] != want:
        raise ModelError(checksum_message(key, source_entry.file, delta.origin))
    return facts


def read_delta(path: str | Path) -> Delta:
    """A delta file, checked: a truncated or altered file fails here, naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"Delta file {path} does not exist.")
    try:
        entries, metadata = shards.read_header(path)
    except UsafError as err:
        raise ModelError(f"{err} ({path} is a usaf delta: export it again.)") from None
    if metadata.get("format") != DELTA_FORMAT:
        raise ModelError(f"{path} is not a usaf delta file (made by `usaf export --delta`).")
    try:
        info = json.loads(metadata["usaf"])
    except (KeyError, json.JSONDecodeError) as err:
        raise ModelError(
            f"{path} is corrupted: its usaf metadata is unreadable ({err}); export it again."
        ) from None
    if int(info.get("format_version", 0)) > DELTA_FORMAT_VERSION:
        raise ModelError(
            f"{path} is a delta of format version {info.get('format_version')} (usaf {info.get('usaf_version')}); "
            f"this usaf {__version__} reads version {DELTA_FORMAT_VERSION}: upgrade usaf."
        )
    tensors = {name: shards.read_tensor(entry) for name, entry in entries.items()}
    if _payload_digest(tensors) != info.get("payload_sha256"):
        raise ModelError(
            f"{path} is corrupted: its tensors do not match the checksum recorded when it was written; export it "
            "again."
        )
    changes = {}
    try:
        for name, entry in info["changes"].items():
            if entry["kind"] == "full":
                change = TensorChange(None, tensors[f"{name}:full"].reshape(-1))
            else:
                change = TensorChange(tensors[f"{name}:flat_indices"], tensors[f"{name}:values"].reshape(-1))
            # its content, not only its checksum: a checksum recomputed over bad content passes
            check_change(
                change, name, entry.get("shape"), f"Delta file {path}", "export it again from its run"
            )
            if change.flat_indices is not None:
                change = TensorChange(change.flat_indices.to(torch.int64), change.values)
            changes[name] = change
    except (KeyError, TypeError, AttributeError) as err:
        raise ModelError(
            f"{path} is corrupted: its tensor list is unreadable ({err!r}); export it again."
        ) from None
    return Delta(changes, info, base_record=info.get("base"), origin=str(path))


_INDEX_DTYPES = (torch.int32, torch.int64)


def check_change(change: TensorChange, name: str, shape, where: str, fix: str) -> None:
    """The content of one changed tensor, as any reader of a delta or checkpoint must see it before writing it into
    a model: integer flat indices, each once, inside the tensor's `shape`; as many values, all finite."""

    def bad(what: str) -> ModelError:
        return ModelError(f"{where}: tensor '{name}' {what}; it cannot be applied ({fix}).")

    if not isinstance(shape, list | tuple) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise bad(f"has no valid shape ({shape!r})")
    numel = torch.Size(shape).numel()
    values, indices = change.values, change.flat_indices
    if not values.is_floating_point():
        raise bad(f"has values of type {values.dtype}, not floating point")
    if indices is None:
        if values.numel() != numel:
            raise bad(f"holds {values.numel():,} values for its shape {list(shape)} ({numel:,})")
    else:
        if indices.dtype not in _INDEX_DTYPES:
            raise bad(f"has indices of type {indices.dtype}, not int32/int64")
        indices = indices.reshape(-1)
        if indices.numel() != values.numel():
            raise bad(f"has {indices.numel():,} indices for {values.numel():,} values")
        if indices.numel():
            low, high = int(indices.min()), int(indices.max())
            if low < 0:
                raise bad(f"has negative indices (e.g. {low})")
            if high >= numel:
                raise bad(f"has indices beyond its shape {list(shape)} (e.g. {high}, of {numel:,} entries)")
            ordered = torch.sort(indices.to(torch.int64)).values
            repeated = ordered[1:][ordered[1:] == ordered[:-1]]
            if repeated.numel():
                raise bad(f"lists entry {int(repeated[0])} more than once")
    finite = torch.isfinite(values)
    if not bool(finite.all()):
        raise bad(f"holds {int((~finite).sum()):,} NaN/Inf values")


def _payload_digest(tensors: dict[str, torch.Tensor]) -> str:
    hasher = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        hasher.update(f"{name}|{shards.DTYPE_NAMES[tensor.dtype]}|{list(tensor.shape)}|".encode())
        hasher.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return hasher.hexdigest()


# ---- the commands ------------------------------------------------------------------------------------------------


def export_delta(
    run_dir: str | Path,
    out_path: str | Path,
    *,
    fp32: bool = False,
    force: bool = False,
    base_dir: str | Path | None = None,
) -> Path:
    """`usaf export RUN_DIR --delta OUT`: the run's latest checkpoint as a delta file against its base."""
    delta, base = run_delta_and_base(run_dir, base_dir)
    return write_delta(delta, base, out_path, fp32=fp32, force=force)


def run_delta_and_base(
    run_dir: str | Path, base_dir: str | Path | None = None, best: bool = False
) -> tuple[Delta, BaseCheckpoint]:
    """A run's delta (`best`: its best checkpoint's) and the base to write it against (--base or the run's own),
    checked as `usaf apply` checks a delta file's base: the same `check_base`, and the recorded checksums while
    writing."""
    delta = delta_from_run(run_dir, best)
    base = BaseCheckpoint(run_base_dir(Path(run_dir), base_dir))
    check_base(delta, base)
    return delta, base


UNCHECKED_BASE_FLAG = "--unchecked-base"


def check_base(delta: Delta, base: BaseCheckpoint, *, unchecked_base: bool = False) -> None:
    """Cheap checks that `base` is the model `delta` was made against, for a delta file (`usaf apply`, load_delta)
    and a run (`usaf export`) alike: model type, every recorded tensor's presence, dtype, shape and sampled bytes,
    the shard files' sizes. The recorded full sha256 (of the tensors that can hold trained entries) are verified as
    the changed tensors are read. A delta file without its base record is refused unless `unchecked_base`."""
    recorded, delta_path = delta.base_record, delta.origin
    if recorded is None:
        if not unchecked_base:
            check_base_recorded(delta, str(base.dir), UNCHECKED_BASE_FLAG)
    elif not isinstance(recorded, dict):
        raise ModelError(f"{delta_path} is corrupted: its base record is not a mapping; export it again.")
    elif recorded.get("model_type") != (model_type := getattr(base.config, "model_type", None)):
        raise ModelError(
            f"{delta_path} was made for a {recorded.get('model_type')} model, but {base.dir} is {model_type}; use "
            "the model it was trained from."
        )
    for name, entry in (delta.info.get("changes") or {}).items():
        if list(base.shape(name)) != entry["shape"]:  # recorded or not: the indices must fit the target
            raise ModelError(
                f"{delta_path} changes '{name}' of shape {entry['shape']}, but in {base.dir} it is "
                f"{list(base.shape(name))}; use the model it was trained from."
            )
    if recorded is None:
        return  # a run from before base.json (or trained from the hub), or unchecked: nothing to compare against
    found = structural_difference(recorded, base)
    if found is None:
        return
    key, what = found
    entry = base.source.entries.get(key)
    info = (recorded.get("tensors") or {}).get(key)
    if info is None:  # a shard file of another size
        raise ModelError(
            f"{delta_path} was made against a base whose shard {key} is {recorded['files'][key]} bytes, but "
            f"{what}: this is another model or a modified copy. Use the exact checkpoint it was made from."
        )
    if (
        entry is None
        or shards.DTYPE_NAMES[entry.dtype] != info["dtype"]
        or list(entry.shape) != info["shape"]
    ):
        raise ModelError(
            f"{delta_path} was made against a base whose tensor '{key}' is {info['dtype']} {info['shape']}; "
            f"{base.dir} {'lacks it' if entry is None else 'differs'}. Use the model it was trained from."
        )
    raise ModelError(checksum_message(key, entry.file, delta_path, "its first and last bytes differ"))


def check_base_recorded(delta: Delta, target: str, flag: str) -> None:
    """A delta file stripped of its base record: whatever it is applied to cannot be checked; only `flag` (off by
    default) applies it unchecked. A run without base.json (trained from the hub) is checked on its own terms."""
    if delta.base_record is None and delta.info.get("format") == DELTA_FORMAT:
        raise ModelError(
            f"{delta.origin} has no record of the base it was trained on (its metadata lacks 'base'), so {target} "
            f"cannot be checked to be that model; pass {flag} to apply it anyway."
        )


def verify_checksums(delta: Delta, base: BaseCheckpoint) -> None:
    """The full sha256 of exactly the tensors recorded with one (a delta's changed tensors, a run's trained ones);
    the others are compared by `check_base`'s cheap facts."""
    for key, info in ((delta.base_record or {}).get("tensors") or {}).items():
        if "sha256" in info and base.sha256(key) != info["sha256"]:
            raise ModelError(checksum_message(key, base.source.entries[key].file, delta.origin))


def checksum_message(key: str, file: Path, delta_path: Path | str, how: str = "sha256 mismatch") -> str:
    return (
        f"Tensor '{key}' in {file} differs from the base {delta_path} was trained on ({how}): this is another "
        "model or a modified copy. Use the exact checkpoint it was made from."
    )


# ---- files and folders -------------------------------------------------------------------------------------------


def written_from(delta: Delta, base: BaseCheckpoint) -> list[tuple[str, str | Path | None]]:
    """What an output written from `delta` and `base` must never replace or lie inside."""
    return [("the run", (delta.info.get("source") or {}).get("run_dir")), ("the base checkpoint", base.dir)]
