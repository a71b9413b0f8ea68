"""Re-rotating cached keys by a position delta, with the model's own rotary embedding (AttentionSink moves the
kept recent tokens back when the middle of the cache is evicted; StreamingLLM's positions within the cache).

RoPE rotations compose (R(a) R(b) = R(a + b)), so a key rotated at position p becomes the key at p + delta by
one more rotation of ``delta``: ``k cos + rotate_half(k) sin`` with the model's cos/sin at ``delta`` (its
attention scaling, for the RoPE variants that have one, divided out so it is not applied twice).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class KeyRotation:
    """``shift(keys [H, T, D], layer index, delta)``: the keys as if rotated ``delta`` positions further."""

    def __init__(self, model: Any) -> None:
        self.rotary: Any = model.base_model.rotary_emb
        self.layer_types: list[str] | None = getattr(model.config, "layer_types", None)
        self.takes_layer_type = "layer_type" in inspect.signature(self.rotary.forward).parameters

    @torch.inference_mode()
    def shift(self, keys: torch.Tensor, layer: int, delta: int) -> torch.Tensor:
        position = torch.full((1, 1), delta, dtype=torch.int64, device=keys.device)
        probe = keys[None, :, :1]
        if self.takes_layer_type and self.layer_types is not None:
            layer_type = self.layer_types[layer]
            cos, sin = self.rotary(probe, position, layer_type)
            scaling = getattr(self.rotary, f"{layer_type}_attention_scaling", 1.0)
        else:
            cos, sin = self.rotary(probe, position)
            scaling = getattr(self.rotary, "attention_scaling", 1.0)
        cos, sin = cos[0].float() / scaling, sin[0].float() / scaling  # [1, D]
        rotated = keys.float() * cos + rotate_half(keys.float()) * sin
        return rotated.to(keys.dtype)
