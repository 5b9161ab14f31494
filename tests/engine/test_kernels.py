"""usaf.kernels' two implementations against a naive per-expert loop: PyTorch's, and Triton's kernels run on the CPU
by Triton's interpreter."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported: kernels are built interpreted

import importlib.util
import sys

import pytest
import torch

import usaf.kernels as kernels
from usaf.errors import UsafError
from usaf.kernels import Segments, torch_path, triton_path

# imported by an earlier test before TRITON_INTERPRET was set: build its kernels again, interpreted
if not triton_path.INTERPRETED and os.environ["TRITON_INTERPRET"] == "1":
    importlib.reload(triton_path)

needs_triton = pytest.mark.skipif(
    not triton_path.available("cpu"),
    reason="Triton is not installed or its interpreter is off (TRITON_INTERPRET=0)",
)


@pytest.fixture(params=[torch_path, pytest.param(triton_path, marks=needs_triton)], ids=["torch", "triton"])
def impl(request):
    return request.param


def reference_sampled(U, V, row_counts, local, entry_counts, width):
    U, V = U.double(), V.double()
    out = torch.zeros(len(local), dtype=torch.float64)
    r = k = 0
    for rows, count in zip(row_counts, entry_counts, strict=True):
        index = local[k : k + count]
        out[k : k + count] = (U[r : r + rows, index // width] * V[r : r + rows, index % width]).sum(0)
        r, k = r + rows, k + count
    return out.float()


def reference_lines(fixed, spanning, row_counts, lines, entry_counts):
    fixed, spanning = fixed.double(), spanning.double()
    out = torch.zeros(len(lines), spanning.shape[1], dtype=torch.float64)
    r = k = 0
    for rows, count in zip(row_counts, entry_counts, strict=True):
        for j in range(k, k + count):
            out[j] = (fixed[r : r + rows, lines[j], None] * spanning[r : r + rows]).sum(0)
        r, k = r + rows, k + count
    return out.float()


def entries_of(entry_counts, size, generator):
    """Each expert's distinct indices below `size`, ascending, grouped by expert."""
    assert max(entry_counts, default=0) <= size, "more entries than an expert's matrix has"
    parts = [torch.randperm(size, generator=generator)[:count].sort().values for count in entry_counts]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def check(actual, expected, dtype):
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    # inputs are compared on their own (rounded) values, so only the fp32 accumulation differs
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * scale)


# (row counts, entry counts); ENTRY_BLOCK is 64, so 77 entries leave a partial block, and 8 experts of 3 entries
# put one block across 8 experts
CASES = {
    "empty experts": ([0, 5, 0, 7], [4, 3, 9, 2]),
    "experts with no entries": ([3, 6, 9, 2], [3, 0, 70, 0]),
    "one token": ([0, 1, 0], [2, 5, 1]),
    "partial block": ([40], [77]),
    "straddling blocks": ([5, 0, 8, 3, 1, 9, 2, 4], [3] * 8),
    "no rows": ([0, 0, 0], [4, 0, 3]),
    "no entries": ([3, 4], [0, 0]),
    "one expert": ([33], [20]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sampled_dots_matches_a_loop(impl, case, dtype):
    row_counts, entry_counts = CASES[case]
    generator = torch.Generator().manual_seed(0)
    A, B = 8, 11  # room for every case's entries in one expert (88 >= 77)
    R = sum(row_counts)
    U = torch.randn(R, A, generator=generator).to(dtype)
    V = torch.randn(R, B, generator=generator).to(dtype)
    local = entries_of(entry_counts, A * B, generator)
    out = impl.sampled_dots(
        U, V, Segments.from_counts(row_counts, "cpu"), local, Segments.from_counts(entry_counts, "cpu"), B
    )
    check(out, reference_sampled(U, V, row_counts, local, entry_counts, B), dtype)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_line_dots_matches_a_loop(impl, case, dtype):
    row_counts, entry_counts = CASES[case]
    generator = torch.Generator().manual_seed(1)
    A, W = 7, 70  # W over one column block (64)
    R = sum(row_counts)
    fixed = torch.randn(R, A, generator=generator).to(dtype)
    spanning = torch.randn(R, W, generator=generator).to(dtype)
    lines = torch.randint(0, A, (sum(entry_counts),), generator=generator)
    out = impl.line_dots(
        fixed,
        spanning,
        Segments.from_counts(row_counts, "cpu"),
        lines,
        Segments.from_counts(entry_counts, "cpu"),
    )
    check(out, reference_lines(fixed, spanning, row_counts, lines, entry_counts), dtype)


@pytest.mark.parametrize("seed", range(3))
def test_random_sizes(impl, seed):
    generator = torch.Generator().manual_seed(seed)
    E = int(torch.randint(1, 9, (1,), generator=generator))
    A, B = (int(n) for n in torch.randint(1, 49, (2,), generator=generator))
    row_counts = torch.randint(0, 64 // E + 1, (E,), generator=generator).tolist()
    entry_counts = [int(torch.randint(0, min(A * B, 40) + 1, (1,), generator=generator)) for _ in range(E)]
    R = sum(row_counts)
    U, V = torch.randn(R, A, generator=generator), torch.randn(R, B, generator=generator)
    rows, entries = Segments.from_counts(row_counts, "cpu"), Segments.from_counts(entry_counts, "cpu")
    local = entries_of(entry_counts, A * B, generator)
    check(
        impl.sampled_dots(U, V, rows, local, entries, B),
        reference_sampled(U, V, row_counts, local, entry_counts, B),
        torch.float32,
    )
    lines = torch.randint(0, A, (sum(entry_counts),), generator=generator)
    check(
        impl.line_dots(U, V, rows, lines, entries),
        reference_lines(U, V, row_counts, lines, entry_counts),
        torch.float32,
    )


def test_non_contiguous_inputs(impl):
    generator = torch.Generator().manual_seed(3)
    row_counts, entry_counts = [4, 0, 9], [5, 2, 6]
    A, B = 5, 8
    U = torch.randn(A, 13, generator=generator).t()  # column-major [13, A]
    V = torch.randn(13, 2 * B, generator=generator)[:, ::2]  # every other column
    grouped = entries_of(entry_counts, A * B, generator)
    local = torch.stack([grouped, torch.zeros_like(grouped)], 1)[:, 0]  # a strided view
    rows, entries = Segments.from_counts(row_counts, "cpu"), Segments.from_counts(entry_counts, "cpu")
    check(
        impl.sampled_dots(U, V, rows, local, entries, B),
        reference_sampled(U, V, row_counts, local, entry_counts, B),
        torch.float32,
    )
    check(
        impl.line_dots(U, V, rows, local % A, entries),
        reference_lines(U, V, row_counts, local % A, entry_counts),
        torch.float32,
    )


def test_empty_calls_return_empty_fp32(impl):
    rows, entries = Segments.from_counts([2, 1], "cpu"), Segments.from_counts([0, 0], "cpu")
    U, V = torch.randn(3, 4, dtype=torch.bfloat16), torch.randn(3, 5, dtype=torch.bfloat16)
    none = torch.zeros(0, dtype=torch.int64)
    assert impl.sampled_dots(U, V, rows, none, entries, 5).shape == (0,)
    lines = impl.line_dots(U, V, rows, none, entries)
    assert lines.shape == (0, 5) and lines.dtype == torch.float32


@needs_triton
def test_chosen_through_the_interface():
    generator = torch.Generator().manual_seed(4)
    row_counts, entry_counts = [3, 5], [4, 6]
    U, V = torch.randn(8, 4, generator=generator), torch.randn(8, 6, generator=generator)
    local = entries_of(entry_counts, 24, generator)
    try:
        kernels.use("triton")
        out = kernels.sampled_dots(
            U, V, Segments.from_counts(row_counts, "cpu"), local, Segments.from_counts(entry_counts, "cpu"), 6
        )
    finally:
        kernels.use("auto")
    check(out, reference_sampled(U, V, row_counts, local, entry_counts, 6), torch.float32)


def test_use_triton_without_triton_is_one_line(monkeypatch):
    # a fresh copy of the module, imported where `import triton` fails
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    spec = importlib.util.spec_from_file_location("triton_path_without_triton", triton_path.__file__)
    bare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bare)
    assert not bare.available("cuda")
    monkeypatch.setitem(sys.modules, "usaf.kernels.triton_path", bare)
    monkeypatch.setattr(kernels, "triton_path", bare)
    with pytest.raises(UsafError) as raised:
        kernels.use("triton")
    message = str(raised.value)
    assert "train.kernels=triton" in message and "\n" not in message
    assert kernels.chosen() == "auto"


def test_torch_path_groups_experts_when_padding_would_be_large(monkeypatch):
    """One expert with most rows: padding every expert to it would cost experts x its rows; the experts are taken
    in groups instead, with the same result."""
    generator = torch.Generator().manual_seed(5)
    row_counts, entry_counts = [1, 2, 40, 1, 0, 3, 1], [3, 4, 5, 2, 6, 1, 7]
    A, B = 5, 6
    R = sum(row_counts)
    U, V = torch.randn(R, A, generator=generator), torch.randn(R, B, generator=generator)
    local = entries_of(entry_counts, A * B, generator)
    lines = torch.randint(0, A, (sum(entry_counts),), generator=generator)
    monkeypatch.setattr(torch_path, "MIN_PADDED_ROWS", 0)
    monkeypatch.setattr(torch_path, "PADDING_FACTOR", 2)
    assert len(list(torch_path._groups(row_counts))) > 1
    rows, entries = Segments.from_counts(row_counts, "cpu"), Segments.from_counts(entry_counts, "cpu")
    check(
        torch_path.sampled_dots(U, V, rows, local, entries, B),
        reference_sampled(U, V, row_counts, local, entry_counts, B),
        torch.float32,
    )
    check(
        torch_path.line_dots(U, V, rows, lines, entries),
        reference_lines(U, V, row_counts, lines, entry_counts),
        torch.float32,
    )


@pytest.mark.parametrize("shape", [(16, 8), (5, 3)])  # aligned for grouped_mm, and not (the padded product)
@pytest.mark.parametrize("grouped", [False, True])
def test_grouped_matmul_matches_a_loop(shape, grouped, monkeypatch):
    generator = torch.Generator().manual_seed(6)
    K, N = shape
    counts = [3, 0, 5, 1, 20, 2]
    if grouped:  # the padded product in several groups of experts
        monkeypatch.setattr(torch_path, "MIN_PADDED_ROWS", 0)
        monkeypatch.setattr(torch_path, "PADDING_FACTOR", 2)
    x = torch.randn(sum(counts), K, generator=generator)
    weight = torch.randn(len(counts), K, N, generator=generator)
    out = kernels.grouped_matmul(x, weight, Segments.from_counts(counts, "cpu"))
    expected = torch.cat([x[sum(counts[:e]) : sum(counts[: e + 1])] @ weight[e] for e in range(len(counts))])
    torch.testing.assert_close(out, expected)
