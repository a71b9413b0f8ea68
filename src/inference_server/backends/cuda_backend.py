"""The ``custom-cuda`` step runner: Triton kernels for attention, KV store, MoE and RMSNorm, decode in CUDA graphs.

What it changes against the reference ``ModelRunner`` (same ``execute(plan) -> StepResult`` contract):

* Ops: installs the Triton fused MoE, the Triton RMSNorm and the Triton q/k RoPE through
  ``architectures.ops.use_ops`` (process-wide; it re-installs them at every step so a reference runner in the same
  process, run under ``ops.reference_ops()``, cannot leave the wrong ones behind). Attention goes through
  ``PagedAttentionContext`` with the Triton store, prefill and decode kernels. The decode kernel gets a fixed
  ``max_context_len`` (the engine's model length), so its split count depends on the batch size only: eager
  and graphed steps of the same batch run identical kernels.
* Weights and KV stay in the dtype they were built with (bf16 on CUDA); rope tables move to the device once.
* Steps of 1-2 tokens run the routed experts as the MoE decode GEMVs (``kernels.moe_decode``, two launches), larger
  ones as the grouped GEMMs. A Gemma 4 MoE layer's dense MLP runs beside them at those sizes: its gate/up GEMV in the
  router's launch, its down GEMV in the experts' gate/up launch (``kernels.mlp_beside_experts``). Float projections
  of small steps take the Triton GEMV where this GPU's tuning sweep timed it faster than cuBLAS (tuned files in
  ``kernels/configs/dense_linear``), cuBLAS elsewhere.
* Greedy sampling: when every sampled row takes the argmax and asks for nothing else, the lm_head and the
  greedy choice run as one fused GEMV (``kernels.greedy_head``, ``triton_greedy_head``) instead of the full
  logits and the sampler; prompt logprobs and every other sampling request keep the full logits.
* Decode-only steps of at most ``max_batch_size`` sequences replay a CUDA graph of the smallest bucket that
  holds them (``cuda_graphs.DecodeGraphs``); steps with prefill chunks run eagerly. The graph ends at the
  final hidden states: logits and sampling run outside it, on the sampled rows only.
* No host syncs inside the forward (every kernel wrapper sizes its grid from shapes; the reference paths
  with ``.tolist()`` are not used). The sampled tokens come back through pinned memory behind an event,
  so ``launch`` returns while the step runs (``model_runner``'s overlap contract).
* ``compile=True`` wraps the model in ``torch.compile`` (default mode): Inductor fuses the elementwise ops
  (norms, RoPE, routing, residuals) between the Triton kernels, which stay opaque to the compiler (a graph
  break at each attention call and each MoE call; traced through Inductor, the decode kernel's float scale
  became an fp64 constant that its loop rejects, seen on the H200 with torch 2.11 / Triton 3.6). The decode
  graphs then capture the compiled code after a warm-up per bucket.

Overlap needs no second set of static buffers: ``DecodeGraphs.stage`` for step N+1 enqueues its copies on
the same stream as step N's replay, so they land after step N has read the buffers.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence

import attrs
import torch
from torch import nn

from inference_server.backends.cuda_graphs import DecodeGraphs
from inference_server.backends.model_runner import LaunchedStep, ModelRunner
from inference_server.backends.paged_kv import PagedAttentionContext, PagedKVStorage, StepTensors
from inference_server.config import Settings
from inference_server.kernels import rmsnorm as triton_norm
from inference_server.kernels.decode_attention import QueryNormRope, paged_decode_attention
from inference_server.kernels.dense_linear import cublas_is_faster, dense_linear, triton_is_faster
from inference_server.kernels.fused_moe import fused_moe
from inference_server.kernels.gated_activation import SUPPORTED as GATED_ACTIVATIONS
from inference_server.kernels.gated_activation import gated_activation
from inference_server.kernels.gated_gemv import gated_gemv, gated_gemv_config
from inference_server.kernels.greedy_head import ROW_BLOCKS, greedy_head, greedy_head_of_logits, greedy_head_supports
from inference_server.kernels.int8_linear import int8_linear as triton_int8_linear
from inference_server.kernels.int8_linear_configs import Int8LinearConfig
from inference_server.kernels.kv_store import store_kv
from inference_server.kernels.mlp_beside_experts import expert_gate_up_beside_gemv, gated_gemv_and_route, shares_warps
from inference_server.kernels.moe_decode import fused_moe_decode, use_down_weights_before_wait
from inference_server.kernels.norm_add import MAX_OUT_NORMS as NORM_ADD_MAX_OUT_NORMS
from inference_server.kernels.norm_add import norm_add
from inference_server.kernels.norm_add_gemv import MAX_NORM_COLUMNS, add_norm_gemv, norm_add_gemv
from inference_server.kernels.pdl import loop_classes, use_early_release, use_pdl
from inference_server.kernels.prefill_attention import paged_prefill_attention
from inference_server.kernels.qk_norm_rope import PagedKVWrite, qk_norm_rope
from inference_server.kernels.reference_norm import NormMode
from inference_server.kernels.rope import rope_qk_
from inference_server.kernels.rope_tables import rope_tables
from inference_server.kernels.router import MAX_EXPERTS, add_norm_linear_route, linear_route, triton_route
from inference_server.kernels.streamed_linear import GEMV_MAX_TOKENS
from inference_server.models.architectures import layers, ops
from inference_server.models.architectures.blocks import FusedExperts, GatedMLP, SelfAttention
from inference_server.models.architectures.causal_lm import CausalLM
from inference_server.models.architectures.gemma4 import Gemma4Router
from inference_server.models.architectures.quantized import projection_weights
from inference_server.models.loading.source import LoadedModel
from inference_server.models.spec import LayerSpec, ModelSpec, NormStyle
from inference_server.records.sampling_params import SamplingParams
from inference_server.records.steps import ScheduledSequence, StepPlan
from inference_server.startup import phase
from inference_server.telemetry import profiler_ranges

# gemma3's (1 + w) norm has no kernel: reference
_TRITON_NORM_MODE: dict[str, NormMode] = {"gemma4": "gemma", "qwen": "qwen"}


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, style: NormStyle) -> torch.Tensor:
    """``layers.rms_norm`` contract through the Triton kernel (one launch instead of ~7 elementwise kernels);
    falls back to the reference for the gemma3 style and for inputs the kernel does not take."""
    mode = _TRITON_NORM_MODE.get(style)
    if mode is None or x.dim() > 3 or x.stride(-1) != 1:
        return layers.rms_norm(x, weight, eps, style)
    return triton_norm.rms_norm(x, weight, eps, mode)  # type: ignore[arg-type]


def triton_gated_activation(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """``ops.GatedActivationFn`` in one Triton launch (``kernels.gated_activation``); the reference for the
    activations and layouts the kernel does not take (exact-erf gelu, a strided last dim, not [T, I])."""
    canonical = layers.canonical_activation(act)
    if canonical not in GATED_ACTIVATIONS or gate.dim() != 2 or gate.shape != up.shape or gate.dtype != up.dtype \
            or gate.stride(-1) != 1 or up.stride(-1) != 1:
        return ops.torch_gated_activation(gate, up, act)
    return gated_activation(gate, up, canonical)


def _add_norm_kernel_mode(x: torch.Tensor, residual: torch.Tensor, style: NormStyle) -> NormMode | None:
    """The ``kernels.rmsnorm`` mode in which ``fused_add_rmsnorm`` takes ``residual + x`` and its norm of ``style``,
    or None where it does not: the gemma3 style, x of more than 3 dims, a residual of another shape or dtype, strided
    last dims. Shared by the launches that fold this add and norm into their own (router, q/k/v GEMV)."""
    mode = _TRITON_NORM_MODE.get(style)
    if (mode is None or x.dim() > 3 or x.stride(-1) != 1 or residual.shape != x.shape
            or residual.dtype != x.dtype or residual.stride(-1) != 1):
        return None
    return mode


def triton_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float,
                        style: NormStyle) -> tuple[torch.Tensor, torch.Tensor]:
    """``ops.add_rms_norm`` through the Triton kernel: the residual add and the norm in one launch (the add in
    fp32 rounded to the activation dtype, torch's value); the reference for the gemma3 style and odd inputs."""
    mode = _add_norm_kernel_mode(x, residual, style)
    if mode is None:
        return ops.torch_add_rms_norm(x, residual, weight, eps, style)
    return triton_norm.fused_add_rmsnorm(x, residual, weight, eps, mode)


def _qk_norm_rope_kernel_mode(q_raw: torch.Tensor, k_raw: torch.Tensor | None, v_in: torch.Tensor | None,
                              q_norm: layers.RMSNorm, k_norm: layers.RMSNorm | None,
                              v_norm: layers.RMSNorm | None) -> NormMode | None:
    """The ``kernels.qk_norm_rope`` norm mode for these inputs, or None where the kernel does not apply: the gemma3
    norm style, norms that differ in eps or style, a weighted value norm, weights of another dtype, strided last
    dims, an odd head_dim."""
    mode = _TRITON_NORM_MODE.get(q_norm.style)
    norms = [n for n in (q_norm, k_norm, v_norm) if n is not None]
    weights = [q_norm.weight] + ([k_norm.weight] if k_raw is not None and k_norm is not None else [])
    if (mode is None or q_norm.weight is None or any(n.style != q_norm.style or n.eps != q_norm.eps for n in norms)
            or (k_raw is not None and k_norm is None) or (v_norm is not None and v_norm.weight is not None)
            or any(w is None or w.dtype != q_raw.dtype for w in weights) or q_raw.shape[-1] % 2
            or any(t is not None and t.stride(-1) != 1 for t in (q_raw, k_raw, v_in))):
        return None
    return mode


def triton_qk_norm_rope(q_raw: torch.Tensor, k_raw: torch.Tensor | None, v_raw: torch.Tensor | None,
                        q_norm: layers.RMSNorm, k_norm: layers.RMSNorm | None, v_norm: layers.RMSNorm | None,
                        cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                       torch.Tensor | None]:
    """``ops.qk_norm_rope`` in one Triton launch (``kernels.qk_norm_rope``): q/k norms, RoPE and the value norm;
    the unfused path (installed norm and RoPE) where the kernel does not apply (``_qk_norm_rope_kernel_mode``)."""
    v_in = (v_raw if v_raw is not None else k_raw) if v_norm is not None else None
    mode = _qk_norm_rope_kernel_mode(q_raw, k_raw, v_in, q_norm, k_norm, v_norm)
    if mode is None:
        return ops.torch_qk_norm_rope(q_raw, k_raw, v_raw, q_norm, k_norm, v_norm, cos, sin)
    assert q_norm.weight is not None  # checked by the mode
    q, k, v = qk_norm_rope(q_raw, k_raw, v_in, q_norm.weight, k_norm.weight if k_norm is not None else None,
                           q_norm.eps, mode, cos, sin)
    if v_norm is None and k_raw is not None:
        v = v_raw if v_raw is not None else k_raw
    return q, k, v


def triton_qk_norm_rope_store(q_raw: torch.Tensor, k_raw: torch.Tensor, v_raw: torch.Tensor | None,
                              q_norm: layers.RMSNorm, k_norm: layers.RMSNorm, v_norm: layers.RMSNorm | None,
                              cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                   torch.Tensor | None] | None:
    """``paged_kv.NormRopeStoreFn``: ``triton_qk_norm_rope`` whose launch also writes k and v into the paged caches,
    bit for bit what ``store_kv`` writes (``kernels.qk_norm_rope.PagedKVWrite``), so the KV store's own launch
    goes; None (nothing written) where the kernel does not apply or the caches are not ``store_kv``'s layout."""
    value = v_raw if v_raw is not None else k_raw  # what the layer stores as its value, before any value norm
    v_in = value if v_norm is not None else None
    mode = _qk_norm_rope_kernel_mode(q_raw, k_raw, v_in, q_norm, k_norm, v_norm)
    if (mode is None or value.stride(-1) != 1 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape
            or k_cache.dtype != v_cache.dtype or tuple(k_cache.shape[2:]) != tuple(k_raw.shape[1:])
            or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1):
        return None
    write = PagedKVWrite(k_cache, v_cache, slot_mapping, value=None if v_norm is not None else value)
    assert q_norm.weight is not None and k_norm.weight is not None  # checked by the mode
    q, k, v = qk_norm_rope(q_raw, k_raw, v_in, q_norm.weight, k_norm.weight, q_norm.eps, mode, cos, sin, cache=write)
    return q, k, v if v_norm is not None else value


@attrs.frozen
class TritonNormRopeDecode:
    """``paged_kv.NormRopeDecodeFn``: the Triton decode attention that norms and rotates a raw q in its own launch
    (``decode_attention.QueryNormRope``), at the runner's ``max_context_len`` (its split choice, as the plain
    decode's), where ``kernels.qk_norm_rope`` would take q: the gemma4 or qwen norm style with a weight of q's
    dtype, an even head_dim, contiguous rows, RoPE tables of one layout with a row per sequence."""

    max_context_len: int
    kv_before_wait: bool | None = None  # paged_decode_attention's

    def accepts(self, q_raw: torch.Tensor, q_norm: layers.RMSNorm, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        return (q_raw.dim() == 3 and _qk_norm_rope_kernel_mode(q_raw, None, None, q_norm, None, None) is not None
                and cos.shape == (q_raw.shape[0], q_raw.shape[2]) and sin.shape == cos.shape
                and cos.stride() == sin.stride() and cos.stride(-1) == 1 and cos.dtype == q_raw.dtype)

    def __call__(self, q_raw: torch.Tensor, q_norm: layers.RMSNorm, cos: torch.Tensor, sin: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
        assert q_norm.weight is not None  # accepts() checked it
        norm = QueryNormRope(q_norm.weight, q_norm.eps, q_norm.style == "gemma4", cos, sin)
        return paged_decode_attention(q_raw, k_cache, v_cache, block_tables, context_lens, scale, window,
                                      max_context_len=self.max_context_len, q_norm_rope=norm,
                                      kv_before_wait=self.kv_before_wait)


FUSED_ROUTER_MAX_TOKENS = 16
"""Steps of at most this many tokens compute the router logits inside the routing launch (``triton_linear_route``);
larger ones run the router GEMM (cuBLAS), whose launch cost is then small against its work."""


def _router_gemv_fits(x: torch.Tensor, weight: torch.Tensor, top_k: int) -> bool:
    """Whether ``kernels.router``'s fused router GEMV takes these inputs: a decode-sized step of [T, H] rows, a
    float [E, H] weight of x's dtype, contiguous last dims, 1 <= top_k <= E <= MAX_EXPERTS."""
    return (x.dim() == 2 and 0 < x.shape[0] <= FUSED_ROUTER_MAX_TOKENS and weight.dim() == 2
            and weight.shape[1] == x.shape[1] and weight.dtype == x.dtype and x.stride(-1) == 1
            and weight.stride(-1) == 1 and 1 <= top_k <= weight.shape[0] <= MAX_EXPERTS)


def triton_linear_route(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool,
                        per_expert_scale: torch.Tensor | None = None,
                        out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``ops.linear_route`` in one Triton launch at decode sizes (``kernels.router.linear_route``: the router GEMV
    and the routing, one launch instead of two); the router GEMM then the installed ``ops.route`` for larger steps
    and for inputs the kernel does not take."""
    if not _router_gemv_fits(x, weight, top_k):
        return ops.torch_linear_route(x, weight, top_k, renormalize, per_expert_scale, out_dtype)
    return linear_route(x, weight, top_k, renormalize, per_expert_scale, out_dtype)


def triton_add_norm_linear_route(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor | None,
                                  eps: float, style: NormStyle, weight: torch.Tensor, top_k: int, renormalize: bool,
                                  per_expert_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ops.add_norm_linear_route`` in one Triton launch at decode sizes (``kernels.router.add_norm_linear_route``:
    the residual add, the norm, the router GEMV and the routing); the installed ``add_rms_norm`` then
    ``linear_route`` for larger steps and inputs the kernel does not take."""
    mode = _add_norm_kernel_mode(x, residual, style)
    if mode is None or norm_weight is None or norm_weight.dtype != x.dtype or not _router_gemv_fits(x, weight, top_k):
        return ops.torch_add_norm_linear_route(x, residual, norm_weight, eps, style, weight, top_k, renormalize,
                                               per_expert_scale, out_dtype)
    return add_norm_linear_route(x, residual, norm_weight, eps, mode, weight, top_k, renormalize, per_expert_scale,
                                 out_dtype)


def _norm_add_kernel_takes(a: torch.Tensor, a_norm: layers.NormWeights, b: torch.Tensor | None,
                           b_norm: layers.NormWeights | None, sum_norm: layers.NormWeights | None,
                           residual: torch.Tensor | None, scale: torch.Tensor | None,
                           out_norms: Sequence[layers.NormWeights]) -> bool:
    """Whether ``kernels.norm_add`` computes ``ops.norm_add`` of these inputs: weighted gemma4 norms (weights of a's
    dtype or fp32, on its device), at most ``MAX_OUT_NORMS`` out norms, 2-D tensors of a's shape and dtype with
    contiguous rows, ``b`` with its norm, a one-element scale of a's dtype."""
    norms = [n for n in (a_norm, b_norm, sum_norm, *out_norms) if n is not None]
    tensors = [t for t in (a, b, residual) if t is not None]
    return not (any(n.style != "gemma4" or n.weight is None or n.weight.dtype not in (a.dtype, torch.float32)
                    or n.weight.device != a.device for n in norms)
                or len(out_norms) > NORM_ADD_MAX_OUT_NORMS
                or a.dim() != 2 or any(t.shape != a.shape or t.dtype != a.dtype or t.stride(-1) != 1 for t in tensors)
                or (b is None) != (b_norm is None)
                or (scale is not None and (scale.numel() != 1 or scale.dtype != a.dtype)))


def triton_norm_add(a: torch.Tensor, a_norm: layers.NormWeights, b: torch.Tensor | None = None,
                    b_norm: layers.NormWeights | None = None, *, sum_norm: layers.NormWeights | None = None,
                    residual: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                    out_norms: Sequence[layers.NormWeights] = ()) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """``ops.norm_add`` in one Triton launch (``kernels.norm_add``): Gemma 4's post-norm(s), their sum's norm,
    residual add, layer scale and up to three next norms; the unfused path for other norm styles (Gemma 3's
    ``1 + w``), weightless norms, more out norms, other dtypes or layouts (``_norm_add_kernel_takes``)."""
    if not _norm_add_kernel_takes(a, a_norm, b, b_norm, sum_norm, residual, scale, out_norms):
        return ops.torch_norm_add(a, a_norm, b, b_norm, sum_norm=sum_norm, residual=residual, scale=scale,
                                  out_norms=out_norms)

    def weight(norm: layers.NormWeights) -> torch.Tensor:
        assert norm.weight is not None  # checked above
        return norm.weight

    return norm_add(a, weight(a_norm), a_norm.eps,
                    b=b, wb=weight(b_norm) if b_norm is not None else None, eps_b=b_norm.eps if b_norm else 0.0,
                    ws=weight(sum_norm) if sum_norm is not None else None,
                    eps_s=sum_norm.eps if sum_norm is not None else 0.0,
                    residual=residual, scale=scale, out_norms=[(weight(n), n.eps) for n in out_norms])


def triton_rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor,
                        dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """``ops.rope_cos_sin`` in one Triton launch (``kernels.rope_tables``: the reference's arithmetic, CUDA's cosf /
    sinf) for fp32 inverse frequencies on the positions' device; the reference for anything else."""
    if inv_freq.dim() != 1 or inv_freq.dtype != torch.float32 or inv_freq.device != positions.device \
            or positions.dim() != 1 or positions.dtype.is_floating_point \
            or dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return layers.rope_cos_sin(inv_freq, positions, dtype)
    return rope_tables(positions, inv_freq, dtype)


def triton_dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                        max_tokens: int, tuned_only: bool = False) -> torch.Tensor:
    """``ops.linear`` through the Triton weight-streaming GEMV (``kernels.dense_linear``) for steps of at most
    ``max_tokens`` tokens, where cuBLAS runs most of the models' projections well under the memory limit; cuBLAS
    (``F.linear``) for larger steps, biases, weights of another dtype than the activations, and the shapes and
    step sizes where this GPU's tuning sweep timed cuBLAS faster (``dense_linear.cublas_is_faster``). With
    ``tuned_only``, also wherever the sweep did not time this shape and step size (``dense_linear.triton_is_faster``
    is then False): only measured wins take the Triton kernel."""
    if not dense_linear_takes(x, weight, bias, max_tokens=max_tokens, tuned_only=tuned_only):
        return torch.nn.functional.linear(x, weight, bias)
    tokens = math.prod(x.shape[:-1])
    return dense_linear(x.reshape(tokens, x.shape[-1]), weight).reshape(*x.shape[:-1], weight.shape[0])


def dense_linear_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, max_tokens: int,
                       tuned_only: bool) -> bool:
    """Whether ``triton_dense_linear`` runs this projection through the Triton kernel (else cuBLAS)."""
    tokens = math.prod(x.shape[:-1])
    return not (bias is not None or weight.dim() != 2 or x.dtype != weight.dtype or not 1 <= tokens <= max_tokens
                or x.dtype not in (torch.bfloat16, torch.float16, torch.float32)
                or cublas_is_faster(tokens, weight.shape[0], weight.shape[1], x.dtype, x.device)
                or (tuned_only and not triton_is_faster(tokens, weight.shape[0], weight.shape[1], x.dtype, x.device)))


def _installed_gemv_takes(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, *,
                          dense_max_tokens: int | None, tuned_only: bool) -> bool:
    """Whether the installed ops run the projection ``x [T, K] @ weight.T`` through the Triton GEMV kernels (int8
    weights: ``triton_int8_linear`` always; float ones where ``triton_dense_linear`` takes them), with contiguous
    last dims; their config then decides whether it is a one-split CUDA-core GEMV (``gated_gemv_config``)."""
    return x.stride(-1) == 1 and weight.stride(-1) == 1 and (scale is not None or (
        dense_max_tokens is not None and dense_linear_takes(x, weight, None, max_tokens=dense_max_tokens,
                                                            tuned_only=tuned_only)))


def _gated_projection_config(flat: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, canonical: str,
                             flat_up: torch.Tensor | None, *, dense_max_tokens: int | None,
                             tuned_only: bool) -> Int8LinearConfig | None:
    """The one-launch gated GEMV's config for ``triton_gated_projection``'s inputs (2-D), or None where the
    installed ops would not run the projection as a one-split CUDA-core GEMV (then no fused launch)."""
    if canonical in GATED_ACTIVATIONS \
            and (flat_up is None or (flat_up.dtype == flat.dtype and flat_up.stride(-1) == 1
                                     and tuple(flat_up.shape) == (flat.shape[0], weight.shape[0]))) \
            and _installed_gemv_takes(flat, weight, scale, dense_max_tokens=dense_max_tokens, tuned_only=tuned_only):
        return gated_gemv_config(flat, weight, scale, paired=flat_up is None)
    return None


def triton_gated_projection(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, act: str,
                            up: torch.Tensor | None = None, *, dense_max_tokens: int | None,
                            tuned_only: bool = False) -> torch.Tensor:
    """``ops.gated_projection`` in one launch (``kernels.gated_gemv``: the gated activation in the GEMV's
    epilogue) where the installed ops would run the projection as a one-split CUDA-core GEMV and the activation
    through ``triton_gated_activation``: int8 weights always (``triton_int8_linear``), float ones where
    ``triton_dense_linear`` takes them (``dense_max_tokens`` its bound, None: cuBLAS is installed). The same bits
    as those launches; anywhere else it is those launches (``ops.torch_gated_projection``)."""
    canonical = layers.canonical_activation(act)
    flat = x.reshape(-1, x.shape[-1])
    flat_up = up.reshape(-1, up.shape[-1]) if up is not None else None
    config = _gated_projection_config(flat, weight, scale, canonical, flat_up, dense_max_tokens=dense_max_tokens,
                                      tuned_only=tuned_only)
    if config is None:
        return ops.torch_gated_projection(x, weight, scale, act, up)
    out = gated_gemv(flat, weight, scale, canonical, config, flat_up)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def triton_norm_add_gated_projection(a: torch.Tensor, a_norm: layers.NormWeights, residual: torch.Tensor,
                                     weight: torch.Tensor, weight_scale: torch.Tensor | None, act: str,
                                     up: torch.Tensor | None = None, *, scale: torch.Tensor | None = None,
                                     dense_max_tokens: int | None, tuned_only: bool = False,
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``ops.norm_add_gated_projection`` in one launch (``kernels.norm_add_gemv``: the sandwich norm's residual add
    in the gated GEMV's prologue and K loop) where ``triton_norm_add`` would take the norm (a weighted gemma norm)
    and ``triton_gated_projection`` would run one launch (a one-split CUDA-core GEMV at its config), with rows of at
    most ``MAX_NORM_COLUMNS``; anywhere else the installed ``norm_add`` and ``gated_projection``
    (``ops.torch_norm_add_gated_projection``)."""
    canonical = layers.canonical_activation(act)
    flat_up = up.reshape(-1, up.shape[-1]) if up is not None else None
    config = None
    if _norm_add_kernel_takes(a, a_norm, None, None, None, residual, scale, ()) and a.shape[1] <= MAX_NORM_COLUMNS:
        config = _gated_projection_config(a, weight, weight_scale, canonical, flat_up,
                                          dense_max_tokens=dense_max_tokens, tuned_only=tuned_only)
    if config is None or a_norm.weight is None:  # (the weight is there when the kernel takes the norm)
        return ops.torch_norm_add_gated_projection(a, a_norm, residual, weight, weight_scale, act, up, scale=scale)
    return norm_add_gemv(a, a_norm.weight, a_norm.eps, residual, scale, weight, weight_scale, config,
                         gated=canonical, up=flat_up)


def triton_add_norm_projection(x: torch.Tensor, residual: torch.Tensor, norm: layers.NormWeights,
                               weight: torch.Tensor, weight_scale: torch.Tensor | None, *,
                               dense_max_tokens: int | None, tuned_only: bool = False,
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``ops.add_norm_projection`` in one launch (``kernels.norm_add_gemv.add_norm_gemv``: the residual add and the
    qwen norm in the GEMV's prologue and K loop) where ``triton_add_rms_norm`` would take the norm (a weighted qwen
    norm of x's dtype, [T, H] rows) and the installed ops would run a float projection as a one-split CUDA-core GEMV
    (``gated_gemv_config``), with rows of at most ``MAX_NORM_COLUMNS``; anywhere else the installed
    ``add_rms_norm`` and projection (``ops.torch_add_norm_projection``). int8 weights keep the two launches: their
    GEMV reads half the bytes, and the prologue cost more than the launch it saves (Qwen3-30B-A3B int8 on the H200:
    B=1 462.8 against 468.5 tok/s, docs/benchmarks.md)."""
    config = None
    if weight_scale is None and _add_norm_kernel_mode(x, residual, norm.style) == "qwen" and norm.weight is not None \
            and norm.weight.dtype == x.dtype and x.dim() == 2 and x.shape[1] <= MAX_NORM_COLUMNS \
            and _installed_gemv_takes(x, weight, None, dense_max_tokens=dense_max_tokens, tuned_only=tuned_only):
        config = gated_gemv_config(x, weight, None, paired=False)
    if config is None or norm.weight is None:  # (the weight is there when the config is)
        return ops.torch_add_norm_projection(x, residual, norm, weight, weight_scale)
    h, projected = add_norm_gemv(x, norm.weight, norm.eps, residual, weight, None, config)
    return projected, h


def triton_mlp_beside_experts(mlp: nn.Module, router: nn.Module, experts: nn.Module, x: torch.Tensor,
                              residual: torch.Tensor, router_input: torch.Tensor | None, expert_input: torch.Tensor,
                              *, decode_max_tokens: int, dense_max_tokens: int | None,
                              tuned_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``ops.mlp_beside_experts`` at decode in two launches of paired work and the experts' down launch
    (``kernels.mlp_beside_experts``), where the installed ops would run the pieces as one-launch GEMVs: steps of
    at most ``decode_max_tokens`` tokens (the MoE decode GEMVs'), the fused weights in use, the router's input
    normed by the caller. Each pairing is taken on its own: the dense gate/up with the router where the gated
    projection is a one-split CUDA-core GEMV (``triton_gated_projection``'s rule) and the fused router GEMV takes
    the router; the dense down with the experts' gate/up where the down projection is a one-split CUDA-core GEMV
    of the experts' warps. The rest runs through the installed ops (``ops.torch_mlp_beside_experts``' calls)."""
    tokens = x.shape[0]
    if not (isinstance(mlp, GatedMLP) and isinstance(router, Gemma4Router) and isinstance(experts, FusedExperts)
            and ops.fused_weights and mlp.gate_up_weight is not None and router_input is not None
            and x.dim() == 2 and 0 < tokens <= decode_max_tokens and x.stride(-1) == 1
            and expert_input.stride(-1) == 1 and experts.gate_up_proj.stride(-1) == 1
            and experts.down_proj.stride(-1) == 1):
        return ops.torch_mlp_beside_experts(mlp, router, experts, x, residual, router_input, expert_input)
    act = layers.canonical_activation(mlp.act_name)
    gate_config = _gated_projection_config(x, mlp.gate_up_weight, mlp.gate_up_scale, act, None,
                                           dense_max_tokens=dense_max_tokens, tuned_only=tuned_only)
    router_weight = router.proj.weight
    if gate_config is not None and _router_gemv_fits(router_input, router_weight, router.top_k):
        activated, weights, ids = gated_gemv_and_route(x, mlp.gate_up_weight, mlp.gate_up_scale, act, gate_config,
                                                       router_input, router_weight, router.top_k,
                                                       router.renormalize, router.per_expert_scale)
    else:
        activated = mlp.activated(x)
        weights, ids = router(residual, router_input)
    down_weight, down_scale = projection_weights(mlp.down_proj)
    down_config = gated_gemv_config(activated, down_weight, down_scale, paired=False) \
        if _installed_gemv_takes(activated, down_weight, down_scale, dense_max_tokens=dense_max_tokens,
                                 tuned_only=tuned_only) else None
    w_gate_up, w_down = experts.gate_up_proj, experts.down_proj
    if down_config is not None and shares_warps(down_config, w_gate_up.shape[2], w_down.shape[2],
                                                expert_input.element_size(),
                                                int8_experts=experts.gate_up_proj_scale is not None):
        moe, m = expert_gate_up_beside_gemv(expert_input, w_gate_up, w_down, weights, ids,
                                            experts.activation,  # type: ignore[arg-type]
                                            activated, down_weight, down_scale, down_config,
                                            w_gate_up_scale=experts.gate_up_proj_scale,
                                            w_down_scale=experts.down_proj_scale)
        return m, moe
    return mlp.down_proj(activated), experts(expert_input, weights, ids)


def triton_fused_moe(hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor, act: str, *,
                     w_gate_up_scale: torch.Tensor | None = None,
                     w_down_scale: torch.Tensor | None = None, decode_max_tokens: int = 0) -> torch.Tensor:
    """``ops.MoEFn`` through Triton, no host sync: steps of at most ``decode_max_tokens`` tokens as the decode
    GEMVs (``kernels.moe_decode``: gate/up, then down with the k-sum, two launches), larger ones as the grouped
    GEMMs (``kernels.fused_moe``: align + gate/up + down + k-sum). int8 experts (scales given) dequantise their
    weight tiles in registers on both paths."""
    if 0 < hidden.shape[0] <= decode_max_tokens and w_gate_up.stride(-1) == 1 and w_down.stride(-1) == 1 \
            and hidden.stride(-1) == 1:
        return fused_moe_decode(hidden, w_gate_up, w_down, topk_weights, topk_ids, act,  # type: ignore[arg-type]
                                w_gate_up_scale=w_gate_up_scale, w_down_scale=w_down_scale)
    return fused_moe(hidden, w_gate_up, w_down, topk_weights, topk_ids, act,  # type: ignore[arg-type]
                     w_gate_up_scale=w_gate_up_scale, w_down_scale=w_down_scale)


class OpaqueAttentionContext(PagedAttentionContext):
    """``PagedAttentionContext`` that ``torch.compile`` does not trace: it calls the Triton kernels eagerly."""

    @torch.compiler.disable
    def attend(self, layer: LayerSpec, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
               scale: float, logit_softcap: float | None) -> torch.Tensor:
        return super().attend(layer, q, k, v, scale, logit_softcap)


EARLY_RELEASE_MAX_HIDDEN = 2048
"""The largest hidden size at which ``CudaRunnerOptions.pdl_early_release``'s default releases any class early. On the
H200 (2026-12-02, session 13, B=1 overlapped tok/s, every class after the wait against after the loop):
Qwen3-30B-A3B (hidden 2,048) 396.1 against 384.2 and Gemma-4-E2B (1,536) 481.4 against 475.3, but Gemma-4-E4B
(2,560) 297.7 against 303.2, Gemma-4-26B-A4B (2,816) 361.6 against 369.6 and Gemma-4-31B (5,376) 63.7 against 64.8;
B=64 within 0.3 % either way. Per class (2026-12-03, session 14): on E4B, 26B-A4B and 31B no class released early
beats the release after the loop by more than the spread (E4B's attention 304.8 against 304.0 / 305.3)."""

EARLY_RELEASE_NARROW_CLASSES: tuple[str, ...] = ("attention", "gemv", "head", "moe")
"""The classes the default releases right after their wait at hidden sizes up to ``EARLY_RELEASE_MAX_HIDDEN``: every
class but the router GEMV, which releases after its loop. On the H200 (2026-12-03, session 14, B=1 overlapped tok/s,
median of 3): Qwen3-30B-A3B with every class early 396.5, every class early but the router 400.7, but the GEMVs
399.1, but the MoE launches 387.8, but the attention 395.4 (call 1); the attention, head and MoE early (the GEMVs and
the router late) 398.4 / 399.8 against every class early 396.4, and on Gemma-4-E2B (no router) 480.4 / 481.3 against
489.3 (call 2): E2B's GEMVs must release early, so only the router is taken out."""


def early_release_classes_for(hidden_size: int, asked: bool | tuple[str, ...] | None) -> frozenset[str]:
    """The loop classes (``kernels.pdl.PDL_LOOP_CLASSES``) that release right after their wait for a model of
    ``hidden_size`` under ``CudaRunnerOptions.pdl_early_release`` = ``asked``; an unknown class is a ValueError."""
    if asked is None:
        return loop_classes(EARLY_RELEASE_NARROW_CLASSES if hidden_size <= EARLY_RELEASE_MAX_HIDDEN else False)
    return loop_classes(asked)


@attrs.frozen
class CudaRunnerOptions:
    """Knobs of the CUDA runner. ``max_model_len`` bounds the static block tables and fixes the decode
    kernel's split choice; ``capture=False`` runs graph-eligible steps eagerly on the static buffers."""

    max_model_len: int
    max_batch_size: int = 256
    eager_warmup_tokens: tuple[int, ...] = ()
    """Token counts of the eager steps run once at start-up (``eager_warmup_sizes``), so Triton compiles the
    kernel variants of prefill-carrying steps then rather than mid-serving."""
    cuda_graphs: bool = True
    capture: bool = True
    compile: bool = False
    triton_norm: bool = True
    triton_add_norm: bool = True
    """Residual add + RMSNorm in one launch (``ops.add_rms_norm``); needs ``triton_norm``."""
    triton_rope: bool = True
    triton_router: bool = True
    triton_gated_activation: bool = True
    triton_norm_add: bool = True
    """Gemma 4's post-norm(s) + residual add + layer scale + the next norms (the FFN inputs' and the router's, or the
    next layer's input norm) in one launch (``ops.norm_add``); needs ``triton_norm``."""
    triton_rope_tables: bool = True
    """A step's RoPE tables (cos and sin of each attention layer type) in one Triton launch each
    (``ops.rope_cos_sin``, ``kernels.rope_tables``) instead of seven PyTorch kernels."""
    triton_qk_norm_rope: bool = True
    """An attention layer's q/k norms, RoPE and value norm in one launch (``ops.qk_norm_rope``); needs
    ``triton_norm`` and ``triton_rope``."""
    triton_dense_linear: bool = False
    """Float projections (q/k/v, o, dense MLP, routers, PLE, logits: ``ops.linear``) of steps of at most
    ``dense_linear_max_tokens`` tokens as the Triton GEMV (``kernels.dense_linear``) at every shape, cuBLAS above
    (except where this GPU's sweep timed cuBLAS faster). Off by default: at shapes the H200 sweep did not tune it
    won on Gemma-4-E4B (B=1 202 vs 175 tok/s) and lost on Gemma-4-26B-A4B (205 vs 216) and Gemma-4-31B (54.1 vs
    55.1; docs/benchmarks.md)."""
    triton_dense_linear_where_tuned: bool = True
    """Float projections as the Triton GEMV only at the shapes and step sizes where this GPU's sweep
    (``bench/dense_linear.py --sweep --write``) timed it faster than cuBLAS, cuBLAS elsewhere: the H200 files
    cover Qwen3-30B-A3B at 1-2 tokens (B=1 260 vs 244 tok/s). Implied by ``triton_dense_linear``."""
    dense_linear_max_tokens: int = 16
    """The largest step that takes the Triton GEMV (``bench/dense_linear.py`` compares it with cuBLAS per T)."""
    moe_decode_max_tokens: int = 2
    """Steps of at most this many tokens run their routed experts as the decode GEMVs (``kernels.moe_decode``: two
    launches, no alignment or k-sum launch, each pair streams its expert's rows); larger ones as the grouped GEMMs,
    which read an expert shared by several tokens once. 0 turns the decode path off. On the H200
    (``bench/moe_decode.py``, docs/benchmarks.md) the decode path is faster at 1 and 2 tokens and slower from 4."""
    fused_weights: bool = True
    """q, k and v projections as one GEMM (``SelfAttention.fuse_qkv``), a dense MLP's gate and up as one
    (``GatedMLP.fuse_gate_up``), Gemma 4's router scale folded into its norm (``Gemma4Router.fold_scale``):
    one launch instead of three, one instead of two, one instead of three (``ops.fused_weights``)."""
    fused_router_gemv: bool = True
    """A MoE layer's router projection inside the routing launch at decode sizes (``ops.linear_route``, at most
    ``FUSED_ROUTER_MAX_TOKENS`` tokens): one launch fewer per MoE layer; needs ``triton_router``."""
    fused_norm_router: bool = True
    """A pre-norm MoE layer's residual add and FFN norm inside the routing launch at decode sizes
    (``ops.add_norm_linear_route``; Qwen3-MoE): one launch fewer per MoE layer; needs ``fused_router_gemv`` and
    ``triton_add_norm``."""
    fused_kv_store: bool = True
    """The KV store in the q/k norm + RoPE launch (``triton_qk_norm_rope_store``, through the attention context):
    one launch fewer per layer that computes K/V; needs ``triton_qk_norm_rope``."""
    fused_q_norm_rope_attention: bool = True
    """At decode, a layer that reads another layer's KV (Gemma 4 E2B/E4B's KV-shared layers) norms and rotates its q
    inside the decode attention launch (``paged_kv.NormRopeDecodeFn``, ``decode_attention.QueryNormRope``): one
    launch fewer per such layer, the same q up to the order of the norm's fp32 sum of squares. Needs
    ``triton_qk_norm_rope``."""
    fused_gated_gemv: bool = True
    """A dense MLP's fused gate/up projection and its gated activation in one launch (``ops.gated_projection``,
    ``kernels.gated_gemv``) where the projection is a one-split CUDA-core GEMV (1-4 tokens): one launch fewer per
    dense MLP at decode, the same bits; needs ``fused_weights`` and ``triton_gated_activation``."""
    fused_mlp_beside_experts: bool = True
    """A Gemma 4 MoE layer's dense MLP beside its routed experts at decode (``ops.mlp_beside_experts``,
    ``kernels.mlp_beside_experts``): the dense gate/up with the router in one launch, the dense down with the
    experts' gate/up in the next, where each would be a one-launch GEMV; two launches fewer per MoE layer, and the
    router's latency behind the GEMV's stream. Needs ``fused_gated_gemv``, ``fused_router_gemv`` and the MoE
    decode GEMVs (``moe_decode_max_tokens``)."""
    fused_norm_gemv: bool = True
    """Gemma 4 E2B/E4B's post-FFN norm and residual add inside the per-layer-input gate's GEMV at decode
    (``ops.norm_add_gated_projection``, ``kernels.norm_add_gemv``) where that projection is a one-split CUDA-core
    GEMV: one launch fewer per layer, the same values up to the order of the norm's fp32 sum of squares. Needs
    ``triton_norm_add`` and ``fused_gated_gemv``."""
    fused_add_norm_gemv: bool = True
    """A pre-norm layer's residual add and input norm inside its fused q/k/v projection's GEMV at decode
    (``ops.add_norm_projection``, ``kernels.norm_add_gemv.add_norm_gemv``; Qwen3-MoE) where that projection is a
    one-split CUDA-core GEMV of float weights (int8 ones keep the two launches, which were faster): one launch fewer
    per layer, the same values up to the order of the norm's fp32 sum of squares. Needs ``triton_add_norm`` and
    ``fused_weights``."""
    triton_greedy_head: bool = True
    """When every sampled row is greedy and needs nothing else (``sampler.argmax_suffices``), the lm_head GEMV
    with the argmax and its logprob fused (``kernels.greedy_head``): no [N, V] logits written and re-read
    by the sampler's chain. Float and int8 heads (``INT8_EMBEDDINGS``), up to ``greedy_head.MAX_ROWS`` rows."""
    greedy_head_gemv: bool = True
    """With ``triton_greedy_head``, steps of 1-2 sampled rows run the head as its CUDA-core GEMV (the int8 linear's
    for an int8 head, the tuned Triton GEMV for a float one where this GPU's sweep timed it faster than cuBLAS) and
    reduce the logits with the fused head's soft-cap and statistics in two short launches
    (``greedy_head.greedy_head_of_logits``): the same token and logprob as the fused head on the same logits."""
    moe_down_weights_before_wait: bool = True
    """With ``pdl``, the MoE decode GEMVs' down launch loads each program's expert id (the router's, two launches
    back) and its first weight tile before its PDL wait, while the gate/up launch still runs
    (``moe_decode.use_down_weights_before_wait``): the same bits."""
    attention_kv_before_wait: bool = True
    """With ``pdl``, where the decode attention's key loop is not pipelined (1-2 sequences, head_dim <= 128:
    Qwen3-MoE), every program loads its first tile of the earlier keys and values (all but the query's own) before
    its PDL wait, while the launch before it still runs (``paged_decode_attention``'s ``kv_before_wait``): the same
    output, bit for bit. Off: never."""
    pdl_early_release: bool | tuple[str, ...] | None = None
    """With ``pdl``, kernels with a main loop (the GEMVs, the decode attention, the MoE GEMVs and grouped GEMMs, the
    router GEMV, the greedy head's slices) release their dependent right after their PDL wait instead of after the
    loop, so the next launch's CTAs get resident and load what they may load before their own wait while the loop
    still streams (``kernels.pdl.use_early_release``): the same bits, only the overlap moves. None (the default):
    ``EARLY_RELEASE_NARROW_CLASSES`` for models of hidden size <= ``EARLY_RELEASE_MAX_HIDDEN``, where the loops are
    short, none above; True / False: every class / none; a tuple: those classes of ``kernels.pdl.PDL_LOOP_CLASSES``."""
    pdl: bool = True
    """Programmatic dependent launch of the step's Triton kernels (``kernels.pdl``; sm_90+, compiled kernels only):
    each may get resident while its predecessor drains, and in the decode graphs the launch gaps between them
    shrink (Gemma-4-26B-A4B B=1 graph replay 3.16 vs 3.46 ms on the H200). Process-wide, set at every step with
    the ops. Results are bitwise those without it (``tests/backends/test_pdl_runner.py``, every model kind)."""

    @property
    def uses_triton_qk_norm_rope(self) -> bool:
        """Whether the q/k norm + RoPE launch is installed: its own switch, the norm and RoPE kernels it stands
        for, and no torch.compile (which keeps the reference ops for Inductor)."""
        return self.triton_qk_norm_rope and self.triton_norm and self.triton_rope and not self.compile


class CudaModelRunner(ModelRunner):
    """``ModelRunner`` with Triton kernels and bucketed decode graphs (see the module docstring)."""

    def __init__(self, model: CausalLM, spec: ModelSpec, storage: PagedKVStorage, device: torch.device,
                 options: CudaRunnerOptions) -> None:
        kv_before_wait = None if options.attention_kv_before_wait else False  # None: where PDL is on
        decode = functools.partial(paged_decode_attention, max_context_len=options.max_model_len,
                                   kv_before_wait=kv_before_wait)
        fused_store = options.fused_kv_store and options.uses_triton_qk_norm_rope
        fused_q_rope = options.fused_q_norm_rope_attention and options.uses_triton_qk_norm_rope
        super().__init__(model, spec, storage, device, attention_kwargs=dict(
            store=store_kv, prefill_attention=paged_prefill_attention, decode_attention=decode,
            norm_rope_store=triton_qk_norm_rope_store if fused_store else None,
            norm_rope_decode=TritonNormRopeDecode(options.max_model_len, kv_before_wait) if fused_q_rope else None))
        self.options = options
        self.early_release = early_release_classes_for(spec.hidden_size, options.pdl_early_release)
        """The loop classes whose kernels release their PDL dependent right after their wait in this runner's steps
        (``CudaRunnerOptions.pdl_early_release``)."""
        # Under torch.compile the Triton kernels are called eagerly (graph breaks) and the norm is left to
        # Inductor, which fuses the reference ops into their neighbours.
        self._context_cls = OpaqueAttentionContext if options.compile else PagedAttentionContext
        moe = functools.partial(triton_fused_moe, decode_max_tokens=options.moe_decode_max_tokens)
        self._moe = torch.compiler.disable(moe) if options.compile else moe
        # int8 weight-only layers (QUANTIZATION=int8): the Triton GEMV/GEMM, opaque to torch.compile like the MoE
        self._int8_linear = torch.compiler.disable(triton_int8_linear) if options.compile else triton_int8_linear
        self._norm = triton_rms_norm if options.triton_norm and not options.compile else layers.rms_norm
        self._add_norm = triton_add_rms_norm if options.triton_norm and options.triton_add_norm \
            and not options.compile else ops.torch_add_rms_norm
        # One Triton launch rotates q and k in place (ten elementwise kernels per layer in the reference).
        self._rope = rope_qk_ if options.triton_rope and not options.compile else layers.reference_rope_qk
        # One launch for softmax, top-k, renormalisation, per-expert scale and cast (five to seven kernels).
        self._route = triton_route if options.triton_router and not options.compile else ops.torch_route
        # The router GEMV in the same launch at decode sizes (the GEMV is all launch cost there).
        self._linear_route = triton_linear_route if options.fused_router_gemv and options.triton_router \
            and not options.compile else ops.torch_linear_route
        # ... and the residual add + norm before it (Qwen3-MoE's post-attention norm) too.
        self._add_norm_route = triton_add_norm_linear_route if options.fused_norm_router \
            and self._linear_route is triton_linear_route and self._add_norm is triton_add_rms_norm \
            else ops.torch_add_norm_linear_route
        # q/k norms + RoPE (+ value norm): one launch instead of three (four on Gemma 4) per attention layer.
        self._qk_norm = triton_qk_norm_rope if options.uses_triton_qk_norm_rope else ops.torch_qk_norm_rope
        # RoPE tables: one launch a layer type instead of seven.
        self._rope_tables = triton_rope_cos_sin if options.triton_rope_tables and not options.compile \
            else layers.rope_cos_sin
        # Gemma 4's sandwich norms: one launch instead of two to four per use.
        self._norm_add = triton_norm_add if options.triton_norm_add and options.triton_norm and not options.compile \
            else ops.torch_norm_add
        # act(gate) * up: one launch instead of two per dense MLP.
        self._gated = triton_gated_activation if options.triton_gated_activation and not options.compile \
            else ops.torch_gated_activation
        # Whether small-M float projections may take the Triton GEMV (ops.linear below, and the gated projection).
        dense_gemv = (options.triton_dense_linear or options.triton_dense_linear_where_tuned) and not options.compile
        self._dense_gemv = dense_gemv  # also the greedy head's 1-2 row GEMV path (_head_gemv_logits)
        # The gate/up GEMV with the gated activation in its epilogue (same bits as the two launches it replaces).
        self._gated_projection = functools.partial(
            triton_gated_projection, dense_max_tokens=options.dense_linear_max_tokens if dense_gemv else None,
            tuned_only=not options.triton_dense_linear) \
            if options.fused_gated_gemv and self._gated is triton_gated_activation else ops.torch_gated_projection
        # Gemma 4's dense MLP and routed experts: two launches of paired work instead of four in a chain.
        self._mlp_beside_experts = functools.partial(
            triton_mlp_beside_experts, decode_max_tokens=options.moe_decode_max_tokens,
            dense_max_tokens=options.dense_linear_max_tokens if dense_gemv else None,
            tuned_only=not options.triton_dense_linear) \
            if options.fused_mlp_beside_experts and self._gated_projection is not ops.torch_gated_projection \
            and self._linear_route is triton_linear_route and options.moe_decode_max_tokens > 0 \
            else ops.torch_mlp_beside_experts
        # Gemma 4 PLE layers' post-FFN add feeding the per-layer-input gate: one launch instead of two at decode.
        self._norm_add_gated_projection = functools.partial(
            triton_norm_add_gated_projection,
            dense_max_tokens=options.dense_linear_max_tokens if dense_gemv else None,
            tuned_only=not options.triton_dense_linear) \
            if options.fused_norm_gemv and self._norm_add is triton_norm_add \
            and self._gated_projection is not ops.torch_gated_projection else ops.torch_norm_add_gated_projection
        # Qwen3-MoE's input add + norm feeding the fused q/k/v GEMV: one launch instead of two at decode.
        self._add_norm_projection = functools.partial(
            triton_add_norm_projection, dense_max_tokens=options.dense_linear_max_tokens if dense_gemv else None,
            tuned_only=not options.triton_dense_linear) \
            if options.fused_add_norm_gemv and self._add_norm is triton_add_rms_norm else ops.torch_add_norm_projection
        # Small-M float projections: the weight-streaming Triton GEMV; cuBLAS under torch.compile and past the bound.
        self._linear = functools.partial(triton_dense_linear, max_tokens=options.dense_linear_max_tokens,
                                         tuned_only=not options.triton_dense_linear) \
            if dense_gemv else torch.nn.functional.linear
        if options.fused_weights:
            for module in model.modules():
                if isinstance(module, SelfAttention):
                    module.fuse_qkv()
                elif isinstance(module, GatedMLP):
                    module.fuse_gate_up()
                elif isinstance(module, Gemma4Router):
                    module.fold_scale()
        self._install_ops()
        model.model.place_rope_tables(device)
        self._model_fn = torch.compile(model) if options.compile else model
        self.graph_steps = 0  # decode steps that ran as a graph (tests and telemetry)
        self.eager_steps = 0
        self.capture_seconds = 0.0
        self.graphs: DecodeGraphs | None = None
        if options.cuda_graphs:
            max_blocks = -(-options.max_model_len // storage.block_size) + 1  # one block of slack
            self.graphs = DecodeGraphs(self._graph_forward, max_batch=options.max_batch_size,
                                       num_groups=self.num_groups, max_blocks=max_blocks,
                                       block_size=storage.block_size, device=device, capture=options.capture)
            started = time.perf_counter()
            self.graphs.capture()
            self.capture_seconds = time.perf_counter() - started
        started = time.perf_counter()
        self.warm_up_eager(options.eager_warmup_tokens)
        if device.type == "cuda":
            self.warm_up_greedy_head()
        self.eager_warmup_seconds = time.perf_counter() - started

    def warm_up_eager(self, token_counts: tuple[int, ...]) -> None:
        """Run one eager step of each size in ``token_counts`` (one greedy sequence, prefilled from 0).

        Triton compiles a kernel the first time it meets a new variant (block sizes chosen from the step's
        token count, e.g. the fused MoE's BLOCK_M); a variant first met while serving stalls the device for
        seconds (seen on the H200: 1.5-3.6 s steps at a wave of new prompts). Run at start-up only: the
        steps write their KV through block 0 of each group, which no sequence holds yet."""
        if not token_counts:
            return
        greedy = SamplingParams(temperature=0.0, max_tokens=1)
        with phase("compiling eager step kernels", total=len(token_counts), unit="step sizes") as progress:
            for count in progress.wrap(token_counts):
                tables = tuple((0,) * -(-count // self.block_size) for _ in range(self.num_groups))
                sequence = ScheduledSequence(request_id=-1, token_ids=(0,) * count, cached_len=0,
                                             block_tables=tables, sample=True, sampling=greedy, reset=True,
                                             prompt_len=count)
                self.collect(self.launch(StepPlan(step_id=-1, sequences=(sequence,))))
                self.forget((-1,))
        # The counters describe serving: a 1-token warm-up step fits a decode graph and would count as one.
        self.eager_steps = self.graph_steps = 0
        self.tokens_computed = 0

    def _head_operands(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """``(weight [V, H], scale [V] or None)`` of the head for the fused greedy head: the float weight, or an
        int8 head's (``CausalLM.int8_head``); None when ``triton_greedy_head`` is off."""
        if not self.options.triton_greedy_head:
            return None
        weight = self.model.head_weight()
        return (weight, None) if weight is not None else self.model.int8_head()

    def _greedy_head(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The fused greedy head (``triton_greedy_head``) where it takes the head: a float weight of the hidden
        rows' dtype or an int8 one with its scales, and at most ``MAX_ROWS`` rows; at 1-2 rows, with
        ``greedy_head_gemv``, the head's CUDA-core GEMV and ``greedy_head_of_logits`` instead. None (the unfused
        path) otherwise, and for an int8 head's 1-2 rows with ``greedy_head_gemv`` off."""
        head = self._head_operands()
        if head is None or not greedy_head_supports(hidden, *head):
            return None
        weight, scale = head
        softcap = self.model.spec.final_logit_softcapping
        if hidden.shape[0] <= GEMV_MAX_TOKENS:
            # 1-2 rows: the head's CUDA-core GEMV streams the weight faster than the fused head's tensor-core tiles
            # (int8: 0.76-0.88 of the memory limit against 0.51-0.64, bench/greedy_head.py --int8, 2026-12-01; bf16
            # where this GPU's sweep tuned the logits GEMV, e.g. Gemma-4-E4B 297 µs against the fused 326-368), so
            # the GEMV writes the logits and two short launches reduce them as the fused head would.
            logits = self._head_gemv_logits(hidden, weight, scale)
            if logits is not None:
                return greedy_head_of_logits(logits, softcap)
            if scale is not None:
                return None  # the unfused path's int8 GEMV and the sampler
        return greedy_head(hidden, weight, softcap, scale=scale)

    def _head_gemv_logits(self, hidden: torch.Tensor, weight: torch.Tensor,
                          scale: torch.Tensor | None) -> torch.Tensor | None:
        """The raw logits ``[N, V]`` of 1-2 hidden rows through the head's CUDA-core GEMV (``greedy_head_gemv``):
        ``ops.int8_linear``'s kernel for an int8 head, the Triton GEMV for a float head where this GPU's sweep
        timed it faster than cuBLAS (``dense_linear_takes``, tuned shapes only); None where neither applies."""
        if not self.options.greedy_head_gemv:
            return None
        if scale is not None:
            return triton_int8_linear(hidden, weight, scale)
        if self._dense_gemv and dense_linear_takes(hidden, weight, None, max_tokens=GEMV_MAX_TOKENS, tuned_only=True):
            return dense_linear(hidden, weight)
        return None

    def warm_up_greedy_head(self) -> None:
        """Compile the greedy head's variants that decode batches up to ``max_batch_size`` meet (the fused head's, one
        per ``greedy_head.ROW_BLOCKS`` entry, and the 1-2 row GEMV path's), so that none compiles mid-serving (a
        stall of a second or more)."""
        head = self._head_operands()
        if head is None:
            return
        weight, scale = head
        dtype = scale.dtype if scale is not None else weight.dtype  # the activations' (an int8 head's scale has it)
        # through the serving path: 1 and 2 rows (the GEMV path where it applies, each its own GEMV config), then the
        # fewest rows of each fused block (3 rows: the first block's, which 1-2 rows no longer reach)
        for rows in sorted({1, GEMV_MAX_TOKENS, GEMV_MAX_TOKENS + 1, *(block + 1 for block in ROW_BLOCKS[:-1])}):
            hidden = torch.zeros(rows, weight.shape[1], dtype=dtype, device=weight.device)
            if rows <= self.options.max_batch_size:
                self._greedy_head(hidden)

    def _install_ops(self) -> None:
        use_pdl(self.options.pdl)  # kernels.pdl's switch is process-wide, like the ops
        use_early_release(self.early_release)
        use_down_weights_before_wait(None if self.options.moe_down_weights_before_wait else False)
        ops.use_ops(moe=self._moe, norm=self._norm, rope=self._rope, router=self._route,
                    weights_fused=self.options.fused_weights, gated=self._gated, add_norm=self._add_norm,
                    qk_norm=self._qk_norm, sandwich=self._norm_add, int8_linear=self._int8_linear,
                    linear_router=self._linear_route, linear=self._linear, add_norm_router=self._add_norm_route,
                    gated_proj=self._gated_projection, rope_tables=self._rope_tables,
                    mlp_experts=self._mlp_beside_experts, norm_add_gated=self._norm_add_gated_projection,
                    add_norm_proj=self._add_norm_projection)

    def _graph_forward(self, ids: torch.Tensor, step: StepTensors) -> torch.Tensor:
        self._install_ops()
        return self._model_fn(ids, self._context_cls(self.storage, step, **self.attention_kwargs))

    def launch(self, plan: StepPlan) -> LaunchedStep:
        self._install_ops()
        return super().launch(plan)

    def _forward(self, plan: StepPlan) -> torch.Tensor:
        """Graph replay for decode-only steps that fit a bucket, eager otherwise."""
        step_id = plan.step_id
        if self.graphs is not None and self.graphs.fits(plan.sequences):
            with profiler_ranges.phase("stage", step_id):
                bucket = self.graphs.stage(plan.sequences)
                self._resolve_pending(self.graphs.step_view(bucket)[0], plan)
            with profiler_ranges.phase("forward", step_id):
                hidden = self.graphs.run(bucket)  # [bucket, H], padded rows unread
            self.graph_steps += 1
            return hidden
        self.eager_steps += 1
        return super()._forward(plan)  # eager, through this runner's model function and context class


def eager_warmup_sizes(step_token_budget: int) -> tuple[int, ...]:
    """Step sizes to compile at start-up: the budget, then halving down to 1 (each MoE BLOCK_M class and
    alignment chunking a prefill-carrying step can meet lies on this ladder), largest first."""
    sizes, size = [], max(1, step_token_budget)
    while size >= 1:
        sizes.append(size)
        size //= 2
    return tuple(sizes)


def build_cuda_runner(settings: Settings, loaded: LoadedModel, storage: PagedKVStorage, device: torch.device, *,
                      max_model_len: int, step_token_budget: int = 0) -> CudaModelRunner:
    """The ``custom-cuda`` runner for the engine: graphs for batches up to ``MAX_BATCH_SIZE`` (``CUDA_GRAPHS``),
    ``torch.compile`` with ``CUSTOM_BACKEND_COMPILE``. Block tables are sized for the engine's
    ``max_model_len`` (``factory.engine_limits``: already capped by the full-attention pool)."""
    warmup = eager_warmup_sizes(min(step_token_budget, max_model_len)) if step_token_budget and device.type == "cuda" \
        else ()
    options = CudaRunnerOptions(max_model_len=max_model_len, max_batch_size=settings.max_batch_size,
                                eager_warmup_tokens=warmup,
                                cuda_graphs=settings.cuda_graphs, capture=device.type == "cuda",
                                compile=settings.custom_backend_compile)
    return CudaModelRunner(loaded.model, loaded.spec, storage, device, options)
