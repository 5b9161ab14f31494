"""Target kinds are plug-ins: a role registered from outside the package (here, the query/key norms carved out of
`norms`) is a config choice, is found, trains exactly (gradients equal the dense ones at its entries) and is
planned from the model's skeleton."""

import copy

import pytest
from test_targets import backward_against_patched_reference

import usaf
from usaf.config import TARGETS
from usaf.model.targets import TargetKind
from usaf.registry import TARGET_KINDS
from usaf.testing.tiny import tiny_model

QK_NORMS = TargetKind(
    "qk_norms_test",
    "vector",  # the forward norms train with
    lambda path, module, scan: path.endswith((".q_norm", ".k_norm")) and module.weight.dim() == 1,
)


@pytest.fixture
def qk_norms():
    TARGET_KINDS.register(QK_NORMS)
    yield QK_NORMS
    TARGET_KINDS.unregister(QK_NORMS.name)


def test_a_role_from_outside_is_a_choice_and_trains_exactly(qk_norms):
    assert qk_norms.name in TARGETS
    reference = tiny_model("qwen3_moe", tie_word_embeddings=False)
    config = usaf.UsafConfig(density=0.5, selection="random", targets=[qk_norms.name, "norms"])
    model = usaf.prepare_model(copy.deepcopy(reference), config)
    delta = usaf.get_delta(model)
    carved = [k for k in delta if k.endswith((".q_norm.weight", ".k_norm.weight"))]
    assert carved and len(carved) == 2 * model.config.num_hidden_layers
    summary = usaf.trainable_summary(model)
    assert summary[f"{qk_norms.name}_entries"] == sum(delta[k].values.numel() for k in carved)
    assert summary["norms_entries"] == sum(v.values.numel() for k, v in delta.items() if k not in carved)
    backward_against_patched_reference(reference, model)


def test_without_the_plugin_the_name_is_refused():
    with pytest.raises(usaf.UsafError, match="qk_norms_test"):
        usaf.UsafConfig(targets=["qk_norms_test"])


def test_the_planner_counts_a_role_from_outside(qk_norms):
    from usaf.planner.shape import model_shape

    model = tiny_model("qwen3_moe", tie_word_embeddings=False)
    config = model.config.to_dict()
    shape = model_shape(config)
    assert shape.shapes_from == "transformers skeleton"
    carved = sum(m.weight.numel() for p, m in model.named_modules() if p.endswith((".q_norm", ".k_norm")))
    assert shape.target_params[qk_norms.name] == carved
    TARGET_KINDS.unregister(qk_norms.name)
    assert model_shape(config).target_params["norms"] == shape.target_params["norms"] + carved
