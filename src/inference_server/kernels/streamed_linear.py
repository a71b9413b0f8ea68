"""The weight-streaming Triton linear kernel shared by ``int8_linear`` (int8 weights, per-row scale) and
``dense_linear`` (float weights): ``y = x @ W.T [* scale]``, fp32 accumulation, rounded to ``x.dtype``.

Kernel shape ("swap AB"): each program computes a ``[BLOCK_N, BLOCK_T]`` tile of ``y.T`` as
``dot(W[BLOCK_N, BLOCK_K] -> x dtype, x.T[BLOCK_K, BLOCK_T])``. The weight is the dot's left operand (Hopper's
wgmma may take it from registers, where an int8 tile is converted; its right operand must be in shared memory,
where the pipeliner already put the x tile); the token count is the dot's narrow side, so a decode step
(T = 1..16) pads tokens to 16 instead of weight rows to 64. Weight tiles stream once through the K loop with
``num_stages`` loads in flight; at decode the layer is a GEMV bound by the weight read.

Enough programs to keep HBM busy: the grid is (token tiles, weight-row tiles, K splits), token tiles fastest
so the programs running together share weight tiles (each weight byte leaves HBM about once even at
prefill). Where the tiles are too few to keep enough loads in flight (``o_proj``/``down_proj`` of wide models
at decode: N = 5376 is 84 tiles of 64 rows for 132 SMs), K is split (``wave_split_k``'s wave model): each split
writes fp32 partial sums, and a second small kernel adds the splits in a fixed order, applies the scale (int8)
and casts (deterministic, no atomics, no zero-fill).

A config's ``block_t`` below 16 runs the CUDA-core GEMV of ``kernels/int8_gemv.py`` (int8 or float weights;
same outputs and partial sums, so the same reduce kernel). int8 weights have one more path: ``magic_dequant``
converts the bytes by the exponent trick (``int8_dequant``) instead of the quarter-rate conversion instruction.

No host syncs and the grid comes from shapes only, so calls are CUDA-graph capturable. The token count ``T``
is not specialised (``do_not_specialize``): steps of every size share the compiled variants of their config,
and configs change only at token-count buckets (each front's heuristic over its bucket table, or the tuned
configs of ``int8_linear_configs``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from inference_server.kernels.int8_dequant import int8_to_fp32_exact
from inference_server.kernels.int8_gemv import launch_gemv
from inference_server.kernels.int8_linear_configs import Int8LinearConfig, tuned_int8_linear_config
from inference_server.kernels.moe_configs import device_name, tuned_configs_enabled
from inference_server.kernels.pdl import (
    pdl_launch,
    pdl_release,
    pdl_release_after_loop,
    pdl_release_after_wait,
    pdl_wait,
)
from inference_server.kernels.streamed_tile import store_streamed_tile

__all__ = ["GEMV_MAX_TOKENS", "H200_SMS", "HBM_BYTES_PER_S", "MIN_DOT_TOKENS", "REDUCE_LAUNCH_S", "Bucket",
           "bucket_config", "bucket_of", "dividing_block_k", "effective_split_k", "gemv_config", "is_one_split_gemv",
           "max_split_k", "pow2_clamp", "resolve_config", "streamed_linear", "wave_split_k"]

H200_SMS = 132
MIN_DOT_TOKENS = 16  # tl.dot's smallest token tile; configs with a smaller block_t run the CUDA-core GEMV
_MIN_K_PER_SPLIT = 512  # a split streams at least this many K columns
_MAX_SPLIT_K = 16
HBM_BYTES_PER_S = 4.3e12  # measured on the H200 (bench/roofline.py)
REDUCE_LAUNCH_S = 3e-6  # one more kernel in the step's graph: launch gap plus a short tail
_SATURATING_WAVE = 0.4  # fraction of the resident programs whose loads in flight already saturate HBM


@dataclass(frozen=True)
class Bucket:
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
    magic_dequant: int = 0  # int8 weights: the exponent-trick dequantisation (kernels/int8_dequant)


def pow2_clamp(value: int, lo: int, hi: int) -> int:
    """The next power of two of ``value``, clamped to [lo, hi]."""
    return max(lo, min(hi, triton.next_power_of_2(max(1, value))))


def dividing_block_k(k_dim: int, cap: int) -> int:
    """Largest power of two <= cap (and >= 32) dividing k_dim, so the K loop needs no masks; else cap
    (clamped to k_dim's next power of two, at least 16)."""
    cap = pow2_clamp(k_dim, 16, cap)
    bk = cap
    while bk >= 32:
        if k_dim % bk == 0:
            return bk
        bk //= 2
    return cap


def wave_split_k(tiles: int, n: int, k: int, tokens: int, block_k: int, slots: int, weight_bytes: int = 1) -> int:
    """K splits that minimise a wave model of a memory-bound launch.

    ``tiles * split`` programs run in waves of ``slots``. The weight read takes ``N*K*weight_bytes / HBM`` at
    best; a launch whose last wave holds a fraction ``f`` of the slots takes as long as if it held ``max(f, 0.4)``
    (fewer programs than that do not keep enough loads in flight to saturate HBM: at decode a wave of 84 tiles,
    Gemma-4-31B ``down_proj`` on 132 SMs, runs at well under the limit; so does a last wave of a dozen programs).
    A split costs a reduce launch and its fp32 partial sums (written and read once). Ties go to fewer splits.
    """
    max_split = max_split_k(k, block_k)
    weight_s = n * k * weight_bytes / HBM_BYTES_PER_S
    best_split, best_cost = 1, float("inf")
    for split in range(1, max_split + 1):
        waves = tiles * split / slots
        full = int(waves)
        tail = waves - full
        cost = (full + (max(tail, _SATURATING_WAVE) if tail > 1e-9 else 0.0)) / waves
        if split > 1:
            cost += (REDUCE_LAUNCH_S + 2 * split * tokens * n * 4 / HBM_BYTES_PER_S) / weight_s
        if cost < best_cost - 1e-9:
            best_split, best_cost = split, cost
    return best_split


def bucket_config(buckets: tuple[Bucket, ...], num_tokens: int, out_features: int, in_features: int,
                  element_size: int, weight_bytes: int, num_sms: int = H200_SMS) -> Int8LinearConfig:
    """The config of ``num_tokens``' bucket (the first whose ``max_tokens`` holds it) at this shape: one config
    per bucket, so steps of every size inside a bucket share compiled variants. Activations of 4 bytes (fp32)
    get half the K depth: the same shared memory as the 2-byte case. K is split by ``wave_split_k`` where the
    bucket allows it (one token tile: the split then depends on the bucket, not on T)."""
    bucket = bucket_of(buckets, num_tokens)
    cap_k = bucket.cap_k // 2 if element_size > 2 else bucket.cap_k
    block_n = min(bucket.block_n, pow2_clamp(out_features, 16, 1 << 30))
    block_k = dividing_block_k(in_features, cap_k)
    split = 1
    if bucket.may_split:
        split = wave_split_k(triton.cdiv(out_features, block_n), out_features, in_features, bucket.max_tokens,
                             block_k, bucket.programs_per_sm * num_sms, weight_bytes)
    return Int8LinearConfig(block_n, bucket.block_t, block_k, split, bucket.num_warps, bucket.num_stages,
                            magic_dequant=bucket.magic_dequant)


GEMV_MAX_TOKENS = 2
"""Steps of at most this many tokens take the CUDA-core GEMV in both fronts' heuristics (``gemv_config``)."""


def gemv_config(num_tokens: int, in_features: int) -> Int8LinearConfig:
    """The CUDA-core GEMV's heuristic config for 1-2 tokens (``kernels/int8_gemv.py``): 8 weight rows a program (16
    at 2 tokens with 1024-column tiles), K tiles of up to 1024 columns dividing K, one warp per 256 columns (narrower
    tiles make Triton exchange operands through shared memory every tile), no split. The tuning sweeps chose exactly
    these at every Gemma-4-31B int8 shape and at Qwen3-30B-A3B's bf16 q/k/v and o_proj at one token, ahead of the
    tensor-core kernel and of cuBLAS (docs/benchmarks.md, the CUDA-core GEMV)."""
    block_k = dividing_block_k(in_features, 1024)
    tokens = max(1, min(num_tokens, GEMV_MAX_TOKENS))
    block_n = 16 if tokens > 1 and block_k >= 1024 else 8
    return Int8LinearConfig(block_n, tokens, block_k, 1, max(1, min(4, block_k // 256)), 1)


def bucket_of(buckets: tuple[Bucket, ...], num_tokens: int) -> Bucket:
    """The first bucket whose ``max_tokens`` holds ``num_tokens`` (at least 1)."""
    return next(b for b in buckets if max(1, num_tokens) <= b.max_tokens)


def max_split_k(k: int, block_k: int) -> int:
    """The most K splits worth a launch: each streams at least 512 columns, at most 16 splits."""
    return max(1, min(_MAX_SPLIT_K, k // max(_MIN_K_PER_SPLIT, block_k)))


@triton.jit
def _weight_dot(w, x, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr, MAGIC: tl.constexpr):
    """acc += w @ x, the weight tile converted to x's dtype in registers (int8 values are exact in every float
    type; a float weight already has x's dtype, so its conversions are no-ops). IEEE: exact fp32 products (fp32
    activations, no TF32). UPCAST: interpreter-only (the interpreter's numpy dot and int8 -> bf16 conversion
    mishandle bf16): both sides go to fp32; never on GPU. MAGIC (int8 only): the bytes go to fp32 by the exponent
    trick (``int8_dequant``), not the quarter-rate conversion."""
    if MAGIC:
        w = int8_to_fp32_exact(w)  # exact values in fp32: the other paths take them from here
    if UPCAST:
        acc = tl.dot(w.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        acc = tl.dot(w.to(tl.float32), x, acc, input_precision="ieee")
    else:
        acc = tl.dot(w.to(x.dtype), x, acc)
    return acc


@triton.jit(do_not_specialize=["T"])
def _streamed_linear_kernel(
    x_ptr,  # [T, K] activations
    w_ptr,  # [N, K] int8, or float of x's dtype
    scale_ptr,  # [N] per-output-channel scale (HAS_SCALE; else any pointer, unread)
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
    HAS_SCALE: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    MAGIC: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kernels.pdl: launched as a programmatic dependent
):
    # PDL (kernels.pdl): x comes from the previous launch and the output (or partial-sum workspace) may still be read
    # by an earlier one; the weight tiles are pipelined in the same loop as x's, so they too are loaded after the
    # wait, so wait before the first load.
    pdl_wait(USE_PDL)
    pdl_release_after_wait(USE_PDL)
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
            w = tl.load(w_ptrs)  # [BN, BK]
            x = tl.load(x_ptrs, mask=t_ok[None, :], other=0.0)  # [BK, BT]
        else:
            k_ok = offs_k < k_len - kb * BLOCK_K
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0)
            x = tl.load(x_ptrs, mask=t_ok[None, :] & k_ok[:, None], other=0.0)
        acc = _weight_dot(w, x, acc, IEEE, UPCAST, MAGIC)
        w_ptrs += BLOCK_K * stride_wk
        x_ptrs += BLOCK_K * stride_xk
    # Release after the main loop (kernels.pdl's mode; the other releases right after the wait): only the epilogue
    # is left, so the next launch's CTAs (resident from here on, waiting) hold no shared memory and registers while
    # this kernel's programs still stream their tiles.
    pdl_release_after_loop(USE_PDL)
    store_streamed_tile(acc, out_ptr, scale_ptr, offs_t, t_ok, offs_n, N, pid_s, stride_os, stride_ot, stride_scale,
                        SPLIT_K, HAS_SCALE)


@triton.jit(do_not_specialize=["T"])
def _split_k_reduce_kernel(
    part_ptr,  # [SPLIT_K, T, N] fp32
    scale_ptr,  # [N] (HAS_SCALE)
    out_ptr,  # [T, N]
    T,
    N,
    stride_ps,
    stride_pt,
    stride_scale,
    stride_ot,
    SPLIT_K: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kernels.pdl: launched as a programmatic dependent
):
    # PDL (kernels.pdl): the partial sums come from the split kernel just before, so wait before the first load and
    # store; a short kernel, so release the next launch at once (its CTAs get resident and wait while this one runs).
    pdl_wait(USE_PDL)
    pdl_release(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order: deterministic
        acc += tl.load(part_ptr + s * stride_ps + t * stride_pt + offs, mask=mask, other=0.0)
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + offs * stride_scale, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# TRITON_INTERPRET=1 is read when a kernel is decorated: the kernels are then interpreter objects.
_INTERPRETED = not isinstance(_streamed_linear_kernel, triton.runtime.JITFunction)


def resolve_config(x: torch.Tensor, out_features: int, heuristic: Callable[[int, int, int, int], Int8LinearConfig],
                   config_dir: Path) -> Int8LinearConfig:
    """The config ``streamed_linear`` runs ``x [T, K]`` against ``out_features`` weight rows with when not given
    one: the tuned config for this GPU and shape in ``config_dir`` (``int8_linear_configs``; only while
    ``moe_configs.tuned_configs`` is on), else ``heuristic(T, N, K, x.element_size())``."""
    T, K = x.shape
    cfg = None
    if tuned_configs_enabled():  # the switch fused_moe's tuned configs follow too
        cfg = tuned_int8_linear_config(T, out_features, K, x.dtype, device_name(x.device), config_dir)
    return cfg or heuristic(T, out_features, K, x.element_size())


def effective_split_k(config: Int8LinearConfig, in_features: int) -> int:
    """The K splits ``streamed_linear`` launches for ``config``: its ``split_k``, but no empty split."""
    split = max(1, min(config.split_k, triton.cdiv(in_features, config.block_k)))
    k_per_split = triton.cdiv(triton.cdiv(in_features, split), config.block_k) * config.block_k
    return triton.cdiv(in_features, k_per_split)


def is_one_split_gemv(config: Int8LinearConfig, in_features: int) -> bool:
    """Whether ``config`` runs ``in_features`` columns as the CUDA-core GEMV in one K split (whole fp32 sums in one
    program: what an epilogue or a launch shared with other work needs)."""
    return config.block_t < MIN_DOT_TOKENS and effective_split_k(config, in_features) == 1


def streamed_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, *,
                    config: Int8LinearConfig | None, out: torch.Tensor | None,
                    heuristic: Callable[[int, int, int, int], Int8LinearConfig], config_dir: Path) -> torch.Tensor:
    """``x [T, K] @ weight[N, K].T`` (times ``scale [N]`` when given) into ``out`` (allocated when None), for the
    kernels' public wrappers, which have checked the weight's dtype and that the shapes agree.

    ``config`` defaults to the tuned config for this GPU and shape in ``config_dir`` (``int8_linear_configs``;
    only while ``moe_configs.tuned_configs`` is on), else ``heuristic(T, N, K, x.element_size())``. A
    config's ``block_t`` below 16 runs the CUDA-core GEMV (``kernels/int8_gemv.py``, int8 or float weights, same
    outputs), else the tensor-core kernel here."""
    T, K = x.shape
    N = weight.shape[0]
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be fp32, fp16 or bf16, not {x.dtype}")
    if out is None:
        out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (T, N) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be [{T}, {N}] {x.dtype} with a contiguous last dim")
    if T == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    cfg = config or resolve_config(x, N, heuristic, config_dir)
    gemv = cfg.block_t < MIN_DOT_TOKENS
    if cfg.magic_dequant and scale is None and not gemv:
        raise ValueError(f"{cfg}: the exponent-trick dequantisation takes int8 weights only")
    split = effective_split_k(cfg, K)
    k_per_split = triton.cdiv(triton.cdiv(K, split), cfg.block_k) * cfg.block_k
    grid = (triton.cdiv(T, cfg.block_t), triton.cdiv(N, cfg.block_n), split)
    dest = out if split == 1 else torch.empty(split, T, N, dtype=torch.float32, device=x.device)
    scale_arg = scale if scale is not None else weight  # a valid pointer the kernel never reads
    stride_scale = scale.stride(0) if scale is not None else 0
    args = (x, weight, scale_arg, dest, T, N, K, k_per_split,
            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), stride_scale,
            dest.stride(0) if split > 1 else 0, dest.stride(-2))
    tiles = dict(BLOCK_N=cfg.block_n, BLOCK_T=cfg.block_t, BLOCK_K=cfg.block_k, SPLIT_K=split,
                 EVEN_K=K % cfg.block_k == 0)
    if gemv:  # the CUDA-core GEMV (kernels/int8_gemv.py), int8 or float weights
        launch_gemv(grid, x, weight, scale, dest, k_per_split, args[13], block_n=cfg.block_n,
                    block_t=cfg.block_t, block_k=cfg.block_k, split_k=split, num_warps=cfg.num_warps,
                    num_stages=cfg.num_stages, interpreted=_INTERPRETED)  # args[13]: stride_os
    else:
        _streamed_linear_kernel[grid](
            *args, **tiles, HAS_SCALE=scale is not None, IEEE=x.dtype == torch.float32,
            UPCAST=_INTERPRETED and x.dtype != torch.float32, MAGIC=bool(cfg.magic_dequant),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(loop="gemv"),
        )  # fmt: skip
    if split > 1:
        block = pow2_clamp(N, 16, 1024)
        _split_k_reduce_kernel[(T, triton.cdiv(N, block))](
            dest, scale_arg, out, T, N, dest.stride(0), dest.stride(1), stride_scale, out.stride(0),
            SPLIT_K=split, HAS_SCALE=scale is not None, BLOCK=block, num_warps=4 if block >= 512 else 1,
            **pdl_launch(),
        )  # fmt: skip
    return out
