"""The whole suite's settings and fixtures. Test files live in one folder per area (tests/README.md); the shared
modules (helpers.py, faults.py, fixtures/) stay here, importable from every folder."""

import atexit
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))  # `from helpers import ...`, `from faults import ...` in every folder

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Triton's kernels run in its interpreter on the CPU (how `make test` checks them against the PyTorch path); Triton
# reads this once, at import, which importing usaf does
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# datasets' cache (usaf's tokenized data lands there): the session's own, never the user's; datasets reads these
# variables once, at import
os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="usaf-tests-datasets-")
os.environ["HF_DATASETS_OFFLINE"] = "1"
atexit.register(shutil.rmtree, os.environ["HF_DATASETS_CACHE"], ignore_errors=True)
# usaf's own cache of prepared (quantized) stores: the session's too, so that a run starts cold as in CI
os.environ["USAF_CACHE"] = tempfile.mkdtemp(prefix="usaf-tests-cache-")
atexit.register(shutil.rmtree, os.environ["USAF_CACHE"], ignore_errors=True)
warnings.filterwarnings("ignore", message=".*Sparse.*")
# one torch thread a process when pytest-xdist runs the suite on every core (`make test`): its workers share them
THREADS = 1 if "PYTEST_XDIST_WORKER" in os.environ else max(1, min(2, os.cpu_count() or 1))
torch.set_num_threads(THREADS)
# the subprocesses tests start (a run killed and resumed) use as many threads as this process: a different count
# changes the order of float sums, and exact-resume tests compare the two bit for bit
os.environ["OMP_NUM_THREADS"] = str(THREADS)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(params=["torch", "triton"])
def each_kernel_path(request):
    """Run a test once on each implementation of usaf.kernels (Triton interpreted on the CPU)."""
    from usaf import kernels

    if request.param == "triton":
        pytest.importorskip("triton")
    before = kernels.chosen()
    kernels.use(request.param)
    yield request.param
    kernels.use(before)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A tiny model folder and a copy task of 60 records, made once per module (helpers.copy_task_workspace); a
    module that needs another size defines its own."""
    from helpers import copy_task_workspace

    return copy_task_workspace(tmp_path_factory.mktemp("workspace"))


@pytest.fixture(scope="session")
def ws(tmp_path_factory):
    """The fault tables' workspace (tests/faults.py): models, data, a finished run, an unfinished one and a delta,
    made once per session; rows that change them work on copies."""
    from faults import build_workspace

    return build_workspace(tmp_path_factory.mktemp("faults"))


# The modules that take longest on one worker (minutes: a module fixture that trains several runs, or several
# torchrun jobs), measured with --durations: `make test` hands modules to its workers in collection order
# (--dist loadscope), so these go first and the workers finish together instead of one waiting on the last.
LONG_POLES = (
    "package/test_bench_scripts.py",
    "distributed/test_expert_parallel_train.py",
    "package/test_compat.py",
    "distributed/test_rank_faults.py",
    "distributed/test_trainer_ddp.py",
    "distributed/test_data_parallel.py",
)


def pytest_collection_modifyitems(config, items):
    """Every test under tests/distributed/ starts several processes (or shares a fixture that does): marked
    `distributed`, and `slow`, by its folder. The long poles first (a stable sort: each module's order kept)."""
    for item in items:
        if Path(item.path).resolve().parent == TESTS / "distributed":
            item.add_marker(pytest.mark.distributed)
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(LONG_POLES)}
    items.sort(key=lambda item: rank.get(Path(item.path).resolve().relative_to(TESTS).as_posix(), len(rank)))
