"""Text files a user writes (data, prompts, configs, chat templates) read one way: UTF-8, with or without a
byte-order mark (editors on Windows add one; it is no part of the text)."""

from __future__ import annotations

from pathlib import Path

ENCODING = "utf-8-sig"  # UTF-8 that drops a leading byte-order mark


def decode(raw: bytes) -> str:
    """`raw` as text (a leading byte-order mark dropped); UnicodeDecodeError where it is not UTF-8."""
    return raw.decode(ENCODING)


def read_text(path: str | Path) -> str:
    """The text of the file at `path` (see `decode`)."""
    return decode(Path(path).read_bytes())
