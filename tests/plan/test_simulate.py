"""usaf plan --simulate on a tiny model: the step runs on fake tensors with no mismatch and only the intended
host reads, its peak is set beside the plan, and a planted CPU tensor or raw read is caught."""

import torch

from usaf import planner
from usaf.simulate import simulate, summary
from usaf.simulate.step import PACKED_CHECK
from usaf.testing.tiny import tiny_config


def _plan(**parallel):
    config = tiny_config("qwen3_moe").to_dict()
    shape = planner.model_shape(config, "tiny")
    device = next(d for d in planner.DEVICES.values() if d.is_gpu)
    settings = planner.PlanSettings(
        seq=32, batch=2, density=0.05, quant="nf4", residency="device", **parallel
    )
    return planner.plan(shape, settings, device), config


def test_tiny_step_simulates_with_only_intended_reads():
    plan, config = _plan()
    sim = simulate(plan, config)
    assert sim.mismatches == []
    # every sync is one of usaf.kernels.host's intended reads (routing counts per MoE layer, the loss, the norm)
    # or transformers' check whether the batch is packed, once a forward
    assert all("usaf.kernels.host" in site or site == PACKED_CHECK for site in sim.sync_sites)
    assert sim.step_syncs == sum(sim.sync_sites.values()) > 0
    # the layers' reads apart from the step's: one routing read a layer a forward; the loss's count, the gradient
    # norm and the packed check once a step
    assert (
        sim.layer_syncs
        == sim.step_syncs - sim.per_step_syncs
        == sim.layer_steps * (1 + plan.settings.recompute)
    )
    assert sim.per_step_syncs == 3 and sim.sync_sites[PACKED_CHECK] == 1
    # the measured step is the last of the first reselection's probe window: its probes live through it, and the
    # reselection after it runs through (no read of its data outside usaf.kernels.host, no size from the data)
    assert sim.device_line_max.get("reselection probes", 0) > 0
    assert sim.reselection.startswith("simulated after the measured step ({'reselected_entries': ")
    assert "'reselected_entries': 0," not in sim.reselection
    report = summary(plan, sim)
    assert report["simulated_peak"] > report["live_bytes_at_peak"] > 0
    assert {row["line"] for row in report["lines"]} >= {"dense weights", "frozen experts", "activations"}


def test_an_expert_parallel_rank_reads_once_a_layer_forward():
    """Rank 1 of 2 on the fake process group (standing for NCCL): the exchange's counts and the served rows per
    expert come in one read a layer's forward, and nothing else reads in the layers."""
    plan, config = _plan(gpus=2, expert_parallel=2)
    sim = simulate(plan, config, rank=1)
    assert sim.mismatches == [] and sim.rank == "rank 1 of 2"
    assert sim.layer_syncs == sim.layer_steps * (1 + plan.settings.recompute)
    assert all("expert_parallel.py" in site for site in sim.sync_sites if site.endswith(", in a layer)"))
    # the reselection runs through on the rank: its experts' probes, the job's decision gathered
    assert sim.reselection.startswith("simulated after the measured step ({'reselected_entries': ")


def test_planted_cpu_tensor_and_raw_read_are_caught(monkeypatch):
    from usaf.engine import loss

    plan, config = _plan()
    original = loss.chunked_causal_lm_loss

    def cpu_tensor(hidden, *args, **kwargs):
        return original(hidden + torch.zeros(hidden.shape[-1], dtype=hidden.dtype), *args, **kwargs)

    monkeypatch.setattr(loss, "chunked_causal_lm_loss", cpu_tensor)
    found = simulate(plan, config).mismatches
    assert len(found) == 1 and "another device" in found[0]

    def raw_read(hidden, *args, **kwargs):
        out = original(hidden, *args, **kwargs)
        return out * float(hidden.sum().item())

    monkeypatch.setattr(loss, "chunked_causal_lm_loss", raw_read)
    found = simulate(plan, config).mismatches
    assert len(found) == 1 and "read of tensor data" in found[0]
