"""The routed experts of a decode step as two weight-streaming GEMV launches: no alignment, no k-sum launch.

``fused_moe`` (grouped GEMMs) runs four launches at decode: align, gate/up, down, k-sum. It pads each expert's
rows to a 16-row ``tl.dot`` tile and reads the expert weights as the dot's transposed right operand; at batch 1
its two GEMMs stream well under the memory limit and the align and sum launches add their launch costs
(docs/benchmarks.md). For a few tokens this module does the same arithmetic as two GEMVs:

1. ``_gate_up_kernel``, one program per (``BLOCK_N`` intermediate rows, (token, k) pair): the pair's expert id
   straight from ``topk_ids``, its gate and up rows streamed against the token's activations with fp32 FMAs on
   the CUDA cores, ``act(gate) * up`` in the epilogue -> ``inter [T*K, I]``.
2. ``_down_kernel``, one program per (``BLOCK_N`` hidden rows, pair): ``inter[pair] @ W_down[e].T`` for its
   rows, times the routing weight, into a scratch row of the pair; then an arrival counter per (token, row
   tile): the last of the token's K programs to finish adds the K scratch rows in ascending k, in fp32, and
   writes ``out[t]``. Deterministic (a fixed order, no float atomics), and one program per pair keeps K times as
   many weight loads in flight as one program per token would.

Each weight row is read once per pair, so tokens sharing an expert read it twice (from L2 when they run
together); the grouped GEMMs read it once. That is why this path is for a few tokens
(``backends.cuda.options.MOE_DECODE_MAX_TOKENS``, where the two cross: ``bench/moe_decode.py`` in git at 817ca7c).

Rounding is ``fused_moe``'s (``reference_moe``'s ``"pairs"`` accumulation): the gate/up and down results rounded
to the activation dtype, ``act(gate)`` and ``act * up`` rounded, the weighted pair stored in
``promote(act dtype, topk_weights dtype)``, the k-sum in fp32 in ascending k, one cast. Only the order of each
dot product's fp32 sum differs. int8 experts (both scales given): the bytes go to fp32 by the exponent trick
(``int8_dequant``, exact), the row's scale multiplies the fp32 sum before the rounding.

int8 experts are read as 32-bit words where their layout allows it (``int8_words_view``: rows of a multiple of 8
bytes, 4-byte aligned; every real shape), as ``int8_gemv`` reads them: a thread loads two words (8 columns) of a
row, flips the word's four sign bits with one logic op and places each byte in the mantissa of ``2**23`` with one
byte permute (``words_to_fp32_exact``), and the activations are split the same way (column ``4j + i`` with byte
``i`` of word ``j``) into one fp32 accumulator ``[BLOCK_N, BLOCK_K / 4]`` per row set: fewer instructions per byte
than single bytes converted one at a time (the path before words; other layouts still take it). With bf16
activations the words skip the conversion: each
activation tile becomes 16-bit fixed point once, shared by the gate and up rows, and the products are integer dot
products (``kernels/int8_fixed_dot.py``; activations far below their word's largest are rounded, at most
``2**-15`` of it).

Pairs whose expert id is outside [0, E) contribute zeros (``fused_moe`` leaves their rows undefined). No host
syncs; the scratch comes from the caching allocator and the counters are a zeroed buffer per device that each
launch leaves zeroed, so calls are CUDA-graph capturable (the first call on a device must not be inside a capture)
and launches in stream order share it; two launches must not run concurrently.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from inference_server.kernels.arrival_counters import arrival_counters
from inference_server.kernels.fused_moe import act_times_up
from inference_server.kernels.int8_dequant import (
    fma_words,
    int8_to_fp32_exact,
    int8_words_view,
    word_pair_offsets,
    words_to_fp32_exact,
)
from inference_server.kernels.int8_fixed_dot import fixed_point_accumulate, fixed_point_tile, takes_fixed_point
from inference_server.kernels.moe_arguments import ACT_CODES, check_moe_arguments, moe_output
from inference_server.kernels.pdl import (
    pdl_enabled,
    pdl_launch,
    pdl_release_after_loop,
    pdl_release_after_wait,
    pdl_wait,
)
from inference_server.kernels.reference_moe import Activation
from inference_server.kernels.streamed_linear import dividing_block_k, pow2_clamp

__all__ = ["MAX_TOKENS", "MoeDecodeConfig", "MoeDecodeLaunches", "down_program_rows",
           "first_row_tiles", "fused_moe_decode", "gate_up_program", "launch_down", "moe_decode_config",
           "moe_decode_launches", "stream_rows", "stream_rows_from"]

MAX_TOKENS = 64
"""The most tokens one call takes (the arrival counters are sized for it)."""
_MAX_ROW_TILES = 2048
"""Hidden-row tiles per token the counters hold (hidden sizes up to 32,768 at 16 rows a tile)."""


@dataclass(frozen=True)
class MoeDecodeConfig:
    """Tiles of the two kernels: weight rows per program and K depth per streamed tile (powers of two; the K depth
    divides the dot's length or the loop masks its tail), and warps."""

    gate_up_block_n: int = 16
    gate_up_block_k: int = 256
    gate_up_warps: int = 4
    down_block_n: int = 16
    down_block_k: int = 256
    down_warps: int = 4


def moe_decode_config(hidden_size: int, intermediate_size: int, element_size: int, *,
                      int8: bool = False) -> MoeDecodeConfig:
    """Heuristic tiles: 16 weight rows a program, K tiles of 512 bytes for gate/up (256 bf16 columns) and 256 for
    down, where they divide the dot, else the largest power of two that does (at least 32 columns), so the loads
    need no masks: the best or close to it at one token in the sweep of ``bench/moe_decode.py`` (git, 817ca7c).

    ``int8`` experts (read as words): one warp a program and 256 columns a K tile, 8 gate/up and 16 down rows
    (``_INT8_WORD_TILES``)."""
    if int8:
        gu_n, gu_k, gu_w, dn_n, dn_k, dn_w = _INT8_WORD_TILES
        return MoeDecodeConfig(
            gate_up_block_n=min(gu_n, pow2_clamp(intermediate_size, 1, 1 << 30)),
            gate_up_block_k=pow2_clamp(hidden_size, 16, gu_k), gate_up_warps=gu_w,
            down_block_n=min(dn_n, pow2_clamp(hidden_size, 1, 1 << 30)),
            down_block_k=pow2_clamp(intermediate_size, 16, dn_k), down_warps=dn_w,
        )
    return MoeDecodeConfig(
        gate_up_block_n=min(16, pow2_clamp(intermediate_size, 1, 1 << 30)),
        gate_up_block_k=dividing_block_k(hidden_size, 512 // element_size),
        down_block_n=min(16, pow2_clamp(hidden_size, 1, 1 << 30)),
        down_block_k=dividing_block_k(intermediate_size, 256 // element_size),
    )


_INT8_WORD_TILES = (8, 256, 1, 16, 256, 1)
"""(rows, K columns, warps) of gate/up, then of down, for int8 experts read as words. The word path keeps its
loop in registers only where the K tile has 256 columns a warp (a thread's 16-byte load of bf16 activations holds
the 8 columns of its two weight words; fewer, and every tile's activations cross threads through shared memory,
with two barriers). One warp and 256 columns (rather than 4 and 1,024) because the MoE dots are short; it is also
what the tuning sweep chose for the dense int8 GEMV at short K (``configs/int8_linear``). A K not a multiple of 256
takes a masked tail."""


@triton.jit
def _weight_fp32(w, W_INT8: tl.constexpr):
    """A weight tile as fp32: int8 by the exponent trick (exact), float by a plain conversion."""
    if W_INT8:
        return int8_to_fp32_exact(w)
    return w.to(tl.float32)


@triton.jit
def _first_tiles(w_ptrs, row_stride, w_ok, x_ptrs, x_ok, TWO: tl.constexpr, EVEN_K: tl.constexpr,
                 LOAD_X: tl.constexpr):
    """The first K tile of a row stream, issued weight (``a`` at ``w_ptrs``), vector (``x`` at ``x_ptrs``, if
    ``LOAD_X``; else ``a`` stands in), weight (``b`` ``row_stride`` further, if ``TWO``; else ``a``), as the timed
    kernels issue them. ``EVEN_K``: unmasked; else masked by ``w_ok`` (broadcast over the rows) and ``x_ok``, zeros
    beyond."""
    if EVEN_K:
        a = tl.load(w_ptrs)
    else:
        a = tl.load(w_ptrs, mask=w_ok, other=0)
    x = a
    if LOAD_X:
        x = _first_vector_tile(x_ptrs, x_ok, EVEN_K)
    if TWO:
        if EVEN_K:
            b = tl.load(w_ptrs + row_stride)
        else:
            b = tl.load(w_ptrs + row_stride, mask=w_ok, other=0)
    else:
        b = a
    return a, x, b


@triton.jit
def _first_vector_tile(x_ptrs, x_ok, EVEN_K: tl.constexpr):
    """The vector's first K tile (``_first_tiles``), in its own dtype."""
    if EVEN_K:
        return tl.load(x_ptrs)
    return tl.load(x_ptrs, mask=x_ok, other=0.0)


@triton.jit
def first_row_tiles(rows, row_stride, length, TWO: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The first K tile of the weight rows ``stream_rows`` streams: ``(a, b)``, each ``[BN, BK]`` (``b`` is ``a``
    without ``TWO``). Weights only: a kernel may load them before its PDL wait and stream on with
    ``stream_rows_from``."""
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = rows[:, None] + offs_k[None, :]  # [BN, BK]
    a, _, b = _first_tiles(w_ptrs, row_stride, (offs_k < length)[None, :], w_ptrs, None, TWO, EVEN_K, False)
    return a, b


@triton.jit
def stream_rows(rows, x_row, row_stride, length, TWO: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr, W_INT8: tl.constexpr):
    """fp32 dot products of the ``[BN, length]`` weight rows starting at ``rows [BN]`` (and, with ``TWO``, of the
    rows ``row_stride`` further) with the vector at ``x_row``: ``(sum_a [BN], sum_b [BN])``. Float weights, or
    int8 as single bytes (``_stream_word_rows`` reads them as words).

    Triton pipelines only loads that feed a ``tl.dot``, so the loop prefetches by hand: the next tile's loads are
    issued before this tile's FMAs. Products accumulate lane-wise in a ``[BN, BK]`` fp32 tile, summed once at
    the end. EVEN_K: ``length`` is a multiple of BLOCK_K; the prefetch past the end is then masked with a
    uniform mask, which keeps the loads vectorised."""
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = rows[:, None] + offs_k[None, :]  # [BN, BK]
    x_ptrs = x_row + offs_k  # [BK]
    n_tiles = tl.cdiv(length, BLOCK_K)
    k_ok = offs_k < length
    a, x, b = _first_tiles(w_ptrs, row_stride, k_ok[None, :], x_ptrs, k_ok, TWO, EVEN_K, True)
    x = x.to(tl.float32)
    return _stream_rows_loop(a, b, x, w_ptrs, x_ptrs, offs_k, n_tiles, row_stride, length, TWO, BLOCK_K, EVEN_K,
                             W_INT8)


@triton.jit
def stream_rows_from(a, b, rows, x_row, row_stride, length, TWO: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVEN_K: tl.constexpr, W_INT8: tl.constexpr):
    """``stream_rows`` with its first weight tiles ``a``, ``b`` already loaded (``first_row_tiles``)."""
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = rows[:, None] + offs_k[None, :]  # [BN, BK]
    x_ptrs = x_row + offs_k  # [BK]
    n_tiles = tl.cdiv(length, BLOCK_K)
    x = _first_vector_tile(x_ptrs, offs_k < length, EVEN_K).to(tl.float32)
    return _stream_rows_loop(a, b, x, w_ptrs, x_ptrs, offs_k, n_tiles, row_stride, length, TWO, BLOCK_K, EVEN_K,
                             W_INT8)


@triton.jit
def _stream_rows_loop(a, b, x, w_ptrs, x_ptrs, offs_k, n_tiles, row_stride, length, TWO: tl.constexpr,
                      BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, W_INT8: tl.constexpr):
    """``stream_rows``' K loop over ``n_tiles`` tiles from its first ones (weights ``a``, ``b`` and the vector's
    ``x``, at ``w_ptrs`` and ``x_ptrs``)."""
    acc_a = tl.zeros(a.shape, dtype=tl.float32)
    acc_b = tl.zeros(a.shape, dtype=tl.float32)
    for kb in range(0, n_tiles):
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        if EVEN_K:
            more_x = (tl.zeros((BLOCK_K,), tl.int32) + (kb + 1)) < n_tiles  # uniform; False past the last tile
            more = more_x[None, :]
            a_next = tl.load(w_ptrs, mask=more, other=0)
            x_next = tl.load(x_ptrs, mask=more_x, other=0.0).to(tl.float32)
            if TWO:
                b_next = tl.load(w_ptrs + row_stride, mask=more, other=0)
            else:
                b_next = a_next
        else:
            k_next = offs_k < length - (kb + 1) * BLOCK_K
            a_next = tl.load(w_ptrs, mask=k_next[None, :], other=0)
            x_next = tl.load(x_ptrs, mask=k_next, other=0.0).to(tl.float32)
            if TWO:
                b_next = tl.load(w_ptrs + row_stride, mask=k_next[None, :], other=0)
            else:
                b_next = a_next
        acc_a += _weight_fp32(a, W_INT8) * x[None, :]
        if TWO:
            acc_b += _weight_fp32(b, W_INT8) * x[None, :]
        a = a_next
        b = b_next
        x = x_next
    return tl.sum(acc_a, axis=1), tl.sum(acc_b, axis=1)


@triton.jit
def _first_word_tiles(rows, row_stride, length, TWO: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """``first_row_tiles`` for ``_stream_word_rows``: the first tile of words, ``(a, b)`` each ``[BN, BK / 4]``."""
    offs_w, first_col = word_pair_offsets(BLOCK_K // 4)
    w_ptrs = rows[:, None] + offs_w[None, :]  # [BN, WORDS]
    a, _, b = _first_tiles(w_ptrs, row_stride, (first_col < length)[None, :], w_ptrs, None, TWO, EVEN_K, False)
    return a, b


@triton.jit
def _stream_word_rows(rows, x_row, row_stride, length, TWO: tl.constexpr, BLOCK_K: tl.constexpr,
                      EVEN_K: tl.constexpr, PRMT: tl.constexpr, INT_DOT: tl.constexpr):
    """``stream_rows`` for int8 weights read as int32 words: ``rows [BN]`` point at each row's first word (an
    ``int32`` pointer, ``row_stride`` in words), ``length`` counts int8 columns (a multiple of 8) and ``BLOCK_K``
    columns a tile (a multiple of 8). Word ``j`` holds columns ``4j .. 4j+3`` (byte ``i`` is column ``4j + i``);
    the activations are split into the same four column sets (``fma_words``), so no value crosses threads in the
    loop and each accumulator ``[BN, BLOCK_K / 4]`` is summed once at the end. ``PRMT``: bytes placed by the PTX
    byte permute (compiled kernels only; the interpreter takes shifts and masks). ``INT_DOT`` (bf16 activations):
    the words stay integers and each activation tile becomes fixed point once for both row sets
    (``kernels/int8_fixed_dot.py``, as in ``int8_gemv``).

    The next tile's loads go out before this tile's arithmetic (as in ``stream_rows``). EVEN_K: no load is
    masked; the last iteration's prefetch re-reads its own tile (the pointers stop advancing, ``int8_gemv``'s
    way). Else the K tail is masked per pair of words (8-byte loads: ``word_pair_offsets``)."""
    WORDS: tl.constexpr = BLOCK_K // 4
    offs_w, first_col = word_pair_offsets(WORDS)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = rows[:, None] + offs_w[None, :]  # [BN, WORDS]
    x_ptrs = x_row + offs_k  # [BK]
    n_tiles = tl.cdiv(length, BLOCK_K)
    a, x, b = _first_tiles(w_ptrs, row_stride, (first_col < length)[None, :], x_ptrs, offs_k < length, TWO, EVEN_K,
                           True)
    return _stream_word_rows_loop(a, b, x, w_ptrs, x_ptrs, offs_k, first_col, n_tiles, row_stride, length, TWO,
                                  BLOCK_K, EVEN_K, PRMT, INT_DOT)


@triton.jit
def _stream_word_rows_from(a, b, rows, x_row, row_stride, length, TWO: tl.constexpr, BLOCK_K: tl.constexpr,
                           EVEN_K: tl.constexpr, PRMT: tl.constexpr, INT_DOT: tl.constexpr):
    """``_stream_word_rows`` with its first tiles of words ``a``, ``b`` already loaded (``_first_word_tiles``)."""
    WORDS: tl.constexpr = BLOCK_K // 4
    offs_w, first_col = word_pair_offsets(WORDS)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = rows[:, None] + offs_w[None, :]  # [BN, WORDS]
    x_ptrs = x_row + offs_k  # [BK]
    n_tiles = tl.cdiv(length, BLOCK_K)
    x = _first_vector_tile(x_ptrs, offs_k < length, EVEN_K)
    return _stream_word_rows_loop(a, b, x, w_ptrs, x_ptrs, offs_k, first_col, n_tiles, row_stride, length, TWO,
                                  BLOCK_K, EVEN_K, PRMT, INT_DOT)


@triton.jit
def _stream_word_rows_loop(a, b, x, w_ptrs, x_ptrs, offs_k, first_col, n_tiles, row_stride, length,
                           TWO: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PRMT: tl.constexpr,
                           INT_DOT: tl.constexpr):
    """``_stream_word_rows``' K loop over ``n_tiles`` tiles from its first ones (words ``a``, ``b`` and the
    activations' ``x``)."""
    WORDS: tl.constexpr = BLOCK_K // 4
    acc_a = tl.zeros(a.shape, dtype=tl.float32)
    acc_b = tl.zeros(a.shape, dtype=tl.float32)
    for kb in range(0, n_tiles):
        if EVEN_K:
            more = (kb + 1 < n_tiles).to(tl.int32)  # 0 on the last iteration: the prefetch stays in bounds
            w_ptrs += more * WORDS
            x_ptrs += more * BLOCK_K
            a_next = tl.load(w_ptrs)
            x_next = tl.load(x_ptrs)
            if TWO:
                b_next = tl.load(w_ptrs + row_stride)
            else:
                b_next = a_next
        else:
            w_ptrs += WORDS
            x_ptrs += BLOCK_K
            rest = length - (kb + 1) * BLOCK_K
            w_next_ok = (first_col < rest)[None, :]
            a_next = tl.load(w_ptrs, mask=w_next_ok, other=0)
            x_next = tl.load(x_ptrs, mask=offs_k < rest, other=0.0)
            if TWO:
                b_next = tl.load(w_ptrs + row_stride, mask=w_next_ok, other=0)
            else:
                b_next = a_next
        if INT_DOT:
            lo, hi, step = fixed_point_tile(x, WORDS, PRMT)
            acc_a = fixed_point_accumulate(acc_a, a, lo, hi, step, PRMT)
            if TWO:
                acc_b = fixed_point_accumulate(acc_b, b, lo, hi, step, PRMT)
        else:
            a0, a1, a2, a3 = words_to_fp32_exact(a, PRMT)
            acc_a = fma_words(acc_a, a0, a1, a2, a3, x, WORDS)
            if TWO:
                b0, b1, b2, b3 = words_to_fp32_exact(b, PRMT)
                acc_b = fma_words(acc_b, b0, b1, b2, b3, x, WORDS)
        a = a_next
        b = b_next
        x = x_next
    return tl.sum(acc_a, axis=1), tl.sum(acc_b, axis=1)


@triton.jit
def gate_up_program(
    pid_n,  # this program's block of intermediate rows
    pair,  # its (token, k) pair, t * K + k
    x_ptr,  # [T, H] activations (last dim contiguous)
    w_ptr,  # [E, 2I, H] gate rows [0, I), up rows [I, 2I) (last dim contiguous); int8 when W_INT8, its int32
    # words [E, 2I, H / 4] when W_WORDS (strides in words)
    ids_ptr,  # [T*K] expert of each pair, pair = t*K + k
    scale_ptr,  # [E, 2I] per-row scale of int8 weights (unused unless W_INT8)
    out_ptr,  # [T*K, I] act(gate) * up in x's dtype
    num_experts,
    H,
    inter_size,
    stride_xt,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    TOP_K: tl.constexpr,
    ACT: tl.constexpr,  # 0 silu, 1 gelu_tanh
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    W_INT8: tl.constexpr,
    W_WORDS: tl.constexpr = False,  # int8 weights read as int32 words (_stream_word_rows)
    PRMT: tl.constexpr = False,  # W_WORDS: bytes placed by the PTX byte permute (compiled only; not interpreted)
    INT_DOT: tl.constexpr = False,  # W_WORDS with bf16 activations: integer dot products (kernels.int8_fixed_dot)
    USE_PDL: tl.constexpr = False,  # kernels.pdl: launched as a programmatic dependent
):
    """One program of ``_gate_up_kernel`` (step 1 of the module docstring), at the given coordinates; kernels that
    share a launch with other work (``kernels.mlp_beside_experts``) run it at coordinates of their own."""
    # PDL (kernels.pdl): the expert ids and the activations come from earlier launches (which expert's rows to stream
    # is known only from them), so wait before the first load, in every program (also those that return at once).
    pdl_wait(USE_PDL)
    pdl_release_after_wait(USE_PDL)
    expert = tl.load(ids_ptr + pair).to(tl.int32)
    if (expert < 0) | (expert >= num_experts):
        return  # the down kernel gives this pair zeros
    token = (pair // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n_safe = offs_n % inter_size  # in-bounds loads; the store is masked
    rows = w_ptr + expert.to(tl.int64) * stride_we + offs_n_safe.to(tl.int64) * stride_wn  # [BN]
    x_row = x_ptr + token * stride_xt
    if W_WORDS:
        gate, up = _stream_word_rows(rows, x_row, inter_size * stride_wn, H, True, BLOCK_K, EVEN_K, PRMT, INT_DOT)
    else:
        gate, up = stream_rows(rows, x_row, inter_size * stride_wn, H, True, BLOCK_K, EVEN_K, W_INT8)
    # PDL: release after the weight stream (kernels.pdl's mode; the other releases right after the wait): only the
    # epilogue is left, so the next launch's CTAs (resident from here on, waiting) hold no registers while this
    # kernel's programs still stream.
    pdl_release_after_loop(USE_PDL)
    dt = out_ptr.dtype.element_ty
    if W_INT8:  # gate row n, up row I + n
        s_ptrs = scale_ptr + expert.to(tl.int64) * stride_se + offs_n_safe * stride_sn
        gate = gate * tl.load(s_ptrs).to(tl.float32)
        up = up * tl.load(s_ptrs + inter_size * stride_sn).to(tl.float32)
    h = act_times_up(gate, up, dt, ACT)  # fused_moe's rounding points
    tl.store(out_ptr + pair.to(tl.int64) * inter_size + offs_n, h.to(dt), mask=offs_n < inter_size)

@triton.jit
def _gate_up_kernel(  # gate_up_program's parameters in its order (each documented there)
    x_ptr, w_ptr, ids_ptr, scale_ptr, out_ptr, num_experts, H, inter_size, stride_xt, stride_we, stride_wn, stride_se,
    stride_sn, TOP_K: tl.constexpr, ACT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, W_INT8: tl.constexpr, W_WORDS: tl.constexpr = False, PRMT: tl.constexpr = False,
    INT_DOT: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):
    gate_up_program(
        tl.program_id(0), tl.program_id(1), x_ptr, w_ptr, ids_ptr, scale_ptr, out_ptr, num_experts, H, inter_size,
        stride_xt, stride_we, stride_wn, stride_se, stride_sn, TOP_K, ACT, BLOCK_N, BLOCK_K, EVEN_K, W_INT8,
        W_WORDS, PRMT, INT_DOT, USE_PDL,
    )  # fmt: skip


@triton.jit
def weighted_pair_and_k_sum(y, valid, pair, token, pid_n, offs_n, inter_ptr, topk_w_ptr, pair_ptr, counter_ptr,
                            out_ptr, H, stride_ot, TOP_K: tl.constexpr, ROW_TILES_STRIDE: tl.constexpr,
                            BLOCK_N: tl.constexpr):
    """The down program's epilogue (step 2 of the module docstring): the fp32 dot products ``y [BLOCK_N]`` of its
    rows rounded to the activation dtype, times the pair's routing weight (zeros for an invalid pair), stored as the
    pair's scratch row; then the (token, row tile) arrival counter, and the token's last program adds the K rows."""
    route_w = tl.load(topk_w_ptr + pair).to(tl.float32)
    y = y.to(inter_ptr.dtype.element_ty).to(tl.float32) * route_w
    y = tl.where(valid, y, 0.0)
    n_ok = offs_n < H
    tl.store(pair_ptr + pair.to(tl.int64) * H + offs_n, y.to(pair_ptr.dtype.element_ty), mask=n_ok)
    # The token's last program to arrive adds its K pairs. The barrier puts all of this program's stores before
    # the counter's release (acq_rel, GPU scope); the last program's acquire makes the other programs' stores
    # visible, and its loads bypass L1 (.cg), which may hold this scratch from an earlier launch.
    tl.debug_barrier()
    counter = counter_ptr + token * ROW_TILES_STRIDE + pid_n
    arrived = tl.atomic_add(counter, 1)
    if arrived == TOP_K - 1:
        first = pair_ptr + (token * TOP_K).to(tl.int64) * H + offs_n
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k in tl.static_range(TOP_K):  # fixed order k = 0..K-1: deterministic
            total += tl.load(first + k * H, mask=n_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        tl.store(out_ptr + token.to(tl.int64) * stride_ot + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)
        tl.atomic_xchg(counter, 0)  # ready for the next launch (stream order keeps launches apart)


@triton.jit
def down_program_rows(pid_n, pair, ids_ptr, num_experts, H, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """A down program's coordinates: ``(token, expert, valid, offs_n, offs_n_safe)`` for its (``pid_n`` row tile,
    ``pair``). An expert id outside [0, E) is not ``valid`` and reads expert 0's rows (the epilogue gives the pair
    zeros); ``offs_n_safe`` keeps the row loads in bounds (the stores are masked by ``offs_n``)."""
    token = pair // TOP_K
    expert = tl.load(ids_ptr + pair).to(tl.int32)
    valid = (expert >= 0) & (expert < num_experts)
    expert = tl.where(valid, expert, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return token, expert, valid, offs_n, offs_n % H


@triton.jit
def _down_kernel(
    inter_ptr,  # [T*K, I] act(gate) * up (contiguous)
    w_ptr,  # [E, H, I] (last dim contiguous); int8 when W_INT8, its int32 words [E, H, I / 4] when W_WORDS
    ids_ptr,  # [T*K]
    topk_w_ptr,  # [T*K] routing weights
    scale_ptr,  # [E, H] per-row scale of int8 weights (unused unless W_INT8)
    pair_ptr,  # [T*K, H] scratch: weighted pair outputs, dtype promote(act, topk weights)
    counter_ptr,  # int32 [T, ROW_TILES_STRIDE]: programs done per (token, row tile); zero between launches
    out_ptr,  # [T, H]
    num_experts,
    H,
    inter_size,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ot,
    TOP_K: tl.constexpr,
    ROW_TILES_STRIDE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    W_INT8: tl.constexpr,
    W_WORDS: tl.constexpr = False,  # int8 weights read as int32 words (_stream_word_rows)
    PRMT: tl.constexpr = False,  # W_WORDS: bytes placed by the PTX byte permute (compiled only; not interpreted)
    INT_DOT: tl.constexpr = False,  # W_WORDS with bf16 activations: integer dot products (kernels.int8_fixed_dot)
    USE_PDL: tl.constexpr = False,  # kernels.pdl: launched as a programmatic dependent
    W_BEFORE_WAIT: tl.constexpr = False,  # the expert id and the first weight tile are loaded before the PDL wait
):
    if not W_BEFORE_WAIT:
        # PDL (kernels.pdl): the ids, routing weights and act * up rows come from earlier launches, the scratch and
        # the output may still be read by an earlier one, and the arrival counters are reset by the previous launch:
        # wait before the first load, store or atomic.
        pdl_wait(USE_PDL)
        pdl_release_after_wait(USE_PDL)
    pid_n = tl.program_id(0)
    pair = tl.program_id(1)
    # W_BEFORE_WAIT (kernels.pdl): the expert ids come from the router, two launches back (the gate/up launch that
    # this one depends on sits between), so they and the expert's first weight tile can be loaded while the gate/up
    # launch still runs; the act * up rows, the routing weights, every store and the counters wait.
    token, expert, valid, offs_n, offs_n_safe = down_program_rows(pid_n, pair, ids_ptr, num_experts, H, TOP_K,
                                                                  BLOCK_N)
    rows = w_ptr + expert * stride_we + offs_n_safe.to(tl.int64) * stride_wn  # [BN]
    if W_WORDS:
        a, b = _first_word_tiles(rows, 0, inter_size, False, BLOCK_K, EVEN_K)
    else:
        a, b = first_row_tiles(rows, 0, inter_size, False, BLOCK_K, EVEN_K)
    if W_BEFORE_WAIT:
        pdl_wait(USE_PDL)
        pdl_release_after_wait(USE_PDL)
    x_row = inter_ptr + pair.to(tl.int64) * inter_size
    if W_WORDS:
        y, _ = _stream_word_rows_from(a, b, rows, x_row, 0, inter_size, False, BLOCK_K, EVEN_K, PRMT, INT_DOT)
    else:
        y, _ = stream_rows_from(a, b, rows, x_row, 0, inter_size, False, BLOCK_K, EVEN_K, W_INT8)
    # PDL: release after the weight stream (kernels.pdl's mode; the other releases right after the wait): only the
    # epilogue is left, so the next launch's CTAs (resident from here on, waiting) hold no registers while this
    # kernel's programs still stream.
    pdl_release_after_loop(USE_PDL)
    if W_INT8:
        y = y * tl.load(scale_ptr + expert * stride_se + offs_n_safe * stride_sn).to(tl.float32)
    weighted_pair_and_k_sum(y, valid, pair, token, pid_n, offs_n, inter_ptr, topk_w_ptr, pair_ptr, counter_ptr,
                            out_ptr, H, stride_ot, TOP_K, ROW_TILES_STRIDE, BLOCK_N)


_INTERPRETED = not isinstance(_gate_up_kernel, triton.runtime.JITFunction)
"""Under ``TRITON_INTERPRET=1``: the word path places bytes by shifts and masks (the interpreter has no PTX)."""


def _weight_operand(weight: torch.Tensor, w_int8: bool, block_k: int) -> tuple[torch.Tensor, bool]:
    """The expert weight as the kernel reads it, and whether as int32 words: int8 weights whose layout allows it
    (``int8_words_view``) with K tiles of whole word pairs; else the tensor itself (float, or int8 single bytes)."""
    if not w_int8 or block_k % 8:
        return weight, False
    words = int8_words_view(weight)
    return (weight, False) if words is None else (words, True)


def _arrival_counters(device: torch.device) -> torch.Tensor:
    """The down kernel's ``[MAX_TOKENS * _MAX_ROW_TILES]`` counters (``kernels.arrival_counters``)."""
    return arrival_counters("fused_moe_decode", MAX_TOKENS * _MAX_ROW_TILES, device)


@dataclass(frozen=True)
class MoeDecodeLaunches:
    """One ``fused_moe_decode`` call's checked arguments (``moe_decode_launches``): the gate/up launch's ``args``
    in the order of ``_gate_up_kernel``'s runtime parameters with its ``constexprs`` and grid ``(row tiles,
    pairs)``, and the down launch, which ``launch_down`` runs. Kernels that run ``gate_up_program`` beside other
    work (``kernels.mlp_beside_experts``) take the gate/up launch's parameters."""

    gate_up_args: tuple[object, ...]
    gate_up_constexprs: dict[str, object]
    gate_up_grid: tuple[int, int]
    gate_up_warps: int
    down_args: tuple[object, ...]
    down_constexprs: dict[str, object]
    down_grid: tuple[int, int]
    down_warps: int


def moe_decode_launches(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: Activation,
    *,
    config: MoeDecodeConfig | None = None,
    out: torch.Tensor | None = None,
    w_gate_up_scale: torch.Tensor | None = None,
    w_down_scale: torch.Tensor | None = None,
    int8_words: bool = True,
    weights_before_wait: bool | None = None,
) -> tuple[MoeDecodeLaunches | None, torch.Tensor]:
    """``fused_moe_decode``'s checks, buffers and launch arguments (None for zero tokens: nothing to launch) and
    its output ``[T, H]`` (written by the down launch). ``weights_before_wait``: whether the down launch loads each
    program's expert id and first weight tile before its PDL wait (``_down_kernel``'s ``W_BEFORE_WAIT``, the same
    bits); None, where PDL is on (``kernels.pdl``); the interpreter's tests force it."""
    shapes = check_moe_arguments(hidden, w_gate_up, w_down, topk_weights, topk_ids, activation, w_gate_up_scale,
                                 w_down_scale)
    T, H, E, inter_size, K, w_int8 = (shapes.tokens, shapes.hidden, shapes.experts, shapes.intermediate,
                                      shapes.top_k, shapes.int8)
    if T > MAX_TOKENS:
        raise ValueError(f"fused_moe_decode takes at most {MAX_TOKENS} tokens, got {T}")
    if w_gate_up.stride(2) != 1 or w_down.stride(2) != 1 or hidden.stride(1) != 1:
        raise ValueError("hidden and the expert weights need a contiguous last dim")
    out = moe_output(hidden, out)
    if T == 0:
        return None, out
    cfg = config or moe_decode_config(H, inter_size, hidden.element_size(), int8=w_int8)
    int_dot = takes_fixed_point(hidden.dtype)  # int8 words meet bf16 activations as fixed point (int8_fixed_dot)
    row_tiles = triton.cdiv(H, cfg.down_block_n)
    if row_tiles > _MAX_ROW_TILES:
        raise ValueError(f"hidden size {H} needs {row_tiles} row tiles of {cfg.down_block_n}; at most "
                         f"{_MAX_ROW_TILES}")
    n_pairs = T * K
    dev = hidden.device
    ids = topk_ids.reshape(-1)
    weights = topk_weights.reshape(-1)
    inter = torch.empty(n_pairs, inter_size, dtype=hidden.dtype, device=dev)  # [T*K, I]
    gu_scale = w_gate_up_scale if w_gate_up_scale is not None else w_gate_up  # a pointer never read
    gu_w, gu_words = _weight_operand(w_gate_up, w_int8 and int8_words, cfg.gate_up_block_k)
    gate_up_args = (hidden, gu_w, ids, gu_scale, inter, E, H, inter_size, hidden.stride(0), gu_w.stride(0),
                    gu_w.stride(1), gu_scale.stride(0), gu_scale.stride(1))
    gate_up_constexprs: dict[str, object] = dict(
        TOP_K=K, ACT=ACT_CODES[activation], BLOCK_N=cfg.gate_up_block_n, BLOCK_K=cfg.gate_up_block_k,
        EVEN_K=H % cfg.gate_up_block_k == 0, W_INT8=w_int8, W_WORDS=gu_words, PRMT=gu_words and not _INTERPRETED,
        INT_DOT=gu_words and int_dot,
    )
    pair_out = torch.empty(n_pairs, H, dtype=torch.promote_types(hidden.dtype, topk_weights.dtype), device=dev)
    dn_scale = w_down_scale if w_down_scale is not None else w_down
    dn_w, dn_words = _weight_operand(w_down, w_int8 and int8_words, cfg.down_block_k)
    down_args = (inter, dn_w, ids, weights, dn_scale, pair_out, _arrival_counters(dev), out, E, H, inter_size,
                 dn_w.stride(0), dn_w.stride(1), dn_scale.stride(0), dn_scale.stride(1), out.stride(0))
    down_constexprs: dict[str, object] = dict(
        TOP_K=K, ROW_TILES_STRIDE=_MAX_ROW_TILES, BLOCK_N=cfg.down_block_n, BLOCK_K=cfg.down_block_k,
        EVEN_K=inter_size % cfg.down_block_k == 0, W_INT8=w_int8, W_WORDS=dn_words,
        PRMT=dn_words and not _INTERPRETED, INT_DOT=dn_words and int_dot,
        W_BEFORE_WAIT=pdl_enabled() if weights_before_wait is None else weights_before_wait,
    )
    launches = MoeDecodeLaunches(gate_up_args, gate_up_constexprs, (triton.cdiv(inter_size, cfg.gate_up_block_n),
                                                                     n_pairs), cfg.gate_up_warps,
                                 down_args, down_constexprs, (row_tiles, n_pairs), cfg.down_warps)
    return launches, out


def launch_down(launches: MoeDecodeLaunches) -> None:
    """The down launch of a ``moe_decode_launches`` call (after its gate/up launch, in stream order)."""
    _down_kernel[launches.down_grid](*launches.down_args, **launches.down_constexprs, num_warps=launches.down_warps,
                                     **pdl_launch(loop="moe"))


def fused_moe_decode(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: Activation,
    *,
    config: MoeDecodeConfig | None = None,
    out: torch.Tensor | None = None,
    w_gate_up_scale: torch.Tensor | None = None,
    w_down_scale: torch.Tensor | None = None,
    int8_words: bool = True,
    weights_before_wait: bool | None = None,
) -> torch.Tensor:
    """``fused_moe``'s contract (same arguments, shapes and rounding; see the module docstring) for at most
    ``MAX_TOKENS`` tokens, as two GEMV launches. The weights' last dims must be contiguous. ``config`` defaults to
    ``moe_decode_config``. int8 weights are read as 32-bit words where ``int8_words_view`` allows it and the
    config's K tiles are a multiple of 8 columns, else as single bytes (same results up to the fp32 sum order);
    ``int8_words=False`` always reads single bytes (the path before words: for comparisons); ``weights_before_wait``
    as ``moe_decode_launches``'."""
    launches, out = moe_decode_launches(hidden, w_gate_up, w_down, topk_weights, topk_ids, activation, config=config,
                                        out=out, w_gate_up_scale=w_gate_up_scale, w_down_scale=w_down_scale,
                                        int8_words=int8_words, weights_before_wait=weights_before_wait)
    if launches is not None:
        _gate_up_kernel[launches.gate_up_grid](*launches.gate_up_args, **launches.gate_up_constexprs,
                                               num_warps=launches.gate_up_warps, **pdl_launch(loop="moe"))
        launch_down(launches)
    return out
