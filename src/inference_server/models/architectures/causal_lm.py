"""The causal-LM wrapper every architecture shares: ``model.*`` decoder plus an (optionally tied) lm_head."""

from __future__ import annotations

import torch
from torch import nn

from inference_server.models.architectures import ops
from inference_server.models.architectures.attention import AttentionContext
from inference_server.models.architectures.layers import softcap
from inference_server.models.architectures.linear import Linear
from inference_server.models.architectures.quantized import Int8Embedding, Int8Linear
from inference_server.models.spec import ModelSpec


class Decoder(nn.Module, ops.OpsUser):
    """The ``model.*`` part of a causal LM: ``forward(ids [T], ctx)`` gives final hidden states [T, H]."""

    embed_tokens: nn.Embedding | Int8Embedding

    def place_rope_tables(self, device: torch.device | str) -> None:
        """Move the rotary tables to ``device`` once (the runner calls it before any step)."""
        raise NotImplementedError


class CausalLM(nn.Module, ops.OpsUser):
    """``forward`` gives final hidden states [T, H]; ``compute_logits`` turns the rows that need logits into
    [N, V] (tied to ``model.embed_tokens`` when the config says so, softcapped when it has a final cap)."""

    decoder_class: type[Decoder]
    lm_head: Linear | Int8Linear  # only when the embeddings are not tied

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.model = self.decoder_class(spec)
        if not spec.tie_word_embeddings:
            self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        return self.model(ids, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, V] for final hidden states [N, H], in the model dtype."""
        if not self.spec.tie_word_embeddings:
            return softcap(self.lm_head(hidden), self.spec.final_logit_softcapping)
        embedding = self.model.embed_tokens
        if isinstance(embedding, Int8Embedding):
            return softcap(embedding.as_lm_head(hidden), self.spec.final_logit_softcapping)
        return softcap(self.ops.linear(hidden, embedding.weight, None), self.spec.final_logit_softcapping)

    def head_weight(self) -> torch.Tensor | None:
        """The float ``[V, H]`` weight ``compute_logits`` multiplies by (the lm_head's, or the tied embedding's;
        the soft-cap ``spec.final_logit_softcapping`` follows), or None when the head is int8 (its scales are
        part of the product). For kernels that fuse the head with what reads its logits."""
        head = self._head_module()
        if isinstance(head, Int8Linear | Int8Embedding):
            return None
        return head.weight

    def int8_head(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The int8 counterpart of ``head_weight``: ``(qweight [V, H] int8, scale [V])`` of an int8 head (the tied
        ``Int8Embedding`` or an ``Int8Linear`` lm_head, ``reference_int8``'s format: ``compute_logits`` is
        ``ops.int8_linear(hidden, qweight, scale)`` then the soft-cap), or None when the head is float."""
        head = self._head_module()
        if isinstance(head, Int8Linear | Int8Embedding):
            return head.qweight, head.scale
        return None

    def _head_module(self) -> Linear | Int8Linear | nn.Embedding | Int8Embedding:
        """The module whose weight ``compute_logits`` multiplies by: the lm_head, or the tied embedding."""
        return self.lm_head if not self.spec.tie_word_embeddings else self.model.embed_tokens
