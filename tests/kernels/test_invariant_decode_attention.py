"""The batch-invariant decode attention (``kernels.invariant_decode_attention``, ``DETERMINISTIC=true``): one program
per KV split and a fold in split order give a query the aligned prefill kernel's bits (``paged_prefill_attention(
align_kv=True)``), whatever the batch, the split programs, and whether its sequence was prefilled in one piece.

The cases are fp32, where a different order of the splits' fold shows, with small tiles and splits (16-key tiles,
32-key splits) so that contexts fall below, on and across split boundaries, with a sliding window that spans
several splits; the caches are NaN outside the keys a query may read. Under TRITON_INTERPRET=1 ``tl.dot`` is numpy's
matmul of the whole tile, whose rows may round differently by their place in it (``test_batch_invariant_cuda_ops``),
so there the whole-sequence prefill is compared bitwise where the query is first in its tile (its place in the
decode kernel's) and within fp32 tolerance elsewhere; the ``gpu`` cases compare every row bitwise at Gemma 4's and
Qwen3's head sizes in bf16.
"""

from __future__ import annotations

import itertools
import os
import textwrap

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton or the kernels are imported

from tests.kernels.reference_attention import ref_paged_decode_attention
from tests.kernels.test_attention_kernels import assert_close, build_paged, packed

from inference_server.kernels import invariant_decode_attention as idecode
from inference_server.kernels.invariant_decode_attention import (
    invariant_decode_attention,
    max_visible_splits,
    num_split_programs,
)
from inference_server.kernels.prefill_attention import paged_prefill_attention

DEV = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
SMALL = dict(block_m=16, block_n=16, split_keys=32)  # G = 2: BLOCK_Q = 8 queries a tile
CONTEXTS = [0, 1, 17, 20, 31, 32, 33, 64, 65, 70, 97]  # a padded slot, then below, on and across 32-key splits


def decode_batch(ctx_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, window: int | None, seed: int = 0):
    first_visible = [c - window for c in ctx_lens] if window is not None else None  # released blocks: NaN
    case = build_paged(ctx_lens, num_kv_heads, head_dim, block_size, dtype, first_visible=first_visible, seed=seed,
                       kv_std=head_dim**-0.25)
    gen = torch.Generator(device=DEV).manual_seed(seed + 1)
    q = (torch.randn((len(ctx_lens), num_heads, head_dim), generator=gen, device=DEV) * head_dim**-0.25).to(dtype)
    return q, case


def prefill_one_token_each(q: torch.Tensor, case, scale: float, window: int | None, **kwargs) -> torch.Tensor:
    """The aligned prefill kernel with every sequence a one-token chunk (what ``DETERMINISTIC`` ran at decode)."""
    cu = packed([1] * q.shape[0])
    return paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, cu, case.context_lens, scale,
                                   window, align_kv=True, **kwargs)


def last_of_schedule(qs: torch.Tensor, case, b: int, cuts: list[int], scale: float, window: int | None,
                     **kwargs) -> torch.Tensor:
    """The aligned prefill of sequence ``b``'s queries ``qs`` in chunks at ``cuts``: its last query's output."""
    last = None
    for lo, hi in itertools.pairwise(cuts):
        ctx = torch.tensor([hi], dtype=torch.int32, device=DEV)
        last = paged_prefill_attention(qs[lo:hi], case.k_cache, case.v_cache, case.block_tables[b:b + 1],
                                       packed([hi - lo]), ctx, scale, window, align_kv=True, **kwargs)[-1]
    assert last is not None
    return last


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("num_programs", [None, 1, 2, 8])
def test_decode_gives_the_aligned_prefill_bits(window: int | None, num_programs: int | None) -> None:
    """A batch of sequences of different lengths: the decode kernel's rows equal the aligned prefill's one-token
    chunks bit for bit, with every sequence in one split program, in several (2: the longer contexts exceed it and
    fold in one program), or one a split; a row is the same alone as in the batch; and close to the reference."""
    q, case = decode_batch(CONTEXTS, 4, 2, 32, 8, torch.float32, window)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.5, window)
    out = invariant_decode_attention(*args, num_programs=num_programs, **SMALL)
    assert torch.equal(out, prefill_one_token_each(q, case, 0.5, window, **SMALL))
    assert not out[0].any()  # the padded slot
    assert_close(out, ref_paged_decode_attention(*args), torch.float32)
    for b in (3, 7, 10):
        alone = invariant_decode_attention(q[b:b + 1], case.k_cache, case.v_cache, case.block_tables[b:b + 1],
                                           case.context_lens[b:b + 1], 0.5, window, num_programs=num_programs,
                                           **SMALL)
        assert torch.equal(alone[0], out[b])


@pytest.mark.parametrize("window", [None, 40])
def test_decode_gives_the_bits_of_the_whole_prompt_prefilled(window: int | None) -> None:
    """The query at a sequence's last position: the decode kernel equals the aligned prefill of the whole prompt in
    one chunk, and of the prompt in chunks cut across splits (bitwise where the query is first in its prefill tile
    under the interpreter, bitwise everywhere on a GPU)."""
    ctx_lens = [9, 25, 33, 41, 65, 97, 20, 70]
    case = build_paged(ctx_lens, 2, 32, 8, torch.float32, seed=4, kv_std=32**-0.25)
    gen = torch.Generator(device=DEV).manual_seed(5)
    queries = [torch.randn((c, 4, 32), generator=gen, device=DEV) * 32**-0.25 for c in ctx_lens]
    q_last = torch.stack([qs[-1] for qs in queries])
    decode = invariant_decode_attention(q_last, case.k_cache, case.v_cache, case.block_tables, case.context_lens,
                                        0.5, window, num_programs=4, **SMALL)
    block_q = SMALL["block_m"] // 2
    for b, (ctx, qs) in enumerate(zip(ctx_lens, queries, strict=True)):
        for cuts in ([0, ctx], [0, ctx // 3, ctx - ctx // 4, ctx]):
            last = last_of_schedule(qs, case, b, cuts, 0.5, window, **SMALL)
            if not INTERPRETED or (ctx - 1 - cuts[-2]) % block_q == 0:
                assert torch.equal(last, decode[b]), (ctx, cuts)
            else:
                torch.testing.assert_close(last, decode[b], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", [None, 40])
def test_the_fold_in_the_split_launch_and_in_a_second_launch_give_the_same_bits(
        monkeypatch: pytest.MonkeyPatch, window: int | None) -> None:
    """The kv head's last split program folds its rows (arrival counters), or past ``FUSED_FOLD_MAX_HEADS`` pairs a
    second launch folds one head a program: the same fold, so the same bits (and the counters are left at zero)."""
    q, case = decode_batch(CONTEXTS, 8, 2, 32, 8, torch.float32, window, seed=6)  # G = 4
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.5, window)
    fused = invariant_decode_attention(*args, num_programs=4, **SMALL)
    counters = idecode.arrival_counters("invariant_decode_attention", idecode.FUSED_FOLD_MAX_HEADS, q.device)
    assert not counters.any()
    monkeypatch.setattr(idecode, "FUSED_FOLD_MAX_HEADS", 0)
    assert torch.equal(fused, invariant_decode_attention(*args, num_programs=4, **SMALL))
    assert torch.equal(fused, prefill_one_token_each(q, case, 0.5, window, **SMALL))


def test_split_programs_follow_the_shapes_only() -> None:
    assert max_visible_splits(1000, None, 256) == 4
    assert max_visible_splits(100_000, 1024, 256) == 5  # a 1,024-key window starting mid-split touches 5
    assert max_visible_splits(100_000, 1025, 256) == 5 and max_visible_splits(100_000, 1026, 256) == 6
    assert max_visible_splits(300, 1024, 256) == 2
    assert num_split_programs(1, 8, 5) == 5 and num_split_programs(1, 2, 1000) == 64
    assert num_split_programs(64, 8, 5) == 1 and num_split_programs(64, 2, 16) == 3


def test_split_keys_must_be_whole_tiles() -> None:
    q, case = decode_batch([5], 4, 2, 32, 8, torch.float32, None)
    with pytest.raises(ValueError, match="multiple of the key tile"):
        invariant_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.5, None,
                                   block_n=16, split_keys=24)


# ---------------------------------------------------------------------------------------- GPU, real shapes

# (num_heads, num_kv_heads, head_dim, window): Gemma 4 sliding and full layers, Qwen3-30B-A3B.
GPU_LAYERS = [(16, 8, 256, 1024), (16, 2, 512, None), (32, 4, 128, None)]
GPU_CONTEXTS = [0, 1, 255, 256, 257, 511, 512, 513, 540, 1023, 1025, 1300, 2100, 4097]


@pytest.mark.gpu
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "window"), GPU_LAYERS)
@pytest.mark.parametrize("num_programs", [None, 1, 3, 64])
def test_gpu_decode_gives_the_aligned_prefill_bits(num_heads: int, num_kv_heads: int, head_dim: int,
                                                   window: int | None, num_programs: int | None) -> None:
    q, case = decode_batch(GPU_CONTEXTS, num_heads, num_kv_heads, head_dim, 16, torch.bfloat16, window)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, head_dim**-0.5, window)
    out = invariant_decode_attention(*args, num_programs=num_programs, max_context_len=8192)
    assert torch.equal(out, prefill_one_token_each(q, case, head_dim**-0.5, window))
    assert_close(out, ref_paged_decode_attention(*args), torch.bfloat16)
    for b in range(len(GPU_CONTEXTS)):
        alone = invariant_decode_attention(q[b:b + 1], case.k_cache, case.v_cache, case.block_tables[b:b + 1],
                                           case.context_lens[b:b + 1], head_dim**-0.5, window, max_context_len=8192)
        assert torch.equal(alone[0], out[b]), GPU_CONTEXTS[b]


@pytest.mark.gpu
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "window"), GPU_LAYERS)
def test_gpu_decode_gives_the_bits_of_the_prompt_prefilled_in_chunks(num_heads: int, num_kv_heads: int,
                                                                     head_dim: int, window: int | None) -> None:
    ctx_lens = [257, 540, 1025, 2100]
    case = build_paged(ctx_lens, num_kv_heads, head_dim, 16, torch.bfloat16, seed=2, kv_std=head_dim**-0.25)
    gen = torch.Generator(device=DEV).manual_seed(3)
    queries = [(torch.randn((c, num_heads, head_dim), generator=gen, device=DEV) * head_dim**-0.25).to(torch.bfloat16)
               for c in ctx_lens]
    decode = invariant_decode_attention(torch.stack([qs[-1] for qs in queries]), case.k_cache, case.v_cache,
                                        case.block_tables, case.context_lens, 1.0, window)
    for b, (ctx, qs) in enumerate(zip(ctx_lens, queries, strict=True)):
        for cuts in ([0, ctx], [0, 100, 300 if ctx > 300 else 200, ctx], [0, ctx - 1, ctx]):
            last = last_of_schedule(qs, case, b, cuts, 1.0, window)
            assert torch.equal(last, decode[b]), (ctx, cuts)


@pytest.mark.gpu
def test_gpu_decode_replays_in_a_cuda_graph() -> None:
    """Captured once with static buffers (the workspace from the shapes), replayed with new lengths: the same bits
    as eager calls, so nothing in the wrapper syncs with the host or depends on the lengths."""
    num_heads, num_kv_heads, head_dim = 16, 2, 512
    q, case = decode_batch([4096] * 4, num_heads, num_kv_heads, head_dim, 16, torch.bfloat16, None)
    ctx_static = case.context_lens.clone()
    out = torch.empty_like(q)
    args = (q, case.k_cache, case.v_cache, case.block_tables, ctx_static, head_dim**-0.5, None)
    invariant_decode_attention(*args, out=out, max_context_len=4096)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        invariant_decode_attention(*args, out=out, max_context_len=4096)
    for lens in ([1, 17, 4096, 300], [4096, 2048, 1, 0], [256, 257, 512, 3000]):
        ctx_static.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, invariant_decode_attention(*args, max_context_len=4096))


_COMPILE = '''
    import triton
    from triton.backends.compiler import GPUTarget

    from inference_server.kernels.invariant_decode_attention import _fold_splits_kernel, _split_decode_kernel
    from inference_server.kernels.prefill_attention import _paged_prefill_kernel, _value_slices, tile_config

    target = GPUTarget("cuda", 90, 64)
    types = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "block_tables_ptr": "*i32",
             "context_lens_ptr": "*i32", "cu_seqlens_q_ptr": "*i32", "out_ptr": "*bf16", "part_m_ptr": "*fp32",
             "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32", "counter_ptr": "*i32", "qk_scale": "fp32"}

    def compiled(fn, constexprs, warps, stages):
        signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
        aligned = [n for n in fn.arg_names if n.endswith("_ptr") or n.startswith("stride_") and n != "stride_btb"]
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned if n not in constexprs}
        kernel = triton.compile(source(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                target=target, options=dict(num_warps=warps, num_stages=stages))
        assert kernel.metadata.shared <= 232448, (fn.__name__, constexprs, kernel.metadata.shared)
        return kernel

    # Gemma 4 sliding (G 2, D 256) and full (G 8, D 512) layers, Gemma-4-E4B's (G 4), Qwen3-30B-A3B (G 8, D 128)
    for group, head_dim in ((2, 256), (8, 512), (4, 256), (4, 512), (8, 128)):
        # the default prefill's long-chunk tiles fit too (at head_dim 512 with their value slices)
        fast_m, fast_n, fast_warps, fast_stages = tile_config(head_dim, group, small_tiles=False)
        compiled(_paged_prefill_kernel, dict(PAGE=16, G=group, D=head_dim, BLOCK_D=head_dim, BLOCK_M=fast_m,
                                             BLOCK_N=fast_n, BLOCK_Q=fast_m // group, DOT_PRECISION="tf32",
                                             UPCAST=False, ALIGN_KV=False, SPLIT_KEYS=256,
                                             SLICES=_value_slices(head_dim, small_tiles=False)), fast_warps,
                 fast_stages)
        block_m, block_n, warps, stages = tile_config(head_dim, group)
        tiles = dict(PAGE=16, G=group, D=head_dim, BLOCK_D=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
                     SPLIT_KEYS=256, DOT_PRECISION="tf32", UPCAST=False)
        compiled(_split_decode_kernel, dict(tiles, FUSED_FOLD=False, BLOCK_R=group), warps, stages)
        fused = compiled(_split_decode_kernel, dict(tiles, FUSED_FOLD=True, BLOCK_R=group), warps, stages)
        assert "atom" in fused.asm["ptx"] and "fma.rn.f32" in fused.asm["ptx"]
        compiled(_paged_prefill_kernel, dict(tiles, BLOCK_Q=block_m // group, ALIGN_KV=True, SLICES=1), warps, stages)
        fold = compiled(_fold_splits_kernel, dict(D=head_dim, BLOCK_D=head_dim, SPLIT_KEYS=256), 4, 2)
        assert "fma.rn.f32" in fold.asm["ptx"]
    print("compiled")
'''


def test_split_decode_and_aligned_prefill_compile_for_sm90() -> None:
    """Both kernels and the fold compile for the H200 at the served head sizes (the interpreter accepts code the
    compiler rejects) within its shared memory, with the fold's explicit fmas; so does the default prefill with its
    larger tiles."""
    from .test_kernels_compile_for_h200 import _compile_in_child

    _compile_in_child(textwrap.dedent(_COMPILE))
