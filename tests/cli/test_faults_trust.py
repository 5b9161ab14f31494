"""Issue 35, by class: what usaf believes without checking. A config.json believed over its weights (missing,
unexpected or misshapen tensors, pickles), file names read from metadata that lead outside their folder (a store's
file list, a shard index, a checkpoint's state.json), and paths on the command line read as YAML. The machinery
and the workspace `ws` are in tests/faults.py."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import yaml
from faults import SET_ARGS, Row, table_test

from usaf.cli import main
from usaf.errors import UsafError
from usaf.files import INDEX_FILE, STATE_FILE, STATE_SUM_FILE, STORE_FILE
from usaf.io.guard import inside
from usaf.io.shards import read_header

LAST = "checkpoints/step-00000003"  # the finished run's latest checkpoint

# ---- faults a row sets up (tmp: the row's own folder; run: its copy of a run) ------------------------------------


def config_says(**fields):
    """A copy of the base at {tmp}/model whose config.json differs from its weights by `fields`."""

    def setup(ctx, monkeypatch):
        shutil.copytree(ctx.ws.base, ctx.tmp / "model")
        path = ctx.tmp / "model" / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))

    return setup


def store_names_outside(ctx, monkeypatch):
    """A copy of the prepared store whose usaf_store.json names its first file `../outside.safetensors` (a copy
    of it, beside the store)."""
    store = ctx.tmp / "store"
    shutil.copytree(ctx.ws.store, store)
    path = store / STORE_FILE
    metadata = json.loads(path.read_text())
    first = sorted(metadata["files"])[0]
    shutil.move(store / first, ctx.tmp / "outside.safetensors")
    metadata["files"] = {
        ("../outside.safetensors" if name == first else name): info
        for name, info in metadata["files"].items()
    }
    for info in metadata["tensors"].values():
        if info.get("file") == first:
            info["file"] = "../outside.safetensors"
    path.write_text(json.dumps(metadata))


def store_metadata_list(ctx, monkeypatch):
    shutil.copytree(ctx.ws.store, ctx.tmp / "store")
    (ctx.tmp / "store" / STORE_FILE).write_text('["files", "tensors"]\n')


def index_names(where: str):
    """A copy of the base at {tmp}/model whose weights are only reachable through its shard index naming them at
    `where` (`../x.safetensors`, or the absolute path of {tmp}/x.safetensors)."""

    def setup(ctx, monkeypatch):
        model = ctx.tmp / "model"
        shutil.copytree(ctx.ws.base, model)
        shutil.move(model / "model.safetensors", ctx.tmp / "x.safetensors")
        name = str(ctx.tmp / "x.safetensors") if where == "absolute" else "../x.safetensors"
        entries, _ = read_header(ctx.tmp / "x.safetensors")
        (model / INDEX_FILE).write_text(
            json.dumps({"metadata": {}, "weight_map": dict.fromkeys(entries, name)})
        )

    return setup


def state_names_outside(ctx, monkeypatch):
    """The run's latest state.json lists, with its true sha256, a file outside the checkpoint (and its
    state.sha256 is made to match, as a careful forger would)."""
    secret = ctx.tmp / "secret.txt"
    secret.write_text("not the run's\n")
    folder = ctx.run / LAST
    state = json.loads((folder / STATE_FILE).read_text())
    state["files"]["../../../secret.txt"] = hashlib.sha256(secret.read_bytes()).hexdigest()
    (folder / STATE_FILE).write_text(json.dumps(state))
    (folder / STATE_SUM_FILE).write_text(hashlib.sha256((folder / STATE_FILE).read_bytes()).hexdigest())


def write_prompts(ctx, monkeypatch):
    (ctx.tmp / "prompts.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")


MODEL = "{tmp}/model"
TRAIN = [
    "train",
    f"--model={MODEL}",
    "--data={ws.data}",
    "--out={tmp}/run",
    *SET_ARGS,
    "--set=schedule.max_steps=1",
]
EVAL = ["eval", MODEL, "--data={ws.data}"]
KEEP = ["{ws.base}", MODEL]
STORE_TRAIN = ["train", "--model={tmp}/store", "--data={ws.data}", "--out={tmp}/run", *SET_ARGS,
               "--set=model.quant=int8", "--set=schedule.max_steps=1"]  # fmt: skip
FIX = "restore the model's original config.json"

ROWS = [
    # a config.json believed over its weights (each trained or evaluated a partly random model, or ended in a
    # traceback of transformers', before the check)
    Row("more-layers-train", TRAIN, 2, ["model.layers.2.", "num_hidden_layers = 3", FIX],
        setup=config_says(num_hidden_layers=3), keeps=KEEP, absent=["{tmp}/run"]),
    Row("more-layers-eval", EVAL, 2, ["model.layers.2.", "num_hidden_layers = 3"],
        setup=config_says(num_hidden_layers=3), keeps=KEEP),
    Row("fewer-layers-train", TRAIN, 2, ["'model.layers.1.", "does not expect", "num_hidden_layers = 1"],
        setup=config_says(num_hidden_layers=1), keeps=KEEP, absent=["{tmp}/run"]),
    Row("fewer-layers-eval", EVAL, 2, ["'model.layers.1.", "num_hidden_layers = 1"],
        setup=config_says(num_hidden_layers=1), keeps=KEEP),
    Row("hidden-size", TRAIN, 2, ["'lm_head.weight' is [104, 32]", "hidden_size = 48", "[104, 48]"],
        setup=config_says(hidden_size=48), keeps=KEEP, absent=["{tmp}/run"]),
    Row("expert-count", TRAIN, 2, ["mlp.experts.", "num_local_experts = 8"],
        setup=config_says(num_local_experts=8, n_routed_experts=8), keeps=KEEP, absent=["{tmp}/run"]),
    Row("vocab-size", EVAL, 2, ["'lm_head.weight' is [104, 32]", "vocab_size = 120"],
        setup=config_says(vocab_size=120), keeps=KEEP),
    Row("head-dim", TRAIN, 2, ["self_attn.", "head_dim = 12"],
        setup=config_says(head_dim=12), keeps=KEEP, absent=["{tmp}/run"]),
    Row("head-dim-prepare", ["prepare", MODEL, "--quant=int8", "--out={tmp}/store"], 2, ["head_dim = 12"],
        setup=config_says(head_dim=12), keeps=KEEP, absent=["{tmp}/store"]),
    # weights only as pickles: one line saying to convert, from every command that loads a model
    *[Row(f"pickles-{name}", argv, 2, ["{ws.pickles}", "pytorch_model.bin", "convert them to safetensors"],
          setup=write_prompts, keeps=["{ws.pickles}"], absent=["{tmp}/out"])
      for name, argv in [
          ("train", ["train", "--model={ws.pickles}", "--data={ws.data}", "--out={tmp}/out", *SET_ARGS]),
          ("eval", ["eval", "{ws.pickles}", "--data={ws.data}"]),
          ("generate", ["generate", "{ws.pickles}", "--prompts={tmp}/prompts.jsonl", "--out={tmp}/out"]),
          ("prepare", ["prepare", "{ws.pickles}", "--quant=int8", "--out={tmp}/out"]),
      ]],
    # names read from metadata that lead outside their folder (each read the file outside before)
    Row("store-file-outside", STORE_TRAIN, 2,
        ["usaf_store.json's files", "'../outside.safetensors'", "outside {tmp}/store"],
        setup=store_names_outside, keeps=["{tmp}/store", "{tmp}/outside.safetensors"], absent=["{tmp}/run"]),
    Row("store-metadata-list", STORE_TRAIN, 2, ["usaf_store.json holds a JSON list, not a store's metadata"],
        setup=store_metadata_list, keeps=["{tmp}/store"], absent=["{tmp}/run"]),
    Row("index-relative-outside", TRAIN, 2, [f"{INDEX_FILE}'s weight_map", "'../x.safetensors'", "outside"],
        setup=index_names("relative"), keeps=KEEP, absent=["{tmp}/run"]),
    Row("index-absolute", EVAL, 2, [f"{INDEX_FILE}'s weight_map", "'{tmp}/x.safetensors'", "outside"],
        setup=index_names("absolute"), keeps=KEEP),
    Row("state-file-outside", ["export", "{run}", "--delta={tmp}/d.safetensors"], 2,
        ["state.json's files", "'../../../secret.txt'", "outside"],
        run="finished", setup=state_names_outside, keeps=["{run}", "{ws.base}"], absent=["{tmp}/d.safetensors"]),
]  # fmt: skip

test_fault = table_test(ROWS)


# ---- command-line paths are strings, taken verbatim --------------------------------------------------------------

ODD_NAMES = ["qwen #2", "a: b", "line\nbreak", "modèle ü #x: y"]


def test_model_path_verbatim(ws, tmp_path, capsys):
    """--model, --data and --eval-data reach the configuration as typed (YAML would read ` #` as a comment and
    `: ` as a mapping); a decoy `qwen` folder must not be what is trained."""
    (tmp_path / "qwen").mkdir()
    for name in ODD_NAMES:
        folder = tmp_path / name
        shutil.copytree(ws.base, folder)
        data = tmp_path / f"{name}.jsonl"
        shutil.copy(ws.data, data)
        argv = ["train", f"--model={folder}", f"--data={data}", f"--eval-data={data}", "--print-config"]
        capsys.readouterr()
        assert main(argv) == 0
        printed = yaml.safe_load(capsys.readouterr().out)
        assert printed["model"]["path"] == str(folder)
        assert printed["data"]["train"] == [str(data)]
        assert printed["data"]["eval"] == [str(data)]


@pytest.mark.slow
def test_trains_the_folder_named(ws, tmp_path):
    """`usaf train --model "…/qwen #2"` trains that folder (its run records it as the base)."""
    folder = tmp_path / "qwen #2: ü"
    shutil.copytree(ws.base, folder)
    out = tmp_path / "run"
    argv = [
        "train",
        f"--model={folder}",
        f"--data={ws.data}",
        f"--out={out}",
        *SET_ARGS,
        "--set=schedule.max_steps=1",
    ]
    assert main(argv) == 0
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["model"]["path"] == str(folder)


def test_names_from_metadata_stay_inside_their_folder(tmp_path):
    """`inside`: a name, or a link, that leads out of its folder is one line naming the metadata entry; a hub
    cache snapshot's links into its own blobs are where its files belong."""
    folder = tmp_path / "store"
    folder.mkdir()
    (tmp_path / "outside.safetensors").write_bytes(b"x")
    (folder / "link.safetensors").symlink_to(tmp_path / "outside.safetensors")
    (folder / "own.safetensors").write_bytes(b"x")
    assert inside(folder, "own.safetensors", "meta") == folder / "own.safetensors"
    for name in [
        "../outside.safetensors",
        str(tmp_path / "outside.safetensors"),
        "link.safetensors",
        "a/../..",
        "",
    ]:
        with pytest.raises(UsafError, match=r"^meta\[x\] names"):
            inside(folder, name, "meta[x]")
    snapshot = tmp_path / "models--org--name" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (tmp_path / "models--org--name" / "blobs").mkdir()
    (tmp_path / "models--org--name" / "blobs" / "sha").write_bytes(b"x")
    (snapshot / "model.safetensors").symlink_to("../../blobs/sha")
    assert inside(snapshot, "model.safetensors", "index") == snapshot / "model.safetensors"
