"""The CUDA-core int8 GEMV's dot without dequantising a weight byte: bf16 activations as 16-bit fixed point, the
products as integer dot products (``dp2a``), one float conversion per word.

Why: converting every weight byte to fp32 (``int8_dequant``'s exponent trick) costs a byte permute, a float add and an
FMA per byte, which kept the one-token GEMV below the read speed of the same loop without arithmetic
(docs/benchmarks.md). Here the conversion moves to the activations, which every weight row of a program shares: per
weight word (four int8 columns) a row costs two ``dp2a`` (two 16-bit by two 8-bit products each, summed in int32), one
int-to-float conversion and one FMA.

The fixed point, per word of four columns ``4j .. 4j+3`` and token (the columns a weight word meets):

* ``E`` is the fp32 biased exponent of the four values' largest magnitude (at least 15, so tiny values stay normal
  numbers; at most 254);
* each value becomes ``q = rint(x * 2**(141 - E))``, an integer below ``2**15`` in magnitude (``x`` times a power of
  two is exact; adding ``1.5 * 2**23`` in fp32 rounds it to nearest-even and leaves it in the low mantissa bits);
* the word's unit is ``step = 2**(E - 141)``, so the word's contribution is ``step * sum_i q_i * w_i``, the sum
  exact in int32 (``4 * 2**15 * 128 = 2**24``).

A bf16 value has 8 significant bits, so every value within ``2**7`` of its word's largest is represented exactly;
smaller ones are rounded by at most half a step, ``2**(E - 142)``, and the largest is at least ``2**(E - 127)``: at
most ``2**-15`` of the largest's magnitude, reached when it is a power of two (words whose largest is below ``2**-112``
sit on the floor's grid, ``2**-126``, and move by at most ``2**-127``) (``tests/kernels/reference_fixed_point.py``
computes the same numbers in PyTorch). An inf or NaN among the four makes ``step`` NaN, so the
outputs it reaches are NaN, as with float products.

Compiled kernels use PTX (``prmt`` to pack two 16-bit integers a register, ``dp2a``); under the interpreter, which
cannot run inline assembly, shifts and int32 products compute the same integers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inference_server.kernels.int8_dequant import split4_row

__all__ = ["fixed_point_accumulate", "fixed_point_dot", "fixed_point_tile", "takes_fixed_point"]

def takes_fixed_point(activation_dtype: torch.dtype) -> bool:
    """Whether GEMVs over int8 words take these activations as fixed point: bf16 only (8 significant bits, so the
    bound above holds); other dtypes keep the exact float products."""
    return activation_dtype == torch.bfloat16


_ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: |v| < 2**22 plus this rounds v to an integer, kept in the bits
_EXPONENT_FLOOR = tl.constexpr(15)  # the smallest word exponent: step = 2**(15 - 141) = 2**-126, a normal fp32
_EXPONENT_CEIL = tl.constexpr(254)  # the largest finite fp32 exponent (inf / NaN words are marked by the poison)
# PTX: the low 16 bits of two integers (the rounded values' fp32 bits: the integer sits in their low bits) as one
# register, element 0 in the low half: a byte permute each pair.
_PACK_PAIRS = tl.constexpr("""{
    prmt.b32 $0, $2, $3, 0x5410;
    prmt.b32 $1, $4, $5, 0x5410;
}""")
# PTX: sum_i q_i * w_i over the word's four columns: dp2a.lo takes the word's bytes 0-1 with (q0, q1), dp2a.hi its
# bytes 2-3 with (q2, q3), all signed.
_DP2A_WORD = tl.constexpr("""{
    .reg .s32 t;
    dp2a.lo.s32.s32 t, $1, $3, 0;
    dp2a.hi.s32.s32 $0, $2, $3, t;
}""")


@triton.jit
def _fixed_point_word(x0, x1, x2, x3, PTX: tl.constexpr):
    """One token's columns ``4j+i`` (``x_i [WORDS]``) as the fixed point of the module docstring: ``(lo, hi, step)``,
    ``lo``/``hi`` the int16 pairs ``(q0, q1)``/``(q2, q3)`` packed in int32, ``step`` the word's unit in fp32 (NaN
    where a value is inf or NaN)."""
    f0, f1, f2, f3 = x0.to(tl.float32), x1.to(tl.float32), x2.to(tl.float32), x3.to(tl.float32)
    largest = tl.maximum(tl.maximum(tl.abs(f0), tl.abs(f1)), tl.maximum(tl.abs(f2), tl.abs(f3)))
    exponent = largest.to(tl.int32, bitcast=True) >> 23  # biased; the sign bit is clear
    exponent = tl.minimum(tl.maximum(exponent, _EXPONENT_FLOOR), _EXPONENT_CEIL)
    inverse = ((268 - exponent) << 23).to(tl.float32, bitcast=True)  # 2**(141 - E)
    poison = (f0 + f1 + f2 + f3) * 0.0  # 0 for finite values, NaN when one is inf or NaN
    step = ((exponent - 14) << 23).to(tl.float32, bitcast=True) + poison  # 2**(E - 141)
    b0 = tl.fma(f0, inverse, _ROUND_MAGIC).to(tl.int32, bitcast=True)  # low 16 bits: q0 (two's complement)
    b1 = tl.fma(f1, inverse, _ROUND_MAGIC).to(tl.int32, bitcast=True)
    b2 = tl.fma(f2, inverse, _ROUND_MAGIC).to(tl.int32, bitcast=True)
    b3 = tl.fma(f3, inverse, _ROUND_MAGIC).to(tl.int32, bitcast=True)
    if PTX:
        lo, hi = tl.inline_asm_elementwise(_PACK_PAIRS, "=r,=r,r,r,r,r", [b0, b1, b2, b3],
                                           dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        lo = (b0 & 0xFFFF) | (b1 << 16)
        hi = (b2 & 0xFFFF) | (b3 << 16)
    return lo, hi, step


@triton.jit
def _dp2a_word(lo, hi, w, PTX: tl.constexpr):
    """``sum_i q_i * byte_i(w)`` per element, exactly, in int32 (``lo``/``hi`` broadcast to ``w``'s shape)."""
    if PTX:
        return tl.inline_asm_elementwise(_DP2A_WORD, "=r,r,r,r", [lo, hi, w], dtype=tl.int32, is_pure=True, pack=1)
    else:
        return (((lo << 16) >> 16) * ((w << 24) >> 24) + (lo >> 16) * ((w << 16) >> 24)
                + ((hi << 16) >> 16) * ((w << 8) >> 24) + (hi >> 16) * (w >> 24))


@triton.jit
def fixed_point_tile(x, WORDS: tl.constexpr, PTX: tl.constexpr):
    """One token's activation tile ``x [4 * WORDS]`` (bf16) as the fixed point of the module docstring, ready for
    ``fixed_point_accumulate``: ``(lo, hi, step)``, each ``[WORDS]``. Compute it once per tile and token and share
    it across every weight tile it multiplies."""
    x0, x1, x2, x3 = split4_row(x, WORDS)  # columns 4j+i: the thread's contiguous elements
    return _fixed_point_word(x0, x1, x2, x3, PTX)


@triton.jit
def fixed_point_accumulate(acc, w, lo, hi, step, PTX: tl.constexpr):
    """``acc [BN, WORDS]`` += the products of the int8 words ``w [BN, WORDS]`` (byte ``i`` = column ``4j + i``)
    with a ``fixed_point_tile``: per word the exact integer sum times its unit (one rounding, in the FMA)."""
    dots = _dp2a_word(tl.broadcast_to(lo[None, :], w.shape), tl.broadcast_to(hi[None, :], w.shape), w, PTX)
    return tl.fma(dots.to(tl.float32), step[None, :], acc)


@triton.jit
def fixed_point_dot(acc, w, x, WORDS: tl.constexpr, PTX: tl.constexpr):
    """``fixed_point_accumulate`` of ``w`` with ``fixed_point_tile(x)``: one token's bf16 tile ``x [4 * WORDS]``
    times a tile of int8 words ``w [BN, WORDS]``, added to ``acc [BN, WORDS]``."""
    lo, hi, step = fixed_point_tile(x, WORDS, PTX)
    return fixed_point_accumulate(acc, w, lo, hi, step, PTX)
