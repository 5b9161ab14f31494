"""The `usaf` command's first seconds: Ctrl-C or SIGTERM while Python imports torch and transformers ends the
process with one line and 128+N, as later in the run, instead of a traceback (SIGINT) or a silent death (SIGTERM).

Imported first by the package (standard library only, so that it runs before the heavy imports), it acts only in
the process of the `usaf` command itself (its console script, `python -m usaf`, torchrun's workers of it), never
in a program that imports usaf. Nothing has been written yet, so the process ends at once; `usaf.cli.main` hands
the signals over to the command (interruptions that clean up after themselves) when it starts.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import threading


def leave(signum: int, frame) -> None:
    """The handler until the command starts: one line, and the exit status of a process stopped by the signal."""
    how = "" if signum == signal.SIGINT else f" ({signal.Signals(signum).name})"
    os.write(2, f"usaf: interrupted{how} while starting; nothing was written\n".encode())
    os._exit(128 + signum)


def ended(signum: int, frame) -> None:
    """The handler once the command has ended and said what it had to (`usaf.cli.main` installs it): a signal while
    Python shuts down (torchrun ending a job's other workers after one failed) ends the process quietly."""
    os._exit(128 + signum)


def is_the_command() -> bool:
    argv = getattr(sys, "orig_argv", [])
    script = os.path.basename(sys.argv[0]) if sys.argv else ""
    return script in ("usaf", "usaf.exe") or any(
        flag == "-m" and module in ("usaf", "usaf.cli") for flag, module in itertools.pairwise(argv)
    )


def open_standard_streams() -> None:
    """A standard stream the caller closed (`usaf train ... >&-`) reads and writes /dev/null: output is dropped as
    asked, never raises, and no file the command opens takes the stream's number (where a stray print would land)."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            if getattr(sys, name) is None:  # Python found it closed at start
                setattr(sys, name, open(fd, mode, closefd=False))  # noqa: SIM115 (the process's stream)


if is_the_command() and threading.current_thread() is threading.main_thread():
    open_standard_streams()
    for _sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(_sig, leave)
