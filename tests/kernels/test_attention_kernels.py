"""Paged attention kernels against their PyTorch references, and the references against dense attention.

Without CUDA the Triton kernels run in the interpreter (``TRITON_INTERPRET=1``, set below before triton is
imported; it is read when ``@triton.jit`` decorates), so the CPU shapes are tiny. ``@pytest.mark.gpu``
tests run real shapes on the device.

Every paged cache here starts as NaN: block 0 is the "null" block that unused and released block-table
entries point to, and slots past a sequence's context are never written. A kernel that reads a position it
must not (past the context, or in a block released outside the sliding window) produces NaN and fails.
"""

from __future__ import annotations

import math
import os
import textwrap

import attrs
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.kernels.reference_attention import ref_paged_decode_attention

from inference_server.kernels import decode_attention, prefill_attention
from inference_server.kernels.decode_attention import (
    H200_NUM_SMS,
    choose_num_splits,
    decode_config,
    paged_decode_attention,
)
from inference_server.kernels.kv_store import store_kv
from inference_server.kernels.prefill_attention import paged_prefill_attention
from inference_server.kernels.reference_attention import ref_paged_prefill_attention, ref_store_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@attrs.frozen
class PagedCase:
    k_cache: torch.Tensor  # [num_blocks, bs, nKV, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    context_lens: torch.Tensor  # int32 [B]
    keys: list[torch.Tensor]  # per sequence [ctx, nKV, D], in the cache dtype
    values: list[torch.Tensor]


def randn(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=DEVICE)


def build_paged(
    ctx_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    *,
    first_visible: list[int] | None = None,
    seed: int = 0,
    kv_std: float = 1.0,
) -> PagedCase:
    """A NaN-filled paged cache holding random K/V for each sequence in shuffled blocks.

    ``first_visible[b]``: blocks wholly before this position are "released" (their table entry -> 0).
    """
    gen = torch.Generator().manual_seed(seed)
    dev_gen = torch.Generator(device=DEVICE).manual_seed(seed)
    nblocks = [-(-c // block_size) for c in ctx_lens]
    num_blocks = 1 + sum(nblocks) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    block_tables = torch.zeros((len(ctx_lens), max([*nblocks, 1]) + 1), dtype=torch.int32)
    free = (1 + torch.randperm(num_blocks - 1, generator=gen)).tolist()
    keys, values = [], []
    for b, ctx in enumerate(ctx_lens):
        ids = torch.tensor([free.pop() for _ in range(nblocks[b])], dtype=torch.long)
        block_tables[b, : nblocks[b]] = ids.int()
        k = (randn((ctx, num_kv_heads, head_dim), dev_gen) * kv_std).to(dtype)
        v = randn((ctx, num_kv_heads, head_dim), dev_gen).to(dtype)
        pos = torch.arange(ctx)
        where = (ids[pos // block_size].to(DEVICE), (pos % block_size).to(DEVICE))
        k_cache[where] = k
        v_cache[where] = v
        keys.append(k)
        values.append(v)
        if first_visible is not None:
            block_tables[b, : max(0, first_visible[b]) // block_size] = 0
    return PagedCase(
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables.to(DEVICE),
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE),
        keys=keys,
        values=values,
    )


def dense_attention(
    q: torch.Tensor,  # [L, nH, D]
    k: torch.Tensor,  # [ctx, nKV, D]
    v: torch.Tensor,  # [ctx, nKV, D]
    first_q_pos: int,
    scale: float,
    window: int | None,
) -> torch.Tensor:  # [L, nH, D], float64
    """Naive attention over contiguous K/V with explicit causal and sliding masks, in float64."""
    chunk, num_heads, _ = q.shape
    ctx = k.shape[0]
    if ctx == 0:
        return torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    group = num_heads // k.shape[1]
    kd = k.double().repeat_interleave(group, dim=1)  # [ctx, nH, D]
    vd = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,shd->hls", q.double(), kd) * scale  # [nH, L, ctx]
    q_pos = torch.arange(first_q_pos, first_q_pos + chunk, device=q.device)[:, None]
    kv_pos = torch.arange(ctx, device=q.device)[None, :]
    mask = kv_pos <= q_pos
    if window is not None:
        mask &= q_pos - kv_pos < window
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("hls,shd->lhd", probs, vd)


def packed(chunks: list[int]) -> torch.Tensor:
    cu = [0]
    for c in chunks:
        cu.append(cu[-1] + c)
    return torch.tensor(cu, dtype=torch.int32, device=DEVICE)


def prefill_setup(
    prefixes: list[int],
    chunks: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    window: int | None,
    seed: int = 0,
    qk_std: float = 1.0,
) -> tuple[torch.Tensor, PagedCase, torch.Tensor]:
    ctx = [p + c for p, c in zip(prefixes, chunks, strict=True)]
    first_visible = [p - window + 1 for p in prefixes] if window is not None else None
    case = build_paged(
        ctx, num_kv_heads, head_dim, block_size, dtype, first_visible=first_visible, seed=seed, kv_std=qk_std
    )
    gen = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    q = (randn((sum(chunks), num_heads, head_dim), gen) * qk_std).to(dtype)
    return q, case, packed(chunks)


def decode_setup(
    ctx_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    window: int | None,
    seed: int = 0,
    qk_std: float = 1.0,
) -> tuple[torch.Tensor, PagedCase]:
    first_visible = [c - window for c in ctx_lens] if window is not None else None
    case = build_paged(
        ctx_lens,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
        first_visible=first_visible,
        seed=seed,
        kv_std=qk_std,
    )
    gen = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    q = (randn((len(ctx_lens), num_heads, head_dim), gen) * qk_std).to(dtype)
    return q, case


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Elementwise closeness plus a relative Frobenius bound (outputs shrink as contexts grow)."""
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert not actual.isnan().any(), "NaN in output: a masked or released position was read"
    actual, expected = actual.double(), expected.double()
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)
    rel = (actual - expected).norm() / expected.norm().clamp_min(1e-30)
    assert rel < (1e-5 if dtype == torch.float32 else 1e-2), f"relative error {rel:.2e}"


# ---------------------------------------------------------------------------------------- references


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 1, 6])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (8, 1)])
def test_reference_prefill_matches_dense(
    num_heads: int, num_kv_heads: int, window: int | None, dtype: torch.dtype
) -> None:
    prefixes, chunks = [0, 5, 13, 9, 0, 30], [7, 1, 11, 0, 1, 16]
    q, case, cu = prefill_setup(prefixes, chunks, num_heads, num_kv_heads, 16, 4, dtype, window)
    out = ref_paged_prefill_attention(
        q, case.k_cache, case.v_cache, case.block_tables, cu, case.context_lens, 0.3, window
    )
    assert out.dtype == dtype and out.shape == q.shape
    cu_l = cu.tolist()
    for b, prefix in enumerate(prefixes):
        want = dense_attention(q[cu_l[b] : cu_l[b + 1]], case.keys[b], case.values[b], prefix, 0.3, window)
        assert_close(out[cu_l[b] : cu_l[b + 1]], want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 3, 9])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (8, 2)])
def test_reference_decode_matches_dense(
    num_heads: int, num_kv_heads: int, window: int | None, dtype: torch.dtype
) -> None:
    ctx_lens = [1, 4, 5, 16, 37, 0]
    q, case = decode_setup(ctx_lens, num_heads, num_kv_heads, 32, 4, dtype, window)
    out = ref_paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.2, window)
    for b, ctx in enumerate(ctx_lens):
        want = dense_attention(q[b : b + 1], case.keys[b], case.values[b], ctx - 1, 0.2, window)
        assert_close(out[b : b + 1], want, dtype)


def test_reference_store_kv_matches_loop() -> None:
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn((9, 2, 8), generator=gen), torch.randn((9, 2, 8), generator=gen)
    slots = torch.tensor([0, 5, -1, 19, 7, -3, 2, 8, 11])
    k_cache, v_cache = torch.zeros((5, 4, 2, 8)), torch.zeros((5, 4, 2, 8))
    ref_store_kv(k, v, k_cache, v_cache, slots)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want_k[slot // 4, slot % 4] = k[t]
            want_v[slot // 4, slot % 4] = v[t]
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


# ---------------------------------------------------------------------------------------- kv store


@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(1, 16), (3, 24), (2, 64)])
def test_store_kv_kernel_matches_reference(num_kv_heads: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, tokens = 6, 4, 11
    # K/V as strided views of a fused projection output, as the model produces them.
    kv = torch.randn((tokens, 3, num_kv_heads, head_dim), generator=gen).to(DEVICE)
    k, v = kv[:, 0], kv[:, 2]
    slots = torch.tensor([0, 5, -1, 19, 7, -3, 2, 23, 12, 13, -1], dtype=torch.int64, device=DEVICE)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.zeros(shape, device=DEVICE), torch.zeros(shape, device=DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv(k, v, k_cache, v_cache, slots)
    ref_store_kv(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_store_kv_kernel_casts_to_cache_dtype() -> None:
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn((5, 2, 16), generator=gen).to(DEVICE), torch.randn((5, 2, 16), generator=gen).to(DEVICE)
    slots = torch.tensor([3, -1, 0, 9, 4], dtype=torch.int64, device=DEVICE)
    k_cache = torch.zeros((3, 4, 2, 16), dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv(k, v, k_cache, v_cache, slots)
    ref_store_kv(k, v, k_ref, v_ref, slots)
    # The interpreter truncates fp32 -> bf16 where torch rounds to nearest: allow one bf16 ulp.
    torch.testing.assert_close(k_cache.float(), k_ref.float(), atol=0, rtol=2**-7)
    torch.testing.assert_close(v_cache.float(), v_ref.float(), atol=0, rtol=2**-7)


# ---------------------------------------------------------------------------------------- decode


@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("window", [None, 5, 20])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 4, 16), (8, 2, 32), (6, 2, 64), (16, 1, 16)])
def test_decode_kernel_matches_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, window: int | None, num_splits: int | None
) -> None:
    ctx_lens = [1, 4, 5, 16, 37, 0]  # block_size 4: on and just past block boundaries; 0 = padded slot
    q, case = decode_setup(ctx_lens, num_heads, num_kv_heads, head_dim, 4, torch.float32, window)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.25, window)
    hint = 1024 if num_splits is None else None  # auto + a long-context hint: 4 splits at this batch
    out = paged_decode_attention(*args, num_splits, max_context_len=hint, block_n=16)
    assert_close(out, ref_paged_decode_attention(*args), torch.float32)
    assert torch.all(out[-1] == 0)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_kernel_bf16_static_out(num_splits: int) -> None:
    ctx_lens = [3, 29, 8]
    q, case = decode_setup(ctx_lens, 8, 2, 32, 8, torch.bfloat16, None)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.25, None)
    out = torch.full_like(q, float("nan"))
    got = paged_decode_attention(*args, num_splits, out=out, block_n=16)
    assert got.data_ptr() == out.data_ptr()
    assert_close(out, ref_paged_decode_attention(*args), torch.bfloat16)


@pytest.mark.parametrize(("head_dim", "num_splits"), [(128, 1), (128, 2), (256, 2), (512, 1), (512, 3)])
def test_decode_kernel_large_head_dim(head_dim: int, num_splits: int) -> None:
    ctx_lens = [9, 30]
    q, case = decode_setup(ctx_lens, 4, 2, head_dim, 8, torch.float32, None, qk_std=head_dim**-0.25)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 1.0, None)
    out = paged_decode_attention(*args, num_splits, block_n=16)
    assert_close(out, ref_paged_decode_attention(*args), torch.float32)


def reduce_kernel_merge(args: tuple, num_splits: int | None, **kwargs: object) -> torch.Tensor:
    """``paged_decode_attention`` of ``args`` with the splits merged by ``_decode_reduce_kernel`` (the path of more kv
    heads than the arrival counters hold), for comparison with the merge inside the decode launch."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode_attention, "_MAX_FUSED_HEADS", 0)
        return paged_decode_attention(*args, num_splits, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "window", "num_splits"),
                         [(8, 2, 32, None, 3), (6, 2, 64, 20, 4), (16, 1, 16, None, 5), (4, 2, 512, None, 3)])
def test_fused_split_merge_equals_the_reduce_kernel(num_heads: int, num_kv_heads: int, head_dim: int,
                                                    window: int | None, num_splits: int) -> None:
    """The last split of each kv head merges the partials inside the decode launch: the reduce kernel's result up
    to the order of fp32 sums (empty splits and a padded slot included), and the arrival counters end at zero."""
    ctx_lens = [1, 5, 37, 0, 16]
    q, case = decode_setup(ctx_lens, num_heads, num_kv_heads, head_dim, 4, torch.float32, window,
                           qk_std=head_dim**-0.25)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.25, window)
    fused = paged_decode_attention(*args, num_splits, block_n=16)
    separate = reduce_kernel_merge(args, num_splits, block_n=16)
    torch.testing.assert_close(fused, separate, atol=1e-6, rtol=1e-5)
    assert_close(fused, ref_paged_decode_attention(*args), torch.float32)
    assert torch.all(fused[3] == 0)
    assert int(decode_attention._arrival_counters(q.device).count_nonzero()) == 0


@pytest.mark.parametrize("merge_elements", [128, 256])
def test_fused_merge_in_several_chunks(monkeypatch: pytest.MonkeyPatch, merge_elements: int) -> None:
    """With the merge's load capped below the active splits (G = 4 heads of D = 32: one or two splits a load), the
    first chunk loaded with the maxima and the rest in the loop give the reduce kernel's result and the
    reference's."""
    monkeypatch.setattr(decode_attention, "_MERGE_ELEMENTS", merge_elements)
    ctx_lens = [64, 37, 0, 5]  # 4, 3, 0 and 1 active splits of 16 keys
    q, case = decode_setup(ctx_lens, 8, 2, 32, 4, torch.float32, None, qk_std=32**-0.25)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.25, None)
    fused = paged_decode_attention(*args, 5, block_n=16)
    separate = reduce_kernel_merge(args, 5, block_n=16)
    torch.testing.assert_close(fused, separate, atol=1e-6, rtol=1e-5)
    assert_close(fused, ref_paged_decode_attention(*args), torch.float32)
    assert torch.all(fused[2] == 0)


def test_choose_num_splits() -> None:
    assert choose_num_splits(64, 8, 8192) == 1  # 512 programs already fill the GPU
    assert choose_num_splits(1, 4, 8192) == 64  # 4 programs: up to 2 waves (66), capped
    assert choose_num_splits(1, 16, 8192) == 17  # 16 programs: 2 waves
    assert choose_num_splits(1, 16, 600) == 9  # >= 64 keys per split of the longest range
    assert choose_num_splits(1, 4, 60) == 1  # too short to split
    assert choose_num_splits(1, 1, 1 << 20) == 64  # capped
    assert choose_num_splits(1, 4, 8192, num_sms=H200_NUM_SMS) == choose_num_splits(1, 4, 8192)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(("window", "kv_before_wait"), [(None, False), (20, False), (None, True)])
def test_decode_block_table_a_tile_ahead_matches_reference(num_splits: int, window: int | None,
                                                           kv_before_wait: bool) -> None:
    """``DecodePlan.table_ahead``: the key loop loads the next tile's block-table entries one iteration ahead; the
    same result as the plain loop, bit for bit (the same sums in the same order), and the reference's. Sequences
    of one to several 16-key tiles a split over 4-key blocks, a window, a padded slot, and the first tile loaded
    before the PDL wait (the loop then starts at the second tile)."""
    ctx_lens = [1, 16, 17, 40, 75, 0]
    q, case = decode_setup(ctx_lens, 8, 2, 32, 4, torch.float32, window)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.25, window)
    plain = paged_decode_attention(*args, plan=decode_attention.DecodePlan(16, 4, 2, num_splits),
                                   kv_before_wait=kv_before_wait)
    ahead = paged_decode_attention(*args, plan=decode_attention.DecodePlan(16, 4, 2, num_splits, table_ahead=True),
                                   kv_before_wait=kv_before_wait)
    assert torch.equal(ahead, plain)
    assert_close(ahead, ref_paged_decode_attention(*args), torch.float32)
    assert torch.all(ahead[-1] == 0)


@pytest.mark.parametrize(("head_dim", "window"), [(256, 200), (512, None)])
def test_decode_table_ahead_candidate_matches_reference(head_dim: int, window: int | None) -> None:
    """The table-ahead plans ``bench/tune_attention.py`` times at 16 sequences and more of head_dim 256 and 512 (4
    warps, 3 stages, 32- and 16-key tiles, split) against the reference, with sequences of uneven length in bf16, and
    bit for bit against the same plan with the table loaded in the iteration that uses it."""
    batch = 16
    ctx_lens = [1 + (37 * i) % 250 for i in range(batch - 1)] + [0]  # up to 3 splits of 64-96 keys, windowed
    q, case = decode_setup(ctx_lens, 4, 1, head_dim, 16, torch.bfloat16, window, qk_std=head_dim**-0.25)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, head_dim**-0.5, window)
    plan = decode_attention.DecodePlan(32 if head_dim == 256 else 16, 4, 3, 3, table_ahead=True)
    out = paged_decode_attention(*args, plan=plan)
    assert_close(out, ref_paged_decode_attention(*args), torch.bfloat16)
    assert torch.equal(out, paged_decode_attention(*args, plan=attrs.evolve(plan, table_ahead=False)))
    assert torch.all(out[-1] == 0)


def test_decode_plan_is_decode_config_and_choose_num_splits() -> None:
    """The default plan at every head_dim and batch: ``decode_config``'s tiles and ``choose_num_splits``'s splits,
    the block table loaded in the iteration that uses it."""
    from inference_server.kernels.decode_attention import DecodePlan, decode_plan

    for head_dim in (128, 256, 512):
        for batch in (1, 2, 15, 16, 64, 256):
            for kv_heads, bound in ((1, 512), (2, 8192), (8, 1024)):
                today = DecodePlan(*decode_config(head_dim, batch, kv_heads),
                                   choose_num_splits(batch, kv_heads, bound))
                assert decode_plan(head_dim, batch, kv_heads, bound) == today, (head_dim, batch, kv_heads)
                assert decode_plan(head_dim, batch, kv_heads, bound, num_sms=66) == attrs.evolve(
                    today, num_splits=choose_num_splits(batch, kv_heads, bound, num_sms=66))
    assert not decode_plan(256, 64, 2, 512).table_ahead


def test_decode_config_by_batch_regime() -> None:
    """(key tile, warps, stages): batch 1-2 at D <= 128 unpipelined on 8 warps; a wave of programs before splitting
    (64 E4B sequences, 2 kv heads) 32-key tiles for D >= 256, 4 warps, 3 stages; elsewhere the kernel's earlier
    choice. K and V tiles stay within 32 KiB each in bf16 everywhere."""
    assert decode_config(128, 1, 4) == (64, 8, 1)
    assert decode_config(256, 2, 8) == (64, 8, 2)
    assert decode_config(512, 1, 2) == (32, 8, 2)
    assert decode_config(128, 16, 4) == (64, 4, 2)
    assert decode_config(256, 16, 2) == (64, 8, 2)
    assert decode_config(256, 64, 2) == (32, 4, 3)
    assert decode_config(512, 64, 2) == (32, 4, 3)
    assert decode_config(128, 64, 4) == (64, 4, 3)
    for head_dim in (64, 128, 256, 512):
        for batch in (1, 2, 3, 16, 64, 256):
            block_n, _, _ = decode_config(head_dim, batch, 4)
            assert block_n * head_dim * 2 <= 32 * 1024


# ---------------------------------------------------------------------------------------- prefill


@pytest.mark.parametrize("tiles", [(16, 16), (None, None)])
@pytest.mark.parametrize("window", [None, 3, 8])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 4, 16), (8, 2, 32), (6, 2, 16)])
def test_prefill_kernel_matches_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, window: int | None, tiles: tuple[int | None, ...]
) -> None:
    prefixes, chunks = [0, 5, 13, 9, 0, 3], [7, 1, 11, 0, 1, 16]
    q, case, cu = prefill_setup(prefixes, chunks, num_heads, num_kv_heads, head_dim, 4, torch.float32, window)
    args = (q, case.k_cache, case.v_cache, case.block_tables, cu, case.context_lens, 0.3, window)
    out = paged_prefill_attention(*args, block_m=tiles[0], block_n=tiles[1])
    assert_close(out, ref_paged_prefill_attention(*args), torch.float32)


@pytest.mark.parametrize("window", [None, 17, 40])
@pytest.mark.parametrize("num_heads", [1, 2])
def test_prefill_kernel_unmasked_tiles_end_exactly_at_the_visible_keys(num_heads: int, window: int | None) -> None:
    """Key tiles that every query of a query tile sees whole run without masks: prefixes and chunks at every
    alignment to the 16-key tiles (and query tiles of 16 / 8 tokens) put those runs' ends one key before, at and
    after a tile boundary, for the causal diagonal and the window edge alike."""
    prefixes = [0, 1, 14, 15, 16, 17, 31, 32, 33, 47, 60]
    chunks = [33, 17, 18, 16, 15, 2, 20, 1, 31, 16, 9]
    q, case, cu = prefill_setup(prefixes, chunks, num_heads, 1, 16, 4, torch.float32, window)
    args = (q, case.k_cache, case.v_cache, case.block_tables, cu, case.context_lens, 0.3, window)
    out = paged_prefill_attention(*args, block_m=16, block_n=16)
    assert_close(out, ref_paged_prefill_attention(*args), torch.float32)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "window"),
                         [(4, 2, 256, 40), (4, 2, 128, None), (8, 1, 512, None)])
def test_prefill_kernel_long_bf16_chunks_take_the_long_chunk_tiles(
    num_heads: int, num_kv_heads: int, head_dim: int, window: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 chunks that average LONG_CHUNK_TOKENS or more take the long-chunk tiles and match the reference; a step
    of one-token rows beside a chunk keeps the small ones."""
    chosen: list[bool] = []
    config = prefill_attention._prefill_config

    def spy(dim: int, small_tiles: bool = True) -> tuple[int, int, int, int]:
        chosen.append(small_tiles)
        return config(dim, small_tiles)

    monkeypatch.setattr(prefill_attention, "_prefill_config", spy)
    q, case, cu = prefill_setup([0, 70], [130, 70], num_heads, num_kv_heads, head_dim, 16, torch.bfloat16, window,
                                qk_std=head_dim**-0.25)
    args = (q, case.k_cache, case.v_cache, case.block_tables, cu, case.context_lens, head_dim**-0.5, window)
    assert_close(paged_prefill_attention(*args), ref_paged_prefill_attention(*args), torch.bfloat16)
    q, case, cu = prefill_setup([5, 9, 3], [1, 1, 100], num_heads, num_kv_heads, head_dim, 16, torch.bfloat16, window,
                                qk_std=head_dim**-0.25)
    args = (q, case.k_cache, case.v_cache, case.block_tables, cu, case.context_lens, head_dim**-0.5, window)
    assert_close(paged_prefill_attention(*args), ref_paged_prefill_attention(*args), torch.bfloat16)
    assert chosen == [False, True]


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "slices"), [(4, 2, 64, 2), (8, 2, 64, 4),
                                                                              (2, 1, 48, 2)])
def test_prefill_kernel_with_value_slices_matches_reference(num_heads: int, num_kv_heads: int, head_dim: int,
                                                            slices: int, window: int | None) -> None:
    """Programs that each accumulate a slice of the value columns (recomputing the scores over all of D) give the
    reference, a head_dim below the power-of-two tile (48 in 64: the last slice partly masked) included."""
    prefixes, chunks = [0, 5, 13, 9], [7, 1, 11, 20]
    q, case, cu = prefill_setup(prefixes, chunks, num_heads, num_kv_heads, head_dim, 4, torch.float32, window)
    args = (q, case.k_cache, case.v_cache, case.block_tables, cu, case.context_lens, 0.3, window)
    out = paged_prefill_attention(*args, block_m=16, block_n=16, value_slices=slices)
    assert_close(out, ref_paged_prefill_attention(*args), torch.float32)


def test_value_slices_must_leave_16_columns_and_are_refused_with_aligned_keys() -> None:
    q, case, cu = prefill_setup([0], [4], 2, 1, 32, 4, torch.float32, None)
    args = (q, case.k_cache, case.v_cache, case.block_tables, cu, case.context_lens, 0.3, None)
    with pytest.raises(ValueError, match="value_slices"):
        paged_prefill_attention(*args, value_slices=4)  # 8 columns a slice
    with pytest.raises(ValueError, match="value_slices"):
        paged_prefill_attention(*args, value_slices=2, align_kv=True, split_keys=16, block_n=16)


@pytest.mark.parametrize(("head_dim", "window", "tiles"), [(128, None, (16, 16)), (512, 4, (None, None))])
def test_prefill_kernel_bf16_large_head_dim(
    head_dim: int, window: int | None, tiles: tuple[int | None, int | None]
) -> None:
    q, case, cu = prefill_setup([6, 0], [5, 3], 4, 2, head_dim, 8, torch.bfloat16, window, qk_std=head_dim**-0.25)
    args = (q, case.k_cache, case.v_cache, case.block_tables, cu, case.context_lens, 1.0, window)
    out = paged_prefill_attention(*args, block_m=tiles[0], block_n=tiles[1])
    assert_close(out, ref_paged_prefill_attention(*args), torch.bfloat16)


def test_prefill_single_token_chunks_equal_decode() -> None:
    ctx_lens = [1, 12, 21]
    q, case = decode_setup(ctx_lens, 8, 2, 16, 4, torch.float32, 6)
    cu = packed([1, 1, 1])
    pre = paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, cu, case.context_lens, 0.5, 6)
    dec = paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.5, 6, 2)
    assert_close(pre, dec.double(), torch.float32)


# ---------------------------------------------------------------------------------------- GPU, real shapes

# (num_heads, num_kv_heads, head_dim, scale, window): Qwen3-30B-A3B, Gemma 4 sliding and full layers.
GPU_LAYERS = [
    (32, 4, 128, 128**-0.5, None),
    (16, 8, 256, 1.0, 1024),
    (16, 2, 512, 1.0, None),
]


@gpu
@requires_cuda
@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "scale", "window"), GPU_LAYERS)
@pytest.mark.parametrize("num_splits", [1, None])
def test_gpu_decode(
    batch: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    window: int | None,
    num_splits: int | None,
) -> None:
    gen = torch.Generator().manual_seed(batch)
    ctx_lens = torch.randint(1, 8193, (batch,), generator=gen).tolist()
    ctx_lens[0] = 8192
    std = head_dim**-0.25
    q, case = decode_setup(ctx_lens, num_heads, num_kv_heads, head_dim, 16, torch.bfloat16, window, qk_std=std)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, scale, window)
    out = paged_decode_attention(*args, num_splits)
    assert_close(out, ref_paged_decode_attention(*args), torch.bfloat16)
    if num_splits is None:  # the split merge inside the launch against the reduce kernel
        separate = reduce_kernel_merge(args, num_splits)
        torch.testing.assert_close(out.float(), separate.float(), atol=2e-2, rtol=2**-7)


@gpu
@requires_cuda
@pytest.mark.parametrize("batch", [16, 64])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "scale", "window"), GPU_LAYERS)
def test_gpu_decode_block_table_a_tile_ahead(batch: int, num_heads: int, num_kv_heads: int, head_dim: int,
                                             scale: float, window: int | None) -> None:
    """The default plan with the block table loaded a tile ahead (``DecodePlan.table_ahead``): the plain loop's
    output bit for bit (the same sums in the same order), and the reference's, at contexts up to 8,192."""
    gen = torch.Generator().manual_seed(batch + head_dim)
    ctx_lens = torch.randint(1, 8193, (batch,), generator=gen).tolist()
    ctx_lens[0] = 8192
    q, case = decode_setup(ctx_lens, num_heads, num_kv_heads, head_dim, 16, torch.bfloat16, window,
                           qk_std=head_dim**-0.25)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, scale, window)
    plan = decode_attention.decode_plan(head_dim, batch, num_kv_heads, min(8192, window or 8192))
    plain = paged_decode_attention(*args, plan=plan)
    ahead = paged_decode_attention(*args, plan=attrs.evolve(plan, table_ahead=True))
    assert torch.equal(ahead, plain)
    assert_close(ahead, ref_paged_decode_attention(*args), torch.bfloat16)


@gpu
@requires_cuda
def test_gpu_prefill_at_every_layer_kind() -> None:
    """Long bf16 chunks (the long-chunk tiles; head_dim 512 on value slices) beside short ones at Qwen3-30B-A3B's,
    Gemma 4's sliding and full layer shapes. One test, not a sweep: the default GPU run takes a sweep's first case
    only, and each layer kind has its own tile."""
    prefixes, chunks = [0, 3000, 517, 8000, 0], [2048, 1000, 1, 192, 77]
    for num_heads, num_kv_heads, head_dim, scale, window in GPU_LAYERS:
        q, case, cu = prefill_setup(
            prefixes, chunks, num_heads, num_kv_heads, head_dim, 16, torch.bfloat16, window, qk_std=head_dim**-0.25
        )
        args = (q, case.k_cache, case.v_cache, case.block_tables, cu, case.context_lens, scale, window)
        assert_close(paged_prefill_attention(*args), ref_paged_prefill_attention(*args), torch.bfloat16)


@gpu
@requires_cuda
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(4, 128), (8, 256), (2, 512)])
def test_gpu_store_kv(num_kv_heads: int, head_dim: int) -> None:
    tokens, num_blocks, block_size = 3000, 400, 16
    k = torch.randn((tokens, num_kv_heads, head_dim), device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    slots[::7] = -1
    k_cache = torch.zeros((num_blocks, block_size, num_kv_heads, head_dim), device=DEVICE, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv(k, v, k_cache, v_cache, slots)
    ref_store_kv(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@gpu
@requires_cuda
def test_gpu_decode_cuda_graph_replay() -> None:
    """Captured once with static buffers, replayed with new lengths: no host sync inside the wrapper."""
    batch, num_heads, num_kv_heads, head_dim = 4, 32, 4, 128
    q, case = decode_setup(
        [4096] * batch, num_heads, num_kv_heads, head_dim, 16, torch.bfloat16, None, qk_std=head_dim**-0.25
    )
    ctx_static = case.context_lens.clone()
    out = torch.empty_like(q)
    args = (q, case.k_cache, case.v_cache, case.block_tables, ctx_static, head_dim**-0.5, None)
    paged_decode_attention(*args, out=out)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(*args, out=out)
    for lens in ([1, 17, 4096, 300], [4096, 2048, 1, 0]):
        ctx_static.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, ref_paged_decode_attention(*args), torch.bfloat16)


def test_dense_helper_sanity() -> None:
    """The dense helper itself: one key means the output is that key's value."""
    q = torch.randn(1, 2, 4)
    k, v = torch.randn(1, 1, 4), torch.randn(1, 1, 4)
    out = dense_attention(q, k, v, 0, 1.0, None)
    assert torch.allclose(out, v.double().expand(1, 2, 4))
    assert math.isclose(float(dense_attention(q, k, v, 0, 1.0, 1).sum()), float(v.sum() * 2), rel_tol=1e-6)


_DECODE_COMPILE = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from inference_server.kernels.decode_attention import _paged_decode_kernel as fn

    target = GPUTarget("cuda", 90, 64)
    # Qwen3-30B-A3B (G 8, D 128), Gemma 4 sliding (G 2, D 256) and full (G 8, D 512) layers at 16 splits, and
    # Gemma-4-E4B's KV-shared sliding and full layers (G 4) with the raw q normed and rotated in the launch
    # (the first tile of earlier keys loaded before the PDL wait in the first and the fourth)
    for group, head_dim, block_n, warps, chunk, q_norm, early in ((8, 128, 64, 4, 16, 0, 1), (2, 256, 64, 8, 16, 0, 0),
                                                                  (8, 512, 32, 8, 4, 0, 0), (4, 256, 64, 8, 16, 1, 1),
                                                                  (4, 512, 32, 8, 4, 1, 0)):
        constexprs = dict(PAGE=16, G=group, BLOCK_G=16, D=head_dim, BLOCK_D=head_dim, BLOCK_N=block_n, SPLIT=True,
                          DOT_PRECISION="tf32", UPCAST=False, FUSED_REDUCE=True, BLOCK_S=16, SPLIT_CHUNK=chunk,
                          BLOCK_R=group, USE_PDL=bool(early), Q_NORM_ROPE=q_norm, KV_BEFORE_WAIT=bool(early),
                          TABLE_AHEAD=False)
        types = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "block_tables_ptr": "*i32",
                 "context_lens_ptr": "*i32", "out_ptr": "*bf16", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
                 "part_acc_ptr": "*fp32", "counter_ptr": "*i32", "qk_scale": "fp32", "qw_ptr": "*bf16",
                 "cos_ptr": "*bf16", "sin_ptr": "*bf16", "q_eps": "fp32"}
        signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
        kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=target,
                                options=dict(num_warps=warps, num_stages=2))
        assert "atom" in kernel.asm["ptx"] and kernel.metadata.shared <= 232448, (head_dim, kernel.metadata.shared)
    # The table-ahead candidates bench/tune_attention.py times (4 warps, 3 stages, 32-key tiles at D 256, 16-key at
    # D 512, today's splits) as the launcher runs them (Gemma 4 at 64 sequences of 512 keys: E2B, E4B, 26B-A4B and
    # 31B sliding and full layers; 16-byte aligned pointers and head-dim strides), and once per head_dim with the
    # block table loaded in the iteration that uses it: each fits the shared memory of two programs an SM (228 KB,
    # 1 KB of it reserved per program); with the table a tile ahead the pipeliner double-buffers the K and V tiles
    # (shared memory for two of each), without it holds one
    import attrs

    from inference_server.kernels.decode_attention import _MERGE_ELEMENTS, DecodePlan, choose_num_splits
    aligned = ("stride_qb", "stride_qh", "stride_kb", "stride_kt", "stride_kh", "stride_vb", "stride_vt", "stride_vh",
               "stride_ob", "stride_oh")
    attrs_ = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in fn.arg_names
              if n.endswith("_ptr") or n in aligned}
    done = set()
    for group, kv_heads, head_dim in ((8, 1, 256), (8, 1, 512), (4, 2, 256), (4, 2, 512), (2, 8, 256), (8, 2, 512),
                                      (2, 16, 256), (8, 4, 512)):
        plan = DecodePlan(32 if head_dim == 256 else 16, 4, 3, choose_num_splits(64, kv_heads, 512), table_ahead=True)
        for ahead in (True, False):
            block_s = triton.next_power_of_2(plan.num_splits)
            chunk = max(1, min(block_s, _MERGE_ELEMENTS // (triton.next_power_of_2(group) * head_dim)))
            key = (group, head_dim, attrs.evolve(plan, table_ahead=ahead), block_s, chunk)
            if key in done or (not ahead and any(k[1] == head_dim and not k[2].table_ahead for k in done)):
                continue
            done.add(key)
            constexprs = dict(PAGE=16, G=group, BLOCK_G=16, D=head_dim, BLOCK_D=head_dim, BLOCK_N=plan.block_n,
                              SPLIT=plan.num_splits > 1, DOT_PRECISION="tf32", UPCAST=False,
                              FUSED_REDUCE=plan.num_splits > 1, BLOCK_S=block_s, SPLIT_CHUNK=chunk,
                              BLOCK_R=triton.next_power_of_2(group), USE_PDL=True, Q_NORM_ROPE=0,
                              KV_BEFORE_WAIT=False, TABLE_AHEAD=ahead)
            signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
            kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs_),
                                    target=target, options=dict(num_warps=plan.num_warps,
                                                                num_stages=plan.num_stages, launch_pdl=True))
            assert "cp.async" in kernel.asm["ptx"], (key, "loads not pipelined")
            assert 2 * (kernel.metadata.shared + 1024) <= 228 * 1024, (key, kernel.metadata.shared)
            kv_tiles = 2 * plan.block_n * head_dim * 2  # bytes of one K and one V tile
            assert (kernel.metadata.shared >= 2 * kv_tiles) == ahead, (key, kernel.metadata.shared, kv_tiles)
    assert len(done) >= 6, done
    print("compiled")
''')


def test_decode_kernel_with_the_fused_split_merge_compiles_for_sm90() -> None:
    from .test_kernels_compile_for_h200 import _compile_in_child

    _compile_in_child(_DECODE_COMPILE)


@pytest.mark.parametrize("gemma", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "num_splits"),
                         [(8, 2, 32, 1), (6, 2, 64, 3), (4, 1, 16, None)])
def test_decode_kernel_norms_and_rotates_a_raw_query(num_heads: int, num_kv_heads: int, head_dim: int,
                                                     num_splits: int | None, dtype: torch.dtype, gemma: bool) -> None:
    """``q_norm_rope``: the attention of a raw q, normed and rotated in the launch (a KV-shared layer's whole
    ``qk_norm_rope``), equals ``qk_norm_rope``'s q attended: bit for bit under the interpreter's bf16 (the same
    roundings; the sum of squares in another order moves no bit at these sizes), within fp32 rounding in fp32."""
    from tests.kernels.reference_fused import reference_qk_norm_rope

    from inference_server.kernels.decode_attention import QueryNormRope
    from inference_server.kernels.qk_norm_rope import qk_norm_rope
    from inference_server.models.architectures.layers import rope_cos_sin, rope_inv_freq
    from inference_server.models.spec import RopeSpec

    ctx_lens = [3, 17, 8, 0]
    q_raw, case = decode_setup(ctx_lens, num_heads, num_kv_heads, head_dim, 4, dtype, None, seed=head_dim)
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    q_raw = (q_raw.float() * 3).to(dtype)
    weight = (1 + randn((head_dim,), gen) / 4).to(dtype)
    positions = torch.tensor([c - 1 if c else 0 for c in ctx_lens], device=DEVICE)
    cos, sin = rope_cos_sin(rope_inv_freq(RopeSpec(theta=10_000.0, head_dim=head_dim)).to(DEVICE), positions, dtype)
    q, _, _ = qk_norm_rope(q_raw, None, None, weight, None, 1e-6, "gemma" if gemma else "qwen", cos, sin)
    args = (case.k_cache, case.v_cache, case.block_tables, case.context_lens, head_dim**-0.5, None, num_splits)
    want = paged_decode_attention(q, *args, max_context_len=64, block_n=16)
    got = paged_decode_attention(q_raw, *args, max_context_len=64, block_n=16,
                                 q_norm_rope=QueryNormRope(weight, 1e-6, gemma, cos, sin))
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=1e-5 if dtype == torch.float32 else 2e-2,
                                   rtol=1e-5 if dtype == torch.float32 else 2e-2)
    q_ref, _, _ = reference_qk_norm_rope(q_raw, None, None, weight, None, 1e-6, "gemma" if gemma else "qwen", cos, sin)
    assert_close(got, ref_paged_decode_attention(q_ref, *args[:-1]), dtype)  # the PyTorch references
    with pytest.raises(ValueError, match="cos and sin"):
        paged_decode_attention(q_raw, *args, q_norm_rope=QueryNormRope(weight, 1e-6, gemma, cos[:2], sin[:2]))


# ------------------------------------------------------------------- the earlier keys before the PDL wait


KV_BEFORE_WAIT_CASES = [  # (num_heads, num_kv_heads, head_dim, window, num_splits)
    (8, 2, 32, None, 1),  # one split: up to three tiles a program, the query's key in the first or a later one
    (8, 2, 32, None, 3),
    (6, 2, 64, 20, 4),  # a window: the first tile starts inside the sequence's blocks
    (4, 4, 16, 5, None),
    (16, 1, 16, None, 2),
]


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "window", "num_splits"), KV_BEFORE_WAIT_CASES)
def test_earlier_keys_before_the_wait_give_the_same_attention(num_heads: int, num_kv_heads: int, head_dim: int,
                                                               window: int | None, num_splits: int | None) -> None:
    """``kv_before_wait``: the first tile's earlier keys loaded before the wait and the query's own key after it
    give the attention of the plain kernel bit for bit (padded slots, empty splits and windows included)."""
    ctx_lens = [1, 4, 5, 16, 17, 37, 0]  # block_size 4, 16-key tiles: the query's key first / last in a tile
    q, case = decode_setup(ctx_lens, num_heads, num_kv_heads, head_dim, 4, torch.float32, window, seed=5)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.25, window, num_splits)
    early = paged_decode_attention(*args, max_context_len=64, block_n=16, kv_before_wait=True)
    plain = paged_decode_attention(*args, max_context_len=64, block_n=16, kv_before_wait=False)
    assert torch.equal(early, plain)
    assert_close(early, ref_paged_decode_attention(*args[:-1]), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("ctx", [1, 9, 16, 17, 30])
def test_the_query_key_is_read_only_after_the_wait(monkeypatch: pytest.MonkeyPatch, ctx: int,
                                                   num_splits: int) -> None:
    """The query's own key and value (position ``ctx - 1``) are what the launch before the attention writes: with
    ``kv_before_wait`` the kernel must read them after its PDL wait. Under the interpreter the wait here stores them
    (the cache holds NaN there until then), so a load of them before it poisons the output. Programs run one after
    another, so the first program (sequence 0, kv head 0, split 0, whose tile holds the query's key with one split)
    is the one that sees the NaN."""
    q, case = decode_setup([ctx, 12], 4, 2, 16, 4, torch.float32, None, seed=ctx)
    table = case.block_tables[0]
    block, offset = int(table[(ctx - 1) // 4]), (ctx - 1) % 4
    key, value = case.k_cache[block, offset].clone(), case.v_cache[block, offset].clone()
    case.k_cache[block, offset] = float("nan")
    case.v_cache[block, offset] = float("nan")
    waits: list[int] = []

    def wait_then_store(use_pdl: bool) -> None:  # the predecessor completes: its K/V row lands
        waits.append(1)
        case.k_cache[block, offset] = key
        case.v_cache[block, offset] = value

    monkeypatch.setattr(decode_attention, "pdl_wait", wait_then_store)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.25, None, num_splits)
    out = paged_decode_attention(*args, max_context_len=64, block_n=16, kv_before_wait=True)
    assert waits, "the kernel did not wait"
    assert_close(out, ref_paged_decode_attention(*args[:-1]), torch.float32)


@gpu
@requires_cuda
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("kv_before_wait", [False, True])
def test_gpu_query_key_stored_by_the_launch_before(batch: int, kv_before_wait: bool) -> None:
    """On the device with PDL, in a CUDA graph as the engine runs it: a NaN lands in the query's K/V slots (a launch
    without PDL), the q/k norm + RoPE launch stores the real row there, and the attention, a programmatic dependent
    of that launch, must attend to the stored row, never the NaN, in every replay (Qwen3-30B-A3B's layer shape)."""
    from inference_server.kernels import pdl
    from inference_server.kernels.qk_norm_rope import PagedKVWrite, qk_norm_rope

    if not pdl.pdl_supported():
        pytest.skip("PDL needs an sm_90+ GPU and a Triton with launch_pdl")
    num_heads, num_kv_heads, head_dim, page = 32, 4, 128, 16
    ctx_lens = [541 + 37 * b for b in range(batch)]
    _, case = decode_setup(ctx_lens, num_heads, num_kv_heads, head_dim, page, torch.bfloat16, None,
                           qk_std=head_dim**-0.25)
    gen = torch.Generator(device=DEVICE).manual_seed(batch)
    q_raw = randn((batch, num_heads, head_dim), gen).to(torch.bfloat16)
    k_raw = randn((batch, num_kv_heads, head_dim), gen).to(torch.bfloat16)
    v_raw = randn((batch, num_kv_heads, head_dim), gen).to(torch.bfloat16)
    weight = (1 + randn((head_dim,), gen) / 4).to(torch.bfloat16)
    angles = randn((batch, head_dim), gen)
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    slots = torch.tensor([int(case.block_tables[b, (c - 1) // page]) * page + (c - 1) % page
                          for b, c in enumerate(ctx_lens)], dtype=torch.int64, device=DEVICE)
    flat_k = case.k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = case.v_cache.view(-1, num_kv_heads, head_dim)
    out = torch.empty_like(q_raw)
    write = PagedKVWrite(case.k_cache, case.v_cache, slots, value=v_raw)

    def step() -> torch.Tensor:
        flat_k.index_fill_(0, slots, float("nan"))  # what the slots hold until the launch before writes them
        flat_v.index_fill_(0, slots, float("nan"))
        q, _, _ = qk_norm_rope(q_raw, k_raw, None, weight, weight, 1e-6, "qwen", cos, sin, cache=write)
        return paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens,
                                      head_dim**-0.5, None, max_context_len=32768, out=out,
                                      kv_before_wait=kv_before_wait)

    with pdl.pdl_mode(pdl.PdlMode(requested=True)):
        step()  # compiles outside the capture
        torch.cuda.synchronize()
        q_ref = qk_norm_rope(q_raw, k_raw, None, weight, weight, 1e-6, "qwen", cos, sin)[0]
        want = ref_paged_decode_attention(q_ref, case.k_cache, case.v_cache, case.block_tables, case.context_lens,
                                          head_dim**-0.5, None)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for _ in range(50):
            graph.replay()
            torch.cuda.synchronize()
            assert not out.isnan().any(), "the attention read the query's K/V before they were stored"
            assert_close(out, want, torch.bfloat16)


def test_earlier_keys_go_before_the_wait_only_in_an_unpipelined_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default ``kv_before_wait``: with PDL on, only where the key loop has one stage (1-2 sequences of
    head_dim <= 128; pipelined loops were slower with it on the H200); never without PDL."""
    assert decode_attention.earlier_keys_before_wait(1) is False  # no PDL here
    monkeypatch.setattr(decode_attention, "pdl_enabled", lambda: True)
    stages = {(d, b): decode_config(d, b, kv)[2] for d, b, kv in ((128, 1, 4), (128, 2, 4), (128, 16, 4),
                                                                   (128, 64, 4), (256, 1, 8), (512, 1, 2))}
    early = {key: decode_attention.earlier_keys_before_wait(s) for key, s in stages.items()}
    assert early == {(128, 1): True, (128, 2): True, (128, 16): False, (128, 64): False, (256, 1): False,
                     (512, 1): False}
