"""Writing files and folders so that an interruption never leaves something that looks complete.

Everything is written under a temporary name next to its destination (`.NAME.usaf-tmp-PID-RANDOM`), fsynced, and
renamed into place; the folder holding it is fsynced after the rename. Temporaries of processes that are gone are
removed by the next writer to the same place. A symbolic link is never written through nor replaced. An output that
`usaf.io.guard` checked is put in place only if what stands there is still what the check found (nothing, or the
earlier output --force replaces): one another process wrote meanwhile is refused, never silently replaced.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import re
import secrets
import shutil
import signal
from pathlib import Path

from usaf.errors import UsafError
from usaf.files import INDEX_FILE

# ---- what stands at a destination -------------------------------------------------------------------------------


def real_path(path: Path, follow: bool = True) -> Path:
    """`path` with its links followed (`follow=False`: those of its folder only, the last name kept)."""
    path = Path(path).expanduser()
    if follow:
        return Path(os.path.realpath(path))
    return Path(os.path.realpath(path.parent)) / path.name


def identity(path: Path) -> tuple[int, int] | None:
    """What stands at `path` (device and inode, links not followed); None when nothing does."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return None
    return found.st_dev, found.st_ino


# destination (its real place) -> what a command's output check found there (usaf.io.guard.check_output)
_EXPECTED: dict[Path, tuple[int, int] | None] = {}


def expect_at(path: Path, found: tuple[int, int] | None) -> None:
    """Record what the output check found at `path`: it is put in place only if that still stands there."""
    _EXPECTED[real_path(path, follow=False)] = found


def refuse_link(path: Path) -> None:
    """usaf writes into its own files only: a symbolic link where it writes is refused, never followed."""
    if Path(path).is_symlink():
        raise UsafError(
            f"{path} is a symbolic link; usaf never writes through one (it points to {os.readlink(path)}): remove "
            "the link (or put the file itself there) and run it again."
        )


def open_unfollowed(path: Path, flags: int, mode: int = 0o666) -> int:
    """`os.open` of a file usaf owns (a run's lock, its metrics), never through a symbolic link: one in its place,
    even one made after any earlier check, is refused in one line."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW, mode)
    except OSError as err:
        if err.errno == errno.ELOOP:
            refuse_link(path)
        raise


def _appeared(path: Path) -> UsafError:
    return UsafError(
        f"{path} appeared while this command was writing it (another usaf writing the same output?); nothing was "
        "replaced: choose another output, or run it again with --force once the other has finished."
    )


def _place(tmp: Path, path: Path, folder: bool) -> Path | None:
    """Rename `tmp` to `path`; returns the earlier output moved aside (to remove), if any. Where an output check
    recorded what stood at `path`, anything else there now is refused; elsewhere (a run's own files) it is
    replaced. A symbolic link at `path` is refused."""
    refuse_link(path)
    key = real_path(path, follow=False)
    if key in _EXPECTED:
        expected, now = _EXPECTED[key], identity(path)
        if now is not None and now != expected:
            raise _appeared(path)
        if now is None:  # nothing there: put it in place only if nothing appears meanwhile
            _claim(tmp, path, folder)
            return None
    # a run's own file, or the earlier output --force replaces
    if folder:
        return _move_aside_and_rename(tmp, path)
    os.replace(tmp, path)
    return None


def _claim(tmp: Path, path: Path, folder: bool) -> None:
    """Rename `tmp` to `path` where nothing stands, never over another's output that appeared meanwhile."""
    try:
        if folder:
            os.mkdir(path)  # claims the name; a folder renamed onto an empty folder replaces it
            try:
                os.rename(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.rmdir(path)
                raise
        else:
            os.link(tmp, path)
            os.unlink(tmp)
    except FileExistsError:
        raise _appeared(path) from None
    except OSError as err:
        if err.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise _appeared(path) from None
        if folder or err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EXDEV):
            raise
        # a file system without hard links: the last moment's check, then the rename
        if identity(path) is not None:
            raise _appeared(path) from None
        os.replace(tmp, path)


def _move_aside_and_rename(tmp: Path, path: Path) -> Path | None:
    old = None
    if path.exists():
        old = path.parent / f".{_stem(path)}.usaf-old-{secrets.token_hex(4)}"
        os.rename(path, old)
    try:
        os.rename(tmp, path)
    except OSError as err:
        if old is not None:
            with contextlib.suppress(OSError):
                os.rename(old, path)
        if err.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise _appeared(path) from None
        raise
    return old


# ---- a write that fails: one line naming the file --------------------------------------------------------------

# errors of the file system a user can fix, and what to do about each
FILE_SYSTEM_ERRORS = {
    errno.ENOSPC: "free some space (or choose another folder) and run it again",
    errno.EDQUOT: "free some space (or choose another folder) and run it again",
    errno.EROFS: "choose a writable folder",
    errno.EACCES: "check its permissions (or choose another folder)",
    errno.EPERM: "check its permissions (or choose another folder)",
}


def as_os_error(err: BaseException) -> OSError | None:
    """The OSError behind `err`; safetensors reports a failed write as SafetensorError("... (os error 28)")."""
    if isinstance(err, OSError):
        return err
    found = re.search(r"\(os error (\d+)\)", str(err)) if isinstance(err, Exception) else None
    return OSError(int(found[1]), os.strerror(int(found[1]))) if found else None


def output_error(err: BaseException, path: Path | None = None, tmp: Path | None = None) -> UsafError | None:
    """A failed write the user can fix (a full disk or quota, a read-only or forbidden folder) as one line naming
    the file and what to do; None for any other error. `path`: the output being written, named when the error
    names no file or names its temporary `tmp` (a write's error often carries no file name)."""
    found = as_os_error(err)
    if found is None or found.errno not in FILE_SYSTEM_ERRORS:
        return None
    where = found.filename
    if path is not None and (where is None or (tmp is not None and str(where).startswith(str(tmp)))):
        where = path
    where = f"{where}: " if where else ""
    return UsafError(
        f"{where}{found.strerror or found}; {FILE_SYSTEM_ERRORS[found.errno]} (files already written are "
        "complete: usaf writes under temporary names and renames)"
    )


# ---- a SIGTERM while an output is written ------------------------------------------------------------------------


class Terminated(KeyboardInterrupt):
    """SIGTERM during a command (usaf.cli raises it from its handler): raised where Ctrl-C would be, so the same
    clean-up runs (a partial output removed)."""

    signum = signal.SIGTERM


# ---- writing -----------------------------------------------------------------------------------------------------


# bytes of an output's name that the names usaf makes beside it (temporaries, an earlier output set aside) keep:
# with their suffixes they stay far below the file systems' 255-byte limit, whatever the output's name
_NAME_KEPT = 64


def _stem(destination: Path) -> str:
    name = destination.name
    while len(os.fsencode(name)) > _NAME_KEPT:
        name = name[:-1]
    return name


def temporary_name(destination: Path) -> Path:
    return destination.parent / f".{_stem(destination)}.usaf-tmp-{os.getpid()}-{secrets.token_hex(4)}"


def remove_stale_temporaries(destination: Path) -> None:
    """Temporary files and folders of interrupted writes to `destination` (their process is gone)."""
    remove_dead_writers(
        destination.parent, f".{glob.escape(_stem(destination))}.usaf-tmp-*", lambda name: name.split("-")[-2]
    )


def check_destination(path: Path, flag: str) -> None:
    """Before any work: `path` can be made, as far as its names go: none over the file system's limit (bytes,
    usually 255), the whole within the system's path limit, and no regular file where one of its folders must be."""
    path = Path(path)
    existing = path
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if existing != path and not existing.is_dir():
        raise UsafError(
            f"{flag} {path}: {existing} is a file, not a folder, so nothing can be written under it; choose "
            "another output."
        )
    folder = existing if existing.is_dir() else existing.parent
    name_max, path_max = (
        _limit(folder, key, default) for key, default in (("PC_NAME_MAX", 255), ("PC_PATH_MAX", 4096))
    )
    for part in path.parts:
        if (size := len(os.fsencode(part))) > name_max:
            raise UsafError(
                f"{flag}: the name {part[:40]}... is {size} bytes, over the file system's limit of {name_max} "
                "bytes; choose a shorter name."
            )
    if (size := len(os.fsencode(os.path.abspath(path)))) >= path_max:
        raise UsafError(
            f"{flag}: the path {str(path)[:40]}... is {size} bytes, over the system's limit of {path_max - 1}; "
            "choose a shorter one."
        )


def _limit(folder: Path, key: str, default: int) -> int:
    try:
        return os.pathconf(folder, key)
    except (OSError, ValueError):
        return default


def remove_dead_writers(folder: Path, pattern: str, pid_of) -> None:
    """Files and folders in `folder` matching `pattern` whose writer, the process `pid_of(name)` names, is gone
    (killed mid-write); a name without a pid, or a writer still alive (or not ours to signal), is left."""
    for path in folder.glob(pattern):
        try:
            os.kill(int(pid_of(path.name)), 0)
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
    refuse_link(path)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def atomic_file(path: Path, write) -> None:
    """`write(tmp_path)` writes the content; the file appears at `path` only once it is complete and on disk (and
    only if nothing else appeared there meanwhile, for an output `usaf.io.guard` checked). A link at `path` is
    refused."""
    path = Path(path)
    refuse_link(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    tmp = temporary_name(path)
    try:
        write(tmp)
        make_shareable(tmp)
        fsync_file(tmp)
        _place(tmp, path, folder=False)
    except BaseException as err:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        if (failed := output_error(err, path, tmp)) is not None:
            raise failed from None
        raise
    fsync_dir(path.parent)


def make_shareable(path: Path) -> None:
    """The permissions `open` would give (safetensors creates private files; results are shared like any other)."""
    mask = os.umask(0o022)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def atomic_json(path: Path, data: dict) -> None:
    atomic_file(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2)))


@contextlib.contextmanager
def atomic_dir(out_dir: Path, tmp: Path | None = None):
    """A folder written under a temporary name beside `out_dir` (`tmp`, else a fresh one, the temporaries of dead
    writers removed first): the block writes into the yielded path; when it ends the folder is synced and renamed
    into place, and when it raises (a full disk, Ctrl-C, SIGTERM: usaf.cli raises it as Terminated) it is removed."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    if tmp is None:
        remove_stale_temporaries(out_dir)
        tmp = temporary_name(out_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        yield tmp
        fsync_dir(tmp)
        install_dir(tmp, out_dir)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if (failed := output_error(err, out_dir, tmp)) is not None:
            raise failed from None
        raise


def install_dir(tmp: Path, out_dir: Path) -> None:
    """Rename a finished temporary folder into place; an existing one (--force) is moved aside first, then removed
    (for an output `usaf.io.guard` checked: only the one it found there; another's output is refused)."""
    old = _place(tmp, out_dir, folder=True)
    fsync_dir(out_dir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# Weights, which a model folder's side files are not (config, tokenizer, chat template, generation config...).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".h5", ".pkl")
_SIDE_FILE_LIMIT = 64 << 20


def copy_side_files(model_dir: Path, out: Path, keep_shard_index: bool, skip: tuple[str, ...] = ()) -> None:
    """Copy a model folder's small non-weight files into `out`, fsynced (the shard index only when the output keeps
    the source's tensor files and names)."""
    for path in sorted(model_dir.iterdir()):
        if not path.is_file() or path.name in skip:
            continue
        if (path.name == INDEX_FILE and keep_shard_index) or (
            path.name != INDEX_FILE
            and not path.name.endswith(WEIGHT_SUFFIXES)
            and path.stat().st_size <= _SIDE_FILE_LIMIT
        ):
            shutil.copy2(path, out / path.name)
            fsync_file(out / path.name)
