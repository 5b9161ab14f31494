"""A rank that dies (issue 37, faults): under torchrun, rank 1 ends as a crashed GPU process does (os._exit at the
start of a step, the USAF_TEST_DIE_AT_STEP hook); the job stops on every rank in bounded time, the rank left says
so in one line (no traceback), and `usaf train --resume` finishes the run bit for bit as if it had never stopped.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import NEEDS_GLOO, losses, make_model_dir, write_copy_task
from safetensors.torch import load_file

from usaf.train import distributed

pytestmark = NEEDS_GLOO

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
    "distributed.timeout_s=30",  # a rank that hung instead of dying would stop the job after this
]
# from rank 1's death to the job's end: about 2 s measured, under the timeout above and torchrun's 30 s before SIGKILL
BOUND_S = 25


def torchrun(args: list[str], **env) -> subprocess.Popen:
    """`torchrun --standalone --nproc_per_node=2 -m usaf ARGS`, started."""
    return subprocess.Popen(
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
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1", **env},
    )


def finished(job: subprocess.Popen) -> tuple[int, str]:
    """The job's exit status and standard error, once it has ended (within 5 minutes)."""
    _, err = job.communicate(timeout=300)
    return job.returncode, err


def wait_for_step(job: subprocess.Popen, run, step: int) -> None:
    """Until rank 0 has logged `step` (rank 1 dies as it starts the next one); fails if the job ends first."""
    metrics = run / "metrics.jsonl"

    def logged() -> bool:
        return metrics.exists() and f'{{"step": {step}, "loss"' in metrics.read_text()

    while not logged():
        assert job.poll() is None or logged(), job.communicate()
        time.sleep(0.05)


def test_a_dead_rank_stops_the_job_in_one_line_and_the_run_resumes_exactly(tmp_path):
    make_model_dir(tmp_path / "model")
    write_copy_task(tmp_path / "train.jsonl", 80)
    common = [
        f"--model={tmp_path / 'model'}",
        f"--data={tmp_path / 'train.jsonl'}",
        *[f"--set={s}" for s in SETTINGS],
    ]
    # beside the one that dies, with a datasets cache of its own (two jobs building one entry at once collide)
    straight = torchrun(
        ["train", *common, f"--out={tmp_path / 'straight'}"], HF_DATASETS_CACHE=str(tmp_path / "cache")
    )
    run = tmp_path / "died"
    dying = torchrun(["train", *common, f"--out={run}"], USAF_TEST_DIE_AT_STEP="3@1")
    wait_for_step(dying, run, 2)
    died_at = time.monotonic()
    rc, err = finished(dying)
    seconds = time.monotonic() - died_at
    assert rc != 0 and seconds < BOUND_S, (seconds, err[-3000:])
    said = [line for line in err.splitlines() if line.startswith(("usaf: error", "usaf: interrupted"))]
    assert len(said) == 1, err  # rank 0's line; rank 1 died without a word, as a crashed process does
    assert said[0].startswith("usaf: error: rank 0 of 2 stopped: all_reduce") and (
        f"Resume with usaf train --resume {run} " in said[0]
    ), said
    frames = [line for line in err.splitlines() if 'File "' in line]
    assert not any(f"{os.sep}usaf{os.sep}" in line for line in frames), err  # torchrun's own report only
    saved = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert saved[-1] in ("step-00000001", "step-00000002") and saved[-1] in said[0], saved

    rc, err = finished(torchrun(["train", f"--resume={run}"]))
    assert rc == 0, err[-3000:]
    rc, err = finished(straight)
    assert rc == 0, err[-3000:]
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


# the command's process (usaf.startup acts on a program named usaf) after the command ended, as torchrun's SIGTERM
# finds a rank that has just said its one line and is shutting down
_ENDED_THEN_SIGTERM = """
import os, signal, sys
from usaf.cli import main
code = main([])  # the help; the command has ended
os.kill(os.getpid(), signal.SIGTERM)
sys.exit(code)
"""


def test_a_signal_after_the_command_ended_ends_it_quietly(tmp_path):
    script = tmp_path / "usaf"
    script.write_text(_ENDED_THEN_SIGTERM)
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        timeout=120,
    )
    assert done.returncode == 128 + signal.SIGTERM and done.stderr == "", done.stderr
    assert done.stdout.startswith("usage: usaf")  # the help was printed
