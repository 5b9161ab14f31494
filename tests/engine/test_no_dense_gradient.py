"""No dense expert-sized gradient is ever formed: every op run during backward is recorded and checked."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import usaf
from usaf.model.layout import find_moe_layers
from usaf.testing.tiny import FAMILIES, tiny_model

IDS = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))


class OpRecorder(TorchDispatchMode):
    """Records (op, output shape) of every op that allocates a dense output (views and in-place ops do not
    allocate; a sparse CSR result holds only its nonzeros, whatever its nominal shape)."""

    def __init__(self):
        super().__init__()
        self.allocations = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        for i, tensor in enumerate(tree_flatten(out)[0]):
            aliases = i < len(returns) and returns[i].alias_info is not None
            if isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided and not aliases:
                self.allocations.append((str(func), tuple(tensor.shape)))
        return out


def forbidden_shapes(model):
    """Expert stacks [E, A, B] and single expert matrices [A, B], in either orientation."""
    shapes = set()
    for layer in find_moe_layers(model):
        for t in layer.tensors:
            if t.is_bias:
                continue
            e, a, b = getattr(layer.experts, t.name).shape
            shapes |= {(e, a, b), (e, b, a), (a, b), (b, a)}
    return shapes


def backward_allocations(model):
    loss = model(IDS, labels=IDS).loss
    with OpRecorder() as recorder:
        loss.backward()
    return recorder.allocations


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("granularity", ["element", "neuron"])
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.usefixtures("each_kernel_path")
def test_backward_forms_no_dense_expert_gradient(family, granularity, recompute):
    model = usaf.prepare_model(tiny_model(family), usaf.UsafConfig(density=0.1, granularity=granularity))
    if recompute:
        usaf.enable_recomputation(model)
    model.train()
    shapes = forbidden_shapes(model)
    allocations = backward_allocations(model)
    assert allocations, "the recorder saw nothing"
    offending = [(op, shape) for op, shape in allocations if shape in shapes]
    assert not offending, offending
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_recorder_catches_the_dense_path():
    """The same check fails on transformers' own grouped_mm with trainable experts: the test can fail."""
    model = tiny_model("qwen3_moe")
    for layer in find_moe_layers(model):
        layer.experts.gate_up_proj.requires_grad_(True)
    offending = [s for _, s in backward_allocations(model) if s in forbidden_shapes(model)]
    assert offending


def target_matrix_shapes(model):
    """Every targeted matrix beyond the experts (attention, dense MLPs, embedding, output layer), both ways.
    Norm weights are vectors as long as one activation row: their gradient is exempt (see usaf.engine.sparse_weights)."""
    from usaf.engine.installed import sparse_weights

    shapes = set()
    for _, state in sparse_weights(model):
        if state.kind != "vector":
            _, a, b = state.stores["weight"].shape
            shapes |= {(a, b), (b, a)}
    return shapes


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.usefixtures("each_kernel_path")
def test_backward_forms_no_dense_gradient_of_any_target(family, recompute):
    from usaf.config import TARGETS

    model = usaf.prepare_model(
        tiny_model(family, tie_word_embeddings=False), usaf.UsafConfig(density=0.1, targets=list(TARGETS))
    )
    if recompute:
        usaf.enable_recomputation(model)
    model.train()
    shapes = forbidden_shapes(model) | target_matrix_shapes(model)
    assert len(shapes) > len(forbidden_shapes(model))
    offending = [(op, shape) for op, shape in backward_allocations(model) if shape in shapes]
    assert not offending, offending
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_recorder_catches_a_dense_attention_gradient():
    """Autograd's own gradient of a trainable attention weight is caught by the same check."""
    from usaf.model.targets import find_target_weights

    model = tiny_model("qwen3_moe", tie_word_embeddings=False)
    shapes = set()
    for weight in find_target_weights(model, find_moe_layers(model), ["attention"]):
        weight.module.weight.requires_grad_(True)
        shapes.add(tuple(weight.module.weight.shape))
    assert [s for _, s in backward_allocations(model) if s in shapes]
