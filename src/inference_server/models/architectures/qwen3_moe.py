"""Qwen3-MoE decoder, as specified in models.md §4.

Parameter names follow ``Qwen3MoeForCausalLM`` with experts fused as transformers holds them in memory
(``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``); the loader fuses the hub's
per-expert tensors. Router: fp32 softmax, top-k, optional renormalisation, then a cast to the activation
dtype *before* weighting (unlike Gemma 4).
"""

from __future__ import annotations

import torch
from torch import nn

from inference_server.models.architectures.attention import AttentionContext
from inference_server.models.architectures.blocks import FusedExperts, GatedMLP, SelfAttention
from inference_server.models.architectures.causal_lm import CausalLM, Decoder
from inference_server.models.architectures.layers import rope_inv_freq, uninitialised_embedding
from inference_server.models.architectures.ops import OpsUser, RMSNorm
from inference_server.models.spec import LayerSpec, ModelSpec


class Qwen3MoeRouter(nn.Module, OpsUser):
    """``mlp.gate``: linear router over experts."""

    keeps_float_weights = True  # QUANTIZATION=int8 leaves the router float (see quantized.py)

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.top_k = spec.experts_top_k
        self.normalize = spec.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(spec.num_experts, spec.hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # logits [T, E] in x's dtype, then routing; weights cast to x's dtype
        return self.ops.linear_route(x, self.weight, self.top_k, self.normalize, None, x.dtype)  # [T, K] x2

    def add_norm_route(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor) -> tuple[
            torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``norm(residual + x)`` (the experts' input), ``residual + x`` and the routing of the normed rows, as
        ``ops.add_norm`` then ``forward``: one launch on CUDA at decode sizes."""
        return self.ops.add_norm_route(norm, x, residual, self.weight, self.top_k, self.normalize, None, x.dtype)


class Qwen3MoeSparseBlock(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate = Qwen3MoeRouter(spec)
        self.experts = FusedExperts(spec.num_experts, spec.hidden_size, spec.moe_intermediate_size,
                                    spec.hidden_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return self.experts(x, weights, ids)


class Qwen3MoeDecoderLayer(nn.Module, OpsUser):
    """Pre-norm attention and pre-norm FFN (sparse MoE or dense MLP), each added to the residual.

    The residual adds are folded into the norm after them (``ops.add_rms_norm``, one launch on CUDA, and at decode
    one with the router GEMV or the q/k/v GEMV after that norm as well): the
    layer takes ``(hidden, residual)``, where the residual stream is ``residual + hidden``, and returns the
    FFN output as the next ``hidden`` with the residual not yet added; the next layer's input norm (or the
    final norm) adds it. The values are those of ``h = h + attn(norm(h)); h = h + mlp(norm(h))``: the same
    adds in the activation dtype, in the same order."""

    def __init__(self, spec: ModelSpec, layer: LayerSpec) -> None:
        super().__init__()
        self.self_attn = SelfAttention(spec, layer)
        self.mlp = Qwen3MoeSparseBlock(spec) if layer.is_moe else \
            GatedMLP(spec.hidden_size, layer.intermediate_size, spec.hidden_activation)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, "qwen")
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, "qwen")

    def forward(
        self,
        hidden: torch.Tensor,  # [T, H]: the previous layer's FFN output, or the embeddings (first layer)
        residual: torch.Tensor | None,  # [T, H]: the stream before ``hidden`` is added; None in the first layer
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # this layer's FFN output, the residual it is to be added to
        if residual is None:
            residual, attn = hidden, self.self_attn(self.input_layernorm(hidden), cos, sin, ctx)
        else:  # the residual add and norm go into the q/k/v projection's launch where the backend can
            attn, residual = self.self_attn.add_norm_forward(self.input_layernorm, hidden, residual, cos, sin, ctx)
        if isinstance(self.mlp, Qwen3MoeSparseBlock):  # the residual add and norm go into the router's launch
            x, residual, weights, ids = self.mlp.gate.add_norm_route(self.post_attention_layernorm, attn, residual)
            return self.mlp.experts(x, weights, ids), residual
        x, residual = self.ops.add_norm(self.post_attention_layernorm, attn, residual)
        return self.mlp(x), residual


class Qwen3MoeModel(Decoder):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = uninitialised_embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(Qwen3MoeDecoderLayer(spec, layer) for layer in spec.layers)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, "qwen")
        with torch.device("cpu"):  # computed on the CPU even when the model is built on the meta device
            self.inv_freq = rope_inv_freq(spec.layers[0].rope)

    def place_rope_tables(self, device: torch.device | str) -> None:
        """Move the fp32 inverse-frequency table to ``device`` once (see ``Gemma4Model.place_rope_tables``)."""
        self.inv_freq = self.inv_freq.to(device)

    def forward(self, ids: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """Final-normed hidden states [T, H] for the packed token ids [T]."""
        h = self.embed_tokens(ids)  # [T, H]
        cos, sin = self.ops.rope_cos_sin(self.inv_freq, ctx.positions, h.dtype)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            h, residual = layer(h, residual, cos, sin, ctx)
        return self.norm(h) if residual is None else self.ops.add_norm(self.norm, h, residual)[0]


class Qwen3MoeForCausalLM(CausalLM):
    """Qwen3-MoE causal LM: untied lm_head, no softcap."""

    decoder_class = Qwen3MoeModel
