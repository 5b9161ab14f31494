"""Issue 35: what the model is, answered once (usaf.io.model_source). A delta meets a base only through the identity
check `usaf apply` makes; a prepared store is known by its own metadata, which is checked (malformed, a list, or
contradicted by model.quant: one line); a run or a model where the other is expected is named as such."""

from __future__ import annotations

import io
import json
import shutil

from faults import Row, T, delta_parts, table_test, write_delta

from usaf.files import STORE_FILE


def prompts(ctx, monkeypatch):
    (ctx.tmp / "p.jsonl").write_text(json.dumps({"prompt": "copy: ab ->"}) + "\n")
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n/exit\n"))  # chat: never reached when refused


def store_with(text: str):
    """A copy of the workspace's int8 store, its metadata replaced by `text` (and a prompts file)."""

    def setup(ctx, monkeypatch):
        shutil.copytree(ctx.ws.store, ctx.tmp / "store")
        (ctx.tmp / "store" / STORE_FILE).write_text(text)
        prompts(ctx, monkeypatch)

    return setup


def delta_without_base_record(ctx, monkeypatch):
    """{tmp}/stripped.safetensors: the workspace's delta with no record of its base (as usaf apply refuses it)."""
    tensors, info = delta_parts(ctx.ws.delta)
    write_delta(ctx.tmp / "stripped.safetensors", tensors, {k: v for k, v in info.items() if k != "base"})
    prompts(ctx, monkeypatch)


GEN = ["--prompts={tmp}/p.jsonl", "--out={tmp}/o.jsonl"]
KEEP = ["{ws.altered}", "{ws.delta}", "{ws.finished}", "{ws.base}"]

# fmt: off
ROWS = [
    # ---- a delta meets a base: the same identity check as usaf apply, whatever the command
    Row("generate-delta-on-other-base", ["generate", "{ws.altered}", "--delta={ws.delta}", *GEN], 2,
        ["differs from the base {ws.delta} was trained on"], setup=prompts, keeps=KEEP, absent=["{tmp}/o.jsonl"]),
    Row("chat-delta-on-other-base", ["chat", "{ws.altered}", "--delta={ws.delta}"], 2,
        ["differs from the base {ws.delta} was trained on"], setup=prompts, keeps=KEEP),
    Row("generate-delta-without-base-record", ["generate", "{ws.base}", "--delta={tmp}/stripped.safetensors", *GEN],
        2, ["has no record of the base it was trained on", "--unchecked-base"], setup=delta_without_base_record,
        keeps=KEEP, absent=["{tmp}/o.jsonl"]),
    Row("chat-delta-without-base-record", ["chat", "{ws.base}", "--delta={tmp}/stripped.safetensors"], 2,
        ["has no record of the base it was trained on", "--unchecked-base"], setup=delta_without_base_record,
        keeps=KEEP),
    Row("generate-delta-without-base-record-unchecked", ["generate", "{ws.base}",
        "--delta={tmp}/stripped.safetensors", "--unchecked-base", *GEN], 0, ["wrote 1 rows"],
        setup=delta_without_base_record, keeps=KEEP),
    # ---- a store's format is its metadata's: another model.quant (or --quant) is refused, never half-honoured
    Row("train-store-other-quant", T("--model={ws.store}", "--data={ws.data}", "--out={tmp}/run",
        "--set=model.quant=nf4"), 2, ["{ws.store} is a store prepared as int8", "model.quant=nf4"],
        keeps=["{ws.store}"], absent=["{tmp}/run"]),
    Row("plan-store-other-quant", ["plan", "--model={ws.store}", "--quant=int4", "--vram=12GB"], 2,
        ["{ws.store} is a store prepared as int8", "model.quant=int4"], keeps=["{ws.store}"]),
    # ---- a store's metadata that is not what usaf prepare writes: one line naming it
    Row("generate-store-metadata-malformed", ["generate", "{tmp}/store", *GEN], 2,
        ["{tmp}/store/usaf_store.json is unreadable or corrupted"], setup=store_with('{"format": "usaf-st'),
        absent=["{tmp}/o.jsonl"]),
    Row("generate-store-metadata-list", ["generate", "{tmp}/store", *GEN], 2,
        ["{tmp}/store/usaf_store.json holds a JSON list"], setup=store_with("[1, 2]"), absent=["{tmp}/o.jsonl"]),
    Row("train-store-metadata-list", T("--model={tmp}/store", "--data={ws.data}", "--out={tmp}/run"), 2,
        ["{tmp}/store/usaf_store.json holds a JSON list"], setup=store_with("[]"), absent=["{tmp}/run"]),
    Row("eval-store-metadata-no-quant", ["eval", "{tmp}/store", "--data={ws.data}"], 2,
        ["{tmp}/store/usaf_store.json has no valid 'quant'"],
        setup=store_with(json.dumps({"format": "usaf-store", "format_version": 1}))),
    Row("apply-store-metadata-list", ["apply", "{tmp}/store", "{ws.delta}", "{tmp}/out"], 2,
        ["{tmp}/store/usaf_store.json holds a JSON list"], setup=store_with("[]"), absent=["{tmp}/out"]),
    # ---- a run where a model is expected, a model where a run is
    Row("train-on-a-run", T("--model={ws.finished}", "--data={ws.data}", "--out={tmp}/run"), 2,
        ["model.path {ws.finished} is a usaf run, not a model", "--resume"], absent=["{tmp}/run"]),
    Row("apply-on-a-run", ["apply", "{ws.finished}", "{ws.delta}", "{tmp}/out"], 2,
        ["BASE_DIR {ws.finished} is a usaf run, not a base model"], absent=["{tmp}/out"]),
    Row("export-a-model-folder", ["export", "{ws.base}", "--delta={tmp}/d.safetensors"], 2,
        ["RUN_DIR {ws.base} is a model folder, not a usaf run"], absent=["{tmp}/d.safetensors"]),
]
# fmt: on

test_fault = table_test(ROWS)
