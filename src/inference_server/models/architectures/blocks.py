"""Modules shared by the Gemma and Qwen3-MoE decoders, with Hugging Face parameter names.

``SelfAttention`` covers every attention variant of the supported models through its ``LayerSpec`` and the
model's switches (norm style, value norm, scale); ``GatedMLP`` is the gate/up/down MLP; ``FusedExperts``
holds MoE expert weights stored fused as in the checkpoints (``gate_up_proj [E, 2I, H]``, gate rows first,
``down_proj [E, H, I]``) and runs them through the active MoE implementation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from inference_server.kernels.reference_int8 import quantize_int8_per_channel
from inference_server.models.architectures.attention import AttentionContext
from inference_server.models.architectures.layers import activation, canonical_activation
from inference_server.models.architectures.linear import Linear
from inference_server.models.architectures.ops import OpsUser, RMSNorm
from inference_server.models.architectures.quantized import Int8Linear
from inference_server.models.spec import LayerSpec, ModelSpec


def fuse_linear_weights(projections: Sequence[nn.Linear]) -> torch.Tensor:
    """One matrix holding the projections' weights stacked by rows (in order); each projection's weight
    becomes a view of its rows, so the weights exist once and loaders and ``state_dict`` see the same names."""
    return _fuse_rows([p.weight for p in projections])


def _fuse_rows(parameters: list[torch.Tensor]) -> torch.Tensor:
    fused = torch.cat([p.detach() for p in parameters], dim=0)
    offset = 0
    for parameter in parameters:
        rows = parameter.shape[0]
        parameter.data = fused[offset:offset + rows]
        offset += rows
    return fused


def fuse_projections(
    projections: Sequence[nn.Linear] | Sequence[Int8Linear],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``fuse_linear_weights`` for float or int8 projections (all of one kind): ``(weight, None)`` for float,
    ``(qweight, scale)`` for int8, the int8 weights and their per-row scales each concatenated along N (the
    rows), which is exact because every row keeps its own scale. Run the result through ``Ops.project``."""
    if all(isinstance(p, Int8Linear) for p in projections):
        int8 = [p for p in projections if isinstance(p, Int8Linear)]
        return _fuse_rows([p.qweight for p in int8]), _fuse_rows([p.scale for p in int8])
    if all(isinstance(p, nn.Linear) for p in projections):
        return fuse_linear_weights([p for p in projections if isinstance(p, nn.Linear)]), None
    raise TypeError("cannot fuse a mix of float and int8 projections")


def _rows(projection: nn.Module) -> int:
    return projection.out_features if isinstance(projection, (nn.Linear, Int8Linear)) else 0


class SelfAttention(nn.Module, OpsUser):
    """q/k/v projections, per-head q/k norms, RoPE, optional value norm, attention through the context."""

    def __init__(self, spec: ModelSpec, layer: LayerSpec) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = spec.num_attention_heads
        self.head_dim = layer.head_dim
        self.scale = spec.attention_scale if spec.attention_scale is not None else layer.head_dim ** -0.5
        self.logit_softcap = spec.attn_logit_softcapping
        hidden, d, kv = spec.hidden_size, layer.head_dim, layer.num_kv_heads
        self.q_proj = Linear(hidden, self.num_heads * d, bias=False)
        self.q_norm = RMSNorm(d, spec.rms_norm_eps, spec.norm_style)
        if layer.computes_kv:
            self.k_proj = Linear(hidden, kv * d, bias=False)
            self.k_norm = RMSNorm(d, spec.rms_norm_eps, spec.norm_style)
            self.v_proj = Linear(hidden, kv * d, bias=False) if layer.has_v_proj else None
            self.v_norm = RMSNorm(d, spec.rms_norm_eps, spec.norm_style, with_weight=False) \
                if spec.value_norm else None
        self.o_proj = Linear(self.num_heads * d, hidden, bias=False)
        self.qkv_weight: torch.Tensor | None = None  # set by fuse_qkv (not a parameter: no second state_dict entry)
        self.qkv_scale: torch.Tensor | None = None  # the fused per-row scales when the projections are int8
        self.qkv_rows: tuple[int, ...] = ()  # rows of q, k (and v) in qkv_weight

    def fuse_qkv(self) -> None:
        """Concatenate the q, k (and v) projection weights into one ``[(nH + nKV (+ nKV)) * D, H]`` matrix, so a
        step runs one GEMM instead of two or three; the projections' weights become views of it (no second
        copy). Call once the weights are loaded and on their device; idempotent; a layer that reuses another
        layer's KV has only q and is left alone. The fused GEMM runs only while ``ops.fused_weights`` is
        on in the layer's table (the CUDA runner's; off in the reference table)."""
        if not self.layer.computes_kv or self.qkv_weight is not None:
            return
        projections = [self.q_proj, self.k_proj] + ([self.v_proj] if self.v_proj is not None else [])
        self.qkv_weight, self.qkv_scale = fuse_projections(projections)
        self.qkv_rows = tuple(_rows(p) for p in projections)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Raw q [T, nH, D], k [T, nKV, D] and v (None where the layer has no such projection); views of one
        GEMM's output when the projections are fused."""
        tokens, d = x.shape[0], self.head_dim
        if not self.layer.computes_kv:
            return self.q_proj(x).view(tokens, -1, d), None, None
        if self.qkv_weight is not None and self.ops.fused_weights:
            return self._split_qkv(self.ops.project(x, self.qkv_weight, self.qkv_scale))
        q = self.q_proj(x).view(tokens, -1, d)
        k = self.k_proj(x).view(tokens, -1, d)
        return q, k, self.v_proj(x).view(tokens, -1, d) if self.v_proj is not None else None

    def _split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """q [T, nH, D], k [T, nKV, D] and v (or None) as strided views (last dim contiguous) of the fused
        projection's output ``qkv [T, (nH + nKV (+ nKV)) * D]``: slices of its ``[T, nH + nKV (+ nKV), D]`` view,
        adjacent in that order (one view and a slice each: a decode step runs this once per layer)."""
        heads = qkv.view(*qkv.shape[:-1], -1, self.head_dim)
        q_heads, kv_heads = self.qkv_rows[0] // self.head_dim, self.qkv_rows[1] // self.head_dim
        q, k = heads[..., :q_heads, :], heads[..., q_heads:q_heads + kv_heads, :]
        return q, k, heads[..., q_heads + kv_heads:, :] if len(self.qkv_rows) == 3 else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        return self._attend(*self._project(x), cos, sin, ctx)

    def add_norm_forward(
        self,
        norm: RMSNorm,  # the layer's input norm
        hidden: torch.Tensor,  # [T, H]: the previous layer's output, not yet added to the residual stream
        residual: torch.Tensor,  # [T, H]
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # the attention's output [T, H], residual + hidden
        """``forward(norm(residual + hidden))`` and ``residual + hidden``, as ``ops.add_norm`` then ``forward``. With
        the fused q/k/v weight the add, the norm and the projection go through ``ops.add_norm_projection`` (one
        launch on CUDA at decode sizes), since only that GEMM reads the normed rows."""
        if self.qkv_weight is None or not self.ops.fused_weights:
            x, residual = self.ops.add_norm(norm, hidden, residual)
            return self.forward(x, cos, sin, ctx), residual
        qkv, residual = self.ops.add_norm_projection(hidden, residual, norm, self.qkv_weight, self.qkv_scale)
        return self._attend(*self._split_qkv(qkv), cos, sin, ctx), residual

    def _attend(self, q_raw: torch.Tensor, k_raw: torch.Tensor | None, v_raw: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """The rest of ``forward`` after the projections: norms and RoPE, attention, the output projection."""
        tokens = q_raw.shape[0]
        computes_kv = k_raw is not None
        # ops.qk_norm_rope through the context, which may store k and v in the same pass
        q, k, v = ctx.qk_norm_rope(self.ops, self.layer, q_raw, k_raw, v_raw, self.q_norm,
                                   self.k_norm if computes_kv else None, self.v_norm if computes_kv else None,
                                   cos, sin)  # [T, nH, D], [T, nKV, D] x2
        out = ctx.attend(self.layer, q, k, v, self.scale, self.logit_softcap)  # [T, nH, D]
        return self.o_proj(out.reshape(tokens, -1))


class GatedMLP(nn.Module, OpsUser):
    """``down(act(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)
        activation(act)  # fails early on an unknown name
        self.act_name = act
        self.gate_up_weight: torch.Tensor | None = None  # set by fuse_gate_up (not a parameter)
        self.gate_up_scale: torch.Tensor | None = None  # its per-row scales when the projections are int8

    def fuse_gate_up(self) -> None:
        """Concatenate the gate and up weights into one ``[2I, H]`` matrix (the projections become views of it),
        so a step runs one GEMM instead of two while ``ops.fused_weights`` is on (see
        ``SelfAttention.fuse_qkv``). Idempotent; call once the weights are loaded and on their device."""
        if self.gate_up_weight is None:
            self.gate_up_weight, self.gate_up_scale = fuse_projections([self.gate_proj, self.up_proj])

    def activated(self, x: torch.Tensor) -> torch.Tensor:
        """``act(gate(x)) * up(x)`` ``[..., I]``, the down projection's input: the fused gate/up while
        ``ops.fused_weights`` is on and the weights are fused, else the two projections apart."""
        if self.gate_up_weight is not None and self.ops.fused_weights:
            return self.ops.gated_projection(x, self.gate_up_weight, self.gate_up_scale, self.act_name)
        return self.ops.gated_activation(self.gate_proj(x), self.up_proj(x), self.act_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activated(x))


class FusedExperts(nn.Module, OpsUser):
    """Expert weights of one MoE layer; ``forward`` applies the routed experts with their weights.

    After ``quantize_`` the two expert tensors are int8 (same names and shapes, ``requires_grad=False``) and
    ``gate_up_proj_scale [E, 2I]`` / ``down_proj_scale [E, H]`` hold their per-row scales; ``ops.fused_moe`` then
    gets the scales as keyword arguments."""

    gate_up_proj_scale: nn.Parameter | None
    down_proj_scale: nn.Parameter | None

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.register_parameter("gate_up_proj_scale", None)  # set by quantize_
        self.register_parameter("down_proj_scale", None)
        self.activation = canonical_activation(act)

    def quantize_(self) -> None:
        """Replace both expert tensors by int8 ones and their scales, one expert at a time (the float
        temporaries stay one expert big). The int8 tensors take the float ones' places among the parameters,
        so the parameter order (and ``loader.init_dummy_weights``' random stream) is unchanged; idempotent."""
        if self.gate_up_proj_scale is not None:
            return
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(self, name).detach()
            qweight = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
            scale = torch.empty(weight.shape[:-1], dtype=weight.dtype, device=weight.device)
            if weight.device.type != "meta":
                for expert in range(weight.shape[0]):
                    qweight[expert], scale[expert] = quantize_int8_per_channel(weight[expert])
            del weight
            setattr(self, name, nn.Parameter(qweight, requires_grad=False))
            setattr(self, f"{name}_scale", nn.Parameter(scale, requires_grad=False))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj_scale is None:
            return self.ops.fused_moe(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids, self.activation)
        return self.ops.fused_moe(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids, self.activation,
                                  w_gate_up_scale=self.gate_up_proj_scale, w_down_scale=self.down_proj_scale)
