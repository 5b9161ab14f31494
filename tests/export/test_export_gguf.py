"""`usaf export --gguf`: llama.cpp's converter found (--llama-cpp, $LLAMA_CPP), run on the merged export, its file
placed only when it is one; a missing or failing converter is one line and leaves nothing behind.

The converter here is a stand-in with llama.cpp's command line (no network in tests; `helpers.fake_llama_cpp`): it
records what it was given and the merged checkpoint's bytes, so the test sees it converted exactly what `--merged`
writes."""

import hashlib
import json
from pathlib import Path

import pytest
from helpers import fake_llama_cpp

from usaf.cli import main


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
    assert "--outtype must be one of f16, bf16, q8_0, f32" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_gguf_never_replaces_another_file(ws, llama_cpp, tmp_path, capsys):
    out = tmp_path / "notes.gguf"
    out.write_text("mine")
    assert main(["export", str(ws.finished), f"--gguf={out}", f"--llama-cpp={llama_cpp}", "--force"]) == 2
    assert "is not a GGUF file" in capsys.readouterr().err and out.read_text() == "mine"
