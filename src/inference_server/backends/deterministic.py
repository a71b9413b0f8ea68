"""``DETERMINISTIC=true`` on the CPU runner: its batch-invariant ops table and attention, chosen by the factory.

The table is an ``Ops`` record like any other (``architectures.ops``), built once and bound to the model by the runner:
the CPU engine's table (the reference, with the CPU int8 matmul for int8 models) with the ops that are not
batch-invariant on the CPU replaced by ``kernels.batch_invariant_cpu``'s row-tiled GEMMs (float, int8) and the
row-tiled experts below. The attention goes through the fixed-split kernel for every step, decode-only ones too, so a
token's attention runs the same reduction in a decode step as in a mixed one. Norms, RoPE, routing and the
activations are per-row already. The custom-cuda runner's deterministic table is a branch of
``backends.cuda.op_table.cuda_ops``. What each kernel guarantees and what stays outside the guarantee:
docs/architecture.md, "Deterministic inference".
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from inference_server.kernels import batch_invariant_cpu as bi
from inference_server.kernels.reference_int8 import dequantize_int8
from inference_server.models.architectures.layers import activation as activation_fn
from inference_server.models.architectures.ops import Ops


def cpu_ops(base: Ops) -> Ops:
    """``base`` (the CPU engine's table) with the row-tiled GEMMs: every float projection and the float head, every
    int8 layer and int8 head (``torch._weight_int8pack_mm``, never fbgemm, whose activation zero point is chosen per
    call), the routed experts. ``Fusions`` stay ``base``'s (the CPU table has none)."""
    return dataclasses.replace(base, linear=bi.row_tiled_linear, int8_linear=bi.row_tiled_int8_linear,
                               fused_moe=row_tiled_fused_moe)


def cpu_attention_kwargs() -> dict[str, Any]:
    """``PagedAttentionContext`` keyword arguments that send every step's attention through the fixed-split kernel
    (the CPU runner has no decode kernel: a decode step reduces its keys as a prefill chunk would)."""
    return {"prefill_attention": bi.fixed_split_attention}


def row_tiled_fused_moe(hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor, act: str, *,
                        w_gate_up_scale: torch.Tensor | None = None,
                        w_down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``ops.MoEFn``: ``ops.torch_fused_moe``'s order (experts by id, weighted in the weights' dtype, summed into the
    activation dtype) with each expert's two GEMMs row-tiled, so a token's output does not depend on how many
    other tokens chose the same expert (the per-token sum over its experts is in expert-id order whatever the batch)."""
    act_fn = activation_fn(act)
    out = torch.zeros_like(hidden)
    for expert in torch.unique(topk_ids.reshape(-1)).tolist():
        token_idx, k_pos = torch.where(topk_ids == expert)
        gate, up = _expert(hidden[token_idx], w_gate_up, w_gate_up_scale, expert).chunk(2, dim=-1)
        y = _expert(act_fn(gate) * up, w_down, w_down_scale, expert)
        y = y * topk_weights[token_idx, k_pos, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


def _expert(x: torch.Tensor, weights: torch.Tensor, scale: torch.Tensor | None, expert: int) -> torch.Tensor:
    if scale is None:
        return bi.row_tiled_linear(x, weights[expert])
    # int8 experts: the reference's fp32 sums of the exact int8 values, scaled after the reduction
    w = dequantize_int8(weights[expert], torch.ones_like(scale[expert]), torch.float32)
    return (bi.row_tiled_linear(x.float(), w) * scale[expert].float()).to(x.dtype)
