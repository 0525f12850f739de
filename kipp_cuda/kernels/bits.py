"""Packed integers to exact fp32 for the one-token quantized GEMVs, without I2F (a quarter-rate
pipe) and without a float subtraction a weight.

A float with exponent 2**1 whose mantissa holds a byte u in bits 15-22 is 2 + u / 128, exactly;
a nibble n in bits 15-18 gives 2 + n / 128 and in bits 19-22 2 + n / 8. (Bit 23 is the exponent's
low bit, so a byte cannot sit in bits 16-23.) On a GPU a shift moves each byte of a word to bits
15-22 and one LOP3 masks it under the exponent (and can flip its sign bit), so a weight costs
about two integer ops and one FFMA: sum(x u) = 128 (sum(x f) - 2 sum(x)), with sum(x) shared by a
tile's rows. Under the interpreter (ASM false) integer ops give the same values.

The loads are inline PTX too (load_words, load_scalar, load_x8): a tl.load's layout follows its
memory contiguity, and Triton would then carry the GEMV tile's math through layout changes in
shared memory (15 barriers a K step in the SASS of the first version); an asm load keeps each
(row, group) element's words, scale and x in the thread that owns it. Under the interpreter they
are plain tl.loads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def aligned_x(x: torch.Tensor) -> torch.Tensor:
    """x as the GEMVs read it: 16 bytes at a time from the start of each quantization group
    (load_x8), so its start must be 16-byte aligned; a view that is not is copied."""
    return x.clone() if x.data_ptr() % 16 else x


def _byte_asm(e: int, lut: int) -> str:
    # Byte i of $4 shifted to bits 15-22, then one LOP3 of it, the mask m of those bits and the
    # exponent word e into output $i.
    shifts = (
        "shl.b32 a0, $4, 15;",
        "shl.b32 a1, $4, 7;",
        "shr.u32 a2, $4, 1;",
        "shr.u32 a3, $4, 9;",
    )
    lop3 = [f"lop3.b32 ${i}, a{i}, m, e, 0x{lut:02X};" for i in range(4)]
    return "\n".join(
        [
            "{",
            ".reg .b32 a0, a1, a2, a3, m, e;",
            "mov.b32 m, 0x007F8000;",
            f"mov.b32 e, 0x{e:08X};",
            *shifts,
            *lop3,
            "}",
        ]
    )


# lop3 0xEA: (a & m) | e. lop3 0x6A: m ? a ^ e : e, which also flips bit 22 (the byte's top bit)
# because e holds it.
_BYTES = tl.constexpr(_byte_asm(0x40000000, 0xEA))
_BYTES_FLIPPED = tl.constexpr(_byte_asm(0x40400000, 0x6A))


@triton.jit
def byte_floats(w, FLIP: tl.constexpr, ASM: tl.constexpr):
    """int32 words of four bytes (byte i is element i) -> four fp32 tensors 2 + u_i / 128, u_i the
    byte as unsigned, with its top bit flipped if FLIP (then u = q + 128 for an int8 q)."""
    if ASM:
        f0, f1, f2, f3 = tl.inline_asm_elementwise(
            asm=_BYTES_FLIPPED if FLIP else _BYTES,
            constraints="=r,=r,=r,=r,r",
            args=[w],
            dtype=(tl.int32,) * 4,
            is_pure=True,
            pack=1,
        )
        f0 = f0.to(tl.float32, bitcast=True)
        f1 = f1.to(tl.float32, bitcast=True)
        f2 = f2.to(tl.float32, bitcast=True)
        f3 = f3.to(tl.float32, bitcast=True)
    else:
        u = w.to(tl.uint32, bitcast=True)
        if FLIP:
            u = u ^ 0x80808080
        f0 = (u & 0xFF).to(tl.float32) * 0.0078125 + 2.0
        f1 = ((u >> 8) & 0xFF).to(tl.float32) * 0.0078125 + 2.0
        f2 = ((u >> 16) & 0xFF).to(tl.float32) * 0.0078125 + 2.0
        f3 = (u >> 24).to(tl.float32) * 0.0078125 + 2.0
    return f0, f1, f2, f3


@triton.jit
def byte_dot8(w0, w1, x, FLIP: tl.constexpr, ASM: tl.constexpr):
    """sum_i f_i x_i over the eight bytes of the words w0, w1 ([BLOCK_N, BLOCK_G]; f_i as
    byte_floats makes them) and x's eight [BLOCK_G] values."""
    f0, f1, f2, f3 = byte_floats(w0, FLIP, ASM)
    f4, f5, f6, f7 = byte_floats(w1, FLIP, ASM)
    return (
        f0 * x[0][None, :]
        + f1 * x[1][None, :]
        + f2 * x[2][None, :]
        + f3 * x[3][None, :]
        + f4 * x[4][None, :]
        + f5 * x[5][None, :]
        + f6 * x[6][None, :]
        + f7 * x[7][None, :]
    )


@triton.jit
def _nibble_float(w, i: tl.constexpr):
    # the interpreter's value of nibble i: 2 + n / 128 (even i) or 2 + n / 8 (odd i)
    n = ((w.to(tl.uint32, bitcast=True) >> (4 * i)) & 0xF).to(tl.float32)
    return n * (0.0078125 if i % 2 == 0 else 0.125) + 2.0


@triton.jit
def nibble_floats(w, ASM: tl.constexpr):
    """int32 words of eight nibbles (nibble i is element i) -> eight fp32 tensors: 2 + n_i / 128
    for even i (bits 15-18 once its byte is in bits 15-22), 2 + n_i / 8 for odd i (bits 19-22).
    Callers scale the odd elements' x by 1 / 16 to even them out."""
    if ASM:
        f0, f1, f2, f3, f4, f5, f6, f7 = tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 a0, a1, a2, a3, lo, hi, e;
            mov.b32 lo, 0x00078000;
            mov.b32 hi, 0x00780000;
            mov.b32 e, 0x40000000;
            shl.b32 a0, $8, 15;
            shl.b32 a1, $8, 7;
            shr.u32 a2, $8, 1;
            shr.u32 a3, $8, 9;
            lop3.b32 $0, a0, lo, e, 0xEA;
            lop3.b32 $1, a0, hi, e, 0xEA;
            lop3.b32 $2, a1, lo, e, 0xEA;
            lop3.b32 $3, a1, hi, e, 0xEA;
            lop3.b32 $4, a2, lo, e, 0xEA;
            lop3.b32 $5, a2, hi, e, 0xEA;
            lop3.b32 $6, a3, lo, e, 0xEA;
            lop3.b32 $7, a3, hi, e, 0xEA;
            }""",
            constraints="=r,=r,=r,=r,=r,=r,=r,=r,r",
            args=[w],
            dtype=(tl.int32,) * 8,
            is_pure=True,
            pack=1,
        )
        return (
            f0.to(tl.float32, bitcast=True),
            f1.to(tl.float32, bitcast=True),
            f2.to(tl.float32, bitcast=True),
            f3.to(tl.float32, bitcast=True),
            f4.to(tl.float32, bitcast=True),
            f5.to(tl.float32, bitcast=True),
            f6.to(tl.float32, bitcast=True),
            f7.to(tl.float32, bitcast=True),
        )
    return (
        _nibble_float(w, 0),
        _nibble_float(w, 1),
        _nibble_float(w, 2),
        _nibble_float(w, 3),
        _nibble_float(w, 4),
        _nibble_float(w, 5),
        _nibble_float(w, 6),
        _nibble_float(w, 7),
    )


@triton.jit
def load_words(ptr, ASM: tl.constexpr, NC: tl.constexpr = True):
    """The 16 bytes at each int32 pointer (16-byte aligned) as four int32 tensors, one vector load
    a pointer: through the read-only path (NC, weights), or coherent (x, which the previous kernel
    wrote). Inline PTX rather than tl.load: a tl.load's layout follows its memory contiguity, and
    the tile's math would follow it into layout changes through shared memory; an asm load keeps
    each element's words in the thread that owns it."""
    if ASM:
        if NC:
            asm: tl.constexpr = "ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];"
        else:
            asm: tl.constexpr = "ld.global.v4.b32 {$0, $1, $2, $3}, [$4];"
        return tl.inline_asm_elementwise(
            asm=asm,
            constraints="=r,=r,=r,=r,l",
            args=[ptr],
            dtype=(tl.int32,) * 4,
            is_pure=False,
            pack=1,
        )
    return tl.load(ptr), tl.load(ptr + 1), tl.load(ptr + 2), tl.load(ptr + 3)


@triton.jit
def split_halves(word, BF16: tl.constexpr):
    """An int32 holding two 16-bit floats (low half first in memory) as two fp32 tensors: bf16
    widens by a shift and a mask, fp16 through a bitcast and a convert."""
    if BF16:
        return (word << 16).to(tl.float32, bitcast=True), (word & -65536).to(
            tl.float32, bitcast=True
        )
    lo = (word & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    hi = (word >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return lo.to(tl.float32), hi.to(tl.float32)


@triton.jit
def load_scalar(ptr, ASM: tl.constexpr):
    """One 16- or 32-bit float a pointer (group scales and biases), layout-neutral like
    load_words."""
    if ASM:
        ty = ptr.dtype.element_ty
        if ty.primitive_bitwidth == 16:
            v = tl.inline_asm_elementwise(
                asm="ld.global.nc.b16 $0, [$1];",
                constraints="=h,l",
                args=[ptr],
                dtype=tl.int16,
                is_pure=False,
                pack=1,
            )
        else:
            v = tl.inline_asm_elementwise(
                asm="ld.global.nc.b32 $0, [$1];",
                constraints="=r,l",
                args=[ptr],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )
        return v.to(ty, bitcast=True)
    return tl.load(ptr)


@triton.jit
def _half_floats(w, BF16: tl.constexpr):
    # an int32 word of two 16-bit floats -> (low, high) as fp32; a bf16 is the top half of its fp32
    if BF16:
        return (w << 16).to(tl.float32, bitcast=True), (w & -65536).to(tl.float32, bitcast=True)
    lo = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def load_x8(x_ptr, first, ASM: tl.constexpr):
    """x[first + i] for i < 8 as eight fp32 tensors (first a multiple of 8 at each element): one
    16-byte load for bf16/fp16 x, two for fp32. Under the interpreter, eight plain loads."""
    if not ASM:
        return (
            tl.load(x_ptr + first).to(tl.float32),
            tl.load(x_ptr + first + 1).to(tl.float32),
            tl.load(x_ptr + first + 2).to(tl.float32),
            tl.load(x_ptr + first + 3).to(tl.float32),
            tl.load(x_ptr + first + 4).to(tl.float32),
            tl.load(x_ptr + first + 5).to(tl.float32),
            tl.load(x_ptr + first + 6).to(tl.float32),
            tl.load(x_ptr + first + 7).to(tl.float32),
        )
    words = (x_ptr + first).to(tl.pointer_type(tl.int32))
    a, b, c, d = load_words(words, ASM, False)
    if x_ptr.dtype.element_ty == tl.float32:
        e, f, g, h = load_words(words + 4, ASM, False)
        return (
            a.to(tl.float32, bitcast=True),
            b.to(tl.float32, bitcast=True),
            c.to(tl.float32, bitcast=True),
            d.to(tl.float32, bitcast=True),
            e.to(tl.float32, bitcast=True),
            f.to(tl.float32, bitcast=True),
            g.to(tl.float32, bitcast=True),
            h.to(tl.float32, bitcast=True),
        )
    BF16: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
    x0, x1 = _half_floats(a, BF16)
    x2, x3 = _half_floats(b, BF16)
    x4, x5 = _half_floats(c, BF16)
    x6, x7 = _half_floats(d, BF16)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def sum8(x):
    return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]))


# -- int16 x and integer dot products (bf16/fp16 x) ---------------------------------------------
# A group's 32 values of x become int16 q = rint(x / xs), xs = max|x| / 32767 (an error of at
# most xs / 2 = 1.5e-5 of the group's largest value, far under x's own bf16 rounding), packed two
# to a word; the weights' bytes stay integers, and PTX dp2a multiplies two int16 by two int8 and
# adds both to an int32 in one instruction. A group of one row then costs 16 dp2a and one I2F
# where the fp32 path spends ~3 instructions a weight (bits.py's float tricks and an FFMA); the
# group's quantization is shared by the rows a thread holds.

_MAGIC_ROUND = tl.constexpr(12582912.0)  # 1.5 * 2**23: x + this holds rint(x) in its low bits


@triton.jit
def _x16(v, inv):
    # rint(v * inv) in the low 16 bits of an int32 (|v * inv| <= 32767)
    return (v * inv + _MAGIC_ROUND).to(tl.int32, bitcast=True) & 0xFFFF


@triton.jit
def quant_x16(x_ptr, first, NIBBLES: tl.constexpr, ASM: tl.constexpr):
    """x[first + i], i < 32 (first a multiple of 32 at each element), as sixteen int32 words of
    two int16 each, with the scale xs (x ~ xs q) and the fp32 sum of the 32 values. Word p holds
    values (2p, 2p + 1), or with NIBBLES the pairs that dot2 meets in the even and odd nibbles of
    affine4 word c = p // 4: (8c, 8c + 2), (8c + 4, 8c + 6), (8c + 1, 8c + 3), (8c + 5, 8c + 7).
    A NaN or inf in x makes xs NaN, so it reaches the output as NaN instead of vanishing."""
    x = (
        load_x8(x_ptr, first, ASM)
        + load_x8(x_ptr, first + 8, ASM)
        + load_x8(x_ptr, first + 16, ASM)
        + load_x8(x_ptr, first + 24, ASM)
    )
    amax = tl.abs(x[0])
    total = x[0]
    for i in tl.static_range(1, 32):
        amax = tl.maximum(amax, tl.abs(x[i]), propagate_nan=tl.PropagateNan.ALL)
        total += x[i]
    xs = amax * (1.0 / 32767.0)
    xs = tl.where(amax == float("inf"), float("nan"), xs)
    inv = tl.where(amax > 0, 32767.0 / amax, 0.0)
    inv = tl.where(amax == float("inf"), 0.0, inv)
    words = ()
    for p in tl.static_range(16):
        if NIBBLES:
            words = words + (_x16_pair(x, inv, 8 * (p // 4) + 4 * (p % 2) + (p % 4) // 2, 2),)
        else:
            words = words + (_x16_pair(x, inv, 2 * p, 1),)
    return words, xs, total


@triton.jit
def _x16_pair(x, inv, I: tl.constexpr, STEP: tl.constexpr):
    return _x16(x[I], inv) | (_x16(x[I + STEP], inv) << 16)


@triton.jit
def dot2(a, b, acc, HI: tl.constexpr, UNSIGNED: tl.constexpr, ASM: tl.constexpr):
    """acc + a.lo16 * b.byte0 + a.hi16 * b.byte1 (bytes 2 and 3 with HI): PTX dp2a, a's halves
    signed, b's bytes signed or UNSIGNED. Under the interpreter (ASM false), integer ops."""
    if ASM:
        asm: tl.constexpr = (
            f"dp2a.{'hi' if HI else 'lo'}.s32.{'u32' if UNSIGNED else 's32'} $0, $1, $2, $3;"
        )
        return tl.inline_asm_elementwise(
            asm=asm, constraints="=r,r,r,r", args=[a, b, acc], dtype=tl.int32, is_pure=True, pack=1
        )
    if HI:
        b = b >> 16
    if UNSIGNED:
        b0 = b & 0xFF
        b1 = (b >> 8) & 0xFF
    else:
        b0 = (b << 24) >> 24
        b1 = (b << 16) >> 24
    return acc + ((a << 16) >> 16) * b0 + (a >> 16) * b1
