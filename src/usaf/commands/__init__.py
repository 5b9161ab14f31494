"""One module per `usaf` subcommand, each exposing `add_command(subparsers)`."""

from __future__ import annotations

import argparse


def add_set_option(
    parser: argparse.ArgumentParser, help: str = "override a setting, e.g. optim.lr=3e-4"
) -> None:
    """`--set a=1 b=2` and `--set a=1 --set b=2` alike."""
    parser.add_argument("--set", action="extend", nargs="+", default=[], metavar="KEY=VALUE", help=help)
