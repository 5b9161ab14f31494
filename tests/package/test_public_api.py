"""The Python API a user scripts with: usaf.RunConfig + usaf.train, usaf.save_delta from a live model, and a
quantized base loaded with usaf.load_prepared."""

import json

import pytest
import torch
from helpers import FAST_RUN, make_model_dir, write_copy_task
from transformers import AutoModelForCausalLM

import usaf
from usaf.cli import main
from usaf.engine.installed import sparse_modules


@pytest.mark.slow
def test_runconfig_and_train_from_python(tmp_path):
    model, data = make_model_dir(tmp_path / "m"), write_copy_task(tmp_path / "d.jsonl", 24)
    config = usaf.RunConfig.load(
        None, [f"model.path={model}", f"data.train={data}", *FAST_RUN, "schedule.max_steps=2"]
    )
    summary = usaf.train(config, tmp_path / "run")
    assert summary["steps"] == 2 and json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2
    import usaf.train.loop as loop  # the callable package still holds its modules

    assert loop.train is not None and callable(usaf.train)


def test_save_delta_from_a_live_model_merges_to_the_same_model(tmp_path):
    base_dir = make_model_dir(tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    usaf.prepare_model(model, usaf.UsafConfig(density=0.05, selection="random"))
    with torch.no_grad():  # as if trained
        for _, state in sparse_modules(model):
            for entries in state.values():
                entries.values.add_(0.1 * torch.randn_like(entries.values))
    ids = torch.randint(3, model.config.vocab_size, (2, 10))
    with torch.no_grad():
        live = model.eval()(ids).logits
    delta = usaf.save_delta(model, base_dir, tmp_path / "delta.safetensors")
    assert main(["apply", str(base_dir), str(delta), str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, live, rtol=1e-5, atol=1e-5)


def test_a_quantized_base_from_python(tmp_path):
    base_dir = make_model_dir(tmp_path / "base")
    assert main(["prepare", str(base_dir), "--quant=nf4", f"--out={tmp_path / 'store'}", "--device=cpu"]) == 0
    model = usaf.load_prepared(tmp_path / "store", base_dir, usaf.UsafConfig(density=0.05), device="cpu")
    ids = torch.randint(3, model.config.vocab_size, (2, 10))
    loss = usaf.causal_lm_loss(model, ids, ids)
    loss.backward()
    grads = [e.values.grad for _, s in sparse_modules(model) for e in s.values()]
    assert torch.isfinite(loss) and grads and all(g is not None for g in grads)
