"""Small on-disk fixtures: a tiny model directory with the char tokenizer, and a tiny task."""

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from usaf.testing.tiny import tiny_model
from usaf.train.tokenizer import char_tokenizer

# the torch.distributed tests run on gloo (CPU)
NEEDS_GLOO = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(), reason="needs gloo"
)


def torchrun(
    args: list[str], script: Path | None = None, nproc: int = 2, **env
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=NPROC -m usaf ARGS` (or the `script` with ARGS), one torch thread
    a process, this process's import path, `env` added."""
    target = [str(script)] if script is not None else ["-m", "usaf"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return subprocess.run(
        [*command, *target, *args],
        capture_output=True,
        text=True,
        env=_env(**{"OMP_NUM_THREADS": "1", **env}),
        timeout=600,
    )


def make_model_dir(folder: Path, family: str = "qwen3_moe", seed: int = 0) -> Path:
    tokenizer = char_tokenizer()
    model = tiny_model(family, seed=seed, vocab_size=len(tokenizer))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_copy_task(path: Path, count: int, seed: int = 0) -> Path:
    """prompt/completion records: copy a short word (a pattern a tiny model picks up in a few steps)."""
    rnd = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            word = "".join(rnd.choice("abcdef") for _ in range(5))
            f.write(json.dumps({"prompt": f"copy {word} ->", "completion": f" {word}"}) + "\n")
    return path


# 0.1.0's default targets: what the tests of the experts engine, routers and selection are about
# a multi-turn chat with a system prompt, shared by the data and chat-template tests
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "and 3+3?"},
    {"role": "assistant", "content": "6"},
]


def supervised(tokenizer, ids, labels) -> list[str]:
    """The decoded runs of consecutive supervised tokens (labels aligned with ids, never shifted)."""
    pieces, run = [], []
    for token, label in zip([*ids, None], [*labels, -100], strict=True):
        if label != -100:
            assert label == token
            run.append(token)
        elif run:
            pieces.append(tokenizer.decode(run))
            run = []
    return pieces


EXPERTS_AND_ROUTERS = ["experts", "routers"]


# settings of a short CPU run on the tiny model (fault and hardening tests)
FAST_RUN = [
    "data.max_seq_len=48",
    "data.batch_size=4",
    "select.density=0.1",
    "log.progress=false",
    "log.tensorboard=false",
    "schedule.warmup_steps=1",
]


# ---- usaf in its own process: killed, or running beside the test ---------------------------------------------------

# `python -c KILLER ARGS...`: usaf's command line, SIGKILLed (no clean-up of any kind) at step KILL_AT_STEP, either
# right after that step's checkpoint is saved (KILL_WHEN=checkpoint) or in the middle of it, after its metrics row
# and before its checkpoint (KILL_WHEN=row)
KILLER = """
import os, signal, sys
import usaf.train.checkpoint as checkpoint
import usaf.train.metrics as metrics
from usaf.cli import main
at, when = int(os.environ["KILL_AT_STEP"]), os.environ.get("KILL_WHEN", "checkpoint")
save, log = checkpoint.save, metrics.MetricsLog.log
def save_then_die(run_dir, step, **kw):
    path = save(run_dir, step, **kw)
    if when == "checkpoint" and step == at:
        os.kill(os.getpid(), signal.SIGKILL)
    return path
def log_then_die(self, step, record, show=None):
    log(self, step, record, show)
    if when == "row" and step == at and "loss" in record:
        os.kill(os.getpid(), signal.SIGKILL)
checkpoint.save, metrics.MetricsLog.log = save_then_die, log_then_die
sys.exit(main(sys.argv[1:]))
"""

CLI = "import sys; from usaf.cli import main; sys.exit(main(sys.argv[1:]))"


def _env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **extra}


def run_killed(args: list[str], kill_at: int, when: str = "checkpoint") -> subprocess.CompletedProcess:
    """`usaf ARGS` in a process SIGKILLed at step `kill_at` (see KILLER)."""
    return subprocess.run(
        [sys.executable, "-c", KILLER, *args],
        capture_output=True,
        text=True,
        env=_env(KILL_AT_STEP=str(kill_at), KILL_WHEN=when),
    )


def start_usaf(args: list[str]) -> subprocess.Popen:
    """`usaf ARGS` running beside the test."""
    return subprocess.Popen(
        [sys.executable, "-c", CLI, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )


def wait_for_rows(proc: subprocess.Popen, path: Path, rows: int, timeout_s: float = 120) -> None:
    """Until `path` (a metrics.jsonl) has `rows` complete lines; fails if `proc` ends first."""
    deadline = time.monotonic() + timeout_s
    while not path.exists() or path.read_text().count("\n") < rows:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)


def losses(run_dir: Path) -> dict[int, float]:
    """{step: loss} of a run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def reselecting_step(model, optimizer, reselector, step: int, ids, reselect: bool = True):
    """One optimizer step on `ids` as usaf's loop runs it with reselection; returns the reselection's report
    (`reselect=False`: the step up to, not including, the reselection that may follow it)."""
    from usaf.testing.steps import training_step

    return training_step(model, optimizer, ids, reselector=reselector, step=step, reselect=reselect)


def copy_sequences(count: int, seed: int = 0) -> list[dict]:
    """Sequences that repeat a random word, all of one length: learnable in a few steps (transformers.Trainer)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        word = torch.randint(8, 20, (5,), generator=g)
        ids = torch.cat([torch.tensor([1]), word, word, word])
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def copy_task_workspace(root: Path, records: int = 60) -> Path:
    """`root` with a tiny model folder (model/) and a copy task (train.jsonl): what the training and command-line
    tests train on."""
    make_model_dir(root / "model")
    write_copy_task(root / "train.jsonl", records)
    return root


def train_config(workspace: Path, settings: list[str], *extra: str):
    """The RunConfig of a run on `workspace` with `settings` and `extra` (key=value each)."""
    from usaf.config import RunConfig

    return RunConfig.load(
        None,
        [f"model.path={workspace / 'model'}", f"data.train={workspace / 'train.jsonl'}", *settings, *extra],
    )


def train_cli_args(workspace: Path, out: Path, settings: list[str], *sets: str) -> list[str]:
    """`usaf train` arguments for a run on `workspace` into `out`, `settings` and `sets` given with --set."""
    args = ["train", f"--model={workspace / 'model'}", f"--data={workspace / 'train.jsonl'}", f"--out={out}"]
    return [*args, *(f"--set={s}" for s in [*settings, *sets])]


# a stand-in for llama.cpp's convert_hf_to_gguf.py, with its command line: it records what it was given and the
# merged checkpoint's digest (a file `mode` beside it says "fail" or "junk" to misbehave)
FAKE_CONVERTER = """
import hashlib, json, sys
from pathlib import Path
args = sys.argv[1:]
merged, out, outtype = Path(args[0]), args[args.index("--outfile") + 1], args[args.index("--outtype") + 1]
mode = Path(__file__).with_name("mode").read_text() if Path(__file__).with_name("mode").exists() else "ok"
if mode == "fail":
    print("INFO: loading model", file=sys.stderr)
    print("NotImplementedError: Architecture 'Qwen3MoeForCausalLM' not supported!", file=sys.stderr)
    sys.exit(1)
digest = hashlib.sha256((merged / "model.safetensors").read_bytes()).hexdigest()
Path(__file__).with_name("seen.json").write_text(json.dumps({"merged": str(merged), "outtype": outtype,
    "digest": digest, "config": (merged / "config.json").is_file(), "name": args[args.index("--model-name") + 1]}))
Path(out).write_bytes((b"NOPE" if mode == "junk" else b"GGUF") + digest.encode())
"""


# a stand-in for llama.cpp's llama-quantize (INPUT OUTPUT TYPE): writes a GGUF naming the type and the input's bytes
FAKE_QUANTIZE = """
import sys
from pathlib import Path
source, out, kind = sys.argv[1:4]
Path(out).write_bytes(b"GGUF" + kind.encode() + b":" + Path(source).read_bytes())
"""


def fake_llama_cpp(folder: Path, quantize: bool = False) -> Path:
    """A llama.cpp folder whose converter is FAKE_CONVERTER (no network in tests), with FAKE_QUANTIZE built where
    llama.cpp's cmake build puts it if `quantize`."""
    folder.mkdir(parents=True)
    (folder / "convert_hf_to_gguf.py").write_text(FAKE_CONVERTER)
    if quantize:
        tool = folder / "build" / "bin" / "llama-quantize"
        tool.parent.mkdir(parents=True)
        tool.write_text(f"#!{sys.executable}\n{FAKE_QUANTIZE}")
        tool.chmod(0o755)
    return folder


def plans_by_objective(objectives: list[str], tmp_path: Path, capsys) -> tuple[dict[str, str], int]:
    """`usaf plan` of the OLMoE example config on a 12 GB card, once per objective: {objective: its output}, and
    the example's data.batch_size."""
    import yaml

    from usaf.cli import main

    example = Path(__file__).resolve().parents[1] / "examples" / "configs" / "olmoe-1b-7b.yaml"
    config = yaml.safe_load(example.read_text())
    shown = {}
    for objective in objectives:
        path = tmp_path / f"{objective}.yaml"
        path.write_text(
            yaml.safe_dump({**config, "train": {**config.get("train", {}), "objective": objective}})
        )
        assert main(["plan", "--config", str(path), "--device", "rtx-3060-12gb", "--ram", "32GB"]) == 0
        shown[objective] = capsys.readouterr().out
    return shown, config["data"]["batch_size"]
