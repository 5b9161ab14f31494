"""AMD GPUs through torch's ROCm build: fp16 where bf16 has no matrix units, and no CUDA-only API on any path."""

import ast
import types
from pathlib import Path

import pytest
import torch

from usaf import planner
from usaf.train import runtime

ROOT = Path(__file__).resolve().parents[2]
# torch.cuda functions that ROCm builds provide over HIP (the torch.cuda API is the HIP API there)
HIP_PROVIDES = {
    "is_available",
    "is_bf16_supported",
    "get_device_properties",
    "get_device_name",
    "synchronize",
    "max_memory_allocated",
    "memory_allocated",
    "reset_peak_memory_stats",
    "set_per_process_memory_fraction",
    "empty_cache",
    "set_device",
    "get_rng_state_all",
    "set_rng_state_all",
    "device_count",
    "current_device",
    "Stream",
    "Event",
    "stream",
    "current_stream",
    "OutOfMemoryError",
    "mem_get_info",
}


def _fake_gpu(monkeypatch, hip: str | None, arch: str = "", bf16: bool = True):
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda *a, **k: types.SimpleNamespace(gcnArchName=arch)
    )


@pytest.mark.parametrize(
    "hip,arch,expected",
    [
        ("6.2", "gfx1031:sramecc-:xnack-", torch.float16),  # RX 6750 XT (RDNA2): no bf16 matrix units
        ("6.2", "gfx1100", torch.bfloat16),  # RX 7900 XTX (RDNA3)
        ("6.2", "gfx942:sramecc+:xnack-", torch.bfloat16),  # MI300X (CDNA3)
        (None, "", torch.bfloat16),  # an NVIDIA GPU with bf16
    ],
)
def test_auto_dtype_is_fp16_only_where_bf16_has_no_fast_path(monkeypatch, hip, arch, expected):
    _fake_gpu(monkeypatch, hip, arch)
    dtype = runtime.resolve_dtype("auto", torch.device("cuda"))
    assert dtype == expected
    # precision=auto then autocasts to that dtype, and fp16 trains with dynamic loss scaling
    assert runtime.autocast_dtype("auto", dtype) == expected
    assert runtime.resolve_dtype("auto", torch.device("cpu")) == torch.float32


def test_the_planner_knows_amd_cards_and_plans_fp16_on_rdna2():
    for name in ("rx-6750-xt", "rx-7900-xtx", "mi300x"):
        assert name in planner.DEVICES
    assert planner.default_dtype(planner.DEVICES["rx-6750-xt"]) == "fp16"
    assert planner.default_dtype(planner.DEVICES["rx-7900-xtx"]) == "bf16"
    assert planner.DEVICES["rx-6750-xt"].memory == 12 * planner.GiB


def _torch_cuda_calls(path: Path):
    """(line, attribute) of every `torch.cuda.<attribute>` in a Python file."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "cuda"
            and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "torch"
        ):
            yield node.lineno, node.attr


def test_no_code_path_needs_a_cuda_only_feature():
    """Every torch.cuda call of the package and the benchmarks exists on ROCm; no cudnn, nvtx, jiterator or NVML."""
    files = [*ROOT.glob("src/usaf/**/*.py"), *ROOT.glob("bench/*.py")]
    assert len(files) > 20
    unknown = [
        f"{path.relative_to(ROOT)}:{line} torch.cuda.{attr}"
        for path in files
        for line, attr in _torch_cuda_calls(path)
        if attr not in HIP_PROVIDES
    ]
    assert not unknown, unknown
    cuda_only = ("torch.backends.cudnn", "torch.cuda.nvtx", "jiterator", "pynvml", "nvidia-smi", "cupy")
    found = [
        f"{path.relative_to(ROOT)}: {word}"
        for path in [*files, ROOT / "bench" / "gpu.sh"]
        for word in cuda_only
        if word in path.read_text()
    ]
    assert not found, found
