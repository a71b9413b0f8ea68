"""The ops table model code computes through: ``Ops``, a frozen record of the swappable compute functions.

Model modules (``OpsUser``: ``RMSNorm``, ``linear.Linear``, ``quantized.Int8Linear``, the attention, MLP, expert,
router, decoder and causal-LM modules) read their ``ops`` attribute: ``REFERENCE_OPS`` (the PyTorch reference, every
value the parity tests compare against) until a runner binds its own table to the model once, at its construction
(``bind_ops``; the CUDA runner's is built from its options by ``backends.cuda.op_table``, the CPU runner's is the
reference with the CPU int8 matmul). Nothing is installed process-wide, so a reference model and a CUDA model live
side by side in one process, each with its table.

The table has two parts. The primitives (``norm``, ``rope``, ``rope_cos_sin``, ``linear``, ``int8_linear``,
``gated_activation``, ``route``, ``fused_moe``) each compute one thing; a backend swaps in faster implementations of
the same contract. The compositions (``Ops.add_rms_norm``, ``Ops.linear_route``, ``Ops.norm_add``, ...) are methods
written once here over the primitives; a backend may add a ``Fusions`` entry that computes one of them in fewer
launches and returns None where it does not take the inputs, in which case the method composes the primitives
(so each fusion's unfused form lives in one place: here).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn

from inference_server.kernels.reference_int8 import int8_linear_reference
from inference_server.kernels.reference_moe import route_softmax_topk
from inference_server.models.architectures import layers
from inference_server.models.architectures.layers import NormFn, NormWeights, RopeFn
from inference_server.models.architectures.layers import activation as activation_fn
from inference_server.models.spec import NormStyle


class MoEFn(Protocol):
    """The routed-experts op: ``torch_fused_moe``'s signature. The scales are given only for int8 experts
    (``w_gate_up`` / ``w_down`` int8, ``kernels/reference_int8.py`` format); float experts are called with the
    six positional arguments alone, so an implementation without int8 support still serves float models."""

    def __call__(self, hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor, act: str, *,
                 w_gate_up_scale: torch.Tensor | None = None,
                 w_down_scale: torch.Tensor | None = None) -> torch.Tensor: ...


LinearFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
"""``(x [..., K], weight [N, K], bias [N] | None) -> [..., N]``: ``torch.nn.functional.linear``'s contract."""
RopeTablesFn = Callable[[torch.Tensor, torch.Tensor, torch.dtype], tuple[torch.Tensor, ...]]
"""``(inv_freq [D/2], positions [T], dtype) -> (cos, sin)`` ``[T, D]``: ``layers.rope_cos_sin``'s contract."""
Int8LinearFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(x [T, K], qweight [N, K] int8, scale [N]) -> [T, N]`` in x's dtype (``int8_linear_reference``'s contract)."""
RouteFn = Callable[[torch.Tensor, int, bool, "torch.Tensor | None", "torch.dtype | None"],
                   tuple[torch.Tensor, torch.Tensor]]
"""``(router_logits [T, E], top_k, renormalize, per_expert_scale [E] | None, out_dtype | None) -> (weights, ids)``
``[T, K]``: ``torch_route``'s contract."""
GatedActivationFn = Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor]
"""``(gate, up, act) -> act(gate) * up``: ``torch_gated_activation``'s contract."""


def torch_route(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
    per_expert_scale: torch.Tensor | None = None,  # [E]
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, K], ids [T, K] int64
    """A MoE layer's routing after its router projection, as transformers computes it: softmax in fp32 over
    the E experts, ``torch.topk``, ``w / w.sum(-1)`` if ``renormalize`` (Qwen3-MoE's ``norm_topk_prob``,
    Gemma 4), ``w * per_expert_scale[ids]`` if a scale is given (Gemma 4: fp32 times the scale's dtype,
    promoted), then the cast to ``out_dtype`` (Qwen3-MoE: the activation dtype; None keeps fp32).
    The CUDA table's is ``kernels.router.triton_route``, one launch for all of it."""
    weights, ids = route_softmax_topk(router_logits, top_k, renormalize)  # [T, K] fp32, [T, K]
    if per_expert_scale is not None:
        weights = weights * per_expert_scale[ids]
    return (weights if out_dtype is None else weights.to(out_dtype)), ids


def torch_fused_moe(
    hidden: torch.Tensor,  # [T, H]
    w_gate_up: torch.Tensor,  # [E, 2I, H]
    w_down: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K]
    act: str,
    *,
    w_gate_up_scale: torch.Tensor | None = None,  # [E, 2I] when w_gate_up is int8
    w_down_scale: torch.Tensor | None = None,  # [E, H] when w_down is int8
) -> torch.Tensor:  # [T, H]
    """Routed experts in transformers' eager order: expert by expert, weighted in the weights' dtype,
    accumulated in the activation dtype with ``index_add_``. Only experts that received tokens are read; int8
    experts (scales given) go through ``int8_linear_reference`` one active expert at a time (fp32 accumulation,
    scale after the reduction, rounded to the activation dtype: the int8 matmul contract)."""
    act_fn = activation_fn(act)
    out = torch.zeros_like(hidden)
    flat_ids = topk_ids.reshape(-1)
    for expert in torch.unique(flat_ids).tolist():
        token_idx, k_pos = torch.where(topk_ids == expert)
        gate, up = _expert_linear(hidden[token_idx], w_gate_up, w_gate_up_scale, expert).chunk(2, dim=-1)
        y = _expert_linear(act_fn(gate) * up, w_down, w_down_scale, expert)  # [n, H]
        y = y * topk_weights[token_idx, k_pos, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


def _expert_linear(x: torch.Tensor, weights: torch.Tensor, scale: torch.Tensor | None, expert: int) -> torch.Tensor:
    """``x @ weights[expert].T``: ``F.linear`` for float experts, ``int8_linear_reference`` for int8 ones."""
    if scale is None:
        return torch.nn.functional.linear(x, weights[expert])
    return int8_linear_reference(x, weights[expert], scale[expert])


def torch_gated_activation(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """``act(gate) * up`` as two PyTorch kernels (each rounding to the activation dtype); ``act`` by its HF name.
    The CUDA table's is ``kernels.gated_activation``, one launch with the same two roundings."""
    return activation_fn(act)(gate) * up


@dataclasses.dataclass(frozen=True)
class Fusions:
    """One-launch forms of the ``Ops`` compositions (a backend's; the reference has none). Each takes the arguments
    of the ``Ops`` method of its name and returns what that method returns, or None where it does not take the
    inputs (then the method composes the primitives). A fusion gives the values of that composition over the same
    table's primitives (same roundings; summation order may differ where its docstring says so)."""

    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor] | None] | None = None
    linear_route: Callable[..., tuple[torch.Tensor, torch.Tensor] | None] | None = None
    add_norm_linear_route: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None] \
        | None = None
    qk_norm_rope: Callable[..., tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None] | None = None
    gated_projection: Callable[..., torch.Tensor | None] | None = None
    add_norm_projection: Callable[..., tuple[torch.Tensor, torch.Tensor] | None] | None = None
    norm_add: Callable[..., tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None] | None = None
    norm_add_gated_projection: Callable[..., tuple[torch.Tensor, torch.Tensor] | None] | None = None
    mlp_beside_experts: Callable[..., tuple[torch.Tensor, torch.Tensor] | None] | None = None


@dataclasses.dataclass(frozen=True)
class Ops:
    """The compute functions a model runs through (see the module docstring): primitives, whether the fused weights
    are used, and the backend's fusions of the compositions below."""

    norm: NormFn = layers.rms_norm
    """RMSNorm (``layers.rms_norm``'s contract): every ``RMSNorm`` and every norm inside a composition."""
    rope: RopeFn = layers.reference_rope_qk
    """RoPE on q and k (``layers.reference_rope_qk``'s contract; an implementation may rotate in place)."""
    rope_cos_sin: RopeTablesFn = layers.rope_cos_sin
    """A step's RoPE tables ``cos, sin [T, D]`` for its positions."""
    linear: LinearFn = torch.nn.functional.linear
    """Float projections: ``linear.Linear``, the fused q/k/v and gate/up, the tied logits, the router GEMM."""
    int8_linear: Int8LinearFn = int8_linear_reference
    """int8 weight-only projections (``quantized.Int8Linear``, int8 heads, fused int8 q/k/v and gate/up)."""
    gated_activation: GatedActivationFn = torch_gated_activation
    """``act(gate) * up`` of a gated MLP (two roundings to the activation dtype)."""
    route: RouteFn = torch_route
    """A MoE layer's routing after its router projection."""
    fused_moe: MoEFn = torch_fused_moe
    """The routed experts of a MoE layer."""
    fused_weights: bool = False
    """Whether layers whose weights were fused or folded at start-up use them: one GEMM for q/k/v
    (``SelfAttention.fuse_qkv``) and for a dense MLP's gate/up (``GatedMLP.fuse_gate_up``), Gemma 4's router scale
    folded into its norm (``Gemma4Router.fold_scale``). Same math, other rounding; off for the reference."""
    fusions: Fusions = Fusions()

    def apply_norm(self, x: torch.Tensor, norm: NormWeights) -> torch.Tensor:
        """``norm(x)`` through ``self.norm``: what ``RMSNorm.forward`` computes, for norms held as weights."""
        return self.norm(x, norm.weight, norm.eps, norm.style)

    def add_rms_norm(
        self,
        x: torch.Tensor,  # [T, H]: a block's output
        residual: torch.Tensor,  # [T, H]: the residual stream it is added to
        weight: torch.Tensor | None,
        eps: float,
        style: NormStyle,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # normed [T, H], new residual [T, H]
        """The residual add and the next RMSNorm: ``h = residual + x`` in the activation dtype, then the norm of
        ``h``; returns ``(norm(h), h)``. (CUDA fusion: ``kernels.rmsnorm.fused_add_rmsnorm``, which adds in fp32 and
        rounds to the activation dtype: the same value as torch's add.)"""
        fused = self.fusions.add_rms_norm
        if fused is not None and (out := fused(x, residual, weight, eps, style)) is not None:
            return out
        h = residual + x
        return self.norm(h, weight, eps, style), h

    def add_norm(self, norm: NormWeights, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``add_rms_norm`` with ``norm``'s weight, eps and style: ``(norm(residual + x), residual + x)``."""
        return self.add_rms_norm(x, residual, norm.weight, norm.eps, norm.style)

    def linear_route(
        self,
        x: torch.Tensor,  # [T, H]: the router's input
        weight: torch.Tensor,  # [E, H]: the router projection (float)
        top_k: int,
        renormalize: bool,
        per_expert_scale: torch.Tensor | None = None,  # [E]
        out_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, K], ids [T, K] int64
        """A MoE layer's router projection ``x @ weight.T`` (logits in x's dtype), then ``route``. (CUDA fusion at
        decode sizes: ``kernels.router.linear_route``, fp32 dot products rounded to x's dtype: the same logits up to
        summation order.)"""
        fused = self.fusions.linear_route
        if fused is not None and (out := fused(x, weight, top_k, renormalize, per_expert_scale,
                                               out_dtype)) is not None:
            return out
        return self.route(self.linear(x, weight, None), top_k, renormalize, per_expert_scale, out_dtype)

    def add_norm_route(
        self,
        norm: NormWeights,  # the RMSNorm before the router and the experts
        x: torch.Tensor,  # [T, H]: a block's output
        residual: torch.Tensor,  # [T, H]: the residual stream it is added to
        weight: torch.Tensor,  # [E, H]: the router projection
        top_k: int,
        renormalize: bool,
        per_expert_scale: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # normed, new residual, weights, ids
        """A pre-norm MoE layer's FFN entry: ``add_norm`` (``h = residual + x``, ``normed = norm(h)``), then
        ``linear_route`` of ``normed``; returns ``(normed, h, weights, ids)``. (CUDA fusion at decode sizes:
        ``kernels.router.add_norm_linear_route``.)"""
        fused = self.fusions.add_norm_linear_route
        if fused is not None and (out := fused(x, residual, norm.weight, norm.eps, norm.style, weight, top_k,
                                               renormalize, per_expert_scale, out_dtype)) is not None:
            return out
        normed, h = self.add_norm(norm, x, residual)
        return (normed, h, *self.linear_route(normed, weight, top_k, renormalize, per_expert_scale, out_dtype))

    def qk_norm_rope(
        self,
        q_raw: torch.Tensor,  # [T, nH, D]
        k_raw: torch.Tensor | None,  # [T, nKV, D]; None on a layer that reuses another layer's KV
        v_raw: torch.Tensor | None,  # [T, nKV, D]; None under K = V (the value is the raw k) or without KV
        q_norm: NormWeights,
        k_norm: NormWeights | None,
        v_norm: NormWeights | None,  # Gemma 4's weightless value norm, or None
        cos: torch.Tensor,  # [T, D]
        sin: torch.Tensor,  # [T, D]
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # q, k, v for attention
        """An attention layer between its projections and attention: ``q = rope(q_norm(q_raw))``,
        ``k = rope(k_norm(k_raw))``, ``v = v_norm(v_raw or k_raw)`` (``v_raw or k_raw`` without a value norm). The
        raw tensors are not written (under K = V the raw k is the value). (CUDA fusion: ``kernels.qk_norm_rope``.)"""
        fused = self.fusions.qk_norm_rope
        if fused is not None and (out := fused(q_raw, k_raw, v_raw, q_norm, k_norm, v_norm, cos, sin)) is not None:
            return out
        q = self.apply_norm(q_raw, q_norm)
        k = v = None
        if k_raw is not None:
            assert k_norm is not None
            v = v_raw if v_raw is not None else k_raw
            k = self.apply_norm(k_raw, k_norm)  # a new tensor: RoPE may rotate it in place
            if v_norm is not None:
                v = self.apply_norm(v, v_norm)
        q, k = self.rope(q, k, cos, sin)
        return q, k, v

    def project(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """``x [..., K] @ weight.T``: float weights through ``linear``, int8 ones (``scale`` given) through
        ``int8_linear``. Used by the fused projections and the compositions that end in a projection."""
        if scale is None:
            return self.linear(x, weight, None)
        if x.dim() == 2:  # [T, K] already: no reshape either way (two ops per projection at decode)
            return self.int8_linear(x, weight, scale)
        return self.int8_linear(x.reshape(-1, x.shape[-1]), weight, scale).reshape(*x.shape[:-1], weight.shape[0])

    def gated_projection(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, act: str,
                         up: torch.Tensor | None = None) -> torch.Tensor:
        """``act(gate) * up`` of a projection ``x [..., K] @ weight.T`` (``project``), by ``gated_activation``.
        Without ``up`` the weight is a fused ``[gate; up]`` ``[2I, K]`` (``GatedMLP.fuse_gate_up``) and the result
        ``[..., I]``; with ``up [..., N]`` the weight is the gate's alone (Gemma 4's per-layer-input gate). (CUDA
        fusion where the projection is a GEMV: ``kernels.gated_gemv``, the same bits.)"""
        fused = self.fusions.gated_projection
        if fused is not None and (out := fused(x, weight, scale, act, up)) is not None:
            return out
        projected = self.project(x, weight, scale)
        if up is None:
            gate, up = projected.chunk(2, dim=-1)  # [..., I] views
            return self.gated_activation(gate, up, act)
        return self.gated_activation(projected, up, act)

    def add_norm_projection(
        self,
        x: torch.Tensor,  # [T, H]: a block's output
        residual: torch.Tensor,  # [T, H]: the residual stream it is added to
        norm: NormWeights,  # the next block's pre-norm
        weight: torch.Tensor,  # [N, H]: float, or int8 with weight_scale
        weight_scale: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # norm(residual + x) @ weight.T [T, N], residual + x [T, H]
        """``add_norm`` (``h = residual + x`` and its norm), then the projection of the normed rows (``project``):
        Qwen3-MoE's input norm feeding the fused q/k/v projection, whose GEMM alone reads the normed rows. (CUDA
        fusion where the projection is a one-split CUDA-core GEMV: ``kernels.norm_add_gemv.add_norm_gemv``.)"""
        fused = self.fusions.add_norm_projection
        if fused is not None and (out := fused(x, residual, norm, weight, weight_scale)) is not None:
            return out
        normed, h = self.add_norm(norm, x, residual)
        return self.project(normed, weight, weight_scale), h

    def norm_add(
        self,
        a: torch.Tensor,  # [T, H]: a block's output
        a_norm: NormWeights,  # its post-norm
        b: torch.Tensor | None = None,  # [T, H]: a second branch (Gemma 4 MoE layers), added after its own norm
        b_norm: NormWeights | None = None,
        *,
        sum_norm: NormWeights | None = None,  # a norm of the branch sum (Gemma 4 MoE: the post-FFN norm)
        residual: torch.Tensor | None = None,  # [T, H]: the residual stream the normed output is added to
        scale: torch.Tensor | None = None,  # one element: the layer scalar, applied last
        out_norms: Sequence[NormWeights] = (),  # norms of the result: the next blocks' input norms
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:  # y [T, H], norm(y) [T, H] for each out norm
        """Gemma's sandwich-norm glue: ``y = a_norm(a) [+ b_norm(b)]``, then ``sum_norm(y)``, ``residual + y``,
        ``y * scale``, and each ``out_norm(y)``; each a tensor op rounding to the activation dtype. (CUDA fusion:
        ``kernels.norm_add``, one launch for all of it with up to three out norms.)"""
        fused = self.fusions.norm_add
        if fused is not None and (out := fused(a, a_norm, b, b_norm, sum_norm=sum_norm, residual=residual,
                                               scale=scale, out_norms=out_norms)) is not None:
            return out
        y = self.apply_norm(a, a_norm)
        if b is not None:
            assert b_norm is not None
            y = y + self.apply_norm(b, b_norm)
        if sum_norm is not None:
            y = self.apply_norm(y, sum_norm)
        if residual is not None:
            y = residual + y
        if scale is not None:
            y = y * scale
        return y, tuple(self.apply_norm(y, norm) for norm in out_norms)

    def norm_add_gated_projection(
        self,
        a: torch.Tensor,  # [T, H]: a block's output
        a_norm: NormWeights,  # its post-norm
        residual: torch.Tensor,  # [T, H]
        weight: torch.Tensor,  # [N, H]: the gate's (with up) or a fused [gate; up] (float, or int8 with weight_scale)
        weight_scale: torch.Tensor | None,
        act: str,
        up: torch.Tensor | None = None,  # [T, N]: the other factor, from memory
        *,
        scale: torch.Tensor | None = None,  # one element, applied to y last
    ) -> tuple[torch.Tensor, torch.Tensor]:  # y [T, H], the gated projection of y
        """``y = residual + a_norm(a) [* scale]`` (``norm_add``), then ``gated_projection`` of ``y``: Gemma 4's
        E2B/E4B MLP end feeding the per-layer-input gate. (CUDA fusion where the projection is a one-split CUDA-core
        GEMV: ``kernels.norm_add_gemv``.)"""
        fused = self.fusions.norm_add_gated_projection
        if fused is not None and (out := fused(a, a_norm, residual, weight, weight_scale, act, up,
                                               scale=scale)) is not None:
            return out
        y, _ = self.norm_add(a, a_norm, residual=residual, scale=scale)
        return y, self.gated_projection(y, weight, weight_scale, act, up)

    def mlp_beside_experts(
        self,
        mlp: nn.Module,  # x [T, H] -> [T, H]: the dense MLP (blocks.GatedMLP)
        router: nn.Module,  # (residual, router_input) -> routing weights, expert ids [T, K] (gemma4.Gemma4Router)
        experts: nn.Module,  # (expert_input, weights, ids) -> [T, H] (blocks.FusedExperts)
        x: torch.Tensor,  # [T, H]: the dense MLP's input
        residual: torch.Tensor,  # [T, H]: the residual stream the router norms itself when router_input is None
        router_input: torch.Tensor | None,  # [T, H]: the router's normed input, when the caller computed it
        expert_input: torch.Tensor,  # [T, H]: the experts' input
    ) -> tuple[torch.Tensor, torch.Tensor]:  # the dense MLP's output [T, H], the experts' [T, H]
        """Gemma 4's two FFN branches as the modules compute them: ``mlp(x)``, then the router and the routed
        experts. The branches do not depend on each other. (CUDA fusion at decode: two launches of paired work,
        ``kernels.mlp_beside_experts``.)"""
        fused = self.fusions.mlp_beside_experts
        if fused is not None and (out := fused(mlp, router, experts, x, residual, router_input,
                                               expert_input)) is not None:
            return out
        m = mlp(x)
        weights, ids = router(residual, router_input)
        return m, experts(expert_input, weights, ids)


REFERENCE_OPS = Ops()
"""The PyTorch reference table: the values every other table is tested against (the CPU engine's is it with its own
int8 matmul; the CUDA runner's ``reference_ops`` table, the before of every before/after, is it with the Triton norm,
RoPE, MoE and int8 GEMVs)."""


class OpsUser:
    """A model module whose forward computes through an ops table: ``ops``, the reference until ``bind_ops``."""

    ops: Ops = REFERENCE_OPS


def bind_ops(model: nn.Module, table: Ops) -> None:
    """Make ``table`` the ops of every ``OpsUser`` module of ``model`` (a runner calls it once, when it takes the
    model; a model serves one runner's table at a time, so a reference run beside a CUDA run uses its own model)."""
    for module in model.modules():
        if isinstance(module, OpsUser):
            module.ops = table


class RMSNorm(nn.Module, OpsUser):
    """An RMSNorm with an HF-named ``weight`` parameter (or none, for weightless norms), through ``ops.norm``."""

    def __init__(self, dim: int, eps: float, style: NormStyle, with_weight: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.style: NormStyle = style
        self.weight = nn.Parameter(torch.ones(dim)) if with_weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.norm(x, self.weight, self.eps, self.style)
