"""Preference data. Pairs (train.objective=dpo, orpo, simpo): the tokenized documents of a pair data set, chosen
then rejected per record, held as pairs; a batch of pairs is its chosen rows, then its rejected rows in the same
order: the layout `usaf.engine.preference` reads. Labelled rows (train.objective=kto): one document a row, each
desirable or not, the label in the batch as "label"."""

from __future__ import annotations

import hashlib

import torch

from usaf.data.pack import TokenizedDataset


class PreferencePairs:
    """`rows` (one document each, never packed) as pairs: pair i is rows 2i (chosen) and 2i + 1 (rejected)."""

    def __init__(self, rows: TokenizedDataset):
        if rows.packed or len(rows) % 2:
            raise ValueError("preference pairs need unpacked rows, a chosen and a rejected one per record")
        self.rows = rows
        self.pad_id, self.max_seq_len, self.packed = rows.pad_id, rows.max_seq_len, False
        self.num_documents = rows.num_documents
        self.num_tokens, self.supervised_tokens = (
            rows.num_tokens,
            rows.supervised_tokens,
        )  # rows do not change

    def __len__(self) -> int:
        return len(self.rows) // 2

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """The chosen row of pair `index` (what a probe of the data looks at)."""
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        return self.rows[2 * (index % len(self))]

    def batch_rows(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        """The chosen rows of the pairs, then their rejected rows."""
        return [self.rows[2 * i] for i in indices] + [self.rows[2 * i + 1] for i in indices]

    def fingerprint(self) -> str:
        return "pairs-" + self.rows.fingerprint()


class LabelledRows:
    """KTO's rows: `rows` (one document each, never packed), row i desirable when `desirable[i]`."""

    def __init__(self, rows: TokenizedDataset, desirable: list[bool]):
        if rows.packed or len(rows) != len(desirable):
            raise ValueError("labelled rows need unpacked rows, one label a row")
        self.rows, self.desirable = rows, torch.tensor(desirable, dtype=torch.bool)
        self.pad_id, self.max_seq_len, self.packed = rows.pad_id, rows.max_seq_len, False
        self.num_documents, self.num_tokens, self.supervised_tokens = (
            rows.num_documents,
            rows.num_tokens,
            rows.supervised_tokens,
        )

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {**self.rows[index], "label": self.desirable[index]}

    def batch_rows(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        return [self[i] for i in indices]

    def fingerprint(self) -> str:
        labels = "".join("1" if d else "0" for d in self.desirable.tolist())
        return "labelled-" + hashlib.sha256((self.rows.fingerprint() + labels).encode()).hexdigest()[:16]
