"""Sources: what --data names (files, save_to_disk folders, hub ids) opened as `datasets.Dataset`s of raw
records, each with a fingerprint of its content.

JSON, JSON lines and text files are read here, one JSON string per record in a `json` column beside its
location (`file:LINE`, `file[INDEX]`): Arrow cannot hold a key that is a string in one record and a list in
another, and a broken line must stay one bad record. They are streamed into the datasets cache once per content
(bounded memory; the next load of the same file reads nothing but its bytes, for the digest). CSV/TSV, Parquet and Arrow files, save_to_disk folders
and hub ids are read by `datasets` (their rows are located as `file:row N`, N being the row's index).
"""

from __future__ import annotations

import csv
import hashlib
import io
import itertools
import json
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from usaf.data.cache import cache_root, full_cache, one_builder
from usaf.errors import DataError, UsafError, first_line
from usaf.io.source import cached_snapshot
from usaf.io.text import ENCODING, decode
from usaf.version import __version__

# read here (records located by line or index)
OWN_KINDS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".txt": "text",
    ".text": "text",
    ".md": "text",
}
# read by datasets' packaged builders (records located by row)
TABLE_KINDS = {".csv": "csv", ".tsv": "tsv", ".parquet": "parquet", ".pq": "parquet", ".arrow": "arrow"}
FILE_KINDS = {**OWN_KINDS, **TABLE_KINDS}
# compressions fsspec (and so datasets) infers from the name: the kind is then the suffix before it
COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz", ".zst": "zstd", ".lz4": "lz4"}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HASH_CHUNK = 1 << 22


@dataclass
class Source:
    name: str  # as given, for messages
    rows: object  # datasets.Dataset of raw records
    fingerprint: str  # changes when the content does
    located: bool  # rows carry their own `where` and `json` columns (read here)
    blank_is_absent: bool = False  # CSV: an empty cell is a key the row does not have


@contextmanager
def progress_bars(shown: bool):
    """datasets' bars on a terminal only: in a log file or a pipe they are noise."""
    from datasets.utils import logging as ds_logging

    was = ds_logging.is_progress_bar_enabled()
    (ds_logging.enable_progress_bar if shown and was else ds_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (ds_logging.enable_progress_bar if was else ds_logging.disable_progress_bar)()


def is_hub_id(name: str) -> bool:
    """`org/name` that is no local path (the same rule as model.path) nor named like a data file (a missing
    `data/train.jsonl` is a missing file)."""
    suffixes = [s.lower() for s in Path(name).suffixes[-2:]]
    named_like_a_file = any(s in FILE_KINDS or s in COMPRESSIONS for s in suffixes)
    return bool(HUB_ID.match(name)) and not named_like_a_file and not Path(name).expanduser().exists()


def file_kind(path: Path) -> tuple[str, str | None]:
    """(kind, compression) of a data file, by its name."""
    suffixes = [s.lower() for s in path.suffixes]
    compression = COMPRESSIONS.get(suffixes[-1]) if suffixes else None
    suffix = (suffixes[-2] if len(suffixes) > 1 else "") if compression else path.suffix.lower()
    kind = FILE_KINDS.get(suffix)
    if kind is None:
        raise DataError(
            f"{path}: unknown data file type '{''.join(path.suffixes[-2:] if compression else path.suffixes[-1:])}'; "
            f"use one of {', '.join(sorted(FILE_KINDS))} (compressed with {', '.join(COMPRESSIONS)} or not), "
            "a datasets save_to_disk folder or a hub dataset id."
        )
    return kind, compression


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256(str(path.resolve()).encode())
    with path.open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()[:32]


def _open(path: Path, compression: str | None):
    if compression is None:
        return path.open("rb")
    import fsspec

    try:
        return fsspec.open(str(path), "rb", compression=compression).open()
    except (ValueError, ImportError) as error:  # zstd/lz4 need their python package
        raise DataError(f"{path}: cannot open {compression} data: {first_line(error)}") from None


def _decode(path: Path, number: int, raw: bytes) -> str:
    try:
        return decode(raw)
    except UnicodeDecodeError as error:
        raise DataError(f"{path}:{number}: not UTF-8 ({error}).") from None


def _read_jsonl(path: Path, handle) -> Iterator[tuple[str, str, str]]:
    """(where, line, problem) per non-blank line; the line is parsed when it is encoded (a line that is no
    JSON is one bad record there)."""
    for number, raw in enumerate(handle, start=1):
        where = f"{path}:{number}"
        try:
            line = decode(raw)
        except UnicodeDecodeError as error:
            yield where, "", f"not UTF-8 ({error})"
            continue
        if line.strip():
            yield where, line, ""


def _read_json(path: Path, handle) -> Iterator[tuple[str, str, str]]:
    data = handle.read()  # one JSON value: read whole
    try:
        records = json.loads(_decode(path, 1, data))
    except json.JSONDecodeError as error:  # a broken file has no records to skip
        raise DataError(f"{path}:{error.lineno}: invalid JSON: {error.msg}.") from None
    except RecursionError:
        raise DataError(
            f"{path}: the JSON is nested too deeply to read (thousands of levels); no data needs that."
        ) from None
    if isinstance(records, dict) and isinstance(records.get("data"), list):
        records = records["data"]
    if not isinstance(records, list):
        raise DataError(f'{path}: a .json data file must hold a list of records or {{"data": [records]}}.')
    for index, record in enumerate(records):
        yield f"{path}[{index}]", json.dumps(record), ""


def _read_text(path: Path, handle) -> Iterator[tuple[str, str, str]]:
    """One {"text"} record per blank-line-separated block, located by the block's first line."""
    block: list[str] = []
    first_line_number = 0
    for number, raw in enumerate(
        itertools.chain(handle, [b""]), start=1
    ):  # the sentinel flushes the last block
        line = _decode(path, number, raw).rstrip("\r\n")
        if line.strip():
            if not block:
                first_line_number = number
            block.append(line)
        elif block:
            yield f"{path}:{first_line_number}", json.dumps({"text": "\n".join(block)}), ""
            block = []


READERS = {"jsonl": _read_jsonl, "json": _read_json, "text": _read_text}
_TABLE_BUILDERS = {
    "csv": ("csv", {}),
    "tsv": ("csv", {"sep": "\t"}),
    "parquet": ("parquet", {}),
    "arrow": ("arrow", {}),
}
_TABLE_LABELS = {"csv": "CSV", "tsv": "TSV", "parquet": "Parquet", "arrow": "Arrow"}


def _raw_rows(path: str, kind: str, compression: str | None) -> Iterator[dict]:
    """The generator of a file read here (module level: datasets may pickle it)."""
    try:
        with _open(Path(path), compression) as handle:
            for where, text, problem in READERS[kind](Path(path), handle):
                yield {"where": where, "json": text, "bad": problem}
    except UsafError:
        raise
    except Exception as error:  # a corrupt or truncated archive: OSError, EOFError, lzma.LZMAError, ...
        raise DataError(f"{path}: cannot read: {first_line(error)}") from None


def _own_file(path: Path, kind: str, compression: str | None, show_progress: bool) -> Source:
    """Streamed into the datasets cache (bounded memory), once per content: the fingerprint is the file's."""
    import datasets

    digest = _file_digest(path)
    strings = {column: datasets.Value("string") for column in ("where", "json", "bad")}
    fingerprint = f"usaf-{__version__}-raw-{kind}-{digest}"
    try:
        entry = cache_root().glob(f"generator/*={fingerprint}")  # the builder's folder of this content
        with one_builder(fingerprint, entry), progress_bars(show_progress):
            rows = datasets.Dataset.from_generator(
                _raw_rows,
                features=datasets.Features(strings),
                gen_kwargs={"path": str(path), "kind": kind, "compression": compression},
                cache_dir=str(cache_root()),
                fingerprint=fingerprint,
            )
    except ValueError as error:
        if "corresponds to no data" not in str(error):
            raise
        # a file without records: datasets' builder refuses an empty split, the pipeline says "empty" itself
        rows = datasets.Dataset.from_dict(
            {column: [] for column in strings}, features=datasets.Features(strings)
        )
    except datasets.exceptions.DatasetGenerationError as error:  # datasets wraps what the reader raised
        cause = error.__cause__
        if (full := full_cache(error)) is not None:  # the cache's disk is full, not the file unreadable
            raise full from None
        if isinstance(cause, UsafError):
            raise DataError(str(cause)) from None
        raise DataError(f"{path}: cannot read: {first_line(cause or error)}") from None
    return Source(str(path), rows, digest, located=True)


def _csv_header(path: Path, compression: str | None, sep: str) -> list[str]:
    try:
        with _open(path, compression) as handle:
            return next(
                csv.reader(io.TextIOWrapper(handle, encoding=ENCODING, newline=""), delimiter=sep), []
            )
    except Exception as error:  # not UTF-8, a corrupt archive, ...
        raise DataError(f"{path}: cannot read: {first_line(error)}") from None


def _table_file(path: Path, kind: str, compression: str | None, show_progress: bool) -> Source:
    import datasets

    builder, options = _TABLE_BUILDERS[kind]
    blank_is_absent = builder == "csv"
    if blank_is_absent:
        # every cell as written: pandas would make an answer "4" the number 4 and a text "None" a null; an
        # empty cell then means an absent key (see Source.blank_is_absent)
        header = _csv_header(path, compression, options.get("sep", ","))
        options = {**options, "converters": dict.fromkeys(header, str), "keep_default_na": False}
    try:
        with progress_bars(show_progress):
            rows = datasets.load_dataset(
                builder, data_files=str(path), split="train", cache_dir=str(cache_root()), **options
            )
    except Exception as error:  # pyarrow, pandas and datasets each raise their own kinds
        if (full := full_cache(error)) is not None:
            raise full from None
        raise DataError(f"{path}: cannot read {_TABLE_LABELS[kind]}: {first_line(error)}") from None
    return Source(str(path), rows, _file_digest(path), located=False, blank_is_absent=blank_is_absent)


def _pick_split(name: str, splits: list[str], split: str):
    if split not in splits:
        raise DataError(
            f"{name} has no split '{split}'; its splits are {', '.join(splits)} (set data.split, or add "
            f":SPLIT to the name, e.g. {name}:{splits[0]})."
        )


def _saved_folder(path: Path, split: str, show_progress: bool) -> Source:
    import datasets

    try:
        with progress_bars(show_progress):
            saved = datasets.load_from_disk(str(path))
    except Exception as error:
        raise DataError(f"{path}: cannot read the save_to_disk folder: {first_line(error)}") from None
    if isinstance(saved, datasets.DatasetDict):
        _pick_split(str(path), list(saved), split)
        saved = saved[split]
    return Source(str(path), saved, saved._fingerprint, located=False)


def _hub_dataset(name: str, split: str, show_progress: bool) -> Source:
    """A hub dataset from the local caches first, without a request: what `datasets.load_dataset(NAME)` left in
    the datasets cache, then the repository's files in the hub cache. Else downloaded by datasets, unless the
    Hugging Face offline variables are set (then one line says what to do, at once rather than after retries)."""
    import datasets
    from datasets.packaged_modules.cache.cache import Cache

    cache = cache_root()
    try:
        # the builder `load_dataset` falls back to offline, called directly so no request is ever made
        builder = Cache(
            cache_dir=str(cache), repo_id=name, dataset_name=name.split("/")[-1], version="auto", hash="auto"
        )
    except ValueError as error:
        if "Couldn't find cache" not in str(error):
            raise DataError(f"{name}: cannot read the cached hub dataset: {first_line(error)}") from None
        builder = None
    if builder is not None:
        splits = list(builder.info.splits or {})
        _pick_split(name, splits, split)
        with progress_bars(show_progress):
            rows = builder.as_dataset(split=split)
        return Source(name, rows, rows._fingerprint, located=False)
    folder = cached_snapshot(name, repo_type="dataset")
    if folder is None and not datasets.config.HF_HUB_OFFLINE:
        return _downloaded(name, split, show_progress)
    if folder is None:
        raise DataError(
            f"{name} is neither a local path nor a hub dataset in the local caches ({cache}, or the hub cache), "
            f"and HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set: unset it to download it, or download it where "
            f"the hub can be reached, e.g. python -c \"import datasets; datasets.load_dataset('{name}')\"."
        )
    try:
        with progress_bars(show_progress):  # a local folder: datasets infers its splits from the file names
            loaded = datasets.load_dataset(str(folder), cache_dir=str(cache))
    except Exception as error:
        raise DataError(
            f"{name}: cannot read its files in the hub cache ({folder}): {first_line(error)}"
        ) from None
    _pick_split(name, list(loaded), split)
    rows = loaded[split]
    return Source(name, rows, rows._fingerprint, located=False)


def _downloaded(name: str, split: str, show_progress: bool) -> Source:
    """A hub dataset in no local cache, online: fetched and cached by `datasets.load_dataset` itself (the next
    read finds it in the datasets cache), with one line saying what came."""
    import datasets

    cache = cache_root()
    try:
        with progress_bars(show_progress):
            loaded = datasets.load_dataset(name, cache_dir=str(cache))
    except datasets.exceptions.DatasetNotFoundError:
        raise DataError(
            f"{name}: no such dataset on the hub (or it is private or gated: log in with `hf auth login` and "
            "accept its terms on its page)."
        ) from None
    except Exception as error:  # the network, the hub, or files datasets cannot read
        if (full := full_cache(error)) is not None:
            raise full from None
        raise DataError(f"{name}: cannot download it from the hub: {first_line(error)}") from None
    _pick_split(name, list(loaded), split)
    rows = loaded[split]
    print(
        f"data: fetched {name} from the hub: split {split}, {len(rows):,} rows (cached in {cache})",
        file=sys.stderr,
        flush=True,
    )
    return Source(name, rows, rows._fingerprint, located=False)


def _split_suffix(name: str, split: str) -> tuple[str, str]:
    """`NAME:SPLIT` for a save_to_disk folder or a hub id (a path that exists as given is never split)."""
    base, colon, suffix = name.rpartition(":")
    exists = Path(name).expanduser().exists()
    if colon and suffix and not exists and (Path(base).expanduser().is_dir() or is_hub_id(base)):
        return base, suffix
    return name, split


def open_source(name: str, split: str = "train", show_progress: bool = False) -> Source:
    """One entry of data.train / data.eval as raw records."""
    name, split = _split_suffix(str(name), split)
    path = Path(name).expanduser()
    if path.is_dir():
        if any((path / f).is_file() for f in ("dataset_dict.json", "state.json", "dataset_info.json")):
            return _saved_folder(path, split, show_progress)
        inside = sorted(str(f) for f in path.iterdir() if f.is_file() and f.suffix.lower() in FILE_KINDS)
        example = ",".join(inside[:2]) if inside else f"{path}/train.jsonl"
        raise DataError(
            f"{path} is a folder; give the data files in it, comma separated (e.g. --data {example}), or a "
            "datasets save_to_disk folder."
        )
    if not path.exists() and is_hub_id(name):
        return _hub_dataset(name, split, show_progress)
    kind, compression = file_kind(path)
    if not path.is_file():
        raise DataError(f"{path}: data file not found.")
    if kind in READERS:
        return _own_file(path, kind, compression, show_progress)
    return _table_file(path, kind, compression, show_progress)


def absolute_name(name: str) -> str:
    """A data entry with its local path absolute (a run's config.yaml must not depend on the cwd); hub ids
    stay as they are."""
    base, split = _split_suffix(str(name), "")
    if is_hub_id(base):
        return str(name)
    return os.path.abspath(os.path.expanduser(base)) + (f":{split}" if split else "")


def is_missing(name: str) -> bool:
    """A local data entry that is not there (a resumed run's data moved); hub ids are checked when read."""
    base, _ = _split_suffix(str(name), "")
    return not is_hub_id(base) and not Path(base).expanduser().exists()


def _located(rows, name: str, blank_is_absent: bool = False):
    """A streamed table's rows in the located form of the files read here (`where`, `json`, `bad`), so one
    encoder reads every stream; values JSON cannot hold (dates, bytes) as their text."""

    def locate(row: dict, index: int) -> dict:
        record = {k: v for k, v in row.items() if v != ""} if blank_is_absent else row
        return {"where": f"{name}:row {index}", "json": json.dumps(record, default=str), "bad": ""}

    return rows.map(locate, with_indices=True, remove_columns=list(rows.column_names or []) or None)


def stream_source(name: str, split: str = "train"):
    """One entry of data.train as a `datasets.IterableDataset` of located raw records (`where`, `json`, `bad`):
    read as it is iterated, nothing written to the datasets cache (data.streaming). A hub id not in the local
    caches is streamed from the hub by datasets (one line says so), unless the offline variables are set."""
    import datasets

    name, split = _split_suffix(str(name), split)
    path = Path(name).expanduser()
    if path.is_dir() or (not path.exists() and is_hub_id(name)):
        if path.is_dir() or _in_local_caches(name):
            # already on this disk: opened as without streaming (a hub-cache snapshot is converted once, as there)
            source = open_source(str(path) if path.is_dir() else name, split)
            # as plain Python values: a save_to_disk folder keeps the format it was saved with (torch tensors...)
            return _located(source.rows.with_format(None).to_iterable_dataset(), source.name)
        if datasets.config.HF_HUB_OFFLINE:
            _hub_dataset(name, split, False)  # its one-line error
        try:
            rows = datasets.load_dataset(name, split=split, streaming=True)
        except Exception as error:
            raise DataError(f"{name}: cannot stream it from the hub: {first_line(error)}") from None
        print(f"data: streaming {name} from the hub: split {split}", file=sys.stderr, flush=True)
        return _located(rows, name)
    kind, compression = file_kind(path)
    if not path.is_file():
        raise DataError(f"{path}: data file not found.")
    if kind in READERS:
        return datasets.IterableDataset.from_generator(
            _raw_rows, gen_kwargs={"path": str(path), "kind": kind, "compression": compression}
        )
    builder, options = _TABLE_BUILDERS[kind]
    if builder == "csv":  # every cell as written, as _table_file reads it
        header = _csv_header(path, compression, options.get("sep", ","))
        options = {**options, "converters": dict.fromkeys(header, str), "keep_default_na": False}
    rows = datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True, **options)
    return _located(rows, str(path), blank_is_absent=builder == "csv")


def _in_local_caches(name: str) -> bool:
    from datasets.packaged_modules.cache.cache import Cache

    try:
        Cache(
            cache_dir=str(cache_root()),
            repo_id=name,
            dataset_name=name.split("/")[-1],
            version="auto",
            hash="auto",
        )
    except ValueError:
        return cached_snapshot(name, repo_type="dataset") is not None
    return True
