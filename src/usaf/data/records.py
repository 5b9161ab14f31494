"""Records: the encoders of the plain record kinds (usaf.data.shapes says which kind a record is).

Every encoder maps (record, tokenizer) -> (input_ids, labels), labels aligned with input_ids (-100 where not
supervised). Chat records are encoded in usaf.data.templates.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass

from usaf.engine.loss import IGNORE_INDEX


class BadRecord(Exception):
    """A problem with one record: an error naming its location, or a skip under skip_bad_records."""


@contextmanager
def answer_named(name: str):
    """A preference pair's answer is read and encoded as a prompt/completion record's completion: its problems
    name the pair's own key (an empty 'rejected' is said as such, not as an empty 'completion')."""
    try:
        yield
    except BadRecord as problem:
        raise BadRecord(str(problem).replace("'completion'", f"'{name}'")) from None


def expect_str(record: dict, key: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise BadRecord(f"'{key}' must be a string, got {type(value).__name__}")
    return value


# A text longer than this is tokenized in pieces of _PIECE_CHARS, cut before a whitespace where there is one: a
# tokenizer's whole-text encoding costs ~200 bytes a character (a 700 k-character text took 140 MB, a 4 MB line
# would take 800 MB), so no call gets more than LONG_TEXT_CHARS (~13 MB). What is cut before tokenizing
# (TextLimit) is shorter still; a text split into windows keeps every token and goes in pieces. Tokens can differ
# from the whole-text encoding only at the cuts, one per 32 k characters of documents over 64 k.
LONG_TEXT_CHARS = 1 << 16
_PIECE_CHARS = 1 << 15


def _pieces(text: str) -> list[str]:
    pieces, start = [], 0
    while len(text) - start > _PIECE_CHARS:
        end = start + _PIECE_CHARS
        space = max(text.rfind(" ", start + 1, end), text.rfind("\n", start + 1, end))
        end = space if space > start + _PIECE_CHARS // 2 else end
        pieces.append(text[start:end])
        start = end
    return [*pieces, text[start:]]


@dataclass
class TextLimit:
    """How much of a record's texts is worth tokenizing when only its first `tokens` tokens are kept (truncation).

    No token covers more characters than the longest entry of the vocabulary (a byte-level entry is spelled with
    one character a byte: never fewer than the text it covers), so the first `tokens` tokens lie within
    `tokens` x that many characters; twice that, plus a few tokens' margin for merges across the cut, is cut off
    before the tokenizer sees the text. A 4 MB line then costs what its first max_seq_len tokens cost, not the
    ~100 bytes a character of a whole-text encoding. The characters dropped are counted, for the stats."""

    chars: int
    dropped: int = 0  # characters never tokenized
    kept: int = 0  # characters tokenized, of the texts that went through `cut`

    @classmethod
    def of(cls, tokenizer, tokens: int) -> TextLimit:
        vocabulary = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        longest = max(map(len, vocabulary), default=0)
        return cls(chars=2 * (tokens + 8) * max(longest, 16))

    def cut(self, text: str) -> str:
        if len(text) <= self.chars:
            self.kept += len(text)
            return text
        self.dropped += len(text) - self.chars
        self.kept += self.chars
        return text[: self.chars]

    def dropped_tokens(self, tokens: int) -> int:
        """The tokens the dropped characters would have made, at the rate of those that were tokenized."""
        return round(self.dropped * tokens / self.kept) if self.dropped and self.kept else 0


_LIMIT: contextvars.ContextVar[TextLimit | None] = contextvars.ContextVar("usaf_text_limit", default=None)


@contextmanager
def limited(limit: TextLimit | None):
    """The encoders called inside cut their texts to `limit` (None: texts whole)."""
    token = _LIMIT.set(limit)
    try:
        yield limit
    finally:
        _LIMIT.reset(token)


def text_limit() -> TextLimit | None:
    """The TextLimit of the record being encoded (see `limited`)."""
    return _LIMIT.get()


def _tokenize(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def token_ids(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    if (limit := text_limit()) is not None:
        text = limit.cut(text)
    if len(text) <= LONG_TEXT_CHARS:
        return _tokenize(tokenizer, text, add_special_tokens)
    ids = [token for piece in _pieces(text) for token in _tokenize(tokenizer, piece, False)]
    if add_special_tokens:  # what the tokenizer puts around a text (BOS, and for some EOS), around the whole
        probe = "a"
        plain = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
        full = list(tokenizer(probe, add_special_tokens=True)["input_ids"])
        at = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), 0)
        ids = full[:at] + ids + full[at + len(plain) :]
    return ids


def with_eos(tokenizer, ids: list[int]) -> list[int]:
    eos = tokenizer.eos_token_id
    return [*ids, eos] if eos is not None and (not ids or ids[-1] != eos) else ids


def encode_text(record: dict, tokenizer) -> tuple[list[int], list[int]]:
    text = expect_str(record, "text")
    if not text.strip():
        raise BadRecord("'text' is empty")
    ids = with_eos(tokenizer, token_ids(tokenizer, text, add_special_tokens=True))
    return ids, list(ids)


def encode_prompt_completion(record: dict, tokenizer) -> tuple[list[int], list[int]]:
    prompt, completion = expect_str(record, "prompt"), expect_str(record, "completion")
    if not completion.strip():
        raise BadRecord("'completion' is empty: nothing to learn")
    prompt_ids = token_ids(tokenizer, prompt, add_special_tokens=True)
    completion_ids = token_ids(tokenizer, completion, add_special_tokens=False)
    if not completion_ids:  # all of it dropped by the tokenizer's normalizer: only the EOS would be learned
        raise BadRecord("'completion' is empty after tokenizing: nothing to learn")
    completion_ids = with_eos(tokenizer, completion_ids)
    return prompt_ids + completion_ids, [IGNORE_INDEX] * len(prompt_ids) + completion_ids


def encode_pretokenized(record: dict, tokenizer) -> tuple[list[int], list[int]]:
    ids, labels = record["input_ids"], record.get("labels", record["input_ids"])
    vocab = len(tokenizer)
    for key, values in (("input_ids", ids), ("labels", labels)):
        if not isinstance(values, list) or not all(type(v) is int for v in values):
            raise BadRecord(f"'{key}' must be a list of integers")
    if len(ids) < 2:
        raise BadRecord("'input_ids' needs at least 2 tokens")
    if len(labels) != len(ids):
        raise BadRecord(f"'labels' has {len(labels)} entries but 'input_ids' has {len(ids)}")
    bad = next((i for i, v in enumerate(ids) if not 0 <= v < vocab), None)
    if bad is not None:
        what = getattr(tokenizer, "vocabulary", f"the tokenizer's vocabulary of {vocab}")
        raise BadRecord(f"input_ids[{bad}]={ids[bad]} is outside {what}")
    # Aligned labels equal input_ids wherever they are not ignored; anything else is a shifted or foreign
    # label (pre-shifting here would train every position on token t+2).
    bad = next(
        (i for i, (v, t) in enumerate(zip(labels, ids, strict=True)) if v not in (IGNORE_INDEX, t)), None
    )
    if bad is not None:
        raise BadRecord(
            f"labels[{bad}]={labels[bad]} but input_ids[{bad}]={ids[bad]}: labels must be aligned with "
            "input_ids (equal where supervised, -100 elsewhere), not shifted; the model shifts them"
        )
    return list(ids), list(labels)
