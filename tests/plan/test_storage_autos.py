"""model.quant, model.residency and model.cache_mb are autos (issue 47): the headline models on their cards plan to
fit with no flags, `usaf train --model DIR --card CARD` resolves exactly what `usaf plan` prints, an explicit value
is never overridden, and a card too small for anything is told the smallest card and RAM that would do."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from usaf import planner
from usaf.cli import build_parser, main
from usaf.commands.train import effective_config
from usaf.planner.sizes import GiB, parse_size
from usaf.train import memory_plan, runtime
from usaf.train.loop import resolved_run
from usaf.train.recompute import choose_recompute

PRESETS = Path(planner.__file__).resolve().parent.parent / "presets"

# (preset, card, its memory): the headline models on the cards the README promises them
HEADLINE = [
    ("qwen3-30b-a3b", "rtx-3060-12gb", "12GB"),
    ("gpt-oss-20b", "rtx-4060-ti-16gb", "16GB"),
    ("mixtral-8x7b", "rtx-3090", "24GB"),
    ("olmoe-1b-7b", "rtx-3060-12gb", "12GB"),
]
RAM = "32GB"


def plan_out(capsys, *args) -> tuple[int, str]:
    code = main(["plan", *args])
    return code, capsys.readouterr().out


def block(out: str) -> list[str]:
    """The effective settings block's rows (the card's row apart: its budget names where it came from)."""
    lines = out.splitlines()
    start = lines.index("effective settings:")
    rows = []
    for line in lines[start + 1 :]:
        if not line.startswith("  "):
            break
        rows.append(line)
    return rows


def model_folder(tmp_path: Path, preset: str) -> Path:
    """A model folder holding the preset's config.json alone: what the plan reads, no weights."""
    folder = tmp_path / preset
    folder.mkdir()
    shutil.copy(PRESETS / f"{preset}.json", folder / "config.json")
    return folder


@pytest.mark.parametrize("preset, card, vram", HEADLINE, ids=[h[0] for h in HEADLINE])
def test_the_headline_models_fit_their_cards_with_no_flags_and_train_resolves_the_same(
    capsys, tmp_path, monkeypatch, preset, card, vram
):
    folder = model_folder(tmp_path, preset)
    code, out = plan_out(capsys, "--model", str(folder), "--vram", vram, "--ram", RAM)
    assert code == 0, out
    assert re.search(r"^verdict: (fits on device|needs host offload)", out, re.MULTILINE), out
    peak = float(re.search(r"^peak\s+([\d.]+) GB", out, re.MULTILINE).group(1))
    assert peak <= parse_size(vram) / GiB
    for key in ("model.quant", "model.residency"):
        assert re.search(rf"^{key}=auto: \w+, ", out, re.MULTILINE), key  # each auto says its choice and why
    planned = block(out)

    # usaf train --model DIR --card CARD, on a host of the same RAM, as its rank would resolve it on that GPU
    monkeypatch.setattr(planner.ledger, "machine_ram", lambda: parse_size(RAM))
    args = build_parser().parse_args(["train", "--model", str(folder), "--card", card])
    config = effective_config(args)
    assert config.train.card == card and config.model.quant == "auto" and config.model.residency == "auto"
    # the GPU's device and dtype as usaf train resolves them there (only the planner reads them here)
    cuda = torch.device("cuda")
    dtype = memory_plan.TORCH_DTYPES[planner.default_dtype(planner.DEVICES[card])]
    monkeypatch.setattr(runtime, "resolve_device", lambda _: cuda)
    monkeypatch.setattr(runtime, "resolve_dtype", lambda _, __: dtype)
    resolved, lines = resolved_run(config)
    recompute = choose_recompute(resolved, cuda, dtype).recompute
    trained = block(memory_plan.effective_settings(resolved, cuda, dtype, recompute))
    assert planned[:-1] == trained[:-1]
    assert planned[-1].split()[1] == trained[-1].split()[1] == f"{card},"  # the same card, by flag or by name
    # and the config the run records holds numbers, not autos
    for value in (
        resolved.model.quant,
        resolved.model.residency,
        resolved.model.cache_mb,
        resolved.select.density,
    ):
        assert value != "auto"
    assert [line for line in lines if line.startswith("model.")]


def test_the_readme_first_example_needs_no_storage_flags():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    first = next(line for line in readme.splitlines() if line.strip().startswith("usaf plan --model"))
    assert "--quant" not in first and "--residency" not in first, first


def test_an_explicit_storage_is_never_overridden(capsys):
    code, out = plan_out(
        capsys,
        "--model",
        "qwen3-30b-a3b",
        "--vram",
        "12GB",
        "--ram",
        RAM,
        "--quant",
        "int8",
        "--residency",
        "device",
    )
    assert code == 1 and "verdict: does not fit" in out
    assert "  base:      experts int8, residency device" in out
    assert "model.quant=auto" not in out and "model.residency=auto" not in out
    # only the residency auto: it moves the int8 experts the user asked for, never their format
    code, out = plan_out(
        capsys, "--model", "qwen3-30b-a3b", "--vram", "12GB", "--ram", RAM, "--quant", "int8"
    )
    assert code == 0 and "model.quant=auto" not in out
    assert re.search(r"^model\.residency=auto: host, in pinned host memory", out, re.MULTILINE)


def test_storage_takes_the_least_lossy_that_fits_and_the_cache_takes_what_is_left():
    """Ample memory keeps the experts unquantized on the device; a 12 GB card quantizes them, moves them to host
    memory only when even the most compact format does not fit there, and caches what the plan leaves free."""
    shape = planner.model_shape(planner.load_model_config("olmoe-1b-7b")[1], "olmoe-1b-7b")
    auto = planner.PlanSettings(dtype="bf16")
    h100 = planner.DEVICES["h100"]
    roomy, lines = planner.auto_storage(shape, auto, h100, ram=64 * GiB, quant=True, residency=True)
    assert (roomy.quant, roomy.residency) == ("none", "device") and "the least lossy storage" in lines[0]
    small = planner.DEVICES["rtx-3060-12gb"]
    chosen, lines = planner.auto_storage(shape, auto, small, ram=64 * GiB, quant=True, residency=True)
    assert (chosen.quant, chosen.residency) == ("int8", "device")
    assert "unquantized experts on the device would peak at" in lines[0]
    # the order is storage first: every format that is less lossy does not fit anywhere in memory
    for quant in planner.quant_formats()[: planner.quant_formats().index(chosen.quant)]:
        for residency in planner.storage.residencies(quant, small):
            if residency != "mmap":
                assert not planner.plan(shape, chosen.replace(quant=quant, residency=residency), small).fits
    # the cache: with the experts in host memory, the room the plan leaves on the device (none on the device)
    hosted = chosen.replace(quant="nf4", residency="host")
    cached, line = planner.auto_cache(shape, hosted, small, ram=64 * GiB)
    assert cached.cache_mb > 0 and "most-routed experts" in line
    with_cache = planner.plan(shape, cached, small, ram=64 * GiB)
    assert with_cache.fits and with_cache.device_peak <= small.memory * (
        1 - planner.storage.CACHE_HEADROOM
    ) + (1 << 20)
    assert planner.auto_cache(shape, chosen, small, ram=64 * GiB) == (chosen.replace(cache_mb=0), None)


def test_a_card_too_small_for_anything_is_told_the_smallest_card_and_ram_that_would_do(capsys):
    code, out = plan_out(capsys, "--model", "qwen3-30b-a3b", "--vram", "2GB", "--ram", "8GB")
    assert code == 1
    line = next(line for line in out.splitlines() if line.startswith("model.quant/model.residency=auto:"))
    found = re.search(
        r"the smallest that would do: a [\d.]+ GB card \(([\w-]+)\) with ([\d.]+ GB) of host RAM", line
    )
    assert found, line
    card, ram = found.group(1), found.group(2).replace(" ", "")
    code, again = plan_out(capsys, "--model", "qwen3-30b-a3b", "--device", card, "--ram", ram)
    assert code == 0, again  # the machine it names does fit


def test_the_autos_are_recorded_in_a_store_and_a_published_checkpoint_keeps_its_format(tmp_path, capsys):
    """A published MXFP4 checkpoint's experts stay MXFP4 (the auto says so), and its config records none (the
    published format is asked for by nothing)."""
    folder = model_folder(tmp_path, "gpt-oss-20b")
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    code, out = plan_out(capsys, "--model", str(folder), "--vram", "16GB", "--ram", RAM)
    assert code == 0 and "model.quant=auto: mxfp4, the checkpoint's published format" in out
    assert "  base:      experts mxfp4" in out
