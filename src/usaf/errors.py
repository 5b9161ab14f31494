"""The one exception type usaf raises for problems a user can fix."""


class UsafError(ValueError):
    """Bad input or an unsupported model: the message names the problem and what to do."""


QUOTE_LIMIT = 300  # characters of a library's message a one-line error quotes


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none), cut to QUOTE_LIMIT
    characters: what a one-line error quotes of an exception raised by a library (whose messages can run to
    megabytes: transformers lists every model type it knows, YAML quotes the expanded document)."""
    lines = str(err).strip().splitlines()
    line = lines[0] if lines else type(err).__name__
    return line if len(line) <= QUOTE_LIMIT else line[: QUOTE_LIMIT - 3] + "..."
