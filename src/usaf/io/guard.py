"""Where a command may write: the one check every command that writes calls before it writes anything; and where
a name read from metadata may point (`inside`).

An output (its real place, links followed) is never an input of the command, never holds one and never lies inside
one, and never lies inside a usaf run, a model folder or a prepared store. An existing output is replaced only with
`--force`, and only when it is an earlier output of the same kind (a delta file by a delta file, a merged folder by
a merged folder, a store by a store); never a run, a base, a folder that holds them, or a file of another kind. The
check also tells the writer what it found there (`usaf.io.atomic.expect_at`), so that an output another process
put in place meanwhile is refused when this one is renamed into place, never silently replaced.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from usaf.errors import UsafError
from usaf.files import CONFIG_FILE, DELTA_FORMAT, DEMO_MARKER, MERGED_METADATA_FILE, RUN_MARKER, STORE_FILE
from usaf.io.atomic import WEIGHT_SUFFIXES, expect_at, identity, real_path, refuse_link
from usaf.io.shards import read_header


def is_run(folder: Path) -> bool:
    return (folder / RUN_MARKER).is_file() or (
        (folder / CONFIG_FILE).is_file() and (folder / "checkpoints").is_dir()
    )


def is_store(folder: Path) -> bool:
    return (folder / STORE_FILE).is_file()


def is_model(folder: Path) -> bool:
    """A Hugging Face model folder (a merged checkpoint usaf wrote is one too): config.json beside weights."""
    if not (folder / "config.json").is_file():
        return False
    try:
        return any(name.endswith(WEIGHT_SUFFIXES) for name in os.listdir(folder))
    except OSError:
        return False


def what_is(path: Path) -> str | None:
    """What usaf calls `path` when it is something an output must never replace or lie inside."""
    if not path.is_dir():
        return None
    if is_run(path):
        return "the usaf run"
    if is_store(path):
        return "the usaf prepared store"
    if is_model(path):
        return "the model folder"
    return None


def _is_flat(folder: Path) -> bool:
    """Only files: an output folder of usaf's never holds a folder (and so never a run or a model)."""
    return all(not entry.is_dir() or entry.is_symlink() for entry in os.scandir(folder))


def _is_merged(folder: Path) -> bool:
    return (
        (folder / MERGED_METADATA_FILE).is_file()
        and not is_run(folder)
        and not is_store(folder)
        and _is_flat(folder)
    )


def _is_store_output(folder: Path) -> bool:
    return is_store(folder) and not is_run(folder) and _is_flat(folder)


def _safetensors_format(path: Path) -> str | None:
    """The `format` of a safetensors file's metadata; None when it is not one (or unreadable)."""
    try:
        _, metadata = read_header(path)
    except UsafError:
        return None
    return str(metadata.get("format"))


def _is_delta(path: Path) -> bool:
    return path.is_file() and _safetensors_format(path) == DELTA_FORMAT


def _is_selection(path: Path) -> bool:
    """A selection file of `usaf select`: safetensors with its .json companion (the axes of each selection)."""
    if not path.is_file() or _safetensors_format(path) is None:
        return False
    try:
        meta = json.loads(path.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and "axes" in meta


def _is_demo(folder: Path) -> bool:
    return (folder / DEMO_MARKER).is_file() and set(os.listdir(folder)) <= {DEMO_MARKER, "run", "model"}


def _magic(path: Path) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read(4)
    except OSError:
        return b""


def _is_generations(path: Path) -> bool:
    """A file of `usaf generate`: JSONL whose first row has its prompt's line and a completion."""
    try:
        with open(path, "rb") as handle:
            row = json.loads(handle.readline(1 << 20))
    except (OSError, ValueError):
        return False
    return isinstance(row, dict) and {"line", "prompt", "completion"} <= set(row)


@dataclass(frozen=True)
class Kind:
    name: str  # "a usaf delta file": what an earlier output of this kind is
    short: str  # "delta"
    folder: bool
    is_one: Callable[[Path], bool]


DELTA = Kind("a usaf delta file", "delta", False, _is_delta)
MERGED = Kind("a merged checkpoint usaf wrote", "merged checkpoint", True, _is_merged)
STORE = Kind("a usaf prepared store", "prepared store", True, _is_store_output)
SELECTION = Kind("a usaf selection file", "selection", False, _is_selection)
DEMO = Kind("a previous demo run", "demo", True, _is_demo)
GGUF = Kind("a GGUF file", "gguf", False, lambda path: _magic(path) == b"GGUF")
GENERATIONS = Kind("a usaf generations file", "generations", False, _is_generations)


def check_placement(out: Path, flag: str, inputs: Iterable[tuple[str, str | Path | None]]) -> None:
    """`out` (as given, and with its links followed) is not, does not hold and does not lie inside an input
    (label, path) of the command, nor lies inside a usaf run, a model folder or a prepared store."""
    out = Path(out)
    places = {real_path(out, follow=False), real_path(out)}
    for label, given in inputs:
        if given is None or str(given) == "" or not os.path.lexists(Path(given).expanduser()):
            continue  # nothing there (a hub id, a file yet to be written)
        path = real_path(Path(given))
        for place in places:
            if place == path:
                raise UsafError(
                    f"{flag} {out} would replace {label} {given}, an input of this command; choose another output."
                )
            if path in place.parents:
                raise UsafError(
                    f"{flag} {out} must not be inside {label} {given}, an input of this command; write outputs "
                    "outside it."
                )
            if place in path.parents:
                raise UsafError(
                    f"{flag} {out} holds {label} {given}, an input of this command; usaf never replaces or writes "
                    "into a folder that holds its inputs: choose another output."
                )
    for place in places:
        for folder in place.parents:
            if (what := what_is(folder)) is not None:
                raise UsafError(
                    f"{flag} {out} must not be inside {what} {folder}; usaf writes nothing into one: choose an "
                    "output outside it."
                )


def check_output(
    out: str | Path,
    kind: Kind,
    *,
    flag: str,
    force: bool,
    inputs: Iterable[tuple[str, str | Path | None]] = (),
    noun: str | None = None,
) -> Path:
    """Refuse an output `out` of `kind` that would destroy an input, a run, a base or the user's files (see the
    module); returns `out`. `flag` names it in messages (--delta, OUT_DIR), `noun` says what to choose instead."""
    out = Path(out)
    noun = noun or flag
    check_placement(out, flag, inputs)
    refuse_link(out)
    found = identity(out)
    if found is not None:
        what = what_is(out)
        if what is None and kind.folder and not out.is_dir():
            raise UsafError(f"{flag} {out} is a file, not a folder; choose another {noun}.")
        if what is None and not kind.folder and out.is_dir():
            raise UsafError(
                f"{flag} {out} is a folder; the {kind.short} is one file, e.g. {out / kind.short}.safetensors."
            )
        if not force:
            raise UsafError(f"{out} already exists; choose another {noun} or pass --force to replace it.")
        empty = out.is_dir() and not os.listdir(out)
        if not ((empty and kind.folder) or kind.is_one(out)):
            what = (
                "a" + what.removeprefix("the")
                if what
                else "a folder of other files"
                if out.is_dir()
                else "another file"
            )
            raise UsafError(
                f"{flag} {out} exists and is not {kind.name} (it is {what}); --force replaces only an earlier output "
                "of the same kind, never an input, a run, a base or a folder that holds them: choose another output."
            )
    expect_at(out, found)
    return out


def inside(folder: Path, name: object, what: str) -> Path:
    """`folder / name` for a file name read from metadata (a store's file list, a shard index's weight_map, a
    checkpoint's state.json...), refused in one line unless it stays inside `folder`: no absolute name, no `..`,
    no link that leads out. `what` names the metadata file and its entry, for the message. A hub cache snapshot's
    files are links into the same repository's blobs, which is where they belong."""
    folder = Path(folder)
    if not isinstance(name, str) or name in ("", ".") or "\0" in name:
        raise UsafError(
            f"{what} names {name!r}, which is not a file name; the metadata is damaged: re-create it."
        )
    parts = PurePosixPath(name).parts
    if PurePosixPath(name).is_absolute() or Path(name).is_absolute() or ".." in parts:
        raise UsafError(
            f"{what} names {name!r}, outside {folder}; a name read from metadata must be a file inside its folder: "
            "the metadata is damaged or was not written by its tool, so usaf reads nothing through it (re-create it)."
        )
    path = folder / name
    root = real_path(folder)
    allowed = [root]
    if folder.parent.name == "snapshots":  # huggingface_hub's cache: snapshots/REV/NAME -> ../../blobs/SHA
        allowed.append(real_path(folder.parent.parent / "blobs"))
    real = real_path(path)
    if not any(place in real.parents for place in allowed):
        raise UsafError(
            f"{what} names {name!r}, a link in {folder} that leads outside it (to {real}); usaf reads a folder's "
            "files only from that folder: replace the link by the file itself."
        )
    return path
