"""The datasets cache, where sources and tokenized rows are written: its place (HF_DATASETS_CACHE, else under
HF_HOME, XDG_CACHE_HOME or HOME), a temporary stand-in when it cannot be written (one warning line; the run works,
only without the cache), a full cache as one error naming its variable, cache files cut short (removed and
rebuilt, with one line), and one builder at a time per cache entry across processes."""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

from usaf.errors import UsafError, first_line

_FULL = (errno.ENOSPC, errno.EDQUOT)
_REFUSED = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.ENAMETOOLONG, *_FULL)
# the configured cache -> the folder used for it this process (itself, or a temporary stand-in)
_USED: dict[Path, Path] = {}
# the Arrow IPC stream's end-of-stream marker, the last bytes of every complete file datasets writes
_END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def configured_cache() -> tuple[Path, str]:
    """(the datasets cache, the variable that places it), read at each call: datasets reads its variables once,
    at import."""
    import datasets

    for variable in ("HF_DATASETS_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        if os.environ.get(variable):
            break
    else:
        variable = "HOME"
    return Path(
        os.environ.get("HF_DATASETS_CACHE") or datasets.config.HF_DATASETS_CACHE
    ).expanduser(), variable


def cache_root() -> Path:
    """The folder the datasets cache is written in: the configured one when it can be written, else (with one
    warning line) a temporary one removed at exit, so that a read-only HOME or a cache variable naming a file
    costs the cache, not the run."""
    root, variable = configured_cache()
    if root in _USED:
        return _USED[root]
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=root, prefix=".usaf-probe-")  # can files be made there?
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        if err.errno not in _REFUSED:
            raise
        stand_in = Path(tempfile.mkdtemp(prefix="usaf-datasets-cache-"))
        atexit.register(shutil.rmtree, stand_in, ignore_errors=True)
        print(
            f"usaf: warning: cannot write the datasets cache {root} (from {variable}): {err.strerror or err}; "
            f"this run caches its data in {stand_in} instead (removed at exit): set HF_DATASETS_CACHE to a "
            "writable folder to keep the cache between runs",
            file=sys.stderr,
            flush=True,
        )
        _USED[root] = stand_in
        return stand_in
    _USED[root] = root
    return root


def full_cache(err: BaseException) -> UsafError | None:
    """A full disk or quota while the cache is written, as one line naming the cache's variable; None for any
    other error. pyarrow reports it as an OSError without an errno, its message quoting the system's."""
    found = err.__cause__ if not isinstance(err, OSError) and isinstance(err.__cause__, OSError) else err
    if not isinstance(found, OSError):
        return None
    text = str(found)
    if found.errno not in _FULL and not any(os.strerror(code) in text for code in _FULL):
        return None
    root, variable = configured_cache()
    return UsafError(
        f"the datasets cache {_USED.get(root, root)} (from {variable}) is full: {first_line(found)}; free some "
        f"space there, or set {variable} to a folder with room, and run it again."
    )


@contextlib.contextmanager
def cache_writes():
    """The block writes the datasets cache: a full one becomes one error line naming its variable."""
    try:
        yield
    except Exception as err:
        if (converted := full_cache(err)) is None:
            raise
        raise converted from None


@contextlib.contextmanager
def one_builder(entry: str, files: Iterable[Path]):
    """Held while this process checks and builds the cache entry named `entry` (its fingerprint), whose `files`
    (a lazy glob: listed under the lock) are dropped first if one is torn (`_drop_torn`). Two runs started at once
    on the same data (a sweep of seeds, two terminals) would otherwise each find the other's half-written entry,
    take it for a torn one and remove it under its writer, or read it before it is complete; the second waits here
    instead, then reads the finished entry. filelock: the lock datasets and huggingface_hub use."""
    import filelock

    folder = cache_root() / "usaf_locks"
    folder.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(folder / f"{entry}.lock")):
        _drop_torn(files)
        yield


def _drop_torn(entries: Iterable[Path]) -> None:
    """Remove the cache entries (Arrow files, or folders of them) if a file among them is cut short (no
    end-of-stream marker, as a full disk, a crash or a copy leaves it), with one line: the next read rebuilds them
    instead of failing on them, now and on every later run."""
    entries = list(entries)
    files = [f for entry in entries for f in ([entry] if entry.is_file() else sorted(entry.rglob("*.arrow")))]
    torn = next((path for path in files if not _complete(path)), None)
    if torn is None:
        return
    for entry in entries:
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    print(f"usaf: note: the cached file {torn} was cut short; rebuilding it", file=sys.stderr, flush=True)


def _complete(path: Path) -> bool:
    try:
        with open(path, "rb") as handle:
            if handle.seek(0, os.SEEK_END) < len(_END_OF_STREAM):
                return False
            handle.seek(-len(_END_OF_STREAM), os.SEEK_END)
            return handle.read() == _END_OF_STREAM
    except OSError:
        return False
