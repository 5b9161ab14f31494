"""The one exception type usaf raises for problems a user can fix."""


class UsafError(ValueError):
    """Bad input or an unsupported model: the message names the problem and what to do."""


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none): what a one-line error quotes
    of an exception raised by a library."""
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__
