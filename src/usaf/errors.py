"""The one exception type usaf raises for problems a user can fix."""


class UsafError(ValueError):
    """Bad input or an unsupported model: the message names the problem and what to do."""
