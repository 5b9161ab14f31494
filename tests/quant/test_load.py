"""Preparing a quantized store from a checkpoint and loading it back: equality with naive references, original
values, gradients, residency modes, bounded memory, and clear failures that leave no store behind."""

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import reselecting_step
from safetensors.torch import load_file, save_file

import usaf
from usaf.base.load import load_prepared, read_store_metadata
from usaf.base.writer import prepare_store
from usaf.cli import main as cli_main
from usaf.engine.loss import causal_lm_loss
from usaf.engine.state import model_state
from usaf.errors import UsafError
from usaf.io import shards
from usaf.quant import get_format
from usaf.store.dense import StoredExpertTensor
from usaf.store.quantized import QuantizedStore
from usaf.testing.tiny import tiny_model

IDS = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(1))
CONFIG = dict(density=0.1, selection="random", targets=["experts", "routers"])  # the quantized experts


def save_checkpoint(folder: Path, family="qwen3_moe", **overrides):
    """A tiny model saved as a multi-shard checkpoint (transformers' on-disk layout: per-expert tensors for most
    families)."""
    reference = tiny_model(family, **overrides)
    reference.save_pretrained(folder, max_shard_size="20KB")
    return reference


def load(out, src=None, **kw):
    kw.setdefault("device", "cpu")
    kw.setdefault("dtype", torch.float32)
    return load_prepared(out, src, usaf.UsafConfig(**CONFIG), **kw)


def naive_reference(reference, prepared_dir, model):
    """A plain transformers model holding every stored tensor dequantized in full, with the trained values of
    `model` written in at their entries."""
    metadata = read_store_metadata(prepared_dir)
    entries = {}
    for file in metadata["files"]:
        entries.update(shards.read_header(prepared_dir / file)[0])
    plain = copy.deepcopy(reference)
    tensors = dict(plain.named_parameters()) | dict(plain.named_buffers())
    with torch.no_grad():
        for name, info in metadata["tensors"].items():
            parts = {key.rsplit(":", 1)[1]: shards.read_tensor(entries[key]) for key in info["stored"]}
            shape = info["shape"]
            rows_cols = (
                shape[1:] if info["kind"] == "experts" else shape if len(shape) == 2 else (1, shape[0])
            )
            if info["format"] == "none":
                value = parts["data"]
            else:
                value = get_format(info["format"]).dequantize(parts, *rows_cols, torch.float32)
            tensors[name].copy_(value.reshape(tensors[name].shape))
        for name, delta in usaf.get_delta(model).items():
            tensors[name].view(-1)[delta.flat_indices] = delta.values.detach().reshape(-1)
    return plain


def no_store_left(out: Path):
    return not out.exists() and not list(out.parent.glob(f".{out.name}.usaf-tmp-*"))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(reference model, checkpoint dir, nf4 store dir), made once."""
    root = tmp_path_factory.mktemp("qwen")
    reference = save_checkpoint(root / "src")
    prepare_store(root / "src", root / "nf4", "nf4")
    return reference, root / "src", root / "nf4"


FORMATS_AND_FAMILIES = [
    ("qwen3_moe", "nf4"),
    ("qwen3_moe", "int8"),
    ("qwen3_moe", "int4"),
    ("qwen3_moe", "none"),
    ("gpt_oss", "nf4"),  # fused, transposed experts with biases, stored under their own names
    ("mixtral", "nf4"),  # per-expert w1/w2/w3 under block_sparse_moe, renamed and fused on load
    ("deepseek_v3", "nf4"),  # a dense first layer and shared experts
    ("qwen2_moe", "nf4"),
    ("olmoe", "int8"),
    ("glm4_moe", "int4"),
    ("granitemoe", "nf4"),
    ("gemma4_text", "nf4"),
]


@pytest.mark.parametrize("family,quant", FORMATS_AND_FAMILIES)
def test_forward_equals_naive_reference_and_trained_values_are_the_originals(tmp_path, qwen, family, quant):
    if (family, quant) == ("qwen3_moe", "nf4"):
        reference, src, out = qwen
    else:
        src, out = tmp_path / "src", tmp_path / "out"
        reference = save_checkpoint(src, family)
        prepare_store(src, out, quant, quant_dense=quant == "int8")
    model = load(out, src)
    with torch.no_grad():
        logits = model(IDS).logits
        assert (logits - naive_reference(reference, out, model)(IDS).logits).abs().max() < 1e-5
        if quant == "none":
            assert (logits - reference(IDS).logits).abs().max() < 1e-5
    originals = reference.state_dict()
    deltas = usaf.get_delta(model)
    assert deltas
    for name, delta in deltas.items():
        assert torch.equal(delta.values.detach().reshape(-1), originals[name].reshape(-1)[delta.flat_indices])
    # nothing can use the experts' own (dataless) parameters by accident
    layer = next(m for m in model.modules() if hasattr(m, "usaf"))
    assert isinstance(layer.down_proj, StoredExpertTensor)
    assert not any(n.endswith((".experts.down_proj", ".experts.gate_up_proj")) for n in model.state_dict())
    assert isinstance(layer.usaf.stores["down_proj"], QuantizedStore)


def test_without_source_trained_values_start_from_the_dequantized_base(qwen):
    reference, _, out = qwen
    model = load(out)
    for name, delta in usaf.get_delta(model).items():
        store = model.get_submodule(name.rpartition(".")[0]).usaf.stores[name.rpartition(".")[2]]
        assert torch.equal(delta.values.detach().reshape(-1), store.read(delta.flat_indices))
        assert not torch.equal(
            delta.values.detach().reshape(-1), reference.state_dict()[name].reshape(-1)[delta.flat_indices]
        )


def test_gradients_match_a_patched_dequantized_reference(qwen):
    reference, src, out = qwen
    model = load(out, src)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".values"):
                param.add_(torch.randn_like(param) * 0.2)
    plain = naive_reference(reference, out, model)
    for param in plain.parameters():
        param.requires_grad_(True)
    embeds = plain.get_input_embeddings()(IDS).detach()
    target = torch.randn(2, 7, 97, generator=torch.Generator().manual_seed(2))

    def run(m):
        x = embeds.clone().requires_grad_(True)
        logits = m(inputs_embeds=x).logits
        (logits * target).sum().backward()
        return logits.detach(), x.grad

    ref_logits, ref_grad = run(plain)
    logits, grad = run(model)
    assert (logits - ref_logits).abs().max() < 1e-5
    assert rel(grad, ref_grad) < 1e-4
    dense = dict(plain.named_parameters())
    for name, delta in usaf.get_delta(model).items():
        assert rel(delta.values.grad.reshape(-1), dense[name].grad.reshape(-1)[delta.flat_indices]) < 1e-4
    routers = [(n, p) for n, p in model.named_parameters() if p.requires_grad and not n.endswith(".values")]
    assert routers
    for name, param in routers:
        assert rel(param.grad, dense[name].grad) < 1e-4, name


def test_only_routed_experts_are_dequantized(qwen, monkeypatch):
    _, src, out = qwen
    model = load(out, src)
    routed, asked = {}, []
    for path, module in model.named_modules():
        if hasattr(module, "usaf"):
            module.register_forward_pre_hook(
                lambda m, args, path=path: routed.__setitem__(path, set(args[1].reshape(-1).tolist()))
            )
    for path, module in model.named_modules():
        for store in getattr(getattr(module, "usaf", None), "stores", {}).values():
            if isinstance(store, QuantizedStore):
                original = store.materialize
                monkeypatch.setattr(
                    store,
                    "materialize",
                    lambda ids, o=original, p=path: asked.append((p, list(ids))) or o(ids),
                )
    with torch.no_grad():
        model(IDS[:, :1])  # two tokens, two experts each: at most 4 of 6 experts per layer
    assert asked
    for path, ids in asked:
        assert set(ids) <= routed[path] and len(ids) < 6


def test_residency_modes_and_the_device_cache_give_identical_training(qwen):
    _, _, out = qwen
    runs = {}
    for residency, cache_mb in [("device", 0), ("host", 0), ("mmap", 1)]:
        model = load(out, residency=residency, cache_mb=cache_mb)
        model.train()
        if residency == "mmap":  # the experts' quantized data is a view of the store's files
            assert str(out.resolve()) in Path("/proc/self/maps").read_text()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for _ in range(2):
            loss = model(IDS, labels=IDS).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        with torch.no_grad():
            runs[residency] = (losses, model(IDS).logits, model_state(model).store.streamer)
    losses, logits, _ = runs["device"]
    assert losses[1] < losses[0]  # the trained values do train
    for residency, (other_losses, other_logits, _) in runs.items():
        assert other_losses == losses and torch.equal(other_logits, logits), residency
    uncached, cached = runs["host"][2], runs["mmap"][2]
    assert uncached.bytes_streamed > 0 and uncached.cache.hits == 0
    assert cached.cache.hits > 0 and cached.bytes_streamed < uncached.bytes_streamed


def test_tied_embeddings_and_dense_int8(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    reference = save_checkpoint(src, tie_word_embeddings=True)
    prepare_store(src, out, "none", quant_dense=True)
    tensors = read_store_metadata(out)["tensors"]
    assert "lm_head.weight" not in tensors
    assert tensors["model.layers.0.self_attn.q_proj.weight"]["format"] == "int8"
    assert (
        tensors["model.layers.0.mlp.gate.weight"]["format"] == "none"
    )  # routers are trained: never quantized
    model = load(out, src)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    with torch.no_grad():
        error = (model(IDS).logits - reference(IDS).logits).abs().max()
    assert 0 < error < 0.05  # only the int8 attention weights differ


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak-RSS reset")
def test_prepare_streams_a_multi_shard_checkpoint_within_bounded_memory(tmp_path):
    """Peak RSS of the preparing process (a subprocess) grows by far less than the checkpoint's size."""
    src = tmp_path / "src"
    experts = dict(num_experts=16, num_local_experts=16, n_routed_experts=16)
    model = tiny_model(
        "qwen3_moe", hidden_size=256, moe_intermediate_size=512, num_hidden_layers=4, **experts
    )
    model.save_pretrained(src, max_shard_size="16MB")
    checkpoint_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    assert checkpoint_bytes > 80 << 20 and len(list(src.glob("*.safetensors"))) >= 4
    script = textwrap.dedent(
        f"""
        import json, torch
        from transformers import AutoConfig
        from usaf.model.hf import build_skeleton
        from usaf.base.writer import prepare_store
        from usaf.quant import nf4
        torch.set_num_threads(2)
        build_skeleton(AutoConfig.from_pretrained({str(src)!r}))  # imports everything preparing needs
        nf4.quantize(torch.randn(64, 64))
        def status(field):
            return next(int(l.split()[1]) << 10 for l in open("/proc/self/status") if l.startswith(field + ":"))
        baseline = status("VmRSS")
        open("/proc/self/clear_refs", "w").write("5")  # restart the peak (VmHWM) from here
        prepare_store({str(src)!r}, {str(tmp_path / "out")!r}, "nf4", device="cpu")
        print(json.dumps({{"baseline": baseline, "peak": status("VmHWM")}}))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rss = json.loads(done.stdout.strip().splitlines()[-1])
    growth = rss["peak"] - rss["baseline"]
    assert growth < checkpoint_bytes / 4, (growth >> 20, checkpoint_bytes >> 20)
    assert read_store_metadata(tmp_path / "out")["quant"] == "nf4"


def shard_holding(src: Path, key: str) -> Path:
    return src / json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][key]


EXPERT_KEY = "model.layers.1.mlp.experts.3.up_proj.weight"


def truncate(src):
    path = shard_holding(src, EXPERT_KEY)
    os.truncate(path, path.stat().st_size - 100)
    return path.name, "truncated"


def garble_header(src):
    path = shard_holding(src, EXPERT_KEY)
    with open(path, "r+b") as f:
        f.seek(12)
        f.write(b"\x00\xff" * 8)
    return path.name, "corrupted"


def garble_data(src):
    path = shard_holding(src, EXPERT_KEY)
    entry = shards.read_header(path)[0][EXPERT_KEY]
    with open(path, "r+b") as f:
        f.seek(entry.begin)
        f.write(b"\xff" * 64)
    return EXPERT_KEY, "corrupted"


def drop_tensor(src):
    path = shard_holding(src, EXPERT_KEY)
    tensors = load_file(path)
    del tensors[EXPERT_KEY]
    save_file(tensors, path, metadata={"format": "pt"})
    return EXPERT_KEY, "missing"


def drop_tensor_and_index(src):
    drop_tensor(src)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    del index["weight_map"][EXPERT_KEY]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    return EXPERT_KEY, "lacks"


@pytest.mark.parametrize("damage", [truncate, garble_header, garble_data, drop_tensor, drop_tensor_and_index])
def test_a_damaged_checkpoint_fails_clearly_and_leaves_no_store(tmp_path, damage):
    src, out = tmp_path / "src", tmp_path / "out"
    save_checkpoint(src)
    named, word = damage(src)
    with pytest.raises(UsafError, match=word) as err:
        prepare_store(src, out, "int8")
    assert named in str(err.value)
    assert no_store_left(out)


def test_an_interrupted_preparation_leaves_no_store(tmp_path, monkeypatch):
    from usaf.io.source import SourceCheckpoint

    src, out = tmp_path / "src", tmp_path / "out"
    save_checkpoint(src)
    calls = []
    build = SourceCheckpoint.build_expert

    def failing(self, name, expert):
        calls.append(name)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return build(self, name, expert)

    monkeypatch.setattr(SourceCheckpoint, "build_expert", failing)
    with pytest.raises(KeyboardInterrupt):
        prepare_store(src, out, "int8")
    assert no_store_left(out)


def rewrite_tensor(path: Path, key: str, keep_mtime: bool):
    stat = path.stat()
    tensors = load_file(path)
    tensors[key] = tensors[key] + 1e-3
    save_file(tensors, path, metadata={"format": "pt"})
    if keep_mtime:  # the same size and time: found only when the tensor is read
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


@pytest.mark.parametrize("keep_mtime", [False, True])
def test_a_source_that_changed_since_preparation_is_refused(tmp_path, keep_mtime):
    src, out = tmp_path / "src", tmp_path / "out"
    save_checkpoint(src)
    prepare_store(src, out, "int8")
    path = shard_holding(src, EXPERT_KEY)
    rewrite_tensor(path, EXPERT_KEY, keep_mtime)
    with pytest.raises(UsafError, match="differs from the one the store was prepared from") as err:
        load(out, src)
    assert EXPERT_KEY in str(err.value) and path.name in str(err.value)


def test_existing_outputs_and_damaged_stores(tmp_path, capsys):
    src, out = tmp_path / "src", tmp_path / "out"
    save_checkpoint(src)
    assert cli_main(["prepare", str(src), "--quant", "int4", "--out", str(out)]) == 0
    assert "int4" in capsys.readouterr().out and read_store_metadata(out)["quant"] == "int4"
    assert cli_main(["prepare", str(src), "--quant", "int8", "--out", str(out)]) == 2  # exists, no --force
    assert "--force" in capsys.readouterr().err and read_store_metadata(out)["quant"] == "int4"
    assert cli_main(["prepare", str(src), "--quant", "int8", "--out", str(out), "--force"]) == 0
    assert read_store_metadata(out)["quant"] == "int8"
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(UsafError, match="not a usaf prepared store"):
        prepare_store(src, other, "int8", force=True)
    assert (other / "notes.txt").exists()
    store_file = next(out.glob("usaf-*.safetensors"))
    os.truncate(store_file, store_file.stat().st_size - 10)
    with pytest.raises(UsafError, match="truncated") as err:
        load(out)
    assert store_file.name in str(err.value)
    with pytest.raises(UsafError, match="not a prepared usaf store"):
        load(tmp_path / "src")


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def test_training_loads_a_checkpoint_through_the_cache_of_prepared_stores(qwen, tmp_path, monkeypatch):
    from usaf.base.load import load_for_training
    from usaf.config import ModelSection

    reference, src, store = qwen
    monkeypatch.setenv("USAF_CACHE", str(tmp_path / "cache"))
    select = usaf.UsafConfig(**CONFIG)
    model = ModelSection(path=str(src), quant="int8")
    first = load_for_training(model, select, torch.device("cpu"), torch.float32)
    cached = list((tmp_path / "cache" / "prepared").iterdir())
    assert len(cached) == 1 and read_store_metadata(cached[0])["quant"] == "int8"
    stamp = (cached[0] / "usaf_store.json").stat().st_mtime_ns
    again = load_for_training(
        model, select, torch.device("cpu"), torch.float32
    )  # from the cache: not prepared again
    assert (cached[0] / "usaf_store.json").stat().st_mtime_ns == stamp
    with torch.no_grad():
        assert torch.equal(first(IDS).logits, again(IDS).logits)
    stored = ModelSection(path=str(store), quant="nf4")  # a prepared store, used as it is
    loaded = load_for_training(stored, select, torch.device("cpu"), torch.float32)
    for name, delta in usaf.get_delta(loaded).items():  # from the recorded source: the original values
        assert torch.equal(
            delta.values.detach().reshape(-1), reference.state_dict()[name].reshape(-1)[delta.flat_indices]
        )
    # experts streamed from host memory with a device cache, set from the run's config: the same model
    host = ModelSection(path=str(store), quant="nf4", residency="host", cache_mb=1)
    streamed = load_for_training(host, select, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        assert torch.equal(streamed(IDS).logits, loaded(IDS).logits)
    with pytest.raises(UsafError, match=r"is a store prepared as nf4 .*, but model\.quant=int8"):
        load_for_training(
            ModelSection(path=str(store), quant="int8"), select, torch.device("cpu"), torch.float32
        )


def _entry_bytes(model, optimizer) -> dict[str, float]:
    """Bytes per trained entry of each quantized expert tensor: everything the entries, their gradient and their
    optimizer state hold, less the per-tensor expert offsets."""
    from usaf.engine.installed import sparse_experts

    per_entry = {}
    for path, state in sparse_experts(model):
        for name, entries in state.items():
            held = [*entries.buffers(), entries.values, entries.values.grad]
            held += [t for t in optimizer.state[entries.values].values() if t.dim() > 0]
            total = sum(t.numel() * t.element_size() for t in held) - entries.expert_offsets.numel() * 8
            per_entry[f"{path}.{name}"] = total / entries.numel()
    return per_entry


def test_a_trained_entry_on_a_quantized_store_costs_16_bytes(qwen):
    from usaf.train.optim import CompactAdamW

    _, src, out = qwen
    model = load(out, src)
    values = [p for n, p in model.named_parameters() if n.endswith(".values")]
    optimizer = CompactAdamW([{"params": values, "lr": 1e-3, "compact": True}])
    causal_lm_loss(model, IDS, IDS).backward()
    optimizer.step()
    sizes = _entry_bytes(model, optimizer)
    assert sizes and all(v == 16 for v in sizes.values()), (
        sizes
    )  # value 4, int32 index 4, grad 4, moments 2 + 2
    for _, state in usaf.engine.installed.sparse_experts(model):
        assert all(e.base_values is None for e in state.values())  # the store gives the base back


def test_reselection_on_a_quantized_store_reverts_to_the_dequantized_base(qwen):
    from usaf.selection.reselect import Reselector
    from usaf.train.optim import CompactAdamW

    reference, src, out = qwen
    config = usaf.UsafConfig(
        **{**CONFIG, "selection": "random", "reselect_every": 2, "reselect_fraction": 0.5}
    )
    model = load_prepared(out, src, config, device="cpu", dtype=torch.float32)
    values = [p for n, p in model.named_parameters() if n.endswith(".values")]
    optimizer = CompactAdamW([{"params": values, "lr": 1e-2, "compact": True}])
    reselector = Reselector(model, config, total_steps=10)
    before = {k: d.flat_indices.clone() for k, d in usaf.get_delta(model).items()}
    info = None
    for step in (1, 2):
        info = reselecting_step(model, optimizer, reselector, step, IDS) or info
    assert info and info["reselected_entries"] > 0
    for k, d in usaf.get_delta(model).items():
        assert d.flat_indices.numel() == before[k].numel()
        assert not torch.equal(d.flat_indices, before[k])
    # dropped entries read as the dequantized base again: the model equals the store with today's values written in
    plain = naive_reference(reference, out, model)
    with torch.no_grad():
        assert (model(IDS).logits - plain(IDS).logits).abs().max() < 1e-5


def test_the_backward_streams_only_the_experts_its_forward_routed_to(tmp_path):
    """Host residency: going down (the backward), a layer's copy holds only the experts its forward routed to, and
    nothing is fetched outside the copies; training is the same as with the experts on the device."""
    save_checkpoint(tmp_path / "src", num_hidden_layers=4)
    prepare_store(tmp_path / "src", tmp_path / "nf4", "nf4")
    ids = IDS[:, :2]  # 4 tokens, 2 experts each: at most 8 routed rows per layer
    results = {}
    for residency in ("device", "host"):
        model = load(tmp_path / "nf4", residency=residency)
        model.train()
        streamer = model_state(model).store.streamer
        fills, outside = [], []
        if streamer is not None:
            fill, fetch = streamer._fill, streamer.fetch

            def recording_fill(layer, copy, non_blocking, fill=fill, streamer=streamer, fills=fills):
                fill(layer, copy, non_blocking)
                fills.append((layer, streamer.direction, {e for rows in copy.rows.values() for e in rows}))

            def recording_fetch(
                parts, expert_ids, fetch=fetch, streamer=streamer, fills=fills, outside=outside
            ):
                before, copies = streamer.bytes_streamed, len(fills)
                out = fetch(parts, expert_ids)
                if len(fills) == copies and streamer.bytes_streamed != before:
                    outside.append((parts.layer, expert_ids))  # a fetch outside any layer copy
                return out

            streamer._fill, streamer.fetch = recording_fill, recording_fetch
        losses, grads = [], []
        for _ in range(2):
            fills.clear()
            loss = model(ids, labels=ids).loss
            routed = {layer: set(experts) for layer, experts in (streamer.routed if streamer else {}).items()}
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
            model.zero_grad()
            losses.append(loss.item())
        results[residency] = (losses, grads)
    assert results["device"][0] == results["host"][0]
    for a, b in zip(results["device"][1], results["host"][1], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    layers = sorted(streamer.layers)
    experts = streamer.layers[layers[0]][0].num_experts
    down = [(layer, copied) for layer, direction, copied in fills if direction < 0 and layer != layers[0]]
    assert down, fills
    for layer, copied in down:
        assert copied == routed[layer], (layer, copied, routed)
    assert any(len(copied) < experts for _, copied in down), down  # some layer routed to fewer than all
    assert not outside


@pytest.mark.slow
def test_the_metrics_row_counts_the_bytes_streamed_and_routed_only_backward_moves_less(tmp_path, monkeypatch):
    """`usaf train` with host-resident experts: every metrics row carries `streamed_bytes` (host -> device bytes of
    that step), fewer than the same steps stream when every layer is copied whole (LayerStreamer(routed_only=False));
    device residency reports 0. Few tokens over many experts, so that a layer's backward routes to fewer than all."""
    from helpers import write_copy_task

    from usaf.config import RunConfig
    from usaf.store import offload
    from usaf.train.loop import train
    from usaf.train.tokenizer import char_tokenizer

    tokenizer = char_tokenizer()
    model = tiny_model("qwen3_moe", vocab_size=len(tokenizer), num_experts=32, num_hidden_layers=3)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    write_copy_task(tmp_path / "train.jsonl", 16)

    def rows(residency, routed_only=True):
        original = offload.LayerStreamer.__init__

        def init(self, *args, **kwargs):
            original(self, *args, **kwargs)
            self.routed_only = routed_only

        monkeypatch.setattr(offload.LayerStreamer, "__init__", init)
        run = tmp_path / f"run-{residency}-{routed_only}"
        config = RunConfig.load(
            None,
            [
                f"model.path={tmp_path / 'model'}",
                f"data.train={tmp_path / 'train.jsonl'}",
                "model.quant=nf4",
                f"model.residency={residency}",
                "model.device=cpu",
                "model.dtype=float32",
                "data.max_seq_len=16",
                "data.batch_size=1",
                "select.density=0.1",
                "schedule.max_steps=2",
                "schedule.warmup_steps=1",
                "log.progress=false",
                "log.tensorboard=false",
            ],
        )
        train(config, run)
        return [
            json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line
        ]

    routed, whole, device = rows("host"), rows("host", routed_only=False), rows("device")
    assert len(routed) == len(whole) == 2
    assert all(r["streamed_bytes"] == 0 for r in device)
    for r, w in zip(routed, whole, strict=True):
        assert 0 < r["streamed_bytes"] < w["streamed_bytes"], (r["streamed_bytes"], w["streamed_bytes"])
    assert [r["loss"] for r in routed] == [w["loss"] for w in whole]  # the same step, fewer bytes


@pytest.mark.parametrize("where", ["experts", "dense"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_prepare_refuses_a_checkpoint_with_non_finite_values_naming_the_tensor(tmp_path, where, bad):
    src = tmp_path / "src"
    tiny_model("qwen3_moe").save_pretrained(src)
    path = next(src.glob("*.safetensors"))
    tensors = load_file(path)
    key = next(
        k
        for k in tensors
        if ("experts.1." in k or "experts.gate_up" in k if where == "experts" else "q_proj" in k)
        and tensors[k].is_floating_point()
    )
    tensors[key].view(-1)[7] = bad
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(UsafError, match=r"Non-finite values in .*corrupted"):
        prepare_store(src, tmp_path / "out", "nf4", device="cpu")
