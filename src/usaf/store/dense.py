"""Frozen expert storage behind a small interface, so the engine does not care how the base is kept.

A store holds one fused expert tensor [E, A, B] (or a bias [E, B], seen as [E, 1, B]). The engine asks it for the
weights of the experts a forward routed tokens to; quantized stores (see `usaf.quant`) dequantize exactly those.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from usaf.errors import ModelError


class DenseStore:
    """An unquantized frozen tensor, used in place.

    The engine writes trained values straight into it ("replace" semantics), so the module's own parameter always
    holds the effective weight: `model.state_dict()` and `save_pretrained` see the trained model, and a forward
    needs no copy of the stack.
    """

    # FSDP2 holds the weight sharded and gathers it afresh for each backward, from shards without the trained values
    # (`usaf.train.shard_dense` sets it): the backward then writes them in again, as the forward did
    regathered = False

    def __init__(self, module: torch.nn.Module, name: str, one_matrix: bool = False):
        """one_matrix: the tensor is one weight (a [A, B] matrix or a [B] vector), seen as [1, A, B]; otherwise
        a stack [E, A, B] or a stack of biases [E, B]."""
        # Looked up on each use, so that `model.to(...)` (which swaps parameter data) is followed.
        self.module, self.name = module, name
        self._view: tuple | None = None
        tensor = self.tensor
        if not tensor.is_contiguous():
            raise ModelError(
                f"'{name}' is not contiguous; trained values are written through a flat view. "
                "Load the model with contiguous weights."
            )
        if one_matrix:
            self.shape = (1, *([1] * (2 - tensor.dim())), *tensor.shape)
        else:
            self.shape = tuple(tensor.shape) if tensor.dim() == 3 else (tensor.shape[0], 1, tensor.shape[1])

    @property
    def tensor(self) -> torch.Tensor:
        # the frozen parameter itself (no `.data` alias: an op per use); it needs no gradient, so in-place writes
        # under no_grad are allowed
        return getattr(self.module, self.name)

    @property
    def resident(self) -> bool:
        """The whole stack is addressable at once (one chunk, no workspace) and written into; not while FSDP2 holds
        the weight sharded (`usaf.train.shard_dense`, outside its unit's forward and backward): its shards keep the
        base, and the forward writes the trained values into the weight it gathers."""
        return not isinstance(self.tensor, DTensor)

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    def full(self) -> torch.Tensor:
        """The whole stack as [E, A, B], writable in place."""
        tensor = self.tensor
        if tensor.shape == self.shape:
            return tensor
        # a view is an op: made once per parameter storage (`model.to` swaps it) and reused
        key = (tensor.data_ptr(), tensor.device, tensor.dtype)
        if self._view is None or self._view[0] != key:
            self._view = (key, tensor.view(self.shape))
        return self._view[1]

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def owned(self) -> range:
        """The experts this store holds: all of them (only a `QuantizedStore` is ever an expert-parallel slice)."""
        return range(self.shape[0])

    def materialize(self, expert_ids: list[int]) -> torch.Tensor:
        """A fresh [k, A, B] copy of the given experts."""
        return self.full()[expert_ids]

    def read(self, flat_indices: torch.Tensor) -> torch.Tensor:
        """The stored values at flat indices of the [E, A, B] tensor. A sharded weight is gathered for it (a collective:
        every rank reads the same dense entries, which are replicated)."""
        tensor = self.tensor
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        return tensor.reshape(-1)[flat_indices]


class StoredExpertTensor:
    """Stands in for an experts module's fused parameter whose frozen data lives in a store (a prepared quantized
    base). It has the parameter's shape and dtype, so layout discovery and budgets work unchanged; it has no data,
    and any torch operation on it fails loudly instead of computing with garbage."""

    def __init__(self, store, name: str):
        self.store, self.name = store, name
        self.shape = torch.Size(store.shape)
        self.dtype = store.dtype

    @property
    def device(self) -> torch.device:
        return self.store.device

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return self.shape.numel()

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise ModelError(
            f"{getattr(func, '__name__', func)} was called on an expert tensor that lives in a usaf store (a prepared "
            "quantized base); such a model runs only through usaf's experts implementation."
        )

    def __repr__(self) -> str:
        return f"StoredExpertTensor({self.name}, shape={list(self.shape)}, store={self.store!r})"
