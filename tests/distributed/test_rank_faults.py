"""A rank that dies (issue 37, faults): under torchrun, rank 1 ends as a crashed GPU process does (os._exit at the
start of a step, the USAF_TEST_DIE_AT_STEP hook); the job stops on every rank in bounded time, the rank left says
so in one line (no traceback), and `usaf train --resume` finishes the run bit for bit as if it had never stopped.
"""

import os
import subprocess
import sys
import time

import pytest
import torch
from helpers import losses, make_model_dir, write_copy_task
from safetensors.torch import load_file

from usaf.train import distributed

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(), reason="needs gloo"
)

SETTINGS = [
    "data.max_seq_len=48",
    "data.batch_size=4",
    "select.density=0.1",
    "select.targets=[experts,attention,lm_head]",
    "optim.lr=0.01",
    "log.progress=false",
    "log.tensorboard=false",
    "schedule.warmup_steps=1",
    "schedule.max_steps=4",
    "checkpoint.every_steps=1",
    "checkpoint.keep_last=0",
    "train.seed=5",
    "distributed.timeout_s=20",  # a rank that hung instead of dying would stop the job after this
]
BOUND_S = 60  # the dead job, start to end (starting and loading take most of it)


def torchrun(args: list[str], **env) -> tuple[subprocess.CompletedProcess, float]:
    """`torchrun --standalone --nproc_per_node=2 -m usaf ARGS`, and its wall time."""
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "usaf",
            *args,
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1", **env},
        timeout=BOUND_S + 60,
    )
    return done, time.monotonic() - started


def test_a_dead_rank_stops_the_job_in_one_line_and_the_run_resumes_exactly(tmp_path):
    make_model_dir(tmp_path / "model")
    write_copy_task(tmp_path / "train.jsonl", 80)
    common = [
        f"--model={tmp_path / 'model'}",
        f"--data={tmp_path / 'train.jsonl'}",
        *[f"--set={s}" for s in SETTINGS],
    ]
    straight, _ = torchrun(["train", *common, f"--out={tmp_path / 'straight'}"])
    assert straight.returncode == 0, straight.stderr[-3000:]

    run = tmp_path / "died"
    died, seconds = torchrun(["train", *common, f"--out={run}"], USAF_TEST_DIE_AT_STEP="3@1")
    assert died.returncode != 0 and seconds < BOUND_S, (seconds, died.stderr[-3000:])
    said = [line for line in died.stderr.splitlines() if line.startswith("usaf:")]
    assert len(said) == 1, died.stderr  # rank 0's line; rank 1 died without a word, as a crashed process does
    assert said[0].startswith("usaf: error: rank 0 of 2 stopped: all_reduce") and (
        f"Resume with usaf train --resume {run} " in said[0]
    ), said
    frames = [line for line in died.stderr.splitlines() if line.lstrip().startswith("File ")]
    assert not any(f"{os.sep}usaf{os.sep}" in line for line in frames), (
        died.stderr
    )  # torchrun's own report only
    saved = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert saved[-1] in ("step-00000001", "step-00000002") and saved[-1] in said[0], saved

    resumed, _ = torchrun(["train", f"--resume={run}"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert losses(run) == losses(tmp_path / "straight") and sorted(losses(run)) == [1, 2, 3, 4]
    final = "checkpoints/step-00000004/trainable.safetensors"
    a, b = load_file(str(tmp_path / "straight" / final)), load_file(str(run / final))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


GLOO_SAID = (
    "[/src/gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:41234. This is typically caused by "
    "a remote worker crashing."
)


def _in_usaf(module: str, call) -> None:
    """`call()` from a function `go` of a file that looks like usaf's `module` to a traceback."""
    path = os.sep + os.path.join("site-packages", *module.split(".")) + ".py"
    scope = {}
    exec(compile("def go(call):\n    call()\n", path, "exec"), scope)
    scope["go"](call)


def _gloo_all_reduce() -> None:
    try:
        torch.distributed.all_reduce(torch.zeros(1))  # no process group: raises inside distributed_c10d
    except ValueError as err:  # as gloo raises when the peer has gone, from the same place
        raise RuntimeError(GLOO_SAID).with_traceback(err.__traceback__) from None


def _raised(call) -> BaseException:
    with pytest.raises(BaseException) as caught:
        call()
    return caught.value


def test_only_the_jobs_communication_failing_is_a_peer_failure(monkeypatch):
    in_stop = _raised(lambda: _in_usaf("usaf.train.stop", _gloo_all_reduce))
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert distributed.peer_failure(in_stop) is None  # one process: no job to lose
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert distributed.peer_failure(in_stop) == (
        "all_reduce (in usaf.train.stop) failed: Connection closed by peer [10.0.0.2]:41234"
    )

    def wait():
        raise RuntimeError("Timed out waiting 5000ms for recv operation to complete")

    awaited = _raised(lambda: _in_usaf("usaf.train.distributed", wait))
    assert distributed.peer_failure(awaited) == (
        "a collective waited on in usaf.train.distributed.go failed: Timed out waiting 5000ms for recv operation "
        "to complete"
    )
    watchdog = torch.distributed.DistBackendError("Watchdog caught collective operation timeout")
    assert distributed.peer_failure(watchdog).endswith("failed: Watchdog caught collective operation timeout")
    assert distributed.peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    assert distributed.peer_failure(ValueError("Connection closed by peer")) is None
