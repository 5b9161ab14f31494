"""The exceptions usaf raises for problems a user can fix: one base, `UsafError`, and a small taxonomy under it for
library callers who handle one kind (a bad setting, bad data, a model usaf cannot read, a run folder's state).

The command line treats them all alike: one line `usaf: error: ...` and exit code 2.
"""


class UsafError(ValueError):
    """Bad input or an unsupported model: the message names the problem and what to do."""


class ConfigError(UsafError):
    """A setting (YAML key, --set override, Python config field) that is unknown, out of range or contradicts
    another."""


class DataError(UsafError):
    """A dataset, chat template or prompt file that cannot be read or does not fit the run."""


class ModelError(UsafError):
    """A model folder, checkpoint, prepared store, delta or export that usaf cannot read or that does not match
    what it is used with."""


class RunStateError(UsafError):
    """A run folder in a state the command cannot act on: not a run, finished, locked, moved, or damaged."""


QUOTE_LIMIT = 300  # characters of a library's message a one-line error quotes


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none), cut to QUOTE_LIMIT
    characters: what a one-line error quotes of an exception raised by a library (whose messages can run to
    megabytes: transformers lists every model type it knows, YAML quotes the expanded document)."""
    lines = str(err).strip().splitlines()
    line = lines[0] if lines else type(err).__name__
    return line if len(line) <= QUOTE_LIMIT else line[: QUOTE_LIMIT - 3] + "..."
