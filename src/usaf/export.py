"""Getting the trained model out: sparse delta files, merged checkpoints, and applying a delta.

A delta names the model's parameters as transformers 5 does (fused experts such as `experts.gate_up_proj`) and says,
for each, which flat entries changed and to what; routers change whole. Checkpoints on disk often keep those
parameters otherwise (one tensor per expert and projection). `BaseCheckpoint.locate` maps a parameter's entries onto
checkpoint tensors and positions by running transformers' own load-time conversion on tensors of position ids, so a
merge writes into the original shards in their own layout, for any family, without a table of names.

A merged checkpoint is the base's shards streamed tensor by tensor (in bounded chunks) with the trained entries
replaced: same names, dtypes, shard files and index; nothing else is touched, so a base trained in quantized form
keeps its original precision everywhere else. Outputs appear atomically: written beside the target under a hidden
temporary name, fsynced, renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from . import __version__, checkpoint, shards
from .atomic import (
    atomic_file,
    copy_side_files,
    fsync_dir,
    install_dir,
    remove_stale_temporaries,
    temporary_name,
    write_json,
)
from .errors import UsafError
from .sparse import ElementEntries, line_flat_indices

DELTA_FORMAT = "usaf-delta"
DELTA_FORMAT_VERSION = 1
MERGED_METADATA_FILE = "usaf_delta.json"
INDEX_FILE = "model.safetensors.index.json"
STORE_FILE = "usaf_store.json"  # a prepared (quantized) store, see usaf.load
_CHUNK_BYTES = 64 << 20
_INT32_LIMIT = 2**31 - 1


@dataclass
class TensorChange:
    """New values of one model parameter: at sorted `flat_indices`, or the whole tensor when that is None."""

    flat_indices: torch.Tensor | None
    values: torch.Tensor  # flat, aligned with flat_indices

    @property
    def count(self) -> int:
        return self.values.numel()


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


# ---- the base checkpoint ---------------------------------------------------------------------------------------


class BaseCheckpoint:
    """A full-precision Hugging Face checkpoint directory, read against its model's skeleton (no weights loaded)."""

    def __init__(self, model_dir: str | Path):
        # usaf.load and usaf.source pull in the quantized-storage stack; only what reads checkpoints needs them
        from transformers import AutoConfig

        from .arch import expert_weight_names, find_moe_layers
        from .load import build_skeleton
        from .source import SourceCheckpoint, check_model_files

        self.dir = Path(model_dir)
        if (self.dir / STORE_FILE).exists():
            source = json.loads((self.dir / STORE_FILE).read_text()).get("source", {}).get("dir")
            raise UsafError(
                f"{self.dir} is a usaf prepared (quantized) store; use the full-precision checkpoint it was prepared "
                f"from ({source}) as the base: merged checkpoints are never re-quantized."
            )
        if not (self.dir / "config.json").is_file():
            raise UsafError(
                f"{self.dir} has no config.json; pass the Hugging Face model directory the model was trained from."
            )
        check_model_files(str(self.dir))  # an unreadable config.json or an unknown model_type: one line
        self.config = AutoConfig.from_pretrained(self.dir)
        self.skeleton = build_skeleton(self.config)
        self.layers = find_moe_layers(self.skeleton)
        self.source = SourceCheckpoint(self.dir, self.skeleton, set(expert_weight_names(self.layers)))

    def identity(self) -> dict:
        return {
            "model_type": getattr(self.config, "model_type", None),
            "config_sha256": hashlib.sha256((self.dir / "config.json").read_bytes()).hexdigest(),
            "name_or_path": str(self.dir.resolve()),
        }

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._target(name).shape)

    def dtype(self, name: str) -> torch.dtype:
        return self._target(name).dtype

    def _target(self, name: str):
        target = self.source.targets.get(name)
        if target is None:
            raise UsafError(
                f"The delta changes '{name}', which the model in {self.dir} does not have: it was trained on "
                "another model."
            )
        return target

    def sha256(self, key: str) -> str:
        return self.source.finish_checksums([key])[key]  # hashed once, cached by the source

    def shard_files(self) -> list[str]:
        return sorted({entry.file.name for entry in self.source.entries.values()})

    def locate(self, name: str, flat: torch.Tensor) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """Where entries `flat` of parameter `name` are stored: (checkpoint key, positions in that tensor, which of
        the given entries) per checkpoint tensor involved."""
        from transformers.core_model_loading import WeightRenaming

        target = self._target(name)
        group = self.source.groups[target.group]
        flat = flat.reshape(-1).to(torch.int64).cpu()
        keys = group.keys()
        if (
            isinstance(group.transform, WeightRenaming)
            and len(keys) == 1
            and tuple(self.source.entries[keys[0]].shape) == tuple(target.shape)
        ):
            return [(keys[0], flat, torch.arange(flat.numel()))]
        if target.per_expert:
            return self._locate_per_expert(name, group, target, flat)
        ids, sources = _position_ids(self.source, group, self.source.groups[target.group].sources, name)
        return _split_by_source(ids.reshape(-1)[flat], sources)

    def _locate_per_expert(self, name, group, target, flat):
        per_expert = torch.Size(target.shape[1:]).numel()
        # the conversion is the same for every expert: map expert 0 (one expert's worth of ids, not cached: a
        # parameter is located once per export) and reuse its pattern with each expert's own checkpoint keys
        ids, sources = _position_ids(self.source, group, self.source._expert_sources(group, 0), name)
        slot, position = _decode(ids.reshape(-1), sources)
        expert = torch.div(flat, per_expert, rounding_mode="floor")
        local = flat - expert * per_expert
        combined = expert * len(sources) + slot[local]
        out = []
        for code in torch.unique(combined).tolist():
            e, s = divmod(code, len(sources))
            keys = [k for ks in self.source._expert_sources(group, e).values() for k in ks]
            picked = (combined == code).nonzero(as_tuple=True)[0]
            out.append((keys[s], position[local[picked]], picked))
        return out

    def read(self, name: str, saved: dict[str, shards.TensorEntry] | None = None, where: Path | None = None):
        """The whole parameter `name` as the model holds it, read from this checkpoint, or from `saved` (the tensors
        of a checkpoint in the same layout, e.g. written by transformers.Trainer, in folder `where`)."""
        entries = self.source.entries if saved is None else saved
        shape = self.shape(name)
        if saved is not None and name in saved and name not in self.source.entries:
            # saved under the model's own name: written without converting back to the checkpoint's layout
            return shards.read_tensor(saved[name]).to(self.dtype(name)).reshape(shape)
        numel = torch.Size(shape).numel()
        out = torch.empty(numel, dtype=self.dtype(name))
        for key, positions, picked in self.locate(name, torch.arange(numel)):
            if key not in entries:
                raise UsafError(f"Tensor '{key}' (part of '{name}') is missing from {where or self.dir}.")
            out[picked] = shards.read_tensor(entries[key]).reshape(-1)[positions].to(out.dtype)
        return out.reshape(shape)


def _position_ids(source, group, sources: dict[str, list[str]], name: str) -> tuple[torch.Tensor, list]:
    """Run the group's conversion on tensors holding their own element ids: the result says, for every element of
    `name`, which checkpoint element it comes from. Conversions only move data, so ids pass through unchanged."""
    keys = [k for ks in sources.values() for k in ks]
    offsets, total = {}, 0
    for key in keys:
        offsets[key] = total
        total += torch.Size(source.entries[key].shape).numel()

    def ids_of(key: str) -> torch.Tensor:
        entry = source.entries[key]
        return (torch.arange(torch.Size(entry.shape).numel()) + offsets[key]).reshape(entry.shape)

    try:
        ids = source._convert(group, sources, ids_of)[name]
    except Exception as err:
        raise UsafError(f"Cannot map '{name}' onto the checkpoint tensors {keys[:3]}: {err}") from err
    flat = ids.reshape(-1)
    if flat.dtype != torch.int64 or torch.unique(flat).numel() != flat.numel():
        raise UsafError(
            f"The checkpoint's conversion into '{name}' does not just move values ({type(group.transform).__name__}); "
            "usaf cannot write entries back into this checkpoint layout."
        )
    return ids, [(key, offsets[key]) for key in keys]


def _decode(ids: torch.Tensor, sources: list[tuple[str, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.tensor([offset for _, offset in sources])
    slot = torch.searchsorted(starts, ids, right=True) - 1
    return slot, ids - starts[slot]


def _split_by_source(ids: torch.Tensor, sources: list[tuple[str, int]]):
    slot, position = _decode(ids, sources)
    out = []
    for s in torch.unique(slot).tolist():
        picked = (slot == s).nonzero(as_tuple=True)[0]
        out.append((sources[s][0], position[picked], picked))
    return out


# ---- deltas: from a run, from a file -----------------------------------------------------------------------------

RUN_BASE_FILE = "base.json"  # a run's record of the base it trains on, written when the run starts


SAMPLE_BYTES = 4096  # a tensor that is not hashed whole is known by the sha256 of its first and last 4 KiB


def _base_and_store_checksums(model_dir) -> tuple[BaseCheckpoint, dict[str, str]]:
    """The checkpoint behind `model_dir` (itself, or the source a prepared store was made from) and the sha256
    per tensor the store recorded (none for a checkpoint)."""
    store = Path(model_dir) / STORE_FILE
    if not store.exists():
        return BaseCheckpoint(model_dir), {}
    metadata = json.loads(store.read_text())
    known = {key: info.get("sha256") for key, info in metadata.get("source_tensors", {}).items()}
    return BaseCheckpoint(metadata["source"]["dir"]), known


def base_record(model_dir: str | Path, trained: list[str] | None = None) -> dict:
    """What `check_base` compares a base against: its identity, every tensor's file, dtype, shape and a digest of
    its first and last bytes (`sample_sha256`), every shard file's size, and the full sha256 of the tensors that
    can hold trained entries: the checkpoint tensors that the model parameters `trained` (usaf's names, e.g. a
    fused `experts.gate_up_proj`) are built from; every tensor when `trained` is None or cannot be mapped. A
    prepared store: the checkpoint it was prepared from, with the checksums the store recorded (nothing hashed).

    Hashing only what can change keeps a run's start from reading the whole base (minutes on a 30B model); the
    rest is still compared, cheaply, so another model or a modified copy is refused."""
    base, known = _base_and_store_checksums(model_dir)
    hashed = checkpoint_keys(base, trained) if trained is not None else None
    tensors = {}
    for key, entry in sorted(base.source.entries.items()):
        facts = tensor_facts(entry)
        if hashed is None or key in hashed:
            facts["sha256"] = known.get(key) or shards.sha256_of(entry)
        tensors[key] = facts
    return {
        **base.identity(),
        "sha256_of": "all tensors" if hashed is None else "the tensors that can hold trained entries",
        "files": {name: (base.dir / name).stat().st_size for name in base.shard_files()},
        "tensors": tensors,
    }


def checkpoint_keys(base: BaseCheckpoint, names) -> set[str] | None:
    """The checkpoint tensors that the model parameters `names` are built from (through the loader's own
    renamings and conversions: Mixtral's `block_sparse_moe.experts.3.w1.weight` for `mlp.experts.gate_up_proj`);
    None when one of them is not built from the checkpoint."""
    tied = getattr(base.skeleton, "all_tied_weights_keys", None)
    tied = tied if isinstance(tied, dict) else {}
    keys: set[str] = set()
    for name in names:
        target = base.source.targets.get(name) or base.source.targets.get(tied.get(name) or "")
        if target is None:
            return None
        keys.update(base.source.groups[target.group].keys())
    return keys


def tensor_facts(entry: shards.TensorEntry) -> dict:
    return {
        "file": entry.file.name,
        "dtype": shards.DTYPE_NAMES[entry.dtype],
        "shape": list(entry.shape),
        "sample_sha256": sample_sha256(entry),
    }


def sample_sha256(entry: shards.TensorEntry) -> str:
    """sha256 of a tensor's first and last SAMPLE_BYTES (all of it when smaller): a cheap fingerprint that any
    fine-tune or re-initialisation of the tensor changes."""
    spans = [(entry.begin, min(entry.end, entry.begin + SAMPLE_BYTES))]
    if entry.nbytes > SAMPLE_BYTES:
        spans.append((max(spans[0][1], entry.end - SAMPLE_BYTES), entry.end))
    hasher = hashlib.sha256()
    with open(entry.file, "rb") as f:
        for begin, end in spans:
            f.seek(begin)
            block = f.read(end - begin)
            if len(block) != end - begin:
                raise UsafError(
                    f"{entry.file} ended early while reading tensor '{entry.name}'; re-download it."
                )
            hasher.update(block)
    return hasher.hexdigest()


def base_difference(recorded: dict, model_dir: str | Path) -> str | None:
    """How the base at `model_dir` (a checkpoint, or a prepared store: the checkpoint it was prepared from)
    differs from `recorded` (a run's base.json), checking exactly what was recorded: names, dtypes, shapes,
    sampled bytes and file sizes, and the sha256 of the tensors recorded with one (a store's own checksums are
    taken, not recomputed); None when it does not differ."""
    base, known = _base_and_store_checksums(model_dir)
    if recorded.get("model_type") != getattr(base.config, "model_type", None):
        return (
            f"it is {getattr(base.config, 'model_type', None)}, the run's base {recorded.get('model_type')}"
        )
    found = _structural_difference(recorded, base)
    if found is not None:
        return found[1]
    for key, info in sorted((recorded.get("tensors") or {}).items()):
        if (
            "sha256" in info
            and (known.get(key) or shards.sha256_of(base.source.entries[key])) != info["sha256"]
        ):
            return f"tensor '{key}' differs (sha256 mismatch)"
    return None


def _structural_difference(recorded: dict, base: BaseCheckpoint) -> tuple[str, str] | None:
    """(tensor key or file name, what differs) for the first difference between `base` and the cheap facts of
    `recorded`: file sizes (of the files `base` has under the recorded names), every recorded tensor's presence,
    dtype, shape and sampled bytes. The full sha256 are not checked here."""
    for name, size in sorted((recorded.get("files") or {}).items()):
        path = base.dir / name
        if path.is_file() and path.stat().st_size != size:
            return name, f"{path} is {path.stat().st_size} bytes"
    for key, info in sorted((recorded.get("tensors") or {}).items()):
        entry = base.source.entries.get(key)
        if entry is None:
            return key, f"tensor '{key}' is missing"
        if shards.DTYPE_NAMES[entry.dtype] != info["dtype"] or list(entry.shape) != info["shape"]:
            return key, f"tensor '{key}' is {shards.DTYPE_NAMES[entry.dtype]} {list(entry.shape)}"
        if "sample_sha256" in info and sample_sha256(entry) != info["sample_sha256"]:
            return key, f"tensor '{key}' differs (its sampled bytes)"
    return None


def read_run_base_record(run_dir: Path) -> dict | None:
    path = Path(run_dir) / RUN_BASE_FILE
    if not path.exists():
        return None  # a run from before base.json, or trained from the hub: nothing recorded
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UsafError(f"{path} is unreadable ({err}); the run's record of its base is damaged.") from None


def run_base_dir(run_dir: Path, base_dir: str | Path | None = None) -> Path:
    """The full-precision checkpoint a run trained on: --base, else the run's model.path (for a prepared quantized
    store, the checkpoint it was prepared from)."""
    if base_dir is not None:
        return Path(base_dir)
    config_file = Path(run_dir) / "config.yaml"
    if not config_file.exists():
        raise UsafError(
            f"{run_dir} has no config.yaml: is it a usaf run directory? Pass --base MODEL_DIR otherwise."
        )
    import yaml

    path = ((yaml.safe_load(config_file.read_text()) or {}).get("model") or {}).get("path") or ""
    model_path = Path(path)
    store = model_path / STORE_FILE
    if store.exists():
        model_path = Path(json.loads(store.read_text())["source"]["dir"])
    if not (model_path / "config.json").is_file():
        raise UsafError(
            f"The run in {run_dir} trained on {path!r}, which is not a local model directory (now); pass --base "
            "MODEL_DIR with the full-precision checkpoint it was trained from."
        )
    return model_path


def delta_from_run(run_dir: str | Path) -> Delta:
    """The trained entries and routers of a run's latest finished checkpoint."""
    run_dir = Path(run_dir)
    if run_dir.is_file():
        raise UsafError(f"{run_dir} is a file, not a run directory; pass the --out folder of `usaf train`.")
    if not run_dir.is_dir():
        raise UsafError(f"Run directory {run_dir} does not exist; pass the --out folder of `usaf train`.")
    latest = checkpoint.latest(run_dir)
    if latest is None:
        raise UsafError(
            f"{run_dir} has no finished checkpoint (checkpoints/step-*/state.json): train it first, or resume it "
            "with `usaf train --resume` until it saves one."
        )
    saved = checkpoint.load(latest)
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
        changes[name] = _sorted_change(flat, values)
        claimed.update(k for k in trainable if k.startswith(prefix))
    for key, value in trainable.items():
        if key in claimed:
            continue
        if ".usaf." in key:
            raise UsafError(
                f"Checkpoint {latest} holds '{key}' but no selection layout for it (made by an older usaf); "
                "resume the run for one step with this version to re-save it."
            )
        changes[key] = TensorChange(None, value.reshape(-1))  # a router (or other dense trainable parameter)
    summary_file = run_dir / "summary.json"
    info = {
        "source": {"run_dir": str(run_dir.resolve()), "checkpoint": latest.name, "step": saved.get("step")},
        "training": json.loads(summary_file.read_text()) if summary_file.exists() else None,
    }
    return Delta(changes, info, base_record=read_run_base_record(run_dir), origin=f"the run {run_dir}")


def _sorted_change(flat: torch.Tensor, values: torch.Tensor) -> TensorChange:
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
    check_output_file(out_path, force)
    tensors: dict[str, torch.Tensor] = {}
    described: dict[str, dict] = {}
    checksums: dict[str, dict] = {}
    for name in sorted(delta.changes):
        change = delta.changes[name]
        shape, base_dtype = base.shape(name), base.dtype(name)
        numel = torch.Size(shape).numel()
        values_dtype = torch.float32 if fp32 else base_dtype
        flat = change.flat_indices if change.flat_indices is not None else torch.arange(numel)
        if change.count != flat.numel() or (flat.numel() and int(flat.max()) >= numel):
            raise UsafError(
                f"The trained entries of '{name}' do not fit its shape {list(shape)} in {base.dir}."
            )
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
        described[name] = entry
        for key in entry["source_tensors"]:
            source_entry = base.source.entries[key]
            checksums[key] = {
                "file": source_entry.file.name,
                "dtype": shards.DTYPE_NAMES[source_entry.dtype],
                "shape": list(source_entry.shape),
                "sha256": base.sha256(key),
            }
            want = ((delta.base_record or {}).get("tensors") or {}).get(key, {}).get("sha256")
            if want is not None and checksums[key]["sha256"] != want:
                raise UsafError(_checksum_message(key, source_entry.file, delta.origin))
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
    from safetensors.torch import save_file

    atomic_file(out_path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
    return out_path


def read_delta(path: str | Path) -> Delta:
    """A delta file, checked: a truncated or altered file fails here, naming the file."""
    path = Path(path)
    if not path.is_file():
        raise UsafError(f"Delta file {path} does not exist.")
    try:
        entries, metadata = shards.read_header(path)
    except UsafError as err:
        raise UsafError(f"{err} ({path} is a usaf delta: export it again.)") from None
    if metadata.get("format") != DELTA_FORMAT:
        raise UsafError(f"{path} is not a usaf delta file (made by `usaf export --delta`).")
    try:
        info = json.loads(metadata["usaf"])
    except (KeyError, json.JSONDecodeError) as err:
        raise UsafError(
            f"{path} is corrupted: its usaf metadata is unreadable ({err}); export it again."
        ) from None
    if int(info.get("format_version", 0)) > DELTA_FORMAT_VERSION:
        raise UsafError(
            f"{path} is a delta of format version {info.get('format_version')} (usaf {info.get('usaf_version')}); "
            f"this usaf {__version__} reads version {DELTA_FORMAT_VERSION}: upgrade usaf."
        )
    tensors = {name: shards.read_tensor(entry) for name, entry in entries.items()}
    if _payload_digest(tensors) != info.get("payload_sha256"):
        raise UsafError(
            f"{path} is corrupted: its tensors do not match the checksum recorded when it was written; export it "
            "again."
        )
    changes = {}
    try:
        for name, entry in info["changes"].items():
            if entry["kind"] == "full":
                changes[name] = TensorChange(None, tensors[f"{name}:full"].reshape(-1))
            else:
                changes[name] = TensorChange(
                    tensors[f"{name}:flat_indices"].to(torch.int64), tensors[f"{name}:values"].reshape(-1)
                )
    except KeyError as err:
        raise UsafError(f"{path} is corrupted: it lacks tensor {err}; export it again.") from None
    return Delta(changes, info, base_record=info.get("base"), origin=str(path))


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


def export_merged(
    run_dir: str | Path, out_dir: str | Path, *, force: bool = False, base_dir: str | Path | None = None
) -> Path:
    """`usaf export RUN_DIR --merged OUT_DIR`: the base checkpoint with the run's trained entries written in."""
    check_output_dir(Path(out_dir), base_dir, force)
    delta, base = run_delta_and_base(run_dir, base_dir)
    return write_merged(base, delta, out_dir, force=force)


def run_delta_and_base(
    run_dir: str | Path, base_dir: str | Path | None = None
) -> tuple[Delta, BaseCheckpoint]:
    """A run's delta and the base to write it against (--base or the run's own), checked as `usaf apply` checks
    a delta file's base: the same `check_base`, and the recorded checksums while writing."""
    delta = delta_from_run(run_dir)
    base = BaseCheckpoint(run_base_dir(Path(run_dir), base_dir))
    check_base(delta, base)
    return delta, base


def apply_delta(
    base_dir: str | Path, delta_path: str | Path, out_dir: str | Path, *, force: bool = False
) -> Path:
    """`usaf apply BASE_DIR DELTA OUT_DIR`: a merged checkpoint from a base and a delta file made against it."""
    check_output_dir(Path(out_dir), base_dir, force)
    delta = read_delta(delta_path)
    base = BaseCheckpoint(base_dir)
    check_base(delta, base)
    return write_merged(base, delta, out_dir, force=force)


def check_base(delta: Delta, base: BaseCheckpoint) -> None:
    """Cheap checks that `base` is the model `delta` was made against, for a delta file (`usaf apply`, load_delta)
    and a run (`usaf export`) alike: model type, every recorded tensor's presence, dtype, shape and sampled bytes,
    the shard files' sizes. The recorded full sha256 (of the tensors that can hold trained entries) are verified as
    the changed tensors are read."""
    recorded, delta_path = delta.base_record, delta.origin
    if recorded is None:
        return  # a run from before base.json (or trained from the hub): nothing to compare against
    model_type = getattr(base.config, "model_type", None)
    if recorded.get("model_type") != model_type:
        raise UsafError(
            f"{delta_path} was made for a {recorded.get('model_type')} model, but {base.dir} is {model_type}; use "
            "the model it was trained from."
        )
    for name, entry in (delta.info.get("changes") or {}).items():
        if list(base.shape(name)) != entry["shape"]:
            raise UsafError(
                f"{delta_path} changes '{name}' of shape {entry['shape']}, but in {base.dir} it is "
                f"{list(base.shape(name))}; use the model it was trained from."
            )
    found = _structural_difference(recorded, base)
    if found is None:
        return
    key, what = found
    entry = base.source.entries.get(key)
    info = (recorded.get("tensors") or {}).get(key)
    if info is None:  # a shard file of another size
        raise UsafError(
            f"{delta_path} was made against a base whose shard {key} is {recorded['files'][key]} bytes, but "
            f"{what}: this is another model or a modified copy. Use the exact checkpoint it was made from."
        )
    if (
        entry is None
        or shards.DTYPE_NAMES[entry.dtype] != info["dtype"]
        or list(entry.shape) != info["shape"]
    ):
        raise UsafError(
            f"{delta_path} was made against a base whose tensor '{key}' is {info['dtype']} {info['shape']}; "
            f"{base.dir} {'lacks it' if entry is None else 'differs'}. Use the model it was trained from."
        )
    raise UsafError(_checksum_message(key, entry.file, delta_path, "its first and last bytes differ"))


def verify_checksums(delta: Delta, base: BaseCheckpoint) -> None:
    """The full sha256 of exactly the tensors recorded with one (a delta's changed tensors, a run's trained ones);
    the others are compared by `check_base`'s cheap facts."""
    for key, info in ((delta.base_record or {}).get("tensors") or {}).items():
        if "sha256" in info and base.sha256(key) != info["sha256"]:
            raise UsafError(_checksum_message(key, base.source.entries[key].file, delta.origin))


def _checksum_message(key: str, file: Path, delta_path: Path | str, how: str = "sha256 mismatch") -> str:
    return (
        f"Tensor '{key}' in {file} differs from the base {delta_path} was trained on ({how}): this is another "
        "model or a modified copy. Use the exact checkpoint it was made from."
    )


# ---- merged checkpoints ------------------------------------------------------------------------------------------


def write_merged(
    base: BaseCheckpoint,
    delta: Delta,
    out_dir: str | Path,
    *,
    force: bool = False,
) -> Path:
    """Stream `base`'s shards into `out_dir` with the entries of `delta` replaced (cast to each tensor's dtype).

    The changed tensors must match the checksums of `delta.base_record` (a delta file's, a run's base.json);
    checked as they are read, and a mismatch abandons the output.
    """
    out_dir = Path(out_dir)
    check_output_dir(out_dir, base.dir, force)
    edits = _edits_by_checkpoint_key(base, delta)
    expected = (delta.base_record or {}).get("tensors")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out_dir)
    tmp = temporary_name(out_dir)
    tmp.mkdir()
    try:
        report: dict[str, dict] = {}
        for file in base.shard_files():
            _write_shard(base.dir / file, tmp / file, edits, expected, report, delta.origin)
        missing = sorted(set(edits) - set(report))
        if missing:
            raise UsafError(f"Tensor '{missing[0]}' was not found in the shards of {base.dir}.")
        copy_side_files(base.dir, tmp, keep_shard_index=True, skip=(MERGED_METADATA_FILE,))
        metadata = {
            "format": "usaf-merged",
            "usaf_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "base": base.identity(),
            **{k: v for k, v in delta.info.items() if k in ("source", "training")},
            "changed_parameters": {
                name: "all" if change.flat_indices is None else change.count
                for name, change in delta.changes.items()
            },
            "changed_tensors": report,
        }
        # written last, so that a folder holding it is complete
        write_json(tmp / MERGED_METADATA_FILE, metadata)
        fsync_dir(tmp)
        install_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _edits_by_checkpoint_key(
    base: BaseCheckpoint, delta: Delta
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{checkpoint key: (sorted positions, values in that tensor's dtype)}."""
    pieces: dict[str, list] = {}
    for name, change in delta.changes.items():
        numel = torch.Size(base.shape(name)).numel()
        flat = change.flat_indices if change.flat_indices is not None else torch.arange(numel)
        if change.count != flat.numel():
            raise UsafError(f"The delta for '{name}' has {change.count} values for {flat.numel()} entries.")
        for key, positions, picked in base.locate(name, flat):
            dtype = base.source.entries[key].dtype
            pieces.setdefault(key, []).append((positions, change.values[picked].to(dtype)))
    edits = {}
    for key, parts in pieces.items():
        positions = torch.cat([p for p, _ in parts])
        values = torch.cat([v for _, v in parts])
        order = torch.argsort(positions)
        edits[key] = (positions[order], values[order])
    return edits


def _write_shard(
    source: Path, target: Path, edits: dict, expected: dict | None, report: dict, origin: str
) -> None:
    """Copy one safetensors file tensor by tensor, in bounded chunks, replacing the edited entries."""
    entries, metadata = shards.read_header(source)
    planned = [shards.PlannedTensor(name, e.dtype, e.shape) for name, e in entries.items()]
    writer = shards.StreamingWriter(target, planned, metadata)
    try:
        for name, entry in entries.items():
            edit = edits.get(name)
            before = hashlib.sha256() if edit is not None else None
            after = hashlib.sha256() if edit is not None else None
            itemsize = entry.dtype.itemsize
            step = max(1, _CHUNK_BYTES // itemsize) * itemsize
            for begin in range(entry.begin, entry.end, step):
                end = min(begin + step, entry.end)
                raw = shards.read_bytes(entry, begin, end, before)
                if edit is not None:
                    _apply_edit(raw, entry.dtype, (begin - entry.begin) // itemsize, edit)
                    after.update(raw.numpy())
                writer.write(name, raw, begin - entry.begin)
            if edit is None:
                continue
            digest = before.hexdigest()
            want = (expected or {}).get(name, {}).get("sha256")
            if want is not None and digest != want:
                raise UsafError(_checksum_message(name, source, origin))
            report[name] = {
                "file": source.name,
                "dtype": shards.DTYPE_NAMES[entry.dtype],
                "shape": list(entry.shape),
                "changed_entries": int(edit[0].numel()),
                "base_sha256": digest,
                "merged_sha256": after.hexdigest(),
            }
    except BaseException:
        writer.file.close()
        raise
    writer.close()


def _apply_edit(raw: torch.Tensor, dtype: torch.dtype, first: int, edit) -> None:
    positions, values = edit
    count = raw.numel() // dtype.itemsize
    lo, hi = torch.searchsorted(positions, torch.tensor([first, first + count])).tolist()
    if hi > lo:
        raw.view(dtype)[positions[lo:hi] - first] = values[lo:hi]


# ---- applying a delta to a loaded model ----------------------------------------------------------------------------


@torch.no_grad()
def load_delta(model: nn.Module, path: str | Path, base_dir: str | Path | None = None) -> nn.Module:
    """Apply a delta file to a loaded transformers model, for inference; returns the model.

    A plain model gets the trained values written into its parameters (cast to their dtype). A model prepared by
    `usaf.prepare_model` (quantized base or not) gets them as its trained values: the engine writes them over the
    frozen base in every forward. base_dir: also verify the checksums of the checkpoint the model was loaded from.
    """
    from .prepare import sparse_modules

    path = Path(path)
    delta = read_delta(path)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type is not None and delta.info["base"].get("model_type") not in (None, model_type):
        raise UsafError(
            f"{path} was made for a {delta.info['base']['model_type']} model; this model is {model_type}."
        )
    if base_dir is not None:
        base = BaseCheckpoint(base_dir)
        check_base(delta, base)
        verify_checksums(delta, base)
    prepared = dict(sparse_modules(model))
    for name, change in delta.changes.items():
        shape = delta.info["changes"][name]["shape"]
        module_path, _, attr = name.rpartition(".")
        state = prepared.get(module_path)
        if state is not None and attr in state.stores:
            _load_into_entries(state, attr, change, name, path)
            continue
        try:
            tensor = model.get_parameter(name)
        except AttributeError:
            raise UsafError(f"{path} changes '{name}', which this model does not have.") from None
        if list(tensor.shape) != shape:
            raise UsafError(
                f"{path} changes '{name}' of shape {shape}; this model's is {list(tensor.shape)}."
            )
        _write_entries(tensor.data, change, name)
    return model


def _write_entries(tensor: torch.Tensor, change: TensorChange, name: str) -> None:
    if change.flat_indices is None:
        tensor.copy_(change.values.reshape(tensor.shape).to(tensor.dtype))
        return
    if not tensor.is_contiguous():
        raise UsafError(f"'{name}' is not contiguous in this model; load it with contiguous weights.")
    flat = tensor.view(-1)
    flat[change.flat_indices.to(flat.device)] = change.values.to(device=flat.device, dtype=flat.dtype)


def _load_into_entries(state, attr: str, change: TensorChange, name: str, path: Path) -> None:
    """Make `change` the trained values of a prepared experts tensor (its selection becomes the delta's)."""
    store = state.stores[attr]
    numel = store.shape[0] * store.shape[1] * store.shape[2]
    flat = change.flat_indices if change.flat_indices is not None else torch.arange(numel)
    if flat.numel() and int(flat.max()) >= numel:
        raise UsafError(f"{path} changes entries of '{name}' beyond its shape {list(store.shape)}.")
    values = change.values.reshape(-1)
    old = state[attr] if attr in state else None  # noqa: SIM401 (ModuleDict has no .get)
    if old is not None:
        current = old.expanded_flat_indices().cpu()
        order = torch.argsort(current)
        if current.numel() == flat.numel() and torch.equal(current[order], flat):
            reordered = torch.empty(flat.numel(), dtype=old.values.dtype)
            reordered[order] = values.to(old.values.dtype)
            old.values.data.copy_(reordered.view_as(old.values))
            state.write_resident()
            return
        if store.resident:
            # the old selection was written into the model's own weights: put the base back there first
            old.values.data.copy_(old.base_values.to(old.values.dtype).view_as(old.values))
            old.write_into(store.full(), None)
    entries = ElementEntries(
        store.shape, flat.to(store.device), store.read(flat.to(store.device)), keep_base=store.resident
    )
    entries.values.data.copy_(values.to(entries.values.dtype).view_as(entries.values))
    entries.values.requires_grad_(old.values.requires_grad if old is not None else False)
    state[attr] = entries.to(store.device)
    state.write_resident()


# ---- Hugging Face Trainer checkpoints ----------------------------------------------------------------------------


def delta_from_trainer_checkpoint(
    checkpoint_dir: str | Path,
    base_model_dir: str | Path,
    out_path: str | Path,
    *,
    fp32: bool = False,
    force: bool = False,
) -> Path:
    """Turn the model a `transformers.Trainer` (or TRL) checkpoint saved for a model prepared by usaf into a usaf delta
    file against `base_model_dir`, the checkpoint the model was loaded from. Returns `out_path`."""
    base = BaseCheckpoint(base_model_dir)
    delta = trainer_checkpoint_delta(checkpoint_dir, base)
    return write_delta(delta, base, out_path, fp32=fp32, force=force)


def trainer_checkpoint_delta(checkpoint_dir: str | Path, base: BaseCheckpoint) -> Delta:
    """The trained entries (saved by the prepared model as `<experts>.usaf.<tensor>.*`) and the routers that differ
    from the base, from a checkpoint written by `save_pretrained` (Trainer saves through it)."""
    from .source import list_shards

    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise UsafError(f"Trainer checkpoint {checkpoint_dir} does not exist.")
    saved = list_shards(checkpoint_dir)
    selections = _usaf_keys_by_tensor(saved, base, checkpoint_dir)
    if not selections:
        raise UsafError(
            f"{checkpoint_dir} holds no usaf trained entries: was the model prepared with usaf.prepare_model before "
            "training, and is this the checkpoint folder (checkpoint-N) the Trainer wrote?"
        )
    layers = {layer.experts_name: layer for layer in base.layers}
    changes = {}
    for (path, tensor), keys in sorted(selections.items()):
        values = shards.read_tensor(saved[keys["values"]]).float()
        shape = base.shape(f"{path}.{tensor}")
        shape3 = shape if len(shape) == 3 else (shape[0], 1, shape[1])
        if "flat_indices" in keys:
            flat = shards.read_tensor(saved[keys["flat_indices"]])
        elif "line_ids" in keys:
            axis = _line_axis(layers[path], tensor, shape3, values.shape[-1], checkpoint_dir)
            flat = line_flat_indices(shape3, axis, shards.read_tensor(saved[keys["line_ids"]]))
        else:
            raise UsafError(f"{checkpoint_dir} has values for {path}.{tensor} but no selection for them.")
        changes[f"{path}.{tensor}"] = _sorted_change(flat, values)
    for layer in base.layers:
        if layer.router is None:
            continue
        for param_name, _ in layer.router.named_parameters():
            name = f"{layer.router_name}.{param_name}"
            trained = base.read(name, saved, checkpoint_dir)
            if not torch.equal(trained, base.read(name)):
                changes[name] = TensorChange(None, trained.reshape(-1))
    state_file = checkpoint_dir / "trainer_state.json"
    step = json.loads(state_file.read_text()).get("global_step") if state_file.exists() else None
    return Delta(changes, {"source": {"trainer_checkpoint": str(checkpoint_dir.resolve()), "step": step}})


def _usaf_keys_by_tensor(
    saved: dict, base: BaseCheckpoint, where: Path
) -> dict[tuple[str, str], dict[str, str]]:
    """{(experts module path in the model, tensor name): {buffer or parameter name: saved key}}.

    save_pretrained renames keys back into the checkpoint's own layout (e.g. Mixtral's `.mlp.` becomes
    `.block_sparse_moe.`); the model's own renamings bring the experts path back."""
    from transformers.core_model_loading import apply_renamings

    from .prepare import model_renamings

    renamings = model_renamings(base.skeleton)
    found: dict[tuple[str, str], dict[str, str]] = {}
    for key in saved:
        if ".usaf." not in key:
            continue
        owner, _, rest = key.partition(".usaf.")
        tensor, _, part = rest.rpartition(".")
        path = owner
        if f"{path}.{tensor}" not in base.source.targets:
            path = apply_renamings(key, renamings).partition(".usaf.")[0]
        if f"{path}.{tensor}" not in base.source.targets:
            raise UsafError(
                f"'{key}' in {where} belongs to no weight of the model in {base.dir}: pass the base the "
                "Trainer's model was loaded from."
            )
        found.setdefault((path, tensor), {})[part] = key
    return found


def _line_axis(layer, tensor: str, shape3, line_length: int, where: Path) -> int:
    """Which axis whole-line selections run along: rows hold B entries, columns A. When A == B, usaf's neurons
    decide (rows of the input projection and columns of down, transposed for transposed layouts)."""
    _, rows_a, cols_b = shape3
    if rows_a != cols_b:
        if line_length not in (rows_a, cols_b):
            raise UsafError(
                f"{where}: lines of {line_length} values do not fit {layer.experts_name}.{tensor}."
            )
        return 1 if line_length == cols_b else 2
    is_input = tensor != "down_proj"
    return (2 if is_input else 1) if layer.experts.is_transposed else (1 if is_input else 2)


# ---- files and folders -------------------------------------------------------------------------------------------


def check_output_dir(out_dir: Path, base_dir: str | Path | None, force: bool) -> None:
    if base_dir is not None:
        base = Path(base_dir).resolve()
        if out_dir.resolve() == base or out_dir.resolve() in base.parents:
            raise UsafError(
                f"The output {out_dir} would replace the base checkpoint {base_dir}; choose another one."
            )
    if out_dir.exists() and not force:
        raise UsafError(
            f"{out_dir} already exists; choose another output directory or pass --force to replace it."
        )
    if out_dir.exists() and not out_dir.is_dir():
        raise UsafError(f"{out_dir} exists and is not a directory; remove it or choose another output.")


def check_output_file(out_path: Path, force: bool) -> None:
    if out_path.exists() and not force:
        raise UsafError(
            f"{out_path} already exists; choose another output file or pass --force to replace it."
        )
    if out_path.is_dir():
        raise UsafError(
            f"{out_path} is a directory; the delta is one file, e.g. {out_path / 'delta.safetensors'}."
        )
