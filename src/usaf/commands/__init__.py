"""One module per `usaf` subcommand, each exposing `add_command(subparsers)`."""

from __future__ import annotations

import argparse


def add_set_option(
    parser: argparse.ArgumentParser, help: str = "override a setting, e.g. optim.lr=3e-4"
) -> None:
    """`--set a=1 b=2` and `--set a=1 --set b=2` alike."""
    parser.add_argument("--set", action="extend", nargs="+", default=[], metavar="KEY=VALUE", help=help)


def add_run_inputs(
    parser: argparse.ArgumentParser,
    model: str = "model directory or hub id (model.path)",
    data: str = "data files, comma separated (data.train)",
) -> None:
    """--model, --data and --config: what the commands that read a run's configuration (train, select, data) take
    alike, resolved by `usaf.commands.train.effective_config`."""
    parser.add_argument("--model", help=model)
    parser.add_argument("--data", help=data)
    parser.add_argument("--config", help="YAML run configuration")
