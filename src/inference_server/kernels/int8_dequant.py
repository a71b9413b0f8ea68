"""int8 → float in registers without the integer-to-float conversion instruction.

On sm_90 an ``int8 -> float`` conversion (``I2F``) issues at a quarter of the ALU rate (16 results per clock per
SM). A weight-only int8 GEMV converts every weight byte it streams, and at the H200's 4.3 TB/s that conversion
alone needs ~14 results per clock per SM: the conversion, not HBM, sets the speed (the first int8 GEMV measured
0.41-0.68 of the memory limit, ``bench/int8_kernels.py``).

The exponent trick does it with full-rate integer and float adds: for a byte ``v`` in [-128, 127], the fp32 whose
bits are ``0x4B000000 | (v + 128)`` is exactly ``2**23 + 128 + v`` (the byte lands in the mantissa below an
exponent of 2**23), and ``v + 128`` is the byte's unsigned value with its top bit flipped. Subtracting
``2**23 + 128`` gives ``v`` exactly. Three operations: zero-extend, one logic op, one float add; every int8 value
comes out bit-identical to ``v.to(float32)``.
"""

from __future__ import annotations

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


# Four bytes a time in PTX: flip the four top bits with one XOR, then one PRMT per byte moves it under the
# exponent bytes (d = [byte_i, 0x00, 0x00, 0x4B]: selector nibbles i, 4, 5, 7 over {a, b = 0x4B000000}), and a
# float subtract per value. 2.25 instructions a byte instead of a zero-extend, a logic op, the subtract and the
# compiler's byte extraction. Element i of the pack is byte i of the register Triton packs it into, and result i
# goes to output i: the order is Triton's, whatever it is, on both sides.
_PRMT_TO_FP32 = tl.constexpr("""
{
.reg .b32 t, m;
xor.b32 t, $4, 0x80808080;
mov.b32 m, 0x4B000000;
prmt.b32 $0, t, m, 0x7540;
prmt.b32 $1, t, m, 0x7541;
prmt.b32 $2, t, m, 0x7542;
prmt.b32 $3, t, m, 0x7543;
sub.f32 $0, $0, 0f4B000080;
sub.f32 $1, $1, 0f4B000080;
sub.f32 $2, $2, 0f4B000080;
sub.f32 $3, $3, 0f4B000080;
}
""")

# The same four fp32 values, then their upper halves packed pairwise: a small integer is exact in bf16, whose bits
# are the fp32's upper 16 (selector 0x7632 takes bytes 2, 3 of a and of b).
_PRMT_TO_BF16 = tl.constexpr("""
{
.reg .b32 t, m, f0, f1, f2, f3;
xor.b32 t, $2, 0x80808080;
mov.b32 m, 0x4B000000;
prmt.b32 f0, t, m, 0x7540;
prmt.b32 f1, t, m, 0x7541;
prmt.b32 f2, t, m, 0x7542;
prmt.b32 f3, t, m, 0x7543;
sub.f32 f0, f0, 0f4B000080;
sub.f32 f1, f1, 0f4B000080;
sub.f32 f2, f2, 0f4B000080;
sub.f32 f3, f3, 0f4B000080;
prmt.b32 $0, f0, f1, 0x7632;
prmt.b32 $1, f2, f3, 0x7632;
}
""")


@triton.jit
def int8_to_fp32(w, PTX: tl.constexpr):
    """An int8 tile as fp32, exactly: four bytes per PTX block (``PTX``: on CUDA; the tile's elements per thread
    must be a multiple of 4) or ``int8_to_fp32_exact`` (the interpreter runs no PTX)."""
    if PTX:
        return tl.inline_asm_elementwise(_PRMT_TO_FP32, "=r,=r,=r,=r,r", [w], dtype=tl.float32, is_pure=True, pack=4)
    else:
        return int8_to_fp32_exact(w)


@triton.jit
def int8_to_bf16(w, PTX: tl.constexpr):
    """An int8 tile as bf16, exactly (every int8 value is a bf16): four bytes per PTX block under ``PTX``."""
    if PTX:
        return tl.inline_asm_elementwise(_PRMT_TO_BF16, "=r,=r,r", [w], dtype=tl.bfloat16, is_pure=True, pack=4)
    else:
        return int8_to_fp32_exact(w).to(tl.bfloat16)
