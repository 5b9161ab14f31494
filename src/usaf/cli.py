"""`usaf` command line."""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import os
import re
import signal
import sys

from safetensors import SafetensorError

from usaf.commands import command_texts
from usaf.errors import UsafError
from usaf.version import __version__

# One module of usaf.commands per command, in the order `usaf --help` lists them (the protocol: usaf.commands).
COMMANDS: tuple[str, ...] = (
    "plan",
    "train",
    "eval",
    "prepare",
    "export",
    "apply",
    "generate",
    "chat",
    "report",
    "select",
    "data",
    "demo",
)


class UsageError(UsafError):
    """A command line argparse cannot read."""


class _Parser(argparse.ArgumentParser):
    """argparse's errors as usaf's: one line naming the option and where the usage is, not the usage block and
    argparse's own exit (subcommands' parsers are of this class too)."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message}; see `{self.prog} --help`.")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="usaf",
        description="Fine-tune a Mixture-of-Experts model's own expert weights, sparsely, on a frozen base.",
    )
    parser.add_argument("--version", action="version", version=f"usaf {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"usaf.commands.{name}")
        help_line, description = command_texts(module)
        command = sub.add_parser(name, help=help_line, description=description)
        module.add_arguments(command)
        command.set_defaults(func=module.run)
    return parser


# options whose value may start with '-' (a negative size), which argparse would take for an option
_VALUE_OPTIONS = ("--vram", "--ram")
# errors of the file system a user can fix: one line, not a traceback
_FILE_SYSTEM_ERRORS = {
    errno.ENOSPC: "free some space (or choose another folder) and run it again",
    errno.EDQUOT: "free some space (or choose another folder) and run it again",
    errno.EROFS: "choose a writable folder",
    errno.EACCES: "check its permissions (or choose another folder)",
    errno.EPERM: "check its permissions (or choose another folder)",
}


def _join_values(argv: list[str]) -> list[str]:
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in _VALUE_OPTIONS and arg.startswith("-") and arg[1:2].isdigit():
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(_join_values(list(sys.argv[1:] if argv is None else argv)))
        if extra:  # argparse names the top-level program; the options belong to the command's
            prog = f"usaf {args.command}" if getattr(args, "command", None) else "usaf"
            raise UsageError(f"{prog}: unrecognized arguments: {' '.join(extra)}; see `{prog} --help`.")
    except UsageError as err:
        print(f"usaf: error: {err}", file=sys.stderr)
        return 2
    from usaf.model.hf import quiet_progress_bars

    quiet_progress_bars()
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        _read_arguments(args)
        return int(args.func(args) or 0)
    except UsafError as err:
        print(f"usaf: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `usaf train --list-options | head`: the reader has gone, as for any tool
        _quiet_broken_pipe()
        return 128 + signal.SIGPIPE
    except (OSError, SafetensorError) as raised:
        err = _as_os_error(raised)
        if err is None or err.errno not in _FILE_SYSTEM_ERRORS:
            raise
        where = f"{err.filename}: " if err.filename else ""
        print(
            f"usaf: error: {where}{err.strerror or err}; {_FILE_SYSTEM_ERRORS[err.errno]} (files already "
            "written are complete: usaf writes under temporary names and renames)",
            file=sys.stderr,
        )
        return 2
    except (
        KeyboardInterrupt
    ) as interrupt:  # a second Ctrl-C during training, or one before it began: no traceback
        # (or a SIGTERM while an output is written: usaf.io.atomic.terminate_as_interrupt)
        signum = getattr(interrupt, "signum", signal.SIGINT)
        how = "" if signum == signal.SIGINT else f" ({signal.Signals(signum).name})"
        print(
            f"usaf: interrupted{how}; files already written are complete (checkpoints are atomic)",
            file=sys.stderr,
        )
        return 128 + signum


# options that set a config key: the same key given by --set too would be silently overridden by one of them
_OPTION_KEYS = {"model": "model.path", "data": "data.train", "eval_data": "data.eval"}
# arguments that are not paths (the rest are, or are names that no `~` or `$` begins)
_NOT_PATHS = {"command", "func", "set"}


def _read_arguments(args) -> None:
    """What every command's arguments share: `~` and `$VAR` in paths expanded as in a config file's path options
    (usaf.config.expand_path), and no two arguments that would silently override one another."""
    from usaf.config import expand_path

    for name, value in vars(args).items():
        if name in _NOT_PATHS:
            continue
        if isinstance(value, str):
            setattr(args, name, expand_path(value))
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            setattr(args, name, [expand_path(v) for v in value])
    prog = f"usaf {args.command}"
    for name, key in _OPTION_KEYS.items():
        given = [s for s in getattr(args, "set", None) or [] if s.split("=", 1)[0].strip() == key]
        if getattr(args, name, None) and given:
            option = "--" + name.replace("_", "-")
            raise UsageError(
                f"{prog}: {option} and --set {key}=... both give {key}; give one of them (the other would be "
                "ignored)."
            )
    resume, out = getattr(args, "resume", None), getattr(args, "out", None)
    if resume and out and os.path.realpath(resume) != os.path.realpath(out):
        raise UsageError(
            f"{prog}: --resume {resume} continues that run in its own folder, so --out {out} would be ignored; "
            "drop --out (or, for a new run, drop --resume)."
        )


def _as_os_error(err: BaseException) -> OSError | None:
    """safetensors reports a failed write as SafetensorError("... I/O error: ... (os error 28)")."""
    if isinstance(err, OSError):
        return err
    found = re.search(r"\(os error (\d+)\)", str(err))
    return OSError(int(found[1]), os.strerror(int(found[1]))) if found else None


def _quiet_broken_pipe() -> None:
    """The reader of stdout has gone: point stdout at /dev/null so the interpreter's final flush is silent."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
