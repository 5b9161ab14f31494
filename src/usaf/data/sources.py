"""Sources: data files read into (location, record) pairs; a location names `file:LINE` or `file[INDEX]`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from usaf.data.records import BadRecord
from usaf.errors import UsafError

FILE_KINDS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".txt": "text",
    ".text": "text",
    ".md": "text",
}


def file_kind(path: Path) -> str:
    if path.is_dir():
        inside = sorted(str(f) for f in path.iterdir() if f.is_file() and f.suffix.lower() in FILE_KINDS)
        example = ",".join(inside[:2]) if inside else f"{path}/train.jsonl"
        raise UsafError(
            f"{path} is a folder; give the data files in it, comma separated (e.g. --data {example})."
        )
    kind = FILE_KINDS.get(path.suffix.lower())
    if kind is None:
        raise UsafError(
            f"{path}: unknown data file type '{path.suffix}'; use one of {', '.join(sorted(FILE_KINDS))}."
        )
    if not path.is_file():
        raise UsafError(f"{path}: data file not found.")
    return kind


def _read_jsonl(path: Path) -> Iterator[tuple[str, object]]:
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                yield where, BadRecord(f"not UTF-8 ({error})")
                continue
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as error:
                yield where, BadRecord(f"invalid JSON: {error.msg} (column {error.colno})")


def _read_json(path: Path) -> Iterator[tuple[str, object]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as error:
        raise UsafError(f"{path}: not UTF-8 ({error}).") from None
    except json.JSONDecodeError as error:  # a broken file has no records to skip
        raise UsafError(f"{path}:{error.lineno}: invalid JSON: {error.msg}.") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise UsafError(f'{path}: a .json data file must hold a list of records or {{"data": [records]}}.')
    for index, record in enumerate(data):
        yield f"{path}[{index}]", record


def _read_parquet(path: Path) -> Iterator[tuple[str, object]]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise UsafError(f"{path}: reading Parquet needs pyarrow: pip install usaf[parquet]") from None
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=1024)
        index = 0
        for batch in batches:
            for row in batch.to_pylist():
                yield f"{path}[{index}]", {key: value for key, value in row.items() if value is not None}
                index += 1
    except (OSError, pa.ArrowException) as error:
        raise UsafError(f"{path}: cannot read Parquet: {error}") from None


def _read_text(path: Path) -> Iterator[tuple[str, object]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise UsafError(f"{path}: not UTF-8 ({error}).") from None
    block: list[str] = []
    first_line = 0
    for number, line in enumerate([*lines, ""], start=1):  # the sentinel flushes the last block
        if line.strip():
            if not block:
                first_line = number
            block.append(line)
        elif block:
            yield f"{path}:{first_line}", {"text": "\n".join(block)}
            block = []


READERS = {"jsonl": _read_jsonl, "json": _read_json, "parquet": _read_parquet, "text": _read_text}
