"""Training data: read record files, tokenize them with loss masks, truncate, pack, split off eval, batch.

Public API
  load_dataset(paths, tokenizer, max_seq_len, pack=True, skip_bad_records=False, eval_paths=None,
               eval_fraction=0.05, seed=0) -> (train, eval | None, DataStats)
      The one entry point. `eval` is None only when no eval file is given and eval_fraction == 0.
  TokenizedDataset   the rows to train on; dataset[i] -> {"input_ids", "labels", "position_ids"} (1-D int64)
  Batches(dataset, batch_size, seed=0, shuffle=True, epochs=None)
      Seeded batch iterator with state_dict() / load_state_dict() for exact resume.
  collate(rows, pad_id) -> batch dict of [batch, seq] tensors
  DataStats          what was read, skipped, truncated and packed; .summary() is one line
  IGNORE_INDEX       -100, the label of positions without loss

Files, by extension
  .jsonl/.ndjson  one JSON record per line (blank lines ignored); errors name `file:LINE`.
  .json           a list of records, or {"data": [records]}; errors name `file[INDEX]` (0-based).
  .parquet/.pq    one record per row (needs pyarrow: pip install usaf[parquet]); errors name `file[INDEX]`;
                  null columns count as absent, so files mixing record kinds work.
  .txt/.md        one {"text"} document per blank-line-separated block (a whole file with no blank lines is
                  one document); errors name `file:LINE` of the block's first line.

Records (the keys decide the kind; any other key is an error)
  {"text"}                    loss on every token but the first.
  {"messages", ["tools"]}     chat rendered with the tokenizer's chat template; loss on assistant turns only
                              (their content and the template's end-of-turn text). Roles: system, user,
                              assistant, tool. Messages may also carry name, tool_calls, tool_call_id,
                              reasoning_content.
  {"prompt", "completion"}    plain concatenation (no chat template); loss on the completion only.
  {"input_ids", ["labels"]}   used as given (no BOS/EOS added); labels default to input_ids, must be aligned
                              with input_ids (equal to it where supervised, -100 elsewhere): never shifted.

Tokenization: text and prompts are encoded with the tokenizer's own special tokens (e.g. BOS); EOS is appended
to texts and completions so the model learns to stop. Labels are aligned with input_ids, as transformers
expects: the model (or usaf.engine.loss) shifts them, so the target of position t is token t+1. The first label of
every document is -100: nothing inside the document predicts it, and in a packed row it would otherwise be
the target of the previous document's last token.

Truncation keeps the first max_seq_len tokens and is counted in DataStats, never silent. A record left with
no supervised token is an error (or skipped, with skip_bad_records).

Packing (pack=True): best-fit decreasing, deterministic, documents never split. position_ids restart at 0 for
every document. transformers 5.x turns such position_ids into a block-diagonal causal mask (documents do not
attend to each other) only when attention_mask is None AND no cache is built, so batches carry no
attention_mask and the model must be called with use_cache=False (config.use_cache is usually True, and a
cache object disables the packed-sequence detection). Padding is on the right, with labels -100 and
position_ids restarting at 0 (a segment of its own); causal attention never lets real tokens see it, so no
attention_mask is needed for padding either. Models whose decoder does not pass position_ids to the mask
functions (gpt_oss in transformers 5.24) need pack=False or an explicit mask.

Held-out split (no eval_paths, eval_fraction > 0): whole documents, seeded, before packing, at least one.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from usaf.engine.loss import IGNORE_INDEX
from usaf.errors import UsafError

ROLES = ("system", "user", "assistant", "tool")
MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"}
RECORD_KINDS = {  # kind: (required keys, optional keys)
    "text": ({"text"}, set()),
    "messages": ({"messages"}, {"tools"}),
    "prompt/completion": ({"prompt", "completion"}, set()),
    "input_ids": ({"input_ids"}, {"labels"}),
}
FILE_KINDS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".txt": "text",
    ".text": "text",
    ".md": "text",
}
_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
_KEPT_SKIP_MESSAGES = 5


class _BadRecord(Exception):
    """A problem with one record: an error naming its location, or a skip under skip_bad_records."""


# ----------------------------------------------------------------------------------------------- statistics


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


# ----------------------------------------------------------------------------------------------- reading


def _file_kind(path: Path) -> str:
    if path.is_dir():
        inside = sorted(str(f) for f in path.iterdir() if f.is_file() and f.suffix.lower() in FILE_KINDS)
        example = ",".join(inside[:2]) if inside else f"{path}/train.jsonl"
        raise UsafError(
            f"{path} is a folder; give the data files in it, comma separated (e.g. --data {example})."
        )
    kind = FILE_KINDS.get(path.suffix.lower())
    if kind is None:
        raise UsafError(
            f"{path}: unknown data file type '{path.suffix}'; use one of {', '.join(sorted(FILE_KINDS))}."
        )
    if not path.is_file():
        raise UsafError(f"{path}: data file not found.")
    return kind


def _read_jsonl(path: Path) -> Iterator[tuple[str, object]]:
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                yield where, _BadRecord(f"not UTF-8 ({error})")
                continue
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as error:
                yield where, _BadRecord(f"invalid JSON: {error.msg} (column {error.colno})")


def _read_json(path: Path) -> Iterator[tuple[str, object]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as error:
        raise UsafError(f"{path}: not UTF-8 ({error}).") from None
    except json.JSONDecodeError as error:  # a broken file has no records to skip
        raise UsafError(f"{path}:{error.lineno}: invalid JSON: {error.msg}.") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise UsafError(f'{path}: a .json data file must hold a list of records or {{"data": [records]}}.')
    for index, record in enumerate(data):
        yield f"{path}[{index}]", record


def _read_parquet(path: Path) -> Iterator[tuple[str, object]]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise UsafError(f"{path}: reading Parquet needs pyarrow: pip install usaf[parquet]") from None
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=1024)
        index = 0
        for batch in batches:
            for row in batch.to_pylist():
                yield f"{path}[{index}]", {key: value for key, value in row.items() if value is not None}
                index += 1
    except (OSError, pa.ArrowException) as error:
        raise UsafError(f"{path}: cannot read Parquet: {error}") from None


def _read_text(path: Path) -> Iterator[tuple[str, object]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise UsafError(f"{path}: not UTF-8 ({error}).") from None
    block: list[str] = []
    first_line = 0
    for number, line in enumerate([*lines, ""], start=1):  # the sentinel flushes the last block
        if line.strip():
            if not block:
                first_line = number
            block.append(line)
        elif block:
            yield f"{path}:{first_line}", {"text": "\n".join(block)}
            block = []


_READERS = {"jsonl": _read_jsonl, "json": _read_json, "parquet": _read_parquet, "text": _read_text}


# ----------------------------------------------------------------------------------------------- encoding


def _record_kind(record: object) -> str:
    if not isinstance(record, dict):
        raise _BadRecord(f"a record must be a JSON object, got {type(record).__name__}")
    keys = set(record)
    for kind, (required, optional) in RECORD_KINDS.items():
        if keys & required:
            missing = required - keys
            unknown = keys - required - optional
            if missing:
                raise _BadRecord(f"{kind} record is missing key(s) {sorted(missing)}")
            if unknown:
                raise _BadRecord(
                    f"{kind} record has unknown key(s) {sorted(unknown)}; "
                    f"allowed: {sorted(required | optional)}"
                )
            return kind
    raise _BadRecord(
        f"unknown record keys {sorted(keys)}; expected one of {{'text'}}, {{'messages'}}, "
        "{'prompt', 'completion'}, {'input_ids', 'labels'}"
    )


def _expect_str(record: dict, key: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise _BadRecord(f"'{key}' must be a string, got {type(value).__name__}")
    return value


def _token_ids(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def _with_eos(tokenizer, ids: list[int]) -> list[int]:
    eos = tokenizer.eos_token_id
    return [*ids, eos] if eos is not None and (not ids or ids[-1] != eos) else ids


def _encode_text(record: dict, tokenizer) -> tuple[list[int], list[int]]:
    text = _expect_str(record, "text")
    if not text.strip():
        raise _BadRecord("'text' is empty")
    ids = _with_eos(tokenizer, _token_ids(tokenizer, text, add_special_tokens=True))
    return ids, list(ids)


def _encode_prompt_completion(record: dict, tokenizer) -> tuple[list[int], list[int]]:
    prompt, completion = _expect_str(record, "prompt"), _expect_str(record, "completion")
    if not completion.strip():
        raise _BadRecord("'completion' is empty: nothing to learn")
    prompt_ids = _token_ids(tokenizer, prompt, add_special_tokens=True)
    completion_ids = _with_eos(tokenizer, _token_ids(tokenizer, completion, add_special_tokens=False))
    return prompt_ids + completion_ids, [IGNORE_INDEX] * len(prompt_ids) + completion_ids


def _encode_pretokenized(record: dict, tokenizer) -> tuple[list[int], list[int]]:
    ids, labels = record["input_ids"], record.get("labels", record["input_ids"])
    vocab = len(tokenizer)
    for key, values in (("input_ids", ids), ("labels", labels)):
        if not isinstance(values, list) or not all(type(v) is int for v in values):
            raise _BadRecord(f"'{key}' must be a list of integers")
    if len(ids) < 2:
        raise _BadRecord("'input_ids' needs at least 2 tokens")
    if len(labels) != len(ids):
        raise _BadRecord(f"'labels' has {len(labels)} entries but 'input_ids' has {len(ids)}")
    bad = next((i for i, v in enumerate(ids) if not 0 <= v < vocab), None)
    if bad is not None:
        what = getattr(tokenizer, "vocabulary", f"the tokenizer's vocabulary of {vocab}")
        raise _BadRecord(f"input_ids[{bad}]={ids[bad]} is outside {what}")
    # Aligned labels equal input_ids wherever they are not ignored; anything else is a shifted or foreign
    # label (pre-shifting here would train every position on token t+2).
    bad = next(
        (i for i, (v, t) in enumerate(zip(labels, ids, strict=True)) if v not in (IGNORE_INDEX, t)), None
    )
    if bad is not None:
        raise _BadRecord(
            f"labels[{bad}]={labels[bad]} but input_ids[{bad}]={ids[bad]}: labels must be aligned with "
            "input_ids (equal where supervised, -100 elsewhere), not shifted; the model shifts them"
        )
    return list(ids), list(labels)


def _check_messages(record: dict) -> tuple[list[dict], object]:
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise _BadRecord("'messages' must be a non-empty list")
    cleaned = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise _BadRecord(f"{where} must be an object with 'role' and 'content'")
        message = {key: value for key, value in message.items() if value is not None}
        unknown = set(message) - MESSAGE_KEYS
        if unknown:
            raise _BadRecord(f"{where} has unknown key(s) {sorted(unknown)}; allowed: {sorted(MESSAGE_KEYS)}")
        role = message.get("role")
        if role not in ROLES:
            raise _BadRecord(f"{where} has role {role!r}; allowed: {', '.join(ROLES)}")
        if "content" not in message and "tool_calls" not in message:
            raise _BadRecord(f"{where} is missing 'content'")
        if "content" in message and not isinstance(message["content"], str):
            raise _BadRecord(f"{where}.content must be a string, got {type(message['content']).__name__}")
        cleaned.append(message)
    if not any(message["role"] == "assistant" for message in cleaned):
        raise _BadRecord("'messages' has no assistant turn: nothing to learn")
    tools = record.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise _BadRecord("'tools' must be a list")
    return cleaned, tools


def _render(tokenizer, messages: list[dict], tools, add_generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as error:  # jinja errors, raise_exception() in templates, ...
        raise _BadRecord(f"the chat template failed: {error}") from None


def _assistant_char_spans(tokenizer, messages: list[dict], tools, full: str) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in `full`, found by rendering the conversation's prefixes.

    A turn starts where the rendering of the earlier messages plus the generation prompt ends. It ends where
    the rendering up to and including it ends; templates that render a turn differently once later turns
    follow (e.g. dropping reasoning) fall back to finding its content plus the template's end-of-turn text.
    """
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if index == 0:
            raise _BadRecord(
                "the conversation starts with an assistant turn; this needs a chat template with "
                "{% generation %} markers, or a user/system turn first"
            )
        before = _render(tokenizer, messages[:index], tools, add_generation_prompt=True)
        if not full.startswith(before):
            raise _BadRecord(
                "cannot locate assistant turn: the chat template renders the conversation's start "
                "differently once more turns follow (use a template with {% generation %} markers)"
            )
        start = len(before)
        through = _render(tokenizer, messages[: index + 1], tools)
        if full.startswith(through):
            spans.append((start, len(through)))
            continue
        content = message.get("content", "")
        found = full.find(content, start) if content else -1
        if found < 0 or content not in through:
            raise _BadRecord(
                f"cannot locate assistant turn messages[{index}] in the rendered chat (use a template with "
                "{% generation %} markers)"
            )
        end = found + len(content)
        closing = through[through.rfind(content) + len(content) :]
        if closing and full.startswith(closing, end):
            end += len(closing)
        spans.append((start, end))
    return spans


def _encode_messages(record: dict, tokenizer) -> tuple[list[int], list[int]]:
    messages, tools = _check_messages(record)
    template = tokenizer.get_chat_template(tools=tools)
    if _GENERATION_MARKER.search(template):
        try:
            out = tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
        except Exception as error:
            raise _BadRecord(f"the chat template failed: {error}") from None
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    else:
        full = _render(tokenizer, messages, tools)
        spans = _assistant_char_spans(tokenizer, messages, tools, full)
        encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(encoded["input_ids"])
        # A token is supervised when it overlaps an assistant span (as transformers does with generation
        # markers).
        mask = [any(s < end and e > start for start, end in spans) for s, e in encoded["offset_mapping"]]
    return ids, [token if keep else IGNORE_INDEX for token, keep in zip(ids, mask, strict=True)]


_ENCODERS = {
    "text": _encode_text,
    "messages": _encode_messages,
    "prompt/completion": _encode_prompt_completion,
    "input_ids": _encode_pretokenized,
}


def _check_chat_support(tokenizer, where: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise UsafError(
            f"{where}: chat records ('messages') need a tokenizer with a chat template, and this one has "
            "none; set tokenizer.chat_template or use {'prompt', 'completion'} records."
        )
    if not getattr(tokenizer, "is_fast", False):
        raise UsafError(f"{where}: chat records need a fast (tokenizers-backed) tokenizer for token offsets.")


# ----------------------------------------------------------------------------------------------- documents


@dataclass
class _Documents:
    ids: list[list[int]] = field(default_factory=list)
    labels: list[list[int]] = field(default_factory=list)


def _read_documents(
    paths: list[str], tokenizer, max_seq_len: int, skip_bad_records: bool, stats: DataStats
) -> _Documents:
    documents = _Documents()
    for name in paths:
        path = Path(name)
        for where, record in _READERS[_file_kind(path)](path):
            stats.records += 1
            try:
                if isinstance(record, _BadRecord):
                    raise record
                kind = _record_kind(record)
                if kind != "input_ids" and getattr(tokenizer, "missing", False):
                    raise tokenizer.needs_tokenizer(where, kind)  # a model folder without tokenizer files
                if kind == "messages":
                    _check_chat_support(tokenizer, where)
                ids, labels = _ENCODERS[kind](record, tokenizer)
                labels[0] = IGNORE_INDEX  # see the module docstring: never a target within its document
                cut = max(0, len(ids) - max_seq_len)
                ids, labels = ids[:max_seq_len], labels[:max_seq_len]
                if all(label == IGNORE_INDEX for label in labels):
                    why = f" left after truncation to max_seq_len={max_seq_len}" if cut else ""
                    raise _BadRecord(f"the record has no supervised tokens{why}")
                if cut:
                    stats.truncated_records += 1
                    stats.truncated_tokens += cut
            except _BadRecord as problem:
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


def _split(documents: _Documents, eval_fraction: float, seed: int) -> tuple[_Documents, _Documents]:
    count = len(documents.ids)
    eval_count = max(1, round(eval_fraction * count))
    if count - eval_count < 1:
        raise UsafError(
            f"the data set is too small to hold out {eval_fraction:.0%} for evaluation ({count} documents); "
            "add data, give an eval file, or set eval_fraction to 0."
        )
    chosen = set(np.random.default_rng([seed, count]).permutation(count)[:eval_count].tolist())
    train, held_out = _Documents(), _Documents()
    for index in range(count):  # file order is kept in both parts
        part = held_out if index in chosen else train
        part.ids.append(documents.ids[index])
        part.labels.append(documents.labels[index])
    return train, held_out


def _pack(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: longest documents first, each into the fullest row it fits. Deterministic."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (room left, row index)
    for doc in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        slot = bisect.bisect_left(free, (lengths[doc], -1))
        if slot < len(free):
            room, row = free.pop(slot)
        else:
            room, row = capacity, len(rows)
            rows.append([])
        rows[row].append(doc)
        if room - lengths[doc] > 0:
            bisect.insort(free, (room - lengths[doc], row))
    return rows


# ----------------------------------------------------------------------------------------------- dataset


class TokenizedDataset:
    """Rows ready to batch (made by load_dataset): one document each, or several packed ones.

    Stored flat (int32 + offsets) to keep large data sets compact; dataset[i] gives int64 tensors.
    """

    def __init__(self, documents: _Documents, max_seq_len: int, pack: bool, pad_id: int):
        lengths = [len(ids) for ids in documents.ids]
        rows = _pack(lengths, max_seq_len) if pack else [[i] for i in range(len(lengths))]
        ids, labels, positions, offsets = [], [], [], [0]
        for row in rows:
            for doc in row:
                ids.extend(documents.ids[doc])
                labels.extend(documents.labels[doc])
                positions.extend(range(lengths[doc]))
            offsets.append(len(ids))
        # numpy converts long lists ~2x faster than torch.tensor
        self.input_ids = torch.from_numpy(np.array(ids, dtype=np.int32))
        self.labels = torch.from_numpy(np.array(labels, dtype=np.int32))
        self.position_ids = torch.from_numpy(np.array(positions, dtype=np.int32))
        self.offsets = torch.from_numpy(np.array(offsets, dtype=np.int64))
        self.num_documents = len(lengths)
        self.max_seq_len = max_seq_len
        self.packed = pack
        self.pad_id = pad_id
        self._fingerprint: str | None = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        index %= len(self)
        piece = slice(int(self.offsets[index]), int(self.offsets[index + 1]))
        return {
            "input_ids": self.input_ids[piece].long(),
            "labels": self.labels[piece].long(),
            "position_ids": self.position_ids[piece].long(),
        }

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def supervised_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    def fingerprint(self) -> str:
        """A digest of the rows' content, so a resumed run can refuse data that changed."""
        if self._fingerprint is None:
            digest = hashlib.sha256()
            for tensor in (self.offsets, self.input_ids, self.labels, self.position_ids):
                digest.update(tensor.numpy().tobytes())
            self._fingerprint = digest.hexdigest()[:16]
        return self._fingerprint


def collate(rows: list[dict[str, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad rows to the longest: input_ids with pad_id, labels with -100, position_ids restarting at 0.

    No attention_mask: see the module docstring (packing needs it absent; right padding never needs it).
    """
    width = max(len(row["input_ids"]) for row in rows)
    batch = {
        "input_ids": torch.full((len(rows), width), pad_id, dtype=torch.long),
        "labels": torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long),
        "position_ids": torch.arange(width).repeat(len(rows), 1),
    }
    for index, row in enumerate(rows):
        length = len(row["input_ids"])
        batch["input_ids"][index, :length] = row["input_ids"]
        batch["labels"][index, :length] = row["labels"]
        batch["position_ids"][index, :length] = row["position_ids"]
        batch["position_ids"][index, length:] = torch.arange(width - length)
    return batch


class Batches:
    """Seeded, resumable batches: iterate for dicts of [batch, seq] tensors (see collate).

    Each epoch is a permutation drawn from (seed, epoch) (or dataset order with shuffle=False); the last batch
    of an epoch may be smaller. Iteration runs for `epochs` epochs, or forever when None.
    `state_dict()` after k batches of an epoch holds (epoch, k); loading it into a fresh Batches over the same
    data yields exactly the remaining batches. `last_indices` are the dataset rows of the latest batch.
    """

    def __init__(
        self,
        dataset: TokenizedDataset,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        epochs: int | None = None,
    ):
        if batch_size < 1:
            raise UsafError(f"batch_size must be >= 1, got {batch_size}.")
        if len(dataset) == 0:
            raise UsafError("cannot batch an empty data set.")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epochs = epochs
        self.epoch = 0
        self.position = 0  # batches already taken from this epoch
        self.last_indices: list[int] = []
        self._order_epoch = -1
        self._order: list[int] = []

    def __len__(self) -> int:
        """Batches per epoch."""
        return -(-len(self.dataset) // self.batch_size)

    def __iter__(self) -> Batches:
        return self

    def _epoch_order(self, epoch: int) -> list[int]:
        if self._order_epoch != epoch:
            count = len(self.dataset)
            order = (
                np.random.default_rng([self.seed, epoch]).permutation(count) if self.shuffle else range(count)
            )
            self._order, self._order_epoch = [int(i) for i in order], epoch
        return self._order

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        if self.epochs is not None and self.epoch >= self.epochs:
            raise StopIteration
        start = self.position * self.batch_size
        self.last_indices = self._epoch_order(self.epoch)[start : start + self.batch_size]
        self.position += 1
        return collate([self.dataset[i] for i in self.last_indices], self.dataset.pad_id)

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "rows": len(self.dataset),
            "fingerprint": self.dataset.fingerprint(),
        }

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("seed", "shuffle", "batch_size", "rows", "fingerprint"):
            if state.get(key) != mine[key]:
                raise UsafError(
                    f"cannot resume the data position: {key} was {state.get(key)!r} in the checkpoint but is "
                    f"{mine[key]!r} now (the data, its tokenization or the batch settings changed)."
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


# ----------------------------------------------------------------------------------------------- entry point


def load_dataset(
    paths: list[str],
    tokenizer,
    max_seq_len: int,
    pack: bool = True,
    skip_bad_records: bool = False,
    eval_paths: list[str] | None = None,
    eval_fraction: float = 0.05,
    seed: int = 0,
) -> tuple[TokenizedDataset, TokenizedDataset | None, DataStats]:
    """Read, tokenize, truncate, split and pack `paths` (and `eval_paths`); see the module docstring."""
    if isinstance(paths, str) or isinstance(eval_paths, str):
        raise UsafError("load_dataset: paths and eval_paths must be lists of file names.")
    if not paths:
        raise UsafError("no training data files were given.")
    if not isinstance(max_seq_len, int) or max_seq_len < 2:
        raise UsafError(f"max_seq_len must be an integer >= 2, got {max_seq_len!r}.")
    if not 0.0 <= eval_fraction < 1.0:
        raise UsafError(f"eval_fraction must be in [0, 1), got {eval_fraction!r}.")
    pad_id = next(
        (i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0
    )  # the value is irrelevant to the loss: padded labels are -100
    stats = DataStats(max_seq_len=max_seq_len, packed=pack)

    train_docs = _read_documents(list(paths), tokenizer, max_seq_len, skip_bad_records, stats)
    if not train_docs.ids:
        raise UsafError(
            f"the data set is empty: no usable records in {', '.join(map(str, paths))}"
            + (f" ({stats.skipped_records} bad records skipped)" if stats.skipped_records else "")
            + "."
        )
    if eval_paths:
        eval_docs = _read_documents(list(eval_paths), tokenizer, max_seq_len, skip_bad_records, stats)
        if not eval_docs.ids:
            raise UsafError(
                f"the eval data set is empty: no usable records in {', '.join(map(str, eval_paths))}."
            )
    elif eval_fraction > 0:
        train_docs, eval_docs = _split(train_docs, eval_fraction, seed)
    else:
        eval_docs = None

    train = TokenizedDataset(train_docs, max_seq_len, pack, pad_id)
    stats.train_documents, stats.train_sequences = train.num_documents, len(train)
    stats.train_supervised_tokens = train.supervised_tokens
    held_out = None
    if eval_docs is not None:
        held_out = TokenizedDataset(eval_docs, max_seq_len, pack, pad_id)
        stats.eval_documents, stats.eval_sequences = held_out.num_documents, len(held_out)
        stats.eval_supervised_tokens = held_out.supervised_tokens
    return train, held_out, stats
