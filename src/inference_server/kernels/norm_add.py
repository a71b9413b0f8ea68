"""Triton post-norm + residual add (+ layer scale) (+ up to three next norms) in one launch: Gemma 4's sandwich norms.

A Gemma 4 decoder layer normalises each block's *output* before adding it to the residual stream, and normalises
again before the next block: ``residual + post_norm(block_out)``, then ``pre_norm(...)``; MoE layers add two
normalised branches and normalise their sum (``post_norm(post_norm_1(mlp) + post_norm_2(moe))``), the layer ends
with a scale (``h * layer_scalar``), and the next layer starts with its input norm. This kernel computes, per row
of ``[T, H]``:

    y = norm(a; wa) [+ norm(b; wb)]  [then norm(y; ws)]  [then residual + y]  [then y * scale] -> stored (new hidden)
    z_i = norm(y; wz_i) for each of up to three (wz_i, eps_i)                                  -> stored

with every rounding PyTorch makes on that path: each norm's output, the branch sum, the residual add and the
scale product are rounded to the activation dtype, as bf16 tensor ops do (each computes in fp32 and rounds).
Norms follow the Gemma 4 convention (``kernels.rmsnorm``'s ``"gemma"``: fp32 throughout, ``* w`` in fp32
before the one cast, whatever the weight's float dtype); the inverse root is ``rsqrt`` as in ``kernels.rmsnorm``.

A Gemma 4 MoE layer uses it twice (``models/architectures/gemma4.py``): after attention (``y`` the residual; ``z``
the dense MLP's and the experts' input norms and the router's folded norm), and at the end (the two FFN branches,
their sum's norm, the residual add, the layer scalar; ``z`` the next layer's input norm, or the model's final norm).

Contract: ``a``, ``b``, ``residual`` are ``[T, H]`` of one dtype with a contiguous last dim (any row stride);
weights ``[H]`` of that dtype or fp32; ``scale`` a one-element tensor of the activation dtype (read on the device,
so CUDA graphs see its value at replay). Returns new ``y`` and the tuple of ``z`` (one per given out norm).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from inference_server.kernels.pdl import pdl_launch, pdl_release, pdl_wait

__all__ = ["MAX_OUT_NORMS", "norm_add"]

MAX_OUT_NORMS = 3
"""Out norms one launch emits (Gemma 4's MoE layer after attention: the MLP's, the experts' and the router's)."""


@triton.jit
def _gemma_norm(x, w, n_cols, eps):
    """Gemma RMSNorm of one fp32 row with an fp32 weight; fp32 result (rounded by the caller)."""
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    return x * inv * w


@triton.jit
def _store_norm(yf, w, out_ptr, row, stride, cols, mask, n_cols, eps):
    """``norm(yf; w)`` (w loaded in fp32) rounded to the output's dtype, stored in row ``row`` of ``out``."""
    z = _gemma_norm(yf, w, n_cols, eps).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride + cols, z, mask=mask)


@triton.jit
def _load_row(ptr, cols, mask, PRESENT: tl.constexpr, BLOCK: tl.constexpr):
    """Row ``ptr[cols]`` in fp32 when ``PRESENT``, zeros (nothing read) otherwise."""
    if PRESENT:
        out = tl.load(ptr + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        out = tl.zeros([BLOCK], dtype=tl.float32)
    return out


@triton.jit
def _norm_add_kernel(
    a_ptr, b_ptr, res_ptr, wa_ptr, wb_ptr, ws_ptr, scale_ptr, y_ptr,
    wz0_ptr, wz1_ptr, wz2_ptr, z0_ptr, z1_ptr, z2_ptr,
    n_cols, sa, sb, sr, sy, sz0, sz1, sz2,
    eps_a, eps_b, eps_s, eps_z0, eps_z1, eps_z2,
    HAS_B: tl.constexpr, HAS_SUM_NORM: tl.constexpr, HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr,
    NUM_Z: tl.constexpr,  # 0..3 out norms (z0 first)
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kernels.pdl: launched as a programmatic dependent
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # Every norm weight and the layer scale are model weights (never written in a step): loaded before the PDL wait,
    # so their DRAM latency overlaps the predecessor's tail (kernels.pdl's invariant allows weights there only).
    wa = tl.load(wa_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    wb = _load_row(wb_ptr, cols, mask, HAS_B, BLOCK)
    ws = _load_row(ws_ptr, cols, mask, HAS_SUM_NORM, BLOCK)
    wz0 = _load_row(wz0_ptr, cols, mask, NUM_Z > 0, BLOCK)
    wz1 = _load_row(wz1_ptr, cols, mask, NUM_Z > 1, BLOCK)
    wz2 = _load_row(wz2_ptr, cols, mask, NUM_Z > 2, BLOCK)
    if HAS_SCALE:
        s = tl.load(scale_ptr).to(tl.float32)
    else:
        s = 1.0
    # PDL: every other input comes from earlier kernels, so wait here; one short program per row, so release the next
    # launch at once (its CTAs get resident and wait while this one runs). The activations are all loaded right after
    # the wait: one memory round trip, not one per input.
    pdl_wait(USE_PDL)
    pdl_release(USE_PDL)
    a = tl.load(a_ptr + row * sa + cols, mask=mask, other=0.0)
    b = _load_row(b_ptr + row * sb, cols, mask, HAS_B, BLOCK)
    r = _load_row(res_ptr + row * sr, cols, mask, HAS_RES, BLOCK)
    dtype = a.dtype
    y = _gemma_norm(a.to(tl.float32), wa, n_cols, eps_a).to(dtype)
    if HAS_B:
        nb = _gemma_norm(b, wb, n_cols, eps_b).to(dtype)
        y = (y.to(tl.float32) + nb.to(tl.float32)).to(dtype)
    if HAS_SUM_NORM:
        y = _gemma_norm(tl.where(mask, y.to(tl.float32), 0.0), ws, n_cols, eps_s).to(dtype)
    if HAS_RES:
        y = (r + y.to(tl.float32)).to(dtype)
    if HAS_SCALE:
        y = (y.to(tl.float32) * s).to(dtype)
    tl.store(y_ptr + row * sy + cols, y, mask=mask)
    yf = tl.where(mask, y.to(tl.float32), 0.0)
    if NUM_Z > 0:
        _store_norm(yf, wz0, z0_ptr, row, sz0, cols, mask, n_cols, eps_z0)
    if NUM_Z > 1:
        _store_norm(yf, wz1, z1_ptr, row, sz1, cols, mask, n_cols, eps_z1)
    if NUM_Z > 2:
        _store_norm(yf, wz2, z2_ptr, row, sz2, cols, mask, n_cols, eps_z2)


def _check(name: str, t: torch.Tensor | None, like: torch.Tensor) -> None:
    if t is not None and (t.shape != like.shape or t.dtype != like.dtype or t.stride(-1) != 1):
        raise ValueError(f"{name} must be {tuple(like.shape)} {like.dtype} with a contiguous last dim, "
                         f"got {tuple(t.shape)} {t.dtype}")


def _check_weight(name: str, w: torch.Tensor | None, like: torch.Tensor) -> None:
    hidden = like.shape[1]
    if w is not None and (tuple(w.shape) != (hidden,) or w.dtype not in (like.dtype, torch.float32)):
        raise ValueError(f"{name} must be [{hidden}] {like.dtype} or float32, got {tuple(w.shape)} {w.dtype}")


def norm_add(
    a: torch.Tensor,  # [T, H]
    wa: torch.Tensor,  # [H]
    eps_a: float,
    *,
    b: torch.Tensor | None = None,  # [T, H]
    wb: torch.Tensor | None = None,
    eps_b: float = 0.0,
    ws: torch.Tensor | None = None,  # [H]: the norm of the branch sum, before the residual add
    eps_s: float = 0.0,
    residual: torch.Tensor | None = None,  # [T, H]
    scale: torch.Tensor | None = None,  # one element
    out_norms: Sequence[tuple[torch.Tensor, float]] = (),  # up to MAX_OUT_NORMS (weight [H], eps)
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:  # y [T, H], one z [T, H] per out norm
    """One launch of the module docstring's formula (Gemma norm convention)."""
    if a.dim() != 2 or a.stride(-1) != 1:
        raise ValueError(f"a must be [T, H] with a contiguous last dim, got {tuple(a.shape)}")
    tokens, hidden = a.shape
    _check("b", b, a)
    _check("residual", residual, a)
    if (b is None) != (wb is None):
        raise ValueError("b and wb go together")
    if len(out_norms) > MAX_OUT_NORMS:
        raise ValueError(f"at most {MAX_OUT_NORMS} out norms, got {len(out_norms)}")
    weights = {"wa": wa, "wb": wb, "ws": ws, **{f"out_norms[{i}]": w for i, (w, _) in enumerate(out_norms)}}
    for name, w in weights.items():
        _check_weight(name, w, a)
    if scale is not None and scale.numel() != 1:
        raise ValueError(f"scale must have one element, got {tuple(scale.shape)}")
    y = torch.empty((tokens, hidden), dtype=a.dtype, device=a.device)
    zs = tuple(torch.empty_like(y) for _ in out_norms)
    if tokens == 0:
        return y, zs
    # absent inputs and outputs are dummies the kernel's constexpr flags never touch
    z_ptrs = [*zs, *(y,) * (MAX_OUT_NORMS - len(zs))]
    wz_ptrs = [*(w for w, _ in out_norms), *(wa,) * (MAX_OUT_NORMS - len(zs))]
    eps_z = [*(eps for _, eps in out_norms), *(0.0,) * (MAX_OUT_NORMS - len(zs))]
    block = triton.next_power_of_2(hidden)
    _norm_add_kernel[(tokens,)](
        a, b if b is not None else a, residual if residual is not None else a,
        wa, wb if wb is not None else wa, ws if ws is not None else wa, scale if scale is not None else wa, y,
        *wz_ptrs, *z_ptrs,
        hidden, a.stride(0), (b if b is not None else a).stride(0), (residual if residual is not None else a).stride(0),
        y.stride(0), *(z.stride(0) for z in z_ptrs),
        eps_a, eps_b, eps_s, *eps_z,
        HAS_B=b is not None, HAS_SUM_NORM=ws is not None, HAS_RES=residual is not None, HAS_SCALE=scale is not None,
        NUM_Z=len(zs), BLOCK=block, num_warps=max(4, min(16, block // 512)), **pdl_launch(),
    )  # fmt: skip
    return y, zs
