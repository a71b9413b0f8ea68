"""Triton int8 weight-only linear layer: ``y = (x @ qweight.T) * scale``, dequantised in registers.

Contract (``reference_int8.int8_linear_reference`` is the oracle): ``x [T, K]`` (bf16, fp16 or fp32, any
strides), ``qweight [N, K]`` int8, ``scale [N]`` (any float dtype); the products are accumulated in fp32, the
per-output-channel scale is applied once after the reduction, the result is rounded to ``x.dtype``.

Kernel shape ("swap AB"): each program computes a ``[BLOCK_N, BLOCK_T]`` tile of ``y.T`` as
``dot(W[BLOCK_N, BLOCK_K] -> x dtype, x.T[BLOCK_K, BLOCK_T])``. The weight, converted from int8 in registers,
is the dot's left operand, which Hopper's wgmma may take from registers (its right operand must be in shared
memory, where the pipeliner already put the x tile); the token count is the dot's narrow side, so a decode step
(T = 1..16) pads tokens to 16 instead of weight rows to 64. Weight tiles stream once through the K loop with
``num_stages`` loads in flight; at decode the layer is a GEMV bound by the int8 weight read (half of bf16's).

Enough programs to keep HBM busy: the grid is (token tiles, weight-row tiles, K splits), token tiles fastest
so the programs running together share weight tiles (each weight byte leaves HBM about once even at
prefill). Where the tiles are too few to keep enough loads in flight (``o_proj``/``down_proj`` of wide models
at decode: N = 5376 is 84 tiles of 64 rows for 132 SMs), K is split (``_split_k``'s wave model): each split
writes fp32 partial sums, and a second small kernel adds the splits in a fixed order, applies the scale and
casts (deterministic, no atomics, no zero-fill).

No host syncs and the grid comes from shapes only, so calls are CUDA-graph capturable. The token count ``T``
is not specialised (``do_not_specialize``): steps of every size share the compiled variants of their config,
and configs change only at token-count buckets (``int8_linear_config``, or the tuned buckets of
``int8_linear_configs`` written by ``bench/int8_kernels.py --sweep --write``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from inference_server.kernels.int8_dequant import int8_to_fp32_exact
from inference_server.kernels.int8_gemv import int8_gemv_kernel
from inference_server.kernels.int8_linear_configs import Int8LinearConfig, tuned_int8_linear_config
from inference_server.kernels.moe_configs import device_name, tuned_configs_enabled

__all__ = ["Int8LinearConfig", "int8_linear", "int8_linear_config"]

_H200_SMS = 132
_MIN_DOT_TOKENS = 16  # tl.dot's smallest token tile; configs with a smaller block_t run the CUDA-core GEMV
_MIN_K_PER_SPLIT = 512  # a split streams at least this many K columns
_MAX_SPLIT_K = 16
_HBM_BYTES_PER_S = 4.3e12  # measured on the H200 (bench/roofline.py)
_REDUCE_LAUNCH_S = 3e-6  # one more kernel in the step's graph: launch gap plus a short tail
_SATURATING_WAVE = 0.4  # fraction of the resident programs whose loads in flight already saturate HBM


@dataclass(frozen=True)
class _Bucket:
    """Tiles of one token-count bucket and how many of its programs an H200 SM holds at once (shared memory and
    registers of the sm_90 build at bf16: ``tests/kernels/test_kernels_compile_for_h200.py`` checks the former)."""

    max_tokens: int
    block_t: int
    block_n: int
    cap_k: int
    num_warps: int
    num_stages: int
    programs_per_sm: int
    may_split: bool
    magic_dequant: int = 0


_BUCKETS = (
    # decode GEMV: 72 KB shared; the exponent-trick dequantisation and 256-column tiles measured 10-16 % faster on
    # the H200 than the conversion instruction with 128 (bench/int8_kernels.py --sweep, 2026-11-30)
    _Bucket(16, 16, 64, 256, 4, 3, 3, True, magic_dequant=1),
    _Bucket(32, 32, 64, 128, 4, 4, 4, True),  # 56 KB, 117 registers
    _Bucket(64, 64, 64, 128, 4, 4, 2, True),  # 88 KB, 167 registers
    _Bucket(128, 128, 128, 64, 8, 4, 1, True),  # one token tile: the split still depends on the bucket only
    _Bucket(1 << 62, 128, 128, 64, 8, 4, 1, False),  # prefill GEMM: token tiles vary with T, so never split
)


def _pow2_clamp(value: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(1, value))))


def _block_k(k_dim: int, cap: int) -> int:
    """Largest power of two <= cap (and >= 32) dividing k_dim, so the K loop needs no masks; else cap
    (clamped to k_dim's next power of two, at least 16)."""
    cap = _pow2_clamp(k_dim, 16, cap)
    bk = cap
    while bk >= 32:
        if k_dim % bk == 0:
            return bk
        bk //= 2
    return cap


def _split_k(tiles: int, n: int, k: int, tokens: int, block_k: int, slots: int) -> int:
    """K splits that minimise a wave model of a memory-bound launch.

    ``tiles * split`` programs run in waves of ``slots``. The weight read takes ``N*K / HBM`` at best; a launch
    whose last wave holds a fraction ``f`` of the slots takes as long as if it held ``max(f, 0.4)`` (fewer
    programs than that do not keep enough loads in flight to saturate HBM: at decode a wave of 84 tiles, Gemma-4-31B
    ``down_proj`` on 132 SMs, runs at well under the limit; so does a last wave of a dozen programs). A split
    costs a reduce launch and its fp32 partial sums (written and read once). Ties go to fewer splits.
    """
    max_split = max(1, min(_MAX_SPLIT_K, k // max(_MIN_K_PER_SPLIT, block_k)))
    weight_s = n * k / _HBM_BYTES_PER_S
    best_split, best_cost = 1, float("inf")
    for split in range(1, max_split + 1):
        waves = tiles * split / slots
        full = int(waves)
        tail = waves - full
        cost = (full + (max(tail, _SATURATING_WAVE) if tail > 1e-9 else 0.0)) / waves
        if split > 1:
            cost += (_REDUCE_LAUNCH_S + 2 * split * tokens * n * 4 / _HBM_BYTES_PER_S) / weight_s
        if cost < best_cost - 1e-9:
            best_split, best_cost = split, cost
    return best_split


def int8_linear_config(
    num_tokens: int, out_features: int, in_features: int, element_size: int = 2, num_sms: int = _H200_SMS
) -> Int8LinearConfig:
    """Heuristic config of a token-count bucket (1-16, 17-32, 33-64, 65-128, larger): one config per bucket, so
    steps of every size inside a bucket share compiled variants.

    Decode buckets are weight-streaming GEMVs: 64 weight rows (one wgmma M tile for 4 warps), 128-column int8
    tiles, 4 stages, small enough that 4-5 programs share an SM (many slots: short tails). K is split by
    ``_split_k`` where the weight-row tiles are too few. Prefill buckets are ordinary 128x128 GEMM tiles.
    Activations of 4 bytes (fp32) get half the K depth: the same shared memory as the 2-byte case.
    """
    t = max(1, num_tokens)
    bucket = next(b for b in _BUCKETS if t <= b.max_tokens)
    cap_k = bucket.cap_k // 2 if element_size > 2 else bucket.cap_k
    block_n = min(bucket.block_n, _pow2_clamp(out_features, 16, 1 << 30))
    block_k = _block_k(in_features, cap_k)
    split = 1
    if bucket.may_split:  # one token tile (block_t = bucket size): the split depends on the bucket, not on T
        split = _split_k(triton.cdiv(out_features, block_n), out_features, in_features, bucket.max_tokens, block_k,
                         bucket.programs_per_sm * num_sms)
    return Int8LinearConfig(block_n, bucket.block_t, block_k, split, bucket.num_warps, bucket.num_stages,
                            bucket.magic_dequant)


@triton.jit
def _int8_dot(w, x, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr, MAGIC: tl.constexpr):
    """acc += w @ x for an int8 tile ``w``, converted to x's dtype in registers (int8 values are exact in every
    float type). IEEE: exact fp32 products (fp32 activations, no TF32). UPCAST: interpreter-only (the
    interpreter's numpy dot and int8 -> bf16 conversion mishandle bf16): both sides go to fp32; never on GPU.
    MAGIC: the bytes go to fp32 by the exponent trick (``int8_dequant``), not the quarter-rate conversion."""
    if MAGIC:
        wf = int8_to_fp32_exact(w)
    else:
        wf = w.to(tl.float32)
    if UPCAST:
        acc = tl.dot(wf, x.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        acc = tl.dot(wf, x, acc, input_precision="ieee")
    elif MAGIC:
        acc = tl.dot(wf.to(x.dtype), x, acc)
    else:
        acc = tl.dot(w.to(x.dtype), x, acc)
    return acc


@triton.jit(do_not_specialize=["T"])
def _int8_linear_kernel(
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
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # every split's K range is a whole number of BLOCK_K tiles: no K masks
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    MAGIC: tl.constexpr,
):
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
    x_ptrs = x_ptr + offs_t.to(tl.int64)[None, :] * stride_xt + (k_start + offs_k)[:, None] * stride_xk
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for kb in range(0, tl.cdiv(k_len, BLOCK_K)):
        if EVEN_K:
            w = tl.load(w_ptrs)  # [BN, BK] int8
            x = tl.load(x_ptrs, mask=t_ok[None, :], other=0.0)  # [BK, BT]
        else:
            k_ok = offs_k < k_len - kb * BLOCK_K
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0)
            x = tl.load(x_ptrs, mask=t_ok[None, :] & k_ok[:, None], other=0.0)
        acc = _int8_dot(w, x, acc, IEEE, UPCAST, MAGIC)
        w_ptrs += BLOCK_K * stride_wk
        x_ptrs += BLOCK_K * stride_xk
    out_mask = (offs_n < N)[:, None] & t_ok[None, :]
    o_ptrs = out_ptr + offs_t.to(tl.int64)[None, :] * stride_ot + offs_n[:, None]
    if SPLIT_K == 1:
        scale = tl.load(scale_ptr + offs_n_safe * stride_scale).to(tl.float32)  # [BN]
        tl.store(o_ptrs, (acc * scale[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(o_ptrs + pid_s.to(tl.int64) * stride_os, acc, mask=out_mask)


@triton.jit(do_not_specialize=["T"])
def _int8_split_k_reduce_kernel(
    part_ptr,  # [SPLIT_K, T, N] fp32
    scale_ptr,  # [N]
    out_ptr,  # [T, N]
    T,
    N,
    stride_ps,
    stride_pt,
    stride_scale,
    stride_ot,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order: deterministic
        acc += tl.load(part_ptr + s * stride_ps + t * stride_pt + offs, mask=mask, other=0.0)
    scale = tl.load(scale_ptr + offs * stride_scale, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs, (acc * scale).to(out_ptr.dtype.element_ty), mask=mask)


# TRITON_INTERPRET=1 is read when a kernel is decorated: the kernels are then interpreter objects.
_INTERPRETED = not isinstance(_int8_linear_kernel, triton.runtime.JITFunction)


def int8_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    *,
    config: Int8LinearConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(x @ qweight.T)`` accumulated in fp32, times ``scale`` per output channel, rounded to ``x.dtype``.

    Shapes: ``x [T, K]`` (fp32, fp16 or bf16; any strides), ``qweight [N, K]`` int8 (any strides),
    ``scale [N]`` float. Returns ``[T, N]`` in ``x.dtype`` (written into ``out`` when given: its last dim must
    be contiguous). No host syncs; temporaries come from the caching allocator (CUDA-graph capturable).
    ``config`` defaults to the tuned config for this GPU and shape (``int8_linear_configs``; only while
    ``moe_configs.use_tuned_configs`` is on), else the heuristic ``int8_linear_config(T, N, K)``.
    """
    if x.dim() != 2 or qweight.dim() != 2 or scale.dim() != 1:
        raise ValueError(f"want x [T, K], qweight [N, K], scale [N]; got {tuple(x.shape)}, "
                         f"{tuple(qweight.shape)}, {tuple(scale.shape)}")
    T, K = x.shape
    N = qweight.shape[0]
    if qweight.shape[1] != K or scale.shape[0] != N:
        raise ValueError(f"shapes disagree: x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, "
                         f"scale {tuple(scale.shape)}")
    if qweight.dtype != torch.int8:
        raise ValueError(f"qweight must be int8, not {qweight.dtype}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or not scale.is_floating_point():
        raise ValueError(f"x must be fp32/fp16/bf16 and scale a float tensor; got {x.dtype}, {scale.dtype}")
    if out is None:
        out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (T, N) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be [{T}, {N}] {x.dtype} with a contiguous last dim")
    if T == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    cfg = config
    if cfg is None and tuned_configs_enabled():  # the switch fused_moe's tuned configs follow too
        cfg = tuned_int8_linear_config(T, N, K, x.dtype, device_name(x.device))
    cfg = cfg or int8_linear_config(T, N, K, x.element_size())
    split = max(1, min(cfg.split_k, triton.cdiv(K, cfg.block_k)))
    k_per_split = triton.cdiv(triton.cdiv(K, split), cfg.block_k) * cfg.block_k
    split = triton.cdiv(K, k_per_split)  # no empty split
    grid = (triton.cdiv(T, cfg.block_t), triton.cdiv(N, cfg.block_n), split)
    dest = out if split == 1 else torch.empty(split, T, N, dtype=torch.float32, device=x.device)
    args = (x, qweight, scale, dest, T, N, K, k_per_split,
            x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1), scale.stride(0),
            dest.stride(0) if split > 1 else 0, dest.stride(-2))
    tiles = dict(BLOCK_N=cfg.block_n, BLOCK_T=cfg.block_t, BLOCK_K=cfg.block_k, SPLIT_K=split,
                 EVEN_K=K % cfg.block_k == 0)
    if cfg.block_t < _MIN_DOT_TOKENS:  # the CUDA-core GEMV (kernels/int8_gemv.py)
        int8_gemv_kernel[grid](*args, **tiles, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    else:
        _int8_linear_kernel[grid](
            *args, **tiles, IEEE=x.dtype == torch.float32, UPCAST=_INTERPRETED and x.dtype != torch.float32,
            MAGIC=bool(cfg.magic_dequant), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    if split > 1:
        block = _pow2_clamp(N, 16, 1024)
        _int8_split_k_reduce_kernel[(T, triton.cdiv(N, block))](
            dest, scale, out, T, N, dest.stride(0), dest.stride(1), scale.stride(0), out.stride(0),
            SPLIT_K=split, BLOCK=block, num_warps=4 if block >= 512 else 1,
        )  # fmt: skip
    return out
