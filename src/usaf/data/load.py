"""The entry point: read, tokenize, split off eval, pack (see usaf.data's docstring)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from usaf.config import DataSection, ModelSection, TrainSection
from usaf.data.mix import Mixing, mix
from usaf.data.pack import TokenizedDataset
from usaf.data.pairs import LabelledRows, PreferencePairs
from usaf.data.sources import open_source
from usaf.data.stream import StreamedRows, streamed_stats
from usaf.data.templates import use_chat_template
from usaf.data.tokenize import DataStats, Documents, Settings, read_documents
from usaf.errors import ConfigError, DataError
from usaf.io.text import read_text
from usaf.registry import OBJECTIVES

LONG_DOCUMENTS = ("split", "truncate")


def split_documents(documents: Documents, eval_fraction: float, seed: int) -> tuple[Documents, Documents]:
    """Whole records to each side: the windows of one long record never straddle train and eval."""
    records = list(dict.fromkeys(documents.records)) if documents.records else list(range(len(documents.ids)))
    count = len(records)
    eval_count = max(1, round(eval_fraction * count))
    if count - eval_count < 1:
        raise DataError(
            f"the data set is too small to hold out {eval_fraction:.0%} for evaluation ({count} documents); "
            "add data, give an eval file, or set eval_fraction to 0."
        )
    picked = np.random.default_rng([seed, count]).permutation(count)[:eval_count].tolist()
    chosen = {records[i] for i in picked}
    train, held_out = Documents(), Documents()
    for index in range(len(documents.ids)):  # file order is kept in both parts
        record = documents.records[index] if documents.records else index
        part = held_out if record in chosen else train
        part.ids.append(documents.ids[index])
        part.labels.append(documents.labels[index])
        part.records.append(record)
        part.desirable += documents.desirable[index : index + 1]
    return train, held_out


def load_dataset(
    paths: list[str],
    tokenizer,
    max_seq_len: int,
    pack: bool = True,
    skip_bad_records: bool = False,
    eval_paths: list[str] | None = None,
    eval_fraction: float = 0.05,
    seed: int = 0,
    split: str = "train",
    columns: dict[str, str] | None = None,
    long_documents: str = "split",
    stride: int = 0,
    num_proc: int | None = None,
    model_vocabulary: tuple[int, str] | None = None,
    pairs: bool = False,
    alpaca_format: str = "plain",
    weights: list[float] | None = None,
    mix_stopping: str = "first_exhausted",
    streaming: bool = False,
    objective: str = "dpo",
) -> tuple[TokenizedDataset | StreamedRows, TokenizedDataset | None, DataStats]:
    """Read, tokenize, window or truncate, split and pack `paths` (and `eval_paths`); see the module
    docstring. Paths are files, save_to_disk folders or hub ids. model_vocabulary: (the model's
    vocab_size, its config file), which every token id must be below. pairs: preference pairs for DPO
    (`usaf.data.pairs.PreferencePairs`, never packed). alpaca_format: plain, chat or auto (chat when the
    tokenizer has a chat template). weights: one a path, to draw the training records from them by weight
    (usaf.data.mix; seeded by `seed`) rather than take them all in order. streaming: the training data as
    usaf.data.stream.StreamedRows, read and tokenized as it is iterated (eval_paths are read whole; no
    eval_fraction split of a stream). objective: train.objective, whose name the pairs' errors say, and kto:
    KTO's labelled rows (`usaf.data.pairs.LabelledRows`, never packed)."""
    columns = columns or {}
    _check_arguments(paths, eval_paths, max_seq_len, eval_fraction, long_documents, stride, columns)
    alpaca = alpaca_rendering(alpaca_format, tokenizer)
    settings = Settings(
        max_seq_len, long_documents, stride, tuple(sorted(columns.items())), split, pairs, alpaca, objective
    )
    pack = pack and not pairs and objective != "kto"
    shown = sys.stderr.isatty()
    mixing = Mixing(tuple(float(w) for w in weights), seed, mix_stopping) if weights else None
    if mixing is not None:
        mixing.check(len(paths))

    def read(names, mixed: Mixing | None = None):
        sources = [open_source(str(name), split, shown) for name in names]
        if mixed is None:
            return read_documents(
                sources, tokenizer, settings, skip_bad_records, stats, num_proc, model_vocabulary
            )
        parts = [
            read_documents([s], tokenizer, settings, skip_bad_records, stats, num_proc, model_vocabulary)
            for s in sources
        ]
        documents, line = mix(parts, [s.name for s in sources], mixed)
        stats.notes.append(line)
        return documents

    pad_id = next(
        (i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0
    )  # the value is irrelevant to the loss: padded labels are -100
    stats = DataStats(max_seq_len=max_seq_len, packed=pack)
    if streaming:
        train = StreamedRows(paths, tokenizer, settings, skip_bad_records, pad_id, mixing, model_vocabulary)
        held_out = (
            _rows(read(eval_paths), max_seq_len, pack, pad_id, pairs, objective) if eval_paths else None
        )
        return train, held_out, streamed_stats(train, stats, held_out)

    train_docs = read(paths, mixing)
    if not train_docs.ids:
        raise DataError(
            f"the data set is empty: no usable records in {', '.join(map(str, paths))}"
            + (
                f" ({stats.skipped_records} bad records skipped; the first: {stats.first_skipped[0]})"
                if stats.skipped_records
                else ""
            )
            + "."
        )
    train_docs, eval_docs = _held_out(train_docs, eval_paths, eval_fraction, seed, read)
    train = _rows(train_docs, max_seq_len, pack, pad_id, pairs, objective)
    stats.count_train(train)
    held_out = None
    if eval_docs is not None:
        held_out = _rows(eval_docs, max_seq_len, pack, pad_id, pairs, objective)
        stats.count_eval(held_out)
    return train, held_out, stats


def alpaca_rendering(alpaca_format: str, tokenizer) -> str:
    """data.alpaca_format resolved: auto is chat when the tokenizer has a chat template (data.chat_template is
    set on it before), else plain."""
    if alpaca_format not in ("auto", "chat", "plain"):
        raise ConfigError(f"alpaca_format must be auto, chat or plain, got {alpaca_format!r}.")
    if alpaca_format == "auto":
        return "chat" if getattr(tokenizer, "chat_template", None) else "plain"
    return alpaca_format


def _check_arguments(paths, eval_paths, max_seq_len, eval_fraction, long_documents, stride, columns) -> None:
    """load_dataset's arguments, each fault one clear error naming the setting."""
    if isinstance(paths, str) or isinstance(eval_paths, str):
        raise ConfigError("load_dataset: paths and eval_paths must be lists of file names.")
    if not paths:
        raise ConfigError("no training data files were given.")
    if not isinstance(max_seq_len, int) or max_seq_len < 2:
        raise ConfigError(f"max_seq_len must be an integer >= 2, got {max_seq_len!r}.")
    if not 0.0 <= eval_fraction < 1.0:
        raise ConfigError(f"eval_fraction must be in [0, 1), got {eval_fraction!r}.")
    if long_documents not in LONG_DOCUMENTS:
        raise ConfigError(
            f"long_documents must be one of {', '.join(LONG_DOCUMENTS)}, got {long_documents!r}."
        )
    if not isinstance(stride, int) or not 0 <= stride < max_seq_len - 1:
        raise ConfigError(
            f"data.stride={stride!r} must be in [0, max_seq_len - 1) = [0, {max_seq_len - 1}): each window needs a "
            "new token to learn."
        )
    if not isinstance(columns, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in columns.items()
    ):
        raise DataError(
            f"data.columns must map usaf record keys to column names, e.g. {{prompt: question}}, got {columns!r}."
        )


def _held_out(train_docs: Documents, eval_paths, eval_fraction: float, seed: int, read):
    """(training documents, evaluation documents or None): the eval files' when given, else a seeded share of
    the training documents, else none."""
    if eval_paths:
        eval_docs = read(eval_paths)
        if not eval_docs.ids:
            raise DataError(
                f"the eval data set is empty: no usable records in {', '.join(map(str, eval_paths))}."
            )
        return train_docs, eval_docs
    if eval_fraction > 0:
        return split_documents(train_docs, eval_fraction, seed)
    return train_docs, None


def _rows(documents: Documents, max_seq_len: int, pack: bool, pad_id: int, pairs: bool, objective: str):
    rows = TokenizedDataset(documents, max_seq_len, pack, pad_id)
    if objective == "kto":
        return LabelledRows(rows, documents.desirable)
    return PreferencePairs(rows) if pairs else rows


def load_run_data(
    data: DataSection,
    model: ModelSection,
    train: TrainSection,
    tokenizer,
    pack: bool,
    files: list[str] | None = None,
    held_out: bool = True,
):
    """load_dataset with a run's data settings (`data`; the model's folder from `model`, the seed and objective
    from `train`): what `usaf train`, `usaf eval`, `usaf select` and `usaf data` read. files: other files than
    data.train (eval); held_out=False: no eval split. data.max_seq_len is first fitted to the model's context
    (`fit_context`; its line becomes a note of the stats)."""
    if train.objective == "kto" and data.batch_size < 2:  # TRL's KTOTrainer refuses it too
        raise ConfigError(
            "train.objective=kto needs data.batch_size of 2 or more: its KL term pairs each prompt with the answer "
            "of another row of the micro-batch (with 1, with its own)."
        )
    data, clamped = fit_context(data, model.path)
    use_chat_template(tokenizer, data.chat_template)
    vocabulary = model_vocabulary(model.path)
    train_rows, held_out_rows, stats = load_dataset(
        list(files if files is not None else data.train),
        tokenizer,
        data.max_seq_len,
        pack=pack,
        skip_bad_records=data.skip_bad_records,
        eval_paths=(data.eval or None) if held_out else None,
        eval_fraction=data.eval_fraction if held_out else 0.0,
        seed=train.seed,
        split=data.split,
        columns=data.columns,
        long_documents=data.long_documents,
        stride=data.stride,
        num_proc=data.num_proc or None,
        model_vocabulary=vocabulary,
        pairs=OBJECTIVES[train.objective].pairs,
        alpaca_format=data.alpaca_format,
        weights=data.weights if files is None else None,
        mix_stopping=data.mix_stopping,
        streaming=data.streaming and files is None,
        objective=train.objective,
    )
    if clamped:
        stats.notes.insert(0, clamped)
    return train_rows, held_out_rows, stats


def fit_context(data: DataSection, model_path: str) -> tuple[DataSection, str | None]:
    """`data` with max_seq_len at most the model's max_position_embeddings (the model at `model_path`), and the
    line that says so when it was above (else None): the one rule of every objective and command, applied before
    anything is tokenized. Clamped rather than refused: the default (512) is above many small models' context,
    and a longer window (a DPO pair, an SFT window or packed row) would only hold positions the model never saw;
    longer records are then split or truncated, and counted, as at any max_seq_len. `usaf train` fits its
    config before config.yaml records it, so a resume reads the effective value."""
    context = model_positions(model_path)
    if context is None or data.max_seq_len <= context[0]:
        return data, None
    limit, config_file = context
    line = (
        f"data.max_seq_len={data.max_seq_len} is above the model's {limit} positions ({config_file} "
        f"max_position_embeddings): using {limit}"
    )
    return data.replaced({"max_seq_len": limit}, "data"), line


def _text_config(path: str) -> tuple[dict, dict, str] | None:
    """(config.json, its text part, the file) of a local model folder (or prepared store); None where there is
    no readable one (a hub id; the model's loader reports a broken config)."""
    config_file = Path(path).expanduser() / "config.json"
    try:
        config = json.loads(read_text(config_file))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return config, text, str(config_file)


def model_vocabulary(path: str) -> tuple[int, str] | None:
    """(vocab_size, config file) of a local model folder: the rows of its embedding, which token ids index."""
    if (found := _text_config(path)) is None:
        return None
    config, text, config_file = found
    size = text.get("vocab_size", config.get("vocab_size"))
    return (size, config_file) if type(size) is int and size > 0 else None


def model_positions(path: str) -> tuple[int, str] | None:
    """(max_position_embeddings, config file) of a local model folder: the longest sequence it was made for
    (its text model's, as transformers' get_text_config reads it)."""
    if (found := _text_config(path)) is None:
        return None
    _, text, config_file = found
    size = text.get("max_position_embeddings")
    return (size, config_file) if type(size) is int and size > 0 else None
