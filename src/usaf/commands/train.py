"""`usaf train` and `usaf eval`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from usaf.commands import add_run_inputs, add_set_option
from usaf.config import RunConfig, describe
from usaf.errors import UsafError
from usaf.files import CONFIG_FILE


def add_command(sub) -> None:
    p = sub.add_parser(
        "train",
        help="fine-tune a model's own weights sparsely (expert entries, attention, embedding and output rows; routers "
        "if asked) on data files",
        description="Fine-tune sparsely. Every option lives in one configuration: a YAML file (--config) with "
        "--set section.key=value overrides; --print-config shows the effective result, --list-options all keys.",
    )
    add_run_inputs(p, data="training files, comma separated (data.train)")
    p.add_argument("--eval-data", help="held-out files, comma separated (data.eval)")
    p.add_argument("--out", help="run directory (checkpoints, metrics, summary)")
    p.add_argument(
        "--force", action="store_true", help="start the run in an existing folder that is not a usaf run"
    )
    add_set_option(p)
    p.add_argument("--skip-bad-records", action="store_true", help="skip malformed records and count them")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a stopped run exactly where it stopped")
    p.add_argument("--print-config", action="store_true", help="print the effective configuration and exit")
    p.add_argument("--list-options", action="store_true", help="list every option with its default and exit")
    p.set_defaults(func=run_train)

    e = sub.add_parser("eval", help="held-out loss and perplexity of a model or a run")
    e.add_argument("target", help="model directory, or a run directory (its latest checkpoint is evaluated)")
    e.add_argument("--data", required=True, help="files to evaluate on, comma separated")
    add_set_option(e)
    e.set_defaults(func=run_eval)


def effective_config(args) -> RunConfig:
    overrides = list(args.set)
    config_path = args.config
    if getattr(args, "resume", None):
        saved = Path(args.resume) / CONFIG_FILE
        if not saved.exists():
            raise UsafError(f"--resume {args.resume}: no config.yaml there; is it a usaf run directory?")
        config_path = config_path or str(saved)
    if args.model:
        overrides.append(f"model.path={args.model}")
    if args.data:
        overrides.append(f"data.train={args.data}")
    if getattr(args, "eval_data", None):
        overrides.append(f"data.eval={args.eval_data}")
    if getattr(args, "skip_bad_records", False):
        overrides.append("data.skip_bad_records=true")
    return RunConfig.load(config_path, overrides)


def run_train(args) -> int:
    from usaf.train.loop import train
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
        raise UsafError("give --out RUN_DIR for a new run (or --resume RUN_DIR).")
    if args.config and not args.resume:  # the run's other inputs are in its config; this one is not
        from usaf.io.guard import check_placement

        check_placement(Path(run_dir), "--out", [("the config file", args.config)])
    summary = train(config, run_dir, resume=bool(args.resume), force=args.force)
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


def run_eval(args) -> int:
    from usaf.config import split_paths
    from usaf.train.evaluate import evaluate_target

    result = evaluate_target(args.target, split_paths(args.data), args.set)
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0
