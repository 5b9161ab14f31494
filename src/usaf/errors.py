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


def unknown_names(what: str, unknown: list, known) -> str:
    """A sentence: `unknown key 'densty'; did you mean 'density'?`, the fix a typo most likely wants; the whole
    list of `known` names only where no name is close (a list of 21 keys hides the one meant)."""
    import difflib

    known = sorted(known, key=str)
    close = [difflib.get_close_matches(str(u), [str(k) for k in known], n=1, cutoff=0.6) for u in unknown]
    said = f"unknown {what} {unknown[0]!r}" if len(unknown) == 1 else f"unknown {what}s {unknown}"
    if all(close):
        return said + "; did you mean " + ", ".join(repr(m[0]) for m in close) + "?"
    return f"{said}; allowed {what}s: {known}."
