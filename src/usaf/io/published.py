"""Published pre-quantized checkpoints (gpt-oss's MXFP4 experts; DeepSeek-V3's and Qwen3-*-FP8's block-scaled FP8
linear layers), read as published.

`derive_entries` replaces each quantized weight's stored parts by one `DerivedEntry` under the name of the weight
transformers' dequantized load produces (`experts.gate_up_proj` for `experts.gate_up_proj_blocks` + `_scales`;
`q_proj.weight` for the FP8 `q_proj.weight` + `weight_scale_inv`), in the checkpoint's dtype: everything that maps
checkpoint tensors onto parameters then works unchanged, reading it dequantizes it, and its checksum is that of
the published bytes. `expert_parts` gives a store the published bytes themselves.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from usaf.errors import ModelError
from usaf.io import shards
from usaf.quant import PUBLISHED, fp8, mxfp4

METHODS = tuple(PUBLISHED)  # the quant_method names of the formats read as published
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def quantization_config(config) -> dict | None:
    """A config's (dict or transformers config) quantization_config as a dict, None when it has none."""
    qc = (
        getattr(config, "quantization_config", None)
        if not isinstance(config, dict)
        else config.get("quantization_config")
    )
    if qc is None or isinstance(qc, dict):
        return qc or None
    return qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))


def published_method(config, where: str | Path) -> str | None:
    """The published format of a checkpoint's config ("mxfp4", "fp8"), None for a full-precision one; any other
    quantization is refused in one line (`where`: the folder, for the message)."""
    qc = quantization_config(config)
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8" and not _fp8_block(qc):
        raise ModelError(
            f"{Path(where) / 'config.json'}: quantization_config has no weight_block_size [rows, cols]: usaf reads "
            "block-scaled FP8 (DeepSeek-V3, Qwen3-*-FP8), not per-tensor FP8; use the bf16 checkpoint instead."
        )
    if method not in METHODS:
        raise ModelError(
            f"{Path(where) / 'config.json'}: quantization_config.quant_method is {method!r}; usaf trains on "
            "full-precision checkpoints and on published MXFP4 (gpt-oss) and block-scaled FP8 (DeepSeek-V3, "
            "Qwen3-*-FP8) ones: use the model's bf16 checkpoint."
        )
    return method


def read_config(path: str | Path) -> dict | None:
    """A local model folder's config.json as published (None for a hub id or an unreadable config: their own
    checks speak). Its dtype, not a loaded model's, is the dtype of the dequantized values."""
    if not str(path):
        return None
    try:
        config = json.loads((Path(path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def checkpoint_method(path: str | Path) -> str | None:
    """`published_method` of a local model folder's config.json (None for a hub id or an unreadable config)."""
    config = read_config(path)
    return published_method(config, path) if config is not None else None


def keeps_published(requested: str) -> bool:
    """Whether a run asking for model.quant=`requested` keeps a published checkpoint's experts as published: unless
    told otherwise (a format of usaf's own named)."""
    return requested in ("none", "auto") or requested in METHODS


def quant_for(path: str | Path, requested: str) -> str:
    """The frozen experts' format of a run on the checkpoint at `path`: a published checkpoint's own format, unless
    `requested` names one of usaf's (then its experts are dequantized and stored at it, one expert at a time), said
    in one line; else `requested`."""
    method = checkpoint_method(path)
    if method is None:
        return requested
    if not keeps_published(requested):
        print(
            f"model.quant={requested}: {path} is a published {method.upper()} checkpoint: its experts are "
            f"dequantized one at a time and stored as {requested} (the trained values start from the published "
            "ones).",
            file=sys.stderr,
        )
        return requested
    print(
        f"{path} is a published {method.upper()} checkpoint: its experts stay {method} as published "
        "(dequantized per forward, never re-quantized).",
        file=sys.stderr,
    )
    return method


def _fp8_block(qc: dict) -> tuple[int, int] | None:
    block = qc.get("weight_block_size")
    if (
        isinstance(block, (list, tuple))
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
    ):
        return int(block[0]), int(block[1])
    return None


def values_dtype(config) -> torch.dtype:
    """The dtype transformers' dequantized load gives the weights: the config's own (bf16 when unset)."""
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    dtype = get("dtype") or get("torch_dtype")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.bfloat16


def format_constants(config) -> dict:
    """What the published format's `dequantize` takes besides the parts (stored with a prepared store)."""
    qc = quantization_config(config) or {}
    if qc.get("quant_method") != "fp8":
        return {}
    return {"block": list(_fp8_block(qc)), "values_dtype": str(values_dtype(config)).removeprefix("torch.")}


def derive_entries(entries: dict[str, shards.TensorEntry], config, model_dir: Path) -> dict:
    """`entries` with every published quantized weight as one derived (dequantized) entry; unchanged for a
    full-precision checkpoint."""
    method = published_method(config, model_dir)
    if method is None:
        return entries
    dtype = values_dtype(config)
    if method == "mxfp4":
        return _mxfp4_entries(entries, dtype)
    return _fp8_entries(entries, dtype, _fp8_block(quantization_config(config)))


def _refuse(entry: shards.TensorEntry, what: str) -> ModelError:
    return ModelError(
        f"Tensor '{entry.name}' in {entry.file} {what}, which is not the published layout its config.json's "
        "quantization_config declares; re-download the checkpoint."
    )


def _mxfp4_entries(entries: dict, dtype: torch.dtype) -> dict:
    out = {}
    for key, entry in entries.items():
        if key.endswith("_scales") and key[: -len("_scales")] + "_blocks" in entries:
            continue  # taken with its blocks
        if not key.endswith("_blocks"):
            if key.endswith("_scales"):
                raise _refuse(entry, "has no _blocks tensor beside it")
            out[key] = entry
            continue
        name = key[: -len("_blocks")]
        scales = entries.get(name + "_scales")
        if scales is None:
            raise _refuse(entry, f"has no '{name}_scales' beside it")
        if (
            entry.dtype != torch.uint8
            or scales.dtype != torch.uint8
            or len(entry.shape) != 4
            or entry.shape[-1] != mxfp4.BLOCK_SIZE // 2
            or tuple(scales.shape) != tuple(entry.shape[:-1])
        ):
            raise _refuse(
                entry,
                f"is {shards.DTYPE_NAMES[entry.dtype]} {list(entry.shape)} with scales "
                f"{shards.DTYPE_NAMES[scales.dtype]} {list(scales.shape)} (MXFP4 wants uint8 [E, out, in/32, 16] "
                "and uint8 [E, out, in/32])",
            )
        experts, cols, groups, _ = entry.shape
        rows = groups * mxfp4.BLOCK_SIZE

        def derive(parts, rows=rows, cols=cols):
            return mxfp4.dequantize({"blocks": parts[0], "scales": parts[1]}, rows, cols, dtype)[0]

        out[name] = _derived(entry, name, dtype, (experts, rows, cols), (entry, scales), experts, derive)
    return out


def _fp8_entries(entries: dict, dtype: torch.dtype, block: tuple[int, int]) -> dict:
    out = {}
    consumed = set()
    for key, entry in entries.items():
        if entry.dtype not in _FP8_DTYPES:
            continue
        scale = entries.get(key + "_scale_inv")
        if scale is None or len(entry.shape) != 2:
            raise _refuse(entry, "is FP8 without a 2-D weight and a '_scale_inv' tensor beside it")
        rows, cols = entry.shape
        want = tuple(fp8.layout(rows, cols, dtype, block)["scale_inv"][1])
        if tuple(scale.shape) != want or not scale.dtype.is_floating_point:
            raise _refuse(
                scale,
                f"is {shards.DTYPE_NAMES[scale.dtype]} {list(scale.shape)} for a {rows}x{cols} weight in "
                f"{block[0]}x{block[1]} blocks (want a float {list(want)})",
            )

        def derive(parts, rows=rows, cols=cols):
            return fp8.dequantize({"data": parts[0], "scale_inv": parts[1]}, rows, cols, dtype, block)[0]

        out[key] = _derived(entry, key, dtype, (rows, cols), (entry, scale), 1, derive)
        consumed.add(key + "_scale_inv")
    for key, entry in entries.items():
        if key in out or key in consumed:
            continue
        if key.endswith("activation_scale"):
            continue  # static activation scales: the dequantized model has no use for them (transformers drops them)
        if key.endswith("_scale_inv"):
            raise _refuse(entry, "is a scale with no FP8 weight beside it")
        out[key] = entry
    return out


def _derived(entry, name, dtype, shape, parts, rows, derive) -> shards.DerivedEntry:
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    return shards.DerivedEntry(entry.file, name, dtype, tuple(shape), 0, nbytes, parts, rows, derive)


PART_NAMES = {"mxfp4": ("blocks", "scales"), "fp8": ("data", "scale_inv")}
