"""What a MODEL argument (or `model.path`) names, answered once for every command: a model folder, a cached hub
id (its snapshot folder), a store `usaf prepare` wrote (its quant format from its own metadata), a published
MXFP4/FP8 checkpoint, a usaf run (its base, recorded in its config.yaml) or a merged export (usaf_delta.json beside
its shards). Commands load what `model_source` says rather than guessing from the options they were given."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from usaf.config import read_yaml
from usaf.errors import ConfigError, ModelError, RunStateError, UsafError
from usaf.files import CONFIG_FILE, MERGED_METADATA_FILE, STORE_FILE, STORE_FORMAT_VERSION
from usaf.io.guard import is_run
from usaf.io.published import METHODS, checkpoint_method
from usaf.io.source import cached_model_folder
from usaf.version import __version__

FOLDER, HUB, STORE, PUBLISHED, RUN, MERGED = "folder", "hub", "store", "published", "run", "merged"


@dataclass(frozen=True)
class ModelSource:
    kind: str  # one of FOLDER, HUB, STORE, PUBLISHED, RUN, MERGED
    given: str  # as the user wrote it
    path: (
        str  # what is read: the folder (absolute), a hub id's snapshot folder (the id when it is not cached)
    )
    quant: str  # "none", a store's format, or a published checkpoint's method (mxfp4, fp8)
    requested_quant: str = "none"  # a store's: the format `usaf prepare` was asked for (nf4 may become int4)
    base_path: str | None = None  # a run's: its model.path; a store's: the checkpoint it was prepared from

    @property
    def is_run(self) -> bool:
        return self.kind == RUN

    def base(self) -> ModelSource:
        """A run's base (the model its config.yaml names), resolved the same way."""
        if self.kind != RUN:
            raise ValueError(f"{self.kind} has no recorded base")
        return model_source(self.base_path or "")

    def quant_for(self, requested: str) -> str:
        """The quant format a load uses when `model.quant=requested`: a store's own (the option need not repeat
        it), a published checkpoint's method (usaf train says so), else `requested` (a folder is prepared at it).
        A store given with another format is refused: a demanding user who names nf4 and points at an int8 store
        wants to be told, not to train on a format they did not ask for ("none" and the default "auto" ask for nothing)."""
        if self.kind == STORE:
            if self.quant in METHODS:  # a published format, kept: no model.quant names it (the store says it)
                return "none" if requested == "auto" else requested
            if requested in ("none", "auto", self.quant, self.requested_quant):
                return self.quant
            raise ConfigError(
                f"{self.given} is a store prepared as {self.quant} (its {STORE_FILE}), but model.quant={requested}: drop "
                f"model.quant (the store's format is used), or prepare the checkpoint again with --quant {requested}."
            )
        return requested


def is_local_path(path: str) -> bool:
    """Anything but a hub id: an existing path, or a name not of the hub's `org/name` form."""
    return Path(path).expanduser().exists() or not (
        path.count("/") == 1 and not path.startswith((".", "/", "~"))
    )


def local_model_path(path: str) -> str:
    """`path`, or for a hub id in the local cache its snapshot folder (read like any local checkpoint)."""
    cached = cached_model_folder(path) if path and not is_local_path(path) else None
    return str(cached) if cached is not None else path


def model_source(given: str) -> ModelSource:
    """What `given` names (see the module). A path that does not exist, or a hub id that is not cached, is
    returned as it is (kind "folder" or "hub"): the loader names what is missing, as it always has."""
    given = str(given)
    folder = Path(given).expanduser()
    if not given or not folder.is_dir():  # none given is not the current folder (Path("") is ".")
        if given and not is_local_path(given):
            snapshot = local_model_path(given)
            kind, quant = _classify(Path(snapshot)) if snapshot != given else (HUB, "none")
            return ModelSource(HUB if kind == FOLDER else kind, given, snapshot, quant)
        return ModelSource(FOLDER, given, given, "none")
    path = str(folder.resolve())
    if is_run(folder):
        return ModelSource(RUN, given, path, "none", base_path=_run_model_path(folder))
    if (folder / STORE_FILE).is_file():
        return store_source(given, path, read_store_metadata(folder))
    kind, quant = _classify(folder)
    return ModelSource(kind, given, path, quant)


def store_source(given: str, path: str, metadata: dict) -> ModelSource:
    """A prepared store as a ModelSource, from its metadata (`read_store_metadata`'s) already read."""
    return ModelSource(
        STORE, given, path, metadata["quant"], metadata["requested_quant"], metadata["source"]["dir"]
    )


def _classify(folder: Path) -> tuple[str, str]:
    if (folder / MERGED_METADATA_FILE).is_file():
        return MERGED, "none"  # written from the base's own tensors: a published base comes out in bf16
    method = checkpoint_method(folder)
    return (PUBLISHED, method) if method is not None else (FOLDER, "none")


def _run_model_path(run_dir: Path) -> str | None:
    """The model.path a run's config.yaml records (None when it cannot be read: the commands that need the base
    say so when they load it)."""
    try:
        saved = read_yaml((run_dir / CONFIG_FILE).read_text(), str(run_dir / CONFIG_FILE))
    except (OSError, UsafError):
        return None
    path = ((saved if isinstance(saved, dict) else {}).get("model") or {}).get("path")
    return path if isinstance(path, str) and path else None


def read_store_metadata(store: str | Path) -> dict:
    """A prepared store's metadata (usaf_store.json), checked to be what `usaf prepare` writes: a JSON object of
    format usaf-store, of a version this usaf reads, naming its format and the checkpoint it was prepared from.
    Anything else is one line naming the file."""
    path = Path(store) / STORE_FILE
    if not path.is_file():
        raise ModelError(f"{store} is not a prepared usaf store (no {STORE_FILE}); run `usaf prepare` first.")
    try:
        metadata = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ModelError(f"{path} is unreadable or corrupted ({err}); prepare the store again.") from None
    if not isinstance(metadata, dict):
        raise ModelError(
            f"{path} holds a JSON {type(metadata).__name__}, not a store's metadata (an object): it is damaged; "
            "prepare the store again."
        )
    version = metadata.get("format_version", 0)
    if (
        metadata.get("format") != "usaf-store"
        or not isinstance(version, int)
        or version > STORE_FORMAT_VERSION
    ):
        raise ModelError(
            f"{path} is a store of format version {version!r} made by usaf {metadata.get('usaf_version')}; this "
            f"usaf {__version__} reads version {STORE_FORMAT_VERSION}: prepare the store again."
        )
    source = metadata.get("source")
    fields = {
        "quant": metadata.get("quant"),
        "requested_quant": metadata.setdefault("requested_quant", metadata.get("quant")),
        "source.dir": source.get("dir") if isinstance(source, dict) else None,
    }
    for name, value in fields.items():
        if not isinstance(value, str) or not value:
            raise ModelError(
                f"{path} has no valid '{name}' (a string): it is damaged; prepare the store again."
            )
    for name in ("files", "tensors", "source_tensors"):
        if not isinstance(metadata.get(name, {}), dict):
            raise ModelError(
                f"{path} has no valid '{name}' (an object): it is damaged; prepare the store again."
            )
    return metadata


def base_folder(given: str, what: str) -> str:
    """The checkpoint folder a delta is written into or checked against (`usaf apply BASE`, `export --base`): a
    cached hub id's snapshot folder; a run is refused (a prepared store is refused by `BaseCheckpoint`, which
    names the checkpoint it was prepared from)."""
    source = model_source(given)
    if source.is_run:
        raise ModelError(
            f"{what} {given} is a usaf run, not a base model: give the checkpoint it was trained on (its merged "
            f"model is `usaf export {given} --merged DIR`)."
        )
    return source.path


def run_folder(given: str, what: str) -> str:
    """A usaf run folder, for the commands that take one (`usaf export RUN`): a model of another kind is refused,
    naming what it is."""
    source = model_source(given)
    # a model is named as such; any other path is left to the run's reader, which names what is missing
    if not source.is_run and (Path(source.path) / "config.json").is_file():
        raise RunStateError(
            f"{what} {given} is a {_KIND_NAMES[source.kind]}, not a usaf run (a folder `usaf train --out` wrote); export a run, or "
            "use `usaf apply BASE DELTA OUT_DIR` for a delta file."
        )
    return source.path


_KIND_NAMES = {
    FOLDER: "model folder",
    HUB: "hub model",
    STORE: "prepared store",
    PUBLISHED: "published quantized checkpoint",
    RUN: "usaf run",
    MERGED: "merged export",
}
