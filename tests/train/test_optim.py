"""CompactAdamW: bf16 moments with stochastic rounding track fp32 AdamW, and resume exactly."""

import torch

from usaf.train.optim import COMPACT_DTYPE, CompactAdamW, round_stochastic


def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour():
    x = torch.randn(4096) * 3
    lower = x.to(torch.bfloat16, copy=True)  # nearest; its neighbours bound the exact value
    total = torch.zeros_like(x, dtype=torch.float64)
    draws = 400
    for seed in range(draws):
        rounded = round_stochastic(x, torch.Generator().manual_seed(seed))
        assert rounded.dtype == torch.bfloat16
        # truncation towards zero and one bf16 step up in magnitude are the only outcomes
        down = (x.view(torch.int32) & -65536).view(torch.float32)
        up = ((x.view(torch.int32) & -65536) + 65536).view(torch.float32)
        r = rounded.float()
        assert bool(((r == down) | (r == up)).all())
        total += r.double()
    mean = (total / draws).float()
    ulp = (lower.float().abs() * 2**-7).clamp_min(1e-30)
    # the mean of 400 draws lies within a few standard errors (ulp / 2 / sqrt(400)) of the exact value
    assert float(((mean - x).abs() / ulp).mean()) < 0.03
    assert float(((x.to(torch.bfloat16).float() - x).abs() / ulp).mean()) > 0.1  # nearest rounding is not


def _run(optimizer_class, grads, **kwargs):
    param = torch.nn.Parameter(torch.ones(grads.shape[1]))
    optimizer = optimizer_class([{"params": [param], "lr": 1e-2, **kwargs}], betas=(0.9, 0.999), eps=1e-8)
    for g in grads:
        param.grad = g.clone()
        optimizer.step()
    return param.detach().clone(), optimizer


def test_second_moment_decays_after_a_spike_as_in_fp32():
    # one large gradient, then tiny ones: fp32's v decays as beta2^t; rounding to nearest in bf16 would stall it
    # at the spike (0.1 % a step is below bf16's resolution) and keep the steps small for good
    steps = 600
    grads = torch.full((steps, 256), 1e-3)
    grads[0] = 1.0
    _, reference = _run(torch.optim.AdamW, grads)
    _, compact = _run(CompactAdamW, grads, compact=True)
    ref_v = next(iter(reference.state.values()))["exp_avg_sq"]
    v = next(iter(compact.state.values()))["exp_avg_sq"]
    assert v.dtype == COMPACT_DTYPE
    assert float((v.float().mean() - ref_v.mean()).abs() / ref_v.mean()) < 0.02


def test_compact_moments_track_fp32_adamw():
    torch.manual_seed(0)
    grads = torch.randn(300, 2048) * 0.1 + 0.05
    reference, _ = _run(torch.optim.AdamW, grads)
    compact, _ = _run(CompactAdamW, grads, compact=True)
    moved = (reference - 1).abs().mean()
    assert float((compact - reference).abs().mean() / moved) < 0.01


def test_plain_groups_are_torch_adamw_bit_for_bit():
    torch.manual_seed(1)
    grads = torch.randn(50, 64)
    reference, _ = _run(torch.optim.AdamW, grads, weight_decay=0.1)
    plain, _ = _run(CompactAdamW, grads, weight_decay=0.1)
    assert torch.equal(reference, plain)


def test_resume_from_a_state_dict_equals_an_uninterrupted_run():
    torch.manual_seed(2)
    grads = torch.randn(40, 512)
    whole, _ = _run(CompactAdamW, grads, compact=True)

    first, optimizer = _run(CompactAdamW, grads[:17], compact=True)
    saved = optimizer.state_dict()
    param = torch.nn.Parameter(first.clone())
    resumed = CompactAdamW([{"params": [param], "lr": 1e-2, "compact": True}], betas=(0.9, 0.999), eps=1e-8)
    resumed.load_state_dict(saved)
    assert all(resumed.state[param][k].dtype == COMPACT_DTYPE for k in ("exp_avg", "exp_avg_sq"))
    for g in grads[17:]:
        param.grad = g.clone()
        resumed.step()
    assert torch.equal(param.detach(), whole)
