"""quantize a checkpoint's experts into a prepared store, streaming it tensor by tensor

Read the safetensors checkpoint in MODEL_DIR one tensor (one expert) at a time, quantize the experts per expert,
and write a prepared store: safetensors files plus usaf_store.json (formats, the source tensors' checksums, the
usaf version). Peak memory stays near the largest single tensor. The store appears only when complete.
"""

from __future__ import annotations

import time
from pathlib import Path


def add_arguments(parser) -> None:
    from usaf.quant import FORMATS

    parser.add_argument(
        "model_dir", metavar="MODEL_DIR", help="Hugging Face model directory (config.json + safetensors)"
    )
    parser.add_argument(
        "--quant",
        default=None,
        choices=list(FORMATS),
        help="experts' format (default nf4; becomes int4 where bitsandbytes has no kernels for the device; a "
        "published MXFP4/FP8 checkpoint keeps its own experts' bytes unless --quant is given: then its experts "
        "are dequantized one at a time and stored at --quant)",
    )
    parser.add_argument("--quant-dense", action="store_true", help="store dense linear layers as int8 too")
    parser.add_argument(
        "--out", required=True, metavar="PREPARED_DIR", help="where to write the prepared store"
    )
    parser.add_argument("--force", action="store_true", help="replace an existing prepared store at --out")
    parser.add_argument(
        "--device",
        default=None,
        help="where quantization runs (default: the accelerator torch sees, else cpu)",
    )


def run(args) -> int:
    from usaf.base.load import read_store_metadata
    from usaf.base.writer import prepare_store
    from usaf.io.guard import STORE, check_output
    from usaf.planner.sizes import format_size
    from usaf.quant import PUBLISHED

    _check_model_dir(Path(args.model_dir))
    inputs = [("the checkpoint directory", args.model_dir)]
    check_output(args.out, STORE, flag="--out", force=args.force, inputs=inputs)
    start = time.time()
    out = prepare_store(
        args.model_dir,
        args.out,
        args.quant or "nf4",
        args.quant_dense,
        force=args.force,
        device=_device(args.device),
        progress=True,
        requantize_published=args.quant is not None,
    )
    metadata = read_store_metadata(out)
    stored = sum(info["size"] for info in metadata["files"].values())
    source = sum(Path(args.model_dir, name).stat().st_size for name in metadata["source"]["files"])
    experts = sum(1 for t in metadata["tensors"].values() if t["kind"] == "experts")
    if metadata["quant"] in PUBLISHED:
        note = " (published: the checkpoint's own bytes, not re-quantized)"
    else:
        asked = args.quant or "nf4"
        note = "" if metadata["quant"] == asked else f" (bitsandbytes has no {asked} kernels here)"
    print(
        f"prepared {out}: {experts} expert tensors as {metadata['quant']}{note}, "
        f"{format_size(stored)} from {format_size(source)} in {time.time() - start:.0f} s"
    )
    return 0


def _check_model_dir(folder: Path) -> None:
    """MODEL_DIR is a local Hugging Face folder whose config and shards read: one line otherwise."""
    from usaf.errors import ModelError
    from usaf.io.source import check_model_files

    if folder.is_file():
        raise ModelError(
            f"MODEL_DIR {folder} is a file; give the model's folder (config.json and *.safetensors)."
        )
    if not folder.is_dir():
        raise ModelError(
            f"MODEL_DIR {folder}: no such model directory; usaf prepare reads a local folder (config.json and "
            "*.safetensors): download a hub model first (hf download ORG/NAME --local-dir DIR)."
        )
    # an unreadable config.json, an unknown model_type, a truncated shard (prepare_store maps the weights itself)
    check_model_files(str(folder), weights=False)


def _device(name: str | None):
    """--device as a torch device this machine has (None: the accelerator torch sees, else the CPU)."""
    import torch

    from usaf.errors import ConfigError

    if name is None:
        return None
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(
            f"--device {name!r} is not a device torch knows; give cpu, cuda, cuda:1, xpu or mps, or leave it out."
        ) from None
    if device.type == "cpu":
        return device
    if device.type == "mps":
        available, count = torch.backends.mps.is_available(), 1
    else:
        backend = getattr(torch, device.type, None)
        available = bool(backend is not None and hasattr(backend, "is_available") and backend.is_available())
        count = backend.device_count() if available and hasattr(backend, "device_count") else 0
    if not available:
        raise ConfigError(
            f"--device {name}: this torch build sees no {device.type} device; give --device cpu, or leave it out "
            "(the accelerator torch sees, else the CPU)."
        )
    if device.index is not None and device.index >= count:
        raise ConfigError(
            f"--device {name}: there {'is' if count == 1 else 'are'} {count} {device.type} device(s) (index 0 to "
            f"{count - 1}); give one of them."
        )
    return device
