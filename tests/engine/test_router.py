"""Routers during training: raw-logit capture, balancing and z losses, fp32 routers, health, collapse guard."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import EXPERTS_AND_ROUTERS

import usaf
from usaf.config import RunConfig
from usaf.engine.router import (
    RouterCapture,
    RouterLoss,
    load_balancing_loss,
    make_routers_fp32,
    router_z_loss,
)
from usaf.errors import UsafError
from usaf.model.layout import find_moe_layers
from usaf.testing.tiny import tiny_model
from usaf.train.router_health import (
    CollapseGuard,
    RouterCollapse,
    RouterHealth,
    load_statistics,
    routing_drift,
)

IDS = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(1))


def _prepared(family="qwen3_moe", dtype=torch.float32, train_router=True, **overrides):
    model = tiny_model(family, dtype=dtype, **overrides)
    usaf.prepare_model(
        model, usaf.UsafConfig(targets=EXPERTS_AND_ROUTERS, density=0.05, train_router=train_router)
    )
    return model


# ----------------------------------------------------------------------------------------------------------
# losses against a hand-computed reference
# ----------------------------------------------------------------------------------------------------------

LOGITS = [[2.0, 0.5, -1.0], [0.0, 1.0, 3.0], [1.5, 1.5, 0.0], [-0.5, 2.0, 0.5]]
ROUTED = [[0, 1], [2, 1], [0, 1], [1, 2]]  # top-2 of 3 experts, 4 tokens


def _softmax(row):
    exps = [math.exp(v) for v in row]
    return [e / sum(exps) for e in exps]


def _reference_balance(logits, routed, num_experts):
    slots = [e for row in routed for e in row]
    share = [slots.count(e) / len(slots) for e in range(num_experts)]  # f_e
    probs = [_softmax(row) for row in logits]
    mean_prob = [sum(p[e] for p in probs) / len(probs) for e in range(num_experts)]  # P_e
    return num_experts * sum(f * p for f, p in zip(share, mean_prob, strict=True))


def _reference_z(logits):
    return sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits) / len(logits)


def test_losses_match_hand_computed_reference():
    logits, routed = torch.tensor(LOGITS), torch.tensor(ROUTED)
    # f = [2, 4, 2] / 8; P = column means of the row softmaxes
    assert float(load_balancing_loss(logits, routed, 3)) == pytest.approx(
        _reference_balance(LOGITS, ROUTED, 3)
    )
    assert float(router_z_loss(logits)) == pytest.approx(_reference_z(LOGITS))
    # balanced routing and uniform probabilities give exactly 1
    uniform = torch.zeros(6, 3)
    assert float(load_balancing_loss(uniform, torch.tensor([[0], [1], [2]] * 2), 3)) == pytest.approx(1.0)


def test_router_loss_averages_layers_and_weights_by_coefficients():
    other_logits = [[0.3, -0.2, 0.9], [1.0, 1.0, 1.0]]
    other_routed = [[2], [0]]
    fake_probe = SimpleNamespace(
        layers=[
            SimpleNamespace(num_experts=3),
            SimpleNamespace(num_experts=3),
            SimpleNamespace(num_experts=3),
        ],
        logits=lambda i: [torch.tensor(LOGITS), torch.tensor(other_logits), None][i],  # layer 3 did not run
        routed=lambda i: [torch.tensor(ROUTED), torch.tensor(other_routed), None][i],
    )
    total, parts = RouterLoss(balance_coef=0.1, z_coef=0.01)(fake_probe)
    balance = (_reference_balance(LOGITS, ROUTED, 3) + _reference_balance(other_logits, other_routed, 3)) / 2
    z = (_reference_z(LOGITS) + _reference_z(other_logits)) / 2
    assert float(parts["balance"]) == pytest.approx(balance)
    assert float(parts["z"]) == pytest.approx(z)
    assert float(total) == pytest.approx(0.1 * balance + 0.01 * z)

    # a layer whose logits carry no gradient (a frozen router below the trained layers) is left out of training
    trained = torch.tensor(LOGITS, requires_grad=True)
    fake_probe.logits = lambda i: [trained, torch.tensor(other_logits), None][i]
    total, parts = RouterLoss(balance_coef=0.1, z_coef=0.01)(fake_probe)
    assert float(parts["balance"]) == pytest.approx(_reference_balance(LOGITS, ROUTED, 3))
    assert float(parts["z"]) == pytest.approx(_reference_z(LOGITS))


def test_loss_gradients_reach_the_router_weights():
    model = _prepared()
    model.train()
    probe = RouterCapture(model)
    inputs = []
    hooks = [
        layer.router.register_forward_pre_hook(lambda m, a: inputs.append(a[0])) for layer in probe.layers
    ]
    with probe.capture():
        model(input_ids=IDS, use_cache=False)
        total, _ = RouterLoss(balance_coef=1.0, z_coef=0.1)(probe)
    for hook in hooks:
        hook.remove()
    weights = [layer.router.weight for layer in probe.layers]
    grads = torch.autograd.grad(total, weights, retain_graph=True)
    assert all(g.abs().sum() > 0 for g in grads)

    reference = 0.0  # the same losses written out from the routers' own inputs
    for layer, x, routed in zip(probe.layers, inputs, [probe.routed(0), probe.routed(1)], strict=True):
        logits = x.reshape(-1, 32) @ layer.router.weight.T
        share = torch.bincount(routed.reshape(-1), minlength=6).float() / routed.numel()
        balance = 6 * (share * logits.softmax(-1).mean(0)).sum()
        z = (logits.exp().sum(-1).log() ** 2).mean()
        reference = reference + (1.0 * balance + 0.1 * z) / 2
    expected = torch.autograd.grad(reference, weights)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want)


# ----------------------------------------------------------------------------------------------------------
# the probe: raw logits, routed ids, recomputation
# ----------------------------------------------------------------------------------------------------------


def _independent_raw_logits(router, x):
    """Pre-softmax scores computed here from the router's input, outside usaf."""
    if hasattr(router, "proj"):  # gemma4: rms-normed, scaled input into a bias-free linear
        h = router.norm(x) * router.scale * router.scalar_root_size
        return F.linear(h, router.proj.weight).reshape(-1, router.proj.weight.shape[0])
    x = x.reshape(-1, router.weight.shape[1]).float()
    return F.linear(x, router.weight.float(), getattr(router, "bias", None))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "gemma4_text", "deepseek_v3"])
def test_probe_captures_raw_logits_and_routed_ids(family):
    model = _prepared(family)
    probe = RouterCapture(model)
    seen = []

    def keep(module, args, output):
        seen.append((args[0], output))

    hooks = [layer.router.register_forward_hook(keep) for layer in probe.layers]
    with torch.no_grad(), probe.capture():
        model(input_ids=IDS, use_cache=False)
    for hook in hooks:
        hook.remove()
    assert len(seen) == len(probe.layers) == 2
    for i, (layer, (x, (router_out, _, top_k_index))) in enumerate(zip(probe.layers, seen, strict=True)):
        captured = probe.logits(i)
        assert captured.shape == (IDS.numel(), layer.num_experts) and captured.dtype == torch.float32
        torch.testing.assert_close(captured, _independent_raw_logits(layer.router, x))
        if family == "gemma4_text":  # its router returns probabilities: ours are their logits
            torch.testing.assert_close(captured.softmax(-1), router_out.float())
        else:  # these return the raw scores themselves (gpt-oss with its bias, deepseek in fp32)
            torch.testing.assert_close(captured, router_out.float())
        assert not torch.allclose(captured.sum(-1), torch.ones(IDS.numel()))
        torch.testing.assert_close(probe.routed(i), top_k_index)
    probe.remove()


def test_probe_token_mask_and_nothing_captured_outside():
    model = _prepared()
    probe = RouterCapture(model)
    with torch.no_grad():
        model(input_ids=IDS, use_cache=False)
    assert probe.logits(0) is None and probe.routed(0) is None
    mask = torch.zeros_like(IDS, dtype=torch.bool)
    mask[0, :7] = True
    with torch.no_grad(), probe.capture(token_mask=mask):
        model(input_ids=IDS, use_cache=False)
    assert probe.logits(0).shape[0] == 7 and probe.routed(1).shape[0] == 7
    assert int(probe.routed_counts().sum()) == 2 * 7 * 2  # layers x tokens x top-k


def _step_grads(recompute: bool, capture_backward: bool = False):
    model = _prepared()
    if recompute:
        usaf.enable_recomputation(model)
    model.train()
    probe = RouterCapture(model)
    with probe.capture():
        out = model(input_ids=IDS, labels=IDS, use_cache=False)
        total, _ = RouterLoss(balance_coef=1.0, z_coef=0.1)(probe)
        if capture_backward:
            (out.loss + total).backward()
    if not capture_backward:
        (out.loss + total).backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad])
    return grads, [len(pieces) for pieces in probe._logits], [len(pieces) for pieces in probe._routed]


@pytest.mark.slow
def test_recomputation_does_not_duplicate_captures_and_keeps_gradients_exact():
    reference, _, _ = _step_grads(recompute=False)
    grads, logits_pieces, routed_pieces = _step_grads(recompute=True)
    assert logits_pieces == [1, 1] and routed_pieces == [1, 1]
    torch.testing.assert_close(grads, reference, rtol=0, atol=0)
    # the hooks do re-run in backward: capturing there would append the duplicates
    _, logits_pieces, routed_pieces = _step_grads(recompute=True, capture_backward=True)
    assert logits_pieces == [2, 2] and routed_pieces == [2, 2]


# ----------------------------------------------------------------------------------------------------------
# fp32 routers in a bf16 model
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "gemma4_text"])
def test_fp32_routers_in_a_bf16_model(family):
    frozen_router = _prepared(family, dtype=torch.bfloat16, train_router=False)
    assert all(  # a router that is not trained keeps its dtype
        p.dtype == torch.bfloat16
        for layer in find_moe_layers(frozen_router)
        for p in layer.router.parameters()
    )
    assert len(make_routers_fp32(frozen_router)) == 2
    model = _prepared(family, dtype=torch.bfloat16)  # prepare_model converts trained routers itself
    assert make_routers_fp32(model) == []  # idempotent
    layers = find_moe_layers(model)
    params = [p for layer in layers for p in layer.router.parameters()]
    assert all(p.dtype == torch.float32 for p in params)
    assert any(p.requires_grad for p in params)  # prepare_model's trainability survives the conversion
    routing_dtypes = []
    hooks = [
        layer.experts.register_forward_pre_hook(lambda m, a: routing_dtypes.append(a[2].dtype))
        for layer in layers
    ]
    model.train()
    out = model(input_ids=IDS, labels=IDS, use_cache=False)
    for hook in hooks:
        hook.remove()
    assert routing_dtypes == [torch.float32, torch.float32]  # routing weights computed in fp32
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.loss)  # hidden states stay bf16
    out.loss.backward()
    assert all(
        p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all() for p in params if p.requires_grad
    )


def test_tiny_router_update_survives_in_fp32_and_rounds_away_in_bf16():
    def step(router_weight):
        old = router_weight.detach().clone()
        router_weight.grad = old * 1e-4  # an update of 1e-4 relative
        torch.optim.SGD([router_weight], lr=1.0).step()
        return old, router_weight.detach()

    model = _prepared(dtype=torch.bfloat16, train_router=False)
    bf16_weight = find_moe_layers(model)[0].router.weight
    old, new = step(bf16_weight)
    assert torch.equal(old, new)  # bf16 keeps 8 mantissa bits: the whole update is lost

    make_routers_fp32(model)
    fp32_weight = find_moe_layers(model)[0].router.weight
    old, new = step(fp32_weight)
    torch.testing.assert_close(old - new, old * 1e-4)
    assert (old != new).float().mean() > 0.99


def test_deepseek_routers_are_already_fp32_and_bias_stays_a_buffer():
    model = _prepared("deepseek_v3", dtype=torch.bfloat16)
    assert make_routers_fp32(model) == []
    for layer in find_moe_layers(model):
        names = {n for n, _ in layer.router.named_parameters()}
        assert (
            "e_score_correction_bias" not in names
            and layer.router.e_score_correction_bias.dtype == torch.float32
        )


# ----------------------------------------------------------------------------------------------------------
# health
# ----------------------------------------------------------------------------------------------------------


def test_load_statistics_reference():
    stats = load_statistics(torch.tensor([6, 2, 0, 0]))
    assert stats["load"] == [0.75, 0.25, 0.0, 0.0]
    assert stats["cv"] == pytest.approx(math.sqrt(6) / 2)  # population std sqrt((16+0+4+4)/4) over mean 2
    assert stats["entropy"] == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) / math.log(4))
    assert (stats["dead"], stats["dead_share"]) == (2, 0.5)
    balanced = load_statistics(torch.tensor([5, 5, 5, 5]))
    assert balanced["cv"] == 0 and balanced["entropy"] == pytest.approx(1.0)


class _StubProbe:
    """Routed counts set by the test, for two MoE layers (decoder layers 3 and 5) of 4 experts."""

    def __init__(self):
        self.layers = [
            SimpleNamespace(layer_index=3, num_experts=4),
            SimpleNamespace(layer_index=5, num_experts=4),
        ]
        self.counts = None

    def routed_counts(self):
        return self.counts


def test_health_window_slides_and_skips_unobserved_layers():
    probe = _StubProbe()
    health = RouterHealth(probe, window_steps=2)
    steps = [[[9, 0, 0, 0], [0, 0, 0, 0]], [[1, 1, 0, 2], [0, 0, 0, 0]], [[1, 1, 2, 0], [0, 0, 0, 0]]]
    for counts in steps:
        probe.counts = torch.tensor(counts)
        health.observe()
        health.end_step()
    assert health.window_is_full
    assert health.counts().tolist() == [[2, 2, 2, 2], [0, 0, 0, 0]]  # the first step left the window
    rows = health.per_layer()
    assert rows[0]["layer"] == 3 and rows[0]["cv"] == 0 and rows[0]["dead"] == 0
    assert rows[1] == {"layer": 5, "routed": 0, "drift": None}  # not "all dead": not observed
    assert health.summary() == {"cv_max": 0.0, "entropy_min": pytest.approx(1.0), "dead": 0}
    assert health.metrics()["router/cv_max"] == 0.0 and health.metrics()["router/layers"] == rows
    matrix = health.load_matrix()
    assert matrix[0].tolist() == [0.25] * 4 and torch.isnan(matrix[1]).all()


def test_routing_drift_is_the_kl_of_gate_distributions():
    generator = torch.Generator().manual_seed(0)
    base, now = torch.randn(5, 6, generator=generator), torch.randn(5, 6, generator=generator)
    expected = F.kl_div(now.log_softmax(-1), base.log_softmax(-1), log_target=True, reduction="batchmean")
    assert routing_drift(base, now) == pytest.approx(float(expected))
    assert routing_drift(base, base) == 0.0


def test_drift_from_base_on_a_fixed_probe_batch():
    model = _prepared()
    model.train()
    probe = RouterCapture(model)
    health = RouterHealth(probe, window_steps=4)
    batch = {"input_ids": IDS, "labels": IDS}
    health.record_base(model, batch)
    assert model.training  # restored after the probe forward
    assert health.measure_drift(model, batch) == [0.0, 0.0]
    assert health.base_counts.sum() == 2 * IDS.numel() * 2
    with torch.no_grad():
        probe.layers[1].router.weight.mul_(1.5)  # the last layer's routing sharpens
    drift = health.measure_drift(model, batch)
    assert drift[0] == 0.0 and drift[1] > 1e-3
    assert health.summary()["drift"] == pytest.approx(drift[1] / 2)
    assert probe.logits(0) is None  # the probe forward left nothing behind for the training losses


# ----------------------------------------------------------------------------------------------------------
# the collapse guard
# ----------------------------------------------------------------------------------------------------------


def _stub_health(cv=1.5, entropy=0.9, dead=0, full=True):
    row = {"layer": 7, "routed": 100, "cv": cv, "entropy": entropy, "dead": dead, "dead_share": dead / 8}
    return SimpleNamespace(window_is_full=full, per_layer=lambda: [row, {"layer": 8, "routed": 0}])


def test_guard_thresholds_and_warn():
    guard = CollapseGuard(max_cv=1.0, min_entropy=0.5, max_dead_share=0.25, action="warn")
    assert guard.check(_stub_health(cv=1.5, full=False), step=3) is None  # window still filling
    assert guard.check(_stub_health(cv=0.5), step=4) is None
    message = guard.check(_stub_health(cv=1.5, entropy=0.4, dead=3), step=5)
    assert "layer 7: load cv 1.50 > 1.0" in message and "entropy 0.40 < 0.5" in message
    assert "3 dead experts" in message and guard.trips == 1
    off = CollapseGuard(max_cv=0, min_entropy=0, max_dead_share=1.0)
    assert off.check(_stub_health(cv=9.0, entropy=0.01, dead=8), step=1) is None


def test_guard_raise_balance_doubles_up_to_the_cap():
    loss = RouterLoss(balance_coef=0.01, z_coef=0.001)
    guard = CollapseGuard(1.0, 0.0, 1.0, action="raise_balance", loss=loss, balance_cap=0.05)
    coefs = []
    for step in range(4):
        assert "balance_coef" in guard.check(_stub_health(), step)
        coefs.append(loss.balance_coef)
    assert coefs == [0.02, 0.04, 0.05, 0.05] and loss.z_coef == 0.001
    loss.balance_coef = 0.0
    guard.check(_stub_health(), 5)
    assert loss.balance_coef == 0.01  # from "off" to the usual coefficient
    with pytest.raises(UsafError, match="needs the RouterLoss"):
        CollapseGuard(1.0, 0.0, 1.0, action="raise_balance")


def test_guard_freeze_router_stops_router_updates():
    weight = torch.nn.Parameter(torch.ones(3, 4))
    optimizer = torch.optim.AdamW([weight], lr=0.1, weight_decay=0.0)
    weight.grad = torch.ones_like(weight)
    optimizer.step()  # Adam now has momentum: a zero gradient would still move the weight
    weight.grad = torch.ones_like(weight)
    guard = CollapseGuard(1.0, 0.0, 1.0, action="freeze_router", router_params=[weight])
    assert "routers frozen" in guard.check(_stub_health(), step=9)
    assert not weight.requires_grad and weight.grad is None
    before = weight.detach().clone()
    optimizer.step()
    assert torch.equal(weight.detach(), before)


def test_guard_stop_raises_for_the_trainer_and_config_builds_it():
    section = RunConfig.load(None, ["router.guard_action=stop", "router.guard_max_cv=1.2"]).router
    guard = CollapseGuard.from_config(section, RouterLoss(section.balance_coef, section.z_coef), [])
    assert (guard.max_cv, guard.min_entropy, guard.max_dead_share) == (1.2, 0.5, 0.5)
    with pytest.raises(RouterCollapse, match=r"load cv 1\.50 > 1\.2") as info:
        guard.check(_stub_health(), step=12)
    assert isinstance(info.value, UsafError)
    with pytest.raises(UsafError, match="guard_action"):
        RunConfig.load(None, ["router.guard_action=explode"])


def _train_routers_on_narrow_data(balance_coef: float, guard: CollapseGuard, steps: int) -> list[float]:
    """Only the routers train (AdamW, lr 0.05: 50x a usual router lr) on one repeated 12-token sequence.

    Narrow data in a trained model shares a dominant direction in the residual stream, which a random tiny model
    lacks: it is added to the embeddings here (and taken out of the routers' initial weights, so the starting
    loads are spread). Router updates along that direction move every token at once: routing collapses.
    Returns the worst layer's load cv at each step once the window is full.
    """
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe", num_experts=16, num_local_experts=16)  # all on 2 of 16 experts: cv 2.65
    usaf.prepare_model(model, usaf.UsafConfig(targets=EXPERTS_AND_ROUTERS, density=0.001, train_router=True))
    model.train()
    probe = RouterCapture(model)
    generator = torch.Generator().manual_seed(0)
    shared = torch.randn(32, generator=generator)
    shared /= shared.norm()
    with torch.no_grad():
        embeddings = model.get_input_embeddings().weight
        embeddings += 1.5 * embeddings.norm(dim=1).mean() * shared
        for projection in probe.projections:
            projection.weight -= (projection.weight @ shared)[:, None] * shared[None, :]
    sequence = torch.randint(0, 97, (1, 12), generator=generator).repeat(2, 1)
    router_params = [p for layer in probe.layers for p in layer.router.parameters()]
    guard.router_params = router_params
    optimizer = torch.optim.AdamW(router_params, lr=0.05, weight_decay=0.0)
    loss = RouterLoss(balance_coef=balance_coef, z_coef=0.0)
    health = RouterHealth(probe, window_steps=3)
    cvs = []
    for step in range(1, steps + 1):
        with probe.capture():
            out = model(input_ids=sequence, labels=sequence, use_cache=False)
            router_loss, _ = loss(probe)
        (out.loss + router_loss).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        health.observe()
        health.end_step()
        if health.window_is_full:
            cvs.append(health.summary()["cv_max"])
        guard.check(health, step)
    return cvs


@pytest.mark.slow
def test_guard_trips_on_narrow_data_and_balancing_keeps_loads_spread():
    steps, threshold = 16, 1.4
    collapsing = CollapseGuard(max_cv=threshold, min_entropy=0.0, max_dead_share=1.0, action="stop")
    with pytest.raises(RouterCollapse, match="load cv"):
        _train_routers_on_narrow_data(balance_coef=0.0, guard=collapsing, steps=steps)

    watching = CollapseGuard(max_cv=threshold, min_entropy=0.0, max_dead_share=1.0, action="stop")
    cvs = _train_routers_on_narrow_data(balance_coef=1.0, guard=watching, steps=steps)
    assert len(cvs) == steps - 2 and max(cvs) < threshold and watching.trips == 0
