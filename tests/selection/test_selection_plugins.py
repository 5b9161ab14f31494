"""The selection registries declare every strategy and scorer the config offers, and what each needs."""

from usaf.config import SELECTIONS, STRATEGIES, UsafConfig
from usaf.selection.strategies import SCORER_NEEDS, STRATEGY_NEEDS, needs_gradient, needs_routing


def test_registries_cover_config_choices():
    assert set(STRATEGY_NEEDS) == set(STRATEGIES)
    assert set(SCORER_NEEDS) == set(SELECTIONS) - {"auto"}


def test_needs_follow_strategy_or_scorer():
    def config(strategy, selection):
        c = UsafConfig()
        c.strategy, c.selection = strategy, selection
        return c

    assert needs_gradient(config("gradient", "magnitude"))
    assert needs_gradient(config("uniform", "gradient"))
    assert not needs_gradient(config("routing", "random"))
    assert needs_routing(config("routing", "magnitude"))
    assert not needs_routing(config("uniform", "gradient"))
