"""The output epilogue of the weight-streaming linear kernels (``streamed_linear``'s tensor-core kernel and
``int8_gemv``'s CUDA-core GEMV): both compute a ``[BLOCK_N, BLOCK_T]`` tile of ``y.T`` in fp32 and hand it over
in the same form, so both feed the same split-K reduce kernel."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_streamed_tile(acc, out_ptr, scale_ptr, offs_t, t_ok, offs_n, N, pid_s, stride_os, stride_ot,
                        stride_scale, SPLIT_K: tl.constexpr, HAS_SCALE: tl.constexpr):
    """Store ``acc [BN, BT]`` (fp32 sums for weight rows ``offs_n`` and tokens ``offs_t``): with one split, times
    the row's scale (``HAS_SCALE``: once, after the reduction) and rounded to the output's dtype at ``out[t, n]``;
    with ``SPLIT_K`` splits, as the fp32 partial sums of split ``pid_s`` (``out`` is then ``[SPLIT_K, T, N]``),
    which the reduce kernel adds in a fixed order and scales. Rows past ``N`` and tokens past ``T`` are masked."""
    out_mask = (offs_n < N)[:, None] & t_ok[None, :]
    o_ptrs = out_ptr + offs_t.to(tl.int64)[None, :] * stride_ot + offs_n[:, None]
    if SPLIT_K == 1:
        if HAS_SCALE:
            acc = acc * tl.load(scale_ptr + (offs_n % N) * stride_scale).to(tl.float32)[:, None]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(o_ptrs + pid_s.to(tl.int64) * stride_os, acc, mask=out_mask)
