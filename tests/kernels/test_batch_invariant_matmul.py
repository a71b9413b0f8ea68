"""The batch-invariant Triton GEMM (``kernels.batch_invariant_matmul``, ``DETERMINISTIC=true`` on CUDA): against
``F.linear`` within the dtype's rounding, and every output row bitwise the same whatever the number of rows and
the other rows' values (a row first, last or mid-way in batches of 1 to 130 rows, across M-tile boundaries).
CPU runs use TRITON_INTERPRET=1 at small shapes; the ``gpu`` tests run bf16 at Qwen3-30B-A3B's and Gemma-4-26B-A4B's
projection shapes, where cuBLAS's rows are checked to differ (what the kernel is for)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton or the kernels are imported

import torch.nn.functional as F

from inference_server.kernels import batch_invariant_matmul as bim
from inference_server.kernels.batch_invariant_matmul import CONFIG, invariant_matmul

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def row_of_every_batch(fn, x: torch.Tensor, target: torch.Tensor, sizes: tuple[int, ...]) -> list[torch.Tensor]:
    rows = []
    for m in sizes:
        for pos in sorted({0, m // 2, m - 1}):
            batch = x[:m].clone()
            batch[pos] = target
            rows.append(fn(batch)[pos])
    return rows


def equal_rows_by_tile_place(rows: list[torch.Tensor], sizes: tuple[int, ...]) -> bool:
    """On the GPU every row must equal every other. Under the interpreter ``tl.dot`` is numpy's matmul of the
    whole tile, whose CPU BLAS sums a tile's last rows in another order (an interpreter artifact), so there rows
    are compared with rows at the same place in their tile: still any M, any neighbours, any tile index."""
    places = [pos % CONFIG.block_m if INTERPRETED else 0 for m in sizes for pos in sorted({0, m // 2, m - 1})]
    first: dict[int, torch.Tensor] = {}
    return all(torch.equal(first.setdefault(place, row), row) for place, row in zip(places, rows, strict=True))


def check(k: int, n: int, dtype: torch.dtype, sizes: tuple[int, ...], bias: bool, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(max(sizes), k, generator=gen).to(DEV, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEV, dtype)
    b = torch.randn(n, generator=gen).to(DEV, dtype) if bias else None
    target = torch.randn(k, generator=gen).to(DEV, dtype)
    rows = row_of_every_batch(lambda t: invariant_matmul(t, w, b), x, target, sizes)
    assert equal_rows_by_tile_place(rows, sizes)
    expected = F.linear(target[None].float(), w.float(), None if b is None else b.float())[0]
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(rows[0].float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_rows_match_linear_and_do_not_depend_on_the_batch(dtype: torch.dtype, bias: bool) -> None:
    check(k=96, n=160, dtype=dtype, sizes=(1, 2, 5, 64, 65, 130), bias=bias)


@pytest.mark.parametrize("bias", [False, True])
def test_one_launch_and_split_launches_give_the_same_bits(monkeypatch: pytest.MonkeyPatch, bias: bool) -> None:
    """Small calls give each K split a program and sum the partials in a second launch; large ones sum the splits
    in one program: the same arithmetic, so a row's bits do not depend on which path its call's size chose (fp32
    output, where a different order of the splits' sum shows)."""
    gen = torch.Generator().manual_seed(3)
    k, n = 200, 150  # 4 K blocks, 2 N tiles: split_k gives 4 splits
    assert bim.split_k(n, k) == 4
    x = torch.randn(70, k, generator=gen).to(DEV, torch.float32)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEV, torch.float32)
    b = torch.randn(n, generator=gen).to(DEV, torch.float32) if bias else None
    monkeypatch.setattr(bim, "ONE_LAUNCH_TILES", 10**9)
    split_launches = invariant_matmul(x, w, b)
    monkeypatch.setattr(bim, "ONE_LAUNCH_TILES", 1)
    one_launch = invariant_matmul(x, w, b)
    assert torch.equal(split_launches, one_launch)
    torch.testing.assert_close(one_launch.float(), F.linear(x.float(), w.float(), None if b is None else b.float()),
                               rtol=1e-4, atol=1e-4)


def test_leading_dims_and_strided_inputs() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, 72, generator=gen).to(DEV)
    w = torch.randn(40, 144, generator=gen).to(DEV)[:, ::2]  # a strided weight view
    torch.testing.assert_close(invariant_matmul(x, w), F.linear(x, w), rtol=1e-4, atol=1e-4)
    assert invariant_matmul(x[:0], w).shape == (0, 4, 40)


@gpu
@pytest.mark.parametrize(("k", "n"), [(2048, 5120), (4096, 2048), (2816, 2112), (2048, 151936)])
def test_bf16_rows_are_invariant_at_model_shapes_where_cublas_rows_are_not(k: int, n: int) -> None:
    sizes = (1, 2, 3, 8, 16, 17, 64, 100, 256, 1000)
    check(k=k, n=n, dtype=torch.bfloat16, sizes=sizes, bias=False)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(max(sizes), k, generator=gen).to(DEV, torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEV, torch.bfloat16)
    target = torch.randn(k, generator=gen).to(DEV, torch.bfloat16)
    cublas = row_of_every_batch(lambda t: F.linear(t, w), x, target, sizes)
    print(f"cuBLAS rows equal to M=1's: {sum(torch.equal(cublas[0], r) for r in cublas)}/{len(cublas)}")
