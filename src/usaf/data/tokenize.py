"""Tokenize: the raw records of each source encoded into documents (input_ids, labels) through `datasets.map`,
cached, long ones split into windows or truncated, and counted.

The cache: map writes its rows to HF_DATASETS_CACHE/usaf_tokenized/<fingerprint>.arrow, and the next load with
the same source content, tokenizer, settings and usaf version reads them back without encoding anything (a file
there cut short is rebuilt: usaf.data.cache). The
fingerprint is computed here (not by datasets hashing the encoder with dill, which would hash the tokenizer
object and miss what matters): see `cache_fingerprint`.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import asdict, dataclass, field

from usaf.data.cache import cache_root, cache_writes, one_builder
from usaf.data.records import (
    BadRecord,
    TextLimit,
    answer_named,
    encode_pretokenized,
    encode_prompt_completion,
    encode_text,
    limited,
)
from usaf.data.shapes import (
    EXPECTED,
    RECORD_KEYS,
    normalize,
    normalize_pair,
    normalize_unpaired,
    possible_shapes,
)
from usaf.data.sources import Source, progress_bars
from usaf.data.templates import check_chat_support, encode_messages
from usaf.engine.loss import IGNORE_INDEX
from usaf.errors import DataError
from usaf.version import __version__

_KEPT_SKIP_MESSAGES = 5
SKIP_HINT = " (skip such records with skip_bad_records / --skip-bad-records)"
# kinds split into windows under long_documents=split: a window of a chat or a prompt/completion record would
# train answers without their question, so those are truncated (and counted) instead
SPLITTABLE = ("text", "input_ids")
_ROW_COLUMNS = ("where", "input_ids", "labels", "error", "cut", "window", "ignored", "desirable")


@dataclass
class DataStats:
    """Counts of what load_dataset read and made; `summary()` is one line for the log."""

    records: int = 0  # records read, bad ones included
    skipped_records: int = 0  # bad records skipped (skip_bad_records=True)
    truncated_records: int = 0
    truncated_tokens: int = 0  # tokens cut by truncation
    split_records: int = 0  # long records split into windows (long_documents=split)
    windows: int = 0  # the windows they became
    max_seq_len: int = 0
    packed: bool = False
    train_documents: int = 0
    train_sequences: int = 0  # rows after packing
    train_supervised_tokens: int = 0
    eval_documents: int = 0
    eval_sequences: int = 0
    eval_supervised_tokens: int = 0
    first_skipped: list[str] = field(default_factory=list)  # the first few skip reasons, with locations
    notes: list[str] = field(default_factory=list)  # e.g. columns the records carry that usaf does not use
    streamed: bool = False  # data.streaming: the training data is counted as it is read, not here

    def count_train(self, rows) -> None:
        """The documents, rows and supervised tokens of the training rows (a TokenizedDataset)."""
        self.train_documents, self.train_sequences = rows.num_documents, len(rows)
        self.train_supervised_tokens = rows.supervised_tokens

    def count_eval(self, rows) -> None:
        """The documents, rows and supervised tokens of the held-out rows (a TokenizedDataset)."""
        self.eval_documents, self.eval_sequences = rows.num_documents, len(rows)
        self.eval_supervised_tokens = rows.supervised_tokens

    def summary(self) -> str:
        skipped = f" ({self.skipped_records:,} bad skipped)" if self.skipped_records else ""
        truncated = (
            f"{self.truncated_records:,} truncated to {self.max_seq_len} tokens "
            f"({self.truncated_tokens:,} tokens cut)"
            if self.truncated_records
            else "none truncated"
        )
        if self.split_records:
            truncated += f", {self.split_records:,} split into {self.windows:,} windows"
        rows = "packed sequences" if self.packed else "sequences"
        line = (
            f"data: {self.records:,} records{skipped}, {truncated}; train {self.train_documents:,} docs in "
            f"{self.train_sequences:,} {rows}, {self.train_supervised_tokens:,} supervised tokens"
        )
        if self.streamed:  # the training data is counted as it is read, not here
            line = "data: train streamed"
        if self.eval_documents:
            line += (
                f"; eval {self.eval_documents:,} docs in {self.eval_sequences:,} {rows}, "
                f"{self.eval_supervised_tokens:,} supervised tokens"
            )
        return "; ".join([line, *self.notes])

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Settings:
    """What decides the tokenized rows, besides the source and the tokenizer."""

    max_seq_len: int
    long_documents: str = "split"  # or "truncate"
    stride: int = 0
    columns: tuple = ()  # data.columns as sorted (key, column) pairs
    split: str = "train"
    pairs: bool = False  # train.objective=dpo: each record is a chosen and a rejected document, in that order
    alpaca: str = "plain"  # alpaca records as "plain" text or "chat" (data.alpaca_format, resolved)
    objective: str = "dpo"  # train.objective, what the records are read for where it is not sft (pairs, KTO)


def encode_chat_completion(record: dict, tokenizer) -> tuple[list[int], list[int]]:
    """Conversational prompt/completion: one conversation, only the completion's assistant turns supervised (the
    prompt's, few-shot examples, are context)."""
    prompt = record["prompt"]
    messages = {"messages": prompt + record["completion"], "tools": record.get("tools")}
    return encode_messages(messages, tokenizer, context=len(prompt))


ENCODERS = {
    "text": encode_text,
    "messages": encode_messages,
    "prompt/completion": encode_prompt_completion,
    "chat completion": encode_chat_completion,
    "input_ids": encode_pretokenized,
}


def fit(ids: list[int], labels: list[int], kind: str, settings: Settings) -> tuple[list, int]:
    """([(ids, labels)] windows of at most max_seq_len tokens, tokens cut by truncation).

    A continuation window starts with the last max(stride, 1) tokens of the one before as context, their labels
    -100: every token is the target of exactly one window (the first token of a window predicts nothing)."""
    size = settings.max_seq_len
    if len(ids) <= size:
        return [(ids, labels)], 0
    if settings.long_documents == "truncate" or kind not in SPLITTABLE:
        return [(ids[:size], labels[:size])], len(ids) - size
    overlap = max(settings.stride, 1)
    windows, start = [], 0
    while True:
        end = min(start + size, len(ids))
        window_labels = labels[start:end]
        if start:
            window_labels[:overlap] = [IGNORE_INDEX] * overlap
        if any(label != IGNORE_INDEX for label in window_labels):
            windows.append((ids[start:end], window_labels))
        if end == len(ids):
            return windows, 0
        start = end - overlap


# a JSON escape of a UTF-16 surrogate; a lone one decodes to a str no tokenizer (nor UTF-8) can take
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def parse_record(line: str):
    """One record's JSON, its problems as BadRecord: invalid JSON, nesting deeper than Python's JSON reader goes
    (a RecursionError), a lone UTF-16 surrogate (paired escapes make one character and are fine)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise BadRecord(f"invalid JSON: {error.msg} (column {error.colno})") from None
    except RecursionError:
        raise BadRecord(
            "the JSON is nested too deeply to read (thousands of levels); no record needs that"
        ) from None
    if _SURROGATE_ESCAPE.search(line):
        try:
            json.dumps(record, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as error:
            code = ord(error.object[error.start])
            raise BadRecord(
                f"a lone UTF-16 surrogate (\\u{code:04x}) is half of a character, not text; fix the writer of "
                "this record (it split a surrogate pair), or drop the escape"
            ) from None
    return record


class Encoder:
    """The function `datasets.map` runs over a source's raw records (batched, with indices): one output row per
    document window, and one row with `error` set per bad record under skip_bad_records (else it raises)."""

    def __init__(
        self, source: Source, tokenizer, settings: Settings, skip_bad_records: bool, unused: list[str] = ()
    ):
        self.name, self.located, self.unused = source.name, source.located, list(unused)
        self.blank_is_absent = source.blank_is_absent
        self.tokenizer, self.settings, self.skip = tokenizer, settings, skip_bad_records
        self.columns = dict(settings.columns) if source.located else {}  # tables are renamed before
        self._limit_chars = None

    def text_limit(self, kind: str) -> TextLimit | None:
        """What of a truncated record's texts is tokenized (TextLimit); None for records split into windows,
        whose every token is kept, and for token ids."""
        if kind == "input_ids" or (kind in SPLITTABLE and self.settings.long_documents == "split"):
            return None
        if self._limit_chars is None:
            self._limit_chars = TextLimit.of(self.tokenizer, self.settings.max_seq_len).chars
        return TextLimit(self._limit_chars)

    def record(self, batch: dict, row: int, index: int) -> tuple[str, object]:
        if not self.located:
            record = {key: values[row] for key, values in batch.items()}
            if self.blank_is_absent:
                record = {key: value for key, value in record.items() if value != ""}
            return f"{self.name}:row {index}", record
        where = batch["where"][row]
        if batch["bad"][row]:
            raise _Located(where, BadRecord(batch["bad"][row]))
        try:
            return where, parse_record(batch["json"][row])
        except BadRecord as problem:
            raise _Located(where, problem) from None

    def encode_pair(self, where: str, record: object) -> tuple[list, int, list[str]]:
        """A preference pair: the chosen document, then the rejected one, each truncated (never split)."""
        kind, chosen, rejected, ignored, shape = normalize_pair(record, self.columns, self.settings.objective)
        self._check_tokenizer(where, kind)
        documents, cut = [], 0
        for name, part in (("chosen", chosen), ("rejected", rejected)):
            with limited(self.text_limit(kind)) as limit, answer_named(name):
                ids, labels = ENCODERS[kind](part, self.tokenizer)
            labels[0] = IGNORE_INDEX
            (document,), dropped = fit(ids, labels, kind, self.settings)  # a pair's kinds are never split
            dropped += limit.dropped_tokens(len(ids)) if limit is not None else 0
            cut += dropped
            if all(label == IGNORE_INDEX for label in document[1]):
                raise BadRecord(f"'{name}' has no supervised tokens{self._after_truncation(dropped)}")
            documents.append(document)
        if documents[0] == documents[1]:  # answers that differ only past max_seq_len: no gradient either
            when, fix = (
                (
                    f" after truncation to max_seq_len={self.settings.max_seq_len}",
                    "shorten the prompt, or drop it",
                )
                if cut
                else (" once tokenized", "drop it")
            )
            raise BadRecord(
                f"'chosen' and 'rejected' are the same{when}: the pair teaches nothing (its DPO loss is ln 2 with "
                f"no gradient); {fix}"
            )
        return documents, cut, [f"{shape}:{key}" for key in sorted({*ignored, *self.unused})]

    def _after_truncation(self, cut: int) -> str:
        return f" left after truncation to max_seq_len={self.settings.max_seq_len}" if cut else ""

    def _check_tokenizer(self, where: str, kind: str) -> None:
        tokenizer = self.tokenizer
        if kind != "input_ids" and getattr(tokenizer, "missing", False):
            raise tokenizer.needs_tokenizer(where, kind)  # a model folder without tokenizer files
        if kind in ("messages", "chat completion"):
            check_chat_support(tokenizer, where)

    def encode_unpaired(self, where: str, record: object) -> tuple[list, int, list[str]]:
        """KTO's records (`normalize_unpaired`): one document each, truncated (never split), with its label."""
        kind, parts, ignored, shape = normalize_unpaired(record, self.columns)
        self._check_tokenizer(where, kind)
        documents, cut = [], 0
        for part, desirable in parts:
            with limited(self.text_limit(kind)) as limit:
                ids, labels = ENCODERS[kind](part, self.tokenizer)
            labels[0] = IGNORE_INDEX
            (document,), dropped = fit(ids, labels, kind, self.settings)
            dropped += limit.dropped_tokens(len(ids)) if limit is not None else 0
            cut += dropped
            if all(label == IGNORE_INDEX for label in document[1]):
                raise BadRecord(f"the completion has no supervised tokens{self._after_truncation(dropped)}")
            documents.append((*document, desirable))
        return documents, cut, [f"{shape}:{key}" for key in sorted({*ignored, *self.unused})]

    def encode(self, where: str, record: object) -> tuple[list, int, list[str]]:
        if self.settings.objective == "kto":
            return self.encode_unpaired(where, record)
        if self.settings.pairs:
            return self.encode_pair(where, record)
        kind, record, ignored, shape = normalize(record, self.columns, self.settings.alpaca)
        self._check_tokenizer(where, kind)
        with limited(self.text_limit(kind)) as limit:
            ids, labels = ENCODERS[kind](record, self.tokenizer)
        labels[0] = IGNORE_INDEX  # see usaf.data's docstring: never a target within its document
        windows, cut = fit(ids, labels, kind, self.settings)
        if limit is not None:
            cut += limit.dropped_tokens(len(ids))
        if not windows or all(label == IGNORE_INDEX for label in windows[0][1]):
            raise BadRecord(f"the record has no supervised tokens{self._after_truncation(cut)}")
        return windows, cut, [f"{shape}:{key}" for key in sorted({*ignored, *self.unused})]

    def __call__(self, batch: dict, indices: list[int]) -> dict:
        out = {column: [] for column in _ROW_COLUMNS}

        def add(where, ids, labels, error="", cut=0, window=-1, ignored="", desirable=True):
            for column, value in zip(
                _ROW_COLUMNS, (where, ids, labels, error, cut, window, ignored, desirable), strict=True
            ):
                out[column].append(value)

        for row, index in enumerate(indices):
            where = f"{self.name}:row {index}"
            try:
                where, record = self.record(batch, row, index)
                windows, cut, ignored = self.encode(where, record)
            except (BadRecord, _Located) as problem:
                if isinstance(problem, _Located):
                    where, problem = problem.where, problem.problem
                if not self.skip:
                    raise DataError(f"{where}: {problem}{SKIP_HINT}") from None
                add(where, [], [], error=str(problem))  # counted and quoted by read_documents
                continue
            split = len(windows) > 1 and not self.settings.pairs and self.settings.objective != "kto"
            for number, (ids, labels, *desirable) in enumerate(windows):
                # window -1: a whole record; 0, 1, ...: the windows of a split one
                add(
                    where,
                    ids,
                    labels,
                    cut=cut,
                    window=number if split else -1,
                    ignored=",".join(ignored),
                    desirable=desirable[0] if desirable else True,  # KTO's label; True for the others
                )
        return out


class _Located(Exception):
    def __init__(self, where: str, problem: BadRecord):
        super().__init__(where, problem)
        self.where, self.problem = where, problem


def tokenizer_fingerprint(tokenizer) -> str:
    """What decides the ids: the vocabulary and rules (the fast tokenizer's full JSON), special tokens, chat
    template; not where the tokenizer was loaded from."""
    digest = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode())
    elif hasattr(tokenizer, "get_vocab"):
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    else:  # NoTokenizer: ids are only checked against the vocabulary size
        digest.update(str(len(tokenizer)).encode())
    specials = {k: getattr(tokenizer, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    template = getattr(tokenizer, "chat_template", None)
    digest.update(
        json.dumps([specials, template, getattr(tokenizer, "missing", False)], default=str).encode()
    )
    return digest.hexdigest()


def cache_fingerprint(source: Source, tokenizer_digest: str, settings: Settings) -> str:
    fields = asdict(settings)
    if fields["alpaca"] == "plain":  # as before the option: the caches of earlier runs stay theirs
        del fields["alpaca"]
    if fields["objective"] != "kto":  # only KTO's labelled rows differ; the others' caches stay theirs
        del fields["objective"]
    parts = [__version__, source.fingerprint, source.name, tokenizer_digest, json.dumps(fields)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _renamed(source: Source, settings: Settings) -> tuple[object, list[str]]:
    """A table's columns renamed by data.columns (checked once, for the whole source), without the columns no
    record shape reads (returned, for the note)."""
    rows = source.rows
    mapping = {column: key for key, column in settings.columns if column != key}
    present = {column: key for column, key in mapping.items() if column in rows.column_names}
    if not possible_shapes({present.get(column, column) for column in rows.column_names}):
        # no row can be a record: one error for the source, not one skipped record per row
        missing = [column for column in mapping if column not in present]
        if missing:
            raise DataError(
                f"{source.name} has no column(s) {', '.join(missing)} (data.columns); its columns are "
                f"{', '.join(rows.column_names)}."
            )
        raise DataError(f"{source.name}: unknown record columns {rows.column_names}; {EXPECTED}.")
    mapping = present  # data.columns applies to every source: one may use usaf's names already
    # the mapped column replaces one of the same name; columns no shape reads are not even decoded (images...)
    unused = [key for key in mapping.values() if key in rows.column_names and key not in mapping]
    unused += [c for c in rows.column_names if c not in mapping and c not in RECORD_KEYS and c not in unused]
    rows = rows.remove_columns(unused) if unused else rows
    return (rows.rename_columns(mapping) if mapping else rows), unused


def tokenize_source(
    source: Source, tokenizer, settings: Settings, skip_bad_records: bool, num_proc: int | None, digest: str
):
    """The source's rows tokenized (a datasets.Dataset of _ROW_COLUMNS), from the cache when it has them."""
    import datasets

    # a save_to_disk folder keeps the format it was saved with (torch tensors...): rows as plain Python
    rows, unused = (source.rows, []) if source.located else _renamed(source, settings)
    rows = rows.with_format(None)
    fingerprint = cache_fingerprint(source, digest, settings)
    folder = cache_root() / "usaf_tokenized"
    folder.mkdir(parents=True, exist_ok=True)
    features = datasets.Features(
        {
            "where": datasets.Value("string"),
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "labels": datasets.Sequence(datasets.Value("int32")),
            "error": datasets.Value("string"),
            "cut": datasets.Value("int64"),
            "window": datasets.Value("int32"),
            "ignored": datasets.Value("string"),
            "desirable": datasets.Value("bool"),
        }
    )
    entry = folder.glob(f"{fingerprint}*.arrow")  # its shards too, under num_proc
    with one_builder(fingerprint, entry), progress_bars(sys.stderr.isatty()), cache_writes():
        return rows.map(
            Encoder(source, tokenizer, settings, skip_bad_records, unused),
            batched=True,
            with_indices=True,
            remove_columns=rows.column_names,
            features=features,
            new_fingerprint=fingerprint,
            cache_file_name=str(folder / f"{fingerprint}.arrow"),
            load_from_cache_file=True,
            num_proc=num_proc if num_proc and num_proc > 1 and len(rows) > 1 else None,
            desc=f"tokenizing {source.name}",
        )


@dataclass
class Documents:
    ids: list[list[int]] = field(default_factory=list)
    labels: list[list[int]] = field(default_factory=list)
    records: list[str] = field(default_factory=list)  # the record each came from (windows share one)
    desirable: list[bool] = field(default_factory=list)  # train.objective=kto: each document's label


def _note(ignored: set[str]) -> list[str]:
    """One line per record shape, naming what its records carried that usaf does not use."""
    by_kind: dict[str, set[str]] = {}
    for item in ignored:
        kind, _, key = item.partition(":")
        by_kind.setdefault(kind, set()).add(key)
    notes = []
    for kind, keys in sorted(by_kind.items()):
        if "rejected" in keys:
            notes.append(
                "preference pairs: training on prompt + chosen; the rejected answers are not used by "
                "supervised fine-tuning"
            )
            keys = keys - {"rejected"}
        columns = sorted(k for k in keys if "[]." not in k)
        message_keys = sorted({k.split("[].")[1] for k in keys if "[]." in k})
        if columns:
            notes.append(f"data: ignored columns {', '.join(columns)} (not used by {kind} records)")
        if message_keys:
            notes.append(f"data: ignored message keys {', '.join(message_keys)} (not used by chat templates)")
    return notes


def check_vocabulary(table, tokenizer, source: str, vocab_size: int, config_file: str) -> None:
    """Every token id below the model's vocab_size: a tokenizer larger than the model's embedding (another
    model's) would otherwise fail at the first forward, with an index error deep inside torch."""
    import pyarrow.compute as pc

    if not table.num_rows:
        return
    largest = pc.max(pc.list_flatten(table["input_ids"])).as_py()
    if largest is None or largest < vocab_size:
        return
    where = next(
        w
        for w, ids in zip(table["where"].to_pylist(), table["input_ids"].to_pylist(), strict=True)
        if ids and max(ids) >= vocab_size
    )
    folder = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
    raise DataError(
        f"{where}: token id {largest} is outside the model's vocabulary: {config_file} has vocab_size "
        f"{vocab_size}, and the tokenizer ({folder}, {len(tokenizer)} tokens) makes larger ids; use the model's "
        "own tokenizer (and pre-tokenized ids below vocab_size)."
    )


def read_documents(
    sources: list[Source],
    tokenizer,
    settings: Settings,
    skip_bad_records: bool,
    stats: DataStats,
    num_proc: int | None = None,
    model_vocabulary: tuple[int, str] | None = None,
) -> Documents:
    import pyarrow.compute as pc

    documents = Documents()
    digest = tokenizer_fingerprint(tokenizer)
    ignored: set[str] = set()
    for source in sources:
        stats.records += len(source.rows)
        if not len(source.rows):
            continue  # datasets.map leaves an empty dataset as it is, without the tokenized columns
        table = tokenize_source(source, tokenizer, settings, skip_bad_records, num_proc, digest).data.table
        bad = pc.not_equal(table["error"], "")
        errors = table.filter(bad)
        if errors.num_rows:
            first = f"{errors['where'][0].as_py()}: {errors['error'][0].as_py()}"
            if not skip_bad_records:  # a cache written under skip_bad_records holds the bad records
                raise DataError(first + SKIP_HINT)
            stats.skipped_records += errors.num_rows
            kept = errors.slice(0, max(0, _KEPT_SKIP_MESSAGES - len(stats.first_skipped)))
            stats.first_skipped += [
                f"{where}: {error}"
                for where, error in zip(kept["where"].to_pylist(), kept["error"].to_pylist(), strict=True)
            ]
            if errors.num_rows == len(source.rows) and len(sources) > 1:
                # every record bad: the source's shape or the settings, not its records (nothing is dropped
                # silently beside the good sources)
                raise DataError(
                    f"{source.name}: no usable records ({errors.num_rows} bad records skipped; the first: {first})."
                )
        good = table.filter(pc.invert(bad))
        if model_vocabulary is not None:
            check_vocabulary(good, tokenizer, source.name, *model_vocabulary)
        stats.truncated_records += pc.sum(pc.greater(good["cut"], 0)).as_py() or 0
        stats.truncated_tokens += pc.sum(good["cut"]).as_py() or 0
        stats.split_records += pc.sum(pc.equal(good["window"], 0)).as_py() or 0
        stats.windows += pc.sum(pc.greater_equal(good["window"], 0)).as_py() or 0
        ignored.update(
            item for value in pc.unique(good["ignored"]).to_pylist() for item in value.split(",") if item
        )
        documents.ids += good["input_ids"].to_pylist()
        documents.labels += good["labels"].to_pylist()
        documents.records += good["where"].to_pylist()
        documents.desirable += good["desirable"].to_pylist()
    stats.notes = sorted(set(stats.notes) | set(_note(ignored)))
    return documents
