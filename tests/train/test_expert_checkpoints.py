"""Checkpoints of an expert-parallel run, without processes: a one-process state (a prepared tiny model after one
optimizer step) is cut into the EP ranks' views by hand (`keep_owned_entries`, the optimizer moments following their
entries), the ranks' shards are written as `checkpoint.save` writes them, and what is read back (a resume at the same
or another EP size, an export) is compared with the one-process checkpoint."""

import copy
import json
from types import SimpleNamespace

import pytest
import torch
from helpers import make_model_dir
from safetensors.torch import load_file

from usaf.config import RunConfig
from usaf.engine.expert_parallel import ExpertLayout, owned_mask
from usaf.engine.installed import sparse_experts
from usaf.engine.loss import causal_lm_loss
from usaf.errors import RunStateError
from usaf.export.delta import delta_from_run, export_delta
from usaf.export.merged import export_merged
from usaf.train import checkpoint, runtime
from usaf.train.optim import build_optimizer
from usaf.train.run_dir import check_resumable
from usaf.train.session import load_model


def ep(size: int, rank: int) -> ExpertLayout:
    return ExpertLayout(ep=size, dp=1, ep_rank=rank, dp_rank=0)


class Scheduler:
    def state_dict(self) -> dict:
        return {"last_epoch": 1}


def save(run_dir, model, optimizer, expert_layout=None, world_size=1):
    state = {"rng": runtime.rng_state(), "world_size": world_size}
    return checkpoint.save(
        run_dir, 1, model=model, optimizer=optimizer, scheduler=Scheduler(), state=state, keep_last=1,
        expert_layout=expert_layout,
    )  # fmt: skip


@pytest.fixture(scope="module", params=["element", "neuron"])
def one(request, tmp_path_factory):
    """The model folder, run folder, config, model and optimizer of a one-process run after one step: its checkpoint
    holds trained values and moments of every kind of target (experts by `param`, attention, embeddings, ...)."""
    root = tmp_path_factory.mktemp(f"ep-{request.param}")
    model_dir = make_model_dir(root / "model")
    settings = [f"model.path={model_dir}", "select.density=0.1", f"select.granularity={request.param}"]
    config = RunConfig.load(None, [*settings, "select.strategy=uniform"])
    model = load_model(config, torch.device("cpu"), torch.float32, recompute=False)
    optimizer = build_optimizer(model, config)
    ids = torch.randint(3, 40, (2, 16), generator=torch.Generator().manual_seed(0))
    causal_lm_loss(model, ids, ids).backward()
    optimizer.step()
    save(root / "one", model, optimizer)
    return SimpleNamespace(
        model_dir=model_dir, run=root / "one", config=config, model=model, optimizer=optimizer
    )


def keep_owned_entries(model, expert_layout: ExpertLayout) -> dict[str, torch.Tensor]:
    """What the runtime leaves on an EP rank (it installs a selection cut by `expert_parallel.keep_owned`): the
    entries of the rank's experts, global indices; {values parameter name: the kept mask}."""
    kept = {}
    for path, state in sparse_experts(model):
        for name, entries in state.items():
            axis = entries.axis if entries.selection_name == "line_ids" else None
            selection = getattr(entries, entries.selection_name)
            keep = owned_mask(entries.shape, axis, selection, expert_layout.owned(entries.shape[0]))
            base = entries.base_values[keep] if entries.keeps_base else None
            entries.set_selection(selection[keep], base, entries.values.detach()[keep])
            kept[f"{path}.usaf.{name}.values"] = keep
    return kept


def rank_view(one, expert_layout: ExpertLayout):
    """The model and optimizer an EP rank holds of the one-process state: only its experts' entries, and their
    moments."""
    model = copy.deepcopy(one.model)
    optimizer = build_optimizer(model, one.config)
    optimizer.load_state_dict(one.optimizer.state_dict())
    params = dict(model.named_parameters())
    for name, keep in keep_owned_entries(model, expert_layout).items():
        state = optimizer.state[params[name]]
        for key, value in state.items():
            state[key] = value[keep] if value.dim() else value
    return model, optimizer


def write_ep_checkpoint(one, out_dir, size: int, monkeypatch):
    """The one-process state as an EP run of `size` ranks writes it into `out_dir`: rank 0 through
    `checkpoint.save`, the other ranks' shards written into its folder at the barrier."""
    views = [rank_view(one, ep(size, rank)) for rank in range(size)]

    def other_ranks_write():
        (tmp,) = (out_dir / "checkpoints").glob(".tmp-*")
        for rank in range(1, size):
            checkpoint.write_shard(tmp, *views[rank], ep(size, rank))

    monkeypatch.setattr(checkpoint, "_shards_written", other_ranks_write)
    return save(out_dir, *views[0], expert_layout=ep(size, 0), world_size=size)


def expert_prefixes(run_dir) -> set[str]:
    layout = checkpoint.read_state(checkpoint.latest(run_dir))["selection"]
    return {item["prefix"] for name, item in layout.items() if ".experts." in name}


def owned_by(tensors: dict, layout: dict, owned: range) -> torch.Tensor:
    """Whether each entry of one expert tensor in `tensors` lies in the `owned` experts."""
    key = layout["prefix"] + ("line_ids" if layout["kind"] == "lines" else "flat_indices")
    return owned_mask(layout["shape"], layout["axis"], tensors[key], owned)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).contiguous().view(torch.uint8)


def assert_same_tensors(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        assert torch.equal(bits(got[key]), bits(want[key])), key


def test_shards_hold_their_experts_and_export_equals_the_one_process_export(one, tmp_path, monkeypatch):
    saved = write_ep_checkpoint(one, tmp_path / "ep", 2, monkeypatch)
    meta = checkpoint.read_state(saved)
    record = meta[checkpoint.EXPERT_PARALLEL_KEY]
    assert record["size"] == 2 and meta["world_size"] == 2
    assert [shard["experts"] for shard in record["shards"]] == [{"6": [0, 3]}, {"6": [3, 6]}]
    assert set(meta["files"]) >= {name for shard in record["shards"] for name in shard["files"]}
    prefixes = expert_prefixes(one.run)
    assert prefixes and set(record["optimizer_params"]) == prefixes
    # the replicated file holds no expert entries; each shard only its experts', and some of them
    assert not [k for k in load_file(saved / "trainable.safetensors") if checkpoint._prefix_of(k) in prefixes]
    for rank, shard in enumerate(record["shards"]):
        tensors = load_file(saved / shard["files"][0])
        for layout in (item for item in meta["selection"].values() if item["prefix"] in prefixes):
            owned = owned_by(tensors, layout, range(3 * rank, 3 * rank + 3))
            assert owned.numel() and bool(owned.all())
    # the export gathers them: the one-process delta, bit for bit
    single, sharded = delta_from_run(one.run), delta_from_run(tmp_path / "ep")
    assert sorted(single.changes) == sorted(sharded.changes)
    for name, change in single.changes.items():
        assert torch.equal(sharded.changes[name].values.view(torch.uint8), change.values.view(torch.uint8)), (
            name
        )
        if change.flat_indices is not None:
            assert torch.equal(sharded.changes[name].flat_indices, change.flat_indices), name
    export_delta(one.run, tmp_path / "one.safetensors", base_dir=one.model_dir)
    export_delta(tmp_path / "ep", tmp_path / "ep.safetensors", base_dir=one.model_dir)
    assert_same_tensors(load_file(tmp_path / "ep.safetensors"), load_file(tmp_path / "one.safetensors"))
    export_merged(one.run, tmp_path / "one-merged", base_dir=one.model_dir)
    export_merged(tmp_path / "ep", tmp_path / "ep-merged", base_dir=one.model_dir)
    merged = "model.safetensors"
    assert (tmp_path / "ep-merged" / merged).read_bytes() == (tmp_path / "one-merged" / merged).read_bytes()


def test_each_rank_reads_back_its_own_entries_and_another_ep_size_is_resharded(one, tmp_path, monkeypatch):
    saved = write_ep_checkpoint(one, tmp_path / "ep", 2, monkeypatch)
    whole = checkpoint.load(checkpoint.latest(one.run))
    # no EP (a data-parallel resume at the same world size): every expert, as the one-process checkpoint holds them
    gathered = checkpoint.load(saved)
    assert_same_tensors(gathered["trainable"], whole["trainable"])
    assert_same_tensors(gathered["optimizer_tensors"], whole["optimizer_tensors"])
    for size in (2, 3):  # the same EP size (its own shard), another one (re-sharded)
        for rank in range(size):
            model, optimizer = rank_view(one, ep(size, rank))
            restored = checkpoint.load(saved, ep(size, rank))
            assert_same_tensors(restored["trainable"], checkpoint.trainable_tensors(model))
            want = {
                f"{index}.{key}": value
                for index, state in optimizer.state_dict()["state"].items()
                for key, value in state.items()
            }
            assert_same_tensors(restored["optimizer_tensors"], want)
            checkpoint.restore_trainable(model, restored["trainable"], saved)  # the rank's model takes them
            checkpoint.restore_optimizer(optimizer, restored)


def test_the_best_checkpoint_keeps_its_shards_through_the_rotation(one, tmp_path, monkeypatch):
    """checkpoint.keep_best spares a whole checkpoint folder: an expert-parallel one keeps its shards, and the export
    of the best gathers them."""
    run = tmp_path / "ep"
    best = write_ep_checkpoint(one, run, 2, monkeypatch)  # step 1, the best
    shard_files = sorted(p.name for p in best.iterdir() if "-of-" in p.name)
    for step in (2, 3):  # later checkpoints record it; the rotation keeps the newest one and the best
        state = {"rng": runtime.rng_state(), checkpoint.BEST_KEY: {"step": 1, "kept": True}}
        checkpoint.save(
            run, step, model=one.model, optimizer=one.optimizer, scheduler=Scheduler(), state=state, keep_last=1,
            spare=1,
        )  # fmt: skip
    assert [checkpoint.step_of(p) for p in checkpoint.list_checkpoints(run)] == [1, 3]
    assert shard_files and sorted(p.name for p in best.iterdir() if "-of-" in p.name) == shard_files
    assert checkpoint.best(run) == best
    exported, single = delta_from_run(run, best=True), delta_from_run(one.run)
    assert exported.info["source"]["step"] == 1 and sorted(exported.changes) == sorted(single.changes)
    for name, change in single.changes.items():
        assert torch.equal(
            exported.changes[name].values.view(torch.uint8), change.values.view(torch.uint8)
        ), name


def test_a_damaged_or_missing_shard_is_named_in_one_line(one, tmp_path, monkeypatch):
    saved = write_ep_checkpoint(one, tmp_path / "ep", 2, monkeypatch)
    shard = saved / "trainable-ep1-of-2.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(RunStateError, match=r"trainable-ep1-of-2.safetensors is damaged") as err:
        delta_from_run(tmp_path / "ep")
    assert "\n" not in str(err.value)
    checkpoint.load(saved, ep(2, 0))  # rank 0 reads (and checks) only its own shard
    (saved / "optimizer-ep0-of-2.safetensors").unlink()
    with pytest.raises(RunStateError, match=r"incomplete: optimizer-ep0-of-2.safetensors is missing") as err:
        checkpoint.load(saved, ep(2, 0))
    assert "\n" not in str(err.value)


def test_a_rank_that_wrote_no_shard_leaves_no_checkpoint(one, tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "_shards_written", lambda: None)  # rank 1 never wrote
    model, optimizer = rank_view(one, ep(2, 0))
    with pytest.raises(RunStateError, match="EP rank 1 did not write its shard trainable-ep1-of-2"):
        save(tmp_path, model, optimizer, expert_layout=ep(2, 0), world_size=2)
    assert not list((tmp_path / "checkpoints").iterdir())


def test_an_ep_resume_of_a_checkpoint_without_ep_is_refused_in_one_line(one):
    saved = checkpoint.latest(one.run)
    with pytest.raises(RunStateError, match="trained without expert parallelism") as err:
        checkpoint.load(saved, ep(2, 1))
    assert "distributed.expert_parallel=2" in str(err.value) and "\n" not in str(err.value)


def test_a_resume_may_change_the_ep_size():
    recorded = json.loads(json.dumps(RunConfig().to_dict()))
    now = RunConfig().replace({"distributed.expert_parallel": 2})
    assert check_resumable(recorded, now, recorded) == ["distributed.expert_parallel 1 -> 2"]
