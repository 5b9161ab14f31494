"""Formats stay readable: a prepared store and a stopped run made by usaf 0.1.x (tests/fixtures/compat-0.1, written
by tests/fixtures/make_compat_fixture.py before the package moved into stage packages) resume and export with
today's code exactly as they did then."""

import json
import shutil

import pytest
import torch
from fixtures.make_compat_fixture import OUT, resume_and_export
from safetensors.torch import load_file


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    work = tmp_path_factory.mktemp("compat") / "fixture"
    shutil.copytree(OUT, work, ignore=shutil.ignore_patterns("expected"))
    resume_and_export(work, work / "export")
    return work


@pytest.mark.slow
@pytest.mark.parametrize(
    "made, expected",
    [("delta.safetensors", "delta.safetensors"), ("merged/model.safetensors", "merged.safetensors")],
)
def test_an_old_run_resumes_and_exports_the_same_tensors(exported, made, expected):
    """Names, dtypes, shapes, flat indices and every untrained weight are bit-identical. Trained values agree to
    about 1e-6 relative, not to the bit: the optimizer's vectorized arithmetic rounds differently on another CPU
    (AVX2 against AVX-512), and the output layer's gradient is now scaled after its product rather than before
    (usaf.engine.loss). A lost optimizer state or a misplaced entry moves values by about the learning rate, 1e-3."""
    now, then = load_file(exported / "export" / made), load_file(OUT / "expected" / expected)
    base = load_file(OUT / "model" / "model.safetensors") if made.startswith("merged") else {}
    assert sorted(now) == sorted(then)
    for name, tensor in then.items():
        assert (now[name].dtype, now[name].shape) == (tensor.dtype, tensor.shape), name
        if name.endswith(":flat_indices"):
            assert torch.equal(now[name], tensor), name
            continue
        torch.testing.assert_close(now[name], tensor, rtol=1e-5, atol=1e-7, msg=name)
        if name in base:  # a merged tensor: where it equals the base then, it equals it now
            untrained = tensor == base[name]
            assert torch.equal(now[name][untrained], base[name][untrained]), name


def test_an_old_run_resumes_to_the_same_summary(exported):
    now = json.loads((exported / "run" / "summary.json").read_text())
    then = json.loads((OUT / "expected" / "summary.json").read_text())
    now.pop("train_seconds"), then.pop("train_seconds")
    assert sorted(now) == sorted(then)
    for key, value in then.items():  # the losses to rounding (see above); every count and text exactly
        assert now[key] == (pytest.approx(value, rel=1e-6) if isinstance(value, float) else value), key
