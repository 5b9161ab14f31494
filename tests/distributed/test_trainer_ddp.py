"""transformers.Trainer under Accelerate, 2 processes (DDP on gloo), against one process (issue 13 item 4).

`examples/hf_trainer.py` runs as docs/python.md says: once in one process (per-device batch 4, gradient
accumulation 2) and once under `accelerate launch --multi_gpu --num_processes 2` on CPU (per-device batch 4,
accumulation 1). The two train the same thing, because:
- data: Accelerate shards one seeded order of batches (SeedableRandomSampler, seeded by
  TrainingArguments.seed in both runs): rank r takes batches r, r+2, ..., so step k trains batches 2k and 2k+1
  on ranks 0 and 1, and the same two as its micro-batches in one process;
- loss: the sequences differ in length, so a mean per micro-batch would weigh tokens differently; the Trainer
  divides each micro-batch's summed loss by the step's supervised tokens over all ranks
  (`average_tokens_across_devices`, on by default) and multiplies it by the world size, which DDP's gradient
  average undoes: the summed gradient is the one-process one;
- selection: `prepare_model` gives every rank rank 0's selection (the example's magnitude selection agrees
  anyway; `test_every_rank_trains_rank_0s_selection` makes ranks disagree on purpose).
Exact equality is not promised: the processes run with another thread count than this one (kernels may sum in
another order) and the all-reduce adds in its own order. Hence assert_close, with tolerances far below the size
of the updates (checked too), so a wrong batch, loss scale or selection on either side fails it.
"""

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import make_model_dir
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import usaf
from usaf.errors import UsafError
from usaf.export.delta import read_delta
from usaf.prepare import current_selection
from usaf.testing.tiny import tiny_model

pytest.importorskip("accelerate")
pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(), reason="needs gloo"
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_trainer.py"

# the example under the launcher, then each rank's trained model and what DDP was told
WRAPPER = """
import json, os, runpy, sys
from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel
example, out = sys.argv[1], sys.argv[3]
sys.argv = sys.argv[1:]
run = runpy.run_path(example, run_name="__main__")
rank, wrapped = os.environ["RANK"], run["trainer"].model_wrapped
state = {k: v.detach().clone().contiguous() for k, v in run["model"].state_dict().items()}
save_file(state, f"{out}/rank-{rank}.safetensors")
report = {"world_size": run["trainer"].args.world_size, "ddp": isinstance(wrapped, DistributedDataParallel)}
report["ignored"] = sorted(getattr(wrapped, "parameters_to_ignore", []))
open(f"{out}/rank-{rank}.json", "w").write(json.dumps(report))
"""

# the same model, a random selection seeded by the rank, prepared once the process group is up; each rank's
# selection and trainable values
DISAGREEING = """
import sys
import torch.distributed as dist
from safetensors.torch import save_file
import usaf
from usaf.prepare import current_selection
from usaf.testing.tiny import tiny_model
dist.init_process_group("gloo")
rank = dist.get_rank()
config = usaf.UsafConfig(density=0.1, selection="random", seed=rank, targets=["experts", "attention", "routers"])
model = usaf.prepare_model(tiny_model("qwen3_moe"), config)
held = {f"selection/{k}": c.indices for k, c in current_selection(model).items()}
held |= {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
save_file(held, f"{sys.argv[1]}/rank-{rank}.safetensors")
dist.barrier()  # rank 0 must not exit while rank 1 still receives (gloo aborts on a closed peer)
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    # CPU ranks: Accelerate's multi-process launcher is torchrun; ACCELERATE_USE_CPU makes Trainer use gloo
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(sys.path),
        "OMP_NUM_THREADS": "1",
        "ACCELERATE_USE_CPU": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }


def accelerate_launch(args: list[str]) -> subprocess.CompletedProcess:
    """`accelerate launch --multi_gpu --num_processes 2 ARGS` on CPU (2 gloo ranks)."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes=2"]
    settings = ["--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no"]
    return subprocess.run(
        [*launch, *settings, f"--main_process_port={_free_port()}", *args],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The example in one process, and under accelerate launch with 2."""
    import runpy

    root = tmp_path_factory.mktemp("trainer_ddp")
    base = make_model_dir(root / "model", "qwen3_moe")
    wrapper = root / "wrapper.py"
    wrapper.write_text(WRAPPER)
    two = accelerate_launch([str(wrapper), str(EXAMPLE), str(base), str(root / "two")])
    assert two.returncode == 0, two.stderr[-4000:]
    argv = sys.argv
    sys.argv = [str(EXAMPLE), str(base), str(root / "one")]
    try:
        # in this process: the imports are paid already
        one = runpy.run_path(str(EXAMPLE), run_name="__main__")
    finally:
        sys.argv = argv
    return base, root, one["model"]


@pytest.mark.slow
def test_two_processes_train_what_one_process_with_twice_the_accumulation_trains(runs):
    base, root, one = runs
    reports = [json.loads((root / "two" / f"rank-{r}.json").read_text()) for r in (0, 1)]
    # DDP really ran (on CPU without ACCELERATE_USE_CPU, the Trainer would train in 2 independent processes)
    assert all(r["world_size"] == 2 and r["ddp"] for r in reports), reports
    ranks = [load_file(str(root / "two" / f"rank-{r}.safetensors")) for r in (0, 1)]
    assert ranks[0].keys() == ranks[1].keys()
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])  # both ranks hold the same model

    before = AutoModelForCausalLM.from_pretrained(base).state_dict()
    trained = one.state_dict()
    assert trained.keys() == ranks[0].keys()
    moved = max((trained[k].float() - before[k].float()).abs().max().item() for k in before)
    assert moved > 1e-3  # the updates are far larger than the tolerance below
    for key, value in trained.items():
        torch.testing.assert_close(ranks[0][key], value, atol=1e-6, rtol=1e-5, msg=key)

    # DDP left the selection's buffers alone (no broadcast before every forward): prepare_model synced them
    assert reports[0]["ignored"] and all(".usaf." in name for name in reports[0]["ignored"])
    assert set(reports[0]["ignored"]) <= {n for n, _ in one.named_buffers()}


def test_only_the_selection_and_the_routers_change_and_the_checkpoint_becomes_a_delta(runs):
    base, root, _ = runs
    rank0 = load_file(str(root / "two" / "rank-0.safetensors"))
    before = AutoModelForCausalLM.from_pretrained(base).state_dict()
    delta = read_delta(root / "two" / "delta.safetensors")  # written by the example from checkpoint-10
    assert delta.info["source"]["step"] == 10
    routers = {k for k in before if k.endswith("mlp.gate.weight")}
    assert routers and routers <= set(delta.changes)
    assert any(".experts." in k for k in delta.changes) and any("self_attn" in k for k in delta.changes)
    for name, original in before.items():
        after = rank0[name]
        change = delta.changes.get(name)
        if name in routers:
            assert change.flat_indices is None and not torch.equal(after, original), name
        changed = (after != original).reshape(-1)
        if change is not None:
            torch.testing.assert_close(
                after.reshape(-1)[change.flat_indices]
                if change.flat_indices is not None
                else after.reshape(-1),
                change.values.to(after.dtype),
                atol=0,
                rtol=0,
            )
            if change.flat_indices is not None:
                changed[change.flat_indices] = False
            else:
                changed[:] = False
        assert not changed.any(), f"{name} changed outside the selection"


@pytest.mark.slow
def test_every_rank_trains_rank_0s_selection(tmp_path):
    """Ranks that would choose differently (a random selection seeded by the rank) all train rank 0's selection
    and values: what one process with rank 0's seed trains."""
    script = tmp_path / "disagreeing.py"
    script.write_text(DISAGREEING)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(script),
            tmp_path,
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-12000:]
    config = usaf.UsafConfig(
        density=0.1, selection="random", seed=0, targets=["experts", "attention", "routers"]
    )
    alone = usaf.prepare_model(tiny_model("qwen3_moe"), config)
    want = {f"selection/{k}": c.indices for k, c in current_selection(alone).items()}
    want |= {n: p.detach() for n, p in alone.named_parameters() if p.requires_grad}
    other = usaf.prepare_model(tiny_model("qwen3_moe"), dataclasses.replace(config, seed=1))
    assert any(  # rank 1 alone would have chosen otherwise
        not torch.equal(c.indices, want[f"selection/{k}"]) for k, c in current_selection(other).items()
    )
    for rank in (0, 1):
        held = load_file(str(tmp_path / f"rank-{rank}.safetensors"))
        assert held.keys() == want.keys()
        assert all(torch.equal(held[k], want[k]) for k in want), rank


def test_prepare_model_refuses_a_launched_job_without_its_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UsafError, match=r"create TrainingArguments .* before prepare_model"):
        usaf.prepare_model(tiny_model("qwen3_moe"))
