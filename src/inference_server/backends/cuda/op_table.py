"""The CUDA runner's ops table, built once from its options: which Triton kernels its model computes through.

``cuda_ops`` is the one place a CUDA runner's kernel choice is written: ``reference_ops`` keeps the before of every
before/after (the Triton RMSNorm, RoPE, grouped MoE GEMMs and int8 GEMVs, PyTorch for the rest, no fused weights);
``deterministic`` is the batch-invariant table (``kernels.batch_invariant_cuda``); otherwise every kernel and fusion
of ``backends/cuda/*_ops.py``. A new kernel mode (another table) is one more branch here. ``cuda_attention_kwargs`` is
the attention's part of the same choice (the paged context's kernels).
"""

from __future__ import annotations

import functools
from typing import Any

from inference_server.backends.cuda.attention_ops import (
    TritonNormRopeDecode,
    triton_qk_norm_rope,
    triton_qk_norm_rope_store,
)
from inference_server.backends.cuda.moe_ops import (
    triton_add_norm_linear_route,
    triton_fused_moe,
    triton_linear_route,
    triton_mlp_beside_experts,
)
from inference_server.backends.cuda.norm_ops import (
    invariant_add_rms_norm,
    invariant_rms_norm,
    triton_add_rms_norm,
    triton_norm_add,
    triton_rms_norm,
    triton_rope_cos_sin,
)
from inference_server.backends.cuda.options import DENSE_GEMV_MAX_TOKENS, MOE_DECODE_MAX_TOKENS, CudaRunnerOptions
from inference_server.backends.cuda.projection_ops import (
    triton_add_norm_projection,
    triton_dense_linear,
    triton_gated_activation,
    triton_gated_projection,
    triton_norm_add_gated_projection,
)
from inference_server.kernels.batch_invariant_cuda import invariant_fused_moe, invariant_int8_linear, invariant_matmul
from inference_server.kernels.decode_attention import paged_decode_attention
from inference_server.kernels.int8_linear import int8_linear as triton_int8_linear
from inference_server.kernels.invariant_decode_attention import invariant_decode_attention
from inference_server.kernels.kv_store import store_kv
from inference_server.kernels.prefill_attention import paged_prefill_attention
from inference_server.kernels.rope import rope_qk_
from inference_server.kernels.router import triton_route
from inference_server.models.architectures.ops import Fusions, Ops


def moe_decode_max_tokens(options: CudaRunnerOptions) -> int:
    """The largest step whose routed experts run as the MoE decode GEMVs (0: never, under ``reference_ops``)."""
    return 0 if options.reference_ops else MOE_DECODE_MAX_TOKENS


def cuda_ops(options: CudaRunnerOptions) -> Ops:
    """The table a CUDA runner with ``options`` binds to its model (see the module docstring)."""
    if options.deterministic:
        # DETERMINISTIC: every op whose reduction order could follow the step's token count pinned to one
        # configuration: the fixed-tile GEMM for every float projection and the head (over the fused q/k/v and
        # gate/up weights: its split follows N and K, never M), an int8 weight converted in the call and sent through
        # it, the RMSNorm and the residual add + norm one row a program, the grouped-GEMM MoE with one config per
        # layer shape (never the decode GEMVs). The launches that are already one row (or one row and head) a program
        # whatever the step join them: routing, Gemma 4's sandwich norm + add, the q/k norms + RoPE, the gated
        # activation and the RoPE tables (elementwise). Never the fusions a step takes or leaves by its token count
        # (the GEMV fusions, the fused router GEMV, the MLP beside the experts): docs/architecture.md, Deterministic.
        return Ops(norm=invariant_rms_norm, rope=rope_qk_, linear=invariant_matmul,
                   int8_linear=invariant_int8_linear, fused_moe=invariant_fused_moe, rope_cos_sin=triton_rope_cos_sin,
                   gated_activation=triton_gated_activation, route=triton_route, fused_weights=True,
                   fusions=Fusions(add_rms_norm=invariant_add_rms_norm, qk_norm_rope=triton_qk_norm_rope,
                                   norm_add=triton_norm_add))
    moe = functools.partial(triton_fused_moe, decode_max_tokens=moe_decode_max_tokens(options))
    # One Triton launch for the norm and one rotating q and k in place (~7 and ten elementwise kernels in PyTorch).
    primitives = dict(norm=triton_rms_norm, rope=rope_qk_, fused_moe=moe, int8_linear=triton_int8_linear)
    if options.reference_ops:
        return Ops(**primitives)  # type: ignore[arg-type]
    # Small-M float projections on the Triton GEMV where this GPU's sweep timed it faster than cuBLAS; cuBLAS
    # elsewhere. The same bound for the GEMVs fused with the gated activation, the norms and the router.
    dense = DENSE_GEMV_MAX_TOKENS
    return Ops(
        **primitives,  # type: ignore[arg-type]
        # RoPE tables: one launch a layer type instead of seven.
        rope_cos_sin=triton_rope_cos_sin,
        linear=functools.partial(triton_dense_linear, max_tokens=dense),
        # act(gate) * up: one launch instead of two per dense MLP.
        gated_activation=triton_gated_activation,
        # One launch for softmax, top-k, renormalisation, per-expert scale and cast (five to seven kernels).
        route=triton_route,
        fused_weights=True,
        fusions=Fusions(
            add_rms_norm=triton_add_rms_norm,
            # The router GEMV in the routing launch at decode sizes (the GEMV is all launch cost there), and the
            # residual add + norm before it (Qwen3-MoE's post-attention norm) too.
            linear_route=triton_linear_route,
            add_norm_linear_route=triton_add_norm_linear_route,
            # q/k norms + RoPE (+ value norm): one launch instead of three (four on Gemma 4) per attention layer.
            qk_norm_rope=triton_qk_norm_rope,
            # The gate/up GEMV with the gated activation in its epilogue (same bits as the two launches it replaces).
            gated_projection=functools.partial(triton_gated_projection, dense_max_tokens=dense),
            # Qwen3-MoE's input add + norm feeding the fused q/k/v GEMV: one launch instead of two at decode.
            add_norm_projection=functools.partial(triton_add_norm_projection, dense_max_tokens=dense),
            # Gemma 4's sandwich norms: one launch instead of two to four per use.
            norm_add=triton_norm_add,
            # Gemma 4 PLE layers' post-FFN add feeding the per-layer-input gate: one launch instead of two at decode.
            norm_add_gated_projection=functools.partial(triton_norm_add_gated_projection, dense_max_tokens=dense),
            # Gemma 4's dense MLP and routed experts: two launches of paired work instead of four in a chain.
            mlp_beside_experts=functools.partial(triton_mlp_beside_experts,
                                                 decode_max_tokens=moe_decode_max_tokens(options),
                                                 dense_max_tokens=dense),
        ),
    )


def cuda_attention_kwargs(options: CudaRunnerOptions) -> dict[str, Any]:
    """The ``PagedAttentionContext`` kernels of a CUDA runner with ``options``: the Triton KV store, prefill and decode
    kernels, the decode kernel with a fixed ``max_context_len`` (its split count then depends on the batch size only)
    and, with the kernels table, the norm + RoPE launches that store K/V or feed the decode kernel. ``deterministic``:
    the prefill kernel with position-aligned key tiles folded in fixed KV splits (``align_kv``), and at decode-only
    steps (CUDA graphs too) the decode kernel that runs a program a split and folds them in the same order
    (``invariant_decode_attention``: the prefill's bits), so a query reduces its keys in the same tiles, splits and
    order whether its prefix was computed in chunks, in one piece, by decodes or read from the cache."""
    if options.deterministic:
        return dict(store=store_kv, prefill_attention=functools.partial(paged_prefill_attention, align_kv=True),
                    decode_attention=functools.partial(invariant_decode_attention,
                                                       max_context_len=options.max_model_len),
                    norm_rope_store=triton_qk_norm_rope_store)
    kernels = options.kernels
    return dict(store=store_kv, prefill_attention=paged_prefill_attention,
                decode_attention=functools.partial(paged_decode_attention, max_context_len=options.max_model_len),
                norm_rope_store=triton_qk_norm_rope_store if kernels else None,
                norm_rope_decode=TritonNormRopeDecode(options.max_model_len) if kernels else None)
