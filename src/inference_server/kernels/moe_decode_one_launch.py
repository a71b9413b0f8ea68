"""The routed experts of a decode step in ONE launch: ``moe_decode``'s gate/up and down programs side by side,
the down programs starting while gate/up still streams. Measured slower than the two launches on the H200, so the
runner takes it only when asked (``CudaRunnerOptions.moe_one_launch``, off); kept as the measured alternative.

``moe_decode`` runs two launches, gate/up then down. Each streams its experts' weights with a few loads in flight
per program, so each spends a ramp and a tail of a few µs below the memory limit, and the down launch cannot
load a byte before gate/up has completed (PDL lets it get resident only for gate/up's epilogue). On the H200 at
one token on Qwen3-30B-A3B that is ~17 µs for gate/up's 50 MB and ~11 µs for down's 25 MB, against ~12 and ~6 at
the limit (docs/benchmarks.md). Here both kinds of program share one grid, so that down programs resident beside
gate/up's could overlap the two weight streams.

What the H200 measured (``bench/moe_decode.py``, session 10 calls 1-4; Qwen3-30B-A3B at one token): two launches
24.8-25.4 µs; one launch 31.0-31.5 µs with 16-row down programs holding their whole row block in registers, 27.2
µs at the best config (64 rows streamed after the wait, now the default), 37 µs at 128 rows. Gemma-4-26B-A4B:
31.2 against 32.3. In the engine (Qwen, B=1) the 16-row form ran 334.9 tok/s against 376 with two launches. The
down programs that spin hold SM slots that gate/up's programs would stream in, the tickets cost ~1 µs (the
experiment without them, which relies on in-order dispatch and so is not kept, gained 1-2 µs), and spinning on
plain acquire loads rather than atomics changed nothing; fewer, wider down programs got closest.

Programs and their order:

1. Every program first takes a ticket (an atomic add on a counter; the last ticket puts it back to zero). Tickets
   ``[0, n_gate_up)`` run ``moe_decode.gate_up_program`` at (row tile, pair) = divmod-ordered coordinates, then
   count themselves into their pair's *ready* counter (after a barrier, with release semantics).
2. Tickets from ``n_gate_up`` run a down program for (``BLOCK_N`` hidden rows, pair). With ``down_stream_k`` 0
   it loads the expert's whole ``[BLOCK_N, I]`` weight block into registers, then spins (acquire) until the
   pair's ready counter has all gate/up row tiles and loads the pair's ``act * up`` row (bypassing L1); else it
   spins first and then streams its rows in K tiles (``moe_decode.stream_rows``, the activations bypassing L1).
   Then ``moe_decode``'s epilogue (``weighted_pair_and_k_sum``: routing weight, scratch row, per-token arrival
   counter, k-sum in ascending k), and it counts itself into the pair's *consumed* counter; the pair's last down
   program zeroes both.

Why tickets rather than program ids: a down program spins, so it may occupy an SM only once every gate/up program
it waits for is resident or done. Tickets are taken by programs already running, so every ticket below a down
program's has a running (or finished) program, whatever order the hardware dispatches program ids in; no
deadlock (the scheme of stream-K's and decoupled look-back's forward-progress arguments). Under the interpreter
programs run one after another in program-id order, so the tickets equal the ids and no spin ever waits.

Rounding is ``moe_decode``'s (hence ``fused_moe``'s): only the order of each down dot product's fp32 sum differs.
Float experts only: int8 experts run ``moe_decode``'s two launches. ``fits_one_launch`` says which calls fit (the
pairs and tokens within the counters); a whole-row config must keep ``BLOCK_N x next_pow2(I)`` within
``MAX_DOWN_BLOCK_ELEMENTS`` registers' worth.

PDL (``kernels.pdl``): every program waits before its first load (the ids and activations come from earlier
launches, the counters and scratch are shared with the previous launch) and releases after its weight stream, as
the two kernels it joins. Counters and scratch as in ``moe_decode``: no host syncs, CUDA-graph capturable after a
first call outside capture, launches in stream order share the counters, two launches must not run concurrently.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from inference_server.kernels.arrival_counters import arrival_counters
from inference_server.kernels.moe_arguments import ACT_CODES, check_moe_arguments, moe_output
from inference_server.kernels.moe_decode import (
    MoeDecodeConfig,
    down_program_rows,
    gate_up_program,
    moe_decode_config,
    stream_rows,
    weighted_pair_and_k_sum,
)
from inference_server.kernels.pdl import pdl_launch, pdl_release_after_loop, pdl_release_after_wait, pdl_wait
from inference_server.kernels.reference_moe import Activation
from inference_server.kernels.streamed_linear import dividing_block_k, pow2_clamp

__all__ = ["MAX_DOWN_BLOCK_ELEMENTS", "MAX_PAIRS", "OneLaunchConfig", "fits_one_launch", "moe_decode_one_launch",
           "one_launch_config"]

MAX_PAIRS = 256
"""The most (token, k) pairs one launch takes (the ready and consumed counters are sized for it)."""
MAX_DOWN_BLOCK_ELEMENTS = 16 * 1024
"""The most down weights one program holds in registers (``BLOCK_N x next_pow2(I)``): 128 a thread at 4 warps."""
_MAX_ROW_TILES = 2048
"""Hidden-row tiles per token the k-sum counters hold (as ``moe_decode``)."""
_TOKENS = 64
"""Tokens the k-sum counters hold (pairs are bounded by ``MAX_PAIRS`` too)."""


@dataclass(frozen=True)
class OneLaunchConfig:
    """The gate/up programs' tiles (``moe_decode``'s), the down programs' rows, and the launch's warps (one value
    for both kinds of program: they share the launch)."""

    gate_up_block_n: int = 16
    gate_up_block_k: int = 256
    down_block_n: int = 16
    warps: int = 4
    down_stream_k: int = 0
    """0: a down program holds its whole ``[down_block_n, I]`` block in registers, loaded before its wait; else it
    waits first and then streams its rows in K tiles of this many columns (a power of two)."""


def one_launch_config(hidden_size: int, intermediate_size: int, element_size: int) -> OneLaunchConfig:
    """``moe_decode_config``'s gate/up tiles and warps; 64 down rows a program, streamed after the wait in K tiles
    of 256 bytes (128 bf16 columns, cut to divide I): the best of the H200 sweep (``bench/moe_decode.py``, 16-256
    rows, whole rows in registers or streamed), whose fewer down programs spin less and hold fewer SM slots."""
    base: MoeDecodeConfig = moe_decode_config(hidden_size, intermediate_size, element_size)
    return OneLaunchConfig(base.gate_up_block_n, base.gate_up_block_k,
                           down_block_n=min(64, pow2_clamp(hidden_size, 1, 1 << 30)), warps=base.gate_up_warps,
                           down_stream_k=dividing_block_k(intermediate_size, 256 // element_size))


def fits_one_launch(tokens: int, top_k: int, hidden_size: int, intermediate_size: int, int8: bool) -> bool:
    """Whether ``moe_decode_one_launch`` takes this call at ``one_launch_config``: float experts, at most
    ``MAX_PAIRS`` pairs and ``_TOKENS`` tokens, and the hidden rows within the k-sum counters."""
    if int8 or not 0 < tokens <= _TOKENS or tokens * top_k > MAX_PAIRS:
        return False
    config = one_launch_config(hidden_size, intermediate_size, 2)
    return triton.cdiv(hidden_size, config.down_block_n) <= _MAX_ROW_TILES


@triton.jit
def _wait_for_pair(ready, gate_up_row_tiles):
    """Spin until the pair's act * up row is complete: every gate/up row tile of the pair counted in (their stores
    precede their release; this acquire, then the barrier Triton puts after a scalar atomic, orders the loads that
    follow)."""
    seen = tl.atomic_add(ready, 0, sem="acquire")
    while seen < gate_up_row_tiles:
        seen = tl.atomic_add(ready, 0, sem="acquire")


@triton.jit
def _down_program(
    pid_n, pair, inter_ptr, w_ptr, ids_ptr, topk_w_ptr, pair_ptr, ksum_ptr, out_ptr, ready_ptr, consumed_ptr,
    num_experts, H, inter_size, stride_we, stride_wn, stride_ot, gate_up_row_tiles, down_row_tiles,
    TOP_K: tl.constexpr, ROW_TILES_STRIDE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr,
    EVEN_I: tl.constexpr, STREAM_K: tl.constexpr, STREAM_EVEN: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Step 2 of the module docstring for the down program at (``pid_n``, ``pair``). ``STREAM_K`` > 0: no block in
    registers; after the wait the rows stream in K tiles of that many columns (``moe_decode.stream_rows``)."""
    token, expert, valid, offs_n, offs_n_safe = down_program_rows(pid_n, pair, ids_ptr, num_experts, H, TOP_K,
                                                                  BLOCK_N)
    offs_i = tl.arange(0, BLOCK_I)
    ready = ready_ptr + pair
    if STREAM_K > 0:
        _wait_for_pair(ready, gate_up_row_tiles)
        rows = w_ptr + expert * stride_we + offs_n_safe.to(tl.int64) * stride_wn  # [BN]
        y, _ = stream_rows(rows, inter_ptr + pair.to(tl.int64) * inter_size, 0, inter_size, False, STREAM_K,
                           STREAM_EVEN, False, True)
    else:
        w_ptrs = w_ptr + expert * stride_we + offs_n_safe.to(tl.int64)[:, None] * stride_wn + offs_i[None, :]
        # The whole weight block goes out now: these loads are what overlaps gate/up's stream.
        if EVEN_I:
            w = tl.load(w_ptrs)  # [BN, BI]
        else:
            w = tl.load(w_ptrs, mask=(offs_i < inter_size)[None, :], other=0.0)
        _wait_for_pair(ready, gate_up_row_tiles)
        x_row = inter_ptr + pair.to(tl.int64) * inter_size + offs_i
        if EVEN_I:
            x = tl.load(x_row, cache_modifier=".cg")
        else:
            x = tl.load(x_row, mask=offs_i < inter_size, other=0.0, cache_modifier=".cg")
        y = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)  # [BN]
    # PDL: release after the weight stream, in kernels.pdl's mode (as moe_decode's down kernel).
    pdl_release_after_loop(USE_PDL)
    weighted_pair_and_k_sum(y, valid, pair, token, pid_n, offs_n, inter_ptr, topk_w_ptr, pair_ptr, ksum_ptr,
                            out_ptr, H, stride_ot, TOP_K, ROW_TILES_STRIDE, BLOCK_N)
    # The pair's last down program puts its two counters back to zero: every gate/up program of the pair counted
    # in before any down program passed its spin, and every down program has passed it.
    done = tl.atomic_add(consumed_ptr + pair, 1)
    if done == down_row_tiles - 1:
        tl.atomic_xchg(ready, 0)
        tl.atomic_xchg(consumed_ptr + pair, 0)


@triton.jit
def _one_launch_kernel(
    x_ptr,  # [T, H] activations (last dim contiguous)
    w_gu_ptr,  # [E, 2I, H] gate rows [0, I), up rows [I, 2I) (last dim contiguous)
    w_dn_ptr,  # [E, H, I] (last dim contiguous)
    ids_ptr,  # [T*K] expert of each pair, pair = t*K + k
    topk_w_ptr,  # [T*K] routing weights
    inter_ptr,  # [T*K, I] act(gate) * up in x's dtype
    pair_ptr,  # [T*K, H] scratch: weighted pair outputs, dtype promote(act, topk weights)
    counter_ptr,  # int32 [1 + 2 * MAX_PAIRS + tokens * ROW_TILES_STRIDE], zero between launches: the ticket,
    # the pairs' ready and consumed counts, the k-sum arrival counts
    out_ptr,  # [T, H]
    num_experts,
    H,
    inter_size,
    stride_xt,
    stride_gu_e,
    stride_gu_n,
    stride_dn_e,
    stride_dn_n,
    stride_ot,
    gate_up_row_tiles,
    down_row_tiles,
    n_pairs,
    TOP_K: tl.constexpr,
    ACT: tl.constexpr,  # 0 silu, 1 gelu_tanh
    MAX_PAIRS_: tl.constexpr,
    ROW_TILES_STRIDE: tl.constexpr,
    GU_BLOCK_N: tl.constexpr,
    GU_BLOCK_K: tl.constexpr,
    GU_EVEN_K: tl.constexpr,
    DN_BLOCK_N: tl.constexpr,
    DN_BLOCK_I: tl.constexpr,
    DN_EVEN_I: tl.constexpr,
    DN_STREAM_K: tl.constexpr = 0,
    DN_STREAM_EVEN: tl.constexpr = False,  # DN_STREAM_K divides I
    USE_PDL: tl.constexpr = False,  # kernels.pdl: launched as a programmatic dependent
):
    # PDL (kernels.pdl): the ids and activations come from earlier launches and the counters and scratch are
    # shared with the previous launch: wait before the ticket (the first atomic) in every program.
    pdl_wait(USE_PDL)
    pdl_release_after_wait(USE_PDL)
    n_gate_up = gate_up_row_tiles * n_pairs
    ticket = tl.atomic_add(counter_ptr, 1)
    if ticket == n_gate_up + down_row_tiles * n_pairs - 1:
        tl.atomic_xchg(counter_ptr, 0)  # every ticket is taken: ready for the next launch
    ready_ptr = counter_ptr + 1
    consumed_ptr = counter_ptr + 1 + MAX_PAIRS_
    ksum_ptr = counter_ptr + 1 + 2 * MAX_PAIRS_
    if ticket < n_gate_up:
        pair = ticket // gate_up_row_tiles
        gate_up_program(
            ticket % gate_up_row_tiles, pair, x_ptr, w_gu_ptr, ids_ptr, w_gu_ptr, inter_ptr, num_experts, H,
            inter_size, stride_xt, stride_gu_e, stride_gu_n, 0, 0, TOP_K, ACT, GU_BLOCK_N, GU_BLOCK_K, GU_EVEN_K,
            False, False, False, False, USE_PDL,
        )  # fmt: skip
        # Count in after every thread's store of the act * up rows (a pair with an invalid expert stored none;
        # it counts in all the same, so the pair's down programs never wait on it for ever).
        tl.debug_barrier()
        tl.atomic_add(ready_ptr + pair, 1, sem="release")
    else:
        d = ticket - n_gate_up
        _down_program(
            d % down_row_tiles, d // down_row_tiles, inter_ptr, w_dn_ptr, ids_ptr, topk_w_ptr, pair_ptr, ksum_ptr,
            out_ptr, ready_ptr, consumed_ptr, num_experts, H, inter_size, stride_dn_e, stride_dn_n, stride_ot,
            gate_up_row_tiles, down_row_tiles, TOP_K, ROW_TILES_STRIDE, DN_BLOCK_N, DN_BLOCK_I, DN_EVEN_I,
            DN_STREAM_K, DN_STREAM_EVEN, USE_PDL,
        )  # fmt: skip


def _counters(device: torch.device) -> torch.Tensor:
    """The launch's zeroed counters (``kernels.arrival_counters``): ticket, ready, consumed, k-sum."""
    return arrival_counters("moe_decode_one_launch", 1 + 2 * MAX_PAIRS + _TOKENS * _MAX_ROW_TILES, device)


def moe_decode_one_launch(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: Activation,
    *,
    config: OneLaunchConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``moe_decode.fused_moe_decode``'s contract (``fused_moe``'s arguments, shapes and rounding) for float
    experts in one launch; ValueError where ``fits_one_launch`` says no. ``config`` defaults to
    ``one_launch_config``."""
    shapes = check_moe_arguments(hidden, w_gate_up, w_down, topk_weights, topk_ids, activation, None, None)
    T, H, E, inter_size, K = shapes.tokens, shapes.hidden, shapes.experts, shapes.intermediate, shapes.top_k
    if T and not fits_one_launch(T, K, H, inter_size, shapes.int8):
        raise ValueError(f"moe_decode_one_launch does not take T={T}, K={K}, H={H}, I={inter_size}")
    if w_gate_up.stride(2) != 1 or w_down.stride(2) != 1 or hidden.stride(1) != 1:
        raise ValueError("hidden and the expert weights need a contiguous last dim")
    out = moe_output(hidden, out)
    if T == 0:
        return out
    cfg = config or one_launch_config(H, inter_size, hidden.element_size())
    block_i = triton.next_power_of_2(inter_size)
    if not cfg.down_stream_k and cfg.down_block_n * block_i > MAX_DOWN_BLOCK_ELEMENTS:
        raise ValueError(f"a down block of {cfg.down_block_n} x {block_i} is over {MAX_DOWN_BLOCK_ELEMENTS}")
    gate_up_row_tiles = triton.cdiv(inter_size, cfg.gate_up_block_n)
    down_row_tiles = triton.cdiv(H, cfg.down_block_n)
    if down_row_tiles > _MAX_ROW_TILES:
        raise ValueError(f"hidden size {H} needs {down_row_tiles} row tiles; at most {_MAX_ROW_TILES}")
    n_pairs = T * K
    dev = hidden.device
    inter = torch.empty(n_pairs, inter_size, dtype=hidden.dtype, device=dev)  # [T*K, I]
    pair_out = torch.empty(n_pairs, H, dtype=torch.promote_types(hidden.dtype, topk_weights.dtype), device=dev)
    grid = ((gate_up_row_tiles + down_row_tiles) * n_pairs,)
    _one_launch_kernel[grid](
        hidden, w_gate_up, w_down, topk_ids.reshape(-1), topk_weights.reshape(-1), inter, pair_out, _counters(dev),
        out, E, H, inter_size, hidden.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), w_down.stride(0),
        w_down.stride(1), out.stride(0), gate_up_row_tiles, down_row_tiles, n_pairs,
        TOP_K=K, ACT=ACT_CODES[activation], MAX_PAIRS_=MAX_PAIRS, ROW_TILES_STRIDE=_MAX_ROW_TILES,
        GU_BLOCK_N=cfg.gate_up_block_n, GU_BLOCK_K=cfg.gate_up_block_k, GU_EVEN_K=H % cfg.gate_up_block_k == 0,
        DN_BLOCK_N=cfg.down_block_n, DN_BLOCK_I=block_i, DN_EVEN_I=block_i == inter_size, DN_STREAM_K=cfg.down_stream_k,
        DN_STREAM_EVEN=bool(cfg.down_stream_k) and inter_size % cfg.down_stream_k == 0,
        num_warps=cfg.warps, **pdl_launch(loop="moe"),
    )  # fmt: skip
    return out
