"""The CUDA-core path of ``int8_linear`` for a few tokens: an int8 weight GEMV with fp32 FMAs, no tensor cores.

At decode (1-8 tokens) the tensor-core kernel of ``int8_linear`` pads the tokens to 16 and converts every weight
byte to bf16 for the dot; the conversion instruction, not HBM, limits it (``int8_dequant``). This kernel dequantises
with the exponent trick straight to fp32 and multiplies on the CUDA cores: per weight byte a zero-extend, a logic
op, a float add and one FMA per token, all at full rate. It is selected by a config whose ``block_t`` is below 16
(the dot's smallest token tile), so tuned config files choose between the two paths per shape and token count.

Same contract and output layout as ``int8_linear._int8_linear_kernel`` (fp32 accumulation, the scale applied once
after the reduction; with ``SPLIT_K > 1`` fp32 partial sums that ``int8_linear``'s reduce kernel adds in a fixed
order), so the two paths differ only in the order of the fp32 sums.
"""

from __future__ import annotations

import triton
import triton.language as tl

from inference_server.kernels.int8_dequant import int8_to_fp32_exact
from inference_server.kernels.pdl import pdl_release, pdl_wait
from inference_server.kernels.streamed_tile import store_streamed_tile


@triton.jit(do_not_specialize=["T"])
def int8_gemv_kernel(
    x_ptr,  # [T, K] activations
    w_ptr,  # [N, K] int8
    scale_ptr,  # [N] per-output-channel scale
    out_ptr,  # SPLIT_K == 1: [T, N] in x's dtype; else [SPLIT_K, T, N] fp32 partial sums
    T,
    N,
    K,
    k_per_split,  # K columns per split, a multiple of BLOCK_K (K when SPLIT_K == 1)
    stride_xt,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_scale,
    stride_os,  # between splits of the partial sums (unused when SPLIT_K == 1)
    stride_ot,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tokens per program: each dequantised weight tile is used BLOCK_T times
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # every split's K range is a whole number of BLOCK_K tiles: no K masks
    USE_PDL: tl.constexpr = False,  # kernels.pdl: launched as a programmatic dependent
):
    # PDL (kernels.pdl): as streamed_linear's kernel: x comes from the previous launch and the output may still be
    # read by an earlier one, so wait before the first load.
    pdl_wait(USE_PDL)
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    t_ok = offs_t < T
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_n_safe = offs_n % N  # in-bounds weight loads without masks; the store is masked
    offs_k = tl.arange(0, BLOCK_K)
    k_start = pid_s * k_per_split
    k_len = tl.minimum(K - k_start, k_per_split)
    w_ptrs = w_ptr + offs_n_safe.to(tl.int64)[:, None] * stride_wn + (k_start + offs_k)[None, :] * stride_wk
    x_ptrs = x_ptr + offs_t.to(tl.int64)[:, None] * stride_xt + (k_start + offs_k)[None, :] * stride_xk
    # Triton pipelines only the loads that feed a dot, so the loop prefetches by hand: the next tile's loads are
    # issued before this tile's arithmetic, keeping two tiles of every program in flight.
    n_tiles = tl.cdiv(k_len, BLOCK_K)
    if EVEN_K:
        w = tl.load(w_ptrs)  # [BN, BK] int8
        x = tl.load(x_ptrs, mask=t_ok[:, None], other=0.0)  # [BT, BK]
    else:
        k_ok = offs_k < k_len
        w = tl.load(w_ptrs, mask=k_ok[None, :], other=0)
        x = tl.load(x_ptrs, mask=t_ok[:, None] & k_ok[None, :], other=0.0)
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for kb in range(0, n_tiles):
        w_ptrs += BLOCK_K * stride_wk
        x_ptrs += BLOCK_K * stride_xk
        if EVEN_K:  # a uniform mask keeps the loads vectorised
            more = tl.zeros((1, BLOCK_K), tl.int32) + (kb + 1) < n_tiles  # uniform; False past the last tile
            w_next = tl.load(w_ptrs, mask=more, other=0)
            x_next = tl.load(x_ptrs, mask=t_ok[:, None] & more, other=0.0)
        else:
            k_next = offs_k < k_len - (kb + 1) * BLOCK_K
            w_next = tl.load(w_ptrs, mask=k_next[None, :], other=0)
            x_next = tl.load(x_ptrs, mask=t_ok[:, None] & k_next[None, :], other=0.0)
        wf = int8_to_fp32_exact(w)  # [BN, BK] fp32, exact
        acc += tl.sum(wf[:, None, :] * x.to(tl.float32)[None, :, :], axis=2)  # [BN, BT]
        w = w_next
        x = x_next
    # Release after the main loop: only the epilogue is left, so the next launch's CTAs (resident from here on,
    # waiting) do not take shared memory and registers while this kernel's programs still stream their tiles.
    pdl_release(USE_PDL)
    store_streamed_tile(acc, out_ptr, scale_ptr, offs_t, t_ok, offs_n, N, pid_s, stride_os, stride_ot, stride_scale,
                        SPLIT_K, True)
