"""Triton fused (residual add +) RMSNorm, Gemma or Qwen convention, for hidden rows or per-head rows.

One launch: ``h = x + residual`` (rounded to x's dtype, stored as the new residual), then
``rms(h)`` over the last dim. Conventions (reference/models.md §2.3, §4):

* ``"gemma"``: all fp32, ``y = hf * (mean(hf^2) + eps)^-0.5 * float(w)``, one cast at the end; the
  weight is optional (``v_norm`` and the router norm are weightless).
* ``"qwen"``: ``y = w * (hf * rsqrt(mean(hf^2) + eps)).to(dtype)``: cast first, then multiply by ``w``
  (torch promotion of the two dtypes; the input dtype when ``w`` has it).

Rows: ``x`` may be ``[T, D]`` (a hidden state) or ``[T, heads, D]`` with arbitrary token and head
strides (e.g. q or k heads sliced out of a fused qkv projection), so a per-head q/k/v norm needs no
copy. Several short rows share a program (``[BLOCK_R, BLOCK_D]`` tiles) so D = 128..512 heads are not
one tiny program each. The inverse root is ``rsqrt`` (on GPU the approximate ``rsqrt.approx.f32``,
which is what torch's CUDA ``pow(v, -0.5)`` and ``rsqrt`` also lower to).
"""

from __future__ import annotations

from typing import Literal

import torch
import triton
import triton.language as tl

from inference_server.kernels.pdl import pdl_launch, pdl_release, pdl_wait

__all__ = ["NormMode", "fused_add_rmsnorm", "rms_norm", "times_norm_weight"]

NormMode = Literal["gemma", "qwen"]
"""The two RMSNorm conventions (the module docstring)."""


@triton.jit
def times_norm_weight(y, w, dtype, GEMMA: tl.constexpr):
    """The normed fp32 values ``y`` times the fp32 weight ``w`` in the convention's order, before the final cast:
    gemma multiplies in fp32; qwen first casts to the input ``dtype`` (the module docstring). Also used by
    ``kernels.router``'s add + norm before the router GEMV."""
    if not GEMMA:
        y = y.to(dtype).to(tl.float32)
    return y * w


@triton.jit(do_not_specialize=['n_rows'])
def _rmsnorm_kernel(
    x_ptr,  # [T, R, D]
    res_ptr,  # [T, R, D] or dummy
    w_ptr,  # [D] or dummy
    y_ptr,  # [T, R, D] normed out
    res_out_ptr,  # [T, R, D] x + residual out, or dummy
    n_rows,  # T * R
    heads,  # R
    D,
    eps,
    sx_t,
    sx_h,
    sr_t,
    sr_h,
    sy_t,
    sy_h,
    sro_t,
    sro_h,
    HAS_RES: tl.constexpr,
    HAS_W: tl.constexpr,
    GEMMA: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kernels.pdl: launched as a programmatic dependent
):
    # PDL: wait before the first load (x and the residual are the previous kernel's outputs); a row block is a few
    # µs of work, so release the next launch at once: its CTAs get resident and wait while this one runs.
    pdl_wait(USE_PDL)
    pdl_release(USE_PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    r_ok = rows < n_rows
    t = (rows // heads).to(tl.int64)
    hd = (rows % heads).to(tl.int64)
    d = tl.arange(0, BLOCK_D)  # [BD]
    d_ok = d < D
    mask = r_ok[:, None] & d_ok[None, :]
    x = tl.load(x_ptr + (t * sx_t + hd * sx_h)[:, None] + d[None, :], mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + (t * sr_t + hd * sr_h)[:, None] + d[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # add in the input dtype
        tl.store(res_out_ptr + (t * sro_t + hd * sro_h)[:, None] + d[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)  # [BR]
    y = xf * inv[:, None]
    if HAS_W:
        w = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)  # [BD]
        y = times_norm_weight(y, w[None, :], x_ptr.dtype.element_ty, GEMMA)
    tl.store(y_ptr + (t * sy_t + hd * sy_h)[:, None] + d[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 1:
        return t.view(1, 1, -1)
    if t.dim() == 2:
        return t.unsqueeze(1)
    if t.dim() == 3:
        return t
    raise ValueError(f"expected [D], [T, D] or [T, heads, D], got shape {tuple(t.shape)}")


def _check_rows(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    if t.shape != like.shape or t.stride(-1) != 1:
        raise ValueError(f"{name} must have shape {tuple(like.shape)} and a contiguous last dim")


def fused_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    mode: NormMode,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    block_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(normed, new_residual)`` with ``new_residual = x + residual`` (``x`` itself when None).

    ``x``: ``[D]``, ``[T, D]`` or ``[T, heads, D]`` (any token/head strides, last dim contiguous),
    normalised over the last dim; ``residual``: like ``x`` and of its dtype, or None; ``weight [D]``
    or None. ``normed`` has x's shape and dtype (qwen with a weight: ``promote(x.dtype, w.dtype)``),
    written into ``out`` when given (``out`` may be ``x`` itself, normalising in place);
    ``new_residual`` goes to ``residual_out`` when given (may be ``residual`` itself, in-place
    update). One launch, no host sync. ``block_rows`` fixes the rows a program normalises (a power of two); by
    default it follows the row count, and with it the warps over which a row's sum of squares is reduced, so a
    row's last bit may depend on how many rows the call has (``DETERMINISTIC`` passes a fixed value).
    """
    if mode not in ("gemma", "qwen"):
        raise ValueError(f"unknown norm mode {mode!r}")
    if x.stride(-1) != 1:
        raise ValueError("x must have a contiguous last dim")
    D = x.shape[-1]
    if weight is not None and tuple(weight.shape) != (D,):
        raise ValueError(f"weight must be [{D}], got {tuple(weight.shape)}")
    y_dtype = x.dtype
    if mode == "qwen" and weight is not None:
        y_dtype = torch.promote_types(x.dtype, weight.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=y_dtype, device=x.device)
    _check_rows("out", out, x)
    if out.dtype != y_dtype:
        raise ValueError(f"out must be {y_dtype}")
    if residual is None:
        new_res = x
    else:
        _check_rows("residual", residual, x)
        if residual.dtype != x.dtype:
            raise ValueError("residual must have x's dtype")
        new_res = torch.empty_like(x) if residual_out is None else residual_out
        _check_rows("residual_out", new_res, x)
    x3, y3, r3, ro3 = _as_3d(x), _as_3d(out), _as_3d(residual if residual is not None else x), _as_3d(new_res)
    T, R, _ = x3.shape
    n_rows = T * R
    if n_rows == 0:
        return out, new_res
    block_d = triton.next_power_of_2(D)
    block_r = block_rows or max(1, min(64, 4096 // block_d, triton.next_power_of_2(n_rows)))
    num_warps = max(1, min(16, block_r * block_d // 512))
    _rmsnorm_kernel[(triton.cdiv(n_rows, block_r),)](
        x3, r3, weight if weight is not None else x3, y3, ro3,
        n_rows, R, D, eps,
        x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
        y3.stride(0), y3.stride(1), ro3.stride(0), ro3.stride(1),
        HAS_RES=residual is not None, HAS_W=weight is not None, GEMMA=mode == "gemma",
        BLOCK_R=block_r, BLOCK_D=block_d, num_warps=num_warps, **pdl_launch(),
    )  # fmt: skip
    return out, new_res


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    mode: NormMode,
    *,
    out: torch.Tensor | None = None,
    block_rows: int | None = None,
) -> torch.Tensor:
    """RMSNorm without residual: ``fused_add_rmsnorm(x, None, weight, eps, mode, out=out)[0]``.

    For per-head q/k/v norms pass ``x [T, heads, D]`` (e.g. a strided view into a fused qkv buffer).
    """
    return fused_add_rmsnorm(x, None, weight, eps, mode, out=out, block_rows=block_rows)[0]
