"""Streaming (data.streaming): the training records read as a `datasets.IterableDataset` and tokenized as
batches are taken, for corpora larger than the disk cache. Memory holds one chunk of records at a time.

What a stream cannot do, said where it is asked for: the number of its rows and batches is not known in
advance (schedule.epochs, and anything else that needs len(), is refused in one line: set schedule.max_steps);
no held-out split of a stream (give data.eval); rows are one document (or window) each, not packed; records come
in the sources' order (mixed by data.weights through datasets.interleave_datasets when given), not shuffled; no
preference pairs (train.objective=dpo); bad records skipped (skip_bad_records) are not counted; nothing is
cached, so a resume reads the stream again from its start up to its position (bounded memory, the time of the
skipped batches' tokenizing).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterator
from dataclasses import asdict

import torch

from usaf.data.batches import Batches, collate
from usaf.data.mix import Mixing
from usaf.data.pack import TokenizedDataset
from usaf.data.sources import Source, stream_source
from usaf.data.tokenize import DataStats, Encoder, Settings, check_vocabulary, tokenizer_fingerprint
from usaf.errors import ConfigError, DataError

_CHUNK = 64  # records tokenized at a time
_UNKNOWN = (
    "data.streaming: the number of rows is not known in advance (the data is read as training goes); "
    "set schedule.max_steps rather than schedule.epochs, and give data.eval for evaluation"
)


class StreamedRows:
    """The training rows of a stream: iterate for {"input_ids", "labels", "position_ids"} rows (1-D int64),
    one document or window each, from the start of the stream every time."""

    def __init__(
        self,
        names: list[str],
        tokenizer,
        settings: Settings,
        skip_bad_records: bool,
        pad_id: int,
        mixing: Mixing | None = None,
        model_vocabulary: tuple[int, str] | None = None,
    ):
        if settings.pairs or settings.objective == "kto":
            raise ConfigError(
                f"data.streaming reads documents, not preference records (train.objective={settings.objective}): "
                "set it false."
            )
        if mixing is not None:
            mixing.check(len(names))
        self.names, self.tokenizer, self.settings = list(names), tokenizer, settings
        self.skip, self.pad_id = skip_bad_records, pad_id
        self.mixing, self.vocabulary = mixing, model_vocabulary
        self.max_seq_len = settings.max_seq_len

    def __len__(self) -> int:
        raise DataError(_UNKNOWN + ".")

    def _records(self):
        import datasets

        streams = [stream_source(name, self.settings.split) for name in self.names]
        if self.mixing is None:
            return datasets.concatenate_datasets(streams) if len(streams) > 1 else streams[0]
        return self.mixing.interleave(streams)

    def documents(self) -> Iterator[tuple[list[int], list[int], str]]:
        """(input_ids, labels, where) of every document or window, in stream order."""
        import pyarrow as pa

        source = Source(", ".join(self.names), None, "", located=True)  # every stream is in the located form
        encode = Encoder(source, self.tokenizer, self.settings, self.skip)
        records = iter(self._records())
        for start in itertools.count(0, _CHUNK):
            chunk = list(itertools.islice(records, _CHUNK))
            if not chunk:
                return
            batch = {key: [row[key] for row in chunk] for key in ("where", "json", "bad")}
            out = encode(batch, list(range(start, start + len(chunk))))
            # a bad record under skip_bad_records: skipped (a stream is not counted ahead)
            good = [i for i, error in enumerate(out["error"]) if not error]
            if self.vocabulary is not None:  # the check of read_documents, a chunk at a time
                table = pa.table({key: [out[key][i] for i in good] for key in ("where", "input_ids")})
                check_vocabulary(table, self.tokenizer, source.name, *self.vocabulary)
            for i in good:
                yield out["input_ids"][i], out["labels"][i], out["where"][i]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for ids, labels, _ in self.documents():
            yield {
                "input_ids": torch.tensor(ids, dtype=torch.long),
                "labels": torch.tensor(labels, dtype=torch.long),
                "position_ids": torch.arange(len(ids)),
            }

    def fingerprint(self) -> str:
        """What decides the stream's rows: its names, settings and tokenizer (its content is not read ahead)."""
        parts = [
            json.dumps(self.names),
            json.dumps(asdict(self.settings)),
            tokenizer_fingerprint(self.tokenizer),
        ]
        parts.append(json.dumps(asdict(self.mixing)) if self.mixing is not None else "")
        return "stream-" + hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


class StreamBatches:
    """Batches of a stream, in its order, as `Batches` gives them (iterate for collated batches;
    state_dict / load_state_dict resume at the same batch). A stream that ends starts again (the next epoch), for
    ever or until `epochs` passes are read."""

    def __init__(self, rows: StreamedRows, batch_size: int, epochs: int | None = None):
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}.")
        self.rows, self.batch_size, self.epochs = rows, batch_size, epochs
        self.epoch, self.position = 0, 0  # batches already taken from this epoch
        self.last_indices: list[int] = []
        self._iterator: Iterator | None = None

    def __len__(self) -> int:
        raise DataError(_UNKNOWN + " (schedule.epochs needs the batches an epoch holds).")

    def __iter__(self) -> StreamBatches:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        while True:
            if self._iterator is None:
                self._iterator = iter(self.rows)
            taken = list(itertools.islice(self._iterator, self.batch_size))
            if taken:
                break
            if self.position == 0:
                raise DataError(f"the data set is empty: no usable records in {', '.join(self.rows.names)}.")
            self.epoch, self.position, self._iterator = self.epoch + 1, 0, None
            if self.epochs is not None and self.epoch >= self.epochs:
                raise StopIteration
        start = self.position * self.batch_size
        self.last_indices = list(range(start, start + len(taken)))
        self.position += 1
        return collate(taken, self.rows.pad_id)

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "batch_size": self.batch_size,
            "fingerprint": self.rows.fingerprint(),
        }

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("batch_size", "fingerprint"):
            if state.get(key) != mine[key]:
                raise DataError(
                    f"cannot resume the data position: {key} was {state.get(key)!r} in the checkpoint but is "
                    f"{mine[key]!r} now (the data, its streaming, tokenization or the batch settings changed)."
                )
        self.epoch, self.position, self._iterator = int(state["epoch"]), 0, None
        for _ in range(int(state["position"])):  # read again up to where the run stopped
            next(self)


def batches_for(
    dataset, batch_size: int, seed: int = 0, epochs: int | None = None
) -> Batches | StreamBatches:
    """The training batches of a data set: seeded and shuffled (Batches, `epochs` passes or for ever) or, for a
    stream, in its order."""
    if isinstance(dataset, StreamedRows):
        return StreamBatches(dataset, batch_size, epochs=epochs)
    return Batches(dataset, batch_size, seed=seed, epochs=epochs)


def first_rows(dataset, count: int) -> list[dict[str, torch.Tensor]]:
    """The first `count` rows (fewer when it has fewer) of a data set or a stream."""
    if isinstance(dataset, StreamedRows):
        return list(itertools.islice(iter(dataset), count))
    return [dataset[i] for i in range(min(count, len(dataset)))]


def streamed_stats(rows: StreamedRows, stats: DataStats, held_out: TokenizedDataset | None) -> DataStats:
    """The stats of a streamed load: what is known before the stream is read (the eval rows, read whole)."""
    stats.streamed = True
    if held_out is not None:
        stats.count_eval(held_out)
    stats.notes.append(
        f"data.streaming: {', '.join(rows.names)} read and tokenized as training goes, in order, one document a "
        "row (no packing" + (")" if held_out is not None else "; no eval: give data.eval)")
    )
    return stats
