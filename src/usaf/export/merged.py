"""A merged checkpoint is the base's shards streamed tensor by tensor (in bounded chunks) with the trained entries
replaced: same names, dtypes, shard files and index; nothing else is touched, so a base trained in quantized form
keeps its original precision everywhere else. A published MXFP4/FP8 base keeps its published format: every tensor of
a module the delta leaves alone is copied byte for byte (FP8 weight + weight_scale_inv, MXFP4 blocks + scales); the
quantized weights of a module with trained entries are written dequantized (in the config's dtype, bf16, exactly as
transformers' dequantized load holds them) with the trained values in, and the module is listed in the config's
`quantization_config.modules_to_not_convert`, so transformers loads it as it is, never rounding a small update away
by quantizing it again. Outputs appear atomically: written beside the target under a hidden temporary name,
fsynced, renamed into place."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import torch

from usaf.base.checkpoint import BaseCheckpoint
from usaf.errors import ModelError
from usaf.export.delta import (
    Delta,
    check_base,
    checksum_message,
    read_delta,
    run_delta_and_base,
    written_from,
)
from usaf.files import INDEX_FILE, MERGED_METADATA_FILE
from usaf.io import shards
from usaf.io.atomic import (
    atomic_dir,
    copy_side_files,
    fsync_file,
    write_json,
)
from usaf.io.guard import MERGED, check_output
from usaf.planner.sizes import format_size
from usaf.version import __version__

_CHUNK_BYTES = 64 << 20


def export_merged(
    run_dir: str | Path, out_dir: str | Path, *, force: bool = False, base_dir: str | Path | None = None
) -> Path:
    """`usaf export RUN_DIR --merged OUT_DIR`: the base checkpoint with the run's trained entries written in."""
    inputs = [("the run", run_dir), ("the base checkpoint", base_dir)]
    check_output(out_dir, MERGED, flag="--merged", force=force, inputs=inputs, noun="output directory")
    delta, base = run_delta_and_base(run_dir, base_dir)
    return write_merged(base, delta, out_dir, force=force)


def apply_delta(
    base_dir: str | Path,
    delta_path: str | Path,
    out_dir: str | Path,
    *,
    force: bool = False,
    unchecked_base: bool = False,
) -> Path:
    """`usaf apply BASE_DIR DELTA OUT_DIR`: a merged checkpoint from a base and a delta file made against it
    (`unchecked_base`: a delta without its base record is applied unchecked)."""
    inputs = [("the base checkpoint", base_dir), ("the delta file", delta_path)]
    check_output(out_dir, MERGED, flag="OUT_DIR", force=force, inputs=inputs, noun="output directory")
    delta = read_delta(delta_path)
    base = BaseCheckpoint(base_dir)
    check_base(delta, base, unchecked_base=unchecked_base)
    return write_merged(base, delta, out_dir, force=force, flag="OUT_DIR")


# ---- merged checkpoints ------------------------------------------------------------------------------------------


def write_merged(
    base: BaseCheckpoint,
    delta: Delta,
    out_dir: str | Path,
    *,
    force: bool = False,
    flag: str = "--merged",
) -> Path:
    """Stream `base`'s shards into `out_dir` with the entries of `delta` replaced (cast to each tensor's dtype).

    The changed tensors must match the checksums of `delta.base_record` (a delta file's, a run's base.json);
    checked as they are read, and a mismatch abandons the output. `flag` names the output in messages.
    """
    out_dir = Path(out_dir)
    inputs = written_from(delta, base)
    check_output(out_dir, MERGED, flag=flag, force=force, inputs=inputs, noun="output directory")
    edits = _edits_by_checkpoint_key(base, delta)
    expected = (delta.base_record or {}).get("tensors")
    published = base.source.published is not None
    modules, dequantized = _dequantized_modules(base, edits) if published else ([], {})
    with atomic_dir(out_dir) as tmp:
        report: dict[str, dict] = {}
        written: dict[str, str] = {}  # tensor name -> file
        replaced = _parts_of(dequantized.values())  # the published parts the dequantized weights stand for
        for file in _shard_files(base):
            header, _ = shards.read_header(base.dir / file)
            # a dequantized weight replaces its published parts, in the file of its first part
            entries = {k: e for k, e in header.items() if k not in replaced}
            entries.update({k: e for k, e in dequantized.items() if e.file.name == file})
            written.update(dict.fromkeys(entries, file))
            if entries.keys() == header.keys() and not any(k in edits for k in entries):
                _link_or_copy(base.dir / file, tmp / file)  # nothing changes in it: the base's own file
                continue
            _write_shard(base.dir / file, tmp / file, edits, expected, report, delta.origin, entries)
        missing = sorted(set(edits) - set(report))
        if missing:
            raise ModelError(f"Tensor '{missing[0]}' was not found in the shards of {base.dir}.")
        copy_side_files(base.dir, tmp, keep_shard_index=not dequantized, skip=(MERGED_METADATA_FILE,))
        if dequantized:
            _write_unconverted_config(base, tmp, modules, written)
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
            **({"modules_not_converted": modules} if published else {}),
        }
        # written last, so that a folder holding it is complete
        write_json(tmp / MERGED_METADATA_FILE, metadata)
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
            raise ModelError(f"The delta for '{name}' has {change.count} values for {flat.numel()} entries.")
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
    source: Path,
    target: Path,
    edits: dict,
    expected: dict | None,
    report: dict,
    origin: str,
    entries: dict | None = None,
) -> None:
    """Copy one safetensors file tensor by tensor, in bounded chunks, replacing the edited entries. `entries`: the
    file's tensors as the base reads them (a published base's quantized weights dequantized), else its header's."""
    header, metadata = shards.read_header(source)
    entries = header if entries is None else entries
    planned = [shards.PlannedTensor(name, e.dtype, e.shape) for name, e in entries.items()]
    writer = shards.StreamingWriter(target, planned, metadata)
    try:
        for name, entry in entries.items():
            edit = edits.get(name)
            before = hashlib.sha256() if edit is not None else None
            after = hashlib.sha256() if edit is not None else None
            itemsize = entry.dtype.itemsize
            step = max(1, _CHUNK_BYTES // itemsize) * itemsize
            for offset, raw in _chunks(entry, step, before):
                if edit is not None:
                    _apply_edit(raw, entry.dtype, offset // itemsize, edit)
                    after.update(raw.numpy())
                writer.write(name, raw, offset)
            if edit is None:
                continue
            digest = before.hexdigest()
            want = (expected or {}).get(name, {}).get("sha256")
            if want is not None and digest != want:
                raise ModelError(checksum_message(name, source, origin))
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


def _chunks(entry: shards.TensorEntry, step: int, hasher):
    """(byte offset in the tensor, its bytes as uint8) of a tensor in bounded chunks: a derived (dequantized) one
    row by row (one expert of a stack), computed from its parts, which feed `hasher`."""
    if isinstance(entry, shards.DerivedEntry):
        row_bytes = entry.nbytes // entry.rows
        for row in range(entry.rows):
            value = entry.read_row(row, hasher)
            yield row * row_bytes, value.contiguous().reshape(-1).view(torch.uint8)
        return
    for begin in range(entry.begin, entry.end, step):
        end = min(begin + step, entry.end)
        yield begin - entry.begin, shards.read_bytes(entry, begin, end, hasher)


def _link_or_copy(source: Path, target: Path) -> None:
    """A shard the delta leaves alone, as the base holds it: a hard link where the output is on the base's file
    system (no disk: a 31 GB checkpoint whose trained entries lie in two of its seven shards adds those two),
    else a copy, fsynced. Safetensors files are never written in place (a download replaces a file), so the link
    keeps the base's bytes whatever later happens to the base's folder."""
    try:
        os.link(source, target)
    except OSError:  # another file system, or links not allowed
        shutil.copyfile(source, target)
        fsync_file(target)


def _shard_files(base: BaseCheckpoint) -> list[str]:
    """Every safetensors file of the base (a published weight's parts may lie in files of their own)."""
    files = set(base.shard_files())
    for entry in base.source.entries.values():
        if isinstance(entry, shards.DerivedEntry):
            files.update(part.file.name for part in entry.parts)
    return sorted(files)


def _parts_of(entries) -> set[str]:
    return {part.name for entry in entries for part in entry.parts}


def _dequantized_modules(
    base: BaseCheckpoint, edits: dict
) -> tuple[list[str], dict[str, shards.TensorEntry]]:
    """The modules of a published base whose quantized weights have trained entries (as the model names them, e.g.
    `model.layers.23.mlp.experts`), and every quantized (derived) weight of those modules, by name: the weights
    written dequantized. A whole module, because transformers converts (or not) a module, and because its loader
    fuses a module's per-expert weights with their scales as one list (a few experts in bf16 would not fuse)."""
    module_of = {}
    for group in base.source.groups.values():
        module = group.name.rsplit(".", 1)[0]
        for keys in group.sources.values():
            module_of.update(dict.fromkeys(keys, module))
    entries = base.source.entries
    derived = {k: e for k, e in entries.items() if isinstance(e, shards.DerivedEntry)}
    modules = sorted({module_of[k] for k in edits if k in derived and k in module_of})
    chosen = set(modules)
    return modules, {k: e for k, e in derived.items() if module_of.get(k) in chosen}


def _write_unconverted_config(base: BaseCheckpoint, out: Path, modules: list[str], written: dict) -> None:
    """config.json with `modules` added to quantization_config.modules_to_not_convert (the key transformers'
    FP8 and MXFP4 quantizers read), and the shard index of the tensors as written."""
    config = json.loads((base.dir / "config.json").read_text())
    qc = config["quantization_config"]
    qc["modules_to_not_convert"] = list(dict.fromkeys([*(qc.get("modules_to_not_convert") or []), *modules]))
    write_json(out / "config.json", config)
    if (base.dir / INDEX_FILE).exists():
        headers = {file: shards.read_header(out / file)[0] for file in set(written.values())}
        total = sum(headers[file][name].nbytes for name, file in written.items())
        write_json(
            out / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": dict(sorted(written.items()))}
        )


def dequantized_note(base: BaseCheckpoint, out_dir: Path) -> str | None:
    """One line saying that a published base kept its format, which modules were written dequantized, and the
    size."""
    if base.source.published is None:
        return None
    metadata_path = Path(out_dir) / MERGED_METADATA_FILE
    modules = (
        json.loads(metadata_path.read_text()).get("modules_not_converted", [])
        if metadata_path.exists()
        else []
    )
    size = sum(p.stat().st_size for p in Path(out_dir).glob("*.safetensors"))
    method = base.source.published.upper()
    changed = (
        f"the {len(modules)} module(s) with trained entries ({', '.join(modules[:3])}"
        f"{', ...' if len(modules) > 3 else ''}) dequantized, listed in quantization_config.modules_to_not_convert"
        if modules
        else "no quantized weight changed"
    )
    return (
        f"{base.dir} is a published {method} checkpoint: the merged checkpoint keeps it {method} where the run "
        f"changed nothing, {changed} ({format_size(size)})"
    )


def _apply_edit(raw: torch.Tensor, dtype: torch.dtype, first: int, edit) -> None:
    positions, values = edit
    count = raw.numel() // dtype.itemsize
    lo, hi = torch.searchsorted(positions, torch.tensor([first, first + count])).tolist()
    if hi > lo:
        raw.view(dtype)[positions[lo:hi] - first] = values[lo:hi]
