"""Writing files and folders so that an interruption never leaves something that looks complete.

Everything is written under a temporary name next to its destination (`.NAME.usaf-tmp-PID-RANDOM`), fsynced, and
renamed into place; the folder holding it is fsynced after the rename. Temporaries of processes that are gone are
removed by the next writer to the same place.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from pathlib import Path

from usaf.files import INDEX_FILE


def temporary_name(destination: Path) -> Path:
    return destination.parent / f".{destination.name}.usaf-tmp-{os.getpid()}-{secrets.token_hex(4)}"


def remove_stale_temporaries(destination: Path) -> None:
    """Temporary files and folders of interrupted writes to `destination` (their process is gone)."""
    for path in destination.parent.glob(f".{destination.name}.usaf-tmp-*"):
        try:
            os.kill(int(path.name.split("-")[-2]), 0)
        except ProcessLookupError:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        except (ValueError, IndexError, PermissionError):
            continue


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be fsynced
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_json(path: Path, data: dict) -> None:
    """A JSON file written and fsynced in place: for files inside a temporary folder that is renamed as a whole."""
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def atomic_file(path: Path, write) -> None:
    """`write(tmp_path)` writes the content; the file appears at `path` only once it is complete and on disk."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    tmp = temporary_name(path)
    try:
        write(tmp)
        make_shareable(tmp)
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def make_shareable(path: Path) -> None:
    """The permissions `open` would give (safetensors creates private files; results are shared like any other)."""
    mask = os.umask(0o022)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def atomic_json(path: Path, data: dict) -> None:
    atomic_file(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2)))


def install_dir(tmp: Path, out_dir: Path) -> None:
    """Rename a finished temporary folder into place; an existing one (--force) is moved aside first, then removed."""
    old = None
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.usaf-old-{secrets.token_hex(4)}"
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    fsync_dir(out_dir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# Weights, which a model folder's side files are not (config, tokenizer, chat template, generation config...).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".h5", ".pkl")
_SIDE_FILE_LIMIT = 64 << 20


def copy_side_files(model_dir: Path, out: Path, keep_shard_index: bool, skip: tuple[str, ...] = ()) -> None:
    """Copy a model folder's small non-weight files into `out`, fsynced (the shard index only when the output keeps
    the source's tensor files and names)."""
    for path in sorted(model_dir.iterdir()):
        if not path.is_file() or path.name in skip:
            continue
        if (path.name == INDEX_FILE and keep_shard_index) or (
            path.name != INDEX_FILE
            and not path.name.endswith(_WEIGHT_SUFFIXES)
            and path.stat().st_size <= _SIDE_FILE_LIMIT
        ):
            shutil.copy2(path, out / path.name)
            fsync_file(out / path.name)
