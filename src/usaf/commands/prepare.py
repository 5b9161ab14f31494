"""`usaf prepare`: stream a checkpoint into a quantized frozen base (a prepared store)."""

from __future__ import annotations

import time
from pathlib import Path


def add_command(subparsers) -> None:
    from ..quant import FORMATS

    p = subparsers.add_parser(
        "prepare",
        help="quantize a checkpoint's experts into a prepared store, streaming it tensor by tensor",
        description=(
            "Read the safetensors checkpoint in MODEL_DIR one tensor (one expert) at a time, quantize the experts "
            "per expert, and write a prepared store: safetensors files plus usaf_store.json (formats, the source "
            "tensors' checksums, the usaf version). Peak memory stays near the largest single tensor. The store "
            "appears only when complete."
        ),
    )
    p.add_argument(
        "model_dir", metavar="MODEL_DIR", help="Hugging Face model directory (config.json + safetensors)"
    )
    p.add_argument(
        "--quant",
        default="nf4",
        choices=list(FORMATS),
        help="experts' format (default nf4; becomes int4 where bitsandbytes has no kernels for the device)",
    )
    p.add_argument("--quant-dense", action="store_true", help="store dense linear layers as int8 too")
    p.add_argument("--out", required=True, metavar="PREPARED_DIR", help="where to write the prepared store")
    p.add_argument("--force", action="store_true", help="replace an existing prepared store at --out")
    p.add_argument(
        "--device",
        default=None,
        help="where quantization runs (default: the accelerator torch sees, else cpu)",
    )
    p.set_defaults(func=_run)


def _run(args) -> int:
    from ..load import prepare_store, read_store_metadata
    from ..plan import format_size

    start = time.time()
    out = prepare_store(
        args.model_dir,
        args.out,
        args.quant,
        args.quant_dense,
        force=args.force,
        device=args.device,
        progress=True,
    )
    metadata = read_store_metadata(out)
    stored = sum(info["size"] for info in metadata["files"].values())
    source = sum(Path(args.model_dir, name).stat().st_size for name in metadata["source"]["files"])
    experts = sum(1 for t in metadata["tensors"].values() if t["kind"] == "experts")
    note = "" if metadata["quant"] == args.quant else f" (bitsandbytes has no {args.quant} kernels here)"
    print(
        f"prepared {out}: {experts} expert tensors as {metadata['quant']}{note}, "
        f"{format_size(stored)} from {format_size(source)} in {time.time() - start:.0f} s"
    )
    return 0
