"""Issue 23: no model code, ever; bounded cost from small files (chat templates, YAML, records); and the poorly
said cases of those inputs (a lone surrogate, deep JSON, duplicate YAML keys, a tokenizer larger than the model's
vocabulary). Rows use the shared workspace `ws` (tests/faults.py); the model folders with custom code are this
module's own."""

from __future__ import annotations

import io
import json
import shutil
import sys
import time
from pathlib import Path

import pytest
from faults import NEW, SET_ARGS, Row, T, table_test

from usaf.cli import main

# ---- a model folder that ships code: config.json's auto_map names evil.py, which leaves a marker when imported --


def _with_custom_code(folder: Path, marker: Path, model_type: str | None = None) -> Path:
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    if model_type:
        config["model_type"] = model_type
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer_config = folder / "tokenizer_config.json"
    settings = json.loads(tokenizer_config.read_text())
    settings["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
    tokenizer_config.write_text(json.dumps(settings))
    (folder / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('model code ran')\n"
        "from transformers import PretrainedConfig, PreTrainedTokenizerFast\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n"
        "class EvilModel:\n    pass\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    return folder


@pytest.fixture(scope="module")
def code(ws, tmp_path_factory):
    """`custom`: a model_type transformers does not know, auto_map to evil.py; `known`: a known model_type with
    the same auto_map (transformers' own class serves it); `marker`: what evil.py writes when it is imported."""
    root = tmp_path_factory.mktemp("model-code")
    marker = root / "MARKER"
    custom = _with_custom_code(Path(shutil.copytree(ws.base, root / "custom")), marker, "evil_moe")
    known = _with_custom_code(Path(shutil.copytree(ws.base, root / "known")), marker)
    return type("Code", (), {"custom": custom, "known": known, "marker": marker})


CUSTOM_COMMANDS = {
    "train": ["train", "--model={m}", "--data={ws.data}", "--out={tmp}/run", *SET_ARGS, "--set=schedule.max_steps=1"],
    "eval": ["eval", "{m}", "--data={ws.data}"],
    "select": ["select", "--model={m}", "--data={ws.data}", "--out={tmp}/s.safetensors"],
    "data": ["data", "--model={m}", "--data={ws.data}", "--show=1"],
    "prepare": ["prepare", "{m}", "--quant=int8", "--out={tmp}/store"],
    "apply": ["apply", "{m}", "{ws.delta}", "{tmp}/merged"],
    "plan": ["plan", "--model={m}"],
}  # fmt: skip


@pytest.mark.parametrize("answer", ["y\n", ""], ids=["stdin-y", "stdin-closed"])
@pytest.mark.parametrize("command", sorted(CUSTOM_COMMANDS))
def test_model_code_never_runs(command, answer, code, ws, tmp_path, monkeypatch, capsys):
    """A model that needs its own code is refused in one line naming config.json's auto_map; no prompt, and
    whatever stdin holds, the code is never imported."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(answer))
    argv = [a.format(m=code.custom, ws=ws, tmp=tmp_path) for a in CUSTOM_COMMANDS[command]]
    rc = main(argv)
    out, err = capsys.readouterr()
    assert not code.marker.exists(), "the model folder's code ran"
    assert "Do you wish to run the custom code" not in out + err
    assert "Traceback" not in out + err
    if command == "plan":  # plans from config.json's numbers alone: no model class needed
        return
    assert rc == 2, (out, err)
    assert err.startswith("usaf: error: ") and err.count("\n") == 1, err
    assert "auto_map" in err and "config.json" in err, err


def test_known_model_with_auto_map_uses_transformers_class(code, ws, tmp_path, monkeypatch, capsys):
    """A model_type transformers knows is built by transformers' own class, its auto_map never followed."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))
    run = tmp_path / "run"
    assert main(["train", f"--model={code.known}", f"--data={ws.data}", f"--out={run}", *SET_ARGS,
                 "--set=schedule.max_steps=1"]) == 0  # fmt: skip
    assert main(["export", str(run), f"--merged={tmp_path / 'merged'}"]) == 0
    assert main(["apply", str(code.known), str(ws.delta), str(tmp_path / "applied")]) == 0
    assert main(["prepare", str(code.known), "--quant=int8", f"--out={tmp_path / 'store'}"]) == 0
    assert not code.marker.exists(), "the model folder's code ran"
    assert "Do you wish to run the custom code" not in "".join(capsys.readouterr())


# ---- chat templates: bounded in time, memory and output ----------------------------------------------------------

NESTED_LOOPS = "{% for a in range(99999) %}{% for b in range(99999) %}x{% endfor %}{% endfor %}"  # 81 bytes
SILENT_LOOPS = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"
BIG_STRING = "{{ 'x' * 10**10 }}"
POWER = "{{ 99 ** 99999999 }}"
RECURSION = "{%macro f()%}{{f()}}{%endmacro%}{{f()}}"
DOUBLING = "{% set ns = namespace(s='xx') %}{% for a in range(99) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"
CENTER = "{{ 'x' | center(9999999999) }}"
FORMAT = "{{ '{:>9999999999}'.format(1) }}"


def _chat_file(tmp: Path) -> Path:
    path = tmp / "chat.jsonl"
    record = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}
    path.write_text(json.dumps(record) + "\n")
    return path


@pytest.mark.parametrize(
    "template, bound",
    [
        (NESTED_LOOPS, "characters"),
        (SILENT_LOOPS, "iterations"),
        (BIG_STRING, "characters"),
        (POWER, "too large"),
        (RECURSION, "deep"),
        (DOUBLING, "characters"),
        (CENTER, "too large"),
        (FORMAT, "too large"),
    ],
    ids=["nested-loops", "silent-loops", "big-string", "power", "recursion", "doubling", "center", "format"],
)
def test_chat_template_is_bounded(template, bound, ws, tmp_path, capsys):
    """A few bytes of template cannot take gigabytes or minutes: each fails fast with the bound it hit and the
    template's file."""
    jinja = tmp_path / "evil.jinja"
    jinja.write_text(template)
    started = time.monotonic()
    rc = main(
        ["data", f"--model={ws.base}", f"--data={_chat_file(tmp_path)}", f"--set=data.chat_template={jinja}"]
    )
    elapsed = time.monotonic() - started
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    assert err.startswith("usaf: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert str(jinja) in err and bound in err, err
    assert elapsed < 30, elapsed


def test_model_chat_template_is_bounded(ws, tmp_path, capsys):
    """The model's own template (chat_template.jinja in its folder) is bounded the same way, record by record."""
    model = Path(shutil.copytree(ws.base, tmp_path / "model"))
    (model / "chat_template.jinja").write_text(NESTED_LOOPS)
    started = time.monotonic()
    rc = main(["data", f"--model={model}", f"--data={_chat_file(tmp_path)}"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("usaf: error: ") and err.count("\n") == 1, err
    assert f"{tmp_path / 'chat.jsonl'}:1" in err and f"of {model}" in err and "characters" in err, err
    assert time.monotonic() - started < 30


def test_chat_without_markers_is_bounded_in_turns(ws, tmp_path, capsys):
    """Locating the turns of a chat whose template has no generation markers renders the conversation's prefixes
    (time as turns x length): a record past the bound is refused in one line, up front, naming the markers."""
    template = tmp_path / "plain.jinja"
    template.write_text(
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<eos>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    turns = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " * 1000} for i in range(500)
    ]
    data = tmp_path / "long-chat.jsonl"
    data.write_text(json.dumps({"messages": turns}) + "\n" + json.dumps({"messages": turns[:6]}) + "\n")
    started = time.monotonic()
    # the largest max_seq_len config allows: no record is cut short of its turns
    rc = main(["data", f"--model={ws.base}", f"--data={data}", f"--set=data.chat_template={template}",
               "--set=data.max_seq_len=1048576"])  # fmt: skip
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert f"{data}:1" in err and "{% generation %} markers" in err, err
    assert elapsed < 20, elapsed


# ---- YAML: no alias bombs, no duplicate keys -----------------------------------------------------------------------

LAUGHS = (
    'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    "b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
    "d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\n"
    "f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]\ng: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]\n"
    "h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]\ni: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]\n"
)


def write_bomb(ctx, monkeypatch):
    # the value of a real option: the checks (and config.yaml) would expand it to 9^9 strings
    items = "".join(f"  - {line.split(': ', 1)[1]}\n" for line in LAUGHS.splitlines())
    (ctx.tmp / "bomb.yaml").write_text("data:\n train:\n" + items)


def write_bad_key_bomb(ctx, monkeypatch):
    # a small file whose error message would quote the expanded document
    (ctx.tmp / "bomb.yaml").write_text(LAUGHS.replace("i: &i", "? [*h,*h,*h]\n: 1\nz: &i"))


def write_duplicates(ctx, monkeypatch):
    (ctx.tmp / "dup.yaml").write_text("optim:\n  lr: 3.0e-4\n  lr: 1.0e-2\n")


def write_duplicate_sections(ctx, monkeypatch):
    (ctx.tmp / "dup.yaml").write_text(
        "optim:\n  lr: 3.0e-4\nschedule:\n  max_steps: 2\noptim:\n  beta1: 0.8\n"
    )


def write_run_bomb(ctx, monkeypatch):
    (ctx.run / "config.yaml").write_text(LAUGHS)


ROWS = [
    Row("yaml-alias-bomb", T(*NEW, "--config={tmp}/bomb.yaml"), 2, ["{tmp}/bomb.yaml", "aliases"],
        setup=write_bomb, absent=["{tmp}/run"]),
    Row("yaml-alias-bomb-key", T(*NEW, "--config={tmp}/bomb.yaml"), 2, ["{tmp}/bomb.yaml", "aliases"],
        setup=write_bad_key_bomb, absent=["{tmp}/run"]),
    Row("yaml-alias-bomb-plan", ["plan", "--config={tmp}/bomb.yaml", "--model={ws.base}"], 2,
        ["{tmp}/bomb.yaml", "aliases"], setup=write_bomb),
    Row("yaml-duplicate-key", T(*NEW, "--config={tmp}/dup.yaml"), 2,
        ["{tmp}/dup.yaml:3", "'lr'", "twice"], setup=write_duplicates, absent=["{tmp}/run"]),
    Row("yaml-duplicate-section", T(*NEW, "--config={tmp}/dup.yaml"), 2,
        ["{tmp}/dup.yaml:5", "'optim'", "twice"], setup=write_duplicate_sections, absent=["{tmp}/run"]),
    Row("yaml-run-config-bomb", ["export", "{run}", "--delta={tmp}/d.safetensors"], 2,
        ["{run}/config.yaml", "aliases"], run="finished", setup=write_run_bomb, keeps=["{ws.base}"],
        absent=["{tmp}/d.safetensors"]),
]  # fmt: skip


# ---- records: bounded and said in one line -----------------------------------------------------------------------


def write_surrogate(ctx, monkeypatch):
    (ctx.tmp / "s.jsonl").write_text('{"text": "fine"}\n{"text": "bad \\ud800 half"}\n')


def write_surrogate_json(ctx, monkeypatch):
    (ctx.tmp / "s.json").write_text('[{"text": "fine"}, {"prompt": "a", "completion": "\\udfff"}]')


def write_nested(ctx, monkeypatch):
    (ctx.tmp / "n.jsonl").write_text('{"text": "fine"}\n' + "[" * 100_000 + "\n")


def write_nested_json(ctx, monkeypatch):
    (ctx.tmp / "n.json").write_text("[" * 100_000)


def write_nested_chat(ctx, monkeypatch):
    content = "[" * 5000 + "]" * 5000
    record = (
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "x": %s}]}'
    )
    (ctx.tmp / "n.jsonl").write_text(record % content + "\n")


def big_tokenizer(ctx, monkeypatch):
    """The workspace's model with a tokenizer of more tokens than its embedding has rows."""
    folder = ctx.tmp / "big-vocab"
    shutil.copytree(ctx.ws.base, folder)
    config = json.loads((folder / "config.json").read_text())
    config["vocab_size"] = 50  # the char tokenizer has 104
    (folder / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    for name, tensor in tensors.items():
        if tensor.shape[0] == 104:
            tensors[name] = tensor[:50].clone()
    save_file(tensors, str(folder / "model.safetensors"), {"format": "pt"})


ROWS += [
    Row("record-lone-surrogate", ["data", "--model={ws.base}", "--data={tmp}/s.jsonl"], 2,
        ["{tmp}/s.jsonl:2", "surrogate"], setup=write_surrogate),
    Row("record-lone-surrogate-train", T(*NEW[:1], "--data={tmp}/s.json", "--out={tmp}/run"), 2,
        ["{tmp}/s.json[1]", "surrogate"], setup=write_surrogate_json, absent=["{tmp}/run"]),
    Row("record-nested-json", ["data", "--model={ws.base}", "--data={tmp}/n.jsonl"], 2,
        ["{tmp}/n.jsonl:2", "nested"], setup=write_nested),
    Row("record-nested-json-file", ["data", "--model={ws.base}", "--data={tmp}/n.json"], 2,
        ["{tmp}/n.json", "nested"], setup=write_nested_json),
    Row("record-nested-chat", ["data", "--model={ws.base}", "--data={tmp}/n.jsonl"], 2,
        ["{tmp}/n.jsonl:1"], setup=write_nested_chat),
    Row("tokenizer-over-vocab", T("--model={tmp}/big-vocab", "--data={ws.data}", "--out={tmp}/run"), 2,
        ["{tmp}/big-vocab", "vocab_size"], setup=big_tokenizer, absent=["{tmp}/run"]),
    Row("tokenizer-over-vocab-eval", ["eval", "{tmp}/big-vocab", "--data={ws.data}"], 2,
        ["{tmp}/big-vocab", "vocab_size"], setup=big_tokenizer),
]  # fmt: skip


test_fault = table_test(ROWS)


def test_long_record_is_cut_before_tokenizing(ws, tmp_path, monkeypatch):
    """A 4 MB one-line record under long_documents=truncate is cut to a bound derived from max_seq_len before the
    tokenizer sees it: the tokenizer is never handed megabytes to return 48 tokens of."""
    from usaf.data import records

    seen = []
    real = records._tokenize

    def spy(tokenizer, text, add_special_tokens):
        seen.append(len(text))
        return real(tokenizer, text, add_special_tokens)

    monkeypatch.setattr(records, "_tokenize", spy)
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"prompt": "copy:", "completion": " x" * 2_000_000}) + "\n")
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "y" * 4_000_000}) + "\n")
    for path in (data, text):
        assert main(["data", f"--model={ws.base}", f"--data={path}", "--set=data.long_documents=truncate",
                     "--set=data.max_seq_len=48"]) == 0  # fmt: skip
    assert seen and max(seen) < 100_000, max(seen)


def test_yaml_bounds_in_python(tmp_path):
    """The loader itself: aliases of scalars are fine, a bomb is refused before it is expanded."""
    from usaf.config import read_yaml
    from usaf.errors import UsafError

    assert read_yaml("a: &x 1\nb: *x\n", "t.yaml") == {"a": 1, "b": 1}
    started = time.monotonic()
    with pytest.raises(UsafError, match="aliases"):
        read_yaml(LAUGHS, "t.yaml")
    assert time.monotonic() - started < 2
    with pytest.raises(UsafError, match=r"t.yaml:2: key 'a' appears twice"):
        read_yaml("a: 1\na: 2\n", "t.yaml")
