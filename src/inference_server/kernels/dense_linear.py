"""Triton float-weight linear layer for small token counts: ``y = x @ weight.T`` at the memory limit.

Contract (``torch.nn.functional.linear`` without bias is the reference): ``x [T, K]`` and ``weight [N, K]`` of one
float dtype (bf16, fp16 or fp32, any strides); products accumulated in fp32 (fp32: exact products, no TF32),
rounded once to ``x.dtype``. cuBLAS differs only in summation order (and its split-K).

Why: at decode (T = 1..16) every dense projection is a GEMV bound by the weight read, and cuBLAS runs the
models' shapes well under the memory limit (docs/benchmarks.md: o_proj as split-K plus a separate reduce, the
128-row routers pure launch cost). The kernel is
``kernels.streamed_linear``'s, shared with ``int8_linear``, with float weights: no conversion, no scale. This
module holds its own token-count buckets (a bf16 weight element is two bytes, so a 64 x 128 tile is 16 KB a
stage and fewer programs share an SM than with int8) and reads tuned configs from ``configs/dense_linear``
(``bench/dense_linear.py --sweep --write``). The CUDA backend uses it for steps of at most
``backends.cuda.options.DENSE_GEMV_MAX_TOKENS`` tokens where a tuned file says it beats cuBLAS
(``triton_is_faster``), and cuBLAS elsewhere.
"""

from __future__ import annotations

import torch
import triton

from inference_server.kernels.int8_linear_configs import (
    DENSE_CONFIG_DIR,
    Int8LinearConfig,
    tuned_baseline_faster,
    tuned_int8_linear_config,
)
from inference_server.kernels.moe_configs import device_name, tuned_configs_enabled
from inference_server.kernels.streamed_linear import (
    GEMV_MAX_TOKENS,
    H200_SMS,
    HBM_BYTES_PER_S,
    REDUCE_LAUNCH_S,
    Bucket,
    bucket_config,
    bucket_of,
    dividing_block_k,
    gemv_config,
    max_split_k,
    pow2_clamp,
    streamed_linear,
)

__all__ = ["BUCKETS", "cublas_is_faster", "dense_linear", "dense_linear_config", "triton_is_faster"]

BUCKETS = (
    Bucket(16, 16, 64, 128, 4, 4, 2, True),  # decode GEMV: 16 KB weight + 4 KB x a stage, 4 stages: 80 KB shared
    Bucket(32, 32, 64, 128, 4, 4, 2, True),  # 24 KB a stage
    Bucket(64, 64, 64, 128, 4, 3, 2, True),  # 32 KB a stage, 3 stages
    Bucket(128, 128, 128, 64, 8, 3, 2, True),  # one token tile: the choice still depends on the bucket only
    Bucket(1 << 62, 128, 128, 64, 8, 3, 1, False),  # GEMM: token tiles vary with T, so never split
)
_IN_FLIGHT_BYTES = 4 << 20  # weight bytes in flight that keep HBM at its limit (Little: 4.3 TB/s x ~1 µs)
_SHARED_PER_SM = 227 * 1024  # an H200 SM's shared memory for resident programs
_MAX_PROGRAMS_PER_SM = 8


def _stream_seconds(weight_bytes: int, programs: int, slots: int, in_flight_per_program: int) -> float:
    """Time to stream ``weight_bytes`` split evenly over ``programs``, run in waves of ``slots``: a wave of ``w``
    programs keeps ``w * in_flight_per_program`` bytes in flight and reads at that fraction of
    ``_IN_FLIGHT_BYTES`` times the HBM limit (at most the limit)."""
    full, tail = divmod(programs, slots)
    seconds = 0.0
    for wave, count in ((slots, full), (tail, 1)):
        if not wave or not count:
            continue
        bandwidth = HBM_BYTES_PER_S * min(1.0, wave * in_flight_per_program / _IN_FLIGHT_BYTES)
        seconds += count * wave * (weight_bytes / programs) / bandwidth
    return seconds


def _decode_config(bucket: Bucket, out_features: int, in_features: int, element_size: int,
                   num_sms: int) -> Int8LinearConfig:
    """The fastest launch of one token tile by a model of a memory-bound read: programs of the bucket's rows
    (64 at decode), half or a quarter of them, with K tiles of the same bytes (128, 256, 512 bf16 columns at
    decode: each program keeps as much in flight), times 1 to
    ``max_split_k`` K splits; a launch reads at the HBM limit once enough bytes are in flight
    (``_stream_seconds``), a split adds the reduce kernel's launch and its fp32 partial sums. Ties go to wider
    rows and fewer splits."""
    weight_bytes = out_features * in_features * element_size
    best, best_s = None, float("inf")
    for block_n in (bucket.block_n, bucket.block_n // 2, bucket.block_n // 4):
        if block_n < 16 or block_n > pow2_clamp(out_features, 16, bucket.block_n):
            continue
        cap_k = bucket.cap_k * (bucket.block_n // block_n) // (2 if element_size > 2 else 1)
        block_k = dividing_block_k(in_features, cap_k)
        stage = block_n * block_k * element_size
        shared = bucket.num_stages * (stage + block_k * bucket.block_t * element_size)
        if shared > _SHARED_PER_SM and block_n < bucket.block_n:  # the bucket's own tile fits (compile test)
            continue
        slots = num_sms * max(1, min(_MAX_PROGRAMS_PER_SM, _SHARED_PER_SM // shared))
        tiles = triton.cdiv(out_features, block_n)
        for split in range(1, max_split_k(in_features, block_k) + 1):
            seconds = _stream_seconds(weight_bytes, tiles * split, slots, (bucket.num_stages - 1) * stage)
            if split > 1:
                seconds += REDUCE_LAUNCH_S + 2 * split * bucket.max_tokens * out_features * 4 / HBM_BYTES_PER_S
            if seconds < best_s * 0.99:
                best, best_s = (block_n, block_k, split), seconds
    assert best is not None
    block_n, block_k, split = best
    return Int8LinearConfig(block_n, bucket.block_t, block_k, split, bucket.num_warps, bucket.num_stages)


def dense_linear_config(num_tokens: int, out_features: int, in_features: int, element_size: int = 2,
                        num_sms: int = H200_SMS) -> Int8LinearConfig:
    """Heuristic config of a token-count bucket (1-16, 17-32, 33-64, 65-128, larger). The buckets of one token
    tile choose rows, K depth and splits by ``_decode_config``'s model (it depends on the bucket, not on T, so
    steps of every size inside a bucket share compiled variants); larger steps are ordinary 128 x 128 GEMM
    tiles. fp32 weights and activations get half the K depth. Steps of 1-2 tokens take the CUDA-core GEMV
    (``streamed_linear.gemv_config``)."""
    if num_tokens <= GEMV_MAX_TOKENS:
        return gemv_config(num_tokens, in_features)
    bucket = bucket_of(BUCKETS, num_tokens)
    if not bucket.may_split:
        return bucket_config(BUCKETS, num_tokens, out_features, in_features, element_size, element_size, num_sms)
    return _decode_config(bucket, out_features, in_features, element_size, num_sms)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, *, config: Int8LinearConfig | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T`` accumulated in fp32, rounded to ``x.dtype``: ``x [T, K]``, ``weight [N, K]`` of the same
    float dtype (any strides). Returns ``[T, N]`` (written into ``out`` when given: its last dim must be
    contiguous). No host syncs; temporaries come from the caching allocator (CUDA-graph capturable). ``config``
    defaults to the tuned config for this GPU and shape, else ``dense_linear_config(T, N, K)``."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"want x [T, K] and weight [N, K]; got {tuple(x.shape)}, {tuple(weight.shape)}")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"shapes disagree: x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} differs from x's {x.dtype}")
    return streamed_linear(x, weight, None, config=config, out=out, heuristic=dense_linear_config,
                           config_dir=DENSE_CONFIG_DIR)


def cublas_is_faster(num_tokens: int, out_features: int, in_features: int, dtype: torch.dtype,
                     device: torch.device) -> bool:
    """Whether ``device``'s sweep (``bench/dense_linear.py --sweep --write``) timed cuBLAS faster than every config
    of this shape at ``num_tokens``' tuned count; False without a tuned file (or with tuned configs off)."""
    return tuned_configs_enabled() and tuned_baseline_faster(num_tokens, out_features, in_features, dtype,
                                                             device_name(device), DENSE_CONFIG_DIR)


def triton_is_faster(num_tokens: int, out_features: int, in_features: int, dtype: torch.dtype,
                     device: torch.device) -> bool:
    """Whether ``device``'s sweep timed a config of this shape faster than cuBLAS at ``num_tokens``' tuned count: a
    tuned entry there and no ``baseline_faster`` mark; False without a tuned file (or with tuned configs off)."""
    if not tuned_configs_enabled():
        return False
    name = device_name(device)
    return (tuned_int8_linear_config(num_tokens, out_features, in_features, dtype, name, DENSE_CONFIG_DIR) is not None
            and not tuned_baseline_faster(num_tokens, out_features, in_features, dtype, name, DENSE_CONFIG_DIR))
