"""The engine's state: one object on the model (`usaf.engine.state.ModelState`), one protocol on the prepared
modules (`SparseState`, shared by `SparseExperts` and `SparseWeight`), and forwards that leave the module alone."""

import pytest
import torch

import usaf
from usaf.engine.installed import row_observers, sparse_experts, sparse_modules, sparse_weights
from usaf.engine.state import ModelState, SparseState, model_state, module_state, owned_state
from usaf.testing.tiny import tiny_model

IDS = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(3))


def _prepared(targets=("experts", "attention", "norms", "embeddings", "lm_head"), **kw):
    config = usaf.UsafConfig(density=0.2, selection="random", targets=targets)
    return usaf.prepare_model(tiny_model("qwen3_moe", **kw), config)


def test_the_model_holds_one_state_object():
    model = _prepared()
    state = model_state(model)
    assert isinstance(state, ModelState)
    assert list(state.config.targets) == ["experts", "attention", "norms", "embeddings", "lm_head"]
    assert state.original_values is None and state.calibration is None and state.store is None
    # nothing else of usaf's is stuck onto the model
    assert not [k for k in vars(model) if k.startswith("usaf_") and k != "usaf_state"]
    assert model_state(tiny_model("qwen3_moe")) is None


def test_every_prepared_module_speaks_the_protocol():
    model = _prepared()
    states = dict(sparse_modules(model))
    assert states and all(isinstance(s, SparseState) for s in states.values())
    experts, weights = dict(sparse_experts(model)), dict(sparse_weights(model))
    assert experts and weights and {**experts, **weights} == states
    assert all(s.is_expert_stack and not s.observes_rows and s.target == "experts" for s in experts.values())
    assert all(not s.is_expert_stack and s.observes_rows for s in weights.values())
    assert row_observers(model) == weights
    for state in states.values():  # what consumers read, whatever the kind
        assert state.stores and isinstance(state.probes, dict)
        for name, entries in state.items():
            assert name in state.stores and state.entries_of(name) is entries
        state.write_resident()
        state.after_load()


def test_a_state_must_declare_its_capabilities():
    with pytest.raises(TypeError, match="observes_rows"):

        class Incomplete(SparseState):
            is_expert_stack = False


def test_a_tied_output_layer_uses_the_embeddings_state_without_owning_it():
    model = _prepared(tie_word_embeddings=True)
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    assert head.weight is embedding.weight
    assert owned_state(head) is None and module_state(head) is owned_state(embedding) is not None
    assert not [k for k in model.state_dict() if k.startswith("lm_head.usaf")]


def test_expert_parallel_placement_lives_in_the_experts_state():
    model = _prepared()
    for _, state in sparse_experts(model):
        assert state.placement is None


def test_a_norms_forward_never_deletes_its_parameter_or_sticks_a_weight_on_it():
    """The family forward sees the effective weight through functional_call: the parameter's slot is never deleted
    and no plain `weight` attribute is set; before and after the call (the hooks) `weight` is the parameter."""
    model = _prepared(targets=("norms",))
    (path, state), *_ = [(p, s) for p, s in sparse_weights(model) if s.kind == "vector" and len(s)]
    norm = model.get_submodule(path)
    parameter = norm._parameters["weight"]
    assert isinstance(parameter, torch.nn.Parameter)
    with torch.no_grad():
        state.entries.values.add_(0.5)
    seen = {"pre": [], "post": [], "inside": []}
    norm.register_forward_pre_hook(lambda m, args: seen["pre"].append(m._parameters["weight"]))
    norm.register_forward_hook(lambda m, args, out: seen["post"].append(m._parameters["weight"]))
    import usaf.engine.sparse_weights as engine_weights

    family_forward = engine_weights.family_forward

    def inside(module):
        bound = family_forward(module)

        def forward(*args, **kwargs):
            # the family's forward sees the effective weight, the module keeps its parameter slot and gets no
            # attribute
            seen["inside"].append(
                (module.weight, "weight" in module._parameters, "weight" in module.__dict__)
            )
            return bound(*args, **kwargs)

        return forward

    engine_weights.family_forward = inside
    try:
        x = torch.randn(3, parameter.shape[-1])
        y = norm(x)
    finally:
        engine_weights.family_forward = family_forward
    # the hooks ran once, before and after, around the same parameter object
    assert seen["pre"] == [parameter] and seen["post"] == [parameter]
    assert norm._parameters["weight"] is parameter and "weight" not in norm.__dict__
    (effective, has_slot, has_attribute), *more = seen["inside"]
    assert not more and has_slot and not has_attribute
    assert not isinstance(effective, torch.nn.Parameter) and effective.requires_grad
    expected = parameter.detach().clone().reshape(-1)
    expected[state.entries.flat_indices] = state.entries.values.detach().to(expected.dtype)
    assert torch.equal(effective.detach().reshape(-1), expected)
    y.sum().backward()
    assert state.entries.values.grad is not None and state.entries.values.grad.abs().sum() > 0


def test_embedding_backward_with_padding_and_probe_matches_the_dense_gradient():
    from usaf.engine.sparse import LineProbe

    model = _prepared(targets=("embeddings",))
    (path, state), *_ = list(sparse_weights(model))
    embedding = model.get_submodule(path)
    embedding.padding_idx = 5
    _, rows, hidden = state.stores["weight"].shape
    candidates = torch.tensor([1, 5, 9, 40, 96])
    state.probes["weight"] = LineProbe((1, rows, hidden), 1, candidates)
    ids = torch.tensor([[1, 5, 5, 9, 2, 1]])
    out = embedding(ids)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    (out * weights).sum().backward()
    dense = torch.zeros(rows, hidden).index_add_(0, ids.reshape(-1), weights.reshape(-1, hidden))
    dense[5] = 0  # the padding row gets no gradient
    entries = state.entries
    assert torch.allclose(entries.values.grad, dense.reshape(-1)[entries.flat_indices], atol=1e-6)
    assert torch.allclose(state.probes["weight"].score, dense[candidates].abs(), atol=1e-6)


@pytest.mark.parametrize("ids", [[5, 1, 5, 9, 2, 1], [3], list(range(40, 0, -3)) * 3])
def test_distinct_rows_are_unique_with_a_shape_known_in_advance(ids):
    from usaf.engine.sparse_weights import _distinct_rows

    ids = torch.tensor(ids)
    rows, inverse = _distinct_rows(ids, 97)
    unique, unique_inverse = torch.unique(ids, return_inverse=True)
    assert rows.shape == ids.shape and torch.equal(inverse, unique_inverse)
    assert torch.equal(rows[: unique.numel()], unique) and bool((rows[unique.numel() :] == 97).all())
