"""Triton post-norm + residual add (+ layer scale) (+ the next norm) in one launch: Gemma 4's sandwich norms.

A Gemma 4 decoder layer normalises each block's *output* before adding it to the residual stream, and normalises
again before the next block: ``residual + post_norm(block_out)``, then ``pre_norm(...)``; MoE layers add two
normalised branches (``post_norm_1(mlp) + post_norm_2(moe)``), and the layer ends with a scale
(``h * layer_scalar``). As PyTorch ops (or one RMSNorm kernel each) that is 8 norm launches and 3 elementwise
launches per 26B-A4B layer, each a few microseconds at decode. This kernel computes, per row of ``[T, H]``:

    y = norm(a; wa) [+ norm(b; wb)]  [then residual + y]  [then y * scale]    -> stored (the new hidden/residual)
    z = norm(y; wz)                                                            -> stored when ``wz`` is given

with every rounding PyTorch makes on that path: each norm's output, the branch sum, the residual add and the
scale product are rounded to the activation dtype, as bf16 tensor ops do (each computes in fp32 and rounds).
Norms follow the Gemma 4 convention (``kernels.reference_norm``'s ``"gemma"``: fp32 throughout, ``* w`` before
the one cast); the inverse root is ``rsqrt`` as in ``kernels.rmsnorm``.

Contract: ``a``, ``b``, ``residual`` are ``[T, H]`` of one dtype with a contiguous last dim (any row stride);
weights ``[H]`` of that dtype; ``scale`` a one-element tensor (read on the device, so CUDA graphs see its
value at replay). Returns new ``y`` and ``z`` (``z`` None without ``wz``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inference_server.kernels.pdl import pdl_launch, pdl_release, pdl_wait

__all__ = ["norm_add", "norm_add_reference"]


@triton.jit
def _gemma_norm(x, w, n_cols, eps):
    """Gemma RMSNorm of one fp32 row with an fp32 weight; fp32 result (rounded by the caller)."""
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    return x * inv * w


@triton.jit
def _norm_add_kernel(
    a_ptr, b_ptr, res_ptr, wa_ptr, wb_ptr, wz_ptr, scale_ptr, y_ptr, z_ptr,
    n_cols, sa, sb, sr, sy, sz,
    eps_a, eps_b, eps_z,
    HAS_B: tl.constexpr, HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_Z: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kernels.pdl: launched as a programmatic dependent
):
    # PDL (kernels.pdl): every input but the weights comes from earlier kernels, so wait first; one short program
    # per row, so release the next launch at once (its CTAs get resident and wait while this one runs).
    pdl_wait(USE_PDL)
    pdl_release(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    a = tl.load(a_ptr + row * sa + cols, mask=mask, other=0.0)
    dtype = a.dtype
    wa = tl.load(wa_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = _gemma_norm(a.to(tl.float32), wa, n_cols, eps_a).to(dtype)
    if HAS_B:
        b = tl.load(b_ptr + row * sb + cols, mask=mask, other=0.0).to(tl.float32)
        wb = tl.load(wb_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        nb = _gemma_norm(b, wb, n_cols, eps_b).to(dtype)
        y = (y.to(tl.float32) + nb.to(tl.float32)).to(dtype)
    if HAS_RES:
        r = tl.load(res_ptr + row * sr + cols, mask=mask, other=0.0).to(tl.float32)
        y = (r + y.to(tl.float32)).to(dtype)
    if HAS_SCALE:
        s = tl.load(scale_ptr).to(tl.float32)
        y = (y.to(tl.float32) * s).to(dtype)
    tl.store(y_ptr + row * sy + cols, y, mask=mask)
    if HAS_Z:
        wz = tl.load(wz_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        yf = tl.where(mask, y.to(tl.float32), 0.0)
        z = _gemma_norm(yf, wz, n_cols, eps_z).to(dtype)
        tl.store(z_ptr + row * sz + cols, z, mask=mask)


def _check(name: str, t: torch.Tensor | None, like: torch.Tensor) -> None:
    if t is not None and (t.shape != like.shape or t.dtype != like.dtype or t.stride(-1) != 1):
        raise ValueError(f"{name} must be {tuple(like.shape)} {like.dtype} with a contiguous last dim, "
                         f"got {tuple(t.shape)} {t.dtype}")


def norm_add(
    a: torch.Tensor,  # [T, H]
    wa: torch.Tensor,  # [H]
    eps_a: float,
    *,
    b: torch.Tensor | None = None,  # [T, H]
    wb: torch.Tensor | None = None,
    eps_b: float = 0.0,
    residual: torch.Tensor | None = None,  # [T, H]
    scale: torch.Tensor | None = None,  # one element
    wz: torch.Tensor | None = None,  # [H]
    eps_z: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # y [T, H], z [T, H] | None
    """One launch of the module docstring's formula (Gemma norm convention)."""
    if a.dim() != 2 or a.stride(-1) != 1:
        raise ValueError(f"a must be [T, H] with a contiguous last dim, got {tuple(a.shape)}")
    tokens, hidden = a.shape
    _check("b", b, a)
    _check("residual", residual, a)
    if (b is None) != (wb is None):
        raise ValueError("b and wb go together")
    for name, w in (("wa", wa), ("wb", wb), ("wz", wz)):
        if w is not None and (tuple(w.shape) != (hidden,) or w.dtype != a.dtype):
            raise ValueError(f"{name} must be [{hidden}] {a.dtype}, got {tuple(w.shape)} {w.dtype}")
    if scale is not None and scale.numel() != 1:
        raise ValueError(f"scale must have one element, got {tuple(scale.shape)}")
    y = torch.empty((tokens, hidden), dtype=a.dtype, device=a.device)
    z = torch.empty_like(y) if wz is not None else None
    if tokens == 0:
        return y, z
    block = triton.next_power_of_2(hidden)
    _norm_add_kernel[(tokens,)](
        a, b if b is not None else a, residual if residual is not None else a,
        wa, wb if wb is not None else wa, wz if wz is not None else wa, scale if scale is not None else wa,
        y, z if z is not None else y,
        hidden, a.stride(0), (b if b is not None else a).stride(0), (residual if residual is not None else a).stride(0),
        y.stride(0), (z if z is not None else y).stride(0),
        eps_a, eps_b, eps_z,
        HAS_B=b is not None, HAS_RES=residual is not None, HAS_SCALE=scale is not None, HAS_Z=wz is not None,
        BLOCK=block, num_warps=max(4, min(16, block // 512)), **pdl_launch(),
    )  # fmt: skip
    return y, z


def norm_add_reference(
    a: torch.Tensor, wa: torch.Tensor, eps_a: float, *, b: torch.Tensor | None = None,
    wb: torch.Tensor | None = None, eps_b: float = 0.0, residual: torch.Tensor | None = None,
    scale: torch.Tensor | None = None, wz: torch.Tensor | None = None, eps_z: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same as PyTorch tensor ops (``reference_norm``'s gemma norm, each op rounding to a's dtype)."""
    from inference_server.kernels.reference_norm import rmsnorm_reference

    y = rmsnorm_reference(a, None, wa, eps_a, "gemma")[0]
    if b is not None:
        y = y + rmsnorm_reference(b, None, wb, eps_b, "gemma")[0]
    if residual is not None:
        y = residual + y
    if scale is not None:
        y = y * scale
    return y, (rmsnorm_reference(y, None, wz, eps_z, "gemma")[0] if wz is not None else None)
