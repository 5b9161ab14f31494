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
from safetensors.torch import load_file, save_file

from usaf.config import RunConfig
from usaf.engine import expert_parallel
from usaf.engine.expert_parallel import ExpertLayout, owned_mask
from usaf.engine.installed import sparse_experts
from usaf.engine.loss import causal_lm_loss
from usaf.engine.sparse import LineProbe
from usaf.errors import RunStateError
from usaf.export.delta import delta_from_run, export_delta
from usaf.export.merged import export_merged
from usaf.selection.reselect import Reselector
from usaf.train import checkpoint, runtime
from usaf.train.optim import build_optimizer
from usaf.train.run_dir import check_resumable
from usaf.train.session import load_model


def ep(size: int, rank: int) -> ExpertLayout:
    return ExpertLayout(ep=size, dp=1, ep_rank=rank, dp_rank=0)


class Scheduler:
    def state_dict(self) -> dict:
        return {"last_epoch": 1}


def save(run_dir, model, optimizer, expert_layout=None, world_size=1, extra=None, shard=None):
    state = {"rng": runtime.rng_state(), "world_size": world_size}
    return checkpoint.save(
        run_dir, 1, model=model, optimizer=optimizer, scheduler=Scheduler(), state=state, keep_last=1,
        expert_layout=expert_layout, extra_tensors=extra, shard_tensors=shard,
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


def probed(model, config) -> Reselector:
    """A Reselector whose expert tensors each hold a probe over lines of every expert, with scores: what one process
    holds in a probe window (the job's candidates)."""
    reselector = Reselector(model, config.select, total_steps=10)
    generator = torch.Generator().manual_seed(1)
    for path, state in reselector.states.items():
        for name, axis in reselector.geometry[path].axes.items():
            store = state.stores[name]
            lines = torch.randperm(store.shape[0] * store.shape[axis], generator=generator)
            probe = LineProbe(store.shape, axis, lines[: 4 * store.shape[0]].sort().values)
            probe.score.copy_(torch.rand(probe.score.shape, generator=generator))
            state.probes[name] = probe
    return reselector


def probes_among(tensors: dict, model, expert_layout: ExpertLayout | None) -> dict:
    """The expert probes of a state dict, each kept to the lines of `expert_layout`'s experts (None: all)."""
    stores = {path: state.stores for path, state in sparse_experts(model)}
    kept = {}
    for key, lines in tensors.items():
        if not (key.startswith("probe/") and key.endswith("/lines")):
            continue
        path, name, _ = key[len("probe/") :].rsplit("/", 2)
        if path not in stores:
            continue
        stem, shape = key[: -len("lines")], stores[path][name].shape
        axis = int(tensors[stem + "axis"])
        mine = torch.ones(lines.numel(), dtype=torch.bool)
        if expert_layout is not None:
            mine = owned_mask(shape, axis, lines, expert_layout.owned(shape[0]))
        kept.update({stem + "lines": lines[mine], stem + "score": tensors[stem + "score"][mine]})
        kept[stem + "axis"] = tensors[stem + "axis"]
    return kept


def test_reselection_probes_are_each_ranks_own_in_its_shard_and_resume_exactly(one, tmp_path, monkeypatch):
    """Under expert parallelism a rank probes only its experts' candidate lines: its probes go into its shard of the
    checkpoint (EXTRA_SHARD_FILE), the replicated extra file holds none, and a resume gives each rank its own back
    bit for bit (at another EP size: re-sharded; without EP: the job's). A checkpoint written before the probes were
    sharded (rank 0 held the job's probes in the extra file, its shards had two files) loads too: each rank keeps
    its experts' lines."""
    job = probed(
        copy.deepcopy(one.model), one.config
    ).state_dict()  # the job's probes, as one process holds them
    assert probes_among(job, one.model, None)

    def rank(size, r, tensors):
        """An EP rank's model, optimizer and Reselector, its state restored from `tensors`."""
        expert_parallel.set_layout(ep(size, r))
        try:
            model, optimizer = rank_view(one, ep(size, r))
            reselector = Reselector(model, one.config.select, total_steps=10)
            reselector.load_state_dict(tensors)
            return model, optimizer, reselector.state_dict(), reselector.shard_state_dict()
        finally:
            expert_parallel.set_layout(None)

    views = [rank(2, r, job) for r in range(2)]  # from an old checkpoint's extra file: the job's probes
    for r, (model, _, replicated, shard) in enumerate(views):
        assert not probes_among(replicated, model, None)  # the replicated part holds no expert probe
        assert_same_tensors(shard, probes_among(job, model, ep(2, r)))
        assert any(v.numel() for k, v in shard.items() if k.endswith("/lines"))
    # the ranks' shards, concatenated in rank order, are the job's probes
    for key, value in probes_among(job, one.model, None).items():
        if value.dim():
            assert torch.equal(torch.cat([view[3][key] for view in views]), value), key

    def other_ranks_write():
        (tmp,) = (tmp_path / "ep" / "checkpoints").glob(".tmp-*")
        model, optimizer, _, shard = views[1]
        checkpoint.write_shard(tmp, model, optimizer, ep(2, 1), shard_tensors=shard)

    monkeypatch.setattr(checkpoint, "_shards_written", other_ranks_write)
    model, optimizer, replicated, shard = views[0]
    saved = save(tmp_path / "ep", model, optimizer, ep(2, 0), 2, extra=replicated, shard=shard)
    record = checkpoint.read_state(saved)[checkpoint.EXPERT_PARALLEL_KEY]
    assert [s["files"][2] for s in record["shards"]] == [f"extra-ep{r}-of-2.safetensors" for r in range(2)]
    assert not probes_among(load_file(saved / "extra.safetensors"), one.model, None)
    for size in (2, 3):  # its own shard; re-sharded
        for r in range(size):
            _, _, replicated, shard = rank(size, r, checkpoint.load(saved, ep(size, r))["extra"])
            assert_same_tensors(shard, probes_among(job, one.model, ep(size, r)))
            assert_same_tensors(replicated, views[0][2])
    gathered = checkpoint.load(saved)["extra"]  # no EP: the job's
    assert_same_tensors(probes_among(gathered, one.model, None), probes_among(job, one.model, None))
    # an old checkpoint: two files a shard, the job's probes in the extra file (rank 0's then)
    meta = checkpoint.read_state(saved)
    for shard_record in meta[checkpoint.EXPERT_PARALLEL_KEY]["shards"]:
        name = shard_record["files"].pop()
        (saved / name).unlink()
        del meta["files"][name]
    save_file({**views[0][2], **job}, str(saved / "extra.safetensors"))
    meta["files"]["extra.safetensors"] = checkpoint.file_sha256(saved / "extra.safetensors")
    (saved / "state.sha256").unlink()  # (state.json is not checked where no sum was recorded)
    (saved / "state.json").write_text(json.dumps(meta))
    for r in range(2):
        _, _, _, shard = rank(2, r, checkpoint.load(saved, ep(2, r))["extra"])
        assert_same_tensors(shard, probes_among(job, one.model, ep(2, r)))
