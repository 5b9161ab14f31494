"""`usaf` command line."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import io
import os
import signal
import sys
import threading
from collections.abc import Iterable
from pathlib import Path

from usaf import startup
from usaf.commands import Command, command_name, command_texts
from usaf.errors import ConfigError, UsafError, unknown_names
from usaf.io.atomic import Terminated, check_destination, output_error
from usaf.registry import Registry
from usaf.version import __version__

# One module of usaf.commands per command, in the order `usaf --help` lists them (the protocol: usaf.commands).
# Their heavy imports (torch, transformers, the config) are deferred into their functions, so that importing them
# all here, for their help lines, costs nothing: `usaf --help` answers at once (bench/startup.py).
COMMANDS: Registry[Command] = Registry("usaf command", Command, command_name)
for _name in (
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
):
    COMMANDS.register(importlib.import_module(f"usaf.commands.{_name}"))


class UsageError(ConfigError):
    """A command line argparse cannot read."""


class _Parser(argparse.ArgumentParser):
    """argparse's errors as usaf's: one line naming the option and where the usage is, not the usage block and
    argparse's own exit (subcommands' parsers are of this class too)."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message}; see `{self.prog} --help`.")


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser. `commands`: those whose arguments are added (None: all); the others are
    listed by their help line only, so that a command line builds only its own command's arguments (some, such
    as `usaf plan`'s presets, import the heavy modules)."""
    parser = _Parser(
        prog="usaf",
        description="Fine-tune a Mixture-of-Experts model's own expert weights, sparsely, on a frozen base.",
    )
    parser.add_argument("--version", action="version", version=f"usaf {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in COMMANDS.items():
        help_line, description = command_texts(module)
        command = sub.add_parser(name, help=help_line, description=description)
        if commands is None or name in commands:
            module.add_arguments(command)
        command.set_defaults(func=module.run)
    return parser


# options whose value may start with '-' (a negative size), which argparse would take for an option
_VALUE_OPTIONS = ("--vram", "--ram")
# the arguments that name a command's output (`usaf export --delta` too; elsewhere --delta is an input)
_OUTPUTS = {"out": "--out", "merged": "--merged", "gguf": "--gguf", "out_dir": "OUT_DIR"}


def _join_values(argv: list[str]) -> list[str]:
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in _VALUE_OPTIONS and arg.startswith("-") and arg[1:2].isdigit():
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit status: 0, 1 (a run that stopped), 2 (one line `usaf: error: ...`),
    128+N for a signal N (one line; SIGPIPE's 141, quietly, when the reader of standard output has gone)."""
    with _interruptible():
        try:
            try:
                return _main(argv)
            finally:  # what is still buffered (all of --help into a pipe): its reader's absence shows here
                if sys.stdout is not None:
                    sys.stdout.flush()
        except BrokenPipeError:
            # the reader has gone (`usaf data --show 100 | head -1`): end quietly with the status of a tool that
            # SIGPIPE stopped, as `cat` and `yes` do (Python ignores SIGPIPE and raises this instead)
            _quiet_broken_pipe()
            return 128 + signal.SIGPIPE
        except KeyboardInterrupt as interrupt:  # Ctrl-C or SIGTERM at any moment (before the command too)
            signum = getattr(interrupt, "signum", signal.SIGINT)
            how = "" if signum == signal.SIGINT else f" ({signal.Signals(signum).name})"
            print(
                f"usaf: interrupted{how}; files already written are complete (checkpoints are atomic)",
                file=sys.stderr,
            )
            return 128 + signum


def _unrecognized(parser: argparse.ArgumentParser, command: str | None, extra: list[str]) -> str:
    """argparse's `unrecognized arguments`, with the option a typo most likely meant (Python 3.11's argparse
    suggests none)."""
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    known = sub.choices[command] if sub is not None and command in sub.choices else parser
    options = [o for action in known._actions for o in action.option_strings if o.startswith("--")]
    typos = [word.split("=", 1)[0] for word in extra if word.startswith("--")]
    said = f"unrecognized arguments: {' '.join(extra)}"
    # matched without their dashes, which every option shares (`--bogus` is nothing like `--gpus`)
    names = {o[2:]: o for o in options}
    close = [names[m] for t in typos for m in difflib.get_close_matches(t[2:], names, n=1, cutoff=0.7)]
    if typos and len(close) == len(typos):
        said += " (did you mean " + ", ".join(close) + "?)"
    prog = f"usaf {command}" if command else "usaf"
    return f"{said}; see `{prog} --help`."


def _chosen_command(argv: list[str]) -> str | None:
    """The command a command line names: its first word that is not an option (`usaf` itself takes no values)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def _main(argv: list[str] | None) -> int:
    argv = _join_values(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser(commands=[name] if (name := _chosen_command(argv)) else [])
    try:
        if name is not None and name not in COMMANDS:  # argparse lists the commands; the one meant is wanted
            raise UsageError(f"usaf: {unknown_names('command', [name], COMMANDS)} See `usaf --help`.")
        args, extra = parser.parse_known_args(argv)
        if extra:  # argparse names the top-level program; the options belong to the command's
            prog = f"usaf {args.command}" if getattr(args, "command", None) else "usaf"
            raise UsageError(f"{prog}: {_unrecognized(parser, getattr(args, 'command', None), extra)}")
    except UsageError as err:
        return _last_word(err)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    with _still_starting():
        import usaf.api  # noqa: F401 (every built-in plug-in registered, as `import usaf` does: the config's choices)
    from usaf.model.hf import quiet_progress_bars

    quiet_progress_bars()
    try:
        _read_arguments(args)
        with _progress_lines(_writes_files(args)):
            return int(args.func(args) or 0)
    except UsafError as err:
        return _last_word(err)
    except Exception as raised:  # OSError, or safetensors' SafetensorError
        err = output_error(raised)
        if err is None:
            raise
        return _last_word(err)


# set once the command has said its one-line error and is returning: a signal then (torchrun's SIGTERM to the other
# ranks of a job whose rank failed) adds no second line
_SAID = threading.Event()


def _last_word(err) -> int:
    _SAID.set()
    print(f"usaf: error: {err}", file=sys.stderr)
    return 2


@contextlib.contextmanager
def _interruptible():
    """Ctrl-C and SIGTERM raise (KeyboardInterrupt, usaf.io.atomic.Terminated) wherever the command stands, so
    that what it was writing is cleaned up and main ends with one line and 128+N; before main, usaf.startup ends
    the process itself, and after it ends quietly (usaf.startup.ended). The handlers before are restored after
    (main may be called in-process)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    pid = os.getpid()

    def terminate(signum, frame):
        # a worker forked meanwhile (datasets' num_proc) ends by the signal, as before
        if os.getpid() != pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if _SAID.is_set():
            return  # the command has ended with its line and is returning its status
        raise Terminated()

    _SAID.clear()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is startup.leave:  # the command's process: it has started, and now it has ended
                handler = startup.ended
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


@contextlib.contextmanager
def _still_starting():
    """The API's imports, torch's and transformers' seconds, once the arguments are read: a signal meanwhile ends
    the command's process as one before main does (usaf.startup.leave: one line, nothing written)."""
    if not startup.is_the_command() or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, startup.leave) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _writes_files(args) -> bool:
    """Whether the command's results are files (a run, an export...): its standard output is progress only."""
    return args.command in ("train", "demo") or any(getattr(args, name, None) for name in _outputs(args))


def _outputs(args) -> dict[str, str]:
    return {**_OUTPUTS, **({"delta": "--delta"} if args.command == "export" else {})}


class _ProgressLines(io.TextIOBase):
    """Standard output of a command whose results are files: when its reader goes away (a pipe closed early,
    `usaf train ... | head`), the lines that follow are dropped and the work goes on, to its checkpoints."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except (BrokenPipeError, ValueError):  # ValueError: the stream was closed
            self._gone()
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except (BrokenPipeError, ValueError):
            self._gone()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    def _gone(self) -> None:
        if self.stream is sys.__stdout__:
            _quiet_broken_pipe()
        self.stream = open(os.devnull, "w")  # noqa: SIM115 (for the rest of the process)


@contextlib.contextmanager
def _progress_lines(keep_going: bool):
    if not keep_going or sys.stdout is None:
        yield
        return
    stdout = sys.stdout
    sys.stdout = _ProgressLines(stdout)
    try:
        yield
    finally:
        sys.stdout = stdout


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
    for name, flag in _outputs(args).items():
        if isinstance(value := getattr(args, name, None), str) and value:
            check_destination(Path(value), flag)  # a name too long, a file for a folder: before any work
    resume, out = getattr(args, "resume", None), getattr(args, "out", None)
    if resume and out and os.path.realpath(resume) != os.path.realpath(out):
        raise UsageError(
            f"{prog}: --resume {resume} continues that run in its own folder, so --out {out} would be ignored; "
            "drop --out (or, for a new run, drop --resume)."
        )


def _quiet_broken_pipe() -> None:
    """The reader of stdout has gone: point stdout at /dev/null so the interpreter's final flush is silent."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
