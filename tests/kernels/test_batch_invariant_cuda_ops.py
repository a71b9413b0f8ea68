"""The custom-cuda runner's batch-invariant attention and norm (``DETERMINISTIC``): the paged prefill kernel with
position-aligned key tiles (``align_kv``) gives a query the same output whether its sequence is computed in one
piece, in chunks, or one decode token at a time (a sliding window too); the one-row RMSNorm gives a row the same
output whatever the row count. Against the PyTorch references within rounding.

Under TRITON_INTERPRET=1 ``tl.dot`` is numpy's matmul over a whole tile, whose CPU BLAS may sum some rows of a tile
in another order; the interpreter cases use 16-row tiles and compare rows bitwise where a row keeps its place in the
tile (the decode schedule puts each query first in its tile, so it is compared within tolerance there). The ``gpu``
cases compare every schedule bitwise at Gemma 4's head sizes.
"""

import itertools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton or the kernels are imported

from inference_server.backends.cuda.norm_ops import invariant_rms_norm
from inference_server.kernels.prefill_attention import paged_prefill_attention
from inference_server.kernels.reference_attention import ref_paged_prefill_attention
from inference_server.models.architectures.layers import rms_norm

DEV = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def run_schedule(cuts: list[int], q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 table: torch.Tensor, window: int | None, **kwargs) -> torch.Tensor:
    """The sequence's attention outputs computed chunk by chunk at ``cuts`` (keys all in the cache already)."""
    pieces = []
    for lo, hi in itertools.pairwise(cuts):
        cu = torch.tensor([0, hi - lo], dtype=torch.int32, device=DEV)
        ctx = torch.tensor([hi], dtype=torch.int32, device=DEV)
        pieces.append(paged_prefill_attention(q[lo:hi], k_cache, v_cache, table[None], cu, ctx, 0.1, window,
                                              **kwargs))
    return torch.cat(pieces)


def sequence(total: int, heads: int, kv_heads: int, dim: int, block: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-total // block)
    k_cache = torch.randn(blocks + 2, block, kv_heads, dim, generator=gen).to(DEV, dtype)
    v_cache = torch.randn(blocks + 2, block, kv_heads, dim, generator=gen).to(DEV, dtype)
    table = torch.randperm(blocks + 2, generator=gen)[:blocks].to(DEV, torch.int32)
    q = torch.randn(total, heads, dim, generator=gen).to(DEV, dtype)
    return q, k_cache, v_cache, table


@pytest.mark.parametrize("split_keys", [32, None])  # 32: three KV splits folded in order; None: one (256)
@pytest.mark.parametrize("window", [None, 24])
def test_aligned_key_tiles_make_chunking_invisible(window: int | None, split_keys: int | None) -> None:
    total = 80
    q, k_cache, v_cache, table = sequence(total, 4, 2, 32, 8, torch.float32, 0)
    kwargs = dict(block_m=16, block_n=16, align_kv=True, split_keys=split_keys)
    whole = run_schedule([0, total], q, k_cache, v_cache, table, window, **kwargs)
    tile_rows = 16 // 2  # BLOCK_Q: queries per 16-row tile at G = 2
    same_places = [0, 24, 56, total]  # chunks that start on tile boundaries: every query keeps its tile place
    assert torch.equal(whole, run_schedule(same_places, q, k_cache, v_cache, table, window, **kwargs))
    odd = run_schedule([0, 13, 50, total], q, k_cache, v_cache, table, window, **kwargs)
    decode = run_schedule(list(range(total + 1)), q, k_cache, v_cache, table, window, **kwargs)
    if INTERPRETED:
        torch.testing.assert_close(odd, whole, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(decode, whole, rtol=1e-5, atol=1e-6)
        assert torch.equal(decode[::tile_rows], whole[::tile_rows])  # first of its tile in both schedules
    else:
        assert torch.equal(whole, odd) and torch.equal(whole, decode)
    cu = torch.tensor([0, total], dtype=torch.int32, device=DEV)
    ctx = torch.tensor([total], dtype=torch.int32, device=DEV)
    reference = ref_paged_prefill_attention(q, k_cache, v_cache, table[None], cu, ctx, 0.1, window)
    torch.testing.assert_close(whole, reference, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize(("dim", "window"), [(256, 1024), (512, None), (128, None)])
def test_aligned_attention_is_bitwise_schedule_free_on_gpu(dim: int, window: int | None) -> None:
    total = 2100
    q, k_cache, v_cache, table = sequence(total, 16, 8 if dim == 256 else 2, dim, 16, torch.bfloat16, 1)
    whole = run_schedule([0, total], q, k_cache, v_cache, table, window, align_kv=True)
    for cuts in ([0, 256, 512, 768, 1024, 1280, 1536, 1792, 2048, total], [0, 1000, 1777, total],
                 [0, 2000, *range(2001, total + 1)]):
        assert torch.equal(whole, run_schedule(cuts, q, k_cache, v_cache, table, window, align_kv=True))


@pytest.mark.parametrize("style", ["gemma4", "gemma3", "qwen"])
def test_one_row_norm_does_not_depend_on_the_row_count(style: str) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(70, 96, generator=gen).to(DEV)
    weight = (1 + torch.randn(96, generator=gen) / 4).to(DEV)
    target = torch.randn(96, generator=gen).to(DEV)
    rows = []
    for m in (1, 2, 7, 64, 70):
        batch = x[:m].clone()
        batch[m - 1] = target
        rows.append(invariant_rms_norm(batch, weight, 1e-6, style)[m - 1])  # type: ignore[arg-type]
    assert all(torch.equal(rows[0], r) for r in rows[1:])
    torch.testing.assert_close(rows[0], rms_norm(target[None], weight, 1e-6, style)[0], rtol=1e-5,  # type: ignore
                               atol=1e-5)
