"""The pure-PyTorch implementations of `usaf.kernels` (CPU, MPS, ROCm or CUDA without Triton)."""

from __future__ import annotations

import torch


def sampled_dots(U, V, rows, local, entries, width):
    raise NotImplementedError  # filled in next


def line_dots(fixed, spanning, rows, lines, entries):
    raise NotImplementedError
