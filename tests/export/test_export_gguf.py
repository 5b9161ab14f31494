"""`usaf export --gguf`: llama.cpp's converter found (--llama-cpp, $LLAMA_CPP), run on the merged export, its file
placed only when it is one; a missing or failing converter is one line and leaves nothing behind; k-quants through
llama-quantize; the run's name as general.name; an Ollama Modelfile beside the GGUF.

Most tests run a stand-in with llama.cpp's command line (no network in tests; `helpers.fake_llama_cpp`): it records
what it was given and the merged checkpoint's bytes, so the test sees it converted exactly what `--merged` writes.
Two run llama.cpp's own converter and llama-quantize where they are installed (skipped otherwise, saying why), on
an export of the bundled demo model."""

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest
from helpers import FAST_RUN, fake_llama_cpp

from usaf.cli import main
from usaf.errors import UsafError
from usaf.export.gguf import find_converter, find_quantize
from usaf.export.ollama import modelfile
from usaf.train.tokenizer import char_tokenizer

DEMO = Path(__file__).resolve().parents[2] / "src" / "usaf" / "demo_assets"


@pytest.fixture
def llama_cpp(tmp_path):
    return fake_llama_cpp(tmp_path / "llama.cpp")


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if "usaf-tmp" in p.name)


def test_gguf_is_the_converters_file_of_the_merged_export(ws, llama_cpp, tmp_path, capsys):
    out, merged = tmp_path / "model.gguf", tmp_path / "merged"
    assert (
        main(["export", str(ws.finished), f"--gguf={out}", f"--llama-cpp={llama_cpp}", "--outtype=q8_0"]) == 0
    )
    seen = json.loads((llama_cpp / "seen.json").read_text())
    assert seen["outtype"] == "q8_0" and seen["config"]
    assert main(["export", str(ws.finished), f"--merged={merged}"]) == 0
    expected = hashlib.sha256((merged / "model.safetensors").read_bytes()).hexdigest()
    assert seen["digest"] == expected and out.read_bytes() == b"GGUF" + expected.encode()
    assert (
        not Path(seen["merged"]).exists() and leftovers(tmp_path) == []
    )  # the scratch merged folder is gone
    assert f"gguf: {out}" in capsys.readouterr().out
    # general.name is what the base and the run are called, not the scratch folder's name
    assert seen["name"] == f"{ws.base.name}-{ws.finished.name}"


def test_gguf_beside_merged_converts_that_folder(ws, llama_cpp, tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_CPP", str(llama_cpp))
    out, merged = tmp_path / "model.gguf", tmp_path / "merged"
    assert main(["export", str(ws.finished), f"--merged={merged}", f"--gguf={out}"]) == 0
    seen = json.loads((llama_cpp / "seen.json").read_text())
    assert Path(seen["merged"]) == merged and seen["outtype"] == "bf16" and merged.is_dir()


@pytest.mark.parametrize(
    "mode, says",
    [
        ("fail", "llama.cpp's converter failed (NotImplementedError: Architecture 'Qwen3MoeForCausalLM'"),
        ("junk", "wrote no GGUF file"),
    ],
)
def test_a_failing_converter_leaves_nothing(ws, llama_cpp, tmp_path, capsys, mode, says):
    (llama_cpp / "mode").write_text(mode)
    out = tmp_path / "model.gguf"
    assert main(["export", str(ws.finished), f"--gguf={out}", f"--llama-cpp={llama_cpp}"]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists() and leftovers(tmp_path) == []


def test_a_missing_converter_is_said_before_any_work(ws, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LLAMA_CPP", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    out = tmp_path / "model.gguf"
    assert main(["export", str(ws.finished), f"--gguf={out}"]) == 2
    err = capsys.readouterr().err
    assert "convert_hf_to_gguf.py, which was not found" in err and "git clone" in err
    assert main(["export", str(ws.finished), f"--gguf={out}", f"--llama-cpp={tmp_path}"]) == 2
    assert "holds no convert_hf_to_gguf.py" in capsys.readouterr().err
    assert main(["export", str(ws.finished), f"--gguf={out}", "--llama-cpp=x", "--outtype=q4"]) == 2
    assert "--outtype must be one of f16, bf16, q8_0, f32, q4_k_m" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_gguf_never_replaces_another_file(ws, llama_cpp, tmp_path, capsys):
    out = tmp_path / "notes.gguf"
    out.write_text("mine")
    assert main(["export", str(ws.finished), f"--gguf={out}", f"--llama-cpp={llama_cpp}", "--force"]) == 2
    assert "is not a GGUF file" in capsys.readouterr().err and out.read_text() == "mine"


def test_model_name_can_be_given(ws, llama_cpp, tmp_path):
    out = tmp_path / "model.gguf"
    args = [
        "export",
        str(ws.finished),
        f"--gguf={out}",
        f"--llama-cpp={llama_cpp}",
        "--model-name=My Tune 7B",
    ]
    assert main(args) == 0
    assert json.loads((llama_cpp / "seen.json").read_text())["name"] == "My Tune 7B"


def test_a_k_quant_is_llama_quantize_on_a_16_bit_conversion(ws, tmp_path, capsys):
    llama_cpp = fake_llama_cpp(tmp_path / "llama.cpp", quantize=True)
    out = tmp_path / "out" / "model.gguf"
    args = ["export", str(ws.finished), f"--gguf={out}", f"--llama-cpp={llama_cpp}", "--outtype=q4_k_m"]
    assert main(args) == 0
    seen = json.loads((llama_cpp / "seen.json").read_text())
    assert seen["outtype"] == "f16"  # the converter wrote the 16-bit file that llama-quantize read
    assert out.read_bytes() == b"GGUFQ4_K_M:GGUF" + seen["digest"].encode()
    assert sorted(p.name for p in out.parent.iterdir()) == [
        "model.Modelfile",
        "model.gguf",
    ]  # no intermediate left
    printed = capsys.readouterr().out
    assert "q4_k_m" in printed and "llama-quantize" in printed


def test_a_missing_llama_quantize_is_said_before_any_work(ws, llama_cpp, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LLAMA_QUANTIZE", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    out = tmp_path / "out" / "model.gguf"
    args = ["export", str(ws.finished), f"--gguf={out}", f"--llama-cpp={llama_cpp}", "--outtype=q5_k_m"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert (
        "llama-quantize, which was not found" in err and "cmake" in err and len(err.strip().splitlines()) == 1
    )
    assert not out.parent.exists() and not (llama_cpp / "seen.json").exists()
    monkeypatch.setenv("LLAMA_QUANTIZE", str(tmp_path / "none"))
    assert main(args) == 2
    assert "LLAMA_QUANTIZE=" in capsys.readouterr().err


def test_a_failing_llama_quantize_leaves_nothing(ws, tmp_path, capsys, monkeypatch):
    llama_cpp = fake_llama_cpp(tmp_path / "llama.cpp")
    broken = tmp_path / "llama-quantize"
    broken.write_text("#!/bin/sh\necho 'main: invalid ftype' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("LLAMA_QUANTIZE", str(broken))
    out = tmp_path / "out" / "model.gguf"
    args = ["export", str(ws.finished), f"--gguf={out}", f"--llama-cpp={llama_cpp}", "--outtype=q6_k"]
    assert main(args) == 2
    assert "llama.cpp's llama-quantize failed (main: invalid ftype)" in capsys.readouterr().err
    assert sorted(p.name for p in out.parent.iterdir()) == []  # neither the GGUF nor the 16-bit intermediate


def test_the_modelfile_carries_the_models_template_and_stop_tokens(ws, llama_cpp, tmp_path, capsys):
    out = tmp_path / "model.gguf"
    assert main(["export", str(ws.finished), f"--gguf={out}", f"--llama-cpp={llama_cpp}"]) == 0
    text = (tmp_path / "model.Modelfile").read_text()
    assert "FROM ./model.gguf" in text and 'PARAMETER stop "<eos>"' in text
    # the char tokenizer's template, `<|role|>content<eos>` per message, in Go template syntax
    assert 'eq .Role "user" }}<|user|>{{ .Content }}<eos>' in text
    assert '{{ if and $last (ne .Role "assistant") }}<|assistant|>{{ end }}' in text
    assert "translated to Go template syntax" in text
    # an existing Modelfile is not replaced without --force
    (tmp_path / "other.Modelfile").write_text("mine")
    again = ["export", str(ws.finished), f"--gguf={tmp_path / 'other.gguf'}", f"--llama-cpp={llama_cpp}"]
    assert main(again) == 2
    assert "other.Modelfile exists" in capsys.readouterr().err and not (tmp_path / "other.gguf").exists()
    assert (tmp_path / "other.Modelfile").read_text() == "mine"


# ---- llama.cpp's own converter and llama-quantize, where they are installed ------------------------------------


def real_llama_cpp() -> tuple[Path, Path | None]:
    """llama.cpp's converter (--llama-cpp's search: $LLAMA_CPP, PATH, llama-cpp-python's vendor folder) and its
    llama-quantize if built; the test is skipped, saying why, where the converter or what it imports is missing."""
    pytest.importorskip("gguf", reason="reading the GGUF needs the gguf package (pip install gguf)")
    try:
        converter = find_converter(None)
    except UsafError as err:
        pytest.skip(f"llama.cpp is not installed: {err}")
    if importlib.util.find_spec("sentencepiece") is None:
        pytest.skip("llama.cpp's converter imports sentencepiece (its requirements-convert_hf_to_gguf.txt)")
    try:
        return converter, find_quantize(converter)
    except UsafError:
        return converter, None


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """Two steps of usaf train on the bundled demo model (a Mixtral with a character vocabulary spelled as a Llama
    one, which llama.cpp's converter reads; see scripts/make_demo_model.py)."""
    run = tmp_path_factory.mktemp("demo") / "run"
    args = ["train", f"--model={DEMO / 'model'}", f"--data={DEMO / 'data' / 'train.jsonl'}", f"--out={run}"]
    assert main([*args, *(f"--set={s}" for s in [*FAST_RUN, "schedule.max_steps=2"])]) == 0
    return run


def layers() -> int:
    return json.loads((DEMO / "model" / "config.json").read_text())["num_hidden_layers"]


def read_gguf(path: Path) -> tuple[dict, int]:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    keys = ("general.name", "general.architecture", "general.file_type", "tokenizer.ggml.add_space_prefix")
    return {k: reader.fields[k].contents() for k in keys if k in reader.fields}, len(reader.tensors)


@pytest.mark.slow
def test_the_real_converter_on_an_export(demo_run, tmp_path):
    real_llama_cpp()
    out = tmp_path / "demo.gguf"
    assert main(["export", str(demo_run), f"--gguf={out}", "--outtype=f16"]) == 0
    fields, tensors = read_gguf(out)
    assert (
        fields["general.name"] == "model-run"
    )  # the bundled folder is model/ and fields["general.architecture"] == "llama"
    assert fields["general.file_type"] == 1  # LLAMA_FTYPE_MOSTLY_F16
    assert fields["tokenizer.ggml.add_space_prefix"] is False  # the text is tokenized as transformers does
    # llama.cpp's tensors: embedding, output norm and head, and per layer 4 attention, 2 norms, the router and
    # the experts' gate, up and down stacked
    assert tensors == 3 + 10 * layers()
    assert "FROM ./demo.gguf" in (tmp_path / "demo.Modelfile").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.Modelfile", "demo.gguf"]


@pytest.mark.slow
def test_the_real_llama_quantize_writes_a_k_quant(demo_run, tmp_path):
    _, quantize = real_llama_cpp()
    if quantize is None:
        pytest.skip(
            "llama.cpp's llama-quantize is not built (build/bin beside the converter, PATH, $LLAMA_QUANTIZE)"
        )
    out = tmp_path / "demo-q4_k_m.gguf"
    assert main(["export", str(demo_run), f"--gguf={out}", "--outtype=q4_k_m", "--model-name=tiny"]) == 0
    fields, tensors = read_gguf(out)
    assert fields["general.name"] == "tiny" and fields["general.file_type"] == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert tensors == 3 + 10 * layers()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-q4_k_m.Modelfile", "demo-q4_k_m.gguf"]


def test_the_llama_vocabulary_tokenizes_as_the_plain_one(tmp_path):
    plain, llama = char_tokenizer(), char_tokenizer(llama_vocab=True)
    llama.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "tokenizer.json").read_text())
    assert saved["model"]["byte_fallback"] is True and "\u2581" in saved["model"]["vocab"]
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["add_prefix_space"] is False
    for text in ("shift: abc -> bcd", " two  spaces\nand é", "<|user|>hi<eos>"):
        ids = plain(text).input_ids
        assert llama(text).input_ids == ids and llama.decode(ids) == plain.decode(ids)


def test_a_template_that_cannot_be_translated_is_said_in_the_modelfile(tmp_path):
    tokenizer = char_tokenizer()
    # content changed by the template: no fixed per-role wrapping reproduces it, so no Go template is claimed
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | upper }}{% endfor %}"
    )
    tokenizer.save_pretrained(tmp_path / "model")
    text = modelfile(tmp_path / "model", tmp_path / "m.gguf")
    assert "NOT the model's own" in text and 'eq .Role "user" }}user: {{ .Content }}' in text
    assert "FROM ./m.gguf" in text and 'PARAMETER stop "<eos>"' in text


def test_a_template_that_trims_the_content_is_translated(tmp_path):
    tokenizer = char_tokenizer()
    # Llama 3's shape: the content trimmed; the marker read off the template must survive the trim
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}<eos>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    tokenizer.save_pretrained(tmp_path / "model")
    text = modelfile(tmp_path / "model", tmp_path / "m.gguf")
    assert "translated to Go template syntax" in text and "NOT the model's own" not in text
    assert 'eq .Role "user" }}<|user|>{{ .Content }}<eos>' in text
