"""The Triton RMSNorm family in the ``ops`` contracts: the norm and the RoPE tables (primitives: the PyTorch op where
their kernel does not take the inputs), the residual add + norm and Gemma 4's sandwich norm + add (``ops.Fusions``:
None there, and ``ops.Ops`` composes the primitives).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inference_server.kernels import rmsnorm as triton_norm
from inference_server.kernels.batch_invariant_cuda import INVARIANT_NORM_ROWS
from inference_server.kernels.norm_add import MAX_OUT_NORMS as NORM_ADD_MAX_OUT_NORMS
from inference_server.kernels.norm_add import norm_add
from inference_server.kernels.rmsnorm import NormMode
from inference_server.kernels.rope_tables import rope_tables
from inference_server.models.architectures import layers
from inference_server.models.spec import NormStyle

# gemma3's (1 + w) norm has no kernel: reference
TRITON_NORM_MODE: dict[str, NormMode] = {"gemma4": "gemma", "qwen": "qwen"}


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, style: NormStyle) -> torch.Tensor:
    """``layers.rms_norm`` contract through the Triton kernel (one launch instead of ~7 elementwise kernels);
    falls back to the reference for the gemma3 style and for inputs the kernel does not take."""
    mode = TRITON_NORM_MODE.get(style)
    if mode is None or x.dim() > 3 or x.stride(-1) != 1:
        return layers.rms_norm(x, weight, eps, style)
    return triton_norm.rms_norm(x, weight, eps, mode)  # type: ignore[arg-type]


def invariant_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, style: NormStyle) -> torch.Tensor:
    """``layers.rms_norm`` contract through the Triton kernel with one row a program (``DETERMINISTIC``): a row's sum
    of squares spans the same warps whatever the row count. Gemma 3's ``(1 + w)`` style runs as the kernel's gemma
    mode with the weight ``1 + float(w)`` (the same fp32 product and one cast), so the embedded model is covered too;
    inputs the kernel does not take (more than 3 dims, a strided last dim: none on the supported models' paths) fall
    back to the reference, outside the guarantee."""
    mode: NormMode | None = "gemma" if style == "gemma3" else TRITON_NORM_MODE.get(style)
    if mode is None or x.dim() > 3 or x.stride(-1) != 1:
        return layers.rms_norm(x, weight, eps, style)
    if style == "gemma3" and weight is not None:
        weight = 1.0 + weight.float()  # [D]: gemma3's (1 + w), an elementwise op of the weight alone
    return triton_norm.rms_norm(x, weight, eps, mode, block_rows=INVARIANT_NORM_ROWS)


def add_norm_kernel_mode(x: torch.Tensor, residual: torch.Tensor, style: NormStyle) -> NormMode | None:
    """The ``kernels.rmsnorm`` mode in which ``fused_add_rmsnorm`` takes ``residual + x`` and its norm of ``style``,
    or None where it does not: the gemma3 style, x of more than 3 dims, a residual of another shape or dtype, strided
    last dims. Shared by the launches that fold this add and norm into their own (router, q/k/v GEMV)."""
    mode = TRITON_NORM_MODE.get(style)
    if (mode is None or x.dim() > 3 or x.stride(-1) != 1 or residual.shape != x.shape
            or residual.dtype != x.dtype or residual.stride(-1) != 1):
        return None
    return mode


def triton_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float,
                        style: NormStyle) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``Ops.add_rms_norm`` through the Triton kernel: the residual add and the norm in one launch (the add in
    fp32 rounded to the activation dtype, torch's value); None for the gemma3 style and odd inputs."""
    mode = add_norm_kernel_mode(x, residual, style)
    if mode is None:
        return None
    return triton_norm.fused_add_rmsnorm(x, residual, weight, eps, mode)


def invariant_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float,
                           style: NormStyle) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``Ops.add_rms_norm`` for ``DETERMINISTIC``: ``triton_add_rms_norm`` with one row a program, so a row's add and
    sum of squares are the same whatever the row count; None (the table's add, then ``invariant_rms_norm``) where the
    kernel does not take the inputs."""
    mode = add_norm_kernel_mode(x, residual, style)
    if mode is None:
        return None
    return triton_norm.fused_add_rmsnorm(x, residual, weight, eps, mode, block_rows=INVARIANT_NORM_ROWS)


def norm_add_kernel_takes(a: torch.Tensor, a_norm: layers.NormWeights, b: torch.Tensor | None,
                           b_norm: layers.NormWeights | None, sum_norm: layers.NormWeights | None,
                           residual: torch.Tensor | None, scale: torch.Tensor | None,
                           out_norms: Sequence[layers.NormWeights]) -> bool:
    """Whether ``kernels.norm_add`` computes ``ops.norm_add`` of these inputs: weighted gemma4 norms (weights of a's
    dtype or fp32, on its device), at most ``MAX_OUT_NORMS`` out norms, 2-D tensors of a's shape and dtype with
    contiguous rows, ``b`` with its norm, a one-element scale of a's dtype."""
    norms = [n for n in (a_norm, b_norm, sum_norm, *out_norms) if n is not None]
    tensors = [t for t in (a, b, residual) if t is not None]
    return not (any(n.style != "gemma4" or n.weight is None or n.weight.dtype not in (a.dtype, torch.float32)
                    or n.weight.device != a.device for n in norms)
                or len(out_norms) > NORM_ADD_MAX_OUT_NORMS
                or a.dim() != 2 or any(t.shape != a.shape or t.dtype != a.dtype or t.stride(-1) != 1 for t in tensors)
                or (b is None) != (b_norm is None)
                or (scale is not None and (scale.numel() != 1 or scale.dtype != a.dtype)))


def triton_norm_add(a: torch.Tensor, a_norm: layers.NormWeights, b: torch.Tensor | None = None,
                    b_norm: layers.NormWeights | None = None, *, sum_norm: layers.NormWeights | None = None,
                    residual: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                    out_norms: Sequence[layers.NormWeights] = (),
                    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
    """``Ops.norm_add`` in one Triton launch (``kernels.norm_add``): Gemma 4's post-norm(s), their sum's norm,
    residual add, layer scale and up to three next norms; None (the unfused path) for other norm styles (Gemma 3's
    ``1 + w``), weightless norms, more out norms, other dtypes or layouts (``norm_add_kernel_takes``)."""
    if not norm_add_kernel_takes(a, a_norm, b, b_norm, sum_norm, residual, scale, out_norms):
        return None

    def weight(norm: layers.NormWeights) -> torch.Tensor:
        assert norm.weight is not None  # checked above
        return norm.weight

    return norm_add(a, weight(a_norm), a_norm.eps,
                    b=b, wb=weight(b_norm) if b_norm is not None else None, eps_b=b_norm.eps if b_norm else 0.0,
                    ws=weight(sum_norm) if sum_norm is not None else None,
                    eps_s=sum_norm.eps if sum_norm is not None else 0.0,
                    residual=residual, scale=scale, out_norms=[(weight(n), n.eps) for n in out_norms])


def triton_rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor,
                        dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """``ops.rope_cos_sin`` in one Triton launch (``kernels.rope_tables``: the reference's arithmetic, CUDA's cosf /
    sinf) for fp32 inverse frequencies on the positions' device; the reference for anything else."""
    if inv_freq.dim() != 1 or inv_freq.dtype != torch.float32 or inv_freq.device != positions.device \
            or positions.dim() != 1 or positions.dtype.is_floating_point \
            or dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return layers.rope_cos_sin(inv_freq, positions, dtype)
    return rope_tables(positions, inv_freq, dtype)
