"""Trying a fine-tune: `usaf generate` / `usaf chat` on a run, a merged export and a base plus a delta (quantized
too), against transformers' own `generate`; `usaf.base_weights` as the base of a prepared model."""

import io
import json
from pathlib import Path

import pytest
import torch
from helpers import make_model_dir
from transformers import AutoModelForCausalLM, AutoTokenizer

import usaf
from usaf.base.load import load_prepared
from usaf.cli import main
from usaf.engine.installed import sparse_modules
from usaf.testing.tiny import tiny_model

NEW = 6
PROMPTS = [
    {"prompt": "copy abcde ->"},
    {"prompt": "copy fed ->"},
    {"messages": [{"role": "user", "content": "hi"}]},
]


@pytest.fixture(scope="module")
def tried(ws, tmp_path_factory):
    """The fault workspace's finished run, its merged export and a prompts file."""
    root = tmp_path_factory.mktemp("generate")
    merged = root / "merged"
    assert main(["export", str(ws.finished), f"--merged={merged}"]) == 0
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return ws, merged, prompts


def transformers_generate(model_dir: Path, prompts: list[dict]) -> list[str]:
    """Greedy continuations by transformers alone (the chat prompt through the tokenizer's own template)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = []
    for p in prompts:
        if "prompt" in p:
            ids = tokenizer(p["prompt"], return_tensors="pt")["input_ids"]
        else:
            text = tokenizer.apply_chat_template(p["messages"], tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            new = model.generate(
                ids, max_new_tokens=NEW, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
        out.append(tokenizer.decode(new[0, ids.shape[1] :], skip_special_tokens=True))
    return out


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def generate(*args) -> int:
    return main(["generate", *map(str, args), f"--max-new-tokens={NEW}", "--set=model.device=cpu"])


def test_a_runs_continuations_are_transformers_generate_on_its_merged_export(tried, tmp_path, capsys):
    ws, merged, prompts = tried
    out = tmp_path / "rows.jsonl"
    assert generate(ws.finished, "--prompts", prompts, "--out", out, "--compare-base") == 0
    rows = rows_of(out)
    assert [r["line"] for r in rows] == [1, 2, 3]
    assert [r["prompt"] for r in rows] == [p.get("prompt", p.get("messages")) for p in PROMPTS]
    assert [r["completion"] for r in rows] == transformers_generate(merged, PROMPTS)
    assert [r["base_completion"] for r in rows] == transformers_generate(ws.base, PROMPTS)
    shown = capsys.readouterr().out
    assert "tuned: " in shown and "base: " in shown and f"wrote 3 rows to {out}" in shown


@pytest.mark.parametrize("given", ["a base plus its delta", "a merged export and its base"])
def test_a_fine_tune_and_its_base_generate_as_transformers_does(tried, tmp_path, given):
    ws, merged, prompts = tried
    target = (
        [ws.base, "--delta", ws.delta] if given == "a base plus its delta" else [merged, "--base", ws.base]
    )
    out = tmp_path / "rows.jsonl"
    assert generate(*target, "--prompts", prompts, "--out", out, "--compare-base") == 0
    rows = rows_of(out)
    assert [r["completion"] for r in rows] == transformers_generate(merged, PROMPTS)
    assert [r["base_completion"] for r in rows] == transformers_generate(ws.base, PROMPTS)


def test_a_quantized_base_plus_a_delta_generates_through_the_engine(tried, tmp_path):
    ws, _, prompts = tried
    out = tmp_path / "rows.jsonl"
    args = [ws.base, "--delta", ws.delta, "--prompts", prompts, "--out", out, "--compare-base"]
    assert generate(*args, "--set=model.quant=nf4") == 0
    rows = rows_of(out)
    assert len(rows) == 3 and all(0 < r["new_tokens"] <= NEW for r in rows)
    assert all(isinstance(r["completion"], str) and isinstance(r["base_completion"], str) for r in rows)


@pytest.mark.parametrize(
    "line, says",
    [
        ("not json", "prompts.jsonl:2: not JSON"),
        ('{"prompt": 3}', "prompts.jsonl:2: 'prompt' must be non-empty text"),
        ('{"prompt": "a", "messages": []}', "prompts.jsonl:2: give exactly one of 'prompt'"),
        (
            '{"messages": [{"role": "robot", "content": "x"}]}',
            "prompts.jsonl:2: messages[0] has role 'robot'; allowed: system",
        ),
        ("[1, 2]", "prompts.jsonl:2: a prompt is an object"),
    ],
)
def test_a_bad_prompt_is_named_by_its_line_before_any_model_loads(tried, tmp_path, capsys, line, says):
    ws, _, _ = tried
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "ok"}\n' + line + "\n")
    out = tmp_path / "rows.jsonl"
    assert generate(ws.finished, "--prompts", prompts, "--out", out) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_outputs_are_guarded(tried, tmp_path, capsys):
    ws, merged, prompts = tried
    before = sorted(p.name for p in ws.finished.iterdir())
    assert generate(ws.finished, "--prompts", prompts, "--out", ws.finished / "rows.jsonl") == 2
    assert "must not be inside" in capsys.readouterr().err
    assert sorted(p.name for p in ws.finished.iterdir()) == before
    assert generate(ws.finished, "--prompts", prompts, "--out", prompts) == 2  # its own input
    assert "an input of this command" in capsys.readouterr().err
    other = tmp_path / "notes.jsonl"
    other.write_text('{"mine": 1}\n')
    assert generate(ws.finished, "--prompts", prompts, "--out", other, "--force") == 2
    assert other.read_text() == '{"mine": 1}\n'
    assert generate(merged, "--prompts", prompts, "--out", tmp_path / "r.jsonl", "--compare-base") == 2
    assert "give --base BASE_DIR" in capsys.readouterr().err
    assert (
        generate(ws.finished, "--prompts", prompts, "--out", tmp_path / "r.jsonl", "--delta", ws.delta) == 2
    )
    assert "is a run" in capsys.readouterr().err


def test_an_earlier_output_is_replaced_only_with_force(tried, tmp_path, capsys):
    ws, _, prompts = tried
    out = tmp_path / "rows.jsonl"
    assert generate(ws.finished, "--prompts", prompts, "--out", out) == 0
    assert generate(ws.finished, "--prompts", prompts, "--out", out) == 2
    assert "already exists" in capsys.readouterr().err
    assert generate(ws.finished, "--prompts", prompts, "--out", out, "--force") == 0


def test_chat_streams_keeps_history_and_resets(tried, monkeypatch, capsys):
    ws, _, _ = tried
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\nhi\n/reset\nhi\n"))
    assert main(["chat", str(ws.finished), "--max-new-tokens=4", "--set=model.device=cpu"]) == 0
    shown = capsys.readouterr().out
    assert "(conversation cleared)" in shown
    answers = [part.split("\n")[0] for part in shown.split("> ")[1:4]]
    # the same first message gets the same greedy answer after /reset; the second "hi" saw a history
    assert answers[0] == shown.split("(conversation cleared)")[1].split("> ")[1].split("\n")[0]
    assert len(answers) == 3


@pytest.mark.parametrize("quant", ["none", "nf4"])
def test_base_weights_is_the_base_inside_and_the_fine_tune_after(tmp_path, quant):
    base = tiny_model("qwen3_moe", seed=0)
    ids = torch.randint(0, base.config.vocab_size, (2, 12))
    with torch.no_grad():
        base_logits = base(ids).logits
    if quant == "none":
        model = tiny_model("qwen3_moe", seed=0)
        usaf.prepare_model(model, usaf.UsafConfig(density=0.05, selection="random"))
    else:
        folder = make_model_dir(tmp_path / "base")
        store = tmp_path / "store"
        assert main(["prepare", str(folder), "--quant=nf4", f"--out={store}", "--device=cpu"]) == 0
        model = load_prepared(store, folder, usaf.UsafConfig(density=0.05, selection="random"), device="cpu")
        base = AutoModelForCausalLM.from_pretrained(folder).eval()
        ids = ids.remainder(base.config.vocab_size)
        with torch.no_grad():
            base_logits = base(ids).logits
    model.eval()
    with torch.no_grad():
        start = model(ids).logits
        for _, state in sparse_modules(model):
            for entries in state.values():
                entries.values.add_(torch.randn_like(entries.values))
        tuned = model(ids).logits
        trained = [e.values.clone() for _, s in sparse_modules(model) for e in s.values()]
        with usaf.base_weights(model):
            inside = model(ids).logits
        after = model(ids).logits
    assert not torch.allclose(tuned, start)
    assert torch.equal(inside, start)  # the model as prepared: its starting values
    if quant == "none":
        torch.testing.assert_close(inside, base_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(after, tuned)
    restored = [e.values for _, s in sparse_modules(model) for e in s.values()]
    assert restored and all(torch.equal(a, b) for a, b in zip(trained, restored, strict=True))


def test_a_prompt_takes_any_chat_the_training_data_takes(tmp_path):
    from usaf.generate.prompts import read_prompts

    prompts = tmp_path / "prompts.jsonl"
    sharegpt = {"messages": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hi"}]}
    tool_turn = {"role": "tool", "content": "42", "tool_call_id": "c1", "id": "dropped"}
    prompts.write_text(json.dumps(sharegpt) + "\n" + json.dumps({"messages": [tool_turn]}) + "\n")
    first, second = read_prompts(prompts)
    assert first.messages == ({"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"})
    assert second.messages == ({"role": "tool", "content": "42", "tool_call_id": "c1"},)


def test_the_sampling_options_are_samplings_fields_with_its_defaults():
    """One option per field of Sampling, its default the field's, and the help says that default."""
    import argparse
    from dataclasses import fields

    from usaf.commands.generate import add_target, sampling
    from usaf.generate.generation import Sampling

    parser = argparse.ArgumentParser()
    add_target(parser)
    args = parser.parse_args(["run"])
    assert sampling(args) == Sampling()
    help_text = " ".join(parser.format_help().split())
    for field in fields(Sampling):
        option = "--" + field.name.replace("_", "-")
        assert getattr(args, field.name) == field.default
        shown = help_text.split(option, 2)[2].split(")", 1)[0]  # its help, up to the first ')'
        assert shown.endswith("(default: greedy" if field.default is False else f"(default {field.default}")
    assert sampling(parser.parse_args(["run", "--do-sample", "--top-k", "7"])) == Sampling(
        do_sample=True, top_k=7
    )
