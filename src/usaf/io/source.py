"""The source checkpoint: its safetensors shards, and how their tensors become the model's parameters.

Checkpoints do not always store a model's parameters under their names: most MoE families keep one tensor per
expert and projection (`experts.3.gate_proj.weight`) that transformers fuses on load into `experts.gate_up_proj`.
Rather than a table per family, this follows transformers' own conversion mapping (the one `from_pretrained`
uses), applied either to whole tensors or to the tensors of a single expert, so that a fused stack is built one
expert at a time and never held whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from copy import deepcopy
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import huggingface_hub
import torch
from huggingface_hub.errors import StrictDataclassError
from torch import nn

from usaf.errors import ModelError, UsafError, first_line
from usaf.files import INDEX_FILE, STORE_FILE
from usaf.io import published, shards
from usaf.io.guard import inside
from usaf.model import verify
from usaf.model.config_json import check_model_config
from usaf.model.hf import (
    WeightConverter,
    WeightRenaming,
    build_skeleton,
    conversion_mapping,
    dot_natural_key,
    load_config,
    rename_source_key,
)


@dataclass
class Group:
    """Checkpoint tensors that one transform turns into one or more parameters (`name` is the first of them)."""

    name: str
    transform: WeightRenaming | WeightConverter
    sources: dict[str, list[str]] = field(default_factory=dict)  # source pattern -> checkpoint keys, in order

    def keys(self) -> list[str]:
        return [key for keys in self.sources.values() for key in keys]


@dataclass(frozen=True)
class Target:
    """A model parameter (or persistent buffer) as the checkpoint provides it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype  # the checkpoint's dtype
    group: str
    per_expert: bool = False  # buildable one expert at a time


def list_shards(model_dir: Path) -> dict[str, shards.TensorEntry]:
    """Every tensor of the checkpoint in `model_dir`, with its validated location."""
    index_path = model_dir / INDEX_FILE
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ModelError(f"{index_path} is not a valid safetensors index ({err!r}).") from err
        if not isinstance(weight_map, dict):
            raise ModelError(
                f"{index_path} is not a valid safetensors index (its weight_map is not a mapping)."
            )
        for key, name in weight_map.items():
            inside(model_dir, name, f"{index_path}'s weight_map[{key!r}]")
        files = sorted(set(weight_map.values()))
    else:
        weight_map = None
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        if pickles:
            raise ModelError(
                f"{model_dir} holds its weights only as pickles ({', '.join(pickles[:3])}), which usaf never reads "
                "(loading a pickle runs code): convert them to safetensors (e.g. save_pretrained(..., "
                "safe_serialization=True) in a trusted environment) or download the model's .safetensors files."
            )
        raise ModelError(f"No safetensors weights in {model_dir}.")
    entries: dict[str, shards.TensorEntry] = {}
    for name in files:
        path = model_dir / name
        if not path.exists():
            raise ModelError(f"{path} is listed in {INDEX_FILE} but missing; re-download the checkpoint.")
        found, _ = shards.read_header(path)
        for key, entry in found.items():
            if key in entries:
                raise ModelError(f"Tensor '{key}' is stored twice: in {entries[key].file} and in {path}.")
            entries[key] = entry
    if weight_map is not None:
        for key, name in weight_map.items():
            if entries.get(key) is None or entries[key].file.name != name:
                raise ModelError(
                    f"Tensor '{key}' is missing from {model_dir / name} (listed there by {INDEX_FILE}); "
                    "the shard is incomplete: re-download the checkpoint."
                )
    return entries


class SourceCheckpoint:
    """A checkpoint directory read against a model skeleton (a model built on the meta device)."""

    def __init__(self, model_dir: str | Path, model: nn.Module, expert_names: set[str]):
        self.dir = Path(model_dir)
        self.model = model
        # a published pre-quantized checkpoint: its quantized weights appear dequantized (`usaf.io.published`)
        config = published.read_config(self.dir) or {}
        self.published = published.published_method(config, self.dir)
        self.entries = published.derive_entries(list_shards(self.dir), config, self.dir)
        self.groups, self.ignored = self._group(model)
        verify.check_unexpected(self.dir, model, self.ignored)
        self.targets = self._plan(model, expert_names)
        self._hashers: dict[str, tuple[object, int]] = {}  # key -> (sha256 so far, next expert) for stacks
        self.checksums: dict[str, str] = {}
        self.expected_checksums: dict[str, str] = {}  # from a store's metadata: what reads must match
        self._whole_stack: tuple[str, torch.Tensor] | None = None
        self._whole_parts: dict[str, tuple[str, torch.Tensor]] = {}  # the same, per published part

    # ---- mapping -------------------------------------------------------------------------------------------

    def _group(self, model: nn.Module) -> tuple[dict[str, Group], list[str]]:
        """Checkpoint keys grouped per produced parameter, exactly as transformers' loader groups them."""
        mapping = conversion_mapping(model)
        renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
        by_pattern = {pattern: conv for conv in converters for pattern in conv.source_patterns}
        expected = model.state_dict()
        prefix = model.base_model_prefix
        groups: dict[str, Group] = {}
        ignored = []
        for key in sorted(self.entries, key=dot_natural_key):
            name, pattern = rename_source_key(key, renamings, converters, prefix, expected)
            if name not in expected and key in expected:
                name, pattern = rename_source_key(key, [], [], prefix, expected)
            if name not in expected:
                ignored.append(key)  # e.g. multi-token-prediction layers transformers does not build
                continue
            if pattern is None:
                group = groups.setdefault(name, Group(name, WeightRenaming(key, name)))
                pattern = key
            else:
                group = groups.setdefault(name, Group(name, deepcopy(by_pattern[pattern])))
            group.sources.setdefault(pattern, []).append(key)
        return groups, ignored

    def _plan(self, model: nn.Module, expert_names: set[str]) -> dict[str, Target]:
        """Names, shapes and dtypes of everything the checkpoint provides, from a conversion on meta tensors."""
        expected = model.state_dict()
        targets: dict[str, Target] = {}
        for group in self.groups.values():
            if group.name in expert_names and isinstance(group.transform, WeightConverter):
                for pattern, keys in group.sources.items():  # one tensor per expert, or say which is missing
                    self._expert_keys(group, pattern, keys, expected[group.name].shape[0])
            try:
                produced = self._convert(group, group.sources, self._meta)
            except Exception as err:
                raise verify.unmappable(
                    self.dir, group.keys(), group.name, expected[group.name].shape, err
                ) from None
            for name, tensor in produced.items():
                if name not in expected:
                    continue
                want = tuple(expected[name].shape)
                if tuple(tensor.shape) != want:
                    raise verify.misshapen(self.dir, group.keys(), name, tensor.shape, want, model.config)
                per_expert = name in expert_names and self._per_expert(group, name, want)
                targets[name] = Target(name, want, tensor.dtype, group.name, per_expert)
        tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
        ignore_missing = getattr(model, "_keys_to_ignore_on_load_missing", None) or []
        buffers = {name for name, _ in model.named_buffers()}
        for name in expected:
            if name in targets or name in tied or any(re.search(p, name) for p in ignore_missing):
                continue
            if name in buffers:
                continue  # a persistent buffer the model computes itself when the checkpoint lacks it
            raise verify.missing(self.dir, name, model.config)
        return targets

    def _per_expert(self, group: Group, name: str, shape: tuple[int, ...]) -> bool:
        """Whether expert e of `name` can be built from the checkpoint tensors of expert e alone."""
        num_experts = shape[0]
        if isinstance(group.transform, WeightRenaming):
            return True  # stored stacked under another name: read row e
        for pattern, keys in group.sources.items():
            self._expert_keys(group, pattern, keys, num_experts)
        try:
            produced = self._convert(group, self._expert_sources(group, 0), self._meta)
        except Exception:
            return False
        return len(produced) == 1 and tuple(next(iter(produced.values())).shape) == (1, *shape[1:])

    def _expert_keys(self, group: Group, pattern: str, keys: list[str], num_experts: int) -> list[str]:
        """The keys of one pattern in expert order, checked to be exactly one per expert."""
        if len(keys) == num_experts:
            return keys
        parts = [key.split(".") for key in keys]
        varying = [i for i in range(len(parts[0])) if len({p[i] for p in parts if len(p) > i}) > 1]
        if len(varying) == 1 and all(p[varying[0]].isdigit() for p in parts):
            present = {int(p[varying[0]]) for p in parts}
            missing = sorted(set(range(num_experts)) - present)
            if missing:
                example = list(parts[0])
                example[varying[0]] = str(missing[0])
                raise ModelError(
                    f"The checkpoint in {self.dir} lacks tensor '{'.'.join(example)}' (expert {missing[0]} of "
                    f"'{group.name}', {len(missing)} missing in all); the checkpoint is incomplete: re-download it."
                )
        raise ModelError(
            f"The checkpoint in {self.dir} has {len(keys)} tensors matching '{pattern}' for '{group.name}', "
            f"which has {num_experts} experts; the checkpoint is incomplete or from another config."
        )

    def _expert_sources(self, group: Group, expert: int) -> dict[str, list[str]]:
        return {pattern: [keys[expert]] for pattern, keys in group.sources.items()}

    def _convert(self, group: Group, sources: dict[str, list[str]], load) -> dict[str, torch.Tensor]:
        """Run the group's transform on the given checkpoint keys, each loaded by `load(key)`."""
        transform = deepcopy(group.transform)
        for pattern, keys in sources.items():
            for key in keys:
                transform.add_tensor(group.name, key, pattern, partial(load, key))
        produced = transform.convert(group.name, model=self.model, config=self.model.config)
        return {name: value[0] if isinstance(value, list) else value for name, value in produced.items()}

    def _meta(self, key: str) -> torch.Tensor:
        entry = self.entries[key]
        return torch.empty(entry.shape, dtype=entry.dtype, device="meta")

    # ---- reading -------------------------------------------------------------------------------------------

    def _read(self, key: str) -> torch.Tensor:
        hasher = hashlib.sha256() if key not in self.checksums else None
        tensor = shards.read_tensor(self.entries[key], hasher)
        if hasher is not None:
            self._record(key, hasher.hexdigest())
        return tensor

    def _read_row(self, key: str, expert: int) -> torch.Tensor:
        """Row `expert` of a stacked checkpoint tensor; rows read in order also checksum the whole tensor."""
        entry = self.entries[key]
        hasher, following = self._hashers.get(key, (hashlib.sha256(), 0))
        in_order = key not in self.checksums and expert == following
        row = shards.read_expert(entry, expert, hasher if in_order else None)
        if in_order:
            if expert + 1 == entry.shape[0]:
                self._hashers.pop(key, None)
                self._record(key, hasher.hexdigest())
            else:
                self._hashers[key] = (hasher, expert + 1)
        return row

    def _record(self, key: str, digest: str) -> None:
        expected = self.expected_checksums.get(key)
        if expected is not None and digest != expected:
            raise ModelError(
                f"Tensor '{key}' in {self.entries[key].file} differs from the one the store was prepared from "
                f"(sha256 {digest[:12]}... != {expected[:12]}...): the checkpoint changed since `usaf prepare`. "
                "Pass the checkpoint the store was prepared from, or prepare the store again."
            )
        self.checksums[key] = digest

    def verify(self, key: str) -> None:
        """Hash `key` now and check it against `expected_checksums`."""
        if key not in self.checksums:
            self._record(key, shards.sha256_of(self.entries[key]))

    def verify_partial_reads(self) -> None:
        """Check the stacked tensors of which only some rows were read (their hash is not complete yet)."""
        for key in list(self._hashers):
            self._hashers.pop(key)
            self.verify(key)

    def build(self, group_name: str) -> dict[str, torch.Tensor]:
        """Every parameter a group produces, in the checkpoint's dtype."""
        group = self.groups[group_name]
        return self._convert(group, group.sources, self._read)

    def build_expert(self, name: str, expert: int) -> torch.Tensor:
        """Expert `expert` ([A, B]) of the fused expert tensor `name`, in the checkpoint's dtype."""
        target = self.targets[name]
        group = self.groups[target.group]
        if target.per_expert and isinstance(group.transform, WeightRenaming):
            return self._read_row(group.keys()[0], expert)
        if target.per_expert:
            return self._convert(group, self._expert_sources(group, expert), self._read)[name][0]
        # a conversion that mixes experts: build the whole stack once (bounded by one stack) and slice it
        if self._whole_stack is None or self._whole_stack[0] != name:
            self._whole_stack = None
            self._whole_stack = (name, self.build(group.name)[name])
        return self._whole_stack[1][expert]

    def read_entries(self, name: str, flat_indices: torch.Tensor) -> torch.Tensor:
        """The checkpoint's values of parameter `name` at flat indices, reading one expert at a time."""
        target = self.targets[name]
        per_expert = 1
        for size in target.shape[1:]:
            per_expert *= size
        flat = flat_indices.reshape(-1).cpu()
        expert = torch.div(flat, per_expert, rounding_mode="floor")
        out = torch.empty(flat.shape, dtype=target.dtype)
        for e in torch.unique(expert).tolist():
            where = (expert == e).nonzero(as_tuple=True)[0]
            out[where] = self.build_expert(name, e).reshape(-1)[flat[where] - e * per_expert]
        self.release()
        return out.reshape(flat_indices.shape)

    def release(self) -> None:
        """Drop the whole stack `build_expert` (or `expert_parts`) may have built for an expert-mixing conversion
        (memory bound)."""
        self._whole_stack = None
        self._whole_parts = {}

    def expert_parts(self, name: str, expert: int, load=None) -> dict[str, torch.Tensor]:
        """Expert `expert` of the fused expert tensor `name` as the published checkpoint stores it: its quantized
        parts ({part: tensor}), put together by the same conversion that fuses the weights (it only moves data)."""
        target = self.targets[name]
        group = self.groups[target.group]
        names = published.PART_NAMES[self.published]
        out = {}
        row = expert if isinstance(group.transform, WeightRenaming) else None  # a stacked tensor: its row
        for i, part in enumerate(names):

            def read(key, i=i):
                if not isinstance(self.entries[key], shards.DerivedEntry):
                    raise ModelError(
                        f"Tensor '{key}' in {self.entries[key].file} is not quantized although the checkpoint "
                        f"declares {self.published} experts; use the model's bf16 checkpoint."
                    )
                entry = self.entries[key].parts[i]
                if load is not None:
                    return load(entry, row)
                return shards.read_expert(entry, row) if row is not None else shards.read_tensor(entry)

            if isinstance(group.transform, WeightRenaming):
                out[part] = read(group.keys()[0])
            elif target.per_expert:
                out[part] = self._convert(group, self._expert_sources(group, expert), read)[name][0]
            elif load is not None:
                out[part] = self._convert(group, group.sources, read)[name][expert]
            else:  # a conversion that mixes experts: the whole stack once per part (as build_expert), then rows
                if self._whole_parts.get(part, (None,))[0] != name:
                    self._whole_parts[part] = (name, self._convert(group, group.sources, read)[name])
                out[part] = self._whole_parts[part][1][expert]
        return out

    def expert_part_shapes(self, name: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """{part: (dtype, shape of one expert)} of `expert_parts`, from a conversion on meta tensors."""

        def meta(entry, row):
            shape = entry.shape[1:] if row is not None else entry.shape
            return torch.empty(shape, dtype=entry.dtype, device="meta")

        return {part: (t.dtype, tuple(t.shape)) for part, t in self.expert_parts(name, 0, meta).items()}

    def expert_source_keys(self, name: str, expert: int) -> list[str]:
        """The checkpoint tensors expert `expert` of `name` is built from."""
        target = self.targets[name]
        group = self.groups[target.group]
        if target.per_expert and isinstance(group.transform, WeightConverter):
            return [key for keys in self._expert_sources(group, expert).values() for key in keys]
        return group.keys()

    def source_keys(self, name: str) -> list[str]:
        return self.groups[self.targets[name].group].keys()

    def finish_checksums(self, keys) -> dict[str, str]:
        """Checksums of `keys`, hashing any tensor that was not read whole and in order."""
        for key in keys:
            self.verify(key)
        return {key: self.checksums[key] for key in keys}


def cached_snapshot(repo_id: str, repo_type: str = "model") -> Path | None:
    """The local hub cache's snapshot folder of `repo_id` (None when it is not cached), never the network."""
    # huggingface_hub reads HF_HUB_CACHE once, at import: a value set later (a test, a launcher) is read here
    cache = os.environ.get("HF_HUB_CACHE") or huggingface_hub.constants.HF_HUB_CACHE
    try:
        return Path(
            huggingface_hub.snapshot_download(
                repo_id, repo_type=repo_type, cache_dir=cache, local_files_only=True
            )
        )
    except Exception:  # not cached (LocalEntryNotFoundError), not a repo id (HFValidationError), ...
        return None


def cached_model_folder(repo_id: str) -> Path | None:
    """The snapshot folder of a cached hub model (None when it is not cached). A cached hub id is read from that
    folder like any local checkpoint: a published MXFP4/FP8 base, a quantized store and the run's record of its
    base all need the files, not transformers' loader."""
    folder = cached_snapshot(repo_id)
    return folder if folder is not None and (folder / "config.json").is_file() else None


def _strict_reason(err: BaseException) -> str:
    """huggingface_hub's strict-validation message puts its reason (the expected type) on a later line."""
    lines = [line.strip() for line in str(err).splitlines()[1:] if line.strip()]
    return lines[0] if lines else ""


def check_model_files(path: str, weights: bool = True) -> None:
    """A local model folder's config.json and weight files, checked before transformers reads them: an unknown
    model_type or a truncated shard is one line naming the file, not a traceback from deep inside the loader.
    `weights`: the tensors are also mapped onto the model config.json describes (`SourceCheckpoint`: missing,
    unexpected or misshapen ones named); False where the caller maps them itself next."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return  # a hub id: transformers downloads and checks it
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelError(f"{folder} has no config.json; give the folder of a Hugging Face model.")
    try:
        config = json.loads(config_file.read_text())
        model_type = config.get("model_type")
    except (OSError, ValueError, AttributeError) as err:
        raise ModelError(f"{config_file} is not a readable JSON object ({first_line(err)}).") from None
    check_model_config(config, str(config_file))
    try:
        model_config = load_config(folder)
    except UsafError:
        raise
    except StrictDataclassError as err:  # a field of the wrong type (huggingface_hub's strict dataclasses)
        raise ModelError(f"{config_file}: {first_line(err)} {_strict_reason(err)}; correct it.") from None
    except (OSError, ValueError, KeyError) as err:
        if "does not recognize this architecture" in str(err) or isinstance(err, KeyError):
            import transformers

            raise ModelError(
                f"{config_file}: model_type {model_type!r} is not known to transformers {transformers.__version__}; "
                "upgrade transformers (pip install -U transformers) or correct model_type."
            ) from None
        raise ModelError(f"{config_file} cannot be read: {first_line(err)}") from None
    for shard in sorted(folder.glob("*.safetensors")):
        shards.read_header(shard)  # checked against the file's size: a truncated copy is named here
    if weights and not (folder / STORE_FILE).is_file():  # a prepared store is checked against its metadata
        SourceCheckpoint(folder, build_skeleton(model_config), set())
