"""Issue 23, "poorly said": a model's damaged config.json, options of the wrong type or beyond any sane range, `~` and
`$VAR` in paths, damaged run files that `report` and `export` read, impossible plans and arguments that would
silently override one another. Each is one line naming the file or field and what to do (or, where the request is
valid, it works). The machinery and the workspace `ws` are in tests/faults.py."""

from __future__ import annotations

import json
import shutil

import pytest
from faults import NEW, Row, T, check_row, table_test

from usaf.config import INT_MOST, TOKENS_MOST, RunConfig, UsafConfig
from usaf.errors import UsafError

# ---- faults a row sets up (tmp: the row's own folder; run: its copy of a run) -------------------------------------


def edited_model(**changes):
    """A copy of the tiny model at {tmp}/m whose config.json has `changes` (None: the key removed)."""

    def setup(ctx, monkeypatch):
        shutil.copytree(ctx.ws.base, ctx.tmp / "m")
        path = ctx.tmp / "m" / "config.json"
        config = json.loads(path.read_text())
        for key, value in changes.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value
        path.write_text(json.dumps(config))

    return setup


# the tiny model (qwen3_moe) spells its expert count both ways transformers reads it
NO_EXPERTS = {"num_experts": None, "num_local_experts": None, "n_routed_experts": None}


def home_is_the_workspace(ctx, monkeypatch):
    monkeypatch.setenv("HOME", str(ctx.ws.root))
    monkeypatch.setenv("USAF_TEST_TMP", str(ctx.tmp))


def file_with_a_comma(ctx, monkeypatch):
    shutil.copy(ctx.ws.data, ctx.tmp / "a,b.jsonl")


def torn_summary(ctx, monkeypatch):
    path = ctx.run / "summary.json"
    path.write_text(path.read_text()[:20])


def base_record_a_list(ctx, monkeypatch):
    (ctx.run / "base.json").write_text("[1, 2]")


def binary_metrics(ctx, monkeypatch):
    (ctx.run / "metrics.jsonl").write_bytes(bytes(range(256)) * 8)
    (ctx.run / "router_load.json").unlink()


def config_file(text):
    def setup(ctx, monkeypatch):
        (ctx.tmp / "run.yaml").write_text(text)

    return setup


# ---- the table ---------------------------------------------------------------------------------------------------

ROWS = [
    # ---- a model's config.json, in every command that reads one
    Row("train-config-no-hidden-size", T("--model={tmp}/m", "--data={ws.data}", "--out={tmp}/run"), 2,
        ["{tmp}/m/config.json lacks 'hidden_size'", "restore the model's original config.json"],
        setup=edited_model(hidden_size=None)),
    Row("eval-config-no-vocab-size", ["eval", "{tmp}/m", "--data={ws.data}"], 2,
        ["{tmp}/m/config.json lacks 'vocab_size'"], setup=edited_model(vocab_size=None)),
    Row("select-config-no-expert-count",
        ["select", "--model={tmp}/m", "--data={ws.data}", "--out={tmp}/s.safetensors"], 2,
        ["{tmp}/m/config.json lacks the number of experts (num_experts or num_local_experts)"],
        setup=edited_model(**NO_EXPERTS), absent=["{tmp}/s.safetensors"]),
    Row("prepare-config-string-hidden-size", ["prepare", "{tmp}/m", "--quant=int8", "--out={tmp}/p"], 2,
        ["{tmp}/m/config.json: 'hidden_size' must be a positive integer, got '32'"],
        setup=edited_model(hidden_size="32"), absent=["{tmp}/p"]),
    Row("prepare-config-field-of-another-type", ["prepare", "{tmp}/m", "--quant=int8", "--out={tmp}/p"], 2,
        ["{tmp}/m/config.json: Validation error for field 'rms_norm_eps'", "expected float", "correct it"],
        setup=edited_model(rms_norm_eps="tiny"), absent=["{tmp}/p"]),
    Row("apply-config-no-hidden-size", ["apply", "{tmp}/m", "{ws.delta}", "{tmp}/out"], 2,
        ["{tmp}/m/config.json lacks 'hidden_size'"], setup=edited_model(hidden_size=None), absent=["{tmp}/out"]),
    Row("data-config-string-vocab-size", ["data", "--model={tmp}/m", "--data={ws.data}"], 2,
        ["{tmp}/m/config.json: 'vocab_size' must be a positive integer, got '104'"],
        setup=edited_model(vocab_size="104")),
    Row("plan-config-no-hidden-size", ["plan", "--model={tmp}/m"], 2, ["{tmp}/m/config.json lacks 'hidden_size'"],
        setup=edited_model(hidden_size=None)),
    Row("plan-config-string-hidden-size", ["plan", "--model={tmp}/m/config.json"], 2,
        ["{tmp}/m/config.json: 'hidden_size' must be a positive integer"], setup=edited_model(hidden_size="32")),
    Row("plan-negative-hidden-size", ["plan", "--model={tmp}/m"], 2,
        ["{tmp}/m/config.json: 'hidden_size' must be a positive integer, got -32"],
        setup=edited_model(hidden_size=-32)),
    Row("plan-zero-layers", ["plan", "--model={tmp}/m"], 2,
        ["{tmp}/m/config.json: 'num_hidden_layers' must be a positive integer, got 0"],
        setup=edited_model(num_hidden_layers=0)),
    Row("plan-top-k-above-the-experts", ["plan", "--model={tmp}/m"], 2,
        ["{tmp}/m/config.json: num_experts_per_tok = 9 is more than the model's 6 experts"],
        setup=edited_model(num_experts_per_tok=9)),
    Row("train-top-k-above-the-experts", T("--model={tmp}/m", "--data={ws.data}", "--out={tmp}/run"), 2,
        ["num_experts_per_tok = 9 is more than the model's 6 experts"], setup=edited_model(num_experts_per_tok=9)),
    Row("plan-seq-beyond-any-model", ["plan", "--model={ws.base}", f"--seq={10**12}"], 2,
        [f"--seq must be at most {TOKENS_MOST}"]),
    # ---- options: type and range at parse time, one message style
    Row("train-layers-all-means-every-layer", [*T(*NEW), "--set=select.layers=all", "--print-config"], 0,
        ["layers: null"]),
    Row("train-layers-a-word", [*T(*NEW), "--set=select.layers=first"], 2,
        ["select.layers must be a list of layer numbers (e.g. [0, 2]), or null (or all) for every layer"],
        absent=["{tmp}/run"]),
    Row("train-layers-in-a-file", [*T(*NEW), "--config={tmp}/run.yaml"], 2,
        ["{tmp}/run.yaml: select.layers must be a list of layer numbers"],
        setup=config_file("select:\n  layers: {a: 1}\n"), absent=["{tmp}/run"]),
    Row("train-select-file-a-list", [*T(*NEW), "--config={tmp}/run.yaml"], 2,
        ["{tmp}/run.yaml: select.file must be a string, got [1, 2]"],
        setup=config_file("select:\n  strategy: file\n  file: [1, 2]\n"), absent=["{tmp}/run"]),
    Row("train-seed-above-int64", [*T(*NEW), "--set=train.seed=99999999999999999999"], 2,
        [f"train.seed must be at most {INT_MOST}, got 99999999999999999999"], absent=["{tmp}/run"]),
    Row("select-seed-above-int64",
        ["select", "--model={ws.base}", "--data={ws.data}", "--out={tmp}/s.safetensors",
         "--set=select.seed=99999999999999999999"], 2, ["select.seed must be at most"],
        absent=["{tmp}/s.safetensors"]),
    Row("train-memory-limit-lots", [*T(*NEW), "--set=train.memory_limit=lots"], 2,
        ["train.memory_limit: Cannot read the size 'lots'", "e.g. 12GB"], absent=["{tmp}/run"]),
    Row("train-max-seq-len-1e11", [*T(*NEW), "--set=data.max_seq_len=100000000000"], 2,
        [f"data.max_seq_len must be at most {TOKENS_MOST}, got 100000000000"], absent=["{tmp}/run"]),
    Row("train-columns-not-a-mapping", [*T(*NEW), "--set=data.columns=5"], 2,
        ["data.columns must be a mapping"], absent=["{tmp}/run"]),
    Row("train-host-residency-unquantized", [*T(*NEW), "--set=model.residency=host", "--set=model.quant=none"], 2,
        ["model.residency=host keeps a quantized base's experts in host memory", "set model.quant=nf4"]),
    # ---- ~ and $VAR in paths: expanded as a shell would, in arguments and in path options alike
    Row("train-home-in-out-and-model", T("--model=~/base", "--data=$HOME/train.jsonl", "--out=$USAF_TEST_TMP/run"),
        0, ["trained"], setup=home_is_the_workspace),
    Row("train-home-in-set-data", T("--model={ws.base}", "--set=data.train=~/train.jsonl", "--out={tmp}/run"),
        0, ["trained"], setup=home_is_the_workspace),
    # ---- the data argument and the arguments that would override one another
    Row("train-data-file-with-a-comma", T("--model={ws.base}", "--data={tmp}/a,b.jsonl", "--out={tmp}/run"), 0,
        ["trained"], setup=file_with_a_comma),
    Row("train-data-beside-set-data", T(*NEW, "--set=data.train={tmp}/other.jsonl"), 2,
        ["--data and --set data.train=... both give data.train; give one of them"], absent=["{tmp}/run"]),
    Row("train-out-beside-resume", T("--resume={run}", "--out={tmp}/elsewhere"), 2,
        ["--resume {run} continues that run in its own folder, so --out {tmp}/elsewhere would be ignored"],
        run="unfinished", absent=["{tmp}/elsewhere"], keeps=["{run}", "{ws.base}"]),
    # ---- damaged run files
    Row("report-binary-metrics", ["report", "{run}"], 2,
        ["{run}/metrics.jsonl holds no metrics", "move it aside"], run="finished", setup=binary_metrics),
    Row("export-torn-summary", ["export", "{run}", "--delta={tmp}/d.safetensors"], 2,
        ["{run}/summary.json is damaged", "usaf train --resume {run}"], run="finished", setup=torn_summary,
        absent=["{tmp}/d.safetensors"]),
    Row("export-base-record-a-list", ["export", "{run}", "--delta={tmp}/d.safetensors"], 2,
        ["{run}/base.json holds a JSON list, not the run's record of its base"], run="finished",
        setup=base_record_a_list, absent=["{tmp}/d.safetensors"]),
]  # fmt: skip


test_fault = table_test(ROWS)


def test_the_home_row_wrote_where_home_points(ws, tmp_path, monkeypatch, capsys):
    row = next(r for r in ROWS if r.id == "train-home-in-out-and-model")
    check_row(row, ws, tmp_path, monkeypatch, capsys)
    assert (tmp_path / "run" / "summary.json").exists()
    assert not (tmp_path / "$USAF_TEST_TMP").exists() and not (tmp_path / "~").exists()


# ---- a config made in Python is checked by the same declarations, with the same messages -------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"layers": "every"}, "UsafConfig.layers must be a list of layer numbers"),
        ({"seed": 1 << 70}, f"UsafConfig.seed must be at most {INT_MOST}"),
        ({"density": 2}, "UsafConfig.density must be in (0, 1], got 2"),
        ({"num_entries": 0}, "UsafConfig.num_entries must be >= 1, got 0"),
        ({"file": [1], "strategy": "file"}, "UsafConfig.file must be a string, got [1]"),
        ({"workspace_mb": "big"}, "UsafConfig.workspace_mb must be an integer or auto, got 'big'"),
    ],
)
def test_a_selection_config_made_in_python_is_checked_as_a_file_is(kwargs, message):
    with pytest.raises(UsafError) as err:
        UsafConfig(**kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_layers_all_a_range_or_a_comma_list_are_read():
    assert UsafConfig(layers="all").layers is None
    assert UsafConfig(layers=range(2)).layers == [0, 1]
    assert UsafConfig(layers="0,1").layers == [0, 1]


def test_a_run_config_changed_in_python_is_type_checked():
    with pytest.raises(UsafError, match=r"data\.max_seq_len must be an integer, got 'long'"):
        RunConfig().replace({"data.max_seq_len": "long"})


def test_paths_in_a_config_file_are_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("USAF_DATA", "/data")
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  path: ~/base\ndata:\n  train: [$USAF_DATA/a.jsonl, '${USAF_DATA}/b.jsonl']\n")
    config = RunConfig.load(str(path))
    assert config.model.path == f"{tmp_path}/base"
    assert config.data.train == ["/data/a.jsonl", "/data/b.jsonl"]
