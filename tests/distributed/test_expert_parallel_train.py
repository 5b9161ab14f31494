"""Expert parallelism in `usaf train` (issue 37): torchrun jobs on gloo against one process.

A tiny Qwen3-MoE-shaped model with 16 experts (NF4 store) and a published MXFP4 gpt-oss with 8 experts. EP = 2 with
accumulation 2, EP = 4 and EP 2 x DP 2 with accumulation 1 each train what one process with accumulation 4 trains:
the same selection (and reselection, from probes each rank holds for its own experts) bit for bit, per-step losses and exported deltas within float reassociation
(the expert outputs are summed per token in another order), and each rank holds 1/EP of the experts' bytes.
"""

import json
from pathlib import Path

import pytest
import torch
from helpers import NEEDS_GLOO, char_tokenizer, losses, torchrun, write_copy_task
from safetensors.torch import load_file

from usaf.base.load import load_prepared
from usaf.base.writer import ensure_prepared
from usaf.cli import main
from usaf.config import UsafConfig
from usaf.engine import expert_parallel
from usaf.testing.published import make_mxfp4_gpt_oss
from usaf.testing.tiny import tiny_model

pytestmark = NEEDS_GLOO

SETTINGS = [
    "data.max_seq_len=48",
    "data.batch_size=2",
    "select.density=0.1",
    "select.targets=[experts,routers,attention,embeddings,lm_head]",
    # the reselection is the job's (each rank probes its own experts' candidates, per source rank; the decision is
    # gathered), at step 3; its probe window (2 steps) opens at step 2, so step 2's checkpoint holds the probes
    "select.reselect_every=3",
    "select.reselect_until=1.0",
    "optim.lr=0.01",
    "log.progress=false",
    "log.tensorboard=false",
    "schedule.warmup_steps=1",
    "schedule.max_steps=4",
    "checkpoint.every_steps=4",
    "train.seed=3",
]
MICRO_BATCHES = 4  # per optimizer step, over all ranks


def _train(root: Path, model: Path, out: str, ranks: int = 1, ep: int = 1, *sets: str) -> Path:
    args = [
        "train",
        f"--model={model}",
        f"--data={root / 'train.jsonl'}",
        f"--out={root / out}",
        *[f"--set={s}" for s in SETTINGS],
        f"--set=schedule.grad_accum={MICRO_BATCHES // ranks}",
        f"--set=distributed.expert_parallel={ep}",
        *[f"--set={s}" for s in sets],
    ]
    if ranks == 1:
        assert main(args) == 0
    else:
        done = torchrun(args, nproc=ranks)
        assert done.returncode == 0, done.stderr[-3000:]
    assert main(["export", str(root / out), "--delta", str(root / f"{out}.delta.safetensors")]) == 0
    return root / out


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep-qwen")
    tokenizer = char_tokenizer()
    model = tiny_model("qwen3_moe", seed=0, vocab_size=len(tokenizer), num_experts=16)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    write_copy_task(root / "train.jsonl", 80)
    made = {"one": 1, "ep2": 2, "ep4": 4, "ep2dp2": 4}
    ep_of = {"one": 1, "ep2": 2, "ep4": 4, "ep2dp2": 2}
    return {
        name: _train(root, root / "model", name, n, ep_of[name], "model.quant=nf4")
        for name, n in made.items()
    }


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep-mxfp4")
    make_mxfp4_gpt_oss(root / "model", num_experts=8)
    write_copy_task(root / "train.jsonl", 80)
    return {
        "one": _train(root, root / "model", "one"),
        "ep2": _train(root, root / "model", "ep2", ranks=2, ep=2),
    }


def _reselected(run: Path) -> dict[int, int]:
    """{step: entries reselected} of a run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["reselected_entries"] for r in rows if "reselected_entries" in r}


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def _delta(run: Path) -> dict[str, torch.Tensor]:
    return load_file(f"{run}.delta.safetensors")


def _whole_expert_bytes(run: Path, quant: str) -> int:
    """The frozen expert bytes one process holds: its prepared store (from the cache the runs filled), loaded."""
    store = ensure_prepared(run.parent / "model", quant)
    return expert_parallel.frozen_expert_bytes(load_prepared(store, config=UsafConfig(selection="random")))


def _check_against_one_process(runs: dict, ep_of: dict, quant: str) -> None:
    one = runs["one"]
    reference, reference_delta = losses(one), _delta(one)
    whole = _whole_expert_bytes(one, quant)
    assert whole > 0
    for name, ep in ep_of.items():
        run = runs[name]
        # the selection and every reselection: bit for bit
        a, b = load_file(str(one / "selection.safetensors")), load_file(str(run / "selection.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
        assert _reselected(run) == _reselected(one) and _reselected(one)[3] > 0, name
        got = losses(run)
        assert got.keys() == reference.keys() == {1, 2, 3, 4}, name
        for step, loss in reference.items():
            assert abs(got[step] - loss) <= 1e-5 * abs(loss), (name, step, got[step], loss)
        delta = _delta(run)
        assert delta.keys() == reference_delta.keys(), name
        values = [k for k, v in reference_delta.items() if v.is_floating_point()]
        for key in set(reference_delta) - set(values):  # where the entries are: bit for bit
            assert torch.equal(delta[key], reference_delta[key]), (name, key)
        # values: float reassociation, which may flip a bf16 moment's stochastic rounding (the noise itself is the
        # one-process noise): every value within 1e-4, all but one in a thousand within 1e-6
        apart = torch.cat([(delta[k].float() - reference_delta[k].float()).abs().reshape(-1) for k in values])
        assert float(apart.max()) <= 1e-4 and int((apart > 1e-6).sum()) <= apart.numel() // 1000, (
            name,
            float(apart.max()),
            int((apart > 1e-6).sum()),
        )
        ranks = _summary(run)["ranks"]
        # each rank holds 1/EP of the experts' bytes
        assert [r["frozen_expert_bytes"] for r in ranks] == [whole // ep] * len(ranks), (name, ranks, whole)
        assert whole % ep == 0


def test_expert_parallel_jobs_train_what_one_process_trains(qwen):
    _check_against_one_process(qwen, {"ep2": 2, "ep4": 4, "ep2dp2": 2}, "nf4")
    # the job's trained expert entries, not rank 0's share
    assert _summary(qwen["ep4"])["trained_expert_entries"] == _summary(qwen["one"])["trained_expert_entries"]


def test_expert_parallel_on_a_published_mxfp4_checkpoint(mxfp4):
    _check_against_one_process(mxfp4, {"ep2": 2}, "mxfp4")


def test_a_rank_that_dies_stops_the_job_and_the_run_resumes_exactly_at_its_layout(qwen):
    """Rank 1 of an EP 2 job dies at the start of step 3 (the test hook of tests/distributed/test_rank_faults.py),
    the reselection's step, inside its probe window: the job ends in one line per rank left; the resume reads each
    rank's shard (its experts' entries and probes) and ends where the uninterrupted EP 2 run ended, bit for bit."""
    root, run = qwen["ep2"].parent, qwen["ep2"].parent / "killed"
    args = [
        "train",
        f"--model={root / 'model'}",
        f"--data={root / 'train.jsonl'}",
        f"--out={run}",
        *[f"--set={s}" for s in SETTINGS],
        f"--set=schedule.grad_accum={MICRO_BATCHES // 2}",
        "--set=distributed.expert_parallel=2",
        "--set=model.quant=nf4",
        "--set=checkpoint.every_steps=1",
    ]
    died = torchrun(args, USAF_TEST_DIE_AT_STEP="3@1")
    assert died.returncode != 0
    said = [line for line in died.stderr.splitlines() if line.startswith("usaf: error:")]
    assert len(said) == 1 and "--resume" in said[0], died.stderr[-2000:]
    saved = run / "checkpoints" / "step-00000002"
    shards = sorted(p.name for p in saved.glob("*-ep*-of-2.safetensors"))
    kinds = ("extra", "optimizer", "trainable")
    assert shards == [f"{kind}-ep{e}-of-2.safetensors" for kind in kinds for e in (0, 1)]
    # each rank's probes of its experts' candidates are in its shard, none in the replicated extra file
    for e in (0, 1):
        probes = load_file(str(saved / f"extra-ep{e}-of-2.safetensors"))
        assert any(k.endswith("/lines") and v.numel() for k, v in probes.items()), (e, sorted(probes))
    assert not [k for k in load_file(str(saved / "extra.safetensors")) if ".experts/" in k]
    resumed = torchrun(["train", f"--resume={run}"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert losses(run) == losses(qwen["ep2"])
    assert main(["export", str(run), "--delta", str(root / "killed.delta.safetensors")]) == 0
    straight, again = _delta(qwen["ep2"]), load_file(str(root / "killed.delta.safetensors"))
    assert straight.keys() == again.keys() and all(torch.equal(straight[k], again[k]) for k in straight)
