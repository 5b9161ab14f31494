"""Loading the prepared store (`usaf.base.writer` writes it) back as a trainable model.

`load_prepared` builds the model skeleton on the meta device, materialises the dense weights, gives every expert
tensor a `QuantizedStore` (on the device, in host memory or memory-mapped), and calls `prepare_model`, initialising
the trained values from the source checkpoint's original full-precision weights when it is given.
"""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from usaf.base.writer import ensure_prepared, file_stamp, files_of_entry
from usaf.config import RESIDENCIES, ModelSection, UsafConfig
from usaf.engine import expert_parallel
from usaf.engine.state import PreparedStore, model_state
from usaf.errors import ConfigError, ModelError
from usaf.files import STORE_FILE
from usaf.io import published, shards
from usaf.io.guard import inside
from usaf.io.model_source import read_store_metadata, store_source
from usaf.io.source import SourceCheckpoint
from usaf.model.hf import build_skeleton, compute_missing_buffers, load_config, mark_loaded
from usaf.model.layout import expert_weight_names, find_moe_layers
from usaf.prepare import enable_recomputation, prepare_model
from usaf.quant import PUBLISHED, default_device, get_format
from usaf.selection import across_ranks
from usaf.store.dense import StoredExpertTensor
from usaf.store.offload import LayerStreamer, ResidentParts, StreamedParts, host_copy
from usaf.store.quantized import QuantizedStore

# ---- loading --------------------------------------------------------------------------------------------------


def load_for_training(
    model: ModelSection,
    select: UsafConfig,
    device: torch.device,
    dtype: torch.dtype | None,
    calibration_batches=None,
    recompute: bool = False,
):
    """The model `usaf train` trains when `model.quant` is not "none", or when model.path is a prepared store or a
    published MXFP4/FP8 checkpoint (`model`: the run's model section; `select`: what to train).

    `model.path` is either a prepared store (used as it is; the trained values start from the checkpoint it was
    prepared from, when that is still there) or a checkpoint directory (prepared now at `model.quant`, or taken
    from the cache of earlier preparations).
    """
    path = Path(model.path)
    if (path / STORE_FILE).exists():
        store = path
        metadata = read_store_metadata(store)
        # another format named: refused
        store_source(str(store), str(store.resolve()), metadata).quant_for(model.quant)
        recorded = Path(metadata["source"]["dir"])
        source = recorded if (recorded / "config.json").exists() else None
        # a published format's dequantized base is the original: nothing is lost without the source
        if source is None and metadata["quant"] not in PUBLISHED:
            warnings.warn(
                f"{recorded}, the checkpoint {store} was prepared from, is gone: the trained values start from the "
                "dequantized base rather than the original weights.",
                stacklevel=2,
            )
    elif path.is_dir():
        quant = published.quant_for(
            path, model.fixed_quant
        )  # an auto no plan resolved: as transformers loads
        store, source = _prepared_once(path, quant), path
    else:
        raise ModelError(
            f"model.path {str(path)!r} is not a local directory; a quantized base is prepared from a local "
            "checkpoint (download it first, e.g. with `hf download`)."
        )
    return load_prepared(
        store,
        source,
        select,
        device=device,
        dtype=dtype,
        residency=model.fixed_residency,
        cache_mb=model.fixed_cache_mb,
        calibration_batches=calibration_batches,
        recompute=recompute,
    )


def _prepared_once(path: Path, quant: str) -> Path:
    """`ensure_prepared`, rank 0 first under torchrun: the others then take the store from the cache."""
    return across_ranks.main_first(lambda: ensure_prepared(path, quant, progress=across_ranks.is_main()))


def load_prepared(
    prepared_dir: str | Path,
    source_dir: str | Path | None = None,
    config: UsafConfig | None = None,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    residency: str = "device",
    cache_mb: int = 0,
    calibration_batches=None,
    recompute: bool = False,
) -> nn.Module:
    """A sparsely trainable model on a prepared (quantized) frozen base.

    source_dir: the full-precision checkpoint the store was prepared from. When given, its tensors are checked
        against the store's checksums and the trained values start from its original weights; without it they
        start from the dequantized base.
    device: the compute device (default: the accelerator torch sees, else the CPU).
    dtype: the compute dtype (default: the checkpoint's).
    residency: where the experts' quantized data lives: "device", "host" (streamed per layer, next layer
        prefetched) or "mmap" (memory-mapped from the store, streamed the same way).
    cache_mb: for "host"/"mmap", device memory for keeping the most-routed experts resident.
    calibration_batches: passed to `prepare_model` (selection strategies that look at data).
    recompute: per-layer recomputation (`usaf.enable_recomputation`), on before calibration runs.
    """
    prepared_dir = Path(prepared_dir)
    metadata = read_store_metadata(prepared_dir)
    if residency not in RESIDENCIES:
        raise ConfigError(f"residency must be one of {RESIDENCIES}, got {residency!r}.")
    device = torch.device(device) if device is not None else default_device()
    entries = _store_entries(prepared_dir, metadata)
    tensors = metadata["tensors"]
    if dtype is None:
        dtype = _checkpoint_dtype(tensors)
    model = build_skeleton(load_config(prepared_dir), dtype)
    experts = _stored_experts(model, tensors, prepared_dir)
    source = _open_source(Path(source_dir), metadata, model, experts) if source_dir is not None else None

    _load_dense(model, entries, tensors, device)
    streamer = LayerStreamer(device, cache_mb << 20) if residency != "device" else None
    stores = _install_expert_stores(model, experts, entries, tensors, residency, device, streamer)

    model.tie_weights()
    compute_missing_buffers(model)
    leftover = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if leftover:
        raise ModelError(f"The store in {prepared_dir} lacks {leftover[:3]}; prepare it again.")
    model.to(device)  # buffers the model computed itself
    original_values = None
    if source is not None:

        def original_values(key: str, flat_indices: torch.Tensor) -> torch.Tensor:
            return source.read_entries(key, flat_indices).to(flat_indices.device)

    if recompute:
        enable_recomputation(model)
    prepare_model(
        model, config, stores=stores, original_values=original_values, calibration_batches=calibration_batches
    )
    if source is not None:
        source.verify_partial_reads()
    model_state(model).store = PreparedStore(str(prepared_dir.resolve()), metadata, streamer)
    return model


def _stored_experts(model: nn.Module, tensors: dict, prepared_dir: Path) -> dict[str, int]:
    """{name of each of the model's expert weights: its MoE layer's ordinal}, each of which the store must hold."""
    experts = expert_weight_names(find_moe_layers(model))
    missing = sorted(set(experts) - {n for n, t in tensors.items() if t["kind"] == "experts"})
    if missing:
        raise ModelError(
            f"The store in {prepared_dir} has no expert tensor '{missing[0]}'; prepare it again."
        )
    return experts


def _load_dense(model: nn.Module, entries: dict, tensors: dict, device: torch.device) -> None:
    """The dense weights and buffers the store holds, read into the skeleton on `device` in their own dtype."""
    owned = dict(model.named_parameters())
    owned.update(model.named_buffers())
    for name, info in tensors.items():
        if info["kind"] == "dense":
            value = _read_dense(entries, name, info)
            _set_tensor(model, name, value.to(device=device, dtype=owned[name].dtype))


def _install_expert_stores(
    model, experts: dict, entries: dict, tensors: dict, residency, device, streamer
) -> dict:
    """Every expert tensor of the skeleton replaced by a `QuantizedStore` over its parts (resident, or streamed
    by `streamer`): {tensor name: store}."""
    stores = {}
    ep = expert_parallel.layout()
    for name, layer in experts.items():
        info = tensors[name]
        parts = {key.rsplit(":", 1)[1]: entries[key] for key in info["stored"]}
        # an expert-parallel rank reads only its experts' bytes
        expert_parallel.check_experts(info["shape"][0], name)
        owned = ep.owned(info["shape"][0]) if ep is not None else range(info["shape"][0])
        loaded = {part: _read_part(entry, residency, device, owned) for part, entry in parts.items()}
        holder = ResidentParts(loaded) if streamer is None else StreamedParts(loaded, streamer, layer)
        module_path, _, attr = name.rpartition(".")
        experts_module = model.get_submodule(module_path)
        store = QuantizedStore(
            info["format"],
            holder,
            tuple(info["shape"]),
            getattr(experts_module, attr).dtype,
            info.get("constants"),
            owned,
        )
        del experts_module._parameters[
            attr
        ]  # the meta parameter goes: nothing can compute with it by accident
        setattr(experts_module, attr, StoredExpertTensor(store, name))
        stores[name] = store
    return stores


def _checkpoint_dtype(tensors: dict) -> torch.dtype:
    counts = Counter(t["dtype"] for t in tensors.values() if shards.DTYPES[t["dtype"]].is_floating_point)
    return shards.DTYPES[counts.most_common(1)[0][0]] if counts else torch.float32


def _store_entries(prepared_dir: Path, metadata: dict) -> dict[str, shards.TensorEntry]:
    """Every stored tensor, with each file checked against its recorded size (a truncated store fails here)."""
    entries = {}
    for file, info in metadata["files"].items():
        path = inside(prepared_dir, file, f"{prepared_dir / STORE_FILE}'s files")
        if not path.exists():
            raise ModelError(f"{path} is missing from the prepared store; prepare it again.")
        if path.stat().st_size != info["size"]:
            raise ModelError(
                f"{path} has {path.stat().st_size} bytes, the store recorded {info['size']}: it is truncated or "
                "corrupted; prepare the store again."
            )
        found, _ = shards.read_header(path)
        entries.update(found)
    for info in metadata["tensors"].values():
        for key in info["stored"]:
            if key not in entries:
                raise ModelError(f"The prepared store {prepared_dir} lacks '{key}'; prepare it again.")
    return entries


def _read_dense(entries: dict, name: str, info: dict) -> torch.Tensor:
    if info["format"] == "none":
        return shards.read_tensor(entries[f"{name}:data"])
    parts = {key.rsplit(":", 1)[1]: shards.read_tensor(entries[key]) for key in info["stored"]}
    rows, cols = info["shape"]
    return get_format(info["format"]).dequantize(parts, rows, cols, torch.float32)[0]


def _read_part(entry: shards.TensorEntry, residency: str, device: torch.device, owned: range) -> torch.Tensor:
    """One quantized part ([E, ...]) of an expert tensor, only the `owned` experts' rows of it."""
    if entry.shape[0] < owned.stop:
        raise ModelError(f"'{entry.name}' in {entry.file} has {entry.shape[0]} experts, not {owned.stop}+.")
    whole = len(owned) == entry.shape[0]
    if residency == "mmap":
        from safetensors import safe_open

        with safe_open(entry.file, framework="pt") as f:  # zero-copy: pages come from the file as touched
            return f.get_tensor(entry.name) if whole else f.get_slice(entry.name)[owned.start : owned.stop]
    tensor = shards.read_tensor(entry) if whole else shards.read_experts(entry, owned.start, owned.stop)
    return tensor.to(device) if residency == "device" else host_copy(tensor, device)


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_path, _, attr = name.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    if attr in module._buffers:
        module._buffers[attr] = value
    else:
        module._parameters[attr] = value = nn.Parameter(value, requires_grad=False)
    mark_loaded(value)


def _open_source(source_dir: Path, metadata: dict, model: nn.Module, experts: dict) -> SourceCheckpoint:
    """The source checkpoint, checked against the store: same tensors, and the same bytes in every file that
    changed since preparation; tensors read later are checked as they are read."""
    if not source_dir.is_dir():
        raise ModelError(f"Source checkpoint {source_dir} does not exist.")
    source = SourceCheckpoint(source_dir, model, set(experts))
    recorded = metadata["source_tensors"]
    for key, info in recorded.items():
        entry = source.entries.get(key)
        if entry is None:
            raise ModelError(
                f"Tensor '{key}' (in {info['file']} when the store was prepared) is missing from {source_dir}; "
                "pass the checkpoint the store was prepared from."
            )
        if list(entry.shape) != info["shape"] or shards.DTYPE_NAMES[entry.dtype] != info["dtype"]:
            raise ModelError(
                f"Tensor '{key}' in {entry.file} is {shards.DTYPE_NAMES[entry.dtype]} {list(entry.shape)}, the store "
                f"was prepared from {info['dtype']} {info['shape']}; pass the checkpoint the store was prepared from."
            )
    source.expected_checksums = {key: info["sha256"] for key, info in recorded.items()}
    paths = {
        name: inside(source_dir, name, f"{STORE_FILE}'s source files") for name in metadata["source"]["files"]
    }
    changed = {
        name
        for name, stamp in metadata["source"]["files"].items()
        if not paths[name].exists() or file_stamp(paths[name]) != stamp
    }
    for key, info in recorded.items():
        if {info["file"], *(f.name for f in files_of_entry(source.entries[key]))} & changed:
            source.verify(key)
    return source
