"""safetensors files at the byte level: validated headers, bounded reads with checksums, and a streaming writer.

The format is an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, then the
tensor bytes back to back. Reading through plain file reads (not a memory map) keeps a process's memory at what
it actually holds: streaming a 60 GB checkpoint never maps it. Writing declares every tensor in the header first,
then fills the bytes in any order, so a producer can hand over one expert at a time.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from usaf.errors import ModelError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_MAX_HEADER = 100 << 20  # safetensors' own limit
_READ_CHUNK = 64 << 20


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are: file, absolute byte range, dtype and shape."""

    file: Path
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    def expert_range(self, expert: int) -> tuple[int, int]:
        """Byte range of row `expert` along the first dimension."""
        per_expert = self.nbytes // self.shape[0]
        start = self.begin + expert * per_expert
        return start, start + per_expert


@dataclass(frozen=True)
class DerivedEntry(TensorEntry):
    """A tensor a checkpoint stores as other tensors (a published weight as its quantized parts,
    `usaf.io.published`): reading it computes it, while checksums and samples cover the parts' own bytes.

    `rows` parts are read (and hashed) one after another: the experts of a stacked tensor, each computed alone;
    `derive(part tensors)` is one row's value ([*shape[1:]] when rows > 1, else the whole tensor)."""

    parts: tuple[TensorEntry, ...] = ()
    rows: int = 1
    derive: object = None

    def read_row(self, row: int, hasher=None) -> torch.Tensor:
        read = (
            (lambda part: read_expert(part, row, hasher))
            if self.rows > 1
            else (lambda p: read_tensor(p, hasher))
        )
        return self.derive([read(part) for part in self.parts])


def read_header(path: str | Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """The tensors of a safetensors file and its metadata, checked against the file's size so that a truncated
    or corrupted file fails here, naming the file, rather than later with garbage values."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ModelError(f"{path} is not a safetensors file (only {size} bytes); re-download it.")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(_MAX_HEADER, size - 8):
                raise ModelError(
                    f"{path} is truncated or corrupted: its header claims {header_len} bytes but the file has "
                    f"{size}; re-download or re-create it."
                )
            raw = f.read(header_len)
    except OSError as err:
        raise ModelError(f"Cannot read {path}: {err}.") from err
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelError(f"{path} is corrupted: its safetensors header is not valid JSON ({err}).") from err
    if not isinstance(header, dict):
        raise ModelError(f"{path} is corrupted: its safetensors header is not a JSON object.")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + header_len
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            raise ModelError(f"{path} is corrupted: bad header entry for tensor '{name}' ({err!r}).") from err
        numel = 1
        for s in shape:
            numel *= s
        if end - begin != numel * dtype.itemsize or begin < 0:
            raise ModelError(
                f"{path} is corrupted: tensor '{name}' has {end - begin} bytes for shape {list(shape)} "
                f"{info['dtype']}."
            )
        if data_start + end > size:
            raise ModelError(
                f"{path} is truncated: tensor '{name}' ends at byte {data_start + end} but the file has {size} "
                "bytes; re-download or re-create it."
            )
        entries[name] = TensorEntry(path, name, dtype, shape, data_start + begin, data_start + end)
    return entries, metadata


def read_bytes(entry: TensorEntry, begin: int, end: int, hasher=None) -> torch.Tensor:
    """Bytes [begin, end) of the file as a uint8 tensor (read straight into it), optionally fed to `hasher`."""
    out = torch.empty(end - begin, dtype=torch.uint8)
    view = memoryview(out.numpy())
    with open(entry.file, "rb") as f:
        f.seek(begin)
        done = 0
        while done < len(view):
            n = f.readinto(view[done : done + _READ_CHUNK])
            if not n:
                raise ModelError(
                    f"{entry.file} ended early while reading tensor '{entry.name}'; re-download it."
                )
            done += n
    if hasher is not None:
        hasher.update(view)
    return out


def as_tensor(raw: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    return raw.view(dtype).reshape(shape)


def read_tensor(entry: TensorEntry, hasher=None) -> torch.Tensor:
    if isinstance(entry, DerivedEntry):
        rows = [entry.read_row(row, hasher) for row in range(entry.rows)]
        return (torch.stack(rows) if entry.rows > 1 else rows[0]).reshape(entry.shape)
    return as_tensor(read_bytes(entry, entry.begin, entry.end, hasher), entry.dtype, entry.shape)


def read_expert(entry: TensorEntry, expert: int, hasher=None) -> torch.Tensor:
    """Row `expert` of a tensor stacked over experts, reading only its bytes."""
    if isinstance(entry, DerivedEntry):
        if entry.rows > 1:
            return entry.read_row(expert, hasher)
        return read_tensor(entry, hasher)[expert]
    begin, end = entry.expert_range(expert)
    return as_tensor(read_bytes(entry, begin, end, hasher), entry.dtype, entry.shape[1:])


def read_experts(entry: TensorEntry, first: int, stop: int) -> torch.Tensor:
    """Rows first ... stop - 1 of a tensor stacked over experts, reading only their bytes (an expert-parallel
    rank's share of a store)."""
    if isinstance(entry, DerivedEntry):
        return torch.stack([read_expert(entry, e) for e in range(first, stop)])
    begin, end = entry.expert_range(first)[0], entry.expert_range(stop - 1)[1]
    return as_tensor(read_bytes(entry, begin, end), entry.dtype, (stop - first, *entry.shape[1:]))


def sha256_of(entry: TensorEntry) -> str:
    """Checksum of a tensor's bytes as stored, read in bounded chunks (a derived tensor: its parts' bytes, row by
    row, as reading it hashes them)."""
    hasher = hashlib.sha256()
    if isinstance(entry, DerivedEntry):
        for row in range(entry.rows):
            for part in entry.parts:
                begin, end = part.expert_range(row) if entry.rows > 1 else (part.begin, part.end)
                read_bytes(part, begin, end, hasher)
        return hasher.hexdigest()
    with open(entry.file, "rb") as f:
        f.seek(entry.begin)
        left = entry.nbytes
        while left:
            block = f.read(min(left, _READ_CHUNK))
            if not block:
                raise ModelError(f"{entry.file} ended early while reading tensor '{entry.name}'.")
            hasher.update(block)
            left -= len(block)
    return hasher.hexdigest()


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for s in self.shape:
            numel *= s
        return numel * self.dtype.itemsize


class StreamingWriter:
    """Writes a safetensors file whose tensors are all declared up front and filled piecewise.

    Tensors are laid out by decreasing element size, so that every tensor starts at a multiple of its element size
    and a memory map of the file can view it in place.
    """

    def __init__(self, path: Path, tensors: list[PlannedTensor], metadata: dict[str, str] | None = None):
        self.path = path
        ordered = sorted(tensors, key=lambda t: -t.dtype.itemsize)
        header: dict = {"__metadata__": dict(metadata or {})}
        offset = 0
        self.offsets: dict[str, tuple[int, int]] = {}
        for t in ordered:
            header[t.name] = {
                "dtype": DTYPE_NAMES[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [offset, offset + t.nbytes],
            }
            self.offsets[t.name] = (offset, offset + t.nbytes)
            offset += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
        self.data_start = 8 + len(raw)
        self.size = self.data_start + offset
        self.file = open(path, "wb")  # noqa: SIM115 (closed in close())
        self.file.write(struct.pack("<Q", len(raw)) + raw)
        self.file.truncate(self.size)

    def write(self, name: str, tensor: torch.Tensor, byte_offset: int = 0) -> None:
        """Write `tensor`'s bytes at `byte_offset` within tensor `name`."""
        begin, end = self.offsets[name]
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        if begin + byte_offset + data.nbytes > end:
            raise ValueError(f"write past the end of '{name}' in {self.path}")
        view, position = memoryview(data).cast("B"), self.data_start + begin + byte_offset
        while len(view):
            written = os.pwrite(self.file.fileno(), view, position)
            view, position = view[written:], position + written

    def close(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
