"""Swappable compute ops used by model code: the PyTorch reference by default, Triton on CUDA.

Model files call ``ops.fused_moe``, ``ops.route``, ``ops.linear_route`` (a router projection and its routing),
``ops.gated_activation``, ``ops.gated_projection`` (a fused gate/up projection and its gated activation),
``ops.add_rms_norm`` (a residual add and the RMSNorm after it), ``ops.add_norm_projection`` (the two feeding a
projection), ``ops.norm_add`` (Gemma's post-norm(s) + residual add + scale + next norms),
``ops.norm_add_gated_projection`` (such an add feeding a gated projection),
``ops.qk_norm_rope`` (an attention layer's per-head norms and RoPE), ``ops.rope_cos_sin`` (a step's RoPE tables),
``ops.int8_linear`` (int8 weight-only layers, ``quantized.Int8Linear``), ``ops.linear`` (float projections:
``linear.Linear``, the fused q/k/v and gate/up, the logits, the router GEMM outside the fused routing launch) and
(through ``layers.RMSNorm``) the installed RMSNorm; a backend installs faster implementations with ``use_ops`` at
start-up (the CUDA backend installs the Triton kernels). Keeping the switch here means model code reads the same on
every device. The choice is process-wide: a test that runs a reference runner beside a CUDA runner wraps the
reference steps in ``reference_ops()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch
from torch import nn

from inference_server.kernels.reference_int8 import int8_linear_reference
from inference_server.kernels.reference_moe import route_softmax_topk
from inference_server.models.architectures import layers
from inference_server.models.architectures.layers import NormFn
from inference_server.models.architectures.layers import activation as activation_fn
from inference_server.models.spec import NormStyle


class MoEFn(Protocol):
    """The routed-experts op: ``ops.torch_fused_moe``'s signature. The scales are given only for int8 experts
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
LinearRouteFn = Callable[[torch.Tensor, torch.Tensor, int, bool, "torch.Tensor | None", "torch.dtype | None"],
                         tuple[torch.Tensor, torch.Tensor]]
AddNormFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", float, NormStyle],
                     tuple[torch.Tensor, torch.Tensor]]
AddNormLinearRouteFn = Callable[
    [torch.Tensor, torch.Tensor, "torch.Tensor | None", float, NormStyle, torch.Tensor, int, bool,
     "torch.Tensor | None", "torch.dtype | None"],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


def torch_add_rms_norm(
    x: torch.Tensor,  # [T, H]: a block's output
    residual: torch.Tensor,  # [T, H]: the residual stream it is added to
    weight: torch.Tensor | None,
    eps: float,
    style: NormStyle,
) -> tuple[torch.Tensor, torch.Tensor]:  # normed [T, H], new residual [T, H]
    """The residual add and the next RMSNorm, as the decoder layers wrote them before this op existed:
    ``h = residual + x`` in the activation dtype, then the installed RMSNorm of ``h``; returns ``(norm(h), h)``.
    The CUDA backend installs one Triton launch for both (``kernels.rmsnorm.fused_add_rmsnorm``), which adds
    in fp32 and rounds to the activation dtype: the same value as torch's add."""
    h = residual + x
    return layers.apply_rms_norm(h, weight, eps, style), h


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
    The CUDA backend installs ``kernels.router.triton_route``, one launch for all of it."""
    weights, ids = route_softmax_topk(router_logits, top_k, renormalize)  # [T, K] fp32, [T, K]
    if per_expert_scale is not None:
        weights = weights * per_expert_scale[ids]
    return (weights if out_dtype is None else weights.to(out_dtype)), ids


def torch_linear_route(
    x: torch.Tensor,  # [T, H]: the router's input
    weight: torch.Tensor,  # [E, H]: the router projection (float)
    top_k: int,
    renormalize: bool,
    per_expert_scale: torch.Tensor | None = None,  # [E]
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, K], ids [T, K] int64
    """A MoE layer's router projection ``x @ weight.T`` (logits in x's dtype), then the installed ``route``. The
    CUDA backend installs one Triton launch for both at decode sizes (``kernels.router.linear_route``: fp32 dot
    products rounded to x's dtype, the same logits up to summation order)."""
    return route(linear(x, weight, None), top_k, renormalize, per_expert_scale, out_dtype)


def torch_add_norm_linear_route(
    x: torch.Tensor,  # [T, H]: a block's output
    residual: torch.Tensor,  # [T, H]: the residual stream it is added to
    norm_weight: torch.Tensor | None,  # the RMSNorm before the router and the experts
    eps: float,
    style: NormStyle,
    weight: torch.Tensor,  # [E, H]: the router projection
    top_k: int,
    renormalize: bool,
    per_expert_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # normed, new residual, weights, ids
    """A pre-norm MoE layer's FFN entry: the installed ``add_rms_norm`` (``h = residual + x``, ``normed =
    norm(h)``), then the installed ``linear_route`` of ``normed``; returns ``(normed, h, weights, ids)``. The CUDA
    backend installs one launch for all of it at decode sizes (``kernels.router.add_norm_linear_route``)."""
    normed, h = add_rms_norm(x, residual, norm_weight, eps, style)
    return (normed, h, *linear_route(normed, weight, top_k, renormalize, per_expert_scale, out_dtype))


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


def torch_int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The default ``int8_linear``: ``kernels.reference_int8.int8_linear_reference`` (fp32 accumulation, the
    scale applied after the reduction). The CPU engine installs a faster one (``kernels.cpu_int8``); the CUDA
    backend the Triton GEMV/GEMM."""
    return int8_linear_reference(x, qweight, scale)


GatedActivationFn = Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor]
QkNormRopeFn = Callable[
    [torch.Tensor, "torch.Tensor | None", "torch.Tensor | None", layers.RMSNorm, "layers.RMSNorm | None",
     "layers.RMSNorm | None", torch.Tensor, torch.Tensor],
    tuple[torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"]]


def torch_qk_norm_rope(
    q_raw: torch.Tensor,  # [T, nH, D]
    k_raw: torch.Tensor | None,  # [T, nKV, D]; None on a layer that reuses another layer's KV
    v_raw: torch.Tensor | None,  # [T, nKV, D]; None under K = V (the value is the raw k) or without KV
    q_norm: layers.RMSNorm,
    k_norm: layers.RMSNorm | None,
    v_norm: layers.RMSNorm | None,  # Gemma 4's weightless value norm, or None
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,  # [T, D]
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # q, k, v for attention
    """An attention layer between its projections and attention: ``q = rope(q_norm(q_raw))``,
    ``k = rope(k_norm(k_raw))``, ``v = v_norm(v_raw or k_raw)`` (``v_raw or k_raw`` without a value norm), through
    the installed norm and RoPE. The raw tensors are not written (under K = V the raw k is the value). The CUDA
    backend installs ``kernels.qk_norm_rope``: one launch for all of it."""
    q = q_norm(q_raw)
    k = v = None
    if k_raw is not None:
        assert k_norm is not None
        v = v_raw if v_raw is not None else k_raw
        k = k_norm(k_raw)  # a new tensor: RoPE may rotate it in place
        if v_norm is not None:
            v = v_norm(v)
    q, k = layers.apply_rope_qk(q, k, cos, sin)
    return q, k, v


def torch_gated_activation(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """``act(gate) * up`` as two PyTorch kernels (each rounding to the activation dtype); ``act`` by its HF name.
    The CUDA backend installs ``kernels.gated_activation``, one launch with the same two roundings."""
    return activation_fn(act)(gate) * up


def project(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``x [..., K] @ weight.T``: float weights through the installed ``linear``, int8 ones (``scale`` given) through
    the installed ``int8_linear``. Used by the fused projections (``SelfAttention.fuse_qkv``, ``GatedMLP.fuse_gate_up``)
    and the ops that end in a projection."""
    if scale is None:
        return linear(x, weight, None)
    return int8_linear(x.reshape(-1, x.shape[-1]), weight, scale).reshape(*x.shape[:-1], weight.shape[0])


class AddNormProjectionFn(Protocol):
    """The op of a residual add and the pre-norm feeding a projection: ``torch_add_norm_projection``'s signature."""

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, norm: layers.NormWeights, weight: torch.Tensor,
                 weight_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]: ...


def torch_add_norm_projection(
    x: torch.Tensor,  # [T, H]: a block's output
    residual: torch.Tensor,  # [T, H]: the residual stream it is added to
    norm: layers.NormWeights,  # the next block's pre-norm
    weight: torch.Tensor,  # [N, H]: float, or int8 with weight_scale
    weight_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # norm(residual + x) @ weight.T [T, N], residual + x [T, H]
    """The installed ``add_rms_norm`` (``h = residual + x`` and its norm), then the projection of the normed rows
    (``project``): Qwen3-MoE's input norm feeding the fused q/k/v projection, whose GEMM alone reads the normed rows.
    The CUDA backend installs one launch for both where the projection is a one-split CUDA-core GEMV
    (``kernels.norm_add_gemv.add_norm_gemv``)."""
    normed, h = add_rms_norm(x, residual, norm.weight, norm.eps, norm.style)
    return project(normed, weight, weight_scale), h


class GatedProjectionFn(Protocol):
    """The gated projection op: ``ops.torch_gated_projection``'s signature."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, act: str,
                 up: torch.Tensor | None = None) -> torch.Tensor: ...


def torch_gated_projection(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, act: str,
                           up: torch.Tensor | None = None) -> torch.Tensor:
    """``act(gate) * up`` of a projection ``x [..., K] @ weight.T`` (float weights through the installed
    ``linear``, int8 ones with their ``scale`` through the installed ``int8_linear``), by the installed
    ``gated_activation``. Without ``up`` the weight is a fused ``[gate; up]`` ``[2I, K]`` (``GatedMLP.fuse_gate_up``)
    and the result ``[..., I]``; with ``up [..., N]`` the weight is the gate's alone (Gemma 4's per-layer-input
    gate). The CUDA backend installs one launch for both where the projection is a GEMV (``kernels.gated_gemv``:
    the same bits)."""
    projected = project(x, weight, scale)
    if up is None:
        gate, up = projected.chunk(2, dim=-1)  # [..., I] views
        return gated_activation(gate, up, act)
    return gated_activation(projected, up, act)


class NormAddFn(Protocol):
    """The sandwich-norm op: ``ops.torch_norm_add``'s signature."""

    def __call__(self, a: torch.Tensor, a_norm: layers.NormWeights, b: torch.Tensor | None = None,
                 b_norm: layers.NormWeights | None = None, *, sum_norm: layers.NormWeights | None = None,
                 residual: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                 out_norms: Sequence[layers.NormWeights] = ()) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]: ...


def torch_norm_add(
    a: torch.Tensor,  # [T, H]: a block's output
    a_norm: layers.NormWeights,  # its post-norm
    b: torch.Tensor | None = None,  # [T, H]: a second branch (Gemma 4 MoE layers), added after its own norm
    b_norm: layers.NormWeights | None = None,
    *,
    sum_norm: layers.NormWeights | None = None,  # a norm of the branch sum (Gemma 4 MoE: the post-FFN norm)
    residual: torch.Tensor | None = None,  # [T, H]: the residual stream the normed output is added to
    scale: torch.Tensor | None = None,  # one element: the layer scalar, applied last
    out_norms: Sequence[layers.NormWeights] = (),  # norms of the result: the next blocks' input norms
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:  # y [T, H], norm(y) [T, H] for each out norm
    """Gemma's sandwich-norm glue as the decoder layers wrote it: ``y = a_norm(a) [+ b_norm(b)]``, then
    ``sum_norm(y)``, ``residual + y``, ``y * scale``, and each ``out_norm(y)``; each a tensor op rounding to the
    activation dtype, each norm the installed one (``layers.apply_norm``). The CUDA backend installs
    ``kernels.norm_add``: one launch for all of it (up to three out norms)."""
    y = layers.apply_norm(a, a_norm)
    if b is not None:
        assert b_norm is not None
        y = y + layers.apply_norm(b, b_norm)
    if sum_norm is not None:
        y = layers.apply_norm(y, sum_norm)
    if residual is not None:
        y = residual + y
    if scale is not None:
        y = y * scale
    return y, tuple(layers.apply_norm(y, norm) for norm in out_norms)


class NormAddGatedProjectionFn(Protocol):
    """The op of a sandwich norm's residual add feeding a gated projection: ``torch_norm_add_gated_projection``'s
    signature."""

    def __call__(self, a: torch.Tensor, a_norm: layers.NormWeights, residual: torch.Tensor,
                 weight: torch.Tensor, weight_scale: torch.Tensor | None, act: str, up: torch.Tensor | None = None, *,
                 scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...


def torch_norm_add_gated_projection(
    a: torch.Tensor,  # [T, H]: a block's output
    a_norm: layers.NormWeights,  # its post-norm
    residual: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [N, H]: the gate's (with up) or a fused [gate; up] (float, or int8 with weight_scale)
    weight_scale: torch.Tensor | None,
    act: str,
    up: torch.Tensor | None = None,  # [T, N]: the other factor, from memory
    *,
    scale: torch.Tensor | None = None,  # one element, applied to y last
) -> tuple[torch.Tensor, torch.Tensor]:  # y [T, H], the gated projection of y
    """``y = residual + a_norm(a) [* scale]`` (the installed ``norm_add``), then the installed ``gated_projection``
    of ``y``: Gemma 4's E2B/E4B MLP end feeding the per-layer-input gate. The CUDA backend installs one launch for
    both where the projection is a one-split CUDA-core GEMV (``kernels.norm_add_gemv``)."""
    y, _ = norm_add(a, a_norm, residual=residual, scale=scale)
    return y, gated_projection(y, weight, weight_scale, act, up)


class MlpBesideExpertsFn(Protocol):
    """The op of a MoE layer's FFN with a dense MLP beside the routed experts: ``torch_mlp_beside_experts``'s
    signature."""

    def __call__(self, mlp: nn.Module, router: nn.Module, experts: nn.Module, x: torch.Tensor,
                 residual: torch.Tensor, router_input: torch.Tensor | None,
                 expert_input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


def torch_mlp_beside_experts(
    mlp: nn.Module,  # x [T, H] -> [T, H]: the dense MLP (blocks.GatedMLP)
    router: nn.Module,  # (residual, router_input) -> routing weights, expert ids [T, K] (gemma4.Gemma4Router)
    experts: nn.Module,  # (expert_input, weights, ids) -> [T, H] (blocks.FusedExperts)
    x: torch.Tensor,  # [T, H]: the dense MLP's input
    residual: torch.Tensor,  # [T, H]: the residual stream the router norms itself when router_input is None
    router_input: torch.Tensor | None,  # [T, H]: the router's normed input, when the caller computed it
    expert_input: torch.Tensor,  # [T, H]: the experts' input
) -> tuple[torch.Tensor, torch.Tensor]:  # the dense MLP's output [T, H], the experts' [T, H]
    """Gemma 4's two FFN branches as the modules compute them: ``mlp(x)``, then the router and the routed
    experts. The branches do not depend on each other; the CUDA backend installs a version that runs them in
    two launches of paired work at decode (``kernels.mlp_beside_experts``) and these calls elsewhere."""
    m = mlp(x)
    weights, ids = router(residual, router_input)
    return m, experts(expert_input, weights, ids)


fused_moe: MoEFn = torch_fused_moe
route: RouteFn = torch_route
linear_route: LinearRouteFn = torch_linear_route
gated_activation: GatedActivationFn = torch_gated_activation
gated_projection: GatedProjectionFn = torch_gated_projection
add_rms_norm: AddNormFn = torch_add_rms_norm
add_norm_linear_route: AddNormLinearRouteFn = torch_add_norm_linear_route
qk_norm_rope: QkNormRopeFn = torch_qk_norm_rope
norm_add: NormAddFn = torch_norm_add
mlp_beside_experts: MlpBesideExpertsFn = torch_mlp_beside_experts
norm_add_gated_projection: NormAddGatedProjectionFn = torch_norm_add_gated_projection
add_norm_projection: AddNormProjectionFn = torch_add_norm_projection
int8_linear: Int8LinearFn = torch_int8_linear
linear: LinearFn = torch.nn.functional.linear
"""Float-weight projections (the CUDA backend installs a Triton GEMV for small token counts, cuBLAS above)."""
fused_weights = False
"""Whether layers whose weights were fused or folded at start-up use them: one GEMM for q/k/v
(``SelfAttention.fuse_qkv``) and for a dense MLP's gate/up (``GatedMLP.fuse_gate_up``), Gemma 4's router
scale folded into its norm (``Gemma4Router.fold_scale``). Same math, other rounding; off for the reference."""
rope_cos_sin: RopeTablesFn = layers.rope_cos_sin
"""A step's RoPE tables ``cos, sin [T, D]`` for its positions (``layers.rope_cos_sin``'s contract; the CUDA backend
installs ``kernels.rope_tables``, one launch a table instead of seven)."""


def add_norm(norm: layers.RMSNorm, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The installed ``add_rms_norm`` with ``norm``'s weight, eps and style: ``(norm(residual + x), residual + x)``."""
    return add_rms_norm(x, residual, norm.weight, norm.eps, norm.style)


def add_norm_route(norm: layers.RMSNorm, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, top_k: int,
                   renormalize: bool, per_expert_scale: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                  torch.Tensor]:
    """The installed ``add_norm_linear_route`` with ``norm``'s weight, eps and style: ``(norm(residual + x),
    residual + x, routing weights, expert ids)``."""
    return add_norm_linear_route(x, residual, norm.weight, norm.eps, norm.style, weight, top_k, renormalize,
                                 per_expert_scale, out_dtype)


_REFERENCE: dict[str, object] = {
    "fused_moe": torch_fused_moe,
    "route": torch_route,
    "linear_route": torch_linear_route,
    "gated_activation": torch_gated_activation,
    "gated_projection": torch_gated_projection,
    "add_rms_norm": torch_add_rms_norm,
    "add_norm_linear_route": torch_add_norm_linear_route,
    "qk_norm_rope": torch_qk_norm_rope,
    "norm_add": torch_norm_add,
    "mlp_beside_experts": torch_mlp_beside_experts,
    "norm_add_gated_projection": torch_norm_add_gated_projection,
    "add_norm_projection": torch_add_norm_projection,
    "int8_linear": torch_int8_linear,
    "linear": torch.nn.functional.linear,
    "fused_weights": False,
    "rope_cos_sin": layers.rope_cos_sin,
}
"""Every swappable attribute of this module and its reference value (what ``reference_ops`` installs)."""


def use_ops(*, moe: MoEFn | None = None, norm: NormFn | None = None, rope: layers.RopeFn | None = None,
            router: RouteFn | None = None, weights_fused: bool | None = None,
            gated: GatedActivationFn | None = None, add_norm: AddNormFn | None = None,
            qk_norm: QkNormRopeFn | None = None, sandwich: NormAddFn | None = None,
            int8_linear: Int8LinearFn | None = None, linear_router: LinearRouteFn | None = None,
            linear: LinearFn | None = None, add_norm_router: AddNormLinearRouteFn | None = None,
            gated_proj: GatedProjectionFn | None = None, rope_tables: RopeTablesFn | None = None,
            mlp_experts: MlpBesideExpertsFn | None = None,
            norm_add_gated: NormAddGatedProjectionFn | None = None,
            add_norm_proj: AddNormProjectionFn | None = None) -> None:
    """Install faster implementations (process-wide; a backend calls it at start-up); None leaves one as is."""
    chosen = {"fused_moe": moe, "route": router, "linear_route": linear_router, "gated_activation": gated,
              "gated_projection": gated_proj,
              "add_rms_norm": add_norm, "add_norm_linear_route": add_norm_router,
              "qk_norm_rope": qk_norm, "norm_add": sandwich, "int8_linear": int8_linear, "linear": linear,
              "fused_weights": weights_fused, "rope_cos_sin": rope_tables, "mlp_beside_experts": mlp_experts,
              "norm_add_gated_projection": norm_add_gated, "add_norm_projection": add_norm_proj}
    assert chosen.keys() == _REFERENCE.keys()
    globals().update({name: value for name, value in chosen.items() if value is not None})
    if norm is not None:
        layers.set_norm_impl(norm)
    if rope is not None:
        layers.set_rope_impl(rope)


@contextlib.contextmanager
def reference_ops() -> Iterator[None]:
    """Run the block with the PyTorch reference ops, then restore whatever was installed before."""
    module = globals()
    previous = {name: module[name] for name in _REFERENCE}
    module.update(_REFERENCE)
    previous_norm = layers.set_norm_impl(layers.rms_norm)
    previous_rope = layers.set_rope_impl(layers.reference_rope_qk)
    try:
        yield
    finally:
        module.update(previous)
        layers.set_norm_impl(previous_norm)
        layers.set_rope_impl(previous_rope)
