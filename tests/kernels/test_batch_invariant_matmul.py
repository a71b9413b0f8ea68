"""The batch-invariant Triton GEMM (``kernels.batch_invariant_matmul``, ``DETERMINISTIC=true`` on CUDA): against
``F.linear`` within the dtype's rounding, and every output row bitwise the same whatever the number of rows and
the other rows' values (a row first, last or mid-way in batches of 1 to 130 rows, across M-tile boundaries).
The split launch's fold (the tile's last split program adds the partials) is checked bitwise against the one-program
sum. CPU runs use TRITON_INTERPRET=1 at small shapes; the ``gpu`` tests run bf16 at Qwen3-30B-A3B's and
Gemma-4-26B-A4B's projection shapes, where cuBLAS's rows are checked to differ (what the kernel is for), and the fold
against the one-program sum there, where the split programs finish in any order, and in a CUDA graph's replays."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton or the kernels are imported

import torch.nn.functional as F

from inference_server.kernels import batch_invariant_matmul as bim
from inference_server.kernels.arrival_counters import arrival_counters
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


def fold_case(k: int, n: int, m: int, dtype: torch.dtype, bias: bool, seed: int = 3) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(DEV, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEV, dtype)
    b = torch.randn(n, generator=gen).to(DEV, dtype) if bias else None
    return x, w, b


def takes_split_launch(m: int, n: int, k: int) -> bool:
    """Whether ``invariant_matmul`` gives each K split a program (and folds in the tile's last one) at this shape."""
    tiles = -(-m // CONFIG.block_m) * -(-n // CONFIG.block_n)
    return bim.split_k(n, k) > 1 and tiles < bim.ONE_LAUNCH_TILES


def fold_counters(device: str) -> torch.Tensor:
    return arrival_counters("batch_invariant_matmul", bim.FOLD_COUNTERS, torch.device(device))


def test_one_launch_and_split_launches_give_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small calls give each K split a program and the tile's last program to arrive folds the partials; large ones
    sum the splits in one program: the same arithmetic, so a row's bits do not depend on which path its call's size
    chose (fp32 output, where another order of the splits' sum shows, and so does a bias added twice or not at
    all). 2 x 2 tiles: four tiles' counters, folded each on its own. Without and with a bias in one test (a
    parametrized sweep would run only its first case by default)."""
    k, n, m = 200, 150, 70  # 4 K blocks, 2 N tiles: split_k gives 4 splits; 2 M tiles
    assert bim.split_k(n, k) == 4 and takes_split_launch(m, n, k)
    for bias in (False, True):
        x, w, b = fold_case(k, n, m, torch.float32, bias)
        split_launch = invariant_matmul(x, w, b)
        with monkeypatch.context() as patch:
            patch.setattr(bim, "ONE_LAUNCH_TILES", 1)
            assert not takes_split_launch(m, n, k)
            one_launch = invariant_matmul(x, w, b)
        assert torch.equal(split_launch, one_launch), bias
        reference = F.linear(x.float(), w.float(), None if b is None else b.float())
        torch.testing.assert_close(one_launch.float(), reference, rtol=1e-4, atol=1e-4)


def test_the_fold_leaves_its_counters_at_zero() -> None:
    """The tile's folding program puts its counter back to zero, so the next call (and a CUDA graph's next replay,
    which launches with the counters the capture saw) starts clean: calls back to back give the same bits."""
    k, n, m = 200, 150, 70
    assert takes_split_launch(m, n, k)
    x, w, b = fold_case(k, n, m, torch.float32, bias=True)
    first = invariant_matmul(x, w, b)
    counters = fold_counters(DEV)
    assert counters.shape == (bim.FOLD_COUNTERS,) and not counters.any()
    assert torch.equal(invariant_matmul(x, w, b), first)
    assert not counters.any()


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


@gpu
@pytest.mark.parametrize(("k", "n"), [(2816, 2112), (2048, 5120), (4096, 2048)])
def test_bf16_fold_gives_the_one_launch_bits_at_model_shapes(k: int, n: int) -> None:
    """On the GPU the split programs of a tile finish in any order: whichever folds, the output is the one-launch
    path's, bitwise, call after call (the partials' stores visible to the folding program), and the counters end at
    zero. Decode-sized calls (1 and 64 rows) and one of several M tiles, with a bias."""
    for m in (1, 64, 200):
        assert takes_split_launch(m, n, k), (m, n, k)
        x, w, b = fold_case(k, n, m, torch.bfloat16, bias=True)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(bim, "ONE_LAUNCH_TILES", 1)
            one_launch = invariant_matmul(x, w, b)
        for _ in range(20):
            assert torch.equal(invariant_matmul(x, w, b), one_launch), m
        torch.cuda.synchronize()
        assert not fold_counters(DEV).any()


@gpu
def test_bf16_fold_replays_in_a_cuda_graph_with_the_eager_bits() -> None:
    """The runners capture decode steps after an eager warm-up (the counters' first use, outside the capture): the
    graph's replays launch with the counters the fold left at zero, so each replay gives the eager bits."""
    k, n, m = 2816, 2112, 8
    assert takes_split_launch(m, n, k)
    x, w, b = fold_case(k, n, m, torch.bfloat16, bias=True)
    eager = invariant_matmul(x, w, b)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = invariant_matmul(x, w, b)
    for _ in range(10):
        captured.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
    assert not fold_counters(DEV).any()
