"""Chunked loss, recomputation, the chunked (non-resident) store path, and clear errors on bad input."""

import copy
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

import usaf
from usaf.engine.loss import causal_lm_loss, chunked_causal_lm_loss, output_head
from usaf.model.layout import find_moe_layers
from usaf.store.dense import DenseStore
from usaf.testing.tiny import tiny_model

IDS = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("chunk", [1, 5, 1024])
def test_chunked_loss_equals_plain_loss(chunk):
    hidden = torch.randn(2, 11, 16, dtype=torch.float64, requires_grad=True)
    head = torch.nn.Linear(16, 300, bias=False).double()
    labels = torch.randint(0, 300, (2, 11))
    labels[0, :4] = -100
    plain = F.cross_entropy(
        head(hidden)[:, :-1].reshape(-1, 300), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    # an upstream gradient other than 1 (a loss scale): each chunk's gradients, computed in its forward, are scaled
    g_plain, w_plain = torch.autograd.grad(3.7 * plain, [hidden, head.weight])
    chunked = chunked_causal_lm_loss(hidden, labels, head, chunk_tokens=chunk)
    g_chunked, w_chunked = torch.autograd.grad(3.7 * chunked, [hidden, head.weight])
    assert abs(chunked.item() - plain.item()) <= 1e-6 * abs(plain.item())
    assert torch.allclose(g_chunked, g_plain, rtol=1e-6, atol=1e-12)
    assert torch.allclose(w_chunked, w_plain, rtol=1e-6, atol=1e-12)


def test_chunked_loss_never_builds_full_logits():
    model = tiny_model("qwen3_moe")
    shapes = []
    head = output_head(model)

    def spy(h):
        out = head(h)
        shapes.append(tuple(out.shape))
        return out

    hidden = torch.randn(2, 11, 32, requires_grad=True)
    chunked_causal_lm_loss(hidden, IDS, spy, chunk_tokens=4).backward()
    assert shapes and max(s[0] for s in shapes) <= 4
    # and never recomputes them: the output layer runs once per chunk, forward and backward together
    assert len(shapes) == -(-2 * 10 // 4)


def test_model_loss_matches_transformers_loss():
    for family in ("qwen3_moe", "granitemoe"):  # granite scales its logits
        model = tiny_model(family)
        with torch.no_grad():
            ours = causal_lm_loss(model, IDS, IDS, chunk_tokens=3)
            theirs = model(IDS, labels=IDS).loss
        assert abs(ours.item() - theirs.item()) < 1e-5, family


def test_recomputation_gives_the_same_gradients():
    base = usaf.prepare_model(tiny_model("olmoe"), usaf.UsafConfig(density=0.2, selection="random"))
    recomputed = copy.deepcopy(base)
    usaf.enable_recomputation(recomputed)
    grads = []
    for model in (base, recomputed):
        model.train()
        causal_lm_loss(model, IDS, IDS).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-7), name


class CopyingStore(DenseStore):
    """A store that must be materialized expert by expert, as quantized and offloaded stores are."""

    resident = False

    def full(self):
        raise AssertionError("a non-resident store is never used whole")

    chunk_sizes: ClassVar[list[int]] = []  # every materialized chunk's number of experts, all stores together

    def materialize(self, expert_ids):
        self.chunk_sizes.append(len(expert_ids))
        return self.tensor.view(self.shape)[expert_ids]


@pytest.mark.parametrize("tokens", ["few", "many"])  # some experts routed; every expert (a faster placement)
@pytest.mark.parametrize("per_chunk", [1, 2])
@pytest.mark.parametrize("granularity", ["element", "neuron"])
def test_chunked_store_path_matches_resident_path(granularity, per_chunk, tokens):
    """Chunks of one expert, and of two (of four for the narrower projection): the values land in the right
    expert of the right chunk, and the gradients are the resident path's."""
    config = dict(density=0.2, granularity=granularity, selection="random")
    resident = usaf.prepare_model(tiny_model("gpt_oss"), usaf.UsafConfig(**config))
    chunked_model = tiny_model("gpt_oss")
    stores = {
        f"{layer.experts_name}.{t.name}": CopyingStore(layer.experts, t.name)
        for layer in find_moe_layers(chunked_model)
        for t in layer.tensors
        if not t.is_bias
    }
    chunked = usaf.prepare_model(chunked_model, usaf.UsafConfig(**config), stores=stores)
    CopyingStore.chunk_sizes = []
    for layer in find_moe_layers(chunked):
        largest = max(
            store.shape[1] * store.shape[2] * 4 for store in stores.values()
        )  # fp32 bytes an expert
        layer.experts.usaf.workspace_bytes = per_chunk * largest if per_chunk > 1 else 1
    ids = (
        IDS[:1, :4]
        if tokens == "few"
        else torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(5))
    )
    results = []
    for model in (resident, chunked):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".values"):
                    p.add_(0.1)
        loss = causal_lm_loss(model, ids, ids)
        loss.backward()
        results.append((loss.item(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    assert abs(results[0][0] - results[1][0]) < 1e-6
    for name, grad in results[0][1].items():
        assert torch.allclose(grad, results[1][1][name], rtol=1e-5, atol=1e-7), name
    # a chunk holds routed experts and one scratch expert (`Chunking`): at most the workspace's experts, or two
    sizes = CopyingStore.chunk_sizes
    assert max(sizes) <= max(per_chunk * 2, 2), sizes
    if tokens == "many":
        assert len(sizes) > 2 * len(stores), "several chunks a projection"


def test_dense_model_is_refused():
    config = AutoConfig.for_model(
        "llama",
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=1,
        num_attention_heads=4,
        vocab_size=97,
    )
    with pytest.raises(usaf.UsafError, match="no Mixture-of-Experts layers"):
        usaf.prepare_model(AutoModelForCausalLM.from_config(config))


def test_unknown_experts_layout_is_refused():
    model = tiny_model("qwen3_moe")
    experts = find_moe_layers(model)[0].experts
    experts.has_gate = False  # now it claims an `up_proj` that does not exist
    with pytest.raises(usaf.UsafError, match=r"Unknown experts layout.*up_proj"):
        usaf.prepare_model(model)


@pytest.mark.parametrize("density", [0, -0.1, 1.5, float("nan")])
def test_density_outside_unit_interval_is_refused(density):
    with pytest.raises(usaf.UsafError, match="density must be in"):
        usaf.UsafConfig(density=density)


def test_other_bad_config_values_are_refused():
    with pytest.raises(usaf.UsafError, match="granularity"):
        usaf.UsafConfig(granularity="block")
    with pytest.raises(usaf.UsafError, match="not MoE layers"):
        usaf.prepare_model(tiny_model("qwen3_moe"), usaf.UsafConfig(layers=[7]))
    with pytest.raises(usaf.UsafError, match="already prepared"):
        usaf.prepare_model(usaf.prepare_model(tiny_model("qwen3_moe")))


@pytest.mark.parametrize("kind", ["element", "rows", "columns"])
def test_a_chunks_trained_values_land_in_their_slots_and_the_rest_in_scratch(kind):
    """`write_into` with a slot table equals writing the whole [E, A, B] stack then taking the chunk's experts, in
    the chunk's order; the values of every other expert land in the scratch slot and nowhere else."""
    from usaf.engine.sparse import ElementEntries, LineEntries

    shape, g = (6, 5, 7), torch.Generator().manual_seed(3)
    if kind == "element":
        flat = torch.randperm(6 * 5 * 7, generator=g)[:40].sort().values
        entries = ElementEntries(shape, flat, torch.zeros(40))
    else:
        axis = 1 if kind == "rows" else 2
        lines = torch.randperm(6 * shape[axis], generator=g)[:9].sort().values
        entries = LineEntries(shape, axis, lines, torch.zeros(9, shape[3 - axis]))
    with torch.no_grad():
        entries.values.copy_(torch.randn(entries.values.shape, generator=g))
    whole = torch.zeros(shape)
    entries.write_into(whole, None)
    for chunk in ([0], [2, 3], [5, 1, 4], list(range(6))):
        slots = torch.tensor([chunk.index(e) if e in chunk else len(chunk) for e in range(6)])
        weight = torch.full((len(chunk) + 1, *shape[1:]), float("nan"))
        entries.write_into(weight, slots)
        written = ~weight[: len(chunk)].isnan()
        assert torch.equal(written, whole[chunk] != 0), chunk  # where the whole stack has trained values
        assert torch.equal(weight[: len(chunk)][written], whole[chunk][written]), chunk
        others = [e for e in range(6) if e not in chunk]
        assert bool(weight[len(chunk)].isnan().all()) == (not others or not bool((whole[others] != 0).any()))


@pytest.mark.parametrize(
    "counts, per_chunk",
    [([0, 0, 0], 2), ([3, 1, 2], 8), ([3, 0, 2, 0], 8), ([1, 1, 1, 1, 1], 2), ([2, 0, 0, 1, 4], 1)],
)
def test_chunks_partition_the_rows_and_hold_at_most_their_workspace(counts, per_chunk):
    """No rows: no chunk. Every expert routed and fitting: one chunk of the whole stack in order, no slot table.
    Otherwise routed experts in order, each chunk with one scratch expert (a routed one's data) and a slot table
    that sends every other expert to it; at most `per_chunk` experts a chunk, or two."""
    from usaf.engine.experts import Chunking
    from usaf.kernels import Segments

    chunking = Chunking(Segments.from_counts(counts, "cpu"), per_chunk)
    routed = [e for e, c in enumerate(counts) if c]
    if not routed:
        assert chunking.chunks == []
        return
    if len(routed) == len(counts) and per_chunk >= len(counts):
        (chunk,) = chunking.chunks
        assert chunk.expert_ids == routed and chunk.slots is None and chunk.matmul_rows.counts == counts
        return
    seen, r0 = [], 0
    for chunk in chunking.chunks:
        *own, scratch = chunk.expert_ids
        assert len(chunk.expert_ids) <= max(per_chunk, 2) and scratch in routed
        assert chunk.matmul_rows.counts == [counts[e] for e in own] + [0]  # the scratch expert has no rows
        assert (chunk.r0, chunk.r1) == (r0, r0 + sum(counts[e] for e in own))
        assert chunk.slots.tolist() == [own.index(e) if e in own else len(own) for e in range(len(counts))]
        seen += own
        r0 = chunk.r1
    assert seen == routed and r0 == sum(counts)


def test_a_bare_moe_block_prepares_with_the_default_targets():
    """An experts block prepared on its own (bench/engine.py's layer) has no embedding or output layer: the
    targets beyond the experts find their weights inside it, and nothing asks it for embeddings."""
    from usaf.model.layout import find_moe_layers

    model = tiny_model("qwen3_moe")
    block = find_moe_layers(model)[0].experts
    parent = model.get_submodule(find_moe_layers(model)[0].experts_name.rpartition(".")[0])
    assert block is not None and not hasattr(parent, "get_input_embeddings")
    usaf.prepare_model(parent, usaf.UsafConfig(density=0.1, selection="random"))
    x = torch.randn(5, model.config.hidden_size)
    parent(x.unsqueeze(0))[0].sum().backward()
    assert any(p.grad is not None for p in parent.parameters() if p.requires_grad)
