"""Building blocks shared by the model files: RMSNorm variants, rotary embeddings, activations.

Each function reproduces the exact operation order of the transformers reference it mirrors, because the
parity tests compare fp32 logits bit for bit (see ../shared/reference/models.md §2.3, §2.5, §2.10, §4).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from inference_server.models.spec import NormStyle, RopeSpec

NormFn = Callable[[torch.Tensor, torch.Tensor | None, float, NormStyle], torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, style: NormStyle) -> torch.Tensor:
    """RMSNorm over the last dim in one of three numerically distinct conventions.

    * ``gemma4``: fp32 ``x * pow(mean(x²)+eps, -0.5) * w``, one cast at the end; ``weight`` may be None
      (weightless norms: value norm, router norm).
    * ``gemma3``: fp32 ``x * rsqrt(mean(x²)+eps) * (1 + w)``, one cast at the end.
    * ``qwen``: fp32 ``x * rsqrt(mean(x²)+eps)``, cast to the input dtype, then ``w *`` in the weight dtype.
    """
    xf = x.float()
    if style == "gemma4":
        y = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
        if weight is not None:
            y = y * weight.float()
        return y.type_as(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if style == "gemma3":
        if weight is not None:
            y = y * (1.0 + weight.float())
        return y.type_as(x)
    y = y.to(x.dtype)
    return y if weight is None else weight * y


class NormWeights(Protocol):
    """What an RMSNorm applies, readable without running it (``RMSNorm`` modules, ``NormParams``): fused ops such as
    ``ops.norm_add`` take norms in this form and apply them inside one launch."""

    @property
    def weight(self) -> torch.Tensor | None: ...

    @property
    def eps(self) -> float: ...

    @property
    def style(self) -> NormStyle: ...


@attrs.frozen(eq=False)  # tensors do not compare to one bool
class NormParams:
    """A norm that is not a module: ``Gemma4Router``'s folded ``scale * H^-0.5`` weight (fp32), applied as any
    ``NormWeights`` is (``ops.Ops.apply_norm``)."""

    weight: torch.Tensor | None
    eps: float
    style: NormStyle


def rope_inv_freq(rope: RopeSpec) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32; pairs beyond ``rope.rotated_pairs`` get frequency 0."""
    pairs = rope.rotated_pairs
    exponents = torch.arange(0, 2 * pairs, 2, dtype=torch.int64).to(dtype=torch.float) / rope.head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    padding = rope.head_dim // 2 - pairs
    if padding > 0:
        inv_freq = torch.cat((inv_freq, torch.zeros(padding, dtype=torch.float32)))
    return inv_freq / rope.linear_factor


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """cos and sin [T, head_dim] for absolute ``positions`` [T], made in fp32 and cast to ``dtype``."""
    freqs = positions[:, None].float() * inv_freq.to(device=positions.device, dtype=torch.float)  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX half-split rotation of x [T, heads, D] with cos/sin [T, D]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


RopeFn = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor],
                  tuple[torch.Tensor, torch.Tensor | None]]


def reference_rope_qk(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor,
                      sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RoPE on q [T, nH, D] and k [T, nKV, D] (or None for KV-shared layers) with ``apply_rope``."""
    return apply_rope(q, cos, sin), (apply_rope(k, cos, sin) if k is not None else None)


def canonical_activation(name: str) -> str:
    """An HF activation name with its aliases merged: ``gelu_pytorch_tanh`` is ``gelu_tanh`` (the kernels' name)."""
    return "gelu_tanh" if name == "gelu_pytorch_tanh" else name


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP activation by its HF name."""
    if canonical_activation(name) == "gelu_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "silu":
        return F.silu
    if name == "gelu":
        return F.gelu
    raise ValueError(f"unsupported activation {name!r}")


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``tanh(x / cap) * cap`` (identity when cap is None), in x's dtype."""
    if cap is None:
        return x
    return torch.tanh(x / cap) * cap


def uninitialised_embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """An ``nn.Embedding`` whose weight is left uninitialised (the loader fills every weight). The default
    ``normal_`` init is not free even on the meta device: there it imports torch's reference decompositions,
    about 5 s of every start-up on a small CPU."""
    return nn.Embedding(num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim))
