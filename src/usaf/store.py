"""Frozen expert storage behind a small interface, so the engine does not care how the base is kept.

A store holds one fused expert tensor [E, A, B] (or a bias [E, B], seen as [E, 1, B]). The engine asks it for the
weights of the experts a forward routed tokens to; quantized stores (see `usaf.quant`) dequantize exactly those.
"""

from __future__ import annotations

import torch


class DenseStore:
    """An unquantized frozen tensor, used in place.

    The engine writes trained values straight into it ("replace" semantics), so the module's own parameter always
    holds the effective weight: `model.state_dict()` and `save_pretrained` see the trained model, and a forward
    needs no copy of the stack.
    """

    resident = True  # the whole stack is addressable at once: one chunk, no workspace

    def __init__(self, module: torch.nn.Module, name: str):
        # Looked up on each use, so that `model.to(...)` (which swaps parameter data) is followed.
        self.module, self.name = module, name
        tensor = self.tensor
        if not tensor.is_contiguous():
            raise ValueError(f"'{name}' is not contiguous; trained values are written through a flat view.")
        self.shape = tuple(tensor.shape) if tensor.dim() == 3 else (tensor.shape[0], 1, tensor.shape[1])

    @property
    def tensor(self) -> torch.Tensor:
        return getattr(self.module, self.name).data

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    def full(self) -> torch.Tensor:
        """The whole stack as [E, A, B], writable in place."""
        return self.tensor.view(self.shape)

    def materialize(self, expert_ids: list[int]) -> torch.Tensor:
        """A fresh [k, A, B] copy of the given experts."""
        return self.full()[expert_ids]

    def read(self, flat_indices: torch.Tensor) -> torch.Tensor:
        """The stored values at flat indices of the [E, A, B] tensor."""
        return self.tensor.reshape(-1)[flat_indices]
