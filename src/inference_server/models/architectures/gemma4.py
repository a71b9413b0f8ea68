"""Gemma 4 text decoder (and Gemma 3 through the same code), as specified in models.md §2 and §7.

Parameter names follow ``Gemma4ForCausalLM`` (``model.layers.{i}...``); the loader strips the hub prefix
``model.language_model.``. Gemma 3 runs here with the switches carried by ``ModelSpec``: (1 + w) rsqrt
norms, ``query_pre_attn_scalar ** -0.5`` attention scale, no value norm, no layer scalar.

Norm launches (issue 12): each layer is handed its normed input and the norm that follows it (the next layer's
input norm, or the model's final norm), and ends with one ``ops.norm_add`` that emits both the new hidden state
and that norm of it, so on CUDA a layer's norms take (``kernels.norm_add``, one launch each):

* dense layer (31B): after attention (post-attention norm, residual add, pre-FFN norm) and after the MLP
  (post-FFN norm, residual add, layer scalar, next norm): 2 launches;
* MoE layer (26B-A4B): after attention (the residual and three norms of it: the MLP's, the experts' and the
  router's folded norm) and after the FFN (both branches' norms, their sum's norm, residual add, layer scalar,
  next norm): 2 launches;
* PLE layer (E2B/E4B): the dense layer's two and the per-layer input's add (norm, add, scalar, next norm): 3; at
  decode the post-FFN add runs inside the per-layer-input gate's GEMV (``ops.norm_add_gated_projection``,
  ``kernels.norm_add_gemv``), so 2 launches of their own.

Only the first layer's input norm is a launch of its own (in ``Gemma4Model.forward``). Each launch keeps every
rounding of the op-by-op PyTorch sequence (``Ops.norm_add``'s composition, the CPU path): the same hidden states.
Gemma 3's ``1 + w`` norms have no kernel: there ``ops.norm_add`` is that op-by-op sequence on every device.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from inference_server.models.architectures.attention import AttentionContext
from inference_server.models.architectures.blocks import FusedExperts, GatedMLP, SelfAttention
from inference_server.models.architectures.causal_lm import CausalLM, Decoder
from inference_server.models.architectures.layers import NormParams, NormWeights, rope_inv_freq, uninitialised_embedding
from inference_server.models.architectures.linear import Linear
from inference_server.models.architectures.ops import OpsUser, RMSNorm
from inference_server.models.architectures.quantized import projection_weights
from inference_server.models.spec import LayerSpec, ModelSpec


class Gemma4Router(nn.Module, OpsUser):
    """Top-k routing from the *un-normed* residual: weightless norm, per-channel scale, H^-0.5, fp32 softmax,
    renormalised top-k weights times ``per_expert_scale`` (weights stay fp32)."""

    keeps_float_weights = True  # QUANTIZATION=int8 leaves the router float: its error would flip top-k choices
    renormalize = True  # the top-k weights are renormalised (read by the CUDA runner's paired FFN launch too)

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.eps = spec.rms_norm_eps
        self.top_k = spec.experts_top_k
        self.root_size = spec.hidden_size ** -0.5
        self.proj = nn.Linear(spec.hidden_size, spec.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(spec.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(spec.num_experts))
        self.folded_norm: NormParams | None = None  # set by fold_scale (not a parameter)

    def fold_scale(self) -> None:
        """Fold ``scale * H^-0.5`` into one fp32 norm weight, so the router's input is one norm (computed in the
        decoder layer's post-attention launch, ``input_norm``) instead of a norm and two multiplies (used while
        ``ops.fused_weights`` is on; the gemma4 norm multiplies by the weight in fp32 and rounds once, where the
        reference rounds after each multiply). Call once the weights are loaded and on their device. Idempotent,
        like ``SelfAttention.fuse_qkv``: a second runner over the same model must not replace the tensor, since the
        first runner's CUDA graphs read it by address (a fresh tensor here would free the old one under them)."""
        if self.folded_norm is None:
            self.folded_norm = NormParams(self.scale.detach().float() * self.root_size, self.eps, "gemma4")

    @property
    def input_norm(self) -> NormParams | None:
        """The norm that gives the router's input from the residual in one go, when the scale is folded and in use:
        the decoder layer computes it with its other norms of the residual and hands it to ``forward``."""
        return self.folded_norm if self.ops.fused_weights else None

    def forward(self, residual: torch.Tensor, normed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights (fp32) and expert ids [T, K] for ``residual`` [T, H]; ``normed`` is
        ``input_norm(residual)`` when the caller computed it already."""
        if normed is not None:
            x = normed
        elif self.input_norm is not None:
            x = self.ops.apply_norm(residual, self.input_norm)  # [T, H] in the residual's dtype
        else:
            x = self.ops.norm(residual, None, self.eps, "gemma4") * self.scale * self.root_size  # [T, H]
        # self.proj(x), then routing
        return self.ops.linear_route(x, self.proj.weight, self.top_k, self.renormalize, self.per_expert_scale,
                                None)  # fp32, ids


class Gemma4DecoderLayer(nn.Module, OpsUser):
    """Sandwich-normed attention and FFN; optional MoE beside the dense MLP, PLE gate and layer scalar."""

    layer_scalar: torch.Tensor  # a buffer, registered on Gemma 4 layers only (``has_layer_scalar``)

    def __init__(self, spec: ModelSpec, layer: LayerSpec) -> None:
        super().__init__()
        hidden, eps, style = spec.hidden_size, spec.rms_norm_eps, spec.norm_style
        self.self_attn = SelfAttention(spec, layer)
        self.mlp = GatedMLP(hidden, layer.intermediate_size, spec.hidden_activation)
        self.input_layernorm = RMSNorm(hidden, eps, style)
        self.post_attention_layernorm = RMSNorm(hidden, eps, style)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, style)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, style)
        self.has_layer_scalar = spec.architecture == "gemma4"
        if self.has_layer_scalar:
            self.register_buffer("layer_scalar", torch.ones(1))
        self.is_moe = layer.is_moe
        if self.is_moe:
            self.router = Gemma4Router(spec)
            self.experts = FusedExperts(spec.num_experts, hidden, spec.moe_intermediate_size,
                                        spec.hidden_activation)
            self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps, style)
            self.post_feedforward_layernorm_1 = RMSNorm(hidden, eps, style)
            self.post_feedforward_layernorm_2 = RMSNorm(hidden, eps, style)
        self.ple_size = spec.ple_hidden_size
        if self.ple_size:
            self.act_name = spec.hidden_activation
            self.per_layer_input_gate = Linear(hidden, self.ple_size, bias=False)
            self.per_layer_projection = Linear(self.ple_size, hidden, bias=False)
            self.post_per_layer_input_norm = RMSNorm(hidden, eps, style)

    def forward(
        self,
        h: torch.Tensor,  # [T, H]: the hidden state entering the layer
        h_normed: torch.Tensor,  # [T, H]: input_layernorm(h), made by the previous layer's last launch
        per_layer_input: torch.Tensor | None,  # [T, P]
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: AttentionContext,
        next_norm: NormWeights,  # the norm after this layer: the next layer's input norm, or the model's final norm
    ) -> tuple[torch.Tensor, torch.Tensor]:  # the new hidden state [T, H] and next_norm of it [T, H]
        ops = self.ops
        attn = self.self_attn(h_normed, cos, sin, ctx)
        # residual = h + post_norm(attn), and the FFN's norms of it: one op (one launch on CUDA)
        residual_norms: list[NormWeights] = [self.pre_feedforward_layernorm]
        router_norm = self.router.input_norm if self.is_moe else None
        if self.is_moe:
            residual_norms.append(self.pre_feedforward_layernorm_2)
        if router_norm is not None:
            residual_norms.append(router_norm)
        residual, (x, *moe_inputs) = ops.norm_add(attn, self.post_attention_layernorm, residual=h,
                                                  out_norms=residual_norms)
        if self.is_moe:  # the dense MLP and the routed experts: independent branches, one op
            m, moe = ops.mlp_beside_experts(self.mlp, self.router, self.experts, x, residual,
                                            moe_inputs[1] if router_norm is not None else None, moe_inputs[0])
        else:
            m = self.mlp(x)
        # h = residual + post_norm(m) (MoE: residual + post_norm(post_norm_1(m) + post_norm_2(moe))), then the layer
        # scalar and the next norm: one op (one launch on CUDA)
        scalar = self.layer_scalar if self.has_layer_scalar else None
        if self.ple_size and per_layer_input is None:
            raise ValueError("a layer with per-layer inputs (PLE) was called without them")
        gate_weights = projection_weights(self.per_layer_input_gate) if self.ple_size else None
        if gate_weights is not None and not self.is_moe:
            # h = residual + post_norm(m), then act(gate(h)) * per_layer_input: one op (one launch on CUDA at decode
            # instead of two), the same roundings
            h, gate = ops.norm_add_gated_projection(m, self.post_feedforward_layernorm, residual, *gate_weights,
                                                    self.act_name, per_layer_input)  # [T, H], [T, P]
        else:
            ends_here = gate_weights is None  # else the per-layer input's add is the last op, with scalar and norm
            scale_now, next_norms = (scalar, (next_norm,)) if ends_here else (None, ())
            if self.is_moe:
                h, normed = ops.norm_add(m, self.post_feedforward_layernorm_1, moe, self.post_feedforward_layernorm_2,
                                         sum_norm=self.post_feedforward_layernorm, residual=residual,
                                         scale=scale_now, out_norms=next_norms)
            else:
                h, normed = ops.norm_add(m, self.post_feedforward_layernorm, residual=residual, scale=scale_now,
                                         out_norms=next_norms)
            if gate_weights is not None:
                # act(gate(h)) * per_layer_input: one op (one launch on CUDA instead of three), the same roundings
                gate = ops.gated_projection(h, *gate_weights, self.act_name, per_layer_input)  # [T, P]
        if gate_weights is not None:
            h, normed = ops.norm_add(self.per_layer_projection(gate), self.post_per_layer_input_norm, residual=h,
                                     scale=scalar, out_norms=(next_norm,))
        return h, normed[0]


class Gemma4Model(Decoder):
    """Embeddings (with per-layer embeddings when configured), decoder layers and final norm."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = uninitialised_embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(spec, layer) for layer in spec.layers)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm_style)
        if spec.ple_hidden_size:
            total = spec.num_layers * spec.ple_hidden_size
            self.embed_tokens_per_layer = uninitialised_embedding(spec.ple_vocab_size, total)
            self.per_layer_model_projection = Linear(spec.hidden_size, total, bias=False)
            self.per_layer_projection_norm = RMSNorm(spec.ple_hidden_size, spec.rms_norm_eps, spec.norm_style)
        with torch.device("cpu"):  # computed on the CPU even when the model is built on the meta device
            self.inv_freqs = {layer.layer_type: rope_inv_freq(layer.rope) for layer in spec.layers}

    def place_rope_tables(self, device: torch.device | str) -> None:
        """Move the fp32 inverse-frequency tables to ``device`` once. They live on the CPU by default (they
        are built while the model may be on the meta device); on a GPU, a per-step host-to-device copy would
        cost a copy per forward and cannot be captured in a CUDA graph."""
        self.inv_freqs = {t: inv_freq.to(device) for t, inv_freq in self.inv_freqs.items()}

    def per_layer_inputs(self, ids: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
        """PLE: per-layer inputs [T, L, P] from the token table and a projection of the scaled embedding."""
        spec, tokens = self.spec, ids.shape[0]
        tok = self.embed_tokens_per_layer(ids)  # [T, L * P] in the table's dtype (dequantized rows when int8)
        tok = tok * torch.tensor(spec.ple_hidden_size ** 0.5).to(tok.dtype)
        tok = tok.reshape(tokens, spec.num_layers, spec.ple_hidden_size)
        proj = self.per_layer_model_projection(h0) * spec.hidden_size ** -0.5
        proj = self.per_layer_projection_norm(proj.reshape(tokens, spec.num_layers, spec.ple_hidden_size))
        return (proj + tok) * 2.0 ** -0.5

    def forward(self, ids: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """Final-normed hidden states [T, H] for the packed token ids [T]."""
        h = self.embed_tokens(ids)  # [T, H] in the table's dtype (dequantized rows when int8)
        h = h * torch.tensor(self.spec.embed_scale).to(h.dtype)
        ple = self.per_layer_inputs(ids, h) if self.spec.ple_hidden_size else None  # [T, L, P]
        rope = {t: self.ops.rope_cos_sin(inv_freq, ctx.positions, h.dtype) for t, inv_freq in self.inv_freqs.items()}
        decoder_layers = cast(list[Gemma4DecoderLayer], list(self.layers))
        # each layer ends with the norm that follows it: the next layer's input norm, after the last the final norm
        next_norms: list[NormWeights] = [*(layer.input_layernorm for layer in decoder_layers[1:]), self.norm]
        h_normed = decoder_layers[0].input_layernorm(h)
        for i, (decoder_layer, next_norm) in enumerate(zip(decoder_layers, next_norms, strict=True)):
            cos, sin = rope[self.spec.layers[i].layer_type]
            h, h_normed = decoder_layer(h, h_normed, ple[:, i, :] if ple is not None else None, cos, sin, ctx,
                                        next_norm)
        return h_normed


class Gemma4ForCausalLM(CausalLM):
    """Gemma 4 / Gemma 3 causal LM: tied lm_head and final logit softcapping."""

    decoder_class = Gemma4Model
