"""Selection strategies and scorers are plug-ins: the config's choices are their registries, and one written
outside the package (here, in this test) is passed from Python and trains, by object or by name."""

import subprocess
import sys

import pytest
import torch
from helpers import tiny_model

import usaf
from usaf.config import SELECTIONS, STRATEGIES
from usaf.engine.installed import sparse_experts
from usaf.registry import SCORERS
from usaf.registry import STRATEGIES as STRATEGY_REGISTRY
from usaf.selection.scorers import PerTensorScorer
from usaf.selection.strategies import BaseStrategy, Domain, Needs


def test_config_choices_are_the_registries():
    assert list(STRATEGIES) == ["uniform", "routing", "gradient", "file"]
    assert list(SELECTIONS) == ["auto", "random", "magnitude", "gradient"]
    assert STRATEGY_REGISTRY["routing"].needs == Needs(routing=True)
    assert SCORERS["gradient"].needs == Needs(gradient=True)
    with pytest.raises(usaf.UsafError, match="allowed values: \\['uniform', 'routing'"):
        usaf.UsafConfig(strategy="nope")


def test_builtins_are_registered_by_importing_the_config_alone():
    code = "from usaf.config import UsafConfig; print(UsafConfig(strategy='routing', selection='magnitude').strategy)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "routing"


class FirstEntries(PerTensorScorer):
    """A scorer from outside: the first `count` entries of each tensor (or expert)."""

    name = "first_entries_test"

    def pick_in(self, unit, expert, count, context):
        return torch.arange(count)

    def neuron_scores(self, unit, context):
        return -torch.arange(unit.num_experts * unit.per_expert, dtype=torch.float32).view(
            unit.num_experts, -1
        )


class OnlyExpertZero(BaseStrategy):
    """A strategy from outside: every expert tensor's budget goes to its expert 0; other weights keep theirs."""

    name, needs = "only_expert_zero_test", Needs()

    def domains(self, units, budgets, context):
        return [Domain([u], [0] if u.layer is not None else None, budgets[u.key]) for u in units]


@pytest.fixture
def plugins():
    yield FirstEntries(), OnlyExpertZero()
    SCORERS.unregister(FirstEntries.name)
    STRATEGY_REGISTRY.unregister(OnlyExpertZero.name)


@pytest.mark.parametrize("by_name", [False, True])
def test_a_strategy_and_scorer_from_outside_choose_the_entries(plugins, by_name):
    scorer, strategy = plugins
    if by_name:
        SCORERS.register(scorer)
        STRATEGY_REGISTRY.register(strategy)
        config = usaf.UsafConfig(strategy=strategy.name, selection=scorer.name, density=0.05)
    else:
        config = usaf.UsafConfig(strategy=strategy, selection=scorer, density=0.05)
    assert (config.strategy, config.selection) == (
        strategy.name,
        scorer.name,
    )  # names: the config saves as YAML
    model = tiny_model("qwen3_moe")
    usaf.prepare_model(model, config)
    seen = 0
    for _, state in sparse_experts(model):
        for name, entries in state.items():
            if name.endswith("_bias"):
                continue
            flat = entries.flat_indices
            per_expert = entries.per_expert
            assert flat.numel() > 0
            assert torch.equal(flat, torch.arange(flat.numel())), name  # expert 0's first entries
            assert flat.numel() <= per_expert
            seen += 1
    assert seen


def test_neuron_granularity_ranks_by_the_scorers_neuron_scores(plugins):
    scorer, _ = plugins
    model = tiny_model("qwen3_moe")
    usaf.prepare_model(
        model, usaf.UsafConfig(selection=scorer, granularity="neuron", density=0.05, targets=["experts"])
    )
    for _, state in sparse_experts(model):
        down = state["down_proj"]
        # the scores fall with the neuron id: the first neurons of expert 0 are trained
        assert torch.equal(down.line_ids, torch.arange(down.line_ids.numel()))


def test_a_plugin_without_the_protocol_is_one_clear_error():
    class NotAScorer:
        name = "broken"

    with pytest.raises(usaf.UsafError, match=r"UsafConfig.selection: .* lacks needs, pick, neuron_scores"):
        usaf.UsafConfig(selection=NotAScorer())
