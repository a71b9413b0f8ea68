"""Triton int8 weight-only linear layer: ``y = (x @ qweight.T) * scale``, dequantised in registers.

Contract (``reference_int8.int8_linear_reference`` is the oracle): ``x [T, K]`` (bf16, fp16 or fp32, any
strides), ``qweight [N, K]`` int8, ``scale [N]`` (any float dtype); the products are accumulated in fp32, the
per-output-channel scale is applied once after the reduction, the result is rounded to ``x.dtype``.

The kernels (the tensor-core "swap AB" kernel with its split-K reduce, and the CUDA-core GEMV of
``kernels/int8_gemv.py`` for configs with ``block_t`` below 16) and the wave model that picks K splits are
``kernels.streamed_linear``'s, shared with the float-weight ``dense_linear``; this module holds the int8
token-count buckets (an int8 weight tile of 128 columns is 8 KB a stage, half of bf16's) and the public wrapper.
Tuned configs are read from ``configs/int8_linear`` (written by ``bench/int8_kernels.py --sweep --write``).
"""

from __future__ import annotations

import torch

from inference_server.kernels.int8_linear_configs import CONFIG_DIR, Int8LinearConfig
from inference_server.kernels.streamed_linear import (
    GEMV_MAX_TOKENS,
    H200_SMS,
    Bucket,
    bucket_config,
    gemv_config,
    streamed_linear,
)

__all__ = ["BUCKETS", "Int8LinearConfig", "int8_linear", "int8_linear_config"]

BUCKETS = (
    # decode GEMV: 72 KB shared; the exponent-trick dequantisation and 256-column tiles measured faster than the
    # conversion instruction with 128 (bench/int8_kernels.py --sweep; docs/benchmarks.md)
    Bucket(16, 16, 64, 256, 4, 3, 3, True, magic_dequant=1),
    Bucket(32, 32, 64, 128, 4, 4, 4, True),  # 56 KB, 117 registers
    Bucket(64, 64, 64, 128, 4, 4, 2, True),  # 88 KB, 167 registers
    Bucket(128, 128, 128, 64, 8, 4, 1, True),  # one token tile: the split still depends on the bucket only
    Bucket(1 << 62, 128, 128, 64, 8, 4, 1, False),  # prefill GEMM: token tiles vary with T, so never split
)


def int8_linear_config(
    num_tokens: int, out_features: int, in_features: int, element_size: int = 2, num_sms: int = H200_SMS
) -> Int8LinearConfig:
    """Heuristic config of a token-count bucket (1-16, 17-32, 33-64, 65-128, larger): one config per bucket, so
    steps of every size inside a bucket share compiled variants.

    Decode buckets are weight-streaming GEMVs: 64 weight rows (one wgmma M tile for 4 warps); at 1-16 tokens
    256-column int8 tiles, 3 stages and the exponent-trick dequantisation (3 programs an SM), at 17-64 tokens
    128-column tiles and 4 stages (4 and 2 programs an SM: many slots, short tails). K is split by
    ``streamed_linear.wave_split_k`` where the weight-row tiles are too few. Prefill buckets are ordinary 128x128
    GEMM tiles. Activations of 4 bytes (fp32) get half the K depth: the same shared memory as the 2-byte case.
    Steps of 1-2 tokens take the CUDA-core GEMV instead (``streamed_linear.gemv_config``).
    """
    if num_tokens <= GEMV_MAX_TOKENS:
        return gemv_config(num_tokens, in_features)
    return bucket_config(BUCKETS, num_tokens, out_features, in_features, element_size, 1, num_sms)


def int8_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    *,
    config: Int8LinearConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(x @ qweight.T)`` accumulated in fp32, times ``scale`` per output channel, rounded to ``x.dtype``.

    Shapes: ``x [T, K]`` (fp32, fp16 or bf16; any strides), ``qweight [N, K]`` int8 (any strides),
    ``scale [N]`` float. Returns ``[T, N]`` in ``x.dtype`` (written into ``out`` when given: its last dim must
    be contiguous). No host syncs; temporaries come from the caching allocator (CUDA-graph capturable).
    ``config`` defaults to the tuned config for this GPU and shape (``int8_linear_configs``; only while
    ``moe_configs.tuned_configs`` is on), else the heuristic ``int8_linear_config(T, N, K)``.
    """
    if x.dim() != 2 or qweight.dim() != 2 or scale.dim() != 1:
        raise ValueError(f"want x [T, K], qweight [N, K], scale [N]; got {tuple(x.shape)}, "
                         f"{tuple(qweight.shape)}, {tuple(scale.shape)}")
    if qweight.shape[1] != x.shape[1] or scale.shape[0] != qweight.shape[0]:
        raise ValueError(f"shapes disagree: x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, "
                         f"scale {tuple(scale.shape)}")
    if qweight.dtype != torch.int8:
        raise ValueError(f"qweight must be int8, not {qweight.dtype}")
    if not scale.is_floating_point():
        raise ValueError(f"scale must be a float tensor, not {scale.dtype}")
    return streamed_linear(x, qweight, scale, config=config, out=out, heuristic=int8_linear_config,
                           config_dir=CONFIG_DIR)
