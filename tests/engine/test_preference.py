"""DPO with the base as its own reference (usaf.engine.preference): sequence log-probabilities as transformers'
logits give them, the loss and gradients equal to DPO against an explicit frozen copy of the starting model,
whatever the logits chunk."""

import copy

import pytest
import torch
import torch.nn.functional as F

import usaf
from usaf.engine.installed import sparse_modules
from usaf.engine.loss import IGNORE_INDEX
from usaf.engine.preference import preference_loss, sequence_logps
from usaf.testing.tiny import tiny_model

BETA = 0.1


def pairs(vocab: int, seed: int = 0):
    """Two pairs, chosen rows first: a shared prompt of 5 tokens, answers of 3 and 4 tokens (right-padded)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (4, 10), generator=g)
    ids[2:, :5] = ids[:2, :5]  # each rejected answer follows its chosen one's prompt
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, 5:8] = ids[:, 5:8]
    labels[1, 8] = ids[1, 8]
    return ids, labels


def plain_logps(model, ids, labels) -> torch.Tensor:
    """What TRL computes: log-softmax of the full logits, gathered at the next tokens, summed over the answers."""
    logps = model(input_ids=ids, use_cache=False).logits[:, :-1].float().log_softmax(-1)
    targets = labels[:, 1:]
    keep = targets != IGNORE_INDEX
    picked = torch.gather(logps, 2, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * keep).sum(1)


@pytest.fixture
def trained():
    """A prepared model whose trained entries moved away from the base, and a frozen copy of its start."""
    model = tiny_model("qwen3_moe", seed=0)
    usaf.prepare_model(model, usaf.UsafConfig(density=0.05, selection="random"))
    start = copy.deepcopy(model).eval().requires_grad_(False)
    with torch.no_grad():
        for _, state in sparse_modules(model):
            for entries in state.values():
                entries.values.add_(0.05 * torch.randn_like(entries.values))
    return model.eval(), start


def values_grads(model) -> list[torch.Tensor]:
    return [e.values.grad.clone() for _, s in sparse_modules(model) for e in s.values()]


def test_sequence_logps_are_the_logits_log_probabilities(trained):
    model, _ = trained
    ids, labels = pairs(model.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(
            sequence_logps(model, ids, labels, chunk_tokens=4), plain_logps(model, ids, labels)
        )


@pytest.mark.slow
@pytest.mark.parametrize("chunk_tokens", [1, 5, 1024])
def test_dpo_against_the_base_equals_dpo_against_an_explicit_copy(trained, chunk_tokens):
    model, start = trained
    ids, labels = pairs(model.config.vocab_size)
    result = preference_loss(model, ids, labels, BETA, chunk_tokens=chunk_tokens)
    result.loss_sum.backward()
    ours = values_grads(model)
    model.zero_grad(set_to_none=True)

    with torch.no_grad():
        reference = plain_logps(start, ids, labels)
    policy = plain_logps(model, ids, labels)
    (pc, pr), (rc, rr) = policy.chunk(2), reference.chunk(2)
    expected = -F.logsigmoid(BETA * ((pc - rc) - (pr - rr)))
    expected.sum().backward()
    torch.testing.assert_close(result.loss_sum, expected.sum().detach())
    torch.testing.assert_close(result.margins, (BETA * ((pc - rc) - (pr - rr))).detach())
    for got, want in zip(ours, values_grads(model), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert any(g.abs().sum() > 0 for g in ours)


def test_at_the_start_the_margin_is_zero_and_the_loss_log_two():
    model = tiny_model("qwen3_moe", seed=0)
    usaf.prepare_model(model, usaf.UsafConfig(density=0.05, selection="random"))
    ids, labels = pairs(model.config.vocab_size)
    result = preference_loss(model.eval(), ids, labels, BETA)
    assert torch.equal(result.margins, torch.zeros(2))
    torch.testing.assert_close(result.loss_sum, 2 * torch.log(torch.tensor(2.0)))


def test_a_batch_without_pairs_is_refused():
    model = tiny_model("qwen3_moe", seed=0)
    usaf.prepare_model(model, usaf.UsafConfig(density=0.05, selection="random"))
    ids, labels = pairs(model.config.vocab_size)
    with pytest.raises(ValueError, match="pairs"):
        preference_loss(model, ids[:3], labels[:3], BETA)
