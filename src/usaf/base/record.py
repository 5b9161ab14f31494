"""A run's record of the base it trains on (base.json): cheap facts of every tensor and the sha256 of those that can
hold trained entries, and how a base at hand differs from it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from usaf.base.checkpoint import BaseCheckpoint
from usaf.config import read_yaml
from usaf.errors import ModelError, RunStateError
from usaf.files import CONFIG_FILE, RUN_BASE_FILE, STORE_FILE
from usaf.io import shards
from usaf.io.guard import inside
from usaf.io.model_source import read_store_metadata

SAMPLE_BYTES = 4096  # a tensor that is not hashed whole is known by the sha256 of its first and last 4 KiB


def _base_and_store_checksums(model_dir) -> tuple[BaseCheckpoint, dict[str, str]]:
    """The checkpoint behind `model_dir` (itself, or the source a prepared store was made from) and the sha256
    per tensor the store recorded (none for a checkpoint)."""
    store = Path(model_dir) / STORE_FILE
    if not store.exists():
        return BaseCheckpoint(model_dir), {}
    metadata = read_store_metadata(store.parent)
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
    fine-tune or re-initialisation of the tensor changes. A derived tensor (a published weight): its parts'."""
    if isinstance(entry, shards.DerivedEntry):
        return hashlib.sha256("".join(sample_sha256(part) for part in entry.parts).encode()).hexdigest()
    spans = [(entry.begin, min(entry.end, entry.begin + SAMPLE_BYTES))]
    if entry.nbytes > SAMPLE_BYTES:
        spans.append((max(spans[0][1], entry.end - SAMPLE_BYTES), entry.end))
    hasher = hashlib.sha256()
    with open(entry.file, "rb") as f:
        for begin, end in spans:
            f.seek(begin)
            block = f.read(end - begin)
            if len(block) != end - begin:
                raise ModelError(
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
    found = structural_difference(recorded, base)
    if found is not None:
        return found[1]
    for key, info in sorted((recorded.get("tensors") or {}).items()):
        if (
            "sha256" in info
            and (known.get(key) or shards.sha256_of(base.source.entries[key])) != info["sha256"]
        ):
            return f"tensor '{key}' differs (sha256 mismatch)"
    return None


def structural_difference(recorded: dict, base: BaseCheckpoint) -> tuple[str, str] | None:
    """(tensor key or file name, what differs) for the first difference between `base` and the cheap facts of
    `recorded`: file sizes (of the files `base` has under the recorded names), every recorded tensor's presence,
    dtype, shape and sampled bytes. The full sha256 are not checked here."""
    for name, size in sorted((recorded.get("files") or {}).items()):
        path = inside(
            base.dir, name, "the record of the base (a run's base.json, a delta's metadata): its files"
        )
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
        record = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise RunStateError(
            f"{path} is unreadable ({err}); the run's record of its base is damaged."
        ) from None
    if not isinstance(record, dict):
        raise RunStateError(
            f"{path} holds a JSON {type(record).__name__}, not the run's record of its base (an object): it is "
            "damaged; restore it from a copy of the run."
        )
    return record


def run_base_dir(run_dir: Path, base_dir: str | Path | None = None) -> Path:
    """The full-precision checkpoint a run trained on: --base, else the run's model.path (for a prepared quantized
    store, the checkpoint it was prepared from)."""
    if base_dir is not None:
        return Path(base_dir)
    config_file = Path(run_dir) / CONFIG_FILE
    if not config_file.exists():
        raise RunStateError(
            f"{run_dir} has no config.yaml: is it a usaf run directory? Pass --base MODEL_DIR otherwise."
        )
    saved = read_yaml(config_file.read_text(), str(config_file))
    path = ((saved if isinstance(saved, dict) else {}).get("model") or {}).get("path") or ""
    model_path = Path(path)
    store = model_path / STORE_FILE
    if store.exists():
        model_path = Path(read_store_metadata(model_path)["source"]["dir"])
    if not (model_path / "config.json").is_file():
        raise ModelError(
            f"The run in {run_dir} trained on {path!r}, which is not a local model directory (now); pass --base "
            "MODEL_DIR with the full-precision checkpoint it was trained from."
        )
    return model_path
