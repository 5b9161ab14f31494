"""Writing the prepared store: a checkpoint streamed into a quantized frozen base.

`prepare_store` reads the source checkpoint one tensor (one expert, for fused expert stacks) at a time, quantizes
the experts per expert, and writes safetensors files plus `usaf_store.json` (formats, shapes, dtypes, the source
tensors' checksums, the usaf version). The store appears atomically: it is written into a hidden directory next to
the output and renamed into place only when complete. `ensure_prepared` keeps a cache of stores. Loading one back
is `usaf.base.load`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import ctypes
import functools
import hashlib
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from usaf.errors import ModelError, UsafError
from usaf.files import STORE_FILE, STORE_FORMAT_VERSION
from usaf.io import published, shards
from usaf.io.atomic import (
    atomic_dir,
    copy_side_files,
    write_json,
)
from usaf.io.source import SourceCheckpoint
from usaf.model.hf import build_skeleton, load_config
from usaf.model.layout import expert_weight_names, find_moe_layers
from usaf.quant import FORMATS, default_device, format_constants, get_format, resolve_format
from usaf.quant import int8 as int8_format
from usaf.version import __version__

DEFAULT_FILE_BYTES = 4 << 30
_PIECE_ELEMENTS = 1 << 18  # quantizers' temporaries are a few times this many values


# ---- the model skeleton ---------------------------------------------------------------------------------------


def _dense_linear_weights(model: nn.Module) -> set[str]:
    """Weights of the model's linear layers other than routers (trained) and the output head."""
    routers = {layer.router_name for layer in find_moe_layers(model)}
    head = model.get_output_embeddings()
    return {
        f"{path}.weight"
        for path, module in model.named_modules()
        if isinstance(module, nn.Linear) and module is not head and path not in routers
    }


# ---- preparing ------------------------------------------------------------------------------------------------


def prepare_store(
    model_dir: str | Path,
    out_dir: str | Path,
    quant: str = "nf4",
    quant_dense: bool = False,
    *,
    force: bool = False,
    device: torch.device | str | None = None,
    max_file_bytes: int = DEFAULT_FILE_BYTES,
    progress: bool = False,
    requantize_published: bool = False,
) -> Path:
    """Stream the safetensors checkpoint in `model_dir` into a prepared store at `out_dir`; returns `out_dir`.

    quant: expert format, "nf4" | "int8" | "int4" | "none" ("nf4" becomes "int4" where bitsandbytes has no
        kernels for `device`). A published MXFP4/FP8 checkpoint (`usaf.io.published`) keeps its own format
        whatever `quant` says: its experts' bytes are copied as published, its other quantized weights dequantized;
        with `requantize_published` (`usaf prepare --quant` given), its experts are dequantized one at a time and
        stored at `quant` instead (Qwen3-30B-A3B-FP8's 31 GB as a 16 GB NF4 store).
    quant_dense: also store the dense linear weights (attention, shared experts) as int8.
    device: where quantization runs (default: the accelerator torch sees, else the CPU).
    Peak memory is a small multiple of the largest single checkpoint tensor (one expert for stacked experts).
    """
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    device = torch.device(device) if device is not None else default_device()
    _check_output(model_dir, out_dir, force)
    if not (model_dir / "config.json").exists():
        raise ModelError(f"{model_dir} has no config.json; pass a Hugging Face model directory.")
    config = load_config(model_dir)
    method = published.checkpoint_method(model_dir)
    convert = method is not None and requantize_published and quant not in published.METHODS
    fmt_name = resolve_format(quant, device) if convert else _store_format(model_dir, method, quant, device)
    skeleton = build_skeleton(config)
    experts = expert_weight_names(find_moe_layers(skeleton))
    source = SourceCheckpoint(model_dir, skeleton, set(experts))
    dense_linear = _dense_linear_weights(skeleton) if quant_dense else set()
    tensors = _plan_tensors(source, experts, fmt_name, dense_linear, convert)
    if method is not None and not convert:
        constants = published.format_constants(published.read_config(model_dir))
        for info in tensors.values():
            if info["kind"] == "experts":
                info["constants"] = constants
    files = _assign_files(tensors, max_file_bytes)

    with atomic_dir(out_dir) as tmp:
        writers: dict[str, shards.StreamingWriter] = {}
        try:
            _open_writers(tmp, files, tensors, writers)
            _write_tensors(source, tensors, writers, device, progress, convert)
        except BaseException:  # the files closed before their folder is removed
            for writer in writers.values():
                with contextlib.suppress(Exception):
                    writer.file.close()
            raise
        for writer in writers.values():
            writer.close()
        used = sorted({key for info in tensors.values() for key in info["sources"]})
        checksums = source.finish_checksums(used)
        copy_side_files(model_dir, tmp, keep_shard_index=False)
        metadata = _metadata(model_dir, source, tensors, checksums, quant, fmt_name, quant_dense, tmp)
        write_json(tmp / STORE_FILE, metadata)
    return out_dir


def _open_writers(tmp: Path, files: dict, tensors: dict, writers: dict) -> None:
    """A streaming writer per file of the store, its tensors planned (and each tensor told its file)."""
    for file, names in files.items():
        planned = [
            shards.PlannedTensor(key, dtype, shape)
            for name in names
            for key, (dtype, shape) in tensors[name]["stored"].items()
        ]
        writers[file] = shards.StreamingWriter(tmp / file, planned, {"format": "usaf-store"})
        for name in names:
            tensors[name]["file"] = file


def _store_format(model_dir: Path, method: str | None, quant: str, device: torch.device) -> str:
    """The experts' format in the store: a published MXFP4/FP8 checkpoint keeps its own (the store holds their
    bytes as published); otherwise `quant`, resolved for `device`, which a published format never is."""
    if method is None and quant in published.METHODS:
        raise ModelError(
            f"{model_dir} is not a published {quant} checkpoint (its config.json has no quantization_config "
            f"{quant}); usaf reads {quant} as published and never quantizes into it: choose one of "
            f"{', '.join(FORMATS)}."
        )
    return method or resolve_format(quant, device)


def _check_output(model_dir: Path, out_dir: Path, force: bool) -> None:
    if out_dir.resolve() == model_dir.resolve() or model_dir.resolve() in out_dir.resolve().parents:
        raise UsafError(
            f"The prepared store {out_dir} must not be inside the checkpoint directory {model_dir}."
        )
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise UsafError(
            f"--out {out_dir} is a file, not a folder; choose another --out for the prepared store."
        )
    if not force:
        raise UsafError(f"{out_dir} already exists; choose another --out or pass --force to replace it.")
    if not (out_dir / STORE_FILE).exists() and any(out_dir.iterdir()):
        raise UsafError(
            f"{out_dir} exists and is not a usaf prepared store; refusing to replace it even with --force."
        )


def _plan_tensors(
    source: SourceCheckpoint, experts: dict[str, int], fmt: str, dense_linear: set[str], convert: bool = False
) -> dict:
    """Per model tensor: its format, shape, dtype, and the stored parts ({stored key: (dtype, shape)})."""
    tensors = {}
    for name, target in source.targets.items():
        shape = target.shape
        if name in experts:
            kind, fmt_name = "experts", fmt
            if source.published:  # the checkpoint's own parts, as its conversion fuses them
                layout = source.expert_part_shapes(name)
                _check_published_layout(source, name, layout)
            if convert or not source.published:
                layout = get_format(fmt).layout(shape[1], shape[2], target.dtype)
            stored = {f"{name}:{part}": (dtype, (shape[0], *s)) for part, (dtype, s) in layout.items()}
        elif name in dense_linear and len(shape) == 2:
            kind, fmt_name = "dense", "int8"
            layout = int8_format.layout(shape[0], shape[1], target.dtype)
            stored = {f"{name}:{part}": (dtype, tuple(s)) for part, (dtype, s) in layout.items()}
        else:
            kind, fmt_name = "dense", "none"
            stored = {f"{name}:data": (target.dtype, shape)}
        tensors[name] = {
            "kind": kind,
            "format": fmt_name,
            "shape": list(shape),
            "dtype": shards.DTYPE_NAMES[target.dtype],
            "group": target.group,
            "sources": source.source_keys(name),
            "stored": stored,
        }
        if kind == "experts":
            tensors[name]["layer"] = experts[name]
    return tensors


def _check_published_layout(source: SourceCheckpoint, name: str, layout: dict) -> None:
    """The fused experts' published parts must be what the format's dequantization reads: FP8 blocks that
    straddle the boundary of fused gate and up projections cannot be kept as published."""
    shape = source.targets[name].shape
    constants = published.format_constants(published.read_config(source.dir))
    block = constants.get("block")
    want = get_format(source.published).layout(
        shape[1], shape[2], torch.bfloat16, *([block] if block else [])
    )
    got = {part: tuple(s) for part, (_, s) in layout.items()}
    if got != {part: tuple(s) for part, (_, s) in want.items()}:
        raise ModelError(
            f"The published {source.published} parts of '{name}' in {source.dir} fuse into {got}, not the layout "
            f"{ {part: tuple(s) for part, (_, s) in want.items()} } that dequantization reads (quantization blocks "
            "straddle fused projections); usaf cannot keep them as published: use the bf16 checkpoint."
        )


def _assign_files(tensors: dict, max_file_bytes: int) -> dict[str, list[str]]:
    """Tensors into files of at most `max_file_bytes` (a bigger tensor gets a file of its own), in model order."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, info in tensors.items():
        nbytes = sum(shards.PlannedTensor(k, d, s).nbytes for k, (d, s) in info["stored"].items())
        if groups[-1] and size + nbytes > max_file_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    count = len(groups)
    return {f"usaf-{i + 1:05d}-of-{count:05d}.safetensors": names for i, names in enumerate(groups)}


def _write_tensors(
    source: SourceCheckpoint, tensors: dict, writers: dict, device, progress: bool, convert: bool = False
) -> None:
    names = list(tensors)
    if not progress:
        _write_each(source, tensors, writers, device, names, convert)
        return
    from tqdm import tqdm

    # on a terminal only (disable=None): a log file or pipe gets no bar to break into the lines that follow
    bar = tqdm(names, desc="usaf prepare", unit="tensor", file=sys.stderr, disable=None)
    try:
        _write_each(source, tensors, writers, device, bar, convert)
    except BaseException:
        bar.leave = False  # cleared: the error line that follows starts on a line of its own
        bar.close()
        raise
    bar.close()


def _write_each(source: SourceCheckpoint, tensors: dict, writers: dict, device, names, convert=False) -> None:
    done: set[str] = set()
    constants = published.format_constants(published.read_config(source.dir)) if convert else {}
    with _ExpertWorkers(device) as workers:
        for name in names:
            if name in done:
                continue
            _release_freed_memory()
            info = tensors[name]
            writer = writers[info["file"]]
            if info["kind"] == "experts":
                fmt = get_format(info["format"])
                num_experts = info["shape"][0]
                expert_bytes = {
                    key: _nbytes(dtype, shape[1:]) for key, (dtype, shape) in info["stored"].items()
                }
                for e in range(num_experts):
                    if source.published and not convert:  # copied as published: no re-quantization
                        for part, value in source.expert_parts(name, e).items():
                            key = f"{name}:{part}"
                            writer.write(key, value, e * expert_bytes[key])
                        continue
                    # read here, in order (checksums follow the reads); dequantized, checked, quantized and
                    # written by a worker
                    if convert:  # one published expert dequantized, then stored at the asked format
                        parts = {p: v.unsqueeze(0) for p, v in source.expert_parts(name, e).items()}
                        rows, cols = info["shape"][1], info["shape"][2]
                        weight = functools.partial(
                            get_format(source.published).dequantize,
                            parts,
                            rows,
                            cols,
                            torch.bfloat16,
                            **constants,
                        )
                    else:
                        weight = source.build_expert(name, e)
                    offsets = {key: e * size for key, size in expert_bytes.items()}
                    elements = info["shape"][1] * info["shape"][2]
                    workers.submit(
                        elements, _write_expert, source, name, e, weight, fmt, writer, offsets, device
                    )
                workers.wait()  # this tensor's experts written before the next tensor's are read
                source.release()  # a stack built for this tensor's experts is not needed for the next tensor
                done.add(name)
                continue
            for produced, value in source.build(info["group"]).items():  # a group may produce several tensors
                if produced not in tensors or produced in done:
                    continue
                _check_finite(value, source, produced, source.source_keys(produced), "")
                _write_dense(writers[tensors[produced]["file"]], produced, tensors[produced], value)
                done.add(produced)


def _write_expert(source, name: str, e: int, weight, fmt, writer, offsets: dict, device) -> None:
    """Expert `e` of `name` quantized at `fmt` and written at `offsets` ({stored key: byte offset}); `weight` is
    the expert's values, or the call that computes them (a published expert's dequantization)."""
    if callable(weight):
        weight = weight()[0]
    _check_finite(weight, source, name, source.expert_source_keys(name, e), f"expert {e} of ")
    for piece in fmt.pieces(weight, _PIECE_ELEMENTS):
        for part, value in fmt.quantize(piece.to(device)).items():
            key = f"{name}:{part}"
            writer.write(key, value, offsets[key])
            offsets[key] += value.numel() * value.element_size()


class _ExpertWorkers:
    """Experts quantized on the CPU in parallel, one per thread, each thread's torch ops single-threaded: the same
    cores as torch's own intra-op threads, without a barrier per operation (on a loaded machine a two-thread
    operation waits for its slower thread every time: the quantization of a 256 K-value piece is a dozen such
    operations). The results are the same: no operation here depends on how many threads run it. Only for experts
    of `PARALLEL_ELEMENTS` values or more (the threads cost ~30 MB of their own, more than a small model's whole
    preparation); elsewhere (smaller experts, an accelerator, one thread) each expert is written where it is
    submitted. At most two experts per worker are in flight (memory: a few experts' values), and a worker's error
    is raised in the submitting thread."""

    def __init__(self, device):
        self.count = torch.get_num_threads() if torch.device(device).type == "cpu" else 1
        self.pool = None
        self.threads = None
        self.pending: collections.deque = collections.deque()

    def __enter__(self):
        return self

    def submit(self, elements: int, fn, *args) -> None:
        """Run `fn(*args)` (one expert of `elements` values) on a worker, or here."""
        if self.count < 2 or elements < PARALLEL_ELEMENTS:
            fn(*args)
            return
        if self.pool is None:
            self.threads = torch.get_num_threads()
            torch.set_num_threads(1)
            self.pool = concurrent.futures.ThreadPoolExecutor(
                self.count, "usaf-prepare", initializer=torch.set_num_threads, initargs=(1,)
            )
        while len(self.pending) >= 2 * self.count:
            self.pending.popleft().result()
        self.pending.append(self.pool.submit(fn, *args))

    def wait(self) -> None:
        while self.pending:
            self.pending.popleft().result()

    def __exit__(self, kind, err, tb):
        if self.pool is None:
            return
        for future in self.pending:  # after an error: what has not started never runs
            future.cancel()
        self.pool.shutdown(wait=True)
        torch.set_num_threads(self.threads)
        if err is None:
            self.wait()


PARALLEL_ELEMENTS = 1 << 20


def _write_dense(writer: shards.StreamingWriter, name: str, info: dict, value: torch.Tensor) -> None:
    if info["format"] == "none":
        writer.write(f"{name}:data", value)
        return
    offsets = Counter()  # in pieces of rows, so that no full-precision copy of a large matrix exists
    for piece in int8_format.pieces(value, _PIECE_ELEMENTS):
        for part, quantized in int8_format.quantize(piece).items():
            key = f"{name}:{part}"
            writer.write(key, quantized, offsets[key])
            offsets[key] += quantized.numel() * quantized.element_size()


def _release_freed_memory() -> None:
    """Hand memory freed by the previous tensor back to the OS: glibc keeps freed blocks of a few MB in its heap,
    and over thousands of tensors that retention, not the data in use, would set the peak."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None


def _nbytes(dtype: torch.dtype, shape) -> int:
    return shards.PlannedTensor("", dtype, tuple(shape)).nbytes


def _check_finite(
    value: torch.Tensor, source: SourceCheckpoint, name: str, keys: list[str], what: str
) -> None:
    # the largest and smallest value are NaN or inf exactly when some value is (max and min propagate NaN): two
    # reductions, no temporary of the tensor's size (isfinite(value).all() built a bool copy and took ten times as long)
    if value.is_floating_point() and value.numel() and not _finite_extremes(value):
        files = sorted({str(source.entries[k].file) for k in keys})
        raise ModelError(
            f"Non-finite values in {what}'{name}' (checkpoint tensors {keys[:3]}{'...' if len(keys) > 3 else ''} "
            f"in {', '.join(files)}): the shard is corrupted; re-download it."
        )


def _finite_extremes(value: torch.Tensor) -> bool:
    return bool(torch.isfinite(value.amax())) and bool(torch.isfinite(value.amin()))


def _metadata(model_dir, source, tensors, checksums, requested, fmt, quant_dense, tmp: Path) -> dict:
    files = {}
    for info in tensors.values():
        files.setdefault(info["file"], {"size": (tmp / info["file"]).stat().st_size})
    source_files = {
        file.name
        for key, entry in source.entries.items()
        if key in checksums
        for file in files_of_entry(entry)
    }
    return {
        "format": "usaf-store",
        "format_version": STORE_FORMAT_VERSION,
        "usaf_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "quant": fmt,
        "requested_quant": requested,
        "quant_dense": quant_dense,
        "format_constants": format_constants(),
        "source": {
            "dir": str(model_dir.resolve()),
            "files": {name: file_stamp(model_dir / name) for name in sorted(source_files)},
            "ignored_tensors": source.ignored,
        },
        "files": files,
        "tensors": {
            name: {
                **{k: v for k, v in info.items() if k not in ("stored", "group")},
                "stored": {
                    key: {"dtype": shards.DTYPE_NAMES[d], "shape": list(s)}
                    for key, (d, s) in info["stored"].items()
                },
            }
            for name, info in tensors.items()
        },
        "source_tensors": {
            key: {
                "file": source.entries[key].file.name,
                "dtype": shards.DTYPE_NAMES[source.entries[key].dtype],
                "shape": list(source.entries[key].shape),
                "sha256": digest,
            }
            for key, digest in checksums.items()
        },
    }


def file_stamp(path: Path) -> dict:
    """What tells a file changed without reading it: its size and modification time."""
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def ensure_prepared(
    model_dir: str | Path,
    quant: str = "nf4",
    quant_dense: bool = False,
    cache_dir: str | Path | None = None,
    **kwargs,
) -> Path:
    """A prepared store of `model_dir`, from the cache when one was made from the same files with the same
    settings, else prepared now (what `usaf train` runs before loading). The cache lives in `cache_dir`, else
    $USAF_CACHE/prepared, else ~/.cache/usaf/prepared."""
    model_dir = Path(model_dir).resolve()
    default_root = (
        Path(os.environ["USAF_CACHE"]) if os.environ.get("USAF_CACHE") else Path.home() / ".cache" / "usaf"
    )
    cache_dir = Path(cache_dir or default_root / "prepared")
    stamps = {p.name: file_stamp(p) for p in sorted(model_dir.glob("*.safetensors"))}
    key = json.dumps([str(model_dir), stamps, quant, quant_dense, STORE_FORMAT_VERSION], sort_keys=True)
    out_dir = (
        cache_dir
        / f"{model_dir.name}-{quant}{'-qd' if quant_dense else ''}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    )
    if (out_dir / STORE_FILE).exists():
        return out_dir
    # a published checkpoint asked for at one of usaf's formats is converted; at its own, kept (`prepare_store`)
    kwargs.setdefault("requantize_published", True)
    return prepare_store(model_dir, out_dir, quant, quant_dense, force=out_dir.exists(), **kwargs)


def files_of_entry(entry: shards.TensorEntry) -> list[Path]:
    """The files a checkpoint tensor is read from (a published weight's parts may lie in several)."""
    return [part.file for part in entry.parts] if isinstance(entry, shards.DerivedEntry) else [entry.file]
