"""Data-parallel training (issue 13): 2 gloo ranks under torchrun on the tiny model, against one process.

2 ranks x grad_accum 1 train what 1 process x grad_accum 2 trains (losses, trained values, selection, reselection);
a torchrun job SIGKILLed mid-run resumes exactly; a resume with another world size is refused.
"""

import json
from pathlib import Path

import pytest
import torch
from helpers import KILLER, NEEDS_GLOO, losses, make_model_dir, torchrun, write_copy_task
from safetensors.torch import load_file

from usaf.cli import main
from usaf.config import RunConfig
from usaf.errors import UsafError
from usaf.train import distributed
from usaf.train.loop import train
from usaf.version import __version__

pytestmark = NEEDS_GLOO

SETTINGS = [
    "data.max_seq_len=48",
    "data.batch_size=4",
    "select.density=0.1",
    "select.targets=[experts,routers,attention,embeddings,lm_head]",
    "select.reselect_every=2",  # reselection's statistics are summed across ranks
    "optim.lr=0.01",
    "log.progress=false",
    "log.tensorboard=false",
    "schedule.warmup_steps=2",
    "schedule.max_steps=6",
    "checkpoint.every_steps=2",
    "train.seed=3",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process with grad_accum 2, and 2 ranks with grad_accum 1, of the same run."""
    root = tmp_path_factory.mktemp("distributed")
    make_model_dir(root / "model")
    write_copy_task(root / "train.jsonl", 160)
    common = [
        f"--model={root / 'model'}",
        f"--data={root / 'train.jsonl'}",
        *[f"--set={s}" for s in SETTINGS],
    ]
    assert main(["train", *common, f"--out={root / 'one'}", "--set=schedule.grad_accum=2"]) == 0
    two = torchrun(["train", *common, f"--out={root / 'two'}", "--set=schedule.grad_accum=1"])
    assert two.returncode == 0, two.stderr[-3000:]
    return root, common, two


def _trained(run: Path, step: int = 6) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step-{step:08d}" / "trainable.safetensors"))


@pytest.mark.slow
def test_two_ranks_train_what_one_process_with_twice_the_accumulation_trains(runs):
    root, _, two = runs
    one_losses, two_losses = losses(root / "one"), losses(root / "two")
    assert sorted(two_losses) == list(range(1, 7))
    assert all(abs(one_losses[s] - two_losses[s]) < 1e-5 for s in one_losses), (one_losses, two_losses)
    a, b = _trained(root / "one"), _trained(root / "two")
    assert a.keys() == b.keys() and any(".usaf." not in k for k in a)  # routers are trained too
    for key in a:
        assert torch.allclose(a[key].float(), b[key].float(), atol=1e-5, rtol=1e-4), key
    rows = [json.loads(line) for line in (root / "two" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("reselected_entries") for r in rows)  # a reselection happened, the same on both ranks
    one_tokens = json.loads((root / "one" / "summary.json").read_text())["tokens"]
    assert json.loads((root / "two" / "summary.json").read_text())["tokens"] == one_tokens  # global
    assert (
        f"usaf {__version__}: training" in two.stdout
        and two.stdout.count(f"usaf {__version__}: training") == 1
    )  # rank 0 prints


def test_the_selection_does_not_depend_on_the_world_size(runs):
    root, _, _ = runs
    a = load_file(str(root / "one" / "selection.safetensors"))
    b = load_file(str(root / "two" / "selection.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    after_a, after_b = _trained(root / "one"), _trained(root / "two")  # after the reselections
    chosen = [k for k in after_a if k.endswith(("flat_indices", "line_ids"))]
    assert chosen and all(torch.equal(after_a[k], after_b[k]) for k in chosen)


@pytest.mark.slow
def test_a_killed_job_resumes_exactly_and_only_with_its_world_size(runs, tmp_path):
    root, common, _ = runs
    killer = tmp_path / "killer.py"
    killer.write_text(KILLER)
    run = tmp_path / "killed"
    # rank 0 is SIGKILLed right after its step-4 checkpoint; torchrun ends the other rank
    killed = torchrun(
        ["train", *common, f"--out={run}", "--set=schedule.grad_accum=1"], killer, KILL_AT_STEP="4"
    )
    assert killed.returncode != 0
    assert (run / "checkpoints" / "step-00000004").exists()
    assert not (run / "checkpoints" / "step-00000006").exists()

    with pytest.raises(UsafError, match="world size 2 and this job has world size 1"):
        train(RunConfig.load(str(run / "config.yaml")), run, resume=True)

    resumed = torchrun(["train", f"--resume={run}"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    straight, again = losses(root / "two"), losses(run)
    assert sorted(again) == list(range(1, 7)) and all(straight[s] == again[s] for s in straight)
    a, b = _trained(root / "two"), _trained(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_backend_choice_and_one_process_defaults(monkeypatch):
    monkeypatch.delenv(distributed.BACKEND_ENV, raising=False)
    assert distributed.choose_backend("auto", "cuda") == "nccl"
    assert distributed.choose_backend("auto", "cpu") == "gloo"
    assert distributed.choose_backend("gloo", "cuda") == "gloo"
    monkeypatch.setenv(distributed.BACKEND_ENV, "gloo")
    assert distributed.choose_backend("auto", "cuda") == "gloo"
    monkeypatch.setenv(distributed.BACKEND_ENV, "mpi2")
    with pytest.raises(UsafError, match="not one of"):
        distributed.choose_backend("auto", "cpu")
    assert (
        distributed.world_size() == 1
        and distributed.is_main()
        and distributed.sum_scalars(3, 1.5) == (3, 1.5)
    )
    distributed.check_world_size(None, "x")  # a checkpoint from before: world size 1
    with pytest.raises(UsafError, match="world size 4 and this job has world size 1"):
        distributed.check_world_size(4, "x")
