"""usaf.testing.launches counts what it says, and a usaf step's launches per layer (issue 22): the same whatever the
number of experts, in fp32 and bf16, and at most two host syncs (the routing counts' one read per layer)."""

from functools import cache

import pytest
import torch

import usaf
from usaf.testing.launches import count_launches, per_layer
from usaf.testing.tiny import tiny_model


def test_counts_a_hand_written_function():
    a = torch.ones(3)

    def fn():
        b = a + 1
        b = b + a
        b = b.add(2)
        return b.tolist()

    for method in ("profiler", "dispatch"):
        counts = count_launches(fn, method)
        assert (counts.ops, counts.syncs) == (3, 1), (method, counts)
        assert counts.names == {"aten::add": 3}
        assert [site.rsplit(" ", 1)[1] for site in counts.sync_sites] == ["(tolist)"]


def test_counts_every_host_read_once_and_ops_without_their_children():
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(2, 3)

    def fn():
        loss = torch.nn.functional.linear(x, w).sum()
        loss.backward()
        loss = loss.detach()
        int(loss), bool(loss > 0), float(loss), loss.item()  # four reads; bool calls item: still one
        x.to("cpu"), x.cpu(), x.to(torch.float64)  # two copies to the host; a dtype change is none

    counts = count_launches(fn)
    assert counts.syncs == 6, counts.sync_sites
    # linear counts once, its children (t, addmm) not
    assert counts.names["aten::linear"] == 1 and "aten::addmm" not in counts.names
    assert "aten::item" not in counts.names  # a host read's own ops are the sync, not launches


def test_reads_of_what_stays_on_the_host_on_a_gpu_are_not_syncs():
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    optimizer = torch.optim.AdamW([param])
    optimizer.step()
    counts = count_launches(optimizer.step)  # reads its host-side step counter
    assert counts.syncs == 0 and counts.cpu_only_syncs >= 1, counts
    step = torch.ones((), dtype=torch.int64)  # on a GPU run, a CPU tensor's read is not a sync
    assert count_launches(step.item, device="cuda").syncs == 0
    assert count_launches(step.item).syncs == 1


@cache
def _per_layer(experts: int, dtype: torch.dtype = torch.float32):
    ids = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(0))

    def make(layers: int):
        model = tiny_model("qwen3_moe", dtype=dtype, num_experts=experts, num_hidden_layers=layers)
        usaf.prepare_model(model, usaf.UsafConfig(density=0.05, selection="random"))
        model.train()
        optimizer = usaf.CompactAdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

        def step():
            usaf.causal_lm_loss(model, ids, ids).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    return per_layer(make)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ops_per_layer_do_not_grow_with_the_number_of_experts(dtype):
    few, many = _per_layer(4, dtype), _per_layer(16, dtype)
    assert many.ops == few.ops, (few.ops, many.ops, (many - few).top())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_at_most_two_host_syncs_per_layer(dtype):
    counts = _per_layer(16, dtype)
    assert counts.syncs <= 2, counts.sync_sites
