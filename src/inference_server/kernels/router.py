"""Triton MoE routing: softmax, top-k, renormalisation, per-expert scale and the cast in one launch.

The reference (``models/architectures/ops.torch_route``) is five to seven PyTorch kernels per MoE layer at
decode (softmax, topk, sum, divide, gather and multiply or cast); here one program per token row does all of it
in registers:

* ``p = softmax(logits)`` in fp32 over the row's E experts (E <= 1024, padded to a power of two);
* the top-k by K rounds of "take the largest, lowest expert id among equals" (descending, as ``torch.topk``).
  Exact ties happen with bf16 logits (8 bits of mantissa over 128 experts); ``torch.topk`` leaves their order
  unspecified (on the CPU it took the higher id first), so at a tie on the k-th place the two may route a
  token to different, equally weighted experts: within bf16's tolerance, never in fp32 tests;
* if ``renormalize``: ``w / sum(w)`` in fp32 (Qwen3-MoE with ``norm_topk_prob``, Gemma 4);
* if ``per_expert_scale`` is given: ``w * float(scale[id])`` (Gemma 4);
* ``w`` stored in ``out_dtype`` (Qwen casts to the activation dtype; Gemma keeps fp32), ids as int64.

fp32 results match the reference to within a few ulp (``exp`` and the summation order differ); the bf16 cast
is then exact or one bf16 ulp apart.

``linear_route`` also computes the router logits ``x @ weight.T`` in the same launch, for decode-sized T (the
unfused router GEMV's time is nearly all launch cost for its few hundred KB of weights: docs/benchmarks.md).
Programs over (expert group, token row) each dot one row with a few experts' weight rows in fp32 and round the
logits to the activation dtype, as the unfused path's cuBLAS output is rounded, into a scratch row; the last program
to finish (an arrival counter) routes every row as above. The logits differ from cuBLAS's only by the fp32 summation
order, so the expert choice is the unfused path's except where two logits are within an ulp of a tie.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from inference_server.kernels.arrival_counters import arrival_counters
from inference_server.kernels.pdl import (
    pdl_launch,
    pdl_release,
    pdl_release_after_loop,
    pdl_release_after_wait,
    pdl_wait,
)
from inference_server.kernels.rmsnorm import NormMode, times_norm_weight

__all__ = ["RouteLaunch", "add_norm_linear_route", "linear_route", "linear_route_program", "route_arguments",
           "triton_route"]

MAX_EXPERTS = 1024
MAX_FUSED_ROWS = 64
"""Most token rows ``linear_route`` takes: the last program routes them all as one [rows, experts] tile."""


@triton.jit
def _route_rows(
    x,  # [ROWS, BLOCK_E] fp32 logits; experts >= E are ignored
    E,
    scale_ptr,  # [E] or a dummy
    ROWS: tl.constexpr,
    K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Softmax, top-k, renormalisation and scale of each row (the module docstring's steps): ``(w [ROWS, BLOCK_K]
    fp32, ids [ROWS, BLOCK_K] int32)``, slots >= K undefined."""
    experts = tl.arange(0, BLOCK_E)[None, :] + tl.zeros([ROWS, 1], dtype=tl.int32)  # [R, BE]
    valid = experts < E
    x = tl.where(valid, x, -float("inf"))
    shifted = tl.exp(x - tl.max(x, axis=1)[:, None])
    shifted = tl.where(valid, shifted, 0.0)
    probs = shifted / tl.sum(shifted, axis=1)[:, None]  # [R, BE]
    remaining = tl.where(valid, probs, -1.0)  # probabilities are >= 0: -1 marks padding and taken experts
    slots = tl.arange(0, BLOCK_K)[None, :] + tl.zeros([ROWS, 1], dtype=tl.int32)  # [R, BK]
    top_w = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
    top_id = tl.zeros([ROWS, BLOCK_K], dtype=tl.int32)
    for k in tl.static_range(K):
        best = tl.max(remaining, axis=1)  # [R]
        best_id = tl.min(tl.where(remaining == best[:, None], experts, BLOCK_E), axis=1)  # [R]
        top_w = tl.where(slots == k, best[:, None], top_w)
        top_id = tl.where(slots == k, best_id[:, None], top_id)
        remaining = tl.where(experts == best_id[:, None], -1.0, remaining)
    in_k = slots < K
    if RENORMALIZE:
        top_w = top_w / tl.sum(tl.where(in_k, top_w, 0.0), axis=1)[:, None]
    if HAS_SCALE:
        top_w = top_w * tl.load(scale_ptr + top_id, mask=in_k, other=0.0).to(tl.float32)
    return top_w, top_id


@triton.jit(do_not_specialize=["n_rows"])
def _route_kernel(
    logits_ptr,  # [T, E]
    scale_ptr,  # [E] or a dummy
    weights_ptr,  # [T, K] out
    ids_ptr,  # [T, K] int64 out
    n_rows,
    E,
    stride_row,
    K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kernels.pdl: launched as a programmatic dependent
):
    # PDL (kernels.pdl): the logits are the previous GEMM's output, so wait before the first load and store; a short
    # kernel, so release the next launch at once (its CTAs get resident and wait while this one runs).
    pdl_wait(USE_PDL)
    pdl_release(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)[None, :]  # [1, BE]
    x = tl.load(logits_ptr + row * stride_row + experts, mask=experts < E, other=0.0).to(tl.float32)
    top_w, top_id = _route_rows(x, E, scale_ptr, 1, K, RENORMALIZE, HAS_SCALE, BLOCK_E, BLOCK_K)
    slots = tl.arange(0, BLOCK_K)[None, :]  # [1, BK]
    in_k = slots < K
    tl.store(weights_ptr + row * K + slots, top_w.to(weights_ptr.dtype.element_ty), mask=in_k)
    tl.store(ids_ptr + row * K + slots, top_id.to(tl.int64), mask=in_k)


@triton.jit
def _summed_row_tile(a_ptr, res_ptr, row, stride_a, stride_r, cols, h_ok):
    """``a + residual`` of one row's columns, added in fp32 and rounded to the activation dtype (torch's add, and
    ``kernels.rmsnorm``'s)."""
    a = tl.load(a_ptr + row * stride_a + cols, mask=h_ok, other=0.0)
    r = tl.load(res_ptr + row * stride_r + cols, mask=h_ok, other=0.0)
    return (a.to(tl.float32) + r.to(tl.float32)).to(a.dtype)


@triton.jit
def linear_route_program(
    group,  # this program's expert group
    row,  # its token row (int64)
    n_programs,  # the programs of this routing launch (the arrival count the last one sees)
    x_ptr,  # [T, H]: the router's input; with ADD_NORM the block output that is added to the residual first
    w_ptr,  # [E, H]
    logits_ptr,  # [T, E] scratch, x's dtype
    counter_ptr,  # int32 [1]: programs done; 0 between launches
    scale_ptr,  # [E] or a dummy
    weights_ptr,  # [T, K] out
    ids_ptr,  # [T, K] int64 out
    res_ptr,  # ADD_NORM: [T, H] the residual stream (else a dummy)
    norm_w_ptr,  # ADD_NORM: [H] the RMSNorm weight (else a dummy)
    res_out_ptr,  # ADD_NORM: [T, H] out, x + residual (else a dummy)
    normed_ptr,  # ADD_NORM: [T, H] out, the norm of it: the router's (and the experts') input (else a dummy)
    n_rows,
    E,
    H,
    stride_x,
    stride_w,
    stride_r,
    stride_ro,
    stride_n,
    eps,
    K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ROWS: tl.constexpr,  # T padded to a power of two
    BLOCK_E: tl.constexpr,  # E padded to a power of two
    BLOCK_K: tl.constexpr,
    EXPERTS_PER_PROGRAM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ADD_NORM: tl.constexpr = False,  # the residual add and RMSNorm before the router, in this launch
    GEMMA_NORM: tl.constexpr = False,  # the norm's convention (kernels.rmsnorm): gemma, else qwen
    USE_PDL: tl.constexpr = False,  # kernels.pdl: launched as a programmatic dependent
):
    """One program of ``_linear_route_kernel`` (the module docstring's router GEMV and routing), at the given
    coordinates; kernels that share a launch with other work (``kernels.mlp_beside_experts``) run it at coordinates
    of their own, with ``n_programs`` their routing programs."""
    # PDL (kernels.pdl): x (and the residual) come from earlier launches (the router weight rows are loaded in the
    # same loop), the logit scratch and the outputs may still be read by an earlier launch, and the arrival counter
    # is reset by the previous linear_route launch's last program: wait before the first load, store or atomic.
    # Every program waits, so a launch completes only after its predecessor did and launches in stream order still
    # never overlap on the counter.
    pdl_wait(USE_PDL)
    pdl_release_after_wait(USE_PDL)
    experts = group * EXPERTS_PER_PROGRAM + tl.arange(0, EXPERTS_PER_PROGRAM)  # [PE]
    e_ok = experts < E
    inv = 0.0
    if ADD_NORM:
        # Every program needs the whole normed row, so each computes the row's inverse root (a pass over 2 rows of
        # H, from L2) before its GEMV; the norm is then applied tile by tile in the GEMV loop.
        squares = tl.zeros([BLOCK_H], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            summed = _summed_row_tile(x_ptr, res_ptr, row, stride_x, stride_r, cols, cols < H).to(tl.float32)
            squares += summed * summed
        inv = tl.rsqrt(tl.sum(squares, axis=0) / H + eps)
    acc = tl.zeros([EXPERTS_PER_PROGRAM], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        h_ok = cols < H
        if ADD_NORM:
            summed = _summed_row_tile(x_ptr, res_ptr, row, stride_x, stride_r, cols, h_ok)
            norm_w = tl.load(norm_w_ptr + cols, mask=h_ok, other=0.0).to(tl.float32)
            normed = times_norm_weight(summed.to(tl.float32) * inv, norm_w, summed.dtype, GEMMA_NORM).to(
                normed_ptr.dtype.element_ty)
            # the expert group 0 programs write the row's two outputs (a vector compare: the interpreter rejects
            # a scalar & vector mask)
            first = h_ok & (cols * 0 + group == 0)
            tl.store(res_out_ptr + row * stride_ro + cols, summed, mask=first)
            tl.store(normed_ptr + row * stride_n + cols, normed, mask=first)
            x = normed.to(tl.float32)
        else:
            x = tl.load(x_ptr + row * stride_x + cols, mask=h_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + experts[:, None].to(tl.int64) * stride_w + cols[None, :],
                    mask=e_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    # Release after the GEMV loop (kernels.pdl's mode; the other releases right after the wait): the next launch
    # gets resident while the last program routes the rows.
    pdl_release_after_loop(USE_PDL)
    # the logits as the unfused path hands them to routing: rounded to the activation dtype
    tl.store(logits_ptr + row * E + experts, acc.to(logits_ptr.dtype.element_ty), mask=e_ok)
    # The last program to arrive routes every row. The barrier puts all of this program's logit stores before
    # the counter's release (acq_rel, GPU scope); the last program's acquire makes every program's visible, and
    # its loads bypass L1 (.cg), which may hold this scratch from an earlier launch.
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1)
    if arrived == n_programs - 1:
        rows = tl.arange(0, ROWS)
        all_e = tl.arange(0, BLOCK_E)
        row_ok = rows < n_rows
        logits = tl.load(logits_ptr + rows[:, None] * E + all_e[None, :], mask=row_ok[:, None] & (all_e < E)[None, :],
                         other=0.0, cache_modifier=".cg").to(tl.float32)
        top_w, top_id = _route_rows(logits, E, scale_ptr, ROWS, K, RENORMALIZE, HAS_SCALE, BLOCK_E, BLOCK_K)
        slots = tl.arange(0, BLOCK_K)
        out = rows[:, None] * K + slots[None, :]
        out_ok = row_ok[:, None] & (slots < K)[None, :]
        tl.store(weights_ptr + out, top_w.to(weights_ptr.dtype.element_ty), mask=out_ok)
        tl.store(ids_ptr + out, top_id.to(tl.int64), mask=out_ok)
        tl.atomic_xchg(counter_ptr, 0)  # ready for the next launch (stream order keeps launches apart)

@triton.jit(do_not_specialize=["n_rows"])
def _linear_route_kernel(  # linear_route_program's parameters in its order (each documented there)
    x_ptr, w_ptr, logits_ptr, counter_ptr, scale_ptr, weights_ptr, ids_ptr, res_ptr, norm_w_ptr, res_out_ptr,
    normed_ptr, n_rows, E, H, stride_x, stride_w, stride_r, stride_ro, stride_n, eps, K: tl.constexpr,
    RENORMALIZE: tl.constexpr, HAS_SCALE: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr, EXPERTS_PER_PROGRAM: tl.constexpr, BLOCK_H: tl.constexpr, ADD_NORM: tl.constexpr = False,
    GEMMA_NORM: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):
    linear_route_program(
        tl.program_id(0), tl.program_id(1).to(tl.int64), tl.num_programs(0) * tl.num_programs(1), x_ptr, w_ptr,
        logits_ptr, counter_ptr, scale_ptr, weights_ptr, ids_ptr, res_ptr, norm_w_ptr, res_out_ptr, normed_ptr,
        n_rows, E, H, stride_x, stride_w, stride_r, stride_ro, stride_n, eps, K, RENORMALIZE, HAS_SCALE, ROWS,
        BLOCK_E, BLOCK_K, EXPERTS_PER_PROGRAM, BLOCK_H, ADD_NORM, GEMMA_NORM, USE_PDL,
    )  # fmt: skip



def triton_route(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
    per_expert_scale: torch.Tensor | None = None,  # [E]
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, K] (out_dtype, default fp32), ids [T, K] int64
    """``ops.torch_route`` in one launch (see the module docstring)."""
    T, E = router_logits.shape
    if not 1 <= top_k <= E <= MAX_EXPERTS:
        raise ValueError(f"routing needs 1 <= top_k <= experts <= {MAX_EXPERTS}, got top_k={top_k}, E={E}")
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    device = logits.device
    weights = torch.empty((T, top_k), dtype=out_dtype or torch.float32, device=device)
    ids = torch.empty((T, top_k), dtype=torch.int64, device=device)
    if T == 0:
        return weights, ids
    scale = per_expert_scale if per_expert_scale is not None else weights  # a dummy pointer, never read
    _route_kernel[(T,)](
        logits, scale, weights, ids, T, E, logits.stride(0),
        K=top_k, RENORMALIZE=renormalize, HAS_SCALE=per_expert_scale is not None,
        BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(top_k), **pdl_launch(),
    )
    return weights, ids


def _arrival_counter(device: torch.device) -> torch.Tensor:
    """``linear_route``'s one counter (``kernels.arrival_counters``)."""
    return arrival_counters("linear_route", 1, device)


def linear_route(
    x: torch.Tensor,  # [T, H], T <= MAX_FUSED_ROWS
    weight: torch.Tensor,  # [E, H], x's dtype
    top_k: int,
    renormalize: bool,
    per_expert_scale: torch.Tensor | None = None,  # [E]
    out_dtype: torch.dtype | None = None,
    *,
    experts_per_program: int | None = None,
    block_h: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, K] (out_dtype, default fp32), ids [T, K] int64
    """``triton_route(F.linear(x, weight), ...)`` in one launch (see the module docstring); the keyword
    arguments are launch parameters, not semantics.

    ``experts_per_program`` defaults to 1 up to 4 rows and 2 beyond; ``num_warps`` to 1 up to 2 rows (the last
    program's top-k rounds are then warp shuffles, no block barriers) and 4 beyond: the faster of each pair at
    Qwen3-30B-A3B's and Gemma-4-26B-A4B's shapes (docs/benchmarks.md, the fused router)."""
    return _launch(x, None, weight, top_k, renormalize, per_expert_scale, out_dtype,
                   experts_per_program=experts_per_program, block_h=block_h, num_warps=num_warps)[2:]


def add_norm_linear_route(
    x: torch.Tensor,  # [T, H], T <= MAX_FUSED_ROWS: a block's output (Qwen3-MoE: the attention's)
    residual: torch.Tensor,  # [T, H], x's dtype: the residual stream x is added to
    norm_weight: torch.Tensor,  # [H], x's dtype: the RMSNorm before the router and the experts
    eps: float,
    mode: NormMode,
    weight: torch.Tensor,  # [E, H], x's dtype: the router projection
    top_k: int,
    renormalize: bool,
    per_expert_scale: torch.Tensor | None = None,  # [E]
    out_dtype: torch.dtype | None = None,
    *,
    experts_per_program: int | None = None,
    block_h: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # normed, new residual, weights, ids
    """``h = x + residual``, ``normed = rmsnorm(h)`` (``kernels.rmsnorm.fused_add_rmsnorm``'s convention and
    roundings), then ``linear_route(normed, weight, ...)``, in one launch: the residual add and norm of a
    pre-norm MoE layer's FFN input go into the router's launch. Returns ``(normed, h, weights, ids)``; ``normed``
    and ``h`` are new tensors (the experts read ``normed``, the next layer adds to ``h``).

    Each program recomputes the row's norm before its slice of the router GEMV (two reads of 2 rows of H, from
    L2); the programs of expert group 0 store ``h`` and ``normed``. The inverse root's fp32 sum of squares runs in
    ``block_h`` tiles, so ``normed`` can differ from ``fused_add_rmsnorm``'s by the rounding of that sum (an ulp
    of the activation dtype now and then)."""
    if mode not in ("gemma", "qwen"):
        raise ValueError(f"unknown norm mode {mode!r}")
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1:
        raise ValueError(f"residual must be {tuple(x.shape)} {x.dtype} with a contiguous last dim")
    if tuple(norm_weight.shape) != (x.shape[-1],) or norm_weight.dtype != x.dtype or norm_weight.stride(-1) != 1:
        raise ValueError(f"norm_weight must be [{x.shape[-1]}] of x's dtype, got {tuple(norm_weight.shape)} "
                         f"{norm_weight.dtype}")
    return _launch(x, (residual, norm_weight, eps, mode), weight, top_k, renormalize, per_expert_scale, out_dtype,
                   experts_per_program=experts_per_program, block_h=block_h, num_warps=num_warps)


@dataclass(frozen=True)
class RouteLaunch:
    """The arguments of one ``_linear_route_kernel`` launch (``route_arguments``): ``args`` in the order of the
    kernel's runtime parameters, ``constexprs`` by name, the grid ``(expert groups, token rows)`` and the warps.
    Kernels that run ``linear_route_program`` beside other work (``kernels.mlp_beside_experts``) take the same
    parameters."""

    args: tuple[object, ...]
    constexprs: dict[str, object]
    groups: int
    rows: int
    num_warps: int


def route_arguments(
    x: torch.Tensor,
    add_norm: tuple[torch.Tensor, torch.Tensor, float, NormMode] | None,  # residual, norm weight, eps, mode
    weight: torch.Tensor,
    top_k: int,
    renormalize: bool,
    per_expert_scale: torch.Tensor | None,
    out_dtype: torch.dtype | None,
    *,
    experts_per_program: int | None,
    block_h: int | None,
    num_warps: int | None,
) -> tuple[RouteLaunch | None, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The checked arguments of ``linear_route`` / ``add_norm_linear_route``'s launch (None for zero tokens: nothing
    to launch) and its outputs: normed rows and the new residual (``x``, ``x`` without ``add_norm``), routing
    weights and expert ids (written by the launch)."""
    tokens, hidden = x.shape
    if experts_per_program is None:
        experts_per_program = 1 if tokens <= 4 else 2
    if num_warps is None:
        num_warps = 1 if tokens <= 2 else 4
    experts = weight.shape[0]
    if not 1 <= top_k <= experts <= MAX_EXPERTS:
        raise ValueError(f"routing needs 1 <= top_k <= experts <= {MAX_EXPERTS}, got top_k={top_k}, E={experts}")
    if tokens > MAX_FUSED_ROWS:
        raise ValueError(f"linear_route takes at most {MAX_FUSED_ROWS} rows, got {tokens}")
    if weight.shape != (experts, hidden) or weight.dtype != x.dtype or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"weight must be [E, {hidden}] of x's dtype and both need a contiguous last dim, got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    if experts_per_program < 1 or experts_per_program & (experts_per_program - 1):
        raise ValueError(f"experts_per_program must be a power of two, got {experts_per_program}")
    device = x.device
    weights = torch.empty((tokens, top_k), dtype=out_dtype or torch.float32, device=device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=device)
    normed, summed = x, x
    if add_norm is not None:
        normed, summed = torch.empty_like(x), torch.empty_like(x)
    if tokens == 0:
        return None, (normed, summed, weights, ids)
    logits = torch.empty((tokens, experts), dtype=x.dtype, device=device)
    block_h = block_h or min(triton.next_power_of_2(hidden), max(64, 8192 // experts_per_program))
    scale = per_expert_scale if per_expert_scale is not None else weights  # a dummy pointer, never read
    residual, norm_weight, eps, mode = add_norm if add_norm is not None else (x, x, 0.0, "qwen")
    args = (x, weight, logits, _arrival_counter(device), scale, weights, ids, residual, norm_weight, summed, normed,
            tokens, experts, hidden, x.stride(0), weight.stride(0), residual.stride(0), summed.stride(0),
            normed.stride(0), eps)
    constexprs: dict[str, object] = dict(
        K=top_k, RENORMALIZE=renormalize, HAS_SCALE=per_expert_scale is not None, ROWS=triton.next_power_of_2(tokens),
        BLOCK_E=triton.next_power_of_2(experts), BLOCK_K=triton.next_power_of_2(top_k),
        EXPERTS_PER_PROGRAM=experts_per_program, BLOCK_H=block_h, ADD_NORM=add_norm is not None,
        GEMMA_NORM=mode == "gemma",
    )
    launch = RouteLaunch(args, constexprs, triton.cdiv(experts, experts_per_program), tokens, num_warps)
    return launch, (normed, summed, weights, ids)


def _launch(
    x: torch.Tensor,
    add_norm: tuple[torch.Tensor, torch.Tensor, float, NormMode] | None,  # residual, norm weight, eps, mode
    weight: torch.Tensor,
    top_k: int,
    renormalize: bool,
    per_expert_scale: torch.Tensor | None,
    out_dtype: torch.dtype | None,
    *,
    experts_per_program: int | None,
    block_h: int | None,
    num_warps: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # normed, new residual (x, x without add_norm),
    # weights, ids
    launch, outputs = route_arguments(x, add_norm, weight, top_k, renormalize, per_expert_scale, out_dtype,
                                      experts_per_program=experts_per_program, block_h=block_h, num_warps=num_warps)
    if launch is not None:
        _linear_route_kernel[(launch.groups, launch.rows)](*launch.args, **launch.constexprs,
                                                           num_warps=launch.num_warps, **pdl_launch(loop="router"))
    return outputs
