"""int8 → float in registers without the integer-to-float conversion instruction.

On sm_90 an ``int8 -> float`` conversion (``I2F``) issues at a quarter of the ALU rate (16 results per clock per
SM). A weight-only int8 GEMV converts every weight byte it streams, so at HBM's speed the conversion, not HBM,
sets the speed (docs/benchmarks.md).

The exponent trick does it with full-rate integer and float adds: for a byte ``v`` in [-128, 127], the fp32 whose
bits are ``0x4B000000 | (v + 128)`` is exactly ``2**23 + 128 + v`` (the byte lands in the mantissa below an
exponent of 2**23), and ``v + 128`` is the byte's unsigned value with its top bit flipped. Subtracting
``2**23 + 128`` gives ``v`` exactly. Three operations: zero-extend, one logic op, one float add; every int8 value
comes out bit-identical to ``v.to(float32)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# constexpr: compiled kernels read only constexpr globals
_MAGIC_BITS = tl.constexpr(0x4B000080)  # fp32 bits of 2**23 + 128 (the byte's flipped top bit is ORed in by the XOR)
_MAGIC_VALUE = tl.constexpr(8388736.0)  # 2**23 + 128


@triton.jit
def int8_to_fp32_exact(w):
    """An int8 tile as fp32, exactly (``w.to(tl.float32)``), by the exponent trick of the module docstring."""
    unsigned = w.to(tl.uint8, bitcast=True).to(tl.int32)  # zero-extended byte in [0, 255]
    bits = unsigned ^ _MAGIC_BITS  # 0x4B000000 | (byte ^ 0x80) == bits of 2**23 + 128 + v
    return bits.to(tl.float32, bitcast=True) - _MAGIC_VALUE


_SIGN_BITS = tl.constexpr(0x80808080)  # the top bit of each byte of a word
_EXPONENT_BITS = tl.constexpr(0x4B000000)  # fp32 bits of 2**23
# PTX for one word: flip the four sign bits (one logic op), then place each byte below the exponent of 2**23 (one
# byte permute each: result byte 0 is byte i of the word, bytes 1-3 those of 0x4B000000).
_PRMT_WORD = tl.constexpr("""{
    .reg .b32 flipped;
    xor.b32 flipped, $4, 0x80808080;
    prmt.b32 $0, flipped, $5, 0x7650;
    prmt.b32 $1, flipped, $5, 0x7651;
    prmt.b32 $2, flipped, $5, 0x7652;
    prmt.b32 $3, flipped, $5, 0x7653;
}""")


@triton.jit
def words_to_fp32_exact(words, PRMT: tl.constexpr):
    """Four int8 columns packed in each int32 of ``words`` (byte ``i`` = column ``4j + i``) as four fp32 tensors of
    ``words``' shape, exactly, by the exponent trick: per byte one permute (``PRMT``, PTX; compiled kernels only,
    the interpreter cannot run it) or a shift and a mask, one float add; per word one logic op."""
    flipped = words.to(tl.uint32, bitcast=True) ^ _SIGN_BITS
    if PRMT:
        magic = tl.full(words.shape, _EXPONENT_BITS, tl.uint32)
        b0, b1, b2, b3 = tl.inline_asm_elementwise(_PRMT_WORD, "=r,=r,=r,=r,r,r", [words, magic],
                                                   dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
                                                   is_pure=True, pack=1)
    else:
        b0 = (flipped & 0xFF) | _EXPONENT_BITS
        b1 = ((flipped >> 8) & 0xFF) | _EXPONENT_BITS
        b2 = ((flipped >> 16) & 0xFF) | _EXPONENT_BITS
        b3 = (flipped >> 24) | _EXPONENT_BITS
    return (b0.to(tl.float32, bitcast=True) - _MAGIC_VALUE, b1.to(tl.float32, bitcast=True) - _MAGIC_VALUE,
            b2.to(tl.float32, bitcast=True) - _MAGIC_VALUE, b3.to(tl.float32, bitcast=True) - _MAGIC_VALUE)


def int8_words_view(weight: torch.Tensor) -> torch.Tensor | None:
    """An int8 weight ``[..., K]`` as int32 words ``[..., K / 4]`` (four columns a word, little-endian: column
    ``4j + i`` is byte ``i`` of word ``j``), or None where its layout does not allow it (K not a multiple of 8,
    columns not contiguous, other strides or the start not 4-byte aligned): the kernels then read single bytes.
    K is a multiple of 8, not only of 4, so that the word kernels' K-tail masks can be per pair of words (8-byte
    loads; ``word_pair_offsets``)."""
    if weight.dtype != torch.int8 or weight.dim() == 0 or weight.shape[-1] % 8 or weight.shape[-1] == 0:
        return None
    if weight.stride(-1) != 1 or any(weight.stride(d) % 4 for d in range(weight.dim() - 1)):
        return None
    if weight.storage_offset() % 4:
        return None
    return weight.view(torch.int32)


@triton.jit
def word_pair_offsets(WORDS: tl.constexpr):
    """``(offsets, first_column)`` of a tile of ``WORDS`` int32 words: the offsets are ``0 .. WORDS-1``, written so
    that Triton sees runs of 2 (a thread reads two words, 8 columns, a load: the 8 bf16 columns its 16-byte
    activation load holds), and ``first_column`` is the first int8 column of each word's pair (``8 * (j // 2)``),
    constant over the pair: a K-tail mask ``first_column < rest`` keeps the masked loads 8 bytes wide (rows of a
    multiple of 8 columns: a pair is all in or all out)."""
    pair = tl.arange(0, WORDS) // 2
    return pair * 2 + tl.arange(0, WORDS) % 2, pair * 8


@triton.jit
def split4_row(t, WORDS: tl.constexpr):
    """``t [4 * WORDS]`` as four ``[WORDS]`` tensors: elements ``4j``, ``4j+1``, ``4j+2``, ``4j+3`` (each thread's
    contiguous elements stay in its registers)."""
    even, odd = tl.split(tl.reshape(t, (WORDS, 2, 2)))  # last axis: column parity
    t0, t2 = tl.split(even)
    t1, t3 = tl.split(odd)
    return t0, t1, t2, t3


@triton.jit
def fma_words(acc, w0, w1, w2, w3, x, WORDS: tl.constexpr):
    """acc [BN, WORDS] += the products of one token's columns ``x [4 * WORDS]`` with the weight columns ``w_i``
    (``4j + i``, e.g. from ``words_to_fp32_exact``): four FMAs per accumulator, each rounding only the sum."""
    x0, x1, x2, x3 = split4_row(x, WORDS)
    acc = tl.fma(w0, x0.to(tl.float32)[None, :], acc)
    acc = tl.fma(w1, x1.to(tl.float32)[None, :], acc)
    acc = tl.fma(w2, x2.to(tl.float32)[None, :], acc)
    acc = tl.fma(w3, x3.to(tl.float32)[None, :], acc)
    return acc
