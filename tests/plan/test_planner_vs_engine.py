"""The planner's ledger against what the engine allocates, component by component, on a tiny MoE trained two steps on
the CPU: the plan is `usaf plan --config`'s (`settings_for_run`, `plan`) of the same run configuration.

Exact where the rule is exact (the bytes of the trained state, the workspace's chunks, the decay centres); the
optimizer's buckets are a bound (the ledger plans the largest a bucket may be, the greedy fill stops short of it).
Tensors per weight rather than per entry (a selection's E + 1 expert offsets, the step counters) are left out, as
the ledger leaves them out. Activations have no rule of the engine's own (`usaf.engine.costs`): not compared here.
"""

from pathlib import Path

import pytest
import torch

import usaf
from usaf import planner
from usaf.base.load import load_prepared
from usaf.base.writer import prepare_store
from usaf.config import RunConfig
from usaf.engine import costs
from usaf.engine.installed import sparse_modules
from usaf.planner.shape import load_model_config
from usaf.store.quantized import QuantizedStore
from usaf.testing.tiny import tiny_model
from usaf.train.optim import CompactAdamW, build_optimizer, router_params

SEQ, BATCH = 16, 2
DEVICE = planner.DEVICES["rtx-3090"]  # a GPU's ledger: it has the optimizer step's line too


def _run_config(model_dir: Path, density: float = 1 / 8, **select) -> RunConfig:
    return RunConfig.from_dict(
        {
            "model": {"path": str(model_dir)},
            "data": {"max_seq_len": SEQ, "batch_size": BATCH},
            # uniform at 1/2^k: every targeted tensor's share is a whole number of entries, as the ledger counts
            "select": {"density": density, "strategy": "uniform", "selection": "random", **select},
            "optim": {"decay_to_base": 1.0},
        }
    )


def _ledger(config: RunConfig) -> dict[str, planner.LedgerLine]:
    shape = planner.model_shape(load_model_config(config.model.path)[1], "tiny")
    plan = planner.plan(shape, planner.settings_for_run(config, "fp32"), DEVICE)
    return {line.name: line for line in plan.lines}


def _train(model, config: RunConfig, steps: int = 2):
    optimizer = build_optimizer(model, config)
    ids = torch.randint(3, 90, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        usaf.causal_lm_loss(model, ids, ids).backward()
        optimizer.step()  # the gradients stay: they are part of what is measured
    return optimizer


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _entry_state(model, optimizer, experts: bool) -> tuple[int, int]:
    """(entries, bytes) of the trained entries of the expert stacks (or of the other weights): values, indices,
    gradients, optimizer moments and kept base values."""
    entries = size = 0
    for _, state in sparse_modules(model):
        if state.is_expert_stack != experts:
            continue
        for name in state:
            e = state[name]
            moments = optimizer.state[e.values]
            index = e.local_indices if hasattr(e, "local_indices") else None
            entries += e.values.numel()
            size += _nbytes(
                e.values, e.values.grad, index, e.base_values, moments["exp_avg"], moments["exp_avg_sq"]
            )
    return entries, size


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory):
    """A tiny fp32 model trained two steps at the run configuration the ledger plans."""
    folder = tmp_path_factory.mktemp("dense")
    tiny_model("qwen3_moe").save_pretrained(folder)
    config = _run_config(folder, targets=["experts", "attention", "routers"])
    model = usaf.prepare_model(tiny_model("qwen3_moe"), config.select)
    return config, model, _train(model, config)


def test_trained_state_is_the_ledgers_byte_for_byte(dense_run):
    config, model, optimizer = dense_run
    lines = _ledger(config)
    for experts, line in ((True, "sparse state + optimizer"), (False, "sparse state beyond the experts")):
        entries, size = _entry_state(model, optimizer, experts)
        assert entries and lines[line].device == size, (line, entries, size)
    routers = router_params(model)
    measured = sum(
        _nbytes(p.grad, optimizer.state[p]["exp_avg"], optimizer.state[p]["exp_avg_sq"]) for p in routers
    )
    assert routers and lines["routers (trainable)"].device == measured


def test_optimizer_buckets_stay_within_the_ledgers_bound(dense_run, monkeypatch):
    """With a small floor the largest-tensor rule decides the buckets: the ledger's step line holds the largest
    bucket the rule allows, and the optimizer's greedy fill reaches past that bound less one largest tensor."""
    config, model, optimizer = dense_run
    monkeypatch.setattr(costs, "OPTIMIZER_BUCKET_ENTRIES", 64)
    assert isinstance(optimizer, CompactAdamW)
    pending = [
        (p, g, i) for i, (g, p) in enumerate((g, p) for g in optimizer.param_groups for p in g["params"])
    ]
    pending = [item for item in pending if item[1]["compact"] and item[0].grad is not None]
    buckets = [sum(p.numel() for p, *_ in bucket) for bucket in optimizer._buckets(pending)]
    largest = max(p.numel() for p, *_ in pending)
    routers = sum(p.numel() for p in router_params(model))
    planned = (_ledger(config)["optimizer step temporaries"].device - 4 * routers) / 16
    assert len(buckets) > 1 and planned - largest < max(buckets) <= planned, (buckets, planned)


@pytest.fixture(scope="module")
def int8_store(tmp_path_factory) -> tuple[Path, Path]:
    """(model folder, its int8 store): one expert's gate_up is 1 MiB in fp32, its down 512 KiB."""
    root = tmp_path_factory.mktemp("quantized")
    model = tiny_model("qwen3_moe", moe_intermediate_size=4096, num_experts=4, num_hidden_layers=1)
    model.save_pretrained(root / "base")
    return root / "base", prepare_store(root / "base", root / "store", quant="int8", device="cpu")


def _quantized_run(int8_store, workspace_mb: int):
    """The store loaded at `workspace_mb` and trained two steps: (config, model, optimizer, the largest chunk the
    engine dequantized at once, in bytes)."""
    base, store = int8_store
    config = _run_config(base, 1 / 64, targets=["experts"], workspace_mb=workspace_mb)
    config = RunConfig.from_dict({**config.to_dict(), "model": {"path": str(base), "quant": "int8"}})
    model = load_prepared(store, base, config.select, device="cpu")
    chunks = []
    materialize = QuantizedStore.materialize

    def recorded(self, expert_ids):
        weight = materialize(self, expert_ids)
        chunks.append(_nbytes(weight))
        return weight

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(QuantizedStore, "materialize", recorded)
        optimizer = _train(model, config)
    return config, model, optimizer, max(chunks)


def test_quantized_state_and_decay_centres_are_the_ledgers(int8_store):
    """Entries on a quantized store keep no base; optim.decay_to_base holds their starting values instead."""
    config, model, optimizer, _ = _quantized_run(int8_store, 1)
    lines = _ledger(config)
    entries, size = _entry_state(model, optimizer, experts=True)
    assert lines["sparse state + optimizer"].device == size
    centres = [optimizer.base_of(e.values) for _, state in sparse_modules(model) for e in state.values()]
    assert all(not e.keeps_base for _, state in sparse_modules(model) for e in state.values())
    assert lines["decay centres"].host == _nbytes(*centres) == entries * 4


# (workspace MB, the largest chunk): at 1 MB one routed gate_up and the scratch one (past the bound: an expert is
# never split); at 3 MB two routed gate_ups and the scratch one, or every down (the whole stack, in order)
@pytest.mark.parametrize(("workspace_mb", "chunk_mib"), [(1, 2), (3, 3)])
def test_dequant_workspace_is_the_engines_largest_chunk(int8_store, workspace_mb, chunk_mib):
    """The ledger's workspace is the largest chunk the engine dequantizes: the last chunk alive while the next is
    built, at its dequantization's peak (int8's fp32 codes and product: its output, in fp32 here, is the product)."""
    config, _, _, largest_chunk = _quantized_run(int8_store, workspace_mb)
    line = _ledger(config)["dequant workspace"]
    per_element = 4 + max(4, usaf.quant.descriptor("int8").temporaries)
    assert largest_chunk == chunk_mib << 20
    assert line.device == largest_chunk // 4 * per_element
