"""`distributed.shard_dense`: the frozen dense weights sharded over the ranks with FSDP2 (`fully_shard`).

Under torchrun every rank otherwise holds the whole dense part of the model (attention, norms, embeddings, the output
layer, shared experts, and the experts themselves when they are unquantized parameters): where that alone does not
fit a card, FSDP2 keeps 1/N of each of those weights on each of the N ranks (the mesh is the whole world) and
all-gathers a unit's weights only while it runs, in the forward and again in the backward.

- The units: each decoder layer, the input embeddings and the output layer (each its own unit unless they are tied:
  a tied weight stays whole on every rank) and the decoder body (the final norm). usaf's loss runs the body and then
  the output layer (`usaf.engine.loss.causal_lm_loss`), never the model's own forward, so the body and the output
  layer are FSDP2's roots.
- Every trainable parameter (usaf's trained `values`, the routers) is left out (`ignored_params`): it stays whole
  and replicated and usaf's own `GradientReducer` sums its gradient as without sharding. FSDP2 moves only frozen
  weights: it has no gradient to reduce. The quantized expert stores are not parameters and are untouched.
- The forward writes the trained entries into the gathered weight (`usaf.engine.sparse_weights`, the experts'
  resident stores) and the backward writes them again into the weight gathered afresh for it, so the sharded
  weights themselves stay the base and a dropped entry reads as its base.
- The sharding is applied after the model is prepared and a checkpoint restored (`Trainer.setup`), which both read
  and write the whole weights.
- auto: on exactly when the planner's ledger says the dense weights whole on every rank (and a GPU's runtime
  context) do not fit the card (`train.memory_limit`, else the GPU's memory, or the machine's RAM on the CPU).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from usaf.engine.installed import sparse_modules
from usaf.errors import ConfigError, UsafError
from usaf.model.hf import decoder_body
from usaf.planner.sizes import format_size
from usaf.selection.across_ranks import active
from usaf.store.dense import DenseStore
from usaf.train.memory_plan import run_plan


@dataclasses.dataclass(frozen=True)
class ShardChoice:
    shard: bool
    line: (
        str | None
    )  # one line for the run's log: what was chosen and why (None: one process, nothing to say)


def choose_shard_dense(config, device: torch.device, dtype: torch.dtype) -> ShardChoice:
    """Resolve `config.distributed.shard_dense`: off in one process, true and false as given, auto from the
    planner."""
    setting = config.distributed.shard_dense
    if not active():
        return ShardChoice(False, None)  # one process: nothing to say
    if setting is True or setting is False:
        line = f"shard_dense: {'on' if setting else 'off'} (distributed.shard_dense={str(setting).lower()})"
        return ShardChoice(setting, line)
    try:
        run = run_plan(config, device, dtype)
    except UsafError as err:
        return ShardChoice(False, f"shard_dense: off (distributed.shard_dense=auto: {err})")
    whole = run.plan(run.settings.replace(shard_dense=False))
    planned = f"the dense weights whole on every rank, {format_size(whole.replicated_dense)},"
    if whole.replicated_dense <= run.budget:
        return ShardChoice(
            False, f"shard_dense: off (distributed.shard_dense=auto: {planned} fit {run.where})"
        )
    return ShardChoice(
        True, f"shard_dense: on, FSDP2 (distributed.shard_dense=auto: {planned} exceed {run.where})"
    )


def shard_dense(model: nn.Module) -> None:
    """Apply FSDP2 to the frozen dense weights of a prepared `model` (see the module's docstring)."""
    body = decoder_body(model)
    layers = next((m for m in body.children() if isinstance(m, nn.ModuleList)), None)
    if layers is None:
        raise ConfigError(
            f"distributed.shard_dense: {type(body).__name__} has no list of decoder layers to shard; set "
            "distributed.shard_dense=false."
        )
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embeddings.weight
    whole = {p for p in model.parameters() if p.requires_grad}
    if tied:  # used by two units' modules: one of them would see it sharded
        whole.add(embeddings.weight)
    units = [*layers, *([] if tied else [embeddings]), body]
    for unit in units:
        fully_shard(unit, ignored_params=whole & set(unit.parameters()))
    roots = [body]
    if head is not None and not tied:
        fully_shard(head, ignored_params=whole & set(head.parameters()))
        roots.append(head)
    for root in roots:  # FSDP2 keeps a root gathered after its forward, for the backward: without one, not
        root.register_forward_hook(_reshard_without_backward)
    for _, state in sparse_modules(model):  # their backward writes the trained values in again
        for store in state.stores.values():
            if isinstance(store, DenseStore) and isinstance(store.tensor, DTensor):
                store.regathered = True


def _reshard_without_backward(root, args, output) -> None:
    if not torch.is_grad_enabled():  # an evaluation's forward: no backward will reshard it
        root.reshard()


def frozen_parameter_bytes(model: nn.Module) -> int:
    """The bytes of frozen parameters this process holds (of those FSDP2 shards, its shards)."""
    held = 0
    for param in model.parameters():
        if not param.requires_grad:
            local = param.to_local() if isinstance(param, DTensor) else param
            held += local.numel() * local.element_size()
    return held
