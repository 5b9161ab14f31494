"""The expert-parallel prototype (usaf.engine.expert_parallel) on 2 gloo ranks: each rank owns half the experts of
every layer and trains on its own tokens; the logits equal the single-device model's, an expert's value gradients
arise only on the rank that owns it and equal the single-device gradient of both ranks' tokens there, and the other
trained weights' gradients summed over the ranks equal it too."""

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # spawned ranks import this module by name

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(), reason="needs gloo"
)

FAMILIES = ["qwen3_moe", "mixtral"]


def _model(family: str):
    import usaf
    from usaf.testing.tiny import tiny_model

    config = usaf.UsafConfig(
        density=0.2,
        selection="magnitude",
        targets=["experts", "routers", "attention", "embeddings", "lm_head"],
    )
    return usaf.prepare_model(tiny_model(family, seed=1), config)


def _batch(rank: int) -> torch.Tensor:
    return torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(10 + rank))


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss * ids.shape[0]


def _expert_of_entries(model) -> dict[str, torch.Tensor]:
    """For each trained experts tensor's values parameter: the expert of every entry."""
    from usaf.engine.installed import sparse_modules

    found = {}
    for name, state in sparse_modules(model):
        if name.endswith("experts"):
            for tensor, entries in state.items():
                per_expert = entries.shape[1] * entries.shape[2]
                found[f"{name}.usaf.{tensor}.values"] = entries.flat_indices // per_expert
    return found


def _rank(rank: int, port: int, family: str, results: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    from usaf.engine import expert_parallel

    reference, model = _model(family), _model(family)  # both prepared before joining: every expert's entries
    for other in range(2):  # the single-device model sees both ranks' tokens
        _loss(reference, _batch(other)).backward()
    layout = expert_parallel.join(2)
    expert_parallel.enable(model)
    ids = _batch(rank)
    _loss(model, ids).backward()
    owned = layout.owned(expert_parallel.find_moe_layers(model)[0].experts.usaf.num_experts)
    torch.save(
        {
            "logits": model(input_ids=ids).logits.detach(),
            "reference_logits": reference(input_ids=ids).logits.detach(),
            "grads": {n: p.grad for n, p in model.named_parameters() if p.requires_grad},
            "reference": {n: p.grad for n, p in reference.named_parameters() if p.requires_grad},
            "owned": list(owned),
            "expert_of_entries": _expert_of_entries(model),
        },
        f"{results}/{rank}.pt",
    )
    torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_expert_parallel_matches_the_single_device_model(tmp_path, family):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_rank, args=(port, family, str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    assert [r["owned"] for r in ranks] == [[0, 1, 2], [3, 4, 5]]
    for result in ranks:
        torch.testing.assert_close(result["logits"], result["reference_logits"], rtol=1e-5, atol=1e-5)
    reference, expert_of = ranks[0]["reference"], ranks[0]["expert_of_entries"]
    assert len(expert_of) == 4 and any("router" in n or ".gate." in n for n in reference)
    for name, want in reference.items():
        if name in expert_of:  # an expert's value gradients arise only on its owner, whole
            for result in ranks:
                mine = torch.isin(expert_of[name], torch.tensor(result["owned"]))
                assert mine.any() and not mine.all(), name
                torch.testing.assert_close(result["grads"][name][mine], want[mine], rtol=1e-4, atol=1e-6)
                assert torch.equal(result["grads"][name][~mine], torch.zeros_like(want[~mine])), name
        else:  # routers, attention, embeddings: data parallel, summed over the ranks
            summed = ranks[0]["grads"][name] + ranks[1]["grads"][name]
            torch.testing.assert_close(summed, want, rtol=1e-4, atol=1e-6, msg=name)


def test_an_expert_parallel_size_that_does_not_divide_the_experts_is_refused():
    from usaf.engine import expert_parallel
    from usaf.errors import UsafError

    model = _model("qwen3_moe")
    with pytest.raises(UsafError, match=r"needs a layout"):
        expert_parallel.enable(model)
    expert_parallel.set_layout(expert_parallel.ExpertLayout(ep=4, dp=1, ep_rank=0, dp_rank=0))
    try:
        with pytest.raises(UsafError, match=r"expert_parallel=4 must divide .* has 6"):
            expert_parallel.enable(model)
    finally:
        expert_parallel.set_layout(None)
