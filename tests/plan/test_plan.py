"""The planner: sizes, presets against published parameter counts, the ledger's arithmetic, verdicts and the CLI."""

import json
import re
import shlex
import warnings

import pytest

from usaf import planner
from usaf.cli import main
from usaf.errors import UsafError

GiB = 1 << 30

# The long-sequence NF4 run these tests were written for, once usaf plan's own defaults; usaf plan now has none of its
# own (it plans usaf train's: seq 512 x batch 4, unquantized experts on the device, autos resolved)
LONG_NF4 = {"seq": 2048, "batch": 1, "quant": "nf4"}
LONG_NF4_FLAGS = [
    *("--seq", "2048", "--batch", "1", "--quant", "nf4", "--density", "0.01", "--residency", "auto"),
    *("--workspace-mb", "256"),
]


def long_nf4(**changes) -> planner.PlanSettings:
    return planner.PlanSettings(**{**LONG_NF4, **changes})


def shape_of(preset: str) -> planner.ModelShape:
    name, config = planner.load_model_config(preset)
    return planner.model_shape(config, name)


def run_cli(capsys, *args) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


# ---- sizes ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("12GB", 12 * GiB),
        ("12GiB", 12 * GiB),
        ("12g", 12 * GiB),
        (" 12 gb ", 12 * GiB),
        ("512MB", 512 << 20),
        ("1.5TB", int(1.5 * (1 << 40))),
        ("64k", 64 << 10),
        ("4096", 4096),
        ("4096B", 4096),
        (4096, 4096),
    ],
)
def test_sizes_are_binary_with_optional_units(text, expected):
    assert planner.parse_size(text) == expected


@pytest.mark.parametrize("text", ["12XB", "GB", "", "-1GB", "12 G B", "twelve"])
def test_a_bad_size_names_the_accepted_forms(text):
    with pytest.raises(UsafError, match=r"12GB, 12GiB, 12G, 512MB"):
        planner.parse_size(text)


# ---- presets and parameter counts -----------------------------------------------------------------------------

# Totals and active parameters per token as published by the model authors (model cards, papers), and whether
# their active count includes the input embedding table (OpenAI's gpt-oss counts leave it out; Qwen3.5's "3B
# activated" is the count without it too: 2.94 B, against 3.45 B with it).
PUBLISHED = {
    "qwen3-30b-a3b": (30.5e9, 3.3e9, True),
    "qwen3-235b-a22b": (235e9, 22e9, True),
    "qwen3.5-35b-a3b": (35e9, 3e9, False),
    "mixtral-8x7b": (46.7e9, 12.9e9, True),
    "gpt-oss-20b": (21e9, 3.6e9, False),
    "gpt-oss-120b": (117e9, 5.1e9, False),
    "olmoe-1b-7b": (6.9e9, 1.3e9, True),
    "deepseek-v2-lite": (15.7e9, 2.4e9, True),
    "deepseek-v3": (671e9, 37e9, True),
}


def test_every_preset_is_published_and_carries_its_source():
    assert sorted(planner.list_presets()) == sorted(PUBLISHED)
    for name in planner.list_presets():
        loaded_name, config = planner.load_model_config(name)
        assert loaded_name == name
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", config["_source"]), name
        # the Hugging Face repo id finds the same preset
        assert planner.load_model_config(config["_source"]) == (name, config)


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_preset_totals_match_the_published_counts(preset):
    shape = shape_of(preset)
    total, active, with_embedding = PUBLISHED[preset]
    assert shape.shapes_from == "transformers skeleton"
    assert shape.total_params == pytest.approx(total, rel=0.03)
    # "A3B"-style names round the active count, so it gets a wider margin
    counted = shape.active_params - (0 if with_embedding else shape.embedding_params)
    assert counted == pytest.approx(active, rel=0.15)


def test_exact_counts_of_the_motivating_case():
    shape = shape_of("qwen3-30b-a3b")
    assert shape.total_params == 30_532_122_624  # the checkpoint's safetensors total
    assert shape.num_moe_layers == 48 and shape.num_experts == 128 and shape.experts_per_token == 8
    assert shape.expert_weights == 48 * 128 * 3 * 2048 * 768


def test_unknown_model_types_are_planned_from_formulas():
    _, config = planner.load_model_config("qwen3-30b-a3b")
    made_up = {**config, "model_type": "made_up_moe"}
    with pytest.warns(UserWarning, match="planning from formulas") as warned:
        shape = planner.model_shape(made_up, "made-up")
    # one short line: transformers' own message lists every model type it knows (about 10,000 characters)
    assert len(str(warned[0].message)) < 500
    assert shape.shapes_from == "config formulas"
    assert shape.total_params == pytest.approx(shape_of("qwen3-30b-a3b").total_params, rel=0.03)
    assert shape.expert_weights == shape_of("qwen3-30b-a3b").expert_weights


def test_latent_attention_formulas_agree_with_the_skeleton():
    _, config = planner.load_model_config("deepseek-v3")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        formulas = planner.model_shape({**config, "model_type": "made_up_v3"}, "made-up")
    skeleton = shape_of("deepseek-v3")
    assert formulas.num_moe_layers == skeleton.num_moe_layers == 58
    assert formulas.total_params == pytest.approx(skeleton.total_params, rel=0.03)


def test_models_are_found_by_preset_directory_and_file(tmp_path):
    _, config = planner.load_model_config("olmoe-1b-7b")
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert planner.load_model_config(str(tmp_path)) == (tmp_path.name, config)
    assert planner.load_model_config(str(tmp_path / "config.json"))[1] == config
    with pytest.raises(UsafError, match="Presets: deepseek-v2-lite, deepseek-v3, gpt-oss-120b"):
        planner.load_model_config("no-such-model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsafError, match=r"has no config\.json"):
        planner.load_model_config(str(tmp_path / "empty"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UsafError, match="not valid JSON"):
        planner.load_model_config(str(tmp_path / "bad.json"))


# ---- the ledger -----------------------------------------------------------------------------------------------


def ledger(p: planner.Plan) -> dict[str, planner.LedgerLine]:
    return {line.name: line for line in p.lines}


def test_nf4_experts_take_four_and_a_half_bits_and_int8_adds_a_scale_per_row():
    shape = shape_of("qwen3-30b-a3b")
    gpu = planner.DEVICES["rtx-4090"]
    nf4 = ledger(planner.plan(shape, long_nf4(quant="nf4"), gpu, ram=64 * GiB))
    weights = shape.expert_weights
    assert nf4["frozen experts"].device == weights / 2
    assert nf4["quantization constants"].device == weights / 64 * 4
    int8 = ledger(planner.plan(shape, long_nf4(quant="int8"), gpu, ram=64 * GiB))
    assert int8["frozen experts"].device == weights
    assert int8["quantization constants"].device == 4 * shape.expert_rows
    none = ledger(planner.plan(shape, long_nf4(quant="none"), gpu, ram=64 * GiB))
    assert none["frozen experts"].device == 2 * weights and "quantization constants" not in none


def test_published_mxfp4_and_fp8_presets_are_planned_as_published_and_against_a_12gb_card(capsys):
    # gpt-oss-20b's config carries quantization_config mxfp4: its experts are planned at 4.25 bits per value (4-bit
    # codes and one 8-bit exponent scale per 32 values), never re-quantized by the search
    shape = shape_of("gpt-oss-20b")
    gpu = planner.DEVICES["rtx-4090"]
    mxfp4 = ledger(planner.plan(shape, long_nf4(quant="mxfp4"), gpu, ram=64 * GiB))
    weights = shape.expert_weights
    assert mxfp4["frozen experts"].device == weights / 2 + shape.expert_biases * 2
    assert mxfp4["quantization constants"].device == weights / 32
    code, out, _ = run_cli(
        capsys,
        "--model",
        "gpt-oss-20b",
        "--vram",
        "16GB",
        "--ram",
        "64GB",
        *LONG_NF4_FLAGS,
        "--quant",
        "auto",
    )  # auto: the published format (--quant nf4 would convert it, as usaf prepare --quant does)
    assert "experts mxfp4" in out and "--quant mxfp4" in out and "--quant nf4" not in out
    line = out.strip().splitlines()[-1]
    assert re.fullmatch(
        r"published MXFP4 experts, kept as published: 9\.\d\d GB \(4\.25 bits/weight\); on a 12 GB card "
        r"\(rtx-3060-12gb\) this run (fits|fits with the experts in host memory|does not fit)",
        line,
    ), line
    assert code == 0

    # DeepSeek-V3 publishes block-scaled FP8: one byte a value and one fp32 scale per 128x128 block
    shape = shape_of("deepseek-v3")
    fp8 = ledger(planner.plan(shape, long_nf4(quant="fp8"), planner.DEVICES["h100"], ram=2048 * GiB))
    assert fp8["frozen experts"].device == shape.expert_weights
    blocks = sum(n * -(-r // 128) * -(-c // 128) for n, r, c in shape.expert_matrices)
    assert fp8["quantization constants"].device == 4 * blocks


@pytest.mark.parametrize(
    ("quantization", "error"),
    [
        ({"quant_method": "gptq"}, "quant_method is 'gptq'"),
        ({"quant_method": "fp8"}, "no weight_block_size"),  # per-tensor FP8: usaf train refuses it too
    ],
)
def test_a_quantization_usaf_train_refuses_is_refused_by_plan_too(capsys, tmp_path, quantization, error):
    _, config = planner.load_model_config("qwen3-30b-a3b")
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    code, out, err = run_cli(capsys, "--model", str(tmp_path), "--vram", "24GB", "--ram", "64GB")
    assert code == 2 and error in err and len(err.strip().splitlines()) == 1 and not out


def test_sparse_state_counts_every_byte_per_entry_and_neurons_need_no_index():
    shape = shape_of("olmoe-1b-7b")
    cpu = planner.DEVICES["cpu"]
    element = long_nf4(density=0.01, dtype="fp32", quant="none", targets=("experts", "routers"))
    entries = planner.trained_entries(shape, element)
    assert entries == round(0.01 * shape.expert_weights)
    sparse = ledger(planner.plan(shape, element, cpu, ram=64 * GiB))["sparse state + optimizer"].device
    # value 4, int32 index 4, grad 4, bf16 moments 4, and the base (fp32 here): an unquantized store is written into
    assert sparse == entries * (4 + 4 + 4 + 4 + 4)
    nf4 = ledger(planner.plan(shape, element.replace(quant="nf4"), cpu, ram=64 * GiB))
    assert nf4["sparse state + optimizer"].device == entries * 16  # a quantized store gives the base back
    assert any(
        "16 B per trained expert entry" in note
        for note in planner.plan(shape, element.replace(quant="nf4"), cpu, ram=64 * GiB).notes
    )
    neuron = ledger(planner.plan(shape, element.replace(granularity="neuron"), cpu, ram=64 * GiB))
    assert neuron["sparse state + optimizer"].device == entries * (
        4 + 4 + 4 + 4
    )  # value, base, grad, moments
    eight_bit = ledger(planner.plan(shape, element.replace(optimizer="adamw8bit"), cpu, ram=64 * GiB))
    assert eight_bit["sparse state + optimizer"].device == sparse - entries * 2
    fp32 = ledger(planner.plan(shape, element.replace(optimizer="adamw-fp32"), cpu, ram=64 * GiB))
    assert fp32["sparse state + optimizer"].device == sparse + entries * 4


def test_residency_moves_the_experts_off_the_device_and_adds_streaming_buffers():
    shape = shape_of("qwen3-30b-a3b")
    gpu = planner.DEVICES["rtx-3060-12gb"]
    on_device = planner.plan(shape, long_nf4(residency="device"), gpu, ram=64 * GiB)
    host = planner.plan(shape, long_nf4(residency="host"), gpu, ram=64 * GiB)
    mmap = planner.plan(shape, long_nf4(residency="mmap"), gpu, ram=64 * GiB)
    experts = ledger(on_device)["frozen experts"].device
    assert ledger(host)["frozen experts"].host == experts and ledger(host)["frozen experts"].device == 0
    assert ledger(mmap)["frozen experts"].host == ledger(mmap)["frozen experts"].device == 0
    buffers = ledger(host)["offload buffers"].device
    assert buffers == pytest.approx(2 * (experts + ledger(on_device)["quantization constants"].device) / 48)
    assert (
        host.device_peak < on_device.device_peak and host.step.streaming_s > 0 == on_device.step.streaming_s
    )


def test_recomputation_keeps_one_layer_and_the_peak_is_the_largest_phase():
    shape = shape_of("qwen3-30b-a3b")
    gpu = planner.DEVICES["h100"]
    p = planner.plan(shape, long_nf4(), gpu, ram=256 * GiB)
    lines = ledger(p)
    persistent = sum(line.device for line in p.lines if line.persistent)
    layer = lines["activations: layer inputs"].device + lines["activations: one layer"].device
    layer += lines["dequant workspace"].device
    loss = lines["activations: layer inputs"].device + lines["logits chunk"].device
    assert p.device_peak == pytest.approx(
        persistent + max(layer, loss, lines["optimizer step temporaries"].device)
    )
    everything = planner.plan(shape, long_nf4(recompute=False), gpu, ram=256 * GiB)
    assert ledger(everything)["activations: all layers"].device > 40 * lines["activations: one layer"].device
    smaller_chunk = planner.plan(shape, long_nf4(logits_chunk=128), gpu, ram=256 * GiB)
    assert ledger(smaller_chunk)["logits chunk"].device < lines["logits chunk"].device / 3


def test_step_time_names_the_dominant_term():
    shape = shape_of("qwen3-30b-a3b")
    settings = long_nf4(residency="mmap", seq=512)
    slow_link = planner.plan(shape, settings, planner.DEVICES["h100"], ram=8 * GiB)  # page cache too small
    assert slow_link.step.dominant == "host->device streaming"
    compute = planner.plan(shape, long_nf4(seq=8192), planner.DEVICES["rtx-3060-12gb"], ram=64 * GiB)
    assert compute.step.dominant == "compute" and compute.step.seconds == compute.step.compute_s


def test_user_mistakes_in_settings_are_usaf_errors():
    with pytest.raises(UsafError, match="--quant must be one of none, int8, nf4, int4"):
        long_nf4(quant="gptq")  # fp8 is a published format now
    with pytest.raises(UsafError, match=r"--density must be in \(0, 1\]"):
        long_nf4(density=0)


# ---- verdicts and the command line ----------------------------------------------------------------------------


def test_qwen3_30b_on_a_12gb_card_prints_a_configuration_that_fits(capsys):
    code, out, _ = run_cli(
        capsys, "--model", "qwen3-30b-a3b", "--vram", "12GB", "--ram", "32GB", *LONG_NF4_FLAGS
    )
    assert code == 0
    for item in (
        "frozen experts",
        "quantization constants",
        "dense weights",
        "sparse state + optimizer",
        "routers (trainable)",
        "activations: layer inputs",
        "logits chunk",
        "dequant workspace",
        "offload buffers",
        "framework overhead",
    ):
        assert item in out
    assert re.search(r"^verdict: (fits on device|needs host offload)", out, re.MULTILINE)
    peak = re.search(r"^peak\s+([\d.]+) GB\s+([\d.]+) GB", out, re.MULTILINE)
    assert float(peak.group(1)) <= 12 and float(peak.group(2)) <= 32
    assert re.search(r"^step ~ [\d.]+ s on rtx-3060-12gb: .* -> \w.* dominates", out, re.MULTILINE)


def test_too_little_vram_suggests_settings_that_fit_when_planned_again(capsys):
    code, out, _ = run_cli(
        capsys, "--model", "qwen3-30b-a3b", "--vram", "6GB", "--ram", "64GB", *LONG_NF4_FLAGS, "--seq", "4096"
    )
    assert code == 1 and "verdict: does not fit" in out
    suggested = re.search(r"^settings that fit .*\n  (usaf plan .*)$", out, re.MULTILINE).group(1)
    args = shlex.split(suggested)[2:]
    assert args[args.index("--vram") + 1] == "6GB"
    code, again, _ = run_cli(capsys, *args)
    assert code == 0
    assert re.search(r"^verdict: (fits on device|needs host offload)", again, re.MULTILINE)


def test_the_suggestion_is_the_nearest_setting_that_fits():
    shape = shape_of("qwen3-30b-a3b")
    gpu = planner.DEVICES["rtx-3060-12gb"]
    request = long_nf4(seq=4096, density=0.02)
    verdict = planner.decide(shape, request, gpu, 8 * GiB, 64 * GiB)
    assert verdict.status == "does not fit"
    suggestion = verdict.suggestion
    assert suggestion.fits and suggestion.device_peak <= 8 * GiB
    again = planner.plan(shape, suggestion.settings, gpu, 8 * GiB, 64 * GiB)
    assert again.fits and again.device_peak == suggestion.device_peak
    # nothing beyond what was needed changed: quantization and batch stay as asked
    assert (suggestion.settings.quant, suggestion.settings.batch) == ("nf4", 1)


def test_a_model_that_fits_says_so_and_one_that_cannot_says_nothing_fits(capsys):
    code, out, _ = run_cli(capsys, "--model", "olmoe-1b-7b", "--device", "rtx-4090", "--ram", "32GB")
    assert code == 0 and "verdict: fits on device" in out and "--vram" not in out
    code, out, _ = run_cli(capsys, "--model", "deepseek-v3", "--vram", "12GB", "--ram", "16GB")
    assert code == 1 and "nothing searched fits" in out


def test_cli_mistakes_are_clear_errors(capsys):
    code, _, err = run_cli(capsys, "--model", "qwen3-30b-a3b", "--vram", "12XB")
    assert code == 2 and "Cannot read the size '12XB'" in err and "12GiB" in err
    code, _, err = run_cli(capsys, "--model", "qwen-9000")
    assert code == 2 and "Unknown model 'qwen-9000'" in err and "qwen3-30b-a3b" in err
    code, _, err = run_cli(capsys, "--model", "qwen3-30b-a3b", "--device", "tpu")
    assert code == 2 and "Unknown device 'tpu'" in err and "rtx-3060-12gb" in err


def test_targets_beyond_the_experts_are_in_the_ledger():
    """select.targets follows into the planner: entries of the named weights at the same density, routers only
    when targeted; the counts come from the same discovery the engine uses (tiny skeleton vs real model)."""
    from usaf.config import TARGETS
    from usaf.model.layout import find_moe_layers
    from usaf.model.targets import find_target_weights
    from usaf.testing.tiny import tiny_config, tiny_model

    config = tiny_config("qwen2_moe", tie_word_embeddings=False).to_dict()
    shape = planner.model_shape(config, "tiny")
    model = tiny_model("qwen2_moe", tie_word_embeddings=False)
    for target in ("attention", "dense_mlp", "norms", "embeddings", "lm_head"):
        real = sum(
            w.module.weight.numel() for w in find_target_weights(model, find_moe_layers(model), [target])
        )
        assert shape.target_params[target] == real, target
    base = long_nf4(density=0.1, dtype="fp32", targets=("experts", "routers"))
    wide = base.replace(targets=tuple(TARGETS))
    extra = sum(shape.target_params.values())
    assert planner.trained_entries(shape, wide) == planner.trained_entries(shape, base) + round(0.1 * extra)
    no_routers = base.replace(targets=("experts",))
    device = planner.DEVICES["cpu"]

    def line(settings, name):
        return next(x for x in planner.plan(shape, settings, device).lines if x.name == name)

    assert line(no_routers, "routers (trainable)").device == 0 < line(base, "routers (trainable)").device
    assert line(wide, "sparse state beyond the experts").device > 0
    with pytest.raises(UsafError, match="--targets"):
        long_nf4(targets=("experts", "mlp"))


def test_decay_centres_of_a_quantized_base_are_planned_in_host_memory():
    """optim.decay_to_base on a quantized base keeps each trained expert entry's starting value in host memory
    (the base dtype's bytes an entry, nothing on the device); a resident base keeps them with the entries."""
    from usaf.config import RunConfig

    shape = shape_of("qwen3-30b-a3b")
    gpu = planner.DEVICES["rtx-4090"]
    decaying = RunConfig.from_dict({"optim": {"decay_to_base": 3.0}})
    off = RunConfig.from_dict({"optim": {"decay_to_base": 0.0}})

    def lines(run, quant):
        plan = planner.plan(shape, planner.PlanSettings(run, quant=quant, density=0.01), gpu)
        return {line.name: line for line in plan.lines}

    centres = lines(decaying, "nf4")["decay centres"]
    nf4 = lines(decaying, "nf4")
    expert_entries = planner.trained_entries(shape, planner.PlanSettings(decaying, quant="nf4", density=0.01))
    assert centres.device == 0 and 0 < centres.host <= 2 * expert_entries
    assert (
        nf4["sparse state + optimizer"].device == lines(RunConfig(), "nf4")["sparse state + optimizer"].device
    )
    assert "decay centres" not in lines(off, "nf4") and "decay centres" not in lines(decaying, "none")


def test_the_ledger_counts_trained_routers_in_fp32_as_the_engine_trains_them():
    """A bf16 model's routers train with fp32 master weights, gradients and moments: the planner's routers line
    is exactly the bytes the engine adds over the bf16 weights (issue 10, item 4)."""
    import torch

    import usaf
    from usaf.model.layout import find_moe_layers
    from usaf.testing.tiny import tiny_config, tiny_model

    model = tiny_model("qwen3_moe").to(torch.bfloat16)
    usaf.prepare_model(
        model, usaf.UsafConfig(density=0.1, targets=["experts", "routers"], selection="random")
    )
    params = [p for layer in find_moe_layers(model) for p in layer.router.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    ids = torch.randint(0, 97, (1, 8))
    usaf.causal_lm_loss(model, ids, ids).backward()
    optimizer.step()
    state_bytes = sum(
        t.numel() * t.element_size() for p in params for t in optimizer.state[p].values() if t.dim()
    )
    engine = sum((p.element_size() - 2 + p.grad.element_size()) * p.numel() for p in params) + state_bytes

    shape = planner.model_shape(tiny_config("qwen3_moe").to_dict(), "tiny")
    settings = long_nf4(density=0.1, dtype="bf16", quant="none", targets=("experts", "routers"))
    line = next(
        x
        for x in planner.plan(shape, settings, planner.DEVICES["cpu"]).lines
        if x.name == "routers (trainable)"
    )
    assert shape.router_params == sum(p.numel() for p in params)
    assert line.device == engine


def test_suggested_command_lines_give_sizes_with_a_unit():
    """`usaf plan` refuses a bare number as a size, so the command lines it prints never contain one."""
    from usaf.planner.format import _size_arg
    from usaf.planner.sizes import parse_size

    for size in (12 << 30, 3 << 20, 5 << 10, 4097):
        text = _size_arg(size)
        assert not text.isdigit() and parse_size(text) == size, text


def test_reselection_probes_are_counted_and_go_with_no_reselect():
    shape = shape_of("qwen3-30b-a3b")
    gpu = planner.DEVICES["rtx-3060-12gb"]
    settings = long_nf4(density=0.01)
    entries = planner.trained_entries(shape, settings)
    with_probes = ledger(planner.plan(shape, settings, gpu, ram=32 * GiB))
    # select.oversample (4) x select.reselect_fraction (0.3) candidate entries per trained entry, fp32
    assert with_probes["reselection probes"].device == int(4 * 4 * 0.3 * entries)
    without = ledger(planner.plan(shape, settings.replace(reselect=False), gpu, ram=32 * GiB))
    assert "reselection probes" not in without


def test_plan_config_plans_the_runs_own_configuration(capsys, tmp_path):
    """`usaf plan --config run.yaml` reads the same keys `usaf train` does (and the same defaults for the rest);
    a flag beside it overrides it."""
    run = tmp_path / "run.yaml"
    run.write_text(
        "model:\n  path: qwen3-30b-a3b\n  quant: nf4\n  residency: host\n"
        "data:\n  max_seq_len: 1024\n  batch_size: 2\nselect:\n  density: 0.02\n  reselect_every: 0\n"
        "optim:\n  moments: fp32\n"
    )
    memory = ["--vram", "12GB", "--ram", "64GB"]
    code, from_config, _ = run_cli(capsys, "--config", str(run), *memory)
    flags = ["--seq", "1024", "--batch", "2", "--density", "0.02", "--quant", "nf4", "--residency", "host"]
    code_flags, from_flags, _ = run_cli(
        capsys, "--model", "qwen3-30b-a3b", *flags, "--no-reselect", "--optimizer", "adamw-fp32", *memory
    )
    # one set of defaults: the flags' plan has the config's (usaf train's) for the rest, the autos resolved alike
    assert from_config.startswith("select.workspace_mb=auto: 256 MB"), from_config
    assert (code, from_config) == (code_flags, from_flags)
    assert "seq 1024 x batch 2, density 0.02" in from_config and "adamw-fp32" in from_config
    _, overridden, _ = run_cli(capsys, "--config", str(run), "--seq", "4096", *memory)
    assert "seq 4096 x batch 2, density 0.02" in overridden
    run.write_text("data:\n  max_seq_len: 1024\n")
    code, _, err = run_cli(capsys, "--config", str(run), *memory)
    assert code == 2 and "needs --model (or --config with a model.path)" in err


# ---- several GPUs --------------------------------------------------------------------------------------------


def _lines(p) -> dict:
    return {line.name: line.device + line.host for line in p.lines}


@pytest.mark.parametrize("gpus", [2, 8])
def test_expert_parallel_divides_the_experts_and_their_entries_by_the_gpus(gpus):
    shape = shape_of("qwen3-30b-a3b")
    device = planner.DEVICES["h100"]
    one = _lines(planner.plan(shape, long_nf4(), device, ram=256 << 30))
    per_rank = _lines(planner.plan(shape, long_nf4(gpus=gpus, expert_parallel=True), device, ram=256 << 30))
    for name in ("frozen experts", "quantization constants", "sparse state + optimizer"):
        assert per_rank[name] == pytest.approx(one[name] / gpus, rel=1e-9), name
    for name in ("dense weights", "sparse state beyond the experts", "activations: one layer"):
        assert per_rank[name] == one[name], name


def test_data_parallel_adds_the_gradient_buckets_and_nothing_else():
    shape = shape_of("qwen3-30b-a3b")
    device = planner.DEVICES["rtx-4090"]
    settings = long_nf4(targets=("experts", "routers", "attention"))
    one = _lines(planner.plan(shape, settings, device, ram=64 << 30))
    two = planner.plan(shape, settings.replace(gpus=2), device, ram=64 << 30)
    reduced = planner.trained_entries(shape, settings) + planner.trained_router_params(shape, settings)
    buckets = _lines(two).pop("all-reduce buckets")
    assert buckets == 4 * reduced
    rest = {k: v for k, v in _lines(two).items() if k not in ("all-reduce buckets", "framework overhead")}
    assert rest == {k: v for k, v in one.items() if k != "framework overhead"}
    assert two.traffic.all_reduce_buffer == 4 * reduced and two.traffic.all_to_all_sent == 0
    assert two.traffic.all_reduce_sent == 4 * reduced  # a ring of 2 sends 2 (N-1)/N = once the buffer


def test_all_to_all_bytes_are_two_exchanges_per_moe_layer_in_each_pass():
    """Independent arithmetic for Qwen3-235B-A22B on 8 GPUs: T tokens x top-8 pairs x hidden 4096 x 2 B (bf16), out
    and home, in forward, recomputation and backward, 94 MoE layers, the 7/8 whose expert is elsewhere."""
    shape = shape_of("qwen3-235b-a22b")
    settings = long_nf4(seq=4096, gpus=8, expert_parallel=True)
    traffic = planner.plan(shape, settings, planner.DEVICES["h100"], ram=512 << 30).traffic
    assert traffic.all_to_all_sent == 2 * 3 * 94 * (4096 * 8) * 4096 * 2 * 7 / 8
    no_recompute = planner.plan(
        shape, settings.replace(recompute=False), planner.DEVICES["h100"], ram=512 << 30
    ).traffic
    assert no_recompute.all_to_all_sent == traffic.all_to_all_sent * 2 / 3
    assert traffic.all_to_all_s == pytest.approx(traffic.all_to_all_sent / 450e9)


def test_the_planned_all_reduce_is_the_engines_trained_values():
    """The bytes the planner says a data-parallel step sums are the trained values' fp32 gradients of a model the
    engine prepared with the same density and targets (within the per-tensor rounding of the budget)."""
    import usaf
    from usaf.testing.tiny import tiny_config, tiny_model

    targets = ("experts", "routers", "attention", "embeddings", "lm_head")
    model = usaf.prepare_model(
        tiny_model("qwen3_moe"), usaf.UsafConfig(density=0.1, targets=list(targets), selection="random")
    )
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    shape = planner.model_shape(tiny_config("qwen3_moe").to_dict(), "tiny")
    settings = long_nf4(density=0.1, dtype="fp32", quant="none", targets=targets, gpus=2)
    planned = planner.plan(shape, settings, planner.DEVICES["cpu"]).traffic.all_reduce_buffer
    assert planned == pytest.approx(4 * trained, rel=0.01)


def test_parallel_mistakes_are_one_line_errors(capsys):
    with pytest.raises(UsafError, match=r"--expert-parallel over 3 GPUs .* 128 experts per layer"):
        planner.plan(
            shape_of("qwen3-30b-a3b"),
            long_nf4(gpus=3, expert_parallel=True),
            planner.DEVICES["h100"],
        )
    with pytest.raises(UsafError, match="give --gpus 2 or more"):
        long_nf4(expert_parallel=True)
    assert main(["plan", "--model", "qwen3-30b-a3b", "--gpus", "0"]) == 2
    assert "--gpus must be at least 1, got 0" in capsys.readouterr().err


def test_plan_prints_the_per_rank_ledger_and_the_traffic(capsys):
    args = "plan --model qwen3-235b-a22b --gpus 8 --expert-parallel --device h100 --ram 256GB"
    code = main(args.split())
    out = capsys.readouterr().out
    assert code == 0 and "verdict: fits on device" in out
    assert "8 GPUs, expert parallel: each holds 1/8 of every layer's experts" in out
    assert "94 layers x 16 of 128 experts" in out
    assert re.search(r"all-to-all per step: [\d.]+ GB leaving each rank", out)
    assert re.search(r"all-reduce per step: [\d.]+ MB of fp32 gradients", out)


def test_ranks_on_one_host_share_its_ram():
    """Two data-parallel ranks on a 32 GB host each keep Qwen3-30B-A3B's 15 GB of NF4 experts in pinned memory only
    if 2 x their host ledger fits: per rank the budget is half the host."""
    shape, device = shape_of("qwen3-30b-a3b"), planner.DEVICES["rtx-3060-12gb"]
    settings = long_nf4(density=0.005, residency="host")
    one = planner.plan(shape, settings, device, ram=32 << 30)
    two = planner.plan(shape, settings.replace(gpus=2), device, ram=32 << 30)
    apart = planner.plan(shape, settings.replace(gpus=2, gpus_per_host=1), device, ram=32 << 30)
    assert one.fits and one.ram == 32 << 30
    assert two.ram == 16 << 30 and two.host_ram == 32 << 30 and not two.fits
    assert apart.ram == 32 << 30 and apart.fits
    assert "--ram 32GB" in planner.command_line("qwen3-30b-a3b", two)


# ---- one model of a run --------------------------------------------------------------------------------------


def test_the_planner_reads_the_runs_own_configuration():
    """PlanSettings is a view of a RunConfig: its settings are the run's options, and flags set those options."""
    from usaf.config import RunConfig

    run = RunConfig.from_dict(
        {
            "data": {"max_seq_len": 1024},
            "select": {"density": 0.02, "reselect_every": 0},
            "optim": {"eight_bit": True},
        }
    )
    settings = planner.settings_for_run(run, "bf16")
    assert (settings.seq, settings.density, settings.reselect, settings.optimizer) == (
        1024,
        0.02,
        False,
        "adamw8bit",
    )
    assert settings.run.select.density == 0.02
    flagged = long_nf4(seq=4096, num_entries=1000, layers="0,2")
    assert flagged.run.data.max_seq_len == 4096 and flagged.run.select.layers == [0, 2]
    assert flagged.run.select.num_entries == 1000 and flagged.quant == "nf4"
    with pytest.raises(UsafError, match=r"--num-entries must be >= 1, got 0"):
        long_nf4(num_entries=0)


def test_num_entries_is_the_budget_split_by_size_and_layers_train_their_share():
    shape = shape_of("qwen3-30b-a3b")
    targets = ("experts", "attention", "embeddings")
    budget = long_nf4(num_entries=5_000_000, targets=targets)
    assert planner.trained_entries(shape, budget) == pytest.approx(5_000_000, abs=2)
    # split by size: the experts get their share of the eligible entries, as usaf.prepare spreads it
    experts_only = planner.trained_entries(shape, budget.replace(targets=("experts",)))
    assert experts_only == 5_000_000
    everything = long_nf4(density=0.01, targets=targets)
    half = everything.replace(layers=list(range(shape.num_moe_layers // 2)))
    experts = planner.trained_entries(shape, everything.replace(targets=("experts",)))
    assert planner.trained_entries(shape, half.replace(targets=("experts",))) == pytest.approx(
        experts / 2, rel=1e-6
    )
    # with layers named, the embedding (outside the decoder layers) stays frozen
    assert planner.trained_entries(shape, half.replace(targets=("embeddings",))) == 0
    assert (
        planner.trained_router_params(shape, half.replace(targets=("routers",))) == shape.router_params // 2
    )


def test_plan_config_plans_num_entries_and_layers(capsys, tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text(
        "model:\n  path: qwen3-30b-a3b\n  quant: nf4\nselect:\n  num_entries: 2000000\n  layers: [0, 1]\n"
    )
    code, out, _ = run_cli(capsys, "--config", str(run), "--vram", "24GB", "--ram", "64GB")
    # the config's workspace auto: every expert of a projection at once
    auto = next(line for line in out.splitlines() if line.startswith("select.workspace_mb=auto"))
    assert auto.startswith("select.workspace_mb=auto: 768 MB, every expert of a projection at once"), auto
    assert code in (0, 1) and "2.00 M entries in layers [0, 1]" in out
    code_flags, flags, _ = run_cli(
        capsys, "--model", "qwen3-30b-a3b", "--num-entries", "2000000", "--layers", "0,1", "--quant", "nf4",
        "--vram", "24GB", "--ram", "64GB",
    )  # fmt: skip
    assert (code_flags, flags) == (code, out)
