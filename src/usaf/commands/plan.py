"""memory ledger, verdict and step-time estimate for a model, from its config alone

Plan a sparse fine-tune: where memory goes, whether it fits, and settings that would. With no flags it plans what
`usaf train` would run: the run's defaults (or --config's), its autos resolved as train resolves them, on its card
(train.card, else this machine's device).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path
from typing import TYPE_CHECKING

from usaf.errors import ConfigError
from usaf.files import CONFIG_FILE

if TYPE_CHECKING:
    from usaf.config import RunConfig


def add_arguments(parser) -> None:
    from usaf import planner

    # the help lists the options in these groups
    _machine_options(parser.add_argument_group("the model and the machine"), planner)
    _run_options(parser.add_argument_group("the run"), planner)
    _storage_options(parser.add_argument_group("the frozen base"), planner)
    _parallel_options(parser.add_argument_group("several GPUs"))
    simulation = parser.add_argument_group("the simulated step")
    simulation.add_argument(
        "--simulate",
        action="store_true",
        help="run the plan's training step on fake tensors at the model's full shape (no weight read) and set its "
        "device peak, host syncs and device mismatches beside the plan (docs/simulate.md)",
    )
    simulation.add_argument(
        "--simulate-rank", type=int, default=0, help="with --gpus: the rank simulated (default 0)"
    )


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
        help=f"device preset: {', '.join(planner.DEVICES)} (default: the preset whose memory matches --vram, "
        "else the run's train.card, else the device usaf train would compute on)",
    )
    p.add_argument("--vram", default=None, help="device memory, e.g. 12GB (default: the card's)")
    p.add_argument("--ram", default=None, help="host RAM, e.g. 32GB (default: this machine's)")


def _run_options(p, planner) -> None:
    """The run's shape: sequences, what is trained and how, the loss's chunks, the optimizer and the dtype. Each
    defaults to the run's own option (--config's, else usaf train's default), named in its help."""
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (data.max_seq_len)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (data.batch_size)")
    p.add_argument(
        "--density",
        type=float,
        default=None,
        help="share of each targeted weight's entries trained (select.density)",
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
        "--targets", default=None, help="weights that hold trained entries, comma-separated (select.targets)"
    )
    p.add_argument("--granularity", default=None, choices=["element", "neuron"], help="select.granularity")
    p.add_argument(
        "--no-recompute", action="store_true", help="keep every layer's activations (train.recompute=false)"
    )
    p.add_argument(
        "--no-reselect",
        action="store_true",
        help="no reselection (select.reselect_every=0): no probe windows",
    )
    p.add_argument(
        "--logits-chunk",
        type=int,
        default=None,
        help="tokens per logits chunk of the loss (train.logits_chunk_tokens)",
    )
    p.add_argument(
        "--optimizer",
        default=None,
        choices=list(planner.OPTIMIZERS),
        help="adamw: bf16 moments with stochastic rounding (4 B per value, optim's default); adamw-fp32: 8 B; "
        "adamw8bit: 2 B",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=list(planner.DTYPE_BYTES),
        help="compute and dense-weight dtype (default: model.dtype, whose auto is bf16 on GPUs, fp32 on the CPU)",
    )


def _storage_options(p, planner) -> None:
    """Where the frozen base lives and in what format."""
    p.add_argument(
        "--quant",
        default=None,
        choices=["auto", *planner.quant_formats()],
        help="frozen experts' format (model.quant; auto: the least lossy that fits)",
    )
    p.add_argument(
        "--quant-dense",
        action="store_true",
        help="store dense linear layers as int8 too (on disk: loading dequantizes them)",
    )
    p.add_argument(
        "--residency",
        default=None,
        choices=["auto", *planner.RESIDENCIES],
        help="where the frozen experts live (model.residency; auto: the device if they fit, else pinned host "
        "memory, else memory-mapped)",
    )
    p.add_argument(
        "--workspace-mb",
        type=int,
        default=None,
        help="dequantized routed-expert workspace bound (select.workspace_mb)",
    )


def _parallel_options(p) -> None:
    """A torchrun job's GPUs and how the model is spread over them."""
    p.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="GPUs of a torchrun job, one process each (data parallel: every GPU holds the whole model); "
        "the ledger is then one rank's, with the bytes exchanged per step (default: distributed.expert_parallel)",
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
        if value is None:  # not given: the run's own, checked when it was read
            continue
        if value < low:
            raise ConfigError(f"{flag} must be at least {low}, got {value}.")
        if value > most:
            raise ConfigError(f"{flag} must be at most {most}, got {value}.")
    if args.density is not None and not 0 < args.density <= 1:
        raise ConfigError(f"--density must be in (0, 1], got {args.density:g} (e.g. 0.005 for 0.5 %).")


def _card(args, run_config: RunConfig):
    """What the plan is for (`usaf.train.memory_plan.Card`): --device, else the preset whose memory is --vram (or
    a GPU of that memory, without speed figures), else the card usaf train would plan the run against
    (train.card, else the device it computes on); --vram and --ram set the memory."""
    from usaf import planner
    from usaf.train import memory_plan, runtime

    vram = memory_size(args.vram, "--vram") if args.vram is not None else None
    ram = memory_size(args.ram, "--ram") if args.ram is not None else None
    if args.device is not None and args.device not in planner.DEVICES:
        raise ConfigError(f"Unknown device {args.device!r}; device presets: {', '.join(planner.DEVICES)}.")
    if args.device is None and vram is None:  # usaf train's own card
        card = memory_plan.run_card(run_config, runtime.resolve_device(run_config.model.device))
        if card.device.is_gpu:
            return dataclasses.replace(card, ram=ram)
        budget = ram if ram is not None else card.budget
        where = card.where if ram is None else f"{planner.format_size(ram)} (--ram)"
        return memory_plan.Card(card.device, budget, where)
    if args.device is not None:
        device, source = planner.DEVICES[args.device], f"--device {args.device}"
    else:
        matching = [d for d in planner.DEVICES.values() if d.is_gpu and d.memory == vram]
        device, source = (matching[0], f"--vram, as {matching[0].name}") if matching else (None, "--vram")
        device = device or memory_plan.unnamed_gpu(f"a {planner.format_size(vram)} GPU", vram)
    if not device.is_gpu:
        budget = ram if ram is not None else planner.machine_ram()
        where = "--ram" if ram is not None else "the machine's RAM"
        return memory_plan.Card(device, budget, f"{planner.format_size(budget)} ({where})")
    budget, source = (vram, "--vram") if vram is not None else (device.memory, source)
    device = dataclasses.replace(device, memory=budget)
    return memory_plan.Card(device, budget, f"{planner.format_size(budget)} ({source})", ram)


def _run_config(args, named) -> RunConfig:
    """The run planned: --config's, a run's own (--model RUN), else usaf train's defaults."""
    from usaf.config import RunConfig

    if args.config is not None:
        return RunConfig.load(args.config)
    if named is not None and named.is_run:
        return RunConfig.load_saved(str(Path(named.path) / CONFIG_FILE))
    return RunConfig()


def _dtype(args, run_config: RunConfig, device) -> str:
    """The compute dtype: --dtype, else model.dtype, whose auto is what usaf train resolves on the card."""
    from usaf import planner
    from usaf.train import memory_plan, runtime

    if args.dtype is not None:
        return args.dtype
    if run_config.model.dtype != "auto":
        return memory_plan.planner_dtype(runtime.DTYPES[run_config.model.dtype])
    return planner.default_dtype(device)


def run(args: argparse.Namespace) -> int:
    from usaf import planner
    from usaf.io.model_source import STORE, model_source
    from usaf.io.published import METHODS, keeps_published, published_method

    _check_numbers(args)
    named = model_source(args.model) if args.model else None  # read once: the run's or the model's
    run_config = _run_config(args, named)
    model = (args.model if named is None or not named.is_run else None) or run_config.model.path
    if not model:
        raise ConfigError("usaf plan needs --model (or --config with a model.path).")
    source = named if named is not None and not named.is_run else model_source(model)  # --model, or the base
    if Path(source.path).is_dir():  # a cached hub id: its snapshot's config.json
        model = source.path
    run_config, lines = _fitted(run_config, model)
    card = _card(args, run_config)
    settings = _given_flags_over(
        planner.settings_for_run(planner.PlannedRun.of(run_config), _dtype(args, run_config, card.device)),
        args,
    )
    if source.kind == STORE:  # its experts as stored: the store's format (another --quant is refused)
        settings = settings.replace(quant=source.quant_for(args.quant or "none"))
    name, config = planner.load_model_config(model)
    method = published_method(config, model)  # any other quantization: refused as usaf train refuses it
    if method is not None and not keeps_published(args.quant or run_config.model.quant):
        method = (
            None  # told otherwise: its experts are planned at the format asked for, as usaf train stores them
        )
    if source.kind == STORE:  # its config.json is the checkpoint's: the store's own format says what it holds
        method = source.quant if source.quant in METHODS else None
    if method is not None:  # its experts are planned as published, as usaf train keeps them
        settings = settings.replace(quant=method)
    shape = planner.model_shape(config, name)
    settings, block = _resolved(shape, settings, card)
    print("\n".join([*lines, *block, ""]))
    verdict = planner.decide(shape, settings, card.device, *card.memory, residency=settings.residency)
    print(planner.format_verdict(model, verdict))
    if method is not None:
        print(planner.published_line(shape, settings, card.device, card.ram, "auto"))
    if args.simulate:
        return _simulate(args, verdict, config)
    return 0 if verdict.status != "does not fit" else 1


def _simulate(args, verdict, config: dict) -> int:
    """--simulate: the chosen plan's step on fake tensors, beside the plan; exit 1 on a finding."""
    from usaf import simulate

    if verdict.status == "does not fit":
        raise ConfigError(
            "--simulate simulates a plan that fits; give settings that fit (the suggestion above)."
        )
    gpus = verdict.chosen.settings.gpus
    if not 0 <= args.simulate_rank < gpus:
        raise ConfigError(
            f"--simulate-rank must be in 0..{gpus - 1} (--gpus {gpus}), got {args.simulate_rank}."
        )
    result = simulate.simulate(verdict.chosen, config, args.simulate_rank)
    print("\n".join(simulate.format_report(verdict.chosen, result)))
    return 1 if result.mismatches else 0


def _fitted(run_config: RunConfig, model: str) -> tuple[RunConfig, list[str]]:
    """The run's data.max_seq_len within the model's positions, as usaf train fits it, and the line saying so."""
    from usaf.data.load import fit_context

    data, line = fit_context(run_config.data, model)
    return run_config.replace({"data.max_seq_len": data.max_seq_len}), [line] if line else []


def _resolved(shape, settings, card) -> tuple:
    """The settings with their autos resolved as usaf train resolves them, by the same functions (the experts'
    storage and residency, density, workspace and cache, then recomputation, then the forward's precision), and the
    lines train prints for them: what each auto chose, and the effective settings block."""
    from usaf import planner
    from usaf.train import memory_plan, recompute

    planned, lines = memory_plan.auto_settings(memory_plan.RunPlan(shape, settings, card))
    setting = planned.settings.run.train.recompute
    chosen = recompute.planned_recompute(planned) if setting == "auto" else recompute.given_recompute(setting)
    settings = planned.settings.replace(recompute=chosen.recompute)
    precision = memory_plan.precision_name(
        settings.run.train.precision, memory_plan.TORCH_DTYPES[settings.dtype]
    )
    return settings, [*lines, chosen.line, planner.effective_settings(settings, precision, card.line)]


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
    "gpus": "gpus",
    "expert_parallel": "expert_parallel",
    "gpus_per_host": "gpus_per_host",
    "quant_dense": "quant_dense",
}


def _given_flags_over(from_run, args):
    """The run's settings, with every flag the user gave on top (flags default to None: the run's own)."""
    given = {
        field: value
        for flag, field in _FLAG_FIELDS.items()
        if (value := getattr(args, flag)) is not None and value is not False
    }
    if isinstance(given.get("targets"), str):
        given["targets"] = tuple(t.strip() for t in given["targets"].split(",") if t.strip())
    if args.residency is not None:  # auto: the plan's choice, as usaf train's (usaf.planner.storage)
        given["residency"] = args.residency
    if args.no_recompute:
        given["recompute"] = False
    if args.no_reselect:
        given["reselect"] = False
    return from_run.replace(**given)
