"""``DETERMINISTIC=true``: the batch-invariant kernel table a runner picks instead of its default ops.

A table names the ops that differ from what the runner would install (None: the runner's own is already
batch-invariant). This is the one place that wires them in: ``install`` for the CPU runner (process-wide
``ops.use_ops`` today; a per-runner ops record takes the same fields), and ``CudaModelRunner.use_table`` for the
custom-cuda runner (its options' ``deterministic``). What each kernel guarantees and what stays outside the guarantee:
docs/architecture.md, "Deterministic inference".
"""

from __future__ import annotations

from typing import Any

import attrs

from inference_server.models.architectures import ops
from inference_server.models.architectures.layers import NormFn


@attrs.frozen
class KernelTable:
    """Batch-invariant replacements for a runner's ops (None: keep the runner's)."""

    linear: ops.LinearFn | None = None
    norm: NormFn | None = None
    int8_linear: ops.Int8LinearFn | None = None
    fused_moe: ops.MoEFn | None = None
    prefill_attention: Any = None
    """``paged_kv.AttentionFn`` for every step's attention (decode-only steps too, so a token's attention runs the
    same reduction in a decode step as in a mixed one)."""

    def attention_kwargs(self) -> dict[str, Any]:
        """``PagedAttentionContext`` keyword arguments that route all attention through ``prefill_attention``."""
        if self.prefill_attention is None:
            return {}
        return {"prefill_attention": self.prefill_attention, "decode_attention": None, "norm_rope_decode": None}


def cpu_table() -> KernelTable:
    """The CPU runner's table (``kernels.batch_invariant_cpu``): row-tiled GEMMs (float, int8, experts) and the
    fixed-split attention; norms, RoPE, routing and sampling are per-row already."""
    from inference_server.kernels import batch_invariant_cpu as bi

    return KernelTable(linear=bi.row_tiled_linear, int8_linear=bi.row_tiled_int8_linear,
                       fused_moe=bi.row_tiled_fused_moe, prefill_attention=bi.fixed_split_attention)


def cuda_table() -> KernelTable:
    """The custom-cuda runner's table, on top of its ``reference_ops`` set (PyTorch residual adds, routing softmax
    and top-k, activations and RoPE tables, which are elementwise or one row per program; the full logits and the
    sampler instead of the fused greedy head): the fixed-tile Triton GEMM for every float projection and the head
    (``kernels.batch_invariant_matmul``), an int8 weight converted in the call and sent through it, the Triton
    RMSNorm with a fixed row count per program, the grouped-GEMM MoE with one config per layer shape whatever the
    token count (no decode GEMVs), and the paged prefill kernel with position-aligned key tiles for every step,
    decode-only ones too (decode graphs included)."""
    import functools

    from inference_server.kernels import batch_invariant_cuda as bi
    from inference_server.kernels.prefill_attention import paged_prefill_attention

    return KernelTable(linear=bi.invariant_matmul, norm=bi.invariant_rms_norm, int8_linear=bi.invariant_int8_linear,
                       fused_moe=bi.invariant_fused_moe,
                       prefill_attention=functools.partial(paged_prefill_attention, align_kv=True))


def install(table: KernelTable) -> dict[str, Any]:
    """Install ``table``'s ops (process-wide, as the CPU runner's int8 matmul is); returns the attention keyword
    arguments the runner passes to its context."""
    ops.use_ops(linear=table.linear, int8_linear=table.int8_linear, moe=table.fused_moe, norm=table.norm)
    return table.attention_kwargs()
