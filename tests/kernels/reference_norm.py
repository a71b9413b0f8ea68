"""Pure-PyTorch oracle of RMSNorm (with optional residual add) in the Gemma and Qwen conventions.

Written to follow HF transformers op for op (reference/models.md §2.3 and §4):

* ``"gemma"`` (``Gemma4RMSNorm``): ``xf = float32(x)``; ``y = xf * pow(mean(xf^2) + eps, -0.5)``;
  ``y = y * float32(w)`` when a weight is given (plain ``w``, not ``1 + w``); one cast to ``x.dtype``.
* ``"qwen"`` (``Qwen3MoeRMSNorm``): ``n = (xf * rsqrt(mean(xf^2) + eps)).to(x.dtype)``; ``y = w * n``
  in torch type promotion (the input dtype when ``w`` has it), i.e. cast *then* multiply.

The residual add (``x + residual``) happens first, in the input dtype, as the decoder layers do.
"""

from __future__ import annotations

import torch

from inference_server.kernels.rmsnorm import NormMode


def rmsnorm_reference(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    mode: NormMode,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(normed, new_residual)`` with ``new_residual = x + residual`` (``x`` itself if None).

    ``x [..., D]`` is normalised over its last dim; ``weight [D]`` or None (weightless norm).
    Output dtype: ``x.dtype`` for gemma; ``promote(x.dtype, weight.dtype)`` for qwen with a weight.
    """
    h = x if residual is None else x + residual  # [..., D] in x.dtype
    hf = h.float()
    ms = hf.pow(2).mean(-1, keepdim=True)  # [..., 1]
    if mode == "gemma":
        y = hf * torch.pow(ms + eps, -0.5)
        if weight is not None:
            y = y * weight.float()
        return y.to(h.dtype), h
    if mode == "qwen":
        y = (hf * torch.rsqrt(ms + eps)).to(h.dtype)
        if weight is not None:
            y = weight * y
        return y, h
    raise ValueError(f"unknown norm mode {mode!r}")
