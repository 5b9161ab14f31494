"""transformers.Trainer under `accelerate launch` with 2 processes (DDP, gloo on the CPU; issue 13 item 4): a prepared
model trains what one process with twice the accumulation trains, changes only its selection and routers, and its
checkpoint becomes a usaf delta. The run itself is tests/scripts/trainer_ddp.py."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import make_model_dir
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import usaf
from usaf.export.delta import read_delta

SCRIPT = Path(__file__).parent / "scripts" / "trainer_ddp.py"

pytestmark = pytest.mark.skipif(
    shutil.which("accelerate", path=os.path.dirname(sys.executable)) is None
    or not torch.distributed.is_gloo_available(),
    reason="needs accelerate and gloo",
)


def _run(command: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer-accelerate")
    base = make_model_dir(root / "base", "mixtral")
    # one process, 2 micro-batches of 8 a step; two processes under accelerate, one micro-batch of 8 each
    _run([sys.executable, str(SCRIPT), str(base), str(root / "one"), "8", "2"])
    accelerate = str(Path(sys.executable).parent / "accelerate")
    launch = "launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no"
    _run([accelerate, *launch.split(), str(SCRIPT), str(base), str(root / "two"), "8", "1"])
    return root, base


def test_two_processes_train_what_one_process_with_twice_the_accumulation_trains(runs):
    root, _ = runs
    one, two = (json.loads((root / r / "losses.json").read_text()) for r in ("one", "two"))
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert one["losses"][-1] < one["losses"][0]
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5)
    alone = load_file(root / "one" / "trained-rank0.safetensors")
    ranks = [load_file(root / "two" / f"trained-rank{r}.safetensors") for r in range(2)]
    assert sorted(ranks[0]) == sorted(ranks[1]) == sorted(alone)
    assert any(":values" not in name and ":flat_indices" not in name for name in alone)  # the routers too
    for name, tensor in alone.items():
        assert torch.equal(ranks[0][name], ranks[1][name]), name  # DDP keeps the ranks identical
        if name.endswith(":flat_indices"):
            assert torch.equal(ranks[0][name], tensor), name  # one selection, whatever the world size
        else:
            torch.testing.assert_close(ranks[0][name], tensor, rtol=1e-4, atol=1e-6, msg=name)


def test_the_two_process_checkpoint_changes_only_the_selection_and_routers_and_becomes_a_delta(runs):
    root, base = runs
    trained = load_file(root / "two" / "trained-rank0.safetensors")
    before = AutoModelForCausalLM.from_pretrained(base).state_dict()
    after = AutoModelForCausalLM.from_pretrained(root / "two" / "checkpoint-4").state_dict()
    moved = 0
    for name, weight in after.items():
        changed = (weight != before[name]).reshape(-1)
        if name in trained:  # a router, trained whole
            moved += int(changed.sum())
            continue
        if f"{name}:flat_indices" in trained:
            moved += int(changed.sum())
            changed[trained[f"{name}:flat_indices"]] = False
        assert not changed.any(), f"{name} changed outside the selection"
    assert moved > 0

    delta = read_delta(root / "two" / "delta.safetensors")
    assert delta.info["source"]["step"] == 4
    plain = usaf.load_delta(AutoModelForCausalLM.from_pretrained(base), root / "two" / "delta.safetensors")
    ids = torch.randint(8, 20, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(root / "two" / "checkpoint-4")(input_ids=ids).logits
        torch.testing.assert_close(plain(input_ids=ids).logits, want, atol=2e-5, rtol=1e-5)
