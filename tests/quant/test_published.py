"""Published pre-quantized checkpoints as the frozen base: gpt-oss's MXFP4 experts and block-scaled FP8 (Qwen3-*-FP8,
DeepSeek-V3) are read as published, dequantized exactly as transformers' own dequantized load (the reference), trained
on, and exported as plain bf16 checkpoints."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, FineGrainedFP8Config, Mxfp4Config
from transformers.integrations.finegrained_fp8 import Fp8Dequantize
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

import usaf
from usaf.base import writer
from usaf.base.checkpoint import BaseCheckpoint
from usaf.base.load import load_prepared, read_store_metadata
from usaf.base.writer import prepare_store
from usaf.cli import main
from usaf.errors import UsafError
from usaf.export.delta import read_delta
from usaf.io import published
from usaf.io.shards import read_header, read_tensor
from usaf.quant import fp8, mxfp4
from usaf.store.quantized import QuantizedStore
from usaf.testing.published import make_fp8_moe, make_mxfp4_gpt_oss

BLOCK = 8  # the tiny FP8 checkpoint's weight_block_size (128 in the published ones)
CHECKPOINTS = ["mxfp4", "fp8", "fp8-deepseek"]
CONFIG = dict(density=0.1, selection="random", targets=["experts", "routers"])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("published")
    return {
        "mxfp4": make_mxfp4_gpt_oss(root / "gpt-oss-mxfp4"),
        "fp8": make_fp8_moe(root / "qwen3-moe-fp8", block=BLOCK),
        "fp8-deepseek": make_fp8_moe(root / "deepseek-v3-fp8", "deepseek_v3", block=BLOCK),
    }


def reference(folder, kind):
    """transformers' own dequantized load (bf16, the checkpoint's dtype)."""
    method = kind.split("-")[0]
    qc = (
        Mxfp4Config(dequantize=True)
        if method == "mxfp4"
        else FineGrainedFP8Config(dequantize=True, weight_block_size=(BLOCK, BLOCK))
    )
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, quantization_config=qc).eval()


def tensors_of(folder):
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def test_dequantizers_equal_transformers_and_dequantize_only_the_routed_experts(checkpoints):
    tensors = tensors_of(checkpoints["mxfp4"])
    blocks = tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"]
    scales = tensors["model.layers.0.mlp.experts.gate_up_proj_scales"]
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # [E, in, out]
    rows, cols = want.shape[1:]
    got = mxfp4.dequantize({"blocks": blocks, "scales": scales}, rows, cols, torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    routed = mxfp4.dequantize(
        {"blocks": blocks[[4, 1]], "scales": scales[[4, 1]]}, rows, cols, torch.bfloat16
    )
    assert torch.equal(routed.view(torch.int16), want[[4, 1]].view(torch.int16))

    tensors = tensors_of(checkpoints["fp8"])
    for key in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.experts.3.down_proj.weight"):
        weight, scale = tensors[key], tensors[key + "_scale_inv"]
        want = Fp8Dequantize(None)._dequantize_one(weight, scale, output_dtype=torch.bfloat16)
        got = fp8.dequantize(
            {"data": weight, "scale_inv": scale}, *weight.shape, torch.bfloat16, (BLOCK, BLOCK)
        )
        assert torch.equal(got[0].view(torch.int16), want.view(torch.int16)), key


@pytest.mark.parametrize("kind", CHECKPOINTS)
def test_the_store_holds_the_published_bytes_and_trains_like_transformers_dequantized_load(
    checkpoints, kind, tmp_path
):
    folder, method = checkpoints[kind], kind.split("-")[0]
    store = prepare_store(folder, tmp_path / "store", quant="nf4", device="cpu")  # nf4 asked: published wins
    metadata = read_store_metadata(store)
    assert metadata["quant"] == method
    stored = {}
    for file in metadata["files"]:
        stored.update(read_header(store / file)[0])
    source = tensors_of(folder)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    if method == "mxfp4":  # the checkpoint's own bytes, not a re-quantization
        assert torch.equal(read_tensor(stored[f"{name}:blocks"]), source[f"{name}_blocks"])
        assert torch.equal(read_tensor(stored[f"{name}:scales"]), source[f"{name}_scales"])
    else:
        data = read_tensor(stored[f"{name}:data"])[2].view(torch.uint8)
        experts = "model.layers.1.mlp.experts.2"
        pair = [source[f"{experts}.{p}_proj.weight"].view(torch.uint8) for p in ("gate", "up")]
        assert data.dtype == torch.uint8 and torch.equal(data, torch.cat(pair))
        assert metadata["tensors"][name]["constants"] == {"block": [BLOCK, BLOCK], "values_dtype": "bfloat16"}
    assert not any(t["kind"] == "experts" and t["format"] == "none" for t in metadata["tensors"].values())

    model = load_prepared(store, folder, usaf.UsafConfig(**CONFIG), device="cpu", dtype=torch.float32)
    stores = [  # the expert weights (not gpt-oss's biases): published bytes, dequantized per forward
        store
        for m in model.modules()
        for key, store in getattr(getattr(m, "usaf", None), "stores", {}).items()
        if not key.endswith("_bias")
    ]
    assert stores and all(isinstance(s, QuantizedStore) and s.format_name == method for s in stores)
    plain = reference(folder, kind).float()
    dense = dict(plain.named_parameters())
    for key, change in usaf.get_delta(
        model
    ).items():  # trained values start from the dequantized published ones
        assert torch.equal(
            change.values.detach().reshape(-1), dense[key].detach().reshape(-1)[change.flat_indices]
        )

    ids = torch.randint(3, 90, (2, 9), generator=torch.Generator().manual_seed(0))
    target = torch.randn(2, 9, plain.config.vocab_size, generator=torch.Generator().manual_seed(1))
    logits = {}
    for which, m in (("usaf", model), ("reference", plain)):
        for param in m.parameters() if which == "reference" else ():
            param.requires_grad_(True)
        out = m(input_ids=ids).logits
        (out * target).sum().backward()
        logits[which] = out.detach()
    assert (logits["usaf"] - logits["reference"]).abs().max() < 1e-4
    mapped = load_prepared(
        store, folder, usaf.UsafConfig(**CONFIG), device="cpu", dtype=torch.float32, residency="mmap"
    )
    with torch.no_grad():  # the published bytes memory-mapped from the store: the same model
        torch.testing.assert_close(mapped(input_ids=ids).logits, logits["usaf"], atol=1e-6, rtol=0)
    for key, change in usaf.get_delta(model).items():
        want = dense[key].grad.reshape(-1)[change.flat_indices]
        assert (change.values.grad.reshape(-1) - want).norm() <= 1e-4 * want.norm(), key


@pytest.mark.slow
@pytest.mark.parametrize("kind", CHECKPOINTS)
def test_train_then_export_merged_and_apply_a_delta_against_the_published_checkpoint(
    checkpoints, kind, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("USAF_CACHE", str(tmp_path / "cache"))
    folder, method = checkpoints[kind], kind.split("-")[0]
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"copy {w} ->", "completion": f" {w}"}) + "\n" for w in "abcdef")
    )
    sets = ["schedule.max_steps=2", "data.max_seq_len=32", "data.batch_size=3", "select.density=0.05"]
    # one trained layer: the other layer's experts stay published in the merged checkpoint
    sets += ["log.progress=false", "log.tensorboard=false", "data.eval_fraction=0", "select.layers=[1]"]
    run = tmp_path / "run"
    assert (
        main(["train", f"--model={folder}", f"--data={data}", f"--out={run}", *[f"--set={s}" for s in sets]])
        == 0
    )
    assert f"published {method.upper()} checkpoint: its experts stay {method}" in capsys.readouterr().err
    merged, delta_file, applied = tmp_path / "merged", tmp_path / "delta.safetensors", tmp_path / "applied"
    assert main(["export", str(run), "--merged", str(merged), "--delta", str(delta_file)]) == 0
    assert f"keeps it {method.upper()} where the run changed nothing" in capsys.readouterr().out
    assert main(["apply", str(folder), str(delta_file), str(applied)]) == 0

    # the published format kept: quantization_config, with the modules holding trained entries not converted
    config = json.loads((merged / "config.json").read_text())
    base_qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    record = json.loads((merged / "usaf_delta.json").read_text())
    modules, edited = record["modules_not_converted"], set(record["changed_tensors"])
    assert modules and all(".layers.1." in m for m in modules) and any(m.endswith("experts") for m in modules)
    qc = config["quantization_config"]
    assert qc["modules_to_not_convert"] == [*(base_qc.get("modules_to_not_convert") or []), *modules]
    assert {k: v for k, v in qc.items() if k != "modules_to_not_convert"} == {
        k: v for k, v in base_qc.items() if k != "modules_to_not_convert"
    }
    # every tensor outside those modules is the base's, byte for byte (published parts included); inside them
    # the quantized weights are dequantized, their parts gone
    base_tensors, written = tensors_of(folder), tensors_of(merged)
    parts = ("_blocks", "_scales", "_scale_inv")
    assert any(".mlp.experts." in k and ".layers.1." not in k and k.endswith(parts) for k in written)

    def in_changed(key):
        return any(key.startswith(m + ".") for m in modules)

    for key, value in base_tensors.items():
        if in_changed(key) and key.endswith(parts):
            assert key not in written, key
        elif not in_changed(key) and key not in edited:
            assert written[key].dtype == value.dtype and torch.equal(
                written[key].view(torch.uint8), value.view(torch.uint8)
            ), key
    # the changed modules' quantized weights (new names for MXFP4, FP8 ones under their names) are bf16 now
    dequantized = [
        k for k in written if in_changed(k) and (k not in base_tensors or base_tensors[k].dtype.itemsize == 1)
    ]
    assert dequantized and all(written[k].dtype == torch.bfloat16 for k in dequantized)
    size = lambda d: sum(p.stat().st_size for p in d.glob("*.safetensors"))  # noqa: E731
    changed_bf16 = sum(written[k].numel() * 2 for k in dequantized)
    assert size(merged) <= size(folder) + changed_bf16  # the base, plus the changed modules in bf16

    want = reference(folder, kind).state_dict()
    # transformers' own quantizer loads both (dequantizing on this CPU): the fine-tuned model exactly
    got = reference(merged, kind).state_dict()
    again = reference(applied, kind).state_dict()
    changes = read_delta(delta_file).changes
    assert want.keys() == got.keys() == again.keys()
    for name, before in want.items():
        after = got[name]
        assert after.dtype == before.dtype and torch.equal(after, again[name]), name
        keep = torch.ones(before.numel(), dtype=torch.bool)
        change = changes.get(name)
        if change is not None and change.flat_indices is None:
            continue  # a router: trained whole
        if change is not None:
            keep[change.flat_indices] = False
            assert torch.equal(after.reshape(-1)[change.flat_indices], change.values.to(after.dtype))
        # bit for bit outside the trained entries
        bits = torch.int16 if before.dtype == torch.bfloat16 else torch.int32
        assert torch.equal(before.reshape(-1).view(bits)[keep], after.reshape(-1).view(bits)[keep]), name
    assert any(name in changes for name in want if "experts" in name)


def test_other_quantizations_and_damaged_layouts_are_refused_in_one_line(checkpoints, tmp_path, capsys):
    gptq = tmp_path / "gptq"
    shutil.copytree(checkpoints["fp8"], gptq)
    config = json.loads((gptq / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (gptq / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsafError, match=r"config.json: quantization_config.quant_method is 'gptq'"):
        prepare_store(gptq, tmp_path / "store", device="cpu")
    with pytest.raises(UsafError, match="'gptq'"):
        BaseCheckpoint(gptq)

    config["quantization_config"] = {"quant_method": "fp8"}  # per-tensor FP8: no blocks
    (gptq / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsafError, match="no weight_block_size"):
        prepare_store(gptq, tmp_path / "store", device="cpu")

    damaged = tmp_path / "damaged"
    shutil.copytree(checkpoints["mxfp4"], damaged)
    tensors = tensors_of(damaged)
    key = "model.layers.0.mlp.experts.down_proj_scales"
    tensors[key] = tensors[key][..., :1].contiguous()
    save_file(tensors, str(damaged / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        UsafError, match=r"down_proj_blocks' in .*model.safetensors is U8 .* not the published layout"
    ):
        prepare_store(damaged, tmp_path / "store", device="cpu")
    assert not (tmp_path / "store").exists()
    shutil.rmtree(damaged)
    shutil.copytree(checkpoints["fp8"], damaged)
    tensors = tensors_of(damaged)
    del tensors["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    save_file(tensors, str(damaged / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        UsafError, match=r"o_proj.weight' in .* is FP8 without .*'_scale_inv' tensor beside it"
    ):
        BaseCheckpoint(damaged)

    # told otherwise (one of usaf's formats named), the published experts are stored at it; auto keeps them
    assert published.quant_for(checkpoints["mxfp4"], "nf4") == "nf4"
    assert "model.quant=nf4: " in capsys.readouterr().err
    assert published.quant_for(checkpoints["mxfp4"], "auto") == "mxfp4"
    assert "its experts stay mxfp4 as published" in capsys.readouterr().err
    assert published.quant_for(tmp_path, "nf4") == "nf4"  # not a published checkpoint


@pytest.mark.slow
def test_a_cached_hub_id_of_a_published_checkpoint_trains_from_its_snapshot_folder(
    checkpoints, tmp_path, monkeypatch, capsys
):
    """`--model openai/gpt-oss-20b` as users write it: the hub cache's snapshot folder is read like a local
    checkpoint (the published format, the base recorded), not handed to transformers' loader."""
    import huggingface_hub

    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someorg--tiny-gpt-oss"
    shutil.copytree(checkpoints["mxfp4"], repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("USAF_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": f"copy {w} {w}"}) + "\n" for w in "abcdef"))
    sets = ["schedule.max_steps=1", "data.max_seq_len=32", "select.density=0.05", "log.progress=false"]
    sets += ["log.tensorboard=false", "data.eval_fraction=0"]
    run = tmp_path / "run"
    args = ["train", "--model=someorg/tiny-gpt-oss", f"--data={data}", f"--out={run}"]
    assert main([*args, *[f"--set={s}" for s in sets]]) == 0
    assert "published MXFP4 checkpoint: its experts stay mxfp4" in capsys.readouterr().err
    assert str(repo / "snapshots" / revision) in (run / "config.yaml").read_text()
    assert (run / "base.json").is_file()  # the base's identity, checked by a later export --base


def test_an_unquantized_expert_tensor_in_a_published_checkpoint_is_one_line(tmp_path, capsys):
    folder = make_mxfp4_gpt_oss(tmp_path / "gpt-oss")
    for path in sorted(folder.glob("*.safetensors")):
        tensors = load_file(path)
        blocks = [k for k in tensors if k.endswith("layers.0.mlp.experts.gate_up_proj_blocks")]
        if blocks:
            plain = blocks[0].removesuffix("_blocks")
            experts, cols, groups, _ = tensors.pop(blocks[0]).shape
            tensors.pop(plain + "_scales")
            tensors[plain] = torch.zeros(experts, groups * mxfp4.BLOCK_SIZE, cols, dtype=torch.bfloat16)
            save_file(tensors, path, metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    assert not index.exists()  # one shard: no index to rewrite
    assert main(["prepare", str(folder), "--out", str(tmp_path / "store")]) == 2
    err = capsys.readouterr().err
    assert "gate_up_proj' in" in err and "is not quantized although the checkpoint declares mxfp4" in err
    assert "Traceback" not in err and not (tmp_path / "store").exists()


@pytest.mark.parametrize("kind", ["fp8", "mxfp4"])
def test_prepare_with_quant_given_stores_published_experts_at_that_format(checkpoints, kind, tmp_path):
    """`usaf prepare --quant int8` on a published checkpoint: its experts dequantized one at a time and stored as
    int8 (a 31 GB FP8 Qwen3-30B-A3B becomes a 16 GB NF4 store); without --quant the published bytes are kept."""
    folder = checkpoints[kind]
    store = tmp_path / "store"
    assert main(["prepare", str(folder), "--quant", "int8", "--out", str(store), "--device", "cpu"]) == 0
    metadata = read_store_metadata(store)
    assert metadata["quant"] == "int8" and metadata["requested_quant"] == "int8"
    experts = [t for t in metadata["tensors"].values() if t["kind"] == "experts"]
    assert experts and all(t["format"] == "int8" and "constants" not in t for t in experts)
    model = load_prepared(store, folder, usaf.UsafConfig(**CONFIG), device="cpu", dtype=torch.float32)
    plain = reference(folder, kind).float()
    ids = torch.randint(3, 90, (2, 9), generator=torch.Generator().manual_seed(0))
    # int8 of the dequantized published weights: the published model within int8's error
    with torch.no_grad():
        got, want = model(input_ids=ids).logits, plain(input_ids=ids).logits
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    kept = tmp_path / "kept"
    assert main(["prepare", str(folder), "--out", str(kept), "--device", "cpu"]) == 0
    assert read_store_metadata(kept)["quant"] == kind


def test_prepare_to_nf4_with_workers_stores_bitsandbytes_quantization_of_the_dequantized_experts(
    checkpoints, tmp_path, monkeypatch
):
    """FP8 -> NF4 with experts quantized by two worker threads: every expert's stored bytes are bitsandbytes'
    `quantize_4bit` of its published values dequantized as transformers does (bf16), expert by expert."""
    import bitsandbytes.functional as F

    folder = checkpoints["fp8"]
    monkeypatch.setattr(writer, "PARALLEL_ELEMENTS", 1)  # the tiny experts too
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        store = prepare_store(folder, tmp_path / "store", "nf4", device="cpu", requantize_published=True)
    finally:
        torch.set_num_threads(threads)
    assert torch.get_num_threads() == threads
    metadata = read_store_metadata(store)
    stored = {}
    for file in metadata["files"]:
        entries, _ = read_header(store / file)
        stored.update({k: read_tensor(e) for k, e in entries.items()})
    plain = reference(folder, "fp8").state_dict()
    experts = [n for n, t in metadata["tensors"].items() if t["kind"] == "experts"]
    assert experts
    for name in experts:
        assert metadata["tensors"][name]["format"] == "nf4"
        weights = plain[name]
        assert weights.dtype == torch.bfloat16
        for e, weight in enumerate(weights):
            data, state = F.quantize_4bit(weight.reshape(-1).contiguous(), blocksize=64, quant_type="nf4")
            assert torch.equal(stored[f"{name}:data"][e], data.reshape(-1))
            assert torch.equal(stored[f"{name}:absmax"][e], state.absmax.float().reshape(-1))


def test_train_takes_a_store_prepared_from_a_published_checkpoint(checkpoints, tmp_path, monkeypatch, capsys):
    """A store of published MXFP4 experts is a model of `usaf train` (its format is the store's, which no
    model.quant names: it was refused as `model.quant = 'mxfp4' is not allowed`)."""
    monkeypatch.setenv("USAF_CACHE", str(tmp_path / "cache"))
    store = prepare_store(checkpoints["mxfp4"], tmp_path / "store", device="cpu")
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"copy {w} ->", "completion": f" {w}"}) + "\n" for w in "abc")
    )
    sets = ["schedule.max_steps=1", "data.max_seq_len=32", "data.batch_size=2", "select.density=0.05"]
    sets += ["log.progress=false", "log.tensorboard=false", "data.eval_fraction=0", "model.residency=host"]
    run = tmp_path / "run"
    argv = ["train", f"--model={store}", f"--data={data}", f"--out={run}", *[f"--set={s}" for s in sets]]
    assert main(argv) == 0, capsys.readouterr().err
    assert (run / "metrics.jsonl").exists()


def test_a_published_checkpoint_keeps_its_format_unless_told_otherwise(
    checkpoints, tmp_path, monkeypatch, capsys
):
    """model.quant=auto (the default) keeps a published MXFP4 checkpoint's experts as published, in the plan and in
    the run; model.quant=int8 is never overridden: the plan plans int8 and the run trains on an int8 store."""
    folder = checkpoints["mxfp4"]
    assert main(["plan", "--model", str(folder)]) in (0, 1)
    assert "  base:      experts mxfp4" in capsys.readouterr().out
    assert main(["plan", "--model", str(folder), "--quant", "int8"]) in (0, 1)
    assert "  base:      experts int8" in capsys.readouterr().out
    monkeypatch.setenv("USAF_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": f"copy {w} {w}"}) + "\n" for w in "abc"))
    sets = ["schedule.max_steps=1", "data.max_seq_len=32", "select.density=0.05", "log.progress=false"]
    sets += ["log.tensorboard=false", "data.eval_fraction=0", "model.quant=int8"]
    run = tmp_path / "run"
    argv = ["train", f"--model={folder}", f"--data={data}", f"--out={run}", *[f"--set={s}" for s in sets]]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "stored as int8" in err and "  base:      experts int8" in out
    stores = list((tmp_path / "cache" / "prepared").glob("*/usaf_store.json"))
    assert len(stores) == 1 and read_store_metadata(stores[0].parent)["quant"] == "int8"


def test_full_size_writer_has_the_tiny_builders_layout_sharded_with_an_index(checkpoints, tmp_path):
    """write_full_published (scripts/make_published_checkpoints.py --full) streams a preset's shapes into the
    published layout: at the tiny builders' config, the same names, shapes and dtypes, split into shards that
    model.safetensors.index.json maps, every value finite, the same bytes from the same seed."""
    from usaf.testing.published import write_full_published

    for kind, zero_based in (("mxfp4", True), ("fp8", False)):
        config = json.loads((checkpoints[kind] / "config.json").read_text())
        want = {k: (tuple(v.shape), v.dtype) for k, v in tensors_of(checkpoints[kind]).items()}
        folder = write_full_published(tmp_path / kind, config, block=BLOCK, shard_bytes=20_000)
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        assert len(files) > 2 and files[0].startswith("model-00000-" if zero_based else "model-00001-")
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        assert sorted(set(index["weight_map"].values())) == files
        got = tensors_of(folder)
        assert {k: (tuple(v.shape), v.dtype) for k, v in got.items()} == want
        assert index["weight_map"].keys() == got.keys()
        assert json.loads((folder / "config.json").read_text())["quantization_config"]["quant_method"] == kind
        again = tensors_of(write_full_published(tmp_path / f"{kind}-again", config, block=BLOCK))
        assert all(torch.equal(got[k].view(torch.uint8), again[k].view(torch.uint8)) for k in got)
        model = reference(folder, kind)  # transformers dequantizes it
        assert all(torch.isfinite(p).all() for p in model.parameters())


def test_plan_of_a_store_converted_from_a_published_checkpoint_plans_the_stores_format(
    checkpoints, tmp_path, capsys
):
    """A store of `usaf prepare --quant nf4` on an FP8 checkpoint carries the checkpoint's config.json (its
    quantization_config fp8): the plan, from --model or a config's model.path, is of NF4 experts, not of FP8 kept
    as published (which planned Qwen3-30B-A3B's NF4 store at 31 GB, "does not fit", for 19 GB)."""
    store = prepare_store(
        checkpoints["fp8"], tmp_path / "store", "nf4", device="cpu", requantize_published=True
    )
    config = tmp_path / "run.yaml"
    config.write_text(f"model:\n  path: {store}\n  device: cpu\n")
    for argv in (["plan", "--model", str(store)], ["plan", "--config", str(config)]):
        capsys.readouterr()
        assert main(argv) in (0, 1)
        out = capsys.readouterr().out
        assert "experts nf4" in out and "experts fp8" not in out and "as published" not in out, out
