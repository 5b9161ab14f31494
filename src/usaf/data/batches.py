"""Batches: rows collated into padded batches, in a seeded order that resumes exactly."""

from __future__ import annotations

import numpy as np
import torch

from usaf.data.pack import TokenizedDataset
from usaf.engine.loss import IGNORE_INDEX
from usaf.errors import ConfigError, DataError


def collate(rows: list[dict[str, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad rows to the longest: input_ids with pad_id, labels with -100, position_ids restarting at 0.

    No attention_mask: see usaf.data's docstring (packing needs it absent; right padding never needs it).
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
    if "label" in rows[0]:  # KTO's rows (usaf.data.pairs.LabelledRows): each one's label
        batch["label"] = torch.stack([row["label"] for row in rows])
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
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}.")
        if len(dataset) == 0:
            raise DataError("cannot batch an empty data set.")
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
        return collate(self.dataset.batch_rows(self.last_indices), self.dataset.pad_id)

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
                raise DataError(
                    f"cannot resume the data position: {key} was {state.get(key)!r} in the checkpoint but is "
                    f"{mine[key]!r} now (the data, its tokenization or the batch settings changed)."
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
