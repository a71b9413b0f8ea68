"""The CUDA-core path of ``streamed_linear`` for a few tokens: a weight-streaming GEMV with fp32 FMAs, no tensor
cores, for int8 weights (``int8_linear``) and float weights (``dense_linear``).

At decode (1-4 tokens) the tensor-core kernel pads the tokens to 16 and, for int8, converts every weight byte to
bf16 for the dot, which costs more issue slots per byte than streaming HBM at its limit leaves an SM. This kernel
spends per int8 weight byte one byte permute (the byte lands in the mantissa of ``2**23``: the exponent trick of
``int8_dequant``), one float add, one FMA per token, and a quarter of a logic op (the word's sign bits are flipped
once per four bytes):

* int8 weights are read as 32-bit words, each giving four weight columns ``4j .. 4j+3``; the activations are
  split the same way (``tl.split``), so no value crosses threads in the loop. A thread reads two words (8
  columns) of each of its rows a load: its 16-byte activation load holds 8 bf16 columns, and Triton keeps the
  two in one thread only when their column counts agree and the tile has at least ``256 x num_warps`` columns
  (else it exchanges them through shared memory every tile);
* one fp32 accumulator ``[BLOCK_N, BLOCK_K / 4]`` per token (``BLOCK_T`` <= 4), summed over K once after the
  loop: the loop has no shuffles and no shared memory;
* the next tile's loads are issued before this tile's arithmetic (Triton pipelines only loads that feed a dot);
  with whole K tiles (``EVEN_K``) no load is masked: tokens past ``T`` read the last token's row and the last
  prefetch re-reads its own tile, so no predicates or zero fills. A config's ``num_stages`` of 2 (whole K tiles
  only) loads the weight tiles two iterations ahead (``DEEP``): twice the bytes in flight a program, for shapes
  whose programs an SM holds too few of to cover HBM's latency with one tile each (x, read from L2 by every
  program, stays one tile ahead).

Past two tokens the tensor-core kernel, whose instructions per byte do not grow with the token count, is the
better choice (docs/benchmarks.md).

With bf16 activations (every GPU model) the int8 words skip that conversion (``INT_DOT``,
``kernels/int8_fixed_dot.py``): each word of four activations becomes 16-bit fixed point once per program and tile,
shared by all its weight rows, and a row's word costs two ``dp2a`` integer dot products, one conversion and one FMA. The
price is the fixed point's rounding of activations far below their word's largest (at most ``2**-15`` of it;
``tests/kernels/reference_fixed_point.py`` is the oracle); fp32 activations keep the float products.

Float weights (bf16, fp16, fp32; ``HAS_SCALE`` False) take the same loop without the dequantisation: each
element is widened to fp32 and multiplied exactly. Products are exact in fp32 (an FMA rounds only the sum), so
the contract is the tensor-core kernel's: fp32 accumulation of exact products; the outputs differ from it only in
the order of the fp32 sums. Output layout and split-K partial sums are ``store_streamed_tile``'s, so the same
reduce kernel adds the splits.

Selected by a config whose ``block_t`` is below 16 (the dot's smallest token tile), so tuned config files choose
between the two paths per shape and token count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from inference_server.kernels.gated_activation import gated_product
from inference_server.kernels.int8_dequant import (
    fma_words,
    int8_to_fp32_exact,
    int8_words_view,
    word_pair_offsets,
    words_to_fp32_exact,
)
from inference_server.kernels.int8_fixed_dot import fixed_point_dot, takes_fixed_point
from inference_server.kernels.pdl import pdl_launch, pdl_release_after_loop, pdl_release_after_wait, pdl_wait
from inference_server.kernels.streamed_tile import store_streamed_tile

__all__ = ["GATED_ACTIVATIONS", "NORM_ADD_FIRST", "NORM_SANDWICH", "GemvLaunch", "check_gemv_weight", "gemv_arguments",
           "gemv_outputs", "gemv_program", "int8_gemv_kernel", "launch_gemv"]


@triton.jit
def _split4(t, ROWS: tl.constexpr, WORDS: tl.constexpr):
    """``t [ROWS, 4 * WORDS]`` as four ``[ROWS, WORDS]`` tensors: columns ``4j``, ``4j+1``, ``4j+2``, ``4j+3``
    (each thread's contiguous elements stay in its registers)."""
    even, odd = tl.split(tl.reshape(t, (ROWS, WORDS, 2, 2)))  # last axis: column parity
    t0, t2 = tl.split(even)
    t1, t3 = tl.split(odd)
    return t0, t1, t2, t3


@triton.jit
def _weights_fp32(w, BLOCK_N: tl.constexpr, WORDS: tl.constexpr, W_WORDS: tl.constexpr, HAS_SCALE: tl.constexpr,
                  PRMT: tl.constexpr):
    """A loaded weight tile as four fp32 ``[BLOCK_N, WORDS]`` tensors (columns 4j+i), exactly."""
    if W_WORDS:  # int8 packed four to an int32 word: [BN, WORDS]
        w0, w1, w2, w3 = words_to_fp32_exact(w, PRMT)
    else:  # one element per column: [BN, 4 * WORDS]
        w0, w1, w2, w3 = _split4(w, BLOCK_N, WORDS)
        if HAS_SCALE:  # int8 elements
            w0, w1, w2, w3 = (int8_to_fp32_exact(w0), int8_to_fp32_exact(w1), int8_to_fp32_exact(w2),
                              int8_to_fp32_exact(w3))
        else:
            w0, w1, w2, w3 = w0.to(tl.float32), w1.to(tl.float32), w2.to(tl.float32), w3.to(tl.float32)
    return w0, w1, w2, w3


@triton.jit
def _token_row(x_ptrs, row, stride_xt, k_ok, EVEN_K: tl.constexpr):
    """Row ``row`` of the activation tile at ``x_ptrs``: unmasked with ``EVEN_K`` (the caller keeps every address
    in bounds), else zeros outside ``k_ok``."""
    if EVEN_K:
        return tl.load(x_ptrs + row * stride_xt)
    return tl.load(x_ptrs + row * stride_xt, mask=k_ok, other=0.0)


NORM_SANDWICH = 1
"""``gemv_program``'s ``NORM_IN`` for a Gemma sandwich norm's ``y = residual + norm(x; wa) [* s]``
(``kernels.norm_add``)."""
NORM_ADD_FIRST = 2
"""``gemv_program``'s ``NORM_IN`` for a pre-norm after the residual add: ``norm(residual + x; wa)``, qwen convention
(``kernels.rmsnorm.fused_add_rmsnorm``)."""


@triton.jit
def _inverse_root(a_ptr, r_ptr, cols, mask, K, eps, NORM_IN: tl.constexpr):
    """NORM_IN's prologue for one token: ``rsqrt(mean(v * v) + eps)`` in fp32 of the row the norm reads: the row
    ``a_ptr[:K]`` itself (``NORM_SANDWICH``, ``kernels.norm_add``'s gemma norm), or ``h = a + r`` of its row and the
    residual's ``r_ptr[:K]``, rounded to a's dtype (``NORM_ADD_FIRST``, ``kernels.rmsnorm.fused_add_rmsnorm``)."""
    a = tl.load(a_ptr + cols, mask=mask, other=0.0)
    if NORM_IN == 2:
        a = (a.to(tl.float32) + tl.load(r_ptr + cols, mask=mask, other=0.0).to(tl.float32)).to(a.dtype)
    a = a.to(tl.float32)
    return tl.rsqrt(tl.sum(a * a, axis=0) / K + eps)


@triton.jit
def _norm_tile(a, r, wa, inv, s, NORM_IN: tl.constexpr, HAS_S: tl.constexpr):
    """NORM_IN's activation tile, as ``(stored, read)``: the tile of the residual stream's new value the first row
    block stores, and the tile the GEMV multiplies, each built from a's and the residual's tiles (``r``), the norm
    weight's (``wa``, fp32) and the token's inverse root ``inv`` with the unfused kernels' arithmetic and roundings:

    * ``NORM_SANDWICH`` (1): ``y = residual + norm(a; wa) [* s]`` both stored and read (``kernels.norm_add``'s
      gemma norm, each op rounded to a's dtype);
    * ``NORM_ADD_FIRST`` (2): ``h = residual + a`` stored, ``wa * (h * inv).to(dtype)`` read
      (``kernels.rmsnorm.fused_add_rmsnorm``'s add, then its qwen norm: cast first, then the weight)."""
    if NORM_IN == 2:
        h = (a.to(tl.float32) + r.to(tl.float32)).to(a.dtype)
        return h, ((h.to(tl.float32) * inv).to(a.dtype).to(tl.float32) * wa).to(a.dtype)
    y = (r.to(tl.float32) + (a.to(tl.float32) * inv * wa).to(a.dtype).to(tl.float32)).to(a.dtype)
    if HAS_S:
        y = (y.to(tl.float32) * s).to(a.dtype)
    return y, y


@triton.jit
def gemv_program(
    pid_t,  # this program's token block
    pid_n,  # its row block
    pid_s,  # its K split
    x_ptr,  # [T, K] activations
    w_ptr,  # [N, K] int8 or float elements; W_WORDS: [N, K / 4] int32 words of four int8 columns
    scale_ptr,  # [N] per-output-channel scale (HAS_SCALE; else any pointer, unread)
    out_ptr,  # SPLIT_K == 1: [T, N] in x's dtype; else [SPLIT_K, T, N] fp32 partial sums
    T,
    N,
    K,  # columns (elements, not words)
    k_per_split,  # K columns per split, a multiple of BLOCK_K (K when SPLIT_K == 1)
    stride_xt,
    stride_xk,
    stride_wn,  # in w_ptr's elements (words when W_WORDS)
    stride_wk,  # unused when W_WORDS (words are contiguous)
    stride_scale,
    stride_os,  # between splits of the partial sums (unused when SPLIT_K == 1)
    stride_ot,
    half,  # GATED with paired rows: the gate rows (I); the up rows start there (unused otherwise)
    up_ptr,  # GATED with UP_IN_MEMORY: [T, N] the up factor (else any pointer, unread)
    stride_ut,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tokens per program, 1 to 4: each dequantised weight tile is used BLOCK_T times
    BLOCK_K: tl.constexpr,  # columns per tile, a multiple of 4
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # every split's K range is a whole number of BLOCK_K tiles: no K masks
    HAS_SCALE: tl.constexpr = True,  # int8 weights (times the row's scale); False: float weights
    W_WORDS: tl.constexpr = False,  # int8 weights read as int32 words (K % 8 == 0, contiguous rows)
    PRMT: tl.constexpr = False,  # W_WORDS: bytes placed by the PTX byte permute (compiled only; not interpreted)
    USE_PDL: tl.constexpr = False,  # kernels.pdl: launched as a programmatic dependent
    GATED: tl.constexpr = 0,  # 0: y = x @ W.T; 1: act(gate) * up with gelu_tanh, 2: with silu (see gated_gemv)
    UP_IN_MEMORY: tl.constexpr = False,  # GATED: up read from up_ptr (W is the gate alone), not W's second half
    LIBDEVICE_TANH: tl.constexpr = True,  # GATED gelu_tanh: False only under the interpreter
    DEEP: tl.constexpr = False,  # EVEN_K only: weight tiles loaded two iterations ahead (a config's num_stages 2)
    INT_DOT: tl.constexpr = False,  # W_WORDS with bf16 activations: integer dot products (int8_fixed_dot)
    NORM_IN: tl.constexpr = 0,  # 1 (NORM_SANDWICH) or 2 (NORM_ADD_FIRST): x's rows are normed here (_norm_tile)
    res_ptr=None,  # NORM_IN: [T, K] the residual stream (contiguous last dim)
    stride_rt=0,
    wa_ptr=None,  # NORM_IN: [K] the norm's weight (fp32 or x's dtype)
    s_ptr=None,  # NORM_SANDWICH with HAS_S: one element, the scale applied last
    y_ptr=None,  # NORM_IN: [T, K] the residual stream's new value, stored by the first row block's programs
    stride_yt=0,
    eps_a=0.0,
    HAS_S: tl.constexpr = False,
    NORM_BLOCK: tl.constexpr = 1,  # NORM_IN: K padded to a power of two (the prologue's whole rows)
):
    """One program of ``int8_gemv_kernel`` (the module docstring's loop), at the given program coordinates: the
    kernel runs it at its grid's, and kernels that share a launch with other work (``kernels.mlp_beside_experts``)
    at coordinates of their own.

    With ``NORM_IN`` the activations are a norm's output, computed here instead of in a launch of its own: a Gemma
    sandwich norm's ``y = residual + norm(x; wa) [* s]`` (``NORM_SANDWICH``, read and stored), or a pre-norm's
    ``norm(residual + x; wa)`` (``NORM_ADD_FIRST``, read; ``residual + x`` stored), per token row. Every program
    first reduces its tokens' whole rows to their inverse roots (L2-resident rows, a few KB), the first row block's
    programs of split 0 store the residual stream's new value, and the K loop builds each activation tile from the
    x, residual and weight tiles with the same arithmetic (``_norm_tile``)."""
    tl.static_assert(BLOCK_T <= 4, "the CUDA-core GEMV keeps one accumulator per token, at most 4")
    tl.static_assert(W_WORDS or not INT_DOT, "the integer dot reads int8 words")
    tl.static_assert(EVEN_K or not DEEP, "the two-ahead weight loads need whole K tiles")
    tl.static_assert(NORM_IN == 1 or not HAS_S, "the scale is the sandwich norm's")
    WORDS: tl.constexpr = BLOCK_K // 4
    t0 = pid_t * BLOCK_T  # this program's first token
    HALF_N: tl.constexpr = BLOCK_N // 2  # GATED with paired rows: outputs a program
    if GATED and not UP_IN_MEMORY:
        # [gate; up] weight rows ([2I, K]): the program's first BLOCK_N / 2 rows are gate rows j, the rest the up
        # rows I + j of the same outputs j, so the epilogue has both factors of its outputs.
        r = tl.arange(0, BLOCK_N)
        offs_n = pid_n * HALF_N + r % HALF_N  # [BN] the output column each row feeds
        offs_n_safe = tl.minimum(offs_n, half - 1) + (r // HALF_N) * half  # in bounds; the store is masked
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        offs_n_safe = offs_n % N  # in-bounds weight loads without masks; the store is masked
    offs_k = tl.arange(0, BLOCK_K)
    k_start = pid_s * k_per_split
    k_len = tl.minimum(K - k_start, k_per_split)
    if W_WORDS:
        # Two words (8 columns) per thread and load, not the four a 16-byte load would take: a thread's 16-byte
        # load of bf16 activations holds 8 columns, and the weight columns must lie in the same thread as theirs.
        offs_w, first_col = word_pair_offsets(WORDS)
        w_ptrs = w_ptr + offs_n_safe.to(tl.int64)[:, None] * stride_wn + (k_start // 4 + offs_w)[None, :]
        w_step = WORDS
        # The K-tail mask per pair of words (first_col; K is a multiple of 8 on this path, so a pair is all in or
        # all out): constant over each thread's two words, it keeps the masked loads 8 bytes wide.
    else:
        offs_w = offs_k
        w_ptrs = w_ptr + offs_n_safe.to(tl.int64)[:, None] * stride_wn + (k_start + offs_k)[None, :] * stride_wk
        w_step = BLOCK_K * stride_wk
        first_col = offs_k
    x_ptrs = x_ptr + t0.to(tl.int64) * stride_xt + (k_start + offs_k) * stride_xk  # the first token's row
    # Tokens past T read the last token's row (in bounds, no mask); their accumulators are never stored.
    row1 = tl.minimum(t0 + 1, T - 1) - t0
    row2 = tl.minimum(t0 + 2, T - 1) - t0
    row3 = tl.minimum(t0 + 3, T - 1) - t0
    n_tiles = tl.cdiv(k_len, BLOCK_K)
    # Loads of tile 0; in the loop, the next tile's loads go out before this tile's arithmetic, so two tiles of
    # every program are in flight. With EVEN_K no load is masked: the last iteration's prefetch re-reads its own
    # tile (the pointers stop advancing), so no predicate or zero fill is spent per load.
    w_ok = first_col < k_len
    k_ok = offs_k < k_len
    if EVEN_K:
        w = tl.load(w_ptrs)
    else:
        w = tl.load(w_ptrs, mask=w_ok[None, :], other=0)
    w_ahead = w  # DEEP: the tile after the next one, loaded an iteration early (unused otherwise)
    if DEEP:  # tile 1 (tile 0 again when there is one tile): w_ptrs then runs two tiles ahead of the arithmetic
        w_ptrs += (n_tiles > 1).to(tl.int32) * w_step
        w_ahead = tl.load(w_ptrs)
    # NORM_IN: the norm weight's first tile and the scale are weights too, loaded here; without NORM_IN these names
    # are placeholders the compiler drops.
    r_ptrs = x_ptrs  # NORM_IN: the residual's tile, advanced with x's
    wa_ptrs = x_ptrs
    y_ptrs = x_ptrs  # NORM_IN: y's tile of the current iteration
    wa_t = 1.0
    s = 1.0
    if NORM_IN:
        r_ptrs = res_ptr + t0.to(tl.int64) * stride_rt + (k_start + offs_k)
        y_ptrs = y_ptr + t0.to(tl.int64) * stride_yt + (k_start + offs_k)
        wa_ptrs = wa_ptr + (k_start + offs_k)
        wa_t = _token_row(wa_ptrs, 0, 0, k_ok, EVEN_K).to(tl.float32)
        if HAS_S:
            s = tl.load(s_ptr).to(tl.float32)
    # PDL (kernels.pdl): the first weight tiles are loaded before the wait, the one read the invariant allows there
    # (weights are never written during a step; the loads' addresses depend on shapes only). A program made
    # resident while its predecessor drains has its first tiles on the way, so the HBM latency of the kernel's
    # start overlaps the predecessor's tail. x comes from the previous launch and the output may still be read by
    # an earlier one, so every other load and every store is after the wait.
    pdl_wait(USE_PDL)
    pdl_release_after_wait(USE_PDL)
    inv0 = 1.0  # NORM_IN: each token's inverse root of mean(x * x) + eps_a
    inv1 = 1.0
    inv2 = 1.0
    inv3 = 1.0
    if NORM_IN:
        # Every program reduces its tokens' whole rows of x (its sums need all of K; the rows come from L2).
        norm_cols = tl.arange(0, NORM_BLOCK)
        norm_mask = norm_cols < K
        a_row = x_ptr + t0.to(tl.int64) * stride_xt
        r_row = res_ptr + t0.to(tl.int64) * stride_rt
        inv0 = _inverse_root(a_row, r_row, norm_cols, norm_mask, K, eps_a, NORM_IN)
        if BLOCK_T > 1:
            inv1 = _inverse_root(a_row + row1 * stride_xt, r_row + row1 * stride_rt, norm_cols, norm_mask, K, eps_a,
                                 NORM_IN)
        if BLOCK_T > 2:
            inv2 = _inverse_root(a_row + row2 * stride_xt, r_row + row2 * stride_rt, norm_cols, norm_mask, K, eps_a,
                                 NORM_IN)
        if BLOCK_T > 3:
            inv3 = _inverse_root(a_row + row3 * stride_xt, r_row + row3 * stride_rt, norm_cols, norm_mask, K, eps_a,
                                 NORM_IN)
    x0 = _token_row(x_ptrs, 0, stride_xt, k_ok, EVEN_K)
    if BLOCK_T > 1:
        x1 = _token_row(x_ptrs, row1, stride_xt, k_ok, EVEN_K)
    if BLOCK_T > 2:
        x2 = _token_row(x_ptrs, row2, stride_xt, k_ok, EVEN_K)
    if BLOCK_T > 3:
        x3 = _token_row(x_ptrs, row3, stride_xt, k_ok, EVEN_K)
    # NORM_IN: the residual's tiles, loaded (and prefetched) beside x's; y's tile is built where the arithmetic
    # reads it, so the prefetches stay loads in flight
    r0 = x0
    r1 = x0
    r2 = x0
    r3 = x0
    if NORM_IN:
        r0 = _token_row(r_ptrs, 0, stride_rt, k_ok, EVEN_K)
        if BLOCK_T > 1:
            r1 = _token_row(r_ptrs, row1, stride_rt, k_ok, EVEN_K)
        if BLOCK_T > 2:
            r2 = _token_row(r_ptrs, row2, stride_rt, k_ok, EVEN_K)
        if BLOCK_T > 3:
            r3 = _token_row(r_ptrs, row3, stride_rt, k_ok, EVEN_K)
    acc0 = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
    for kb in range(0, n_tiles):
        if EVEN_K:
            more = (kb + 1 < n_tiles).to(tl.int32)  # 0 on the last iteration: the prefetch stays in bounds
            x_ptrs += more * (BLOCK_K * stride_xk)
            if NORM_IN:
                r_ptrs += more * BLOCK_K
                wa_ptrs += more * BLOCK_K
            if DEEP:  # tile kb + 2 (clamped to the last), two iterations before its arithmetic
                w_ptrs += (kb + 2 < n_tiles).to(tl.int32) * w_step
                w_next = w_ahead
                w_ahead = tl.load(w_ptrs)
            else:
                w_ptrs += more * w_step
                w_next = tl.load(w_ptrs)
        else:
            w_ptrs += w_step
            x_ptrs += BLOCK_K * stride_xk
            if NORM_IN:
                r_ptrs += BLOCK_K
                wa_ptrs += BLOCK_K
            rest = k_len - (kb + 1) * BLOCK_K
            k_ok = offs_k < rest
            w_next = tl.load(w_ptrs, mask=(first_col < rest)[None, :], other=0)
        x0_next = _token_row(x_ptrs, 0, stride_xt, k_ok, EVEN_K)
        if BLOCK_T > 1:
            x1_next = _token_row(x_ptrs, row1, stride_xt, k_ok, EVEN_K)
        if BLOCK_T > 2:
            x2_next = _token_row(x_ptrs, row2, stride_xt, k_ok, EVEN_K)
        if BLOCK_T > 3:
            x3_next = _token_row(x_ptrs, row3, stride_xt, k_ok, EVEN_K)
        if NORM_IN:
            wa_next = _token_row(wa_ptrs, 0, 0, k_ok, EVEN_K).to(tl.float32)
            r0_next = _token_row(r_ptrs, 0, stride_rt, k_ok, EVEN_K)
            if BLOCK_T > 1:
                r1_next = _token_row(r_ptrs, row1, stride_rt, k_ok, EVEN_K)
            if BLOCK_T > 2:
                r2_next = _token_row(r_ptrs, row2, stride_rt, k_ok, EVEN_K)
            if BLOCK_T > 3:
                r3_next = _token_row(r_ptrs, row3, stride_rt, k_ok, EVEN_K)
            # this tile of the residual stream's new value; the first row block's split-0 programs store it (vector
            # predicates: the interpreter rejects a scalar bool combined with a vector mask)
            y_ok = ((kb * BLOCK_K + offs_k) < k_len) & ((offs_k * 0 + pid_n + pid_s) == 0)
            y0, x0 = _norm_tile(x0, r0, wa_t, inv0, s, NORM_IN, HAS_S)
            tl.store(y_ptrs, y0, mask=y_ok)
            if BLOCK_T > 1:
                y1, x1 = _norm_tile(x1, r1, wa_t, inv1, s, NORM_IN, HAS_S)
                tl.store(y_ptrs + row1 * stride_yt, y1, mask=y_ok & (offs_k * 0 + t0 + 1 < T))
            if BLOCK_T > 2:
                y2, x2 = _norm_tile(x2, r2, wa_t, inv2, s, NORM_IN, HAS_S)
                tl.store(y_ptrs + row2 * stride_yt, y2, mask=y_ok & (offs_k * 0 + t0 + 2 < T))
            if BLOCK_T > 3:
                y3, x3 = _norm_tile(x3, r3, wa_t, inv3, s, NORM_IN, HAS_S)
                tl.store(y_ptrs + row3 * stride_yt, y3, mask=y_ok & (offs_k * 0 + t0 + 3 < T))
            y_ptrs += BLOCK_K
        if INT_DOT:  # the weight words as they are; each token's activations as fixed point (int8_fixed_dot)
            acc0 = fixed_point_dot(acc0, w, x0, WORDS, PRMT)
            if BLOCK_T > 1:
                acc1 = fixed_point_dot(acc1, w, x1, WORDS, PRMT)
            if BLOCK_T > 2:
                acc2 = fixed_point_dot(acc2, w, x2, WORDS, PRMT)
            if BLOCK_T > 3:
                acc3 = fixed_point_dot(acc3, w, x3, WORDS, PRMT)
        else:
            w0, w1, w2, w3 = _weights_fp32(w, BLOCK_N, WORDS, W_WORDS, HAS_SCALE, PRMT)
            acc0 = fma_words(acc0, w0, w1, w2, w3, x0, WORDS)
            if BLOCK_T > 1:
                acc1 = fma_words(acc1, w0, w1, w2, w3, x1, WORDS)
            if BLOCK_T > 2:
                acc2 = fma_words(acc2, w0, w1, w2, w3, x2, WORDS)
            if BLOCK_T > 3:
                acc3 = fma_words(acc3, w0, w1, w2, w3, x3, WORDS)
        if BLOCK_T > 1:
            x1 = x1_next
        if BLOCK_T > 2:
            x2 = x2_next
        if BLOCK_T > 3:
            x3 = x3_next
        if NORM_IN:
            wa_t = wa_next
            r0 = r0_next
            if BLOCK_T > 1:
                r1 = r1_next
            if BLOCK_T > 2:
                r2 = r2_next
            if BLOCK_T > 3:
                r3 = r3_next
        w = w_next
        x0 = x0_next
    # Release after the main loop (kernels.pdl's mode; the other releases right after the wait): only the epilogue
    # is left, so the next launch's CTAs (resident from here on, waiting) hold no shared memory and registers while
    # this kernel's programs still stream their tiles.
    pdl_release_after_loop(USE_PDL)
    # [BN, BT]: token t's column is acc_t summed over the words (one cross-thread reduction per program)
    offs_bt = tl.arange(0, BLOCK_T)[None, :]
    out = tl.where(offs_bt == 0, tl.sum(acc0, axis=1)[:, None], 0.0)
    if BLOCK_T > 1:
        out = tl.where(offs_bt == 1, tl.sum(acc1, axis=1)[:, None], out)
    if BLOCK_T > 2:
        out = tl.where(offs_bt == 2, tl.sum(acc2, axis=1)[:, None], out)
    if BLOCK_T > 3:
        out = tl.where(offs_bt == 3, tl.sum(acc3, axis=1)[:, None], out)
    offs_t = t0 + tl.arange(0, BLOCK_T)
    if GATED:
        tl.static_assert(SPLIT_K == 1, "the gated epilogue needs whole sums")
        # Each factor as the projection's output is rounded (store_streamed_tile's order: the scale after the
        # reduction, then the cast), then the gated activation's two roundings (kernels.gated_activation).
        if HAS_SCALE:
            out = out * tl.load(scale_ptr + offs_n_safe * stride_scale).to(tl.float32)[:, None]
        out = out.to(out_ptr.dtype.element_ty).to(tl.float32)
        if UP_IN_MEMORY:
            t_ok = offs_t < T
            o_mask = (offs_n < N)[:, None] & t_ok[None, :]
            up = tl.load(up_ptr + offs_t.to(tl.int64)[None, :] * stride_ut + offs_n[:, None], mask=o_mask,
                         other=0.0).to(tl.float32)
            y = gated_product(out, up, out_ptr.dtype.element_ty, GATED == 1, LIBDEVICE_TANH)
            o_ptrs = out_ptr + offs_t.to(tl.int64)[None, :] * stride_ot + offs_n[:, None]
            tl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=o_mask)
        else:
            gate, up = tl.split(tl.permute(tl.reshape(out, (2, HALF_N, BLOCK_T)), (1, 2, 0)))  # [BN / 2, BT] each
            y = gated_product(gate, up, out_ptr.dtype.element_ty, GATED == 1, LIBDEVICE_TANH)
            offs_o = pid_n * HALF_N + tl.arange(0, HALF_N)
            o_ptrs = out_ptr + offs_t.to(tl.int64)[None, :] * stride_ot + offs_o[:, None]
            tl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=(offs_o < half)[:, None] & (offs_t < T)[None, :])
    else:
        store_streamed_tile(out, out_ptr, scale_ptr, offs_t, offs_t < T, offs_n, N, pid_s, stride_os, stride_ot,
                            stride_scale, SPLIT_K, HAS_SCALE)


@triton.jit(do_not_specialize=["T"])
def int8_gemv_kernel(  # gemv_program's parameters in its order (each documented there)
    x_ptr, w_ptr, scale_ptr, out_ptr, T, N, K, k_per_split, stride_xt, stride_xk, stride_wn, stride_wk, stride_scale,
    stride_os, stride_ot, half, up_ptr, stride_ut, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, HAS_SCALE: tl.constexpr = True, W_WORDS: tl.constexpr = False,
    PRMT: tl.constexpr = False, USE_PDL: tl.constexpr = False, GATED: tl.constexpr = 0,
    UP_IN_MEMORY: tl.constexpr = False, LIBDEVICE_TANH: tl.constexpr = True, DEEP: tl.constexpr = False,
    INT_DOT: tl.constexpr = False,
):
    gemv_program(
        tl.program_id(0), tl.program_id(1), tl.program_id(2),
        x_ptr, w_ptr, scale_ptr, out_ptr, T, N, K, k_per_split, stride_xt, stride_xk, stride_wn, stride_wk,
        stride_scale, stride_os, stride_ot, half, up_ptr, stride_ut, BLOCK_N, BLOCK_T, BLOCK_K, SPLIT_K, EVEN_K,
        HAS_SCALE, W_WORDS, PRMT, USE_PDL, GATED, UP_IN_MEMORY, LIBDEVICE_TANH, DEEP, INT_DOT,
    )  # fmt: skip


GATED_ACTIVATIONS = {"gelu_tanh": 1, "silu": 2}
"""The gated epilogue's activations and their ``GATED`` codes."""


@dataclass(frozen=True)
class GemvLaunch:
    """The arguments of one ``int8_gemv_kernel`` launch (``gemv_arguments``): ``args`` in the order of the kernel's
    runtime parameters, ``constexprs`` by name, and the launch options. Kernels that run ``gemv_program`` beside
    other work (``kernels.mlp_beside_experts``) take the same parameters under the same names."""

    args: tuple[object, ...]
    constexprs: dict[str, object]
    num_warps: int
    num_stages: int


def check_gemv_weight(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> None:
    """The weights the GEMV takes for activations ``x``: float ones of x's dtype, or int8 ones with a scale per row."""
    if scale is None and weight.dtype != x.dtype:
        raise ValueError(f"float weights must have x's dtype {x.dtype}, not {weight.dtype}")
    if scale is not None and (weight.dtype != torch.int8 or tuple(scale.shape) != (weight.shape[0],)):
        raise ValueError("int8 weights need int8 values and one scale per row")


def gemv_outputs(rows: int, block_n: int, paired: bool) -> tuple[int, int]:
    """``(outputs, outputs a program)`` of a GEMV over ``rows`` weight rows: with ``paired`` gate/up rows (the gated
    epilogue without ``up``) half of each, else all of them."""
    return (rows // 2, block_n // 2) if paired else (rows, block_n)


def gemv_arguments(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, dest: torch.Tensor,
                   k_per_split: int, stride_os: int, *, block_n: int, block_t: int, block_k: int, split_k: int,
                   num_warps: int, num_stages: int, interpreted: bool, gated: str | None = None,
                   up: torch.Tensor | None = None) -> GemvLaunch:
    """The arguments of the GEMV launch ``launch_gemv`` describes, checked (see there)."""
    T, K = x.shape
    N = weight.shape[0]
    if block_k % 4 or not 1 <= block_t <= 4:
        raise ValueError(f"the CUDA-core GEMV needs block_k a multiple of 4 and 1-4 tokens a program, not "
                         f"block_k {block_k}, block_t {block_t}")
    paired = gated is not None and up is None
    if gated is not None and (gated not in GATED_ACTIVATIONS or split_k != 1
                              or (paired and (block_n < 2 or N % 2))):
        raise ValueError(f"the gated GEMV needs an activation of {tuple(GATED_ACTIVATIONS)}, one split and, with "
                         f"paired rows, an even block_n and row count; got {gated!r}, split {split_k}, block_n "
                         f"{block_n}, N {N}")
    if up is not None and (gated is None or tuple(up.shape) != (T, N) or up.dtype != x.dtype or up.stride(-1) != 1):
        raise ValueError(f"up must come with an activation and be [{T}, {N}] {x.dtype} with a contiguous last dim")
    words = int8_words_view(weight) if scale is not None else None
    w = words if words is not None else weight
    scale_arg = scale if scale is not None else weight  # a valid pointer the kernel never reads
    up_arg = up if up is not None else x  # a valid pointer the kernel never reads
    args = (x, w, scale_arg, dest, T, N, K, k_per_split, x.stride(0), x.stride(1), w.stride(0), w.stride(1),
            scale.stride(0) if scale is not None else 0, stride_os, dest.stride(-2), N // 2, up_arg, up_arg.stride(0))
    constexprs: dict[str, object] = dict(
        BLOCK_N=block_n, BLOCK_T=block_t, BLOCK_K=block_k, SPLIT_K=split_k, EVEN_K=K % block_k == 0,
        HAS_SCALE=scale is not None, W_WORDS=words is not None, PRMT=words is not None and not interpreted,
        GATED=GATED_ACTIVATIONS[gated] if gated is not None else 0, UP_IN_MEMORY=up is not None,
        LIBDEVICE_TANH=not interpreted, DEEP=num_stages >= 2 and K % block_k == 0,
        INT_DOT=words is not None and takes_fixed_point(x.dtype),
    )
    return GemvLaunch(args, constexprs, num_warps, num_stages)


def launch_gemv(grid: tuple[int, int, int], x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
                dest: torch.Tensor, k_per_split: int, stride_os: int, *, block_n: int, block_t: int, block_k: int,
                split_k: int, num_warps: int, num_stages: int, interpreted: bool, gated: str | None = None,
                up: torch.Tensor | None = None) -> None:
    """Launch the GEMV of ``x [T, K] @ weight[N, K].T`` (int8 weights with ``scale``, else float weights of x's
    dtype) into ``dest`` (``[T, N]`` in x's dtype, or ``[split_k, T, N]`` fp32 partial sums). ``block_k`` must be
    a multiple of 4; int8 weights are read as words where ``int8_words_view`` allows it.

    ``gated`` (an activation of ``GATED_ACTIVATIONS``; ``kernels.gated_gemv``), one split only: with ``up``
    (``[T, N]``, x's dtype, a contiguous last dim) ``dest [T, N]`` gets ``act(x @ weight.T) * up``; without it
    ``weight`` is a fused ``[gate; up]`` of ``2I`` rows and ``dest [T, I]`` gets ``act(gate) * up``, ``block_n``
    even and the grid's second axis ``cdiv(I, block_n / 2)``."""
    launch = gemv_arguments(x, weight, scale, dest, k_per_split, stride_os, block_n=block_n, block_t=block_t,
                            block_k=block_k, split_k=split_k, num_warps=num_warps, num_stages=num_stages,
                            interpreted=interpreted, gated=gated, up=up)
    int8_gemv_kernel[grid](*launch.args, **launch.constexprs, num_warps=launch.num_warps,
                           num_stages=launch.num_stages, **pdl_launch(loop="gemv"))
