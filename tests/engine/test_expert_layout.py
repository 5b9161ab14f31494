"""Expert parallelism's pieces that need no second process (issue 37): what a rank owns, keeps and reads, and the
settings refused before anything loads. The torchrun jobs are tests/distributed/test_expert_parallel_train.py."""

import pytest
import torch
from helpers import make_model_dir

from usaf.base.load import load_prepared
from usaf.base.writer import prepare_store
from usaf.config import RunConfig, UsafConfig
from usaf.engine import expert_parallel
from usaf.engine.expert_parallel import ExpertLayout
from usaf.engine.installed import sparse_experts
from usaf.errors import ConfigError, ModelError
from usaf.selection.saved import Chosen
from usaf.train import distributed


@pytest.fixture
def rank_one_of_three():
    """This process as EP rank 1 of 3 (no process group: only what reads the layout without collectives)."""
    expert_parallel.set_layout(ExpertLayout(ep=3, dp=1, ep_rank=1, dp_rank=0))
    yield expert_parallel.layout()
    expert_parallel.set_layout(None)


def test_a_layout_splits_experts_into_contiguous_blocks():
    layouts = [ExpertLayout(ep=4, dp=2, ep_rank=e, dp_rank=1) for e in range(4)]
    assert [list(x.owned(16)) for x in layouts] == [list(range(4 * e, 4 * e + 4)) for e in range(4)]
    assert {layouts[0].owner(e, 16) for e in range(4)} == {0} and layouts[0].owner(15, 16) == 3


def test_a_rank_keeps_only_its_experts_entries_with_global_indices(rank_one_of_three):
    shape = (6, 3, 5)  # rank 1 of 3 owns experts 2 and 3: flat indices 30 ... 59
    flat = torch.tensor([0, 29, 30, 44, 59, 60, 89])
    lines = torch.tensor([0, 5, 6, 11, 12])  # along axis 1 (3 lines an expert): lines 6 ... 11 are its own
    store = type("Store", (), {"shape": shape})()
    kept = expert_parallel.keep_owned(
        {"e.a": Chosen(None, flat), "e.b": Chosen(1, lines), "attention": Chosen(None, flat)},
        {"e.a": store, "e.b": store},
    )
    assert kept["e.a"].indices.tolist() == [30, 44, 59]
    assert kept["e.b"].indices.tolist() == [6, 11]
    assert torch.equal(kept["attention"].indices, flat)  # not an expert stack: whole on every rank


@pytest.mark.slow
def test_a_rank_reads_only_its_experts_bytes_of_a_store(tmp_path, rank_one_of_three):
    make_model_dir(tmp_path / "model")
    prepare_store(tmp_path / "model", tmp_path / "nf4", "nf4")
    whole = load_prepared(tmp_path / "nf4", config=UsafConfig(selection="random"), device="cpu")
    expert_parallel.set_layout(None)
    full = load_prepared(tmp_path / "nf4", config=UsafConfig(selection="random"), device="cpu")
    expert_parallel.set_layout(rank_one_of_three)
    (path, mine), *_ = sparse_experts(whole)
    everything = dict(sparse_experts(full))[path]
    for name, store in mine.stores.items():
        if name.endswith("_bias"):
            continue
        owned = store.owned
        assert store.shape == everything.stores[name].shape and list(owned) == [2, 3]  # 6 experts / 3
        assert store.nbytes * 3 == everything.stores[name].nbytes
        assert torch.equal(store.materialize([2, 3]), everything.stores[name].materialize([2, 3]))
        with pytest.raises(ModelError, match="another rank holds"):
            store.materialize([0])
    assert expert_parallel.frozen_expert_bytes(whole) * 3 == expert_parallel.frozen_expert_bytes(full)


def test_settings_an_expert_parallel_job_cannot_run_are_refused_in_one_line(monkeypatch):
    config = RunConfig.load(None, [("distributed.expert_parallel", 2)])
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"expert_parallel=2 .* this job has 3: start it with torchrun"):
        distributed.check_expert_parallel(config)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="--nproc_per_node=2"):
        distributed.check_expert_parallel(config)
    neurons = config.replace({"select.granularity": "neuron", "select.reselect_every": 5})
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(
        ConfigError, match="reselecting whole neurons is not available under expert parallelism"
    ):
        distributed.check_expert_parallel(neurons)
    distributed.check_expert_parallel(config)  # 2 of 2: fine
