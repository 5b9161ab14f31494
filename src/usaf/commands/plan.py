"""memory ledger, verdict and step-time estimate for a model, from its config alone

Plan a sparse fine-tune: where memory goes, whether it fits, and settings that would.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from usaf.errors import ConfigError
from usaf.files import CONFIG_FILE


def add_arguments(parser) -> None:
    from usaf import planner

    # the help lists the options in these groups
    _machine_options(parser.add_argument_group("the model and the machine"), planner)
    _run_options(parser.add_argument_group("the run"), planner)
    _storage_options(parser.add_argument_group("the frozen base"), planner)
    _parallel_options(parser.add_argument_group("several GPUs"))


def _machine_options(p, planner) -> None:
    """What is planned, on what: the model, a run's configuration, the device and the host."""
    p.add_argument(
        "--model",
        default=None,
        help=f"model directory, config.json, or a preset: {', '.join(planner.list_presets())} "
        "(default with --config: its model.path)",
    )
    p.add_argument(
        "--config",
        default=None,
        help="plan a run's own configuration (YAML, as `usaf train --config`): its sequence, batch, selection, "
        "storage and optimizer; flags given beside it override it",
    )
    p.add_argument(
        "--device",
        default=None,
        help=f"device preset: {', '.join(planner.DEVICES)} (default: "
        "rtx-3060-12gb, or the preset whose memory matches --vram)",
    )
    p.add_argument("--vram", default=None, help="device memory, e.g. 12GB (default: the device preset's)")
    p.add_argument("--ram", default=None, help="host RAM, e.g. 32GB (default: this machine's)")


def _run_options(p, planner) -> None:
    """The run's shape: sequences, what is trained and how, the loss's chunks, the optimizer and the dtype."""
    from usaf.config import DEFAULT_DENSITY, DEFAULT_LOGITS_CHUNK, DEFAULT_TARGETS

    seq, batch = planner.PLAN_DEFAULTS["seq"], planner.PLAN_DEFAULTS["batch"]
    p.add_argument("--seq", type=int, default=seq, help=f"tokens per sequence (default {seq})")
    p.add_argument("--batch", type=int, default=batch, help=f"sequences per step (default {batch})")
    p.add_argument(
        "--density",
        type=float,
        default=DEFAULT_DENSITY,
        help=f"share of each targeted weight's entries trained (default {DEFAULT_DENSITY})",
    )
    p.add_argument(
        "--num-entries",
        type=int,
        default=None,
        help="a global budget of trained entries, split by size; overrides --density (select.num_entries)",
    )
    p.add_argument(
        "--layers",
        default=None,
        help="decoder layer numbers to train, e.g. 0,2 (select.layers; default: all, with the embedding and "
        "output layer)",
    )
    p.add_argument(
        "--targets",
        default=",".join(DEFAULT_TARGETS),
        help=f"weights that hold trained entries, comma-separated (select.targets; default {','.join(DEFAULT_TARGETS)})",
    )
    p.add_argument("--granularity", default="element", choices=["element", "neuron"])
    p.add_argument(
        "--no-recompute", action="store_true", help="keep every layer's activations (no recomputation)"
    )
    p.add_argument(
        "--no-reselect",
        action="store_true",
        help="no reselection (select.reselect_every=0): no probe windows",
    )
    p.add_argument(
        "--logits-chunk",
        type=int,
        default=DEFAULT_LOGITS_CHUNK,
        help=f"tokens per logits chunk of the loss (default {DEFAULT_LOGITS_CHUNK}, as train.logits_chunk_tokens)",
    )
    p.add_argument(
        "--optimizer",
        default="adamw",
        choices=list(planner.OPTIMIZERS),
        help="adamw: bf16 moments with stochastic rounding (4 B per value, the default); adamw-fp32: 8 B; "
        "adamw8bit: 2 B",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=list(planner.DTYPE_BYTES),
        help="compute and dense-weight dtype (default bf16 on GPUs, fp32 on the CPU)",
    )


def _storage_options(p, planner) -> None:
    """Where the frozen base lives and in what format."""
    from usaf.config import DEFAULT_WORKSPACE_MB

    quant = planner.PLAN_DEFAULTS["quant"]
    p.add_argument(
        "--quant", default=quant, choices=list(planner.quant_formats()), help="frozen experts' format"
    )
    p.add_argument(
        "--quant-dense",
        action="store_true",
        help="store dense linear layers as int8 too (on disk: loading dequantizes them)",
    )
    p.add_argument(
        "--residency",
        default="auto",
        choices=["auto", *planner.RESIDENCIES],
        help="where the frozen experts live (auto: the device if they fit, else pinned host memory, "
        "else memory-mapped)",
    )
    p.add_argument(
        "--workspace-mb",
        type=int,
        default=DEFAULT_WORKSPACE_MB,
        help=f"dequantized routed-expert workspace bound (default {DEFAULT_WORKSPACE_MB}, as select.workspace_mb)",
    )


def _parallel_options(p) -> None:
    """A torchrun job's GPUs and how the model is spread over them."""
    p.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="GPUs of a torchrun job, one process each (data parallel: every GPU holds the whole model); "
        "the ledger is then one rank's, with the bytes exchanged per step",
    )
    p.add_argument(
        "--expert-parallel",
        nargs="?",
        const=True,
        default=False,
        type=int,
        metavar="EP",
        help="with --gpus N: each GPU holds E/EP experts of every layer and their trained entries; tokens travel "
        "all-to-all within each group of EP GPUs, and the N/EP groups are data-parallel replicas "
        "(distributed.expert_parallel; bare: EP = N; docs/distributed.md)",
    )
    p.add_argument(
        "--gpus-per-host",
        type=int,
        default=0,
        help="with --gpus: ranks on one host, sharing its --ram (default: up to 8)",
    )


# the sizes a memory can be: a typo's thousandfold (12000TB) is refused, not planned for
_MEMORY_LEAST, _MEMORY_MOST = 1 << 20, 100 << 40


def memory_size(text: str, flag: str) -> int:
    """--vram / --ram: a size with its unit, above zero ('12' alone would be 12 bytes: refused)."""
    from usaf import planner

    value = str(text).strip()
    if value.startswith("-"):
        raise ConfigError(f"{flag} {value} is negative; give the memory size, e.g. {flag} 12GB.")
    if re.fullmatch(r"\+?\d+(\.\d*)?", value):
        raise ConfigError(f"{flag} {value} has no unit; write {value}GB (or {value}GiB, {value}MB).")
    size = planner.parse_size(value)
    if size <= 0:
        raise ConfigError(f"{flag} {value} is no memory; give a size above zero, e.g. {flag} 12GB.")
    if not _MEMORY_LEAST <= size <= _MEMORY_MOST:
        raise ConfigError(
            f"{flag} {value} is {planner.format_size(size)}, outside 1MB..100TB (no device or host has that); "
            f"give the memory size, e.g. {flag} 12GB."
        )
    return size


def _check_numbers(args) -> None:
    from usaf.config import TOKENS_MOST

    # the ranges of the run options these flags stand for (usaf.config), so a plan never "fits" what train refuses
    for flag, value, low, most in (
        ("--seq", args.seq, 1, TOKENS_MOST),
        ("--batch", args.batch, 1, TOKENS_MOST),
        ("--logits-chunk", args.logits_chunk, 1, TOKENS_MOST),
        ("--workspace-mb", args.workspace_mb, 1, 1 << 30),
        ("--gpus", args.gpus, 1, 1 << 20),
        ("--gpus-per-host", args.gpus_per_host, 0, 1 << 20),
    ):
        if value < low:
            raise ConfigError(f"{flag} must be at least {low}, got {value}.")
        if value > most:
            raise ConfigError(f"{flag} must be at most {most}, got {value}.")
    if not 0 < args.density <= 1:
        raise ConfigError(f"--density must be in (0, 1], got {args.density:g} (e.g. 0.005 for 0.5 %).")


def _device(args) -> tuple:
    from usaf import planner

    vram = memory_size(args.vram, "--vram") if args.vram is not None else None
    if args.device is None:
        matching = [d for d in planner.DEVICES.values() if d.is_gpu and d.memory == vram]
        device = matching[0] if matching else planner.DEVICES["rtx-3060-12gb"]
    elif args.device in planner.DEVICES:
        device = planner.DEVICES[args.device]
    else:
        raise ConfigError(f"Unknown device {args.device!r}; device presets: {', '.join(planner.DEVICES)}.")
    return device, vram if vram is not None else (device.memory if device.is_gpu else None)


def run(args: argparse.Namespace) -> int:
    from usaf import planner
    from usaf.config import AUTO, RunConfig
    from usaf.io.model_source import STORE, model_source
    from usaf.io.published import published_method

    _check_numbers(args)
    device, vram = _device(args)
    ram = memory_size(args.ram, "--ram") if args.ram is not None else None
    settings = planner.PlanSettings(
        seq=args.seq,
        batch=args.batch,
        density=args.density,
        quant=args.quant,
        quant_dense=args.quant_dense,
        granularity=args.granularity,
        recompute=not args.no_recompute,
        reselect=not args.no_reselect,
        logits_chunk=args.logits_chunk,
        optimizer=args.optimizer,
        dtype=args.dtype or planner.default_dtype(device),
        workspace_mb=args.workspace_mb,
        targets=tuple(t.strip() for t in args.targets.split(",") if t.strip()),
        num_entries=args.num_entries,
        layers=args.layers,
        gpus=args.gpus,
        expert_parallel=args.expert_parallel,
        gpus_per_host=args.gpus_per_host,
    )
    model, residency = args.model, args.residency
    named = model_source(model) if model else None  # read once: the run's or the model's
    run = named if named is not None and named.is_run else None
    if run is not None:  # a run: its base, planned with the run's own configuration
        model = None
    if args.config is not None or run is not None:
        if args.config is not None:
            run_config = RunConfig.load(args.config)
        else:
            run_config = RunConfig.load_saved(str(Path(run.path) / CONFIG_FILE))
        model = model or run_config.model.path
        residency = residency if residency != "auto" else run_config.model.residency
        settings = _given_flags_over(
            planner.settings_for_run(planner.PlannedRun.of(run_config), settings.dtype), settings, args
        )
    if not model:
        raise ConfigError("usaf plan needs --model (or --config with a model.path).")
    source = named if named is not None and run is None else model_source(model)  # --model, or the run's base
    if source.kind == STORE:  # its experts as stored: the store's format (another --quant is refused)
        given = args.quant if args.quant != planner.PLAN_DEFAULTS["quant"] else "none"
        settings = settings.replace(quant=source.quant_for(given))
    if Path(source.path).is_dir():  # a cached hub id: its snapshot's config.json
        model = source.path
    name, config = planner.load_model_config(model)
    method = published_method(config, model)  # any other quantization: refused as usaf train refuses it
    if method is not None:  # its experts are planned as published, as usaf train keeps them
        settings = settings.replace(quant=method)
    shape = planner.model_shape(config, name)
    if settings.run.select.density is AUTO and settings.num_entries is None:  # as usaf train resolves it
        settings, why = planner.auto_density(shape, settings, device, vram, ram, residency=residency)
        print(f"select.density=auto: {settings.density:.2%}, {why}")
    if settings.run.select.workspace_mb is AUTO:  # then the workspace, at that density
        settings, why = planner.auto_workspace(shape, settings, device, vram, ram, residency=residency)
        if why is not None:
            print(f"select.workspace_mb=auto: {settings.workspace_mb} MB, {why}")
    verdict = planner.decide(shape, settings, device, vram, ram, residency=residency)
    print(planner.format_verdict(model, verdict))
    if method is not None:
        print(planner.published_line(shape, settings, device, ram, residency))
    return 0 if verdict.status != "does not fit" else 1


# the flags a run's configuration also sets, and the settings field each one fills
_FLAG_FIELDS = {
    "seq": "seq",
    "batch": "batch",
    "density": "density",
    "quant": "quant",
    "granularity": "granularity",
    "logits_chunk": "logits_chunk",
    "optimizer": "optimizer",
    "workspace_mb": "workspace_mb",
    "targets": "targets",
    "num_entries": "num_entries",
    "layers": "layers",
    "no_recompute": "recompute",
    "no_reselect": "reselect",
    "gpus": "gpus",
    "expert_parallel": "expert_parallel",
    "gpus_per_host": "gpus_per_host",
}


def _given_flags_over(from_config, from_flags, args):
    """The run's settings, with every flag the user gave (a value other than the flag's default) on top."""
    defaults = _parser_defaults()
    given = {
        field: getattr(from_flags, field)
        for flag, field in _FLAG_FIELDS.items()
        if getattr(args, flag) != defaults[flag]
    }
    return from_config.replace(**given)


def _parser_defaults() -> dict:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return vars(parser.parse_args(["--model", "x"]))
