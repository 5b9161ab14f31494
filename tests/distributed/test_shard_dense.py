"""distributed.shard_dense (issue 37): FSDP2 shards the frozen dense weights of a torchrun job over its ranks.

2 gloo ranks on the tiny model, with every kind of trained weight (experts, routers, attention, embeddings, the
output layer, norms) and reselection, data parallel and expert parallel (EP 2): sharded, the job trains bit for bit
what the same job trains with the dense weights whole on every rank, and each rank holds half of the frozen
parameters' bytes (under EP the experts live in its store, already 1/2, and are not parameters).
"""

import json

import pytest
import torch
from helpers import NEEDS_GLOO, losses, make_model_dir, torchrun, write_copy_task
from safetensors.torch import load_file

pytestmark = NEEDS_GLOO

SETTINGS = [
    "data.max_seq_len=48",
    "data.batch_size=2",
    "select.density=0.1",
    "select.targets=[experts,routers,attention,embeddings,lm_head,norms]",
    "optim.lr=0.01",
    "log.progress=false",
    "log.tensorboard=false",
    "schedule.warmup_steps=1",
    "schedule.max_steps=3",
    "checkpoint.every_steps=3",
    # without recomputation, the backward's input gradients read the weights gathered afresh for it, where the
    # trained entries must be written again (a recomputed forward writes them itself)
    "train.recompute=false",
    "select.reselect_every=2",  # reselection reads base values of new entries from the sharded weights
    "train.seed=3",
]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("shard-dense")
    make_model_dir(root / "model")
    write_copy_task(root / "train.jsonl", 40)
    return root


def _job(root, out: str, ep: int, shard: bool):
    args = [
        "train",
        f"--model={root / 'model'}",
        f"--data={root / 'train.jsonl'}",
        f"--out={root / out}",
        *[f"--set={s}" for s in SETTINGS],
        f"--set=distributed.expert_parallel={ep}",
        f"--set=distributed.shard_dense={str(shard).lower()}",
    ]
    done = torchrun(args)
    assert done.returncode == 0, done.stderr[-3000:]
    run = root / out
    summary = json.loads((run / "summary.json").read_text())
    return run, done.stdout, summary["ranks"]


def _trained(run) -> dict[str, torch.Tensor]:
    """The final checkpoint's trained values and selections (under EP, every rank's shard)."""
    found = {}
    for path in sorted((run / "checkpoints" / "step-00000003").glob("trainable*.safetensors")):
        found.update({f"{path.name}:{k}": v for k, v in load_file(str(path)).items()})
    return found


@pytest.mark.parametrize("ep", [1, 2])
def test_sharded_dense_weights_train_what_whole_ones_train_on_half_the_bytes(root, ep):
    whole, _, whole_ranks = _job(root, f"whole-{ep}", ep, shard=False)
    sharded, said, sharded_ranks = _job(root, f"sharded-{ep}", ep, shard=True)
    assert "shard_dense: on (distributed.shard_dense=true)" in said

    a, b = losses(whole), losses(sharded)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    assert all(abs(a[s] - b[s]) <= 1e-6 * abs(a[s]) for s in a), (a, b)
    x, y = _trained(whole), _trained(sharded)
    assert x.keys() == y.keys() and any(".norm." in k or "layernorm" in k for k in x)
    for key in x:
        torch.testing.assert_close(y[key], x[key], rtol=1e-6, atol=0, msg=key)
    full = whole_ranks[0]["frozen_parameter_bytes"]
    assert [r["frozen_parameter_bytes"] for r in whole_ranks] == [full, full]
    for rank in sharded_ranks:  # half of each weight, rounded up to whole rows
        assert 0.5 * full <= rank["frozen_parameter_bytes"] <= 0.52 * full, (rank, full)
