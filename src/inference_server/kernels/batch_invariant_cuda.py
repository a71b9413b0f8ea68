"""The custom-cuda runner's batch-invariant ops (``DETERMINISTIC=true``; the table is ``backends.cuda.op_table``'s):
each wraps an engine kernel with its configuration pinned, so that a row's result does not depend on how many rows
the call has. The GEMM itself is ``kernels.batch_invariant_matmul``.

* ``INVARIANT_NORM_ROWS``: the rows a program of the Triton RMSNorm handles (by default the rows per program, and
  with them the warps a row's sum of squares is spread over, follow the row count); the norm op in the ops contract
  is ``backends.cuda.norm_ops.invariant_rms_norm``.
* ``invariant_fused_moe``: the grouped-GEMM fused MoE (``kernels.fused_moe``: align, gate/up, down, a per-token k-sum
  in k order) with one config per layer shape, the heuristic's for ``MOE_CONFIG_TOKENS`` tokens, whatever the step's
  token count; never the decode GEMVs (their split differs from the GEMM's).
* ``invariant_int8_linear``: an int8 weight converted to the activation dtype in the call (exact: |q| <= 127) and
  sent through the invariant GEMM, the scale applied after: correct and invariant, but it reads the weight twice
  over; int8 on CUDA is not the default (``QUANTIZATION=auto`` is none there).
"""

from __future__ import annotations

import functools

import torch

from inference_server.kernels.batch_invariant_matmul import invariant_matmul
from inference_server.kernels.fused_moe import _halve_block_k, fused_moe, moe_kernel_config
from inference_server.kernels.moe_configs import MoeKernelConfig

__all__ = ["INVARIANT_NORM_ROWS", "MOE_CONFIG_TOKENS", "invariant_fused_moe", "invariant_int8_linear",
           "invariant_matmul"]

INVARIANT_NORM_ROWS = 1
"""Rows a norm program handles: one, as the batch-invariant RMSNorms of the peers (a row's reduction then spans the
same warps whatever the call)."""
MOE_CONFIG_TOKENS = 256
"""The token count whose heuristic MoE config every step uses (a grouped-GEMM config: BLOCK_M 64-128 at the
supported models' expert counts)."""


@functools.cache
def _moe_config(hidden: int, intermediate: int, experts: int, top_k: int, wide: bool) -> MoeKernelConfig:
    config = moe_kernel_config(MOE_CONFIG_TOKENS, hidden, intermediate, experts, top_k)
    return _halve_block_k(config) if wide else config


def invariant_fused_moe(hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor, act: str, *,
                        w_gate_up_scale: torch.Tensor | None = None,
                        w_down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``ops.MoEFn``: ``kernels.fused_moe`` with the layer shape's one config."""
    experts, hidden_size, intermediate = w_down.shape
    config = _moe_config(hidden_size, intermediate, experts, topk_ids.shape[-1], hidden.element_size() > 2)
    return fused_moe(hidden, w_gate_up, w_down, topk_weights, topk_ids, act,  # type: ignore[arg-type]
                     config=config, w_gate_up_scale=w_gate_up_scale, w_down_scale=w_down_scale)


def invariant_int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``ops.Int8LinearFn``: ``x [T, K]`` times int8 ``qweight [N, K]``, per-channel ``scale``, per row."""
    y = invariant_matmul(x, qweight.to(x.dtype))
    return (y.float() * scale.float()).to(x.dtype)
