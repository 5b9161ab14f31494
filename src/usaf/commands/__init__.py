"""One module per `usaf` subcommand, named as the command (`usaf.commands.eval` is `usaf eval`), registered in
`usaf.cli.COMMANDS` (a `usaf.registry.Registry`) in the order `usaf --help` shows them. A command module (the
protocol `Command`, checked when it is registered; any object with a `__name__` and these members will do):

- its docstring: the first paragraph is the one-line help of `usaf --help`, the rest the description of
  `usaf NAME --help` (both read by `command_texts`; argparse reflows them, so they are written as prose);
- `add_arguments(parser)`: the command's arguments, and any defaults its `run` or the shared readers expect
  (`parser.set_defaults(...)`);
- `run(args) -> int`: the command itself, its exit code.

Its name is the last part of its `__name__` (`command_name`): a command written outside usaf is a module of its
own, `usaf.cli.COMMANDS.register(module)` before `usaf.cli.main` runs.

What several commands share lives here (`add_set_option`, `add_run_inputs`) or in the command it belongs to (the
run configuration of `usaf.commands.train.effective_config`, the model options of `usaf.commands.generate`)."""

from __future__ import annotations

import argparse
import inspect
from typing import Protocol, runtime_checkable


@runtime_checkable
class Command(Protocol):
    """A `usaf` subcommand (see the module docstring): its arguments and what it does."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def command_name(command: Command) -> str:
    """The name a command is typed as: its module's last name (`usaf.commands.eval` -> eval)."""
    return command.__name__.rpartition(".")[2]


def command_texts(module: Command) -> tuple[str, str | None]:
    """(help, description) of a command module, from its docstring: the first paragraph, the rest (None if none),
    each on one line."""
    paragraphs = [" ".join(p.split()) for p in inspect.cleandoc(module.__doc__ or "").split("\n\n")]
    paragraphs = [p for p in paragraphs if p]
    if not paragraphs:
        raise ValueError(f"{module.__name__} has no docstring: its first paragraph is the command's help")
    return paragraphs[0], " ".join(paragraphs[1:]) or None


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
