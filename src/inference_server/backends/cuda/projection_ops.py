"""The CUDA runner's projections: small-M float projections on the Triton GEMV where this GPU's sweep timed it faster
than cuBLAS, the gated activation (primitives), and the GEMVs with a gated activation or a residual add + norm fused
in (``ops.Fusions``: one launch where the table's primitives would run two; None elsewhere).
"""

from __future__ import annotations

import math

import torch

from inference_server.backends.cuda.norm_ops import (
    add_norm_kernel_mode,
    norm_add_kernel_takes,
)
from inference_server.kernels.dense_linear import cublas_is_faster, dense_linear, triton_is_faster
from inference_server.kernels.gated_activation import SUPPORTED as GATED_ACTIVATIONS
from inference_server.kernels.gated_activation import gated_activation
from inference_server.kernels.gated_gemv import gated_gemv, gated_gemv_config
from inference_server.kernels.int8_linear_configs import Int8LinearConfig
from inference_server.kernels.norm_add_gemv import MAX_NORM_COLUMNS, add_norm_gemv, norm_add_gemv
from inference_server.models.architectures import layers, ops


def triton_gated_activation(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """``ops.GatedActivationFn`` in one Triton launch (``kernels.gated_activation``); the reference for the
    activations and layouts the kernel does not take (exact-erf gelu, a strided last dim, not [T, I])."""
    canonical = layers.canonical_activation(act)
    if canonical not in GATED_ACTIVATIONS or gate.dim() != 2 or gate.shape != up.shape or gate.dtype != up.dtype \
            or gate.stride(-1) != 1 or up.stride(-1) != 1:
        return ops.torch_gated_activation(gate, up, act)
    return gated_activation(gate, up, canonical)


def triton_dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                        max_tokens: int) -> torch.Tensor:
    """``ops.linear`` through the Triton weight-streaming GEMV (``kernels.dense_linear``) for steps of at most
    ``max_tokens`` tokens, where cuBLAS runs most of the models' projections well under the memory limit; cuBLAS
    (``F.linear``) for larger steps, biases, weights of another dtype than the activations, and the shapes and
    step sizes where this GPU's tuning sweep timed cuBLAS faster (``dense_linear.cublas_is_faster``) or did not time
    them (``dense_linear.triton_is_faster``): only measured wins take the Triton kernel (the heuristic config at
    every shape won on one model and lost on two: docs/benchmarks.md)."""
    if not dense_linear_takes(x, weight, bias, max_tokens=max_tokens):
        return torch.nn.functional.linear(x, weight, bias)
    tokens = math.prod(x.shape[:-1])
    return dense_linear(x.reshape(tokens, x.shape[-1]), weight).reshape(*x.shape[:-1], weight.shape[0])


def dense_linear_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, max_tokens: int) -> bool:
    """Whether ``triton_dense_linear`` runs this projection through the Triton kernel (else cuBLAS)."""
    tokens = math.prod(x.shape[:-1])
    return not (bias is not None or weight.dim() != 2 or x.dtype != weight.dtype or not 1 <= tokens <= max_tokens
                or x.dtype not in (torch.bfloat16, torch.float16, torch.float32)
                or cublas_is_faster(tokens, weight.shape[0], weight.shape[1], x.dtype, x.device)
                or not triton_is_faster(tokens, weight.shape[0], weight.shape[1], x.dtype, x.device))


def installed_gemv_takes(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, *,
                          dense_max_tokens: int | None) -> bool:
    """Whether the CUDA table runs the projection ``x [T, K] @ weight.T`` through the Triton GEMV kernels (int8
    weights: ``triton_int8_linear`` always; float ones where ``triton_dense_linear`` takes them), with contiguous
    last dims; their config then decides whether it is a one-split CUDA-core GEMV (``gated_gemv_config``)."""
    return x.stride(-1) == 1 and weight.stride(-1) == 1 and (scale is not None or (
        dense_max_tokens is not None and dense_linear_takes(x, weight, None, max_tokens=dense_max_tokens)))


def gated_projection_config(flat: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, canonical: str,
                             flat_up: torch.Tensor | None, *, dense_max_tokens: int | None) -> Int8LinearConfig | None:
    """The one-launch gated GEMV's config for ``triton_gated_projection``'s inputs (2-D), or None where the
    installed ops would not run the projection as a one-split CUDA-core GEMV (then no fused launch)."""
    if canonical in GATED_ACTIVATIONS \
            and (flat_up is None or (flat_up.dtype == flat.dtype and flat_up.stride(-1) == 1
                                     and tuple(flat_up.shape) == (flat.shape[0], weight.shape[0]))) \
            and installed_gemv_takes(flat, weight, scale, dense_max_tokens=dense_max_tokens):
        return gated_gemv_config(flat, weight, scale, paired=flat_up is None)
    return None


def triton_gated_projection(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, act: str,
                            up: torch.Tensor | None = None, *, dense_max_tokens: int | None) -> torch.Tensor | None:
    """``Ops.gated_projection`` in one launch (``kernels.gated_gemv``: the gated activation in the GEMV's
    epilogue) where the table would run the projection as a one-split CUDA-core GEMV and the activation
    through ``triton_gated_activation``: int8 weights always (``triton_int8_linear``), float ones where
    ``triton_dense_linear`` takes them (``dense_max_tokens`` its bound, None: cuBLAS is in the table). The same bits
    as those launches; None anywhere else (then the table runs those launches)."""
    canonical = layers.canonical_activation(act)
    flat = x.reshape(-1, x.shape[-1])
    flat_up = up.reshape(-1, up.shape[-1]) if up is not None else None
    config = gated_projection_config(flat, weight, scale, canonical, flat_up, dense_max_tokens=dense_max_tokens)
    if config is None:
        return None
    out = gated_gemv(flat, weight, scale, canonical, config, flat_up)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def triton_norm_add_gated_projection(a: torch.Tensor, a_norm: layers.NormWeights, residual: torch.Tensor,
                                     weight: torch.Tensor, weight_scale: torch.Tensor | None, act: str,
                                     up: torch.Tensor | None = None, *, scale: torch.Tensor | None = None,
                                     dense_max_tokens: int | None,
                                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``Ops.norm_add_gated_projection`` in one launch (``kernels.norm_add_gemv``: the sandwich norm's residual add
    in the gated GEMV's prologue and K loop) where ``triton_norm_add`` would take the norm (a weighted gemma norm)
    and ``triton_gated_projection`` would run one launch (a one-split CUDA-core GEMV at its config), with rows of at
    most ``MAX_NORM_COLUMNS``; None anywhere else (then the table's ``norm_add`` and ``gated_projection``)."""
    canonical = layers.canonical_activation(act)
    flat_up = up.reshape(-1, up.shape[-1]) if up is not None else None
    config = None
    if norm_add_kernel_takes(a, a_norm, None, None, None, residual, scale, ()) and a.shape[1] <= MAX_NORM_COLUMNS:
        config = gated_projection_config(a, weight, weight_scale, canonical, flat_up,
                                          dense_max_tokens=dense_max_tokens)
    if config is None or a_norm.weight is None:  # (the weight is there when the kernel takes the norm)
        return None
    return norm_add_gemv(a, a_norm.weight, a_norm.eps, residual, scale, weight, weight_scale, config,
                         gated=canonical, up=flat_up)


def triton_add_norm_projection(x: torch.Tensor, residual: torch.Tensor, norm: layers.NormWeights,
                               weight: torch.Tensor, weight_scale: torch.Tensor | None, *,
                               dense_max_tokens: int | None,
                               ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``Ops.add_norm_projection`` in one launch (``kernels.norm_add_gemv.add_norm_gemv``: the residual add and the
    qwen norm in the GEMV's prologue and K loop) where ``triton_add_rms_norm`` would take the norm (a weighted qwen
    norm of x's dtype, [T, H] rows) and the table would run a float projection as a one-split CUDA-core GEMV
    (``gated_gemv_config``), with rows of at most ``MAX_NORM_COLUMNS``; None anywhere else (then the
    table's ``add_rms_norm`` and projection). int8 weights keep the two launches: their
    GEMV reads half the bytes, and the prologue cost more than the launch it saves (docs/benchmarks.md, the add + norm
    in the q/k/v GEMV)."""
    config = None
    if weight_scale is None and add_norm_kernel_mode(x, residual, norm.style) == "qwen" and norm.weight is not None \
            and norm.weight.dtype == x.dtype and x.dim() == 2 and x.shape[1] <= MAX_NORM_COLUMNS \
            and installed_gemv_takes(x, weight, None, dense_max_tokens=dense_max_tokens):
        config = gated_gemv_config(x, weight, None, paired=False)
    if config is None or norm.weight is None:  # (the weight is there when the config is)
        return None
    h, projected = add_norm_gemv(x, norm.weight, norm.eps, residual, weight, None, config)
    return projected, h
