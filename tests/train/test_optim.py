"""CompactAdamW: bf16 moments with stochastic rounding track fp32 AdamW, and resume exactly."""

import pytest
import torch

from usaf.config import RunConfig
from usaf.train.objectives import NEXT_TOKEN_LR, PREFERENCE_LR
from usaf.train.optim import COMPACT_DTYPE, CompactAdamW, peak_lr, round_stochastic


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


def test_decay_to_base_pulls_values_toward_their_base_not_toward_zero(monkeypatch):
    """With no gradient signal (zero gradients: Adam's step is 0), each step takes lr x c of value - base away;
    c = 0 is the optimizer without it, bit for bit."""
    import usaf
    from usaf.config import RunConfig
    from usaf.engine.installed import sparse_modules
    from usaf.testing.tiny import tiny_model
    from usaf.train.optim import base_lookup, build_optimizer

    def prepared():
        model = tiny_model("qwen3_moe")
        return usaf.prepare_model(model, usaf.UsafConfig(density=0.1, selection="random"))

    model = prepared()
    entries = [e for _, state in sparse_modules(model) for e in state.values()]
    with torch.no_grad():
        for e in entries:
            e.values.add_(1.0)
    before = [e.values.detach() - e.base_values.float() for e in entries]
    config = RunConfig.from_dict({"optim": {"lr": 0.01, "decay_to_base": 5.0}})
    optimizer = build_optimizer(model, config)
    for e in entries:
        e.values.grad = torch.zeros_like(e.values)
    optimizer.step()
    for e, moved in zip(entries, before, strict=True):
        torch.testing.assert_close(e.values.detach() - e.base_values.float(), moved * (1 - 0.01 * 5.0))
    assert base_lookup(model)(entries[0].values) is entries[0].base_values  # kept on the entries: no copy
    plain, decayed = prepared(), prepared()
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    for model, c in ((plain, None), (decayed, 0.0)):
        if c is None:  # usaf's AdamW with no decay in its groups at all
            values = [p for p in model.parameters() if p.requires_grad]
            group = {"params": values, "lr": 0.01, "weight_decay": 0.0, "compact": True}
            optimizer = CompactAdamW([group], foreach=True)
        else:
            optimizer = build_optimizer(
                model, RunConfig.from_dict({"optim": {"lr": 0.01, "decay_to_base": c}})
            )
        for _ in range(2):
            model(ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    for a, b in zip(usaf.get_delta(plain).values(), usaf.get_delta(decayed).values(), strict=True):
        assert torch.equal(a.values, b.values)


def test_decay_to_base_applies_to_the_8bit_optimizer_too():
    """optim.eight_bit (bitsandbytes' AdamW8bit) decays toward the base as usaf's AdamW does: with zero gradients
    (no Adam step) each value's distance from its base shrinks by lr x c, from a hook before each step."""
    pytest.importorskip("bitsandbytes")
    import usaf
    from usaf.config import RunConfig
    from usaf.engine.installed import sparse_modules
    from usaf.testing.tiny import tiny_model
    from usaf.train.optim import build_optimizer

    model = usaf.prepare_model(tiny_model("qwen3_moe"), usaf.UsafConfig(density=0.1, selection="random"))
    entries = [e for _, state in sparse_modules(model) for e in state.values()]
    with torch.no_grad():
        for e in entries:
            e.values.add_(1.0)
            e.values.grad = torch.zeros_like(e.values)
    optim = {"lr": 0.01, "decay_to_base": 5.0, "eight_bit": True}
    build_optimizer(model, RunConfig.from_dict({"optim": optim})).step()
    for e in entries:
        moved = e.values.detach() - e.base_values.float()
        torch.testing.assert_close(moved, torch.full_like(moved, 1 - 0.01 * 5.0))


def test_a_resumed_optimizer_keeps_the_runs_decay_to_base():
    """The setting is the run's, not the checkpoint's: a checkpoint without it (0.1.x) or with another value
    loads, and the decay stays what the run asks."""
    param = torch.nn.Parameter(torch.ones(4))
    saved = CompactAdamW([{"params": [param], "lr": 1e-2, "compact": True}]).state_dict()
    del saved["param_groups"][0]["decay_to_base"]  # as 0.1.x wrote it
    resumed = CompactAdamW([{"params": [param], "lr": 1e-2, "compact": True, "decay_to_base": 2.0}])
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["decay_to_base"] == 2.0


def test_decay_to_base_applies_with_fp32_moments_too():
    """optim.moments=fp32 runs the values through torch's own AdamW (a plain group): the decay toward the base
    still applies, as it does with bf16 moments."""
    import usaf
    from usaf.config import RunConfig
    from usaf.engine.installed import sparse_modules
    from usaf.testing.tiny import tiny_model
    from usaf.train.optim import build_optimizer

    moved = {}
    for moments in ("bf16", "fp32"):
        model = usaf.prepare_model(tiny_model("qwen3_moe"), usaf.UsafConfig(density=0.1, selection="random"))
        entries = [e for _, state in sparse_modules(model) for e in state.values()]
        with torch.no_grad():
            for e in entries:
                e.values.add_(1.0)
        optim = {"lr": 0.01, "decay_to_base": 5.0, "moments": moments}
        optimizer = build_optimizer(model, RunConfig.from_dict({"optim": optim}))
        for e in entries:
            e.values.grad = torch.zeros_like(e.values)
        optimizer.step()
        moved[moments] = [e.values.detach() - e.base_values.float() for e in entries]
    for bf16, fp32 in zip(moved["bf16"], moved["fp32"], strict=True):
        torch.testing.assert_close(fp32, bf16)
        torch.testing.assert_close(fp32, torch.full_like(fp32, 1 - 0.01 * 5.0), atol=1e-2, rtol=0)


def test_decay_to_base_on_a_quantized_base_pulls_toward_the_recorded_originals(tmp_path):
    """An NF4 store keeps no base values on the device: the centre is read once per selection (the
    full-precision originals of the source checkpoint, not the dequantized NF4 values) into host memory, and read
    again after a new selection."""
    from helpers import make_model_dir

    import usaf
    from usaf.base.load import load_prepared
    from usaf.base.writer import prepare_store
    from usaf.config import RunConfig
    from usaf.engine.base_weights import starting_values
    from usaf.engine.installed import sparse_modules
    from usaf.train.optim import base_lookup, build_optimizer

    base = make_model_dir(tmp_path / "base")
    store = prepare_store(base, tmp_path / "store", quant="nf4", device="cpu")
    model = load_prepared(store, base, usaf.UsafConfig(density=0.1, selection="random"), device="cpu")
    owned = [
        (path, state, name)
        for path, state in sparse_modules(model)
        for name in state
        if not state.stores[name].resident
    ]
    assert owned and all(not state[name].keeps_base for _, state, name in owned)
    starts = [starting_values(model, *owner).float() for owner in owned]
    with torch.no_grad():
        for (_, state, name), start in zip(owned, starts, strict=True):
            state[name].values.copy_(start.reshape(state[name].values.shape) + 1.0)
            state[name].values.grad = torch.zeros_like(state[name].values)
    optimizer = build_optimizer(model, RunConfig.from_dict({"optim": {"lr": 0.01, "decay_to_base": 5.0}}))
    optimizer.step()
    for (_, state, name), start in zip(owned, starts, strict=True):
        moved = state[name].values.detach() - start.reshape(state[name].values.shape)
        torch.testing.assert_close(moved, torch.full_like(moved, 1 - 0.01 * 5.0))
    # the centres are the originals, not the NF4 values the store dequantizes to
    _, state, name = owned[0]
    entries = state[name]
    dequantized = (
        state.stores[name].read(entries.expanded_flat_indices()).float().reshape(entries.values.shape)
    )
    assert not torch.equal(base_lookup(model)(entries.values).float(), dequantized)
    # a new selection is read again
    lookup = base_lookup(model)
    first = lookup(entries.values)
    assert lookup(entries.values) is first
    flat = entries.expanded_flat_indices()
    half = flat.numel() // 2
    entries.set_selection(flat[:half], None, entries.values.detach()[:half])
    again = lookup(entries.values)
    assert again is not first and again.numel() == half


def test_the_default_rate_is_the_objectives_own():
    """optim.lr=auto: next-token objectives at 1e-2, DPO at its lower measured rate; a number given wins."""
    assert RunConfig().optim.lr == "auto"
    assert peak_lr(RunConfig()) == NEXT_TOKEN_LR == 1e-2
    assert peak_lr(RunConfig().replace({"train.objective": "dpo"})) == PREFERENCE_LR < NEXT_TOKEN_LR
    assert peak_lr(RunConfig().replace({"train.objective": "dpo", "optim.lr": 0.05})) == 0.05
