"""Getting the model out: delta files, merged checkpoints, `usaf apply`, their guards, and transformers.Trainer.

The acceptance checks load exports with plain transformers in a subprocess that never imports usaf.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import EXPERTS_AND_ROUTERS, copy_sequences, make_model_dir, write_copy_task
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import usaf
from usaf.base.checkpoint import BaseCheckpoint
from usaf.cli import main
from usaf.config import RunConfig
from usaf.errors import UsafError
from usaf.export.delta import read_delta
from usaf.prepare import get_delta
from usaf.testing.tiny import tiny_model
from usaf.train import checkpoint, runtime
from usaf.train.tokenizer import char_tokenizer

ROUND_TRIP = {  # every tested family; granularity alternates (neurons exercise whole-line selections)
    "qwen3_moe": "element",
    "qwen2_moe": "neuron",
    "olmoe": "element",
    "mixtral": "neuron",
    "gpt_oss": "element",
    "deepseek_v3": "element",
    "glm4_moe": "neuron",
    "granitemoe": "element",
    "gemma4_text": "neuron",
}

PLAIN_LOGITS = """
import json, sys
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

jobs, out = json.loads(sys.argv[1]), {}
for tag, model_dir, ids_file in jobs:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        out[tag] = model(input_ids=load_file(ids_file)["input_ids"]).logits.contiguous()
assert not any(name == "usaf" or name.startswith("usaf.") for name in sys.modules), "usaf was imported"
save_file(out, sys.argv[2])
"""


def plain_logits(jobs: list[tuple[str, Path, Path]], out: Path) -> dict[str, torch.Tensor]:
    """Logits of each model directory, computed by transformers alone in a fresh process."""
    done = subprocess.run(
        [sys.executable, "-c", PLAIN_LOGITS, json.dumps([[t, str(d), str(i)] for t, d, i in jobs]), str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return load_file(str(out))


def model_dir(folder: Path, family: str, shard_kb: int | None = None, dtype=torch.float32) -> Path:
    tokenizer = char_tokenizer()
    model = tiny_model(family, vocab_size=len(tokenizer), dtype=dtype)
    kwargs = {"max_shard_size": f"{shard_kb}KB"} if shard_kb else {}
    model.save_pretrained(folder, **kwargs)
    tokenizer.save_pretrained(folder)
    return folder


def adamw_steps(model, input_ids: torch.Tensor, steps: int = 3, lr: float = 2e-2) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for _ in range(steps):
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


def save_run(run_dir: Path, model, optimizer, model_path: Path, *overrides: str) -> Path:
    """A usaf run directory holding one finished checkpoint of `model` (as `usaf train` writes them)."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(
        RunConfig.load(None, [f"model.path={model_path}", *overrides]).to_yaml()
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    state = {"rng": runtime.rng_state(), "data": {}}
    checkpoint.save(
        run_dir, 3, model=model, optimizer=optimizer, scheduler=scheduler, state=state, keep_last=1
    )
    return run_dir


def logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=input_ids).logits


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Per family: a base checkpoint, a run trained on it for three steps, the inputs and the trained logits."""
    root = tmp_path_factory.mktemp("export")
    torch.manual_seed(0)
    input_ids = torch.randint(8, 100, (2, 10))
    save_file({"input_ids": input_ids}, str(root / "ids.safetensors"))
    runs = {}
    for family, granularity in ROUND_TRIP.items():
        # qwen3_moe in several shards: the index file and multi-shard streaming are part of the round trip
        base = model_dir(root / family / "base", family, shard_kb=40 if family == "qwen3_moe" else None)
        model = AutoModelForCausalLM.from_pretrained(base)
        before = logits(model, input_ids)
        usaf.prepare_model(
            model, usaf.UsafConfig(density=0.1, granularity=granularity, targets=EXPERTS_AND_ROUTERS)
        )
        optimizer = adamw_steps(model, input_ids)
        runs[family] = {
            "base": base,
            "run": save_run(root / family / "run", model, optimizer, base),
            "model": model,
            "logits": logits(model, input_ids),
            "before": before,
        }
    return {"root": root, "ids": root / "ids.safetensors", "input_ids": input_ids, "runs": runs}


@pytest.mark.slow
def test_round_trip_merged_and_applied_load_in_plain_transformers(trained):
    root, jobs = trained["root"], []
    for family, run in trained["runs"].items():
        out = root / family
        assert main(["export", str(run["run"]), "--merged", str(out / "merged")]) == 0
        assert main(["export", str(run["run"]), "--delta", str(out / "delta.safetensors")]) == 0
        assert main(["apply", str(run["base"]), str(out / "delta.safetensors"), str(out / "applied")]) == 0
        jobs += [
            (f"{family}/merged", out / "merged", trained["ids"]),
            (f"{family}/applied", out / "applied", trained["ids"]),
        ]
        for folder in ("merged", "applied"):
            made = out / folder
            base_files = sorted(p.name for p in run["base"].iterdir())
            assert sorted(p.name for p in made.iterdir()) == sorted([*base_files, "usaf_delta.json"])
            shard = _first_shard(made)
            with safe_open(made / shard, "pt") as f, safe_open(run["base"] / shard, "pt") as g:
                assert f.metadata() == g.metadata()
    assert (root / "qwen3_moe" / "merged" / "model.safetensors.index.json").exists()

    got = plain_logits(jobs, root / "plain_logits.safetensors")
    for family, run in trained["runs"].items():
        assert not torch.allclose(run["logits"], run["before"], atol=1e-4), (
            f"{family}: training changed nothing"
        )
        for kind in ("merged", "applied"):
            torch.testing.assert_close(
                got[f"{family}/{kind}"], run["logits"], atol=2e-5, rtol=1e-5, msg=f"{family} {kind}"
            )


def _first_shard(folder: Path) -> str:
    return sorted(p.name for p in folder.glob("*.safetensors"))[0]


def test_merged_checkpoint_keeps_names_dtypes_and_untouched_bytes(trained):
    run = trained["runs"]["qwen3_moe"]
    out = trained["root"] / "qwen3_moe" / "kept"
    usaf.export.merged.export_merged(run["run"], out)
    assert (out / "model.safetensors.index.json").read_bytes() == (
        run["base"] / "model.safetensors.index.json"
    ).read_bytes()
    report = json.loads((out / "usaf_delta.json").read_text())
    changed = report["changed_tensors"]
    assert changed and all(info["changed_entries"] > 0 for info in changed.values())
    for shard in sorted(p.name for p in run["base"].glob("*.safetensors")):
        with safe_open(run["base"] / shard, "pt") as a, safe_open(out / shard, "pt") as b:
            assert sorted(a.keys()) == sorted(b.keys())
            for key in a.keys():  # noqa: SIM118 (safe_open handles have no __iter__)
                x, y = a.get_tensor(key), b.get_tensor(key)
                assert x.dtype == y.dtype and x.shape == y.shape
                if key not in changed:
                    assert torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8)), key


def test_delta_file_is_small_and_self_describing(trained):
    run = trained["runs"]["gpt_oss"]
    path = trained["root"] / "gpt_oss" / "small.safetensors"
    usaf.export.delta.export_delta(run["run"], path)
    delta = read_delta(path)
    info = delta.info
    assert info["usaf_version"] == usaf.__version__ and info["base"]["model_type"] == "gpt_oss"
    assert len(info["base"]["config_sha256"]) == 64 and info["base"]["tensors"]
    # every tensor of the base by its cheap facts, the ones the delta changes by their whole sha256 too
    assert all(len(t["sample_sha256"]) == 64 for t in info["base"]["tensors"].values())
    hashed = {key for key, t in info["base"]["tensors"].items() if len(t.get("sha256", "")) == 64}
    assert hashed == {key for change in info["changes"].values() for key in change["source_tensors"]}
    trained_values = get_delta(run["model"])
    for name, change in trained_values.items():
        entry = info["changes"][name]
        assert entry["index_dtype"] == "I32" and entry["values_dtype"] == "F32"
        assert torch.equal(delta.changes[name].flat_indices, change.flat_indices.sort().values)
    routers = [n for n, e in info["changes"].items() if e["kind"] == "full"]
    assert routers and all("router" in n for n in routers)
    entries = sum(c.count for c in delta.changes.values())
    base_bytes = sum(p.stat().st_size for p in run["base"].glob("*.safetensors"))
    assert path.stat().st_size < 0.35 * base_bytes
    assert path.stat().st_size < entries * 8 + 64 * 1024  # values + int32 indices + metadata
    umask = os.umask(0o022)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # not the private file safetensors creates

    fp32 = trained["root"] / "gpt_oss" / "fp32.safetensors"
    assert main(["export", str(run["run"]), "--delta", str(fp32), "--fp32"]) == 0
    assert all(e["values_dtype"] == "F32" for e in read_delta(fp32).info["changes"].values())


def test_load_delta_into_plain_and_prepared_models(trained):
    run = trained["runs"]["mixtral"]
    path = trained["root"] / "mixtral" / "for_loading.safetensors"
    usaf.export.delta.export_delta(run["run"], path)
    ids = trained["input_ids"]

    plain = usaf.load_delta(AutoModelForCausalLM.from_pretrained(run["base"]), path, base_dir=run["base"])
    torch.testing.assert_close(logits(plain, ids), run["logits"], atol=2e-5, rtol=1e-5)

    # a prepared model with another selection (elements, not neurons): the delta's entries become its trained values
    prepared = usaf.prepare_model(
        AutoModelForCausalLM.from_pretrained(run["base"]), usaf.UsafConfig(density=0.02)
    )
    usaf.load_delta(prepared, path)
    torch.testing.assert_close(logits(prepared, ids), run["logits"], atol=2e-5, rtol=1e-5)
    loaded = get_delta(prepared)
    for name, change in get_delta(run["model"]).items():
        order = torch.argsort(change.flat_indices)
        assert torch.equal(loaded[name].flat_indices, change.flat_indices[order])
        torch.testing.assert_close(loaded[name].values.reshape(-1), change.values.reshape(-1)[order])

    with pytest.raises(UsafError, match="was made for a mixtral model"):
        usaf.load_delta(AutoModelForCausalLM.from_pretrained(trained["runs"]["qwen3_moe"]["base"]), path)


@pytest.mark.slow
def test_usaf_train_run_exports_with_its_summary(tmp_path):
    base = make_model_dir(tmp_path / "base", "olmoe")
    data = write_copy_task(tmp_path / "train.jsonl", 32)
    sets = ["schedule.max_steps=3", "data.max_seq_len=32", "data.batch_size=4", "select.density=0.05"]
    sets += ["log.progress=false", "log.tensorboard=false", "data.eval_fraction=0"]
    run = tmp_path / "run"
    args = ["train", f"--model={base}", f"--data={data}", f"--out={run}", *[f"--set={s}" for s in sets]]
    assert main(args) == 0
    assert (
        main(
            ["export", str(run), "--delta", str(tmp_path / "d.safetensors"), "--merged", str(tmp_path / "m")]
        )
        == 0
    )
    info = read_delta(tmp_path / "d.safetensors").info
    assert info["training"]["steps"] == 3 and info["source"]["checkpoint"] == "step-00000003"
    merged = json.loads((tmp_path / "m" / "usaf_delta.json").read_text())
    assert merged["training"]["steps"] == 3 and merged["base"]["model_type"] == "olmoe"


# ---- a quantized base -------------------------------------------------------------------------------------------


def test_nf4_trained_run_merges_into_the_original_precision(tmp_path):
    from usaf.base import load
    from usaf.base.writer import prepare_store

    base = model_dir(tmp_path / "base", "qwen3_moe", dtype=torch.bfloat16)
    store = prepare_store(base, tmp_path / "store", quant="nf4", device="cpu")
    quant = load.read_store_metadata(store)["quant"]
    model = load.load_prepared(store, base, usaf.UsafConfig(density=0.1), device="cpu")
    input_ids = torch.randint(8, 100, (2, 10))
    optimizer = adamw_steps(model, input_ids)
    run = save_run(tmp_path / "run", model, optimizer, store, f"model.quant={quant}")
    assert main(["export", str(run), "--merged", str(tmp_path / "merged")]) == 0
    assert main(["export", str(run), "--delta", str(tmp_path / "delta.safetensors")]) == 0

    # every tensor outside the trained entries is byte-identical to the base (the base is never re-quantized), and
    # the trained entries hold the trained values cast to the base's dtype
    trained_values = get_delta(model)
    original = AutoModelForCausalLM.from_pretrained(base).state_dict()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    routers = {n for n, p in model.named_parameters() if p.requires_grad and ".usaf." not in n}
    assert original.keys() == merged.keys()
    for name, before in original.items():
        after = merged[name]
        assert after.dtype == before.dtype == torch.bfloat16
        if name in routers:
            continue
        keep = torch.ones(before.numel(), dtype=torch.bool)
        if name in trained_values:
            change = trained_values[name]
            keep[change.flat_indices] = False
            assert torch.equal(
                after.view(-1)[change.flat_indices], change.values.reshape(-1).to(torch.bfloat16)
            )
        before_bits, after_bits = (t.reshape(-1).view(torch.int16)[keep] for t in (before, after))
        assert torch.equal(before_bits, after_bits), name
    for name in routers:
        assert torch.equal(merged[name], dict(model.named_parameters())[name].detach().to(torch.bfloat16))

    # "the trained model without quantization": the full-precision base with the delta loaded
    plain = usaf.load_delta(AutoModelForCausalLM.from_pretrained(base), tmp_path / "delta.safetensors")
    merged_model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(logits(merged_model, input_ids), logits(plain, input_ids), atol=0, rtol=0)

    with pytest.raises(UsafError, match=r"prepared \(quantized\) store"):
        usaf.export.merged.apply_delta(store, tmp_path / "delta.safetensors", tmp_path / "from_store")

    # the delta also loads into the quantized model for inference
    requantized = load.load_prepared(store, base, usaf.UsafConfig(density=0.05), device="cpu")
    usaf.load_delta(requantized, tmp_path / "delta.safetensors")
    torch.testing.assert_close(logits(requantized, input_ids), logits(model, input_ids), atol=1e-2, rtol=1e-2)


# ---- atomicity and guards -------------------------------------------------------------------------------------

KILLER = """
import os, signal, sys
import usaf.export.merged as export
from usaf.base.checkpoint import BaseCheckpoint
from usaf.cli import main

write_shard = export._write_shard
def write_then_die(*args, **kwargs):
    write_shard(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)  # after the first shard is complete on disk
export._write_shard = write_then_die
sys.exit(main(sys.argv[1:]))
"""


def test_killed_export_leaves_nothing_that_looks_complete(trained, tmp_path):
    run = trained["runs"]["qwen3_moe"]
    assert len(list(run["base"].glob("*.safetensors"))) > 1
    out = tmp_path / "merged"
    killed = subprocess.run(
        [sys.executable, "-c", KILLER, "export", str(run["run"]), "--merged", str(out)],
        capture_output=True,
        text=True,
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not out.exists()
    leftovers = list(tmp_path.iterdir())
    assert leftovers and all(p.name.startswith(".merged.usaf-tmp-") for p in leftovers)
    assert not any((p / "usaf_delta.json").exists() or (p / "config.json").exists() for p in leftovers)

    assert (
        main(["export", str(run["run"]), "--merged", str(out)]) == 0
    )  # a new export clears the dead one's files
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]
    assert (out / "usaf_delta.json").exists()


def test_apply_refuses_a_base_whose_tensors_differ(trained, tmp_path):
    run = trained["runs"]["gpt_oss"]
    delta = tmp_path / "delta.safetensors"
    usaf.export.delta.export_delta(run["run"], delta)
    other = tmp_path / "other_base"
    shutil.copytree(run["base"], other)
    tensors = load_file(str(other / "model.safetensors"))
    tensors["model.layers.1.mlp.experts.down_proj"][0, 0, 0] += (
        1.0  # one weight of a tensor the delta changes
    )
    save_file(tensors, str(other / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UsafError, match=r"model\.layers\.1\.mlp\.experts\.down_proj.*differs from the base"):
        usaf.export.merged.apply_delta(other, delta, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))
    with pytest.raises(UsafError, match="differs from the base"):
        usaf.load_delta(AutoModelForCausalLM.from_pretrained(other), delta, base_dir=other)
    # another family altogether
    with pytest.raises(UsafError, match="was made for a gpt_oss model"):
        usaf.export.merged.apply_delta(trained["runs"]["mixtral"]["base"], delta, tmp_path / "out")


def test_truncated_or_corrupted_delta_is_refused(trained, tmp_path):
    delta = tmp_path / "delta.safetensors"
    usaf.export.delta.export_delta(trained["runs"]["deepseek_v3"]["run"], delta)
    raw = delta.read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(raw[: len(raw) - 100])
    with pytest.raises(
        UsafError, match=r"truncated.*truncated\.safetensors|truncated\.safetensors.*truncated"
    ):
        read_delta(truncated)
    corrupted = tmp_path / "corrupted.safetensors"
    flipped = bytearray(raw)
    flipped[-5] ^= 0xFF  # a byte of tensor data
    corrupted.write_bytes(bytes(flipped))
    with pytest.raises(UsafError, match=r"corrupted\.safetensors is corrupted"):
        read_delta(corrupted)
    assert (
        main(["apply", str(trained["runs"]["deepseek_v3"]["base"]), str(corrupted), str(tmp_path / "o")]) == 2
    )
    assert not (tmp_path / "o").exists()
    not_a_delta = trained["runs"]["deepseek_v3"]["base"] / "model.safetensors"
    with pytest.raises(UsafError, match="is not a usaf delta file"):
        read_delta(not_a_delta)


def test_run_without_finished_checkpoint_is_refused(trained, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000005").mkdir(parents=True)  # no state.json: never finished
    (run / "checkpoints" / ".tmp-step-00000006-123").mkdir()
    (run / "config.yaml").write_text(
        RunConfig.load(None, [f"model.path={trained['runs']['qwen3_moe']['base']}"]).to_yaml()
    )
    with pytest.raises(UsafError, match="has no finished checkpoint"):
        usaf.export.delta.export_delta(run, tmp_path / "d.safetensors")
    with pytest.raises(UsafError, match="has no finished checkpoint"):
        usaf.export.merged.export_merged(run, tmp_path / "m")
    assert not (tmp_path / "d.safetensors").exists() and not (tmp_path / "m").exists()
    with pytest.raises(UsafError, match="does not exist"):
        usaf.export.delta.export_delta(tmp_path / "nowhere", tmp_path / "d.safetensors")


def test_existing_outputs_need_force(trained, tmp_path, capsys):
    run = trained["runs"]["gemma4_text"]["run"]
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "keep.txt").write_text("mine")
    (tmp_path / "d.safetensors").write_text("mine")
    assert main(["export", str(run), "--merged", str(tmp_path / "m")]) == 2
    assert "already exists" in capsys.readouterr().err and (tmp_path / "m" / "keep.txt").exists()
    assert main(["export", str(run), "--delta", str(tmp_path / "d.safetensors")]) == 2
    assert (tmp_path / "d.safetensors").read_text() == "mine"
    both = ["export", str(run), "--merged", str(tmp_path / "m"), "--delta", str(tmp_path / "d.safetensors")]
    # --force replaces only an earlier output of usaf's of the same kind (issue 23), never the user's files
    assert main([*both, "--force"]) == 2
    assert "is not a usaf delta file" in capsys.readouterr().err
    (tmp_path / "d.safetensors").unlink()
    assert main([*both, "--force"]) == 2
    assert "is not a merged checkpoint usaf wrote" in capsys.readouterr().err
    assert (tmp_path / "m" / "keep.txt").read_text() == "mine" and not (tmp_path / "d.safetensors").exists()
    shutil.rmtree(tmp_path / "m")
    assert main(both) == 0
    assert main([*both, "--force"]) == 0
    assert (tmp_path / "m" / "usaf_delta.json").exists()
    read_delta(tmp_path / "d.safetensors")
    base = trained["runs"]["gemma4_text"]["base"]
    with pytest.raises(UsafError, match="would replace the base checkpoint"):
        usaf.export.merged.apply_delta(base, tmp_path / "d.safetensors", base, force=True)


# ---- transformers.Trainer ----------------------------------------------------------------------------------------


def test_hf_trainer_trains_only_the_selection_and_its_checkpoint_becomes_a_delta(tmp_path):
    from transformers import Trainer, TrainingArguments

    base = model_dir(tmp_path / "base", "mixtral")  # its checkpoint names differ from the model's (renamings)
    original = AutoModelForCausalLM.from_pretrained(base)
    # the default targets and the routers: every kind of trained entry goes through Trainer's checkpoint
    config = usaf.UsafConfig(density=0.1, targets=[*usaf.config.DEFAULT_TARGETS, "routers"])
    model = usaf.prepare_model(AutoModelForCausalLM.from_pretrained(base), config)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=8,
        per_device_train_batch_size=8,
        learning_rate=0.1,
        warmup_steps=0,
        logging_steps=1,
        save_steps=4,
        report_to=[],
        use_cpu=True,
        activation_checkpointing=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=copy_sequences(16))
    trainer.train()
    assert model.is_activation_checkpointing
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert losses[-1] < losses[0] - 0.1, losses

    trained_values, before = get_delta(model), original.state_dict()
    routers = {n for n, p in model.named_parameters() if p.requires_grad and ".usaf." not in n}
    assert routers
    for name, after in model.state_dict().items():
        if ".usaf." in name:
            continue
        if name in routers:
            assert not torch.equal(after, before[name]), name
            continue
        changed = (after != before[name]).reshape(-1)
        if name in trained_values:
            changed[trained_values[name].flat_indices] = False
        assert not changed.any(), f"{name} changed outside the selection"

    input_ids = torch.randint(8, 100, (2, 10))
    want = logits(model, input_ids)
    ckpt = tmp_path / "out" / "checkpoint-8"
    # the checkpoint's own weights are the trained model (saving writes the trained values through)
    torch.testing.assert_close(
        logits(AutoModelForCausalLM.from_pretrained(ckpt), input_ids), want, atol=2e-5, rtol=1e-5
    )

    delta = usaf.delta_from_trainer_checkpoint(ckpt, base, tmp_path / "delta.safetensors")
    assert read_delta(delta).info["source"]["step"] == 8
    from_open_base = usaf.delta_from_trainer_checkpoint(
        ckpt, BaseCheckpoint(base), tmp_path / "open.safetensors"
    )
    assert read_delta(from_open_base).changes.keys() == read_delta(delta).changes.keys()
    for name, change in read_delta(from_open_base).changes.items():
        assert torch.equal(change.values, read_delta(delta).changes[name].values)
    plain = usaf.load_delta(AutoModelForCausalLM.from_pretrained(base), delta, base_dir=base)
    torch.testing.assert_close(logits(plain, input_ids), want, atol=2e-5, rtol=1e-5)
    assert (
        main(["export", "--from-trainer", str(ckpt), "--base", str(base), "--merged", str(tmp_path / "m")])
        == 0
    )
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    torch.testing.assert_close(logits(merged, input_ids), want, atol=2e-5, rtol=1e-5)

    with pytest.raises(UsafError, match="holds no usaf trained entries"):
        usaf.delta_from_trainer_checkpoint(base, base, tmp_path / "none.safetensors")

    # resuming midway (Trainer reloads save_pretrained's renamed keys with a plain load_state_dict) ends where the
    # uninterrupted run did
    again = usaf.prepare_model(AutoModelForCausalLM.from_pretrained(base), config)
    resumed = Trainer(model=again, args=args, train_dataset=copy_sequences(16))
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-4"))
    for name, change in get_delta(again).items():
        assert torch.equal(change.values, trained_values[name].values), name
    for name in routers:
        assert torch.equal(again.get_parameter(name), model.get_parameter(name)), name


def test_trl_sft_trainer(tmp_path):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")

    base = make_model_dir(tmp_path / "base", "qwen3_moe")
    tokenizer = char_tokenizer()
    model = usaf.prepare_model(AutoModelForCausalLM.from_pretrained(base), usaf.UsafConfig(density=0.05))
    before = get_delta(model)
    before = {k: v.values.detach().clone() for k, v in before.items()}
    texts = [{"text": f"copy {w} -> {w}"} for w in ("abcde", "bcdea", "cdeab", "deabc") * 4]
    config = trl.SFTConfig(
        output_dir=str(tmp_path / "out"),
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=3e-2,
        report_to=[],
        use_cpu=True,
        save_steps=4,
        logging_steps=1,
        bf16=False,  # TRL defaults to bf16 autocast, which stays wrapped around the model's forward
    )
    trainer = trl.SFTTrainer(
        model=model, args=config, train_dataset=datasets.Dataset.from_list(texts), processing_class=tokenizer
    )
    trainer.train()
    after = get_delta(model)
    assert any(not torch.equal(before[k], after[k].values) for k in before)
    delta = usaf.delta_from_trainer_checkpoint(
        tmp_path / "out" / "checkpoint-4", base, tmp_path / "d.safetensors"
    )
    input_ids = torch.randint(8, 100, (2, 10))
    plain = usaf.load_delta(AutoModelForCausalLM.from_pretrained(base), delta)
    torch.testing.assert_close(logits(plain, input_ids), logits(model, input_ids), atol=2e-5, rtol=1e-5)


def test_hf_trainer_example_runs(tmp_path, monkeypatch):
    import runpy

    base = make_model_dir(tmp_path / "model", "qwen3_moe")
    example = Path(__file__).resolve().parents[2] / "examples" / "hf_trainer.py"
    monkeypatch.setattr(sys, "argv", [str(example), str(base), str(tmp_path / "out")])
    runpy.run_path(str(example), run_name="__main__")  # in this process: the imports are paid already
    assert read_delta(tmp_path / "out" / "delta.safetensors").changes
