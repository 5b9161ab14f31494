"""fine-tune a model's own weights sparsely (expert entries, attention, embedding and output rows; routers if
asked) on data files

Fine-tune sparsely. Every option lives in one configuration: a YAML file (--config) with --set section.key=value
overrides; --print-config shows the effective result, --list-options all keys.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from usaf.commands import add_run_inputs, add_set_option
from usaf.errors import ConfigError, RunStateError, UsafError
from usaf.files import CONFIG_FILE

if TYPE_CHECKING:
    from usaf.config import RunConfig


def add_arguments(parser) -> None:
    add_run_inputs(parser, data="training files, comma separated (data.train)")
    parser.add_argument("--eval-data", help="held-out files, comma separated (data.eval)")
    parser.add_argument("--out", help="run directory (checkpoints, metrics, summary)")
    parser.add_argument(
        "--card",
        help="plan the run for this card (train.card, e.g. rtx-3060-12gb): its memory is the budget every auto "
        "fits, as `usaf plan --device` plans it",
    )
    parser.add_argument(
        "--force", action="store_true", help="start the run in an existing folder that is not a usaf run"
    )
    add_set_option(parser)
    parser.add_argument(
        "--skip-bad-records", action="store_true", help="skip malformed records and count them"
    )
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue a stopped run exactly where it stopped")
    parser.add_argument(
        "--print-config", action="store_true", help="print the effective configuration and exit"
    )
    parser.add_argument(
        "--list-options", action="store_true", help="list every option with its default and exit"
    )


def effective_config(args) -> RunConfig:
    from usaf.config import RunConfig

    overrides = list(args.set)
    config_path, load = args.config, RunConfig.load
    if getattr(args, "resume", None) and not config_path:
        load = RunConfig.load_saved  # the run's own config.yaml
    if getattr(args, "resume", None):
        saved = Path(args.resume) / CONFIG_FILE
        if not saved.exists():
            raise RunStateError(f"--resume {args.resume}: no config.yaml there; is it a usaf run directory?")
        config_path = config_path or str(saved)
    # paths as typed, never read as YAML (`qwen #2` is not `qwen` and a comment)
    if args.model:
        overrides.append(("model.path", args.model))
    if args.data:
        overrides.append(("data.train", args.data))
    if getattr(args, "eval_data", None):
        overrides.append(("data.eval", args.eval_data))
    if getattr(args, "card", None):
        overrides.append(("train.card", args.card))
    if getattr(args, "skip_bad_records", False):
        overrides.append("data.skip_bad_records=true")
    return load(config_path, overrides)


def run(args) -> int:
    from usaf.config import describe
    from usaf.train.state import format_summary, stopped_exit_code

    if args.list_options:
        print(describe())
        return 0
    config = effective_config(args)
    if args.print_config:
        print(config.to_yaml(), end="")
        return 0
    run_dir = args.resume or args.out
    if not run_dir:
        raise ConfigError("give --out RUN_DIR for a new run (or --resume RUN_DIR).")
    if args.config and not args.resume:  # the run's other inputs are in its config; this one is not
        from usaf.io.guard import check_placement

        check_placement(Path(run_dir), "--out", [("the config file", args.config)])
    summary = _train_in_job(config, run_dir, args)
    if summary.get("already_finished"):
        print(
            f"{run_dir} is finished (step {summary['step']} of schedule.max_steps="
            f"{config.schedule.max_steps}); nothing changed. To train longer: usaf train --resume {run_dir} "
            f"--set schedule.max_steps=N (N > {summary['step']})."
        )
    if (code := stopped_exit_code(summary)) is not None:
        return code
    print(format_summary(summary))
    return 0


def _train_in_job(config: RunConfig, run_dir: str, args) -> dict:
    """`train`, with the job's communication failing under torchrun (another rank died or hangs) said in one line
    on each rank that is left, instead of a traceback per rank."""
    from usaf.train import checkpoint, distributed
    from usaf.train.loop import train

    try:
        summary = train(config, run_dir, resume=bool(args.resume), force=args.force)
        distributed.leave()
        return summary
    except Exception as err:
        if (failed := distributed.peer_failure(err)) is None:
            raise
        latest = checkpoint.latest(Path(run_dir))
        world, me = os.environ.get("WORLD_SIZE", "?"), os.environ.get("RANK", "?")
        raise UsafError(
            f"rank {me} of {world} stopped: {failed}; another rank died or stopped answering (its own output and "
            "torchrun's report name it). "
            + (
                f"Resume with usaf train --resume {run_dir} under torchrun with the same number of processes: it "
                f"continues from its last checkpoint, {latest.name}."
                if latest
                else "No checkpoint was written yet: start the run again."
            )
        ) from None
