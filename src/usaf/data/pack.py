"""Pack: documents into rows of at most max_seq_len tokens (best-fit decreasing), stored flat."""

from __future__ import annotations

import bisect
import hashlib

import numpy as np
import torch

from usaf.data.tokenize import Documents
from usaf.engine.loss import IGNORE_INDEX


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
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


class TokenizedDataset:
    """Rows ready to batch (made by load_dataset): one document each, or several packed ones.

    Stored flat (int32 + offsets) to keep large data sets compact; dataset[i] gives int64 tensors.
    """

    def __init__(self, documents: Documents, max_seq_len: int, pack: bool, pad_id: int):
        lengths = [len(ids) for ids in documents.ids]
        rows = pack_rows(lengths, max_seq_len) if pack else [[i] for i in range(len(lengths))]
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

    def batch_rows(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        """The rows of a batch, in order (see `usaf.data.pairs` for a data set whose batch is laid out otherwise)."""
        return [self[i] for i in indices]

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
