"""write a run's trained model: a small delta file, or a full merged checkpoint

Export the latest finished checkpoint of RUN_DIR (or, with --from-trainer, a checkpoint written by
transformers.Trainer for a model prepared by usaf) as a delta file (--delta: trained entries and routers only)
and/or a merged checkpoint (--merged: the base's shards with the trained entries written in, loadable by plain
transformers).
"""

from __future__ import annotations

from pathlib import Path

from usaf.errors import ConfigError, UsafError
from usaf.files import CONFIG_FILE


def add_arguments(parser) -> None:
    from usaf.export.gguf import CONVERTER_OUTTYPES, QUANTIZE_OUTTYPES

    parser.add_argument("run_dir", nargs="?", metavar="RUN_DIR", help="usaf run directory")
    parser.add_argument("--delta", metavar="OUT.safetensors", help="write a delta file")
    parser.add_argument("--merged", metavar="OUT_DIR", help="write a merged checkpoint directory")
    parser.add_argument(
        "--gguf",
        metavar="OUT.gguf",
        help="also convert the merged checkpoint to GGUF with llama.cpp's convert_hf_to_gguf.py (without --merged, "
        "a temporary merged folder beside OUT.gguf, removed after), and write an Ollama OUT.Modelfile beside it",
    )
    default = "bf16"
    parser.add_argument(
        "--outtype",
        default=default,
        help=f"with --gguf: {', '.join(CONVERTER_OUTTYPES)} (by the converter), or {', '.join(QUANTIZE_OUTTYPES)} "
        f"(the k-quants and others, by llama.cpp's llama-quantize: $LLAMA_QUANTIZE, the checkout's build/bin or "
        f"PATH) (default {default})",
    )
    parser.add_argument(
        "--llama-cpp", metavar="DIR", help="with --gguf: a llama.cpp checkout (default: $LLAMA_CPP, PATH)"
    )
    parser.add_argument(
        "--model-name",
        metavar="NAME",
        help="with --gguf: the GGUF's general.name (default: the base's name, then the run folder's name)",
    )
    parser.add_argument(
        "--fp32", action="store_true", help="delta values in float32 instead of the base's dtype"
    )
    parser.add_argument(
        "--base", metavar="MODEL_DIR", help="the base checkpoint (default: the run's model.path)"
    )
    parser.add_argument(
        "--from-trainer", metavar="CKPT_DIR", help="a transformers.Trainer checkpoint-N folder"
    )
    parser.add_argument(
        "--best",
        action="store_true",
        help="the checkpoint of the run's best evaluation (kept by checkpoint.keep_best) instead of the latest",
    )
    parser.add_argument("--force", action="store_true", help="replace existing outputs")


def run(args) -> int:
    from usaf.base.checkpoint import BaseCheckpoint
    from usaf.export.delta import run_delta_and_base, write_delta
    from usaf.export.merged import dequantized_note, write_merged
    from usaf.export.trainer import trainer_checkpoint_delta
    from usaf.io.guard import DELTA, MERGED, check_output
    from usaf.io.model_source import base_folder, run_folder

    if args.run_dir:
        args.run_dir = run_folder(args.run_dir, "RUN_DIR")
    if args.base:
        args.base = base_folder(args.base, "--base")
    if not (args.delta or args.merged or args.gguf):
        raise ConfigError(
            "say what to write: --delta OUT.safetensors, --merged OUT_DIR and/or --gguf OUT.gguf."
        )
    # refuse outputs that would replace an input or an earlier output of another kind before any work is done
    inputs = _export_inputs(args)
    if args.delta:
        check_output(args.delta, DELTA, flag="--delta", force=args.force, inputs=inputs, noun="output file")
    if args.merged:
        if args.delta and Path(args.merged).resolve() in Path(args.delta).resolve().parents:
            raise UsafError(
                f"--delta {args.delta} is inside --merged {args.merged}; write the delta beside it."
            )
        check_output(
            args.merged, MERGED, flag="--merged", force=args.force, inputs=inputs, noun="output directory"
        )
    if args.best and not args.run_dir:
        raise ConfigError("--best picks a checkpoint of a usaf run: give RUN_DIR.")
    converter, quantize = _gguf_tools(args, inputs) if args.gguf else (None, None)
    if args.from_trainer:
        if args.run_dir:
            raise ConfigError("give either RUN_DIR or --from-trainer CKPT_DIR, not both.")
        if not args.base:
            raise ConfigError(
                "--from-trainer needs --base MODEL_DIR: the checkpoint the trained model was loaded from."
            )
        base = BaseCheckpoint(args.base)
        delta = trainer_checkpoint_delta(args.from_trainer, base)
    elif args.run_dir:
        delta, base = run_delta_and_base(args.run_dir, args.base, best=args.best)
    else:
        raise ConfigError("give RUN_DIR (a usaf run directory) or --from-trainer CKPT_DIR --base MODEL_DIR.")
    if args.delta:
        path = write_delta(delta, base, args.delta, fp32=args.fp32, force=args.force)
        print(f"delta: {path} ({_size(path)}, {sum(c.count for c in delta.changes.values()):,} values)")
    if args.merged:
        path = write_merged(base, delta, args.merged, force=args.force)
        print(f"merged checkpoint: {path}")
        if (note := dequantized_note(base, path)) is not None:
            print(note)
    if args.gguf:
        _write_gguf(args, base, delta, converter, quantize)
    if args.run_dir:
        print(_which_step(Path(args.run_dir), delta, args.best))
    return 0


def _gguf_tools(args, inputs):
    """llama.cpp's converter and, for its types, llama-quantize, found before any work (a missing one is said at
    once), once the GGUF and its Modelfile are known to be writable."""
    from usaf.export.gguf import QUANTIZE_OUTTYPES, check_outtype, find_converter, find_quantize
    from usaf.export.ollama import modelfile_path
    from usaf.io.guard import GGUF, check_output

    check_output(args.gguf, GGUF, flag="--gguf", force=args.force, inputs=inputs, noun="output file")
    if (modelfile := modelfile_path(Path(args.gguf))).exists() and not args.force:
        raise UsafError(
            f"{modelfile} exists (the Modelfile --gguf writes beside it); pass --force to replace it."
        )
    check_outtype(args.outtype)
    converter = find_converter(args.llama_cpp)
    return converter, find_quantize(converter) if args.outtype in QUANTIZE_OUTTYPES else None


def _write_gguf(args, base, delta, converter, quantize) -> None:
    """The GGUF and its Modelfile from --merged, or from a merged folder written beside it for the conversion and
    removed after."""
    import shutil

    from usaf.export.gguf import convert, model_name
    from usaf.export.merged import write_merged
    from usaf.export.ollama import write_modelfile
    from usaf.io.atomic import remove_stale_temporaries, temporary_name

    out = Path(args.gguf)
    merged = Path(args.merged) if args.merged else None
    scratch = None
    if merged is None:
        remove_stale_temporaries(out)
        scratch = temporary_name(out)
        merged = write_merged(base, delta, scratch, flag="--gguf")
    name = args.model_name or model_name(base.dir, Path(args.run_dir) if args.run_dir else None)
    try:
        path = convert(merged, out, args.outtype, converter, name, quantize)
        modelfile = write_modelfile(merged, path)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    by = f"{converter} and {quantize}" if quantize else str(converter)
    print(f"gguf: {path} ({_size(path)}, {args.outtype}, general.name {name!r}, by {by})")
    print(f"ollama: {modelfile} (ollama create NAME -f {modelfile})")


def _export_inputs(args) -> list[tuple[str, str | Path | None]]:
    """What an export reads: its outputs may never replace or lie inside them."""
    from usaf.base.record import run_base_dir

    base = args.base
    if base is None and args.run_dir:
        try:
            base = run_base_dir(Path(args.run_dir))
        except Exception:  # an unreadable run: said once the run is read
            base = None
    return [
        ("the run", args.run_dir),
        ("the Trainer checkpoint", args.from_trainer),
        ("the base checkpoint", base),
    ]


def _which_step(run_dir: Path, delta, best: bool = False) -> str:
    """Which step was exported, and whether the run had finished (a stopped run exports its last checkpoint)."""
    from usaf.config import read_yaml

    source = delta.info.get("source") or {}
    step = source.get("step")
    if best:
        return f"exported step {step} ({source.get('checkpoint')}): the run's best evaluation so far"
    try:
        planned = (
            (read_yaml((run_dir / CONFIG_FILE).read_text(), CONFIG_FILE) or {}).get("schedule") or {}
        ).get("max_steps")
    except (OSError, UsafError, AttributeError):
        planned = None
    of = f" of schedule.max_steps={planned}" if planned else ""
    if (delta.info.get("training") or {}).get("steps") == step:
        return f"exported step {step}{of} ({source.get('checkpoint')}): the run is finished"
    return (
        f"exported step {step}{of} ({source.get('checkpoint')}): the run is NOT finished (stopped or still "
        f"training); to finish it: usaf train --resume {run_dir}"
    )


def _size(path: Path) -> str:
    return f"{Path(path).stat().st_size:,} bytes"
