"""Tokenize: records of every source encoded into documents (input_ids, labels), truncated and counted."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from usaf.data.records import (
    BadRecord,
    encode_pretokenized,
    encode_prompt_completion,
    encode_text,
    record_kind,
)
from usaf.data.sources import READERS, file_kind
from usaf.data.templates import check_chat_support, encode_messages
from usaf.engine.loss import IGNORE_INDEX
from usaf.errors import UsafError

_KEPT_SKIP_MESSAGES = 5


@dataclass
class DataStats:
    """Counts of what load_dataset read and made; `summary()` is one line for the log."""

    records: int = 0  # records read, bad ones included
    skipped_records: int = 0  # bad records skipped (skip_bad_records=True)
    truncated_records: int = 0
    truncated_tokens: int = 0  # tokens cut by truncation
    max_seq_len: int = 0
    packed: bool = False
    train_documents: int = 0
    train_sequences: int = 0  # rows after packing
    train_supervised_tokens: int = 0
    eval_documents: int = 0
    eval_sequences: int = 0
    eval_supervised_tokens: int = 0
    first_skipped: list[str] = field(default_factory=list)  # the first few skip reasons, with locations

    def summary(self) -> str:
        skipped = f" ({self.skipped_records:,} bad skipped)" if self.skipped_records else ""
        truncated = (
            f"{self.truncated_records:,} truncated to {self.max_seq_len} tokens "
            f"({self.truncated_tokens:,} tokens cut)"
            if self.truncated_records
            else "none truncated"
        )
        rows = "packed sequences" if self.packed else "sequences"
        line = (
            f"data: {self.records:,} records{skipped}, {truncated}; train {self.train_documents:,} docs in "
            f"{self.train_sequences:,} {rows}, {self.train_supervised_tokens:,} supervised tokens"
        )
        if self.eval_documents:
            line += (
                f"; eval {self.eval_documents:,} docs in {self.eval_sequences:,} {rows}, "
                f"{self.eval_supervised_tokens:,} supervised tokens"
            )
        return line

    def to_dict(self) -> dict:
        return asdict(self)


ENCODERS = {
    "text": encode_text,
    "messages": encode_messages,
    "prompt/completion": encode_prompt_completion,
    "input_ids": encode_pretokenized,
}


@dataclass
class Documents:
    ids: list[list[int]] = field(default_factory=list)
    labels: list[list[int]] = field(default_factory=list)


def read_documents(
    paths: list[str], tokenizer, max_seq_len: int, skip_bad_records: bool, stats: DataStats
) -> Documents:
    documents = Documents()
    for name in paths:
        path = Path(name)
        for where, record in READERS[file_kind(path)](path):
            stats.records += 1
            try:
                if isinstance(record, BadRecord):
                    raise record
                kind = record_kind(record)
                if kind != "input_ids" and getattr(tokenizer, "missing", False):
                    raise tokenizer.needs_tokenizer(where, kind)  # a model folder without tokenizer files
                if kind == "messages":
                    check_chat_support(tokenizer, where)
                ids, labels = ENCODERS[kind](record, tokenizer)
                labels[0] = IGNORE_INDEX  # see the module docstring: never a target within its document
                cut = max(0, len(ids) - max_seq_len)
                ids, labels = ids[:max_seq_len], labels[:max_seq_len]
                if all(label == IGNORE_INDEX for label in labels):
                    why = f" left after truncation to max_seq_len={max_seq_len}" if cut else ""
                    raise BadRecord(f"the record has no supervised tokens{why}")
                if cut:
                    stats.truncated_records += 1
                    stats.truncated_tokens += cut
            except BadRecord as problem:
                message = f"{where}: {problem}"
                if not skip_bad_records:
                    raise UsafError(
                        message + " (skip such records with skip_bad_records / --skip-bad-records)"
                    ) from None
                stats.skipped_records += 1
                if len(stats.first_skipped) < _KEPT_SKIP_MESSAGES:
                    stats.first_skipped.append(message)
                continue
            documents.ids.append(ids)
            documents.labels.append(labels)
    return documents
