"""A model at its full shape on fake tensors, stored as a plan says, with no weight read.

The transformers skeleton of the config (on the meta device), its dense weights and buffers replaced by fake
tensors on the simulated card, and every expert tensor by a `QuantizedStore` over fake parts laid out as the
format lays them out (`usaf.quant`'s `layout`), where the residency keeps them: the card, or host memory streamed
by a `LayerStreamer` (pinned host memory and a memory map are both fake CPU tensors here). Unquantized experts on
the card stay the module's own parameter, as usaf train keeps them. Then `usaf.prepare.prepare_model`, as loading
does.
"""

from __future__ import annotations

import warnings

import torch
import transformers
from torch import nn

from usaf.engine import expert_parallel
from usaf.model.layout import expert_weight_names, find_moe_layers
from usaf.quant import get_format
from usaf.store.dense import StoredExpertTensor
from usaf.store.offload import LayerStreamer, ResidentParts, StreamedParts, host_copy
from usaf.store.quantized import QuantizedStore


def skeleton(config: dict, dtype: torch.dtype) -> nn.Module:
    """The causal LM of a config.json's fields on the meta device (its published fields only: a
    quantization_config would ask transformers for quantizer kernels)."""
    fields = {k: v for k, v in config.items() if not k.startswith("_") and k != "quantization_config"}
    hf_config = transformers.AutoConfig.for_model(**fields)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(hf_config, trust_remote_code=False, dtype=dtype)
    return model.eval()


def fake_weights(model: nn.Module, device: torch.device) -> None:
    """Every parameter and buffer a fake tensor of its shape on `device` (called under the fake mode)."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=False
                )
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)


def install_stores(model: nn.Module, quant: str, residency: str, device: torch.device, cache_mb: int) -> dict:
    """The experts' stores as `usaf.base.load` installs them from a prepared store: {tensor name: store}, empty
    for unquantized experts on the device (then the module's own parameters, resident). Called under the fake
    mode."""
    if quant == "none" and residency == "device":
        return {}
    fmt = get_format(quant)
    streamer = LayerStreamer(device, cache_mb << 20) if residency != "device" else None
    ep, stores = expert_parallel.layout(), {}
    for name, layer in expert_weight_names(find_moe_layers(model)).items():
        module_path, _, attr = name.rpartition(".")
        module = model.get_submodule(module_path)
        weight = getattr(module, attr)
        experts, rows, cols = weight.shape
        owned = ep.owned(experts) if ep is not None else range(experts)
        parts = {}
        for part, (dtype, shape) in fmt.layout(rows, cols, weight.dtype).items():
            made = torch.empty(
                (len(owned), *shape), dtype=dtype, device=device if residency == "device" else "cpu"
            )
            parts[part] = host_copy(made, device) if residency == "host" else made
        holder = ResidentParts(parts) if streamer is None else StreamedParts(parts, streamer, layer)
        store = QuantizedStore(quant, holder, (experts, rows, cols), weight.dtype, None, owned)
        del module._parameters[attr]
        setattr(module, attr, StoredExpertTensor(store, name))
        stores[name] = store
    return stores
