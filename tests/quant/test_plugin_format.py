"""A contributor's exercise: a quantization format written outside usaf (here, experts stored in fp16), registered
with one call, is a choice of `usaf prepare --quant`, named by the store it writes, and a run trains on it through
its own `dequantize`."""

import json
import math

import pytest
import torch
from helpers import FAST_RUN, make_model_dir, write_copy_task

from usaf.base.load import read_store_metadata
from usaf.cli import main
from usaf.quant import FORMATS, register_format
from usaf.quant.descriptor import Descriptor


class Half:
    """The experts' weights in fp16, one part per matrix; counts its dequantizations."""

    DESCRIPTOR = Descriptor("half_test", "fp16 (a test's own format)", 16, 0)
    dequantized = 0

    @staticmethod
    def layout(rows, cols, source_dtype):
        return {"data": (torch.float16, (rows, cols))}

    @staticmethod
    def pieces(weight, max_elements):
        yield weight  # rows are independent, but one piece is small enough here

    @staticmethod
    def quantize(weight):
        return {"data": weight.to(torch.float16)}

    @classmethod
    def dequantize(cls, parts, rows, cols, dtype):
        cls.dequantized += 1
        return parts["data"].reshape(-1, rows, cols).to(dtype, copy=True)  # a copy: trained values go into it


@pytest.fixture
def half():
    register_format(Half)
    yield Half
    FORMATS.unregister(Half.DESCRIPTOR.name)


@pytest.mark.slow
def test_a_format_from_outside_prepares_a_store_that_trains(half, tmp_path):
    model, data = make_model_dir(tmp_path / "model"), write_copy_task(tmp_path / "train.jsonl", 24)
    store, run = tmp_path / "store", tmp_path / "run"
    assert main(["prepare", str(model), "--quant=half_test", f"--out={store}", "--device=cpu"]) == 0
    assert read_store_metadata(store)["quant"] == "half_test"
    half.dequantized = 0
    sets = [f"--set={s}" for s in [*FAST_RUN, "schedule.max_steps=3", "select.targets=[experts]"]]
    assert main(["train", f"--model={store}", f"--data={data}", f"--out={run}", *sets]) == 0
    assert half.dequantized > 0  # the experts' weights came through the format's own dequantize
    losses = [json.loads(line).get("loss") for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [loss for loss in losses if loss is not None]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)


def test_an_unregistered_format_is_not_a_choice(tmp_path, capsys):
    model = make_model_dir(tmp_path / "model")
    assert main(["prepare", str(model), "--quant=half_test", f"--out={tmp_path / 'store'}"]) == 2
    assert "invalid choice: 'half_test'" in capsys.readouterr().err
    assert not (tmp_path / "store").exists()
