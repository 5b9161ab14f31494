"""Issue 35: every kind of model source (a model folder, a cached hub id, a `usaf prepare` store, a published MXFP4
checkpoint, a run, a merged export) x every command that takes a model (train, eval, select, plan, generate, chat,
export, apply): real work where the pair makes sense, one line where it does not. The sources are made once for the
module; the same weights reached two ways give the same answers."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
from faults import SET_ARGS
from helpers import make_model_dir, write_copy_task

from usaf.cli import main
from usaf.io.model_source import model_source
from usaf.testing.published import make_mxfp4_gpt_oss

HUB_ID = "tinyorg/tiny-moe"
REVISION = "0123456789abcdef0123456789abcdef01234567"
SETS = [*SET_ARGS, "--set=select.calibration_batches=1"]  # one calibration batch: the matrix is about sources
RUN_SETS = [*SETS, "--set=schedule.max_steps=1", "--set=data.eval_fraction=0"]
SOURCES = ["folder", "hub", "store", "published", "run", "merged"]
# about a minute of CPU in all (a dozen trainings, selections and generations on six sources): in `make test`, out
# of the fast loop
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """{kind: what the user types}, plus the data, prompts and the run's delta; the hub cache and usaf's cache of
    prepared stores point into the module's folder while it lasts."""
    root = tmp_path_factory.mktemp("sources")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_CACHE", str(root / "hub"))
        mp.setenv("USAF_CACHE", str(root / "cache"))
        base = make_model_dir(root / "base")
        snapshot = root / "hub" / f"models--{HUB_ID.replace('/', '--')}" / "snapshots" / REVISION
        shutil.copytree(base, snapshot)
        (snapshot.parents[1] / "refs").mkdir()
        (snapshot.parents[1] / "refs" / "main").write_text(REVISION)
        data = write_copy_task(root / "train.jsonl", 16)
        prompts = root / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": f"copy {w} ->"}) + "\n" for w in ("abcde", "fedcb")))
        paths = {
            "folder": str(base),
            "hub": HUB_ID,
            "store": str(root / "store"),
            "published": str(make_mxfp4_gpt_oss(root / "mxfp4")),
            "run": str(root / "run"),
            "merged": str(root / "merged"),
        }
        assert main(["prepare", str(base), "--quant=nf4", f"--out={paths['store']}"]) == 0
        assert main(["train", f"--model={base}", f"--data={data}", f"--out={paths['run']}", *RUN_SETS]) == 0
        delta = root / "delta.safetensors"
        assert main(["export", paths["run"], f"--merged={paths['merged']}", f"--delta={delta}"]) == 0
        yield {**paths, "data": str(data), "prompts": str(prompts), "delta": str(delta), "cache": {}}


def test_each_source_is_recognised(src):
    kinds = {kind: model_source(src[kind]) for kind in SOURCES}
    assert {k: s.kind for k, s in kinds.items()} == dict(zip(SOURCES, SOURCES, strict=True))
    assert kinds["store"].quant == "nf4" and kinds["published"].quant == "mxfp4"
    assert kinds["hub"].path.endswith(REVISION) and kinds["run"].base().kind == "folder"


def _argv(command: str, kind: str, src: dict, out: Path) -> list[str]:
    model = src[kind]
    if command == "train":
        return ["train", f"--model={model}", f"--data={src['data']}", f"--out={out}/run", *RUN_SETS]
    if command == "eval":
        return ["eval", model, f"--data={src['data']}", *SET_ARGS[:2]]
    if command == "select":
        return ["select", f"--model={model}", f"--data={src['data']}", f"--out={out}/sel.safetensors", *SETS]
    if command == "plan":
        return ["plan", f"--model={model}", "--vram=12GB", "--ram=32GB"]
    if command == "generate":
        return [
            "generate",
            model,
            f"--prompts={src['prompts']}",
            f"--out={out}/o.jsonl",
            "--max-new-tokens=4",
        ]
    if command == "chat":
        return ["chat", model, "--max-new-tokens=4"]
    if command == "export":
        return ["export", model, f"--delta={out}/d.safetensors"]
    assert command == "apply"
    return ["apply", model, src["delta"], str(out / "applied")]


def run_cell(command: str, kind: str, src: dict, tmp_path: Path, monkeypatch, capsys) -> tuple[int, str, str]:
    """One command on one source, in-process, in the source fixture's environment (memoised per module: the
    comparisons below reuse the matrix's own results)."""
    key = (command, kind)
    if key not in src["cache"]:
        monkeypatch.setenv("HF_HUB_CACHE", str(Path(src["folder"]).parent / "hub"))
        monkeypatch.setenv("USAF_CACHE", str(Path(src["folder"]).parent / "cache"))
        monkeypatch.setattr("sys.stdin", io.StringIO("copy abcde ->\n/exit\n"))
        capsys.readouterr()
        rc = main(_argv(command, kind, src, tmp_path))
        out, err = capsys.readouterr()
        assert "Traceback" not in out + err
        if command == "generate" and rc == 0:
            out = [
                row["completion"] for row in map(json.loads, (tmp_path / "o.jsonl").read_text().splitlines())
            ]
        if command == "eval" and rc == 0:
            out = json.loads(out[out.index("{") :])["loss"]
        src["cache"][key] = (rc, out, err)
    return src["cache"][key]


# what each pair must do: 0 (and the output checked below), or the fragment of the one line that refuses it
NOT_A_MODEL = "is a usaf run, not a model"
NOT_A_RUN = "not a usaf run"
CELLS = {
    "train": {**dict.fromkeys(SOURCES, 0), "run": NOT_A_MODEL},
    "eval": dict.fromkeys(SOURCES, 0),
    "select": {**dict.fromkeys(SOURCES, 0), "run": NOT_A_MODEL},
    "plan": dict.fromkeys(SOURCES, 0),
    "generate": dict.fromkeys(SOURCES, 0),
    "chat": dict.fromkeys(SOURCES, 0),
    "export": {**dict.fromkeys(SOURCES, NOT_A_RUN), "run": 0},
    "apply": {
        "folder": 0,
        "hub": 0,  # the same bytes as the folder, in the hub cache
        "store": "is a usaf prepared (quantized) store; use the full-precision checkpoint",
        "published": "was made for a qwen3_moe model",
        "run": "is a usaf run, not a base model",
        "merged": "differs from the base",  # the trained entries are written in: not the base
    },
}
MATRIX = [(command, kind) for command, row in CELLS.items() for kind in row]


@pytest.mark.parametrize(("command", "kind"), MATRIX, ids=[f"{c}-{k}" for c, k in MATRIX])
def test_source_x_command(command, kind, src, tmp_path, monkeypatch, capsys):
    want = CELLS[command][kind]
    rc, out, err = run_cell(command, kind, src, tmp_path, monkeypatch, capsys)
    if want != 0:
        assert rc == 2 and err.startswith("usaf: error: ") and err.count("\n") == 1, (rc, err)
        assert want in err, err
        return
    assert rc == 0, err
    made = {
        "train": tmp_path / "run" / "summary.json",
        "select": tmp_path / "sel.safetensors",
        "generate": tmp_path / "o.jsonl",
        "export": tmp_path / "d.safetensors",
        "apply": tmp_path / "applied" / "config.json",
    }
    if command in made:
        assert made[command].is_file()
    if command == "eval":
        assert 0 < out < 20
    if command == "generate":
        assert len(out) == 2
    if command == "chat":
        assert "usaf chat with" in out and out.rstrip().endswith(">")
    if command == "plan":
        assert "verdict:" in out


def test_same_weights_give_the_same_answers(src, tmp_path, monkeypatch, capsys):
    """A run and its merged export are the same model; a folder and its hub snapshot are the same model."""

    def result(command, kind):
        cell = tmp_path / f"{command}-{kind}"
        cell.mkdir(exist_ok=True)
        rc, out, err = run_cell(command, kind, src, cell, monkeypatch, capsys)
        assert rc == 0, err
        return out

    assert result("eval", "run") == pytest.approx(result("eval", "merged"), rel=1e-5)
    assert result("eval", "hub") == result("eval", "folder")
    assert result("eval", "run") != result("eval", "folder")  # the run did train something
    assert result("generate", "run") == result("generate", "merged")
    assert result("generate", "hub") == result("generate", "folder")


def test_prepare_train_generate_needs_no_repeated_option(src, tmp_path, monkeypatch, capsys):
    """docs/memory.md's path: a store prepared once, trained on and generated from, `model.quant` never repeated."""
    monkeypatch.setenv("USAF_CACHE", str(tmp_path / "cache"))
    store, run, out = tmp_path / "store", tmp_path / "run", tmp_path / "o.jsonl"
    assert main(["prepare", src["folder"], "--quant", "nf4", "--out", str(store)]) == 0
    assert main(["train", "--model", str(store), "--data", src["data"], "--out", str(run), *RUN_SETS]) == 0
    assert (
        main(["generate", str(run), "--prompts", src["prompts"], "--out", str(out), "--max-new-tokens=2"])
        == 0
    )
    assert len(out.read_text().splitlines()) == 2
    assert (
        "model:\n" in (run / "config.yaml").read_text() and "quant: nf4" in (run / "config.yaml").read_text()
    )
    assert not (tmp_path / "cache").exists()  # the store itself was trained on: nothing prepared again
    capsys.readouterr()
