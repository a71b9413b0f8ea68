"""A dense MLP's gate/up projection with its gated activation in the GEMV's epilogue: ``act(x @ G.T) * (x @ U.T)``
for a fused ``[gate; up]`` weight ``[2I, K]`` (``GatedMLP.fuse_gate_up``), one launch where the unfused path takes
two (the projection, then ``kernels.gated_activation``), and no ``[T, 2I]`` intermediate written and read back.

Each program of the CUDA-core GEMV (``kernels/int8_gemv.py``, int8 or float weights) streams ``block_n / 2`` gate
rows and the up rows of the same outputs, so its epilogue holds both factors of its outputs. It rounds each factor
as the projection's output is rounded (times the row scale for int8, then cast to x's dtype) and applies the gated
activation's two roundings through the same jit helper (``gated_activation.gated_product``). A row's fp32 sums do
not depend on which rows share its program, so with the config the unfused projection would run, the result is the
unfused path's, bit for bit. That is the rule of ``gated_gemv_config``: the fused launch is taken only where the
projection alone would run the CUDA-core GEMV in one K split (1-4 tokens; ``streamed_linear.resolve_config``'s
tuned or heuristic config), and with that config; anywhere else the caller runs the two launches.

The same epilogue takes the up factor from memory instead (``up``): ``act(x @ W.T) * up`` for a gate projection
whose other factor comes from elsewhere (Gemma 4's per-layer-input gate on E2B/E4B: ``act(gate(h)) *
per_layer_input``); every program then streams ``block_n`` gate rows.
"""

from __future__ import annotations

import torch
import triton

from inference_server.kernels.dense_linear import DENSE_CONFIG_DIR, dense_linear_config
from inference_server.kernels.int8_gemv import (
    GATED_ACTIVATIONS,
    check_gemv_weight,
    gemv_outputs,
    int8_gemv_kernel,
    launch_gemv,
)
from inference_server.kernels.int8_linear import CONFIG_DIR, int8_linear_config
from inference_server.kernels.int8_linear_configs import Int8LinearConfig
from inference_server.kernels.streamed_linear import is_one_split_gemv, resolve_config

__all__ = ["gated_gemv", "gated_gemv_config"]

# TRITON_INTERPRET=1 is read when a kernel is decorated: the kernel is then an interpreter object.
_INTERPRETED = not isinstance(int8_gemv_kernel, triton.runtime.JITFunction)


def gated_gemv_config(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, *,
                      paired: bool = True) -> Int8LinearConfig | None:
    """The config the projection ``x [T, K] @ weight.T`` alone would run with (``int8_linear``'s for int8 weights
    with ``scale``, ``dense_linear``'s for float ones) when it is a one-split CUDA-core GEMV (and, with ``paired``
    rows of a ``[gate; up]`` weight ``[2I, K]``, one whose programs can pair them); None otherwise (the caller then
    runs the projection and the activation apart)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or (paired and weight.shape[0] % 2) \
            or x.shape[0] == 0 or weight.shape[0] == 0 or x.shape[1] == 0:
        return None
    if scale is None:
        config = resolve_config(x, weight.shape[0], dense_linear_config, DENSE_CONFIG_DIR)
    else:
        config = resolve_config(x, weight.shape[0], int8_linear_config, CONFIG_DIR)
    if not is_one_split_gemv(config, x.shape[1]) or (paired and (config.block_n < 2 or config.block_n % 2)):
        return None
    return config


def gated_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, act: str,
               config: Int8LinearConfig, up: torch.Tensor | None = None) -> torch.Tensor:
    """``act(x @ gate.T) * (x @ up.T)`` ``[T, I]`` in x's dtype, for ``weight = [gate; up]`` ``[2I, K]`` (int8 with
    ``scale [2I]``, else float of x's dtype); with ``up [T, N]`` given, ``act(x @ weight.T) * up`` ``[T, N]``.
    ``config`` comes from ``gated_gemv_config`` (``paired`` when ``up`` is None; see the module docstring);
    ``act`` is ``gelu_tanh`` or ``silu``."""
    if act not in GATED_ACTIVATIONS:
        raise ValueError(f"gated_gemv supports {tuple(GATED_ACTIVATIONS)}, not {act!r}")
    check_gemv_weight(x, weight, scale)
    T, K = x.shape
    if not is_one_split_gemv(config, K):
        raise ValueError(f"gated_gemv runs a CUDA-core GEMV config of one split, not {config}")
    width, rows_per_output = gemv_outputs(weight.shape[0], config.block_n, paired=up is None)
    out = torch.empty(T, width, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(T, config.block_t), triton.cdiv(width, rows_per_output), 1)
    launch_gemv(grid, x, weight, scale, out, K, 0, block_n=config.block_n, block_t=config.block_t,
                block_k=config.block_k, split_k=1, num_warps=config.num_warps, num_stages=config.num_stages,
                interpreted=_INTERPRETED, gated=act, up=up)
    return out
