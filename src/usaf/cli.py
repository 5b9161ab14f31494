"""`usaf` command line."""

from __future__ import annotations

import argparse
import signal
import sys

from . import __version__
from .commands import add_set_option
from .errors import UsafError

# Each command lives in its own module exposing `add_command(subparsers)`; add new ones here.
COMMANDS: tuple[str, ...] = ("plan", "train", "prepare", "export", "report", "select")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="usaf",
        description="Fine-tune a Mixture-of-Experts model's own expert weights, sparsely, on a frozen base.",
    )
    parser.add_argument("--version", action="version", version=f"usaf {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    import importlib

    for name in COMMANDS:
        importlib.import_module(f"usaf.commands.{name}").add_command(sub)
    demo = sub.add_parser("demo", help="fine-tune the bundled small MoE on the bundled task")
    demo.add_argument("--out", default=None, help="output directory (default: ./demo-run)")
    add_set_option(demo, "override a demo setting")
    demo.set_defaults(func=_demo)
    return parser


def _demo(args) -> int:
    from .demo import run_demo

    return run_demo(args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # weight-loading bars would bury usaf's own progress
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except UsafError as err:
        print(f"usaf: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C during training, or one before it began: no traceback
        print(
            "usaf: interrupted; files already written are complete (checkpoints are atomic)", file=sys.stderr
        )
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
