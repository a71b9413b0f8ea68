"""Pure-PyTorch oracle of ``kernels.dense_linear``: the float matmul accumulated in fp32, rounded once."""

from __future__ import annotations

import torch


def dense_linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [T, K] @ weight[N, K].T`` with fp32 products and sums (no TF32), rounded to ``x.dtype``: the value
    ``dense_linear`` must give up to summation order (and cuBLAS's ``F.linear`` likewise)."""
    return (x.float() @ weight.float().t()).to(x.dtype)
