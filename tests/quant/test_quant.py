"""Frozen storage formats, the quantized store, and the offload machinery (streaming, prefetch, expert cache)."""

import random

import pytest
import torch

from usaf.errors import UsafError
from usaf.quant import FORMATS, get_format, register_format, resolve_format
from usaf.quant.descriptor import Descriptor
from usaf.store.offload import ExpertCache, LayerStreamer, ResidentParts, StreamedParts
from usaf.store.quantized import QuantizedStore

# Relative RMS error of quantize -> dequantize on Gaussian weights, measured bounds around the known values:
# NF4 (64-blocks) ~0.092, int8 per row ~0.008, int4 64-groups ~0.09 (less on rows shorter than a group).
ERROR_RANGES = {"nf4": (0.06, 0.11), "int8": (0.003, 0.012), "int4": (0.04, 0.11), "none": (0.0, 0.0)}
SHAPES = [(256, 512), (48, 40), (6, 10)]  # whole blocks; whole blocks per expert only; neither


def stack(fmt, weights):
    parts = [fmt.quantize(w) for w in weights]
    return {name: torch.stack([p[name] for p in parts]) for name in parts[0]}


def rel_rms(a, b):
    return ((a.float() - b.float()).pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt()).item()


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_error_is_in_the_known_range(name, shape):
    fmt = get_format(name)
    weights = torch.randn(3, *shape, generator=torch.Generator().manual_seed(0))
    parts = stack(fmt, weights)
    layout = fmt.layout(*shape, torch.float32)
    assert {k: (v.dtype, tuple(v.shape[1:])) for k, v in parts.items()} == {
        k: (d, tuple(s)) for k, (d, s) in layout.items()
    }
    restored = fmt.dequantize(parts, *shape, torch.float32)
    assert restored.shape == (3, *shape) and restored.is_contiguous()
    low, high = ERROR_RANGES[name]
    assert low <= rel_rms(restored, weights) <= high


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("shape", SHAPES)
def test_any_subset_of_experts_dequantizes_like_each_expert_alone(name, shape):
    """Batched dequantization of k experts (how the engine asks) equals dequantizing each one by itself."""
    fmt = get_format(name)
    parts = stack(fmt, torch.randn(5, *shape, generator=torch.Generator().manual_seed(1)))
    alone = torch.cat(
        [fmt.dequantize({k: v[e : e + 1] for k, v in parts.items()}, *shape, torch.float32) for e in range(5)]
    )
    for subset in ([0, 1, 2, 3, 4], [3, 1], [4]):
        picked = fmt.dequantize({k: v[subset] for k, v in parts.items()}, *shape, torch.float32)
        assert torch.equal(picked, alone[subset])
    assert torch.equal(fmt.dequantize(parts, *shape, torch.bfloat16), alone.to(torch.bfloat16))


def test_int4_is_exact_on_its_grid_and_on_constant_groups():
    fmt = get_format("int4")
    grid = torch.randint(0, 16, (4, 128)).float() * 0.25 - 1.0  # 16 levels, scale 0.25, low -1
    grid[:, 0], grid[:, 1] = -1.0, 2.75  # every group spans the full range
    grid[:, 64], grid[:, 65] = -1.0, 2.75
    constant = torch.full((2, 100), 0.375)
    zeros = torch.zeros(1, 7)
    for w in (grid, constant, zeros):
        assert torch.equal(fmt.dequantize(fmt.quantize(w), *w.shape, torch.float32)[0], w)


def test_int8_keeps_zero_rows_and_row_maxima_exact():
    fmt = get_format("int8")
    w = torch.randn(4, 33)
    w[2] = 0
    restored = fmt.dequantize(fmt.quantize(w), 4, 33, torch.float32)[0]
    assert torch.equal(restored[2], w[2])
    idx = w.abs().argmax(dim=1)
    assert torch.allclose(restored.gather(1, idx[:, None]), w.gather(1, idx[:, None]), rtol=1e-6)


def test_nf4_matches_bitsandbytes_on_whole_blocks():
    import bitsandbytes.functional as F

    w = torch.randn(64, 128)
    data, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4")
    ours = get_format("nf4").dequantize(get_format("nf4").quantize(w), 64, 128, torch.float32)[0]
    assert torch.equal(ours, F.dequantize_4bit(data, state))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_nf4_cpu_quantization_is_bitsandbytes_bit_for_bit(dtype):
    """usaf's CPU NF4 quantization (a code lookup by the top 16 bits of the scaled value) gives bitsandbytes'
    own bytes and absmax: Gaussian blocks at several scales, blocks of zeros and -0, and values one ulp either
    side of every midpoint between two codes (where a lookup could go wrong)."""
    import bitsandbytes.functional as F

    g = torch.Generator().manual_seed(0)
    code = F.get_4bit_type("nf4", device="cpu").float()
    midpoints = (code[:-1] + code[1:]) / 2
    cases = [(torch.randn(512, 64, generator=g) * scale).to(dtype) for scale in (0.02, 1.0, 30.0)]
    zeros = torch.zeros(4, 64, dtype=dtype)
    zeros[1] = -0.0
    cases.append(zeros)
    if dtype == torch.float32:  # only fp32 holds values this close to a midpoint
        near = midpoints[torch.randint(0, 15, (512, 63), generator=g)]
        for ulps in (-1, 0, 1):
            block = torch.ones(512, 64)
            block[:, 1:] = (near.view(torch.int32) + ulps).view(torch.float32)
            cases += [block, block * 3.7, block * -0.3]
    nf4 = get_format("nf4")
    for weight in cases:
        data, state = F.quantize_4bit(weight.contiguous(), blocksize=64, quant_type="nf4")
        ours = nf4.quantize(weight)
        assert torch.equal(ours["data"], data.reshape(-1))
        assert torch.equal(ours["absmax"], state.absmax.float().reshape(-1))


def test_format_choice():
    assert resolve_format("nf4", "cpu") == "nf4"  # bitsandbytes 0.50 has CPU kernels
    assert resolve_format("nf4", "meta") == "int4"  # no bitsandbytes kernels: the pure-PyTorch int4
    assert resolve_format("int8", "meta") == "int8"
    with pytest.raises(UsafError, match="Unknown quantization format"):
        resolve_format("fp3")


def quantized_store(name="nf4", experts=6, shape=(8, 64), parts=None):
    fmt = get_format(name)
    weights = torch.randn(experts, *shape, generator=torch.Generator().manual_seed(2))
    stacked = stack(fmt, weights)
    holder = parts(stacked) if parts else ResidentParts(stacked)
    return QuantizedStore(name, holder, (experts, *shape), torch.float32), weights


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_store_materializes_fresh_tensors_and_reads_entries(name):
    store, _ = quantized_store(name)
    first = store.materialize([1, 2])
    expected = first.clone()
    first.fill_(123.0)  # the engine writes trained values into what it gets: the frozen base must not change
    assert torch.equal(store.materialize([1, 2]), expected)
    flat = torch.tensor([0, 5, 8 * 64 + 3, 5 * 8 * 64 + 511])
    everything = store.materialize(list(range(6))).reshape(-1)
    assert torch.equal(store.read(flat), everything[flat])


@pytest.mark.parametrize("shape", [(64, 128), (6, 10)])
def test_nf4_store_reads_entries_from_their_blocks_only_with_the_whole_experts_values(shape):
    """`read` dequantizes only the blocks holding the entries (NF4's `read_entries`): the values are those of the
    whole experts' dequantization, bit for bit, in any order and with repeats (shapes of whole blocks and not)."""
    store, _ = quantized_store("nf4", experts=5, shape=shape)
    numel = 5 * shape[0] * shape[1]
    flat = torch.randint(0, numel, (300,), generator=torch.Generator().manual_seed(1))
    flat = torch.cat([flat, flat[:7], torch.tensor([0, numel - 1])])
    everything = store.materialize(list(range(5))).reshape(-1)
    assert torch.equal(store.read(flat).view(torch.int32), everything[flat].view(torch.int32))


def streamed(num_layers=3, cache_bytes=0, experts=4):
    streamer = LayerStreamer("cpu", cache_bytes)
    stores = []
    for layer in range(num_layers):
        store, _ = quantized_store(
            "int8", experts, parts=lambda p, layer=layer: StreamedParts(p, streamer, layer)
        )
        stores.append(store)
    return streamer, stores


def test_streamed_store_equals_resident_store_and_prefetches_along_the_pass():
    streamer, stores = streamed()
    resident, _ = quantized_store("int8", 4)  # same seed: same data
    copies = []
    for layer in [0, 1, 2, 2, 1, 0]:  # a forward, then a backward
        assert torch.equal(stores[layer].materialize([3, 0]), resident.materialize([3, 0]))
        copies.append(sorted(streamer.copies))
    # in a forward the next layer is on its way; in the backward, the previous one
    assert copies == [[0, 1], [1, 2], [2], [2], [0, 1], [0]]


def test_expert_cache_keeps_the_most_routed_experts_within_its_budget():
    _, stores = streamed(num_layers=2, cache_bytes=0)
    per_expert = stores[0].parts.bytes_per_expert
    cache = ExpertCache(3 * per_expert)
    parts = [s.parts for s in stores]
    tensors = {name: t.clone() for name, t in parts[0].host.items()}
    rows = {e: e for e in range(4)}
    cache.record(parts[0], [0, 1, 1, 2, 2, 2])
    cache.admit(parts[0], rows, tensors)
    assert sorted(e for _, e in cache.entries) == [0, 1, 2] and cache.used == 3 * per_expert
    cache.record(parts[0], [3, 3])  # 3 (2 uses) is hotter than 0 (1 use): it takes 0's place
    cache.admit(parts[0], rows, tensors)
    assert sorted(e for _, e in cache.entries) == [1, 2, 3] and cache.used <= cache.budget
    cache.record(parts[1], [0])  # a single use does not displace anything hotter
    cache.admit(parts[1], rows, tensors)
    assert sorted(e for _, e in cache.entries) == [1, 2, 3]
    assert torch.equal(cache.get(parts[0], 3)["data"][0], tensors["data"][3])


def test_cached_experts_are_not_streamed_again():
    budget = 2 * 4 * 8 * 65  # every int8 expert of two layers ([8, 64] data + 8 fp32 scales)
    results = {}
    for cache_bytes in (0, budget):
        streamer, stores = streamed(num_layers=2, cache_bytes=cache_bytes)
        outputs = []
        for _ in range(3):
            for layer in (0, 1):
                outputs.append(stores[layer].materialize([0, 1, 2, 3]))
        results[cache_bytes] = (streamer.bytes_streamed, outputs, streamer.cache.hits)
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[budget][1], strict=True))
    assert results[budget][0] < results[0][0] and results[budget][2] > 0


def test_experts_asked_for_from_the_copy_the_cache_and_host_memory_at_once_come_in_the_order_asked():
    """A backward asks for experts its forward did not route (not in the layer's copy): some cached, some
    fetched from host memory, mixed with copied ones, in any order."""
    rnd = random.Random(0)
    streamer, stores = streamed(num_layers=3, cache_bytes=4 * 8 * 65, experts=8)  # room for 4 int8 experts
    resident, _ = quantized_store("int8", 8)
    fetched_before = 0
    for _ in range(4):
        for layer in [0, 1, 2, 2, 1, 0]:
            asked = rnd.sample(range(8), rnd.randint(1, 8))
            assert torch.equal(stores[layer].materialize(asked), resident.materialize(asked)), (layer, asked)
        fetched_before, grew = streamer.bytes_streamed, streamer.bytes_streamed > fetched_before
    assert streamer.cache.hits > 0 and grew


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_quantizing_in_pieces_gives_the_parts_of_the_whole(name):
    """How preparation bounds the quantizers' temporaries: pieces' parts concatenated are the whole's parts."""
    fmt = get_format(name)
    weight = torch.randn(40, 48)
    whole = fmt.quantize(weight)
    pieces = [fmt.quantize(piece) for piece in fmt.pieces(weight, 300)]
    assert len(pieces) > 1 or name == "none"
    for part, value in whole.items():
        joined = torch.cat([p[part].reshape(-1) for p in pieces])
        assert torch.equal(joined, value.reshape(-1)), part


# ---- a format defined outside the package ---------------------------------------------------------------------


class Toy8:
    """int8 with one fp32 scale per matrix: a storage format written here, not in usaf.quant."""

    DESCRIPTOR = Descriptor("toy8", "toy int8, one fp32 scale per matrix", 8, 4)

    @staticmethod
    def layout(rows, cols, source_dtype):
        return {"data": (torch.int8, (rows, cols)), "scale": (torch.float32, (1,))}

    @staticmethod
    def pieces(weight, max_elements):
        yield weight  # one scale for the whole matrix: it is quantized whole

    @staticmethod
    def quantize(weight):
        scale = (weight.float().abs().amax() / 127).clamp_min(1e-12).reshape(1)
        return {"data": torch.round(weight.float() / scale).clamp_(-127, 127).to(torch.int8), "scale": scale}

    @staticmethod
    def dequantize(parts, rows, cols, dtype):
        data = parts["data"].reshape(-1, rows, cols).float()
        return (data * parts["scale"].reshape(-1, 1, 1)).to(dtype)


@pytest.fixture
def toy8():
    register_format(Toy8)
    yield Toy8
    FORMATS.unregister("toy8")


def test_a_format_registered_from_outside_is_a_config_choice_planned_and_stored(toy8, tmp_path):
    from usaf import planner
    from usaf.base.load import load_prepared, read_store_metadata
    from usaf.base.writer import prepare_store
    from usaf.config import RunConfig, UsafConfig
    from usaf.testing.tiny import tiny_model

    assert RunConfig.from_dict({"model": {"quant": "toy8"}}).model.quant == "toy8"
    assert "toy8" in planner.quant_formats()
    # the planner counts its bytes from its layout and its temporaries from its descriptor
    name, config = planner.load_model_config("qwen3-30b-a3b")
    shape = planner.model_shape(config, name)
    ledger = {
        line.name: line
        for line in planner.plan(
            shape, planner.PlanSettings(quant="toy8"), planner.DEVICES["h100"], ram=256 << 30
        ).lines
    }
    assert ledger["frozen experts"].device == shape.expert_weights
    assert "toy int8" in ledger["frozen experts"].detail
    matrices = sum(count for count, _, _ in shape.expert_matrices)
    assert ledger["quantization constants"].device == 4 * matrices
    # a prepared store quantizes into it, and the model loaded from it computes what its dequantized weights do
    src, out = tmp_path / "src", tmp_path / "out"
    reference = tiny_model("qwen3_moe")
    reference.save_pretrained(src)
    prepare_store(src, out, "toy8")
    assert read_store_metadata(out)["quant"] == "toy8"
    model = load_prepared(out, src, UsafConfig(targets=["experts"]), device="cpu", dtype=torch.float32)
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(ids).logits - reference(ids).logits).abs().max() < 0.05
