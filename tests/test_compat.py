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


@pytest.mark.parametrize(
    "made, expected",
    [("delta.safetensors", "delta.safetensors"), ("merged/model.safetensors", "merged.safetensors")],
)
def test_an_old_run_resumes_and_exports_the_same_tensors(exported, made, expected):
    now, then = load_file(exported / "export" / made), load_file(OUT / "expected" / expected)
    assert sorted(now) == sorted(then)
    for name, tensor in then.items():
        assert torch.equal(now[name], tensor), name


def test_an_old_run_resumes_to_the_same_summary(exported):
    now = json.loads((exported / "run" / "summary.json").read_text())
    then = json.loads((OUT / "expected" / "summary.json").read_text())
    now.pop("train_seconds"), then.pop("train_seconds")
    assert now == then
