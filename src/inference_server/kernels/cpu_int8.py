"""The CPU engine's int8 matmul (``ops.int8_linear`` on the CPU): the fastest torch kernels that keep the
quality of the weight-only reference, chosen by measurement (``bench/int8_quality.py``, docs/quantization.md).

On the CPU, one thread, the embedded model's tied lm_head at M=1 is fastest through fbgemm's int8 x int8 GEMM
(``quantized::linear_dynamic``), then ``torch._weight_int8pack_mm`` with bf16 activations, then fp32 ``F.linear``
(figures: docs/quantization.md). fbgemm also quantizes the *activations*, which costs quality when every layer
does it, but little in the one lm_head matmul. Hence two paths:

* matrices of at least ``LARGE_WEIGHT_ELEMENTS`` weights (in practice the lm_head: no decoder layer of the
  supported CPU models comes close), when fbgemm and VNNI are there: fbgemm with each row of ``x`` quantized
  to 8 bits with its own scale (the row is divided by its max |x|, so fbgemm's one per-tensor scale is each
  row's own, and multiplied back after). A row with a large range does not coarsen the others (results
  depend on the batch only through fbgemm's choice of zero point, within the 8-bit step).
  Without VNNI, fbgemm's AVX2 kernel can saturate 8-bit products (hence its 7-bit ``reduce_range``, which
  costs perplexity), so that case takes the next path. (fbgemm's fp16 GEMM of the dequantised weights was
  faster per token on an AVX2 CPU, but packing the head's weights took too long at start-up: dropped; the
  figures are in docs/quantization.md);
* everything else: ``torch._weight_int8pack_mm`` with the activations rounded to bf16 (a weight-only kernel;
  its output is bf16 too; both roundings together change the perplexity by < 0.1 %), cast back to fp32.

fbgemm packs a copy of each large weight on first use (kept on the weight tensor, released with it): on the
embedded model 168 MB beside the 168 MB int8 table. Anything else (CUDA tensors, non-fp32 activations, a torch
without these ops) goes to the weight-only reference.
"""

from __future__ import annotations

import functools
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

from inference_server.kernels.reference_int8 import int8_linear_reference

__all__ = ["LARGE_WEIGHT_ELEMENTS", "cpu_int8_linear", "fbgemm_row_quantized_linear", "int8pack_linear",
           "prepack_large_weights"]

LARGE_WEIGHT_ELEMENTS = 1 << 24  # 16.8 M weights: the embedded lm_head has 168 M, its largest layer 1.3 M
INT8PACK_K_MULTIPLE = 32
"""``torch._weight_int8pack_mm`` on the CPU reads K in vector blocks: K = 8 gave wrong results (and a crash in an
engine run), 16-640 were right; multiples of 32 are taken (every layer of the supported models), others go to
the reference."""
_BF16_SCALE_ATTRIBUTE = "_bf16_scale"  # set on the scale tensor: (data_ptr it was converted from, bf16 copy)
_PACKED_ATTRIBUTE = "_fbgemm_packed"  # set on the qweight tensor: (data_ptr it was packed from, packed weight)


@functools.cache
def _fbgemm_8bit_safe() -> bool:
    """fbgemm is the active quantized engine (``x86`` uses it for linear layers) and the CPU has VNNI, whose
    int8 dot products accumulate in int32 without the AVX2 kernel's int16 saturation."""
    if torch.backends.quantized.engine not in ("x86", "fbgemm"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_vnni" in flags or " avx_vnni" in flags


def _pack(qweight: torch.Tensor, scale: torch.Tensor) -> Any:
    """fbgemm's packed copy of ``qweight`` with per-channel ``scale``, kept on the ``qweight`` tensor object
    (it lives and dies with it) and repacked if the tensor's storage moved."""
    cached = getattr(qweight, _PACKED_ATTRIBUTE, None)
    if cached is not None and cached[0] == qweight.data_ptr():
        return cached[1]
    zero_points = torch.zeros(qweight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # "quantized tensor creation functions are deprecated": this one is internal
        warnings.simplefilter("ignore", UserWarning)
        quantized = torch._make_per_channel_quantized_tensor(qweight.contiguous(), scale.double(), zero_points, 0)
    packed = torch.ops.quantized.linear_prepack(quantized, None)
    setattr(qweight, _PACKED_ATTRIBUTE, (qweight.data_ptr(), packed))
    return packed


def fbgemm_row_quantized_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [T, K]`` fp32 times int8 ``qweight [N, K]`` with per-channel ``scale``, each row of ``x`` quantized to
    8 bits with its own scale on the fly (fbgemm, int32 accumulation). Needs ``_fbgemm_8bit_safe()``."""
    row_scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)  # [T, 1]
    y = torch.ops.quantized.linear_dynamic(x / row_scale, _pack(qweight, scale), False)  # [T, N]
    return y * row_scale


def _bf16_scale(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` in bf16, kept on the scale tensor (one conversion per layer instead of one per call)."""
    cached = getattr(scale, _BF16_SCALE_ATTRIBUTE, None)
    if cached is not None and cached[0] == scale.data_ptr():
        return cached[1]
    converted = scale.to(torch.bfloat16)
    setattr(scale, _BF16_SCALE_ATTRIBUTE, (scale.data_ptr(), converted))
    return converted


SCRATCH_MAX_ROWS = 16
"""Activations of at most this many rows (decode steps) are rounded to bf16 into a kept buffer of their shape
(``_bf16_rows``); longer ones into a fresh tensor."""
_scratch = threading.local()  # per thread: {(shape, inference mode): bf16 buffer}


def _bf16_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.to(torch.bfloat16)``, contiguous: for a decode-sized ``x`` written into a buffer kept per thread and shape
    (``copy_`` rounds as ``to`` does; the matmul reads it before the next call of this thread can write it), which
    saves an allocation per projection."""
    if x.shape[0] > SCRATCH_MAX_ROWS or x.requires_grad:
        return x.to(torch.bfloat16)
    buffers: dict[tuple[torch.Size, bool], torch.Tensor] | None = getattr(_scratch, "buffers", None)
    if buffers is None:
        buffers = _scratch.buffers = {}
    key = x.shape, torch.is_inference_mode_enabled()  # an inference-mode buffer cannot be written outside it
    buffer = buffers.get(key)
    if buffer is None:
        buffer = buffers[key] = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    return buffer.copy_(x)


def int8pack_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Weight-only int8 matmul through ``torch._weight_int8pack_mm`` with x rounded to bf16 (its fast CPU path),
    the result returned in x's dtype."""
    x16 = _bf16_rows(x)
    out = torch._weight_int8pack_mm(x16 if x16.is_contiguous() else x16.contiguous(),
                                    qweight if qweight.is_contiguous() else qweight.contiguous(), _bf16_scale(scale))
    return out.to(x.dtype)


def prepack_large_weights(model: torch.nn.Module) -> int:
    """Pack every large int8 weight of ``model`` (``qweight`` of at least ``LARGE_WEIGHT_ELEMENTS``) for fbgemm
    when ``cpu_int8_linear`` will run it there (a VNNI CPU), so the first request does not pay for it; returns
    how many were packed."""
    if not _fbgemm_8bit_safe():
        return 0
    packed = 0
    for module in model.modules():
        qweight, scale = getattr(module, "qweight", None), getattr(module, "scale", None)
        if not isinstance(qweight, torch.Tensor) or not isinstance(scale, torch.Tensor):
            continue
        if qweight.device.type != "cpu" or qweight.dim() != 2 or qweight.numel() < LARGE_WEIGHT_ELEMENTS:
            continue
        _pack(qweight, scale)
        packed += 1
    return packed


def cpu_int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``ops.Int8LinearFn`` for the CPU engine: ``x [T, K]``, ``qweight [N, K]`` int8, ``scale [N]`` -> ``[T, N]``
    in x's dtype (module docstring for which kernel runs)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.shape[0] == 0:
        return int8_linear_reference(x, qweight, scale)
    if qweight.numel() >= LARGE_WEIGHT_ELEMENTS and _fbgemm_8bit_safe():
        return fbgemm_row_quantized_linear(x, qweight, scale)
    if qweight.shape[1] % INT8PACK_K_MULTIPLE == 0 and hasattr(torch, "_weight_int8pack_mm"):
        return int8pack_linear(x, qweight, scale)
    return int8_linear_reference(x, qweight, scale)
