"""The attention function the Hugging Face backend registers with transformers (``AttentionInterface``).

The model's own modules compute q, k, v, norms and RoPE, and call this in place of ``sdpa``/``eager``: it takes
the mask of the running ``StepCache`` (padding, causality and sliding windows by position, so rows of different
lengths and evicted gaps are exact), then runs transformers' SDPA attention, or the model's own eager attention
when the eviction policy needs the attention weights (H2O, LRU), which it hands to the step cache.
Since the name is not one of transformers' mask implementations, the model builds no mask of its own.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from inference_server.backends.hf.step_cache import CURRENT_STEP

ATTENTION_NAME = "inference_server_hf"


def _eager_of(module: torch.nn.Module) -> Any:
    """The eager attention function of the module's own modeling file (each transformers model defines one:
    softcapping and scaling as the model expects)."""
    return sys.modules[type(module).__module__].eager_attention_forward


def step_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    step = CURRENT_STEP.get()
    if step is None:
        raise RuntimeError("the inference_server_hf attention runs only inside the hf runner's forward")
    index = step.layer_of(key, getattr(module, "layer_idx", -1))
    mask = step.mask(index, query.dtype)
    kwargs.pop("is_causal", None)
    kwargs["dropout"] = 0.0
    if step.policy is not None and step.policy.needs_attention:
        output, weights = _eager_of(module)(module, query, key, value, mask, **kwargs)
        step.observe(index, weights)
    else:
        output, _ = sdpa_attention_forward(module, query, key, value, mask, is_causal=False, **kwargs)
    return output, None


def register_attention() -> str:
    """Register the function (idempotent) and return the ``attn_implementation`` name to give a model."""
    AttentionInterface.register(ATTENTION_NAME, step_attention)
    return ATTENTION_NAME
