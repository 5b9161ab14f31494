"""`QuantizedStore`: a fused expert tensor kept quantized, dequantized only for the experts a forward routed to.

It implements the engine's storage interface (see `usaf.store.dense.DenseStore`): `materialize(expert_ids)` returns
those experts in the compute dtype, `read(flat_indices)` values at entries. Where the quantized data lives (device,
pinned host memory, a memory map) is the business of the `parts` object it is given (see `usaf.store.offload`).
"""

from __future__ import annotations

import itertools

import torch

from usaf.errors import ModelError
from usaf.kernels.host import balanced, read_ints
from usaf.quant import get_format


class QuantizedStore:
    """A frozen [E, A, B] expert tensor in a quantized format.

    parts: an object with `fetch(expert_ids) -> {part: tensor [k, ...] on the compute device}` and `device`.
    constants: keyword arguments of the format's `dequantize` (a published format's block size, say).
    owned: under expert parallelism, the experts this rank holds (`parts` holds only those, its row 0 being
        `owned.start`); the shape stays the whole tensor's, so indices into it keep their meaning. None: all.
    """

    resident = False  # the engine materializes routed experts in workspace-bounded chunks
    regathered = False  # not a parameter: FSDP2 never shards it (see DenseStore.regathered)

    def __init__(
        self,
        format_name: str,
        parts,
        shape: tuple[int, int, int],
        dtype: torch.dtype,
        constants=None,
        owned: range | None = None,
    ):
        self.format_name = format_name
        self.constants = dict(constants or {})  # a published format's own (e.g. FP8's block size)
        self.format = get_format(format_name)
        self.parts = parts
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self.owned = owned if owned is not None else range(self.shape[0])

    @property
    def device(self) -> torch.device:
        return self.parts.device

    @property
    def nbytes(self) -> int:
        """The quantized bytes this store holds (under expert parallelism: its experts' only)."""
        return self.parts.nbytes

    def materialize(self, expert_ids: list[int]) -> torch.Tensor:
        """A fresh [k, A, B] tensor of the given experts, dequantized; no other expert is touched."""
        _, rows, cols = self.shape
        if self.owned.start or len(self.owned) != self.shape[0]:
            if any(e not in self.owned for e in expert_ids):
                raise ModelError(
                    f"experts {list(expert_ids)} asked of a store holding experts {self.owned.start} to "
                    f"{self.owned.stop - 1} only (expert parallelism: another rank holds the others)."
                )
            expert_ids = [e - self.owned.start for e in expert_ids]
        return self.format.dequantize(
            self.parts.fetch(list(expert_ids)), rows, cols, self.dtype, **self.constants
        )

    @torch.no_grad()
    def read(self, flat_indices: torch.Tensor) -> torch.Tensor:
        """Dequantized values at flat indices of the [E, A, B] tensor, one expert at a time: the indices grouped by
        expert with a sort, where each expert's start is read on the host at once (an intended read: on balanced
        data every expert holds as many); experts without an index are not dequantized, and where the format has
        `read_entries` only the blocks holding the entries are (the same values: a block dequantizes on its own)."""
        _, rows, cols = self.shape
        per_expert = rows * cols
        flat = flat_indices.to(self.device).reshape(-1)
        ordered, order = torch.sort(flat)
        owned, n = self.owned, flat.numel()
        edges = torch.arange(owned.start, owned.stop + 1, device=flat.device) * per_expert
        starts = read_ints(
            torch.searchsorted(ordered, edges),
            lambda: [0, *itertools.accumulate(balanced(n, len(owned)))],
        )
        if starts[0] != 0 or starts[-1] != n:
            raise ModelError(
                f"entries outside experts {owned.start} to {owned.stop - 1} asked of a store holding only those "
                "(expert parallelism: another rank holds the others)."
            )
        out = torch.empty(flat.shape, dtype=self.dtype, device=self.device)
        read_entries = getattr(self.format, "read_entries", None)
        for e, start, stop in zip(owned, starts[:-1], starts[1:], strict=True):
            if start < stop:
                local = ordered[start:stop] - e * per_expert
                if read_entries is not None:  # only the quantization blocks holding entries
                    parts = self.parts.fetch([e - owned.start])
                    values = read_entries(parts, local, rows, cols, self.dtype, **self.constants)
                else:
                    values = self.materialize([e]).reshape(-1)[local]
                out[order[start:stop]] = values
        return out.view(flat_indices.shape)

    def __repr__(self) -> str:
        return f"QuantizedStore({self.format_name}, shape={list(self.shape)}, dtype={self.dtype}, parts={self.parts})"
