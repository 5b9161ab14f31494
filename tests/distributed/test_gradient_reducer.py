"""The overlapped gradient all-reduce (usaf.train.distributed.GradientReducer) on 2 gloo ranks: buckets leave
during the backward, the sums equal the synchronous all-reduce's, a parameter unused on one rank or on every rank
is handled as in one process, and a gradient changed after its bucket left is summed again, not lost."""

import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # spawned ranks import this module by name

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(), reason="needs gloo"
)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        # defined first, so they share the last bucket (buckets run in reverse order of definition)
        self.rank1_only = nn.Parameter(torch.randn(16))  # used on rank 1 only
        self.unused = nn.Parameter(torch.randn(16))  # used nowhere: keeps no gradient, as in one process
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))  # a bucket each
        self.frozen = nn.Parameter(torch.randn(16), requires_grad=False)

    def forward(self, x, rank):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if rank == 1:
            x = x * self.rank1_only
        return (x + self.frozen).square().sum()


def _backward(model, rank, micro_batches, reducer=None):
    for index in range(micro_batches):
        if reducer is not None and index == micro_batches - 1:
            reducer.arm()
        torch.manual_seed(100 * rank + index)
        model(torch.randn(8, 16), rank).backward()


def _rank(rank: int, port: int, results: str, touch_after_send: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    from usaf.train import distributed

    distributed.BUCKET_BYTES = 16 * 17 * 4  # one linear layer a bucket: several buckets, sent one by one
    model, reference = Net(), Net()
    reducer = distributed.GradientReducer([p for p in model.parameters() if p.requires_grad])
    if touch_after_send and rank == 0:
        # a gradient changed after its bucket left: when the first layer's weight completes, the last layer's bias
        # (whose bucket backward completed first) gets +1; the reducer must notice and sum again on every rank
        for net in (model, reference):

            def touch(param, net=net) -> None:
                net.layers[3].bias.grad.add_(1.0)

            net.layers[0].weight.register_post_accumulate_grad_hook(touch)
    _backward(reference, rank, 2)
    distributed.all_reduce_gradients(reference)
    _backward(model, rank, 2, reducer)
    sent_during_backward = len(reducer.sent)
    reducer.finish()
    torch.save(
        {
            "buckets": len(reducer.buckets),
            "sent_during_backward": sent_during_backward,
            "grads": {n: p.grad for n, p in model.named_parameters()},
            "reference": {n: p.grad for n, p in reference.named_parameters()},
        },
        f"{results}/{rank}.pt",
    )
    torch.distributed.destroy_process_group()
    # results are on disk: leave without the interpreter's teardown, where gloo's background threads were now and
    # then destroyed unjoined (SIGABRT, "terminate called without an active exception") after the test's work was done
    os._exit(0)


def _run(tmp_path, touch_after_send: bool) -> list[dict]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_rank, args=(port, str(tmp_path), touch_after_send), nprocs=2)
    return [torch.load(tmp_path / f"{r}.pt") for r in range(2)]


@pytest.mark.parametrize("touch_after_send", [False, True], ids=["overlapped", "gradient-changed-after-send"])
def test_overlapped_all_reduce_equals_the_synchronous_one(tmp_path, touch_after_send):
    ranks = _run(tmp_path, touch_after_send)
    for result in ranks:
        assert result["buckets"] >= 5
        # all but the buckets of parameters that no hook reaches on every rank left during the backward
        assert result["sent_during_backward"] >= 4
        for name, reference in result["reference"].items():
            if name in ("unused", "frozen"):
                assert result["grads"][name] is None and reference is None, name
                continue
            torch.testing.assert_close(result["grads"][name], reference, rtol=0, atol=0, msg=name)
    # rank 0 never used rank1_only: it holds rank 1's gradient, summed, as every rank does
    assert torch.equal(ranks[0]["grads"]["rank1_only"], ranks[1]["grads"]["rank1_only"])
