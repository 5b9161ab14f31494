"""The planner for an expert-parallel job (issue 37): world = EP x DP ranks, one rank's ledger, the bytes it
exchanges per step, the paper plans of docs/distributed.md, and the sizes it refuses."""

import re

import pytest

from usaf import planner
from usaf.cli import main
from usaf.errors import UsafError

GiB = 1 << 30
TARGETS = ("experts", "routers", "attention")

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


def lines_of(p: planner.Plan) -> dict:
    return {line.name: line.device + line.host for line in p.lines}


def test_ep_4_x_dp_2_holds_a_quarter_of_the_experts_and_sums_their_gradients_over_the_replicas():
    """8 GPUs as 4 expert-parallel ranks x 2 replicas: a quarter of every expert line, the non-expert gradients summed
    over all 8 ranks and the rank's expert gradients over its 2 replicas (independent arithmetic)."""
    shape, device = shape_of("qwen3-30b-a3b"), planner.DEVICES["h100"]
    settings = long_nf4(targets=TARGETS)
    one = lines_of(planner.plan(shape, settings, device, ram=256 * GiB))
    mesh = planner.plan(shape, settings.replace(gpus=8, expert_parallel=4), device, ram=256 * GiB)
    assert (mesh.settings.expert_parallel, mesh.settings.data_parallel) == (4, 2)
    per_rank = lines_of(mesh)
    for name in ("frozen experts", "quantization constants", "sparse state + optimizer"):
        assert per_rank[name] == pytest.approx(one[name] / 4, rel=1e-9), name
    for name in ("dense weights", "sparse state beyond the experts", "routers (trainable)"):
        assert per_rank[name] == one[name], name

    expert_entries = round(settings.density * shape.expert_weights) / 4
    others = planner.trained_entries(shape, settings) - round(settings.density * shape.expert_weights)
    everywhere = others + planner.trained_router_params(shape, settings)
    assert per_rank["all-reduce buckets"] == pytest.approx(4 * (everywhere + expert_entries))
    traffic = mesh.traffic
    assert traffic.expert_all_reduce == pytest.approx(4 * expert_entries)
    # a ring of 8 sends 2 x 7/8 of its buffer, a ring of 2 sends it once
    assert traffic.all_reduce_sent == pytest.approx(2 * 7 / 8 * 4 * everywhere + 4 * expert_entries)
    pairs = 2048 * shape.experts_per_token
    assert traffic.all_to_all_sent == pytest.approx(
        2 * 3 * shape.num_moe_layers * pairs * shape.hidden_size * 2 * 3 / 4
    )


def test_ep_over_every_gpu_keeps_expert_gradients_off_the_all_reduce():
    """Bare --expert-parallel is EP = --gpus: no replicas, so the expert entries' gradients never leave their owner."""
    shape, device = shape_of("qwen3-30b-a3b"), planner.DEVICES["h100"]
    settings = long_nf4(targets=TARGETS)
    bare = planner.plan(shape, settings.replace(gpus=8, expert_parallel=True), device, ram=256 * GiB)
    sized = planner.plan(shape, settings.replace(gpus=8, expert_parallel=8), device, ram=256 * GiB)
    assert bare.settings.expert_parallel == 8 and lines_of(bare) == lines_of(sized)
    everywhere = planner.trained_entries(shape, settings) - round(settings.density * shape.expert_weights)
    everywhere += planner.trained_router_params(shape, settings)
    assert bare.traffic.expert_all_reduce == 0
    assert bare.traffic.all_reduce_buffer == pytest.approx(4 * everywhere)


def test_a_rank_streams_only_its_own_experts():
    shape, device = shape_of("qwen3-235b-a22b"), planner.DEVICES["rtx-4090"]
    settings = long_nf4(residency="host", density=0.0025)
    four = planner.plan(shape, settings.replace(gpus=4, expert_parallel=4), device, ram=1 << 40)
    eight = planner.plan(shape, settings.replace(gpus=8, expert_parallel=8), device, ram=1 << 40)
    assert eight.step.streaming_s == pytest.approx(four.step.streaming_s / 2)
    assert lines_of(eight)["offload buffers"] == pytest.approx(lines_of(four)["offload buffers"] / 2)


def run_plan(capsys, args: str) -> tuple[int, str, str]:
    code = main(["plan", *LONG_NF4_FLAGS, *args.split()])  # the test's own flags last: they win
    out = capsys.readouterr()
    return code, out.out, out.err


# the paper plans of docs/distributed.md ("The paper plans"): each with the verdict it must keep
PAPER_PLANS = [
    (
        "qwen3-235b-a22b --gpus 4 --expert-parallel --device rtx-4090 --ram 256GB --density 0.0025",
        "host offload",
    ),
    (
        "qwen3-235b-a22b --gpus 8 --expert-parallel --device rtx-4090 --ram 256GB --density 0.005",
        "host offload",
    ),
    # on the device at 46.98 of 48 GB: less room than the plan's error, so residency=auto takes host memory
    (
        "gpt-oss-120b --gpus 2 --expert-parallel --device rtx-6000-ada --ram 128GB --quant auto",
        "host offload",
    ),
    (
        "gpt-oss-120b --gpus 2 --expert-parallel --device rtx-6000-ada --ram 128GB --quant auto --residency device",
        "fits on device",
    ),
    ("gpt-oss-120b --gpus 4 --expert-parallel --device rtx-4090 --ram 128GB --quant auto", "host offload"),
    ("deepseek-v3 --gpus 8 --expert-parallel --device h100 --ram 1TB --quant auto", "host offload"),
]


@pytest.mark.parametrize("args, verdict", PAPER_PLANS)
def test_the_paper_plans_keep_their_verdicts(capsys, args, verdict):
    code, out, _ = run_plan(capsys, "--model " + args)
    assert code == 0
    assert {"fits on device": "verdict: fits on device", "host offload": "verdict: needs host offload"}[
        verdict
    ] in out
    assert "all-to-all per step:" in out and "FSDP2" not in out.split("verdict:")[1]


def test_qwen3_235b_on_four_24gb_cards_at_the_default_density_suggests_the_paper_plan(capsys):
    code, out, _ = run_plan(
        capsys,
        "--model qwen3-235b-a22b --gpus 4 --expert-parallel --device rtx-4090 --ram 256GB --density 0.01",
    )
    assert code == 1 and "verdict: does not fit" in out
    # model.residency=auto starts the search where the storage fits at a lower density: in host memory
    assert re.search(r"^model\.residency=auto: host, nothing fits", out, re.MULTILINE)
    assert (
        re.search(r"--density 0\.00\d+ --quant nf4 --residency host", out)
        and "--gpus 4 --expert-parallel" in out
    )


def test_replicated_dense_weights_over_a_card_are_sharded_by_fsdp2(capsys):
    """DeepSeek-V3's 32 GB of dense weights cannot be replicated on 24 GB cards: distributed.shard_dense=auto shards
    them, and the verdict no longer asks for what usaf lacks."""
    code, out, _ = run_plan(
        capsys, "--model deepseek-v3 --gpus 8 --expert-parallel --device rtx-4090 --ram 1TB"
    )
    assert code == 1
    assert "dense weights (FSDP2)" in out and "sharded over 8 GPUs by FSDP2" in out
    assert "whole on every rank, and the runtime's context alone take" not in out
    assert "does not have yet" not in out


def test_the_fsdp2_dense_line_is_an_eighth_plus_the_largest_unit_gathered():
    """Independent arithmetic: 1/8 of the dense weights, plus the largest unit gathered while it runs (here the
    embedding table or the output layer, larger than a decoder layer), plus the routers whole; auto turns it on exactly when the whole
    dense weights and the context exceed the card."""
    shape, device = shape_of("deepseek-v3"), planner.DEVICES["rtx-4090"]
    settings = long_nf4(targets=TARGETS, gpus=8, expert_parallel=True)
    auto = planner.plan(shape, settings, device, ram=1024 * GiB)
    on = planner.plan(shape, settings.replace(shard_dense=True), device, ram=1024 * GiB)
    off = planner.plan(shape, settings.replace(shard_dense=False), device, ram=1024 * GiB)
    head = shape.target_params["lm_head"]
    layer = (shape.dense_params - shape.embedding_params - head) / shape.num_layers
    assert (
        layer < head == shape.embedding_params
    )  # the embedding table (and the output layer) is the largest unit
    held = shape.dense_params / 8 + shape.embedding_params + shape.router_params
    assert lines_of(on)["dense weights (FSDP2)"] == pytest.approx(2 * held, rel=1e-9)  # bf16
    assert lines_of(auto) == lines_of(on)
    assert "dense weights (FSDP2)" not in lines_of(off)
    assert off.replicated_dense > off.device_budget and on.device_peak < off.device_peak
    # one 80 GB card holds them whole: auto leaves them so
    h100 = planner.plan(shape, settings, planner.DEVICES["h100"], ram=1024 * GiB)
    assert "dense weights" in lines_of(h100)


@pytest.mark.parametrize(
    "args, error",
    [
        ("--gpus 8 --expert-parallel 3", "--expert-parallel 3 must divide --gpus 8"),
        (
            "--gpus 12 --expert-parallel 12",
            "--expert-parallel over 12 GPUs needs a number of experts divisible",
        ),
        ("--gpus 8 --expert-parallel 0", "--expert-parallel must be >= 1, got 0"),
        ("--expert-parallel", "give --gpus 2 or more"),
        ("--gpus 2 --expert-parallel 4", "--expert-parallel 4 must divide --gpus 2"),
    ],
)
def test_bad_expert_parallel_sizes_are_one_line_errors(capsys, args, error):
    code, _, err = run_plan(capsys, "--model qwen3-30b-a3b --device h100 " + args)
    assert code == 2 and error in err and len(err.strip().splitlines()) == 1


def test_plan_config_takes_the_runs_expert_parallel_size(capsys, tmp_path):
    """distributed.expert_parallel of a run: planned on that many GPUs, or as EP x DP with --gpus; the suggested
    command line and run configuration keep it."""
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  path: qwen3-235b-a22b\ndistributed:\n  expert_parallel: 4\n")
    code, out, _ = run_plan(capsys, f"--config {config} --device h100 --ram 512GB")
    assert "4 GPUs, expert parallel: each holds 1/4 of every layer's experts" in out
    code, out, _ = run_plan(capsys, f"--config {config} --device h100 --ram 512GB --gpus 8")
    assert "8 GPUs, expert parallel 4 x data parallel 2: each holds 1/4 of every layer's experts" in out
    code, out, _ = run_plan(capsys, f"--config {config} --device rtx-4090 --ram 512GB --gpus 8")
    assert "--gpus 8 --expert-parallel 4" in out and "distributed:\n    expert_parallel: 4" in out
    code, _, err = run_plan(capsys, f"--config {config} --device h100 --gpus 6")
    assert code == 2 and "--expert-parallel 4 must divide --gpus 6" in err


def test_a_suggested_command_line_plans_the_same_mesh_again(capsys):
    code, out, _ = run_plan(
        capsys, "--model qwen3-235b-a22b --device rtx-4090 --ram 512GB --gpus 8 --expert-parallel 4"
    )
    suggested = next(x.strip() for x in out.splitlines() if x.strip().startswith("usaf plan "))
    assert suggested.endswith("--gpus 8 --expert-parallel 4")
    code, again, _ = run_plan(capsys, suggested.removeprefix("usaf plan "))
    assert code == 0 and "expert parallel 4 x data parallel 2" in again


def test_plan_settings_refuse_an_ep_that_does_not_divide_the_gpus():
    with pytest.raises(UsafError, match="--expert-parallel 3 must divide --gpus 4"):
        long_nf4(gpus=4, expert_parallel=3)
