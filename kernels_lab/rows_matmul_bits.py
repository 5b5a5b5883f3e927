"""int8 and int4 weights made bf16 through their bits in `rows_matmul` (chapter 09_kernels_rows_matmul), for the
16-sequence step on Q8_0 and Q4_K planes: is the dequantization what holds the quantized tiles back?

Napkin math: on an H100 the 16-row int8 `rows_matmul` takes Qwen3-4B's Q8_0 planes (4.28 G weights) in ~2.57 ms, 1.67 G
weights a millisecond, while the BF16 kernel at 16 rows takes 8.05 G weights in ~3.5 ms, 2.3 G a millisecond: the int8
tiles go through fewer weights a second than the BF16 ones although they read half the bytes. The export turns each
int8 weight into a bf16 by four instructions and a half (compiled for sm_90: a PRMT to put the byte under 2^23's
exponent, an FADD to take 2^23 + 128 off, an FMUL by the group's scale, half an F2FP to round two to bf16, a quarter of
an XOR).

int8 (`int8_bits`): each weight is made bf16 exactly in its own bits, two a 32-bit register: a PRMT puts bytes b0, b1
under 0x43 (bf16 128, 7 mantissa bits), one LOP3 keeps their low 7 bits (A = 128 + (b & 127)), one keeps their sign
bit (C = 128, or 256 where b < 0: 0x4380), and one bf16x2 FMA makes A - C = b exactly (int8 values are bf16
integers). Then one bf16x2 multiply by the group's scale (rounded to bf16 first: two roundings where the export has
one). Two and a half instructions a weight. Compiled for sm_90 offline (chapter 09's tile, 32 x 128 at 2 warps, Q8_0's
groups of 32): the loop 329 instructions against the export's 406 (the conversion's 163 against 243: no FADD, FMUL or
F2FP left), 122 registers.

int4 (`int4_bits`): the export makes each weight 128 + q in fp32 (one LOP3, chapter 09's `_nibbles_to_f32`), then
q * scale + minimum in one FFMA, and half an F2FP to round it to bf16. Here sixteen_rows_swap.py's `_nibbles_as_bf16`
makes 128 + q as bf16 (a LOP3 a pair, with the shifts and permutes about one instruction a weight), one bf16x2 subtract
takes the 128 off (exactly), one bf16x2 FMA makes q * scale + minimum with both rounded to bf16 first (the export
rounds once, from fp32). Compiled for sm_90 offline in int4's tile (64 x 128 at 4 warps): the loop 379 instructions
against the export's 448 with groups of 32 (96 registers against 128), 355 against 414 with groups of 128.

Neither is timed yet. `use_bits(int8, int4)` swaps chapter 09's `_times_x` for this module's in the process (before
its kernel first compiles); under the interpreter the bits are made by Triton's integer ops instead of PTX. Checked
here against `rows_matmul(impl='torch')`:
    TRITON_INTERPRET=1 PYTHONPATH=.:kernels_lab python3 kernels_lab/rows_matmul_bits.py
and the step on a GPU, each first in its process: PYTHONPATH=. python3 kernels_lab/sixteen_seqs_step.py int8_bits
(with LAB_PLANES=q4_k: int4_bits)"""

import torch

import forge_engine.kernels.rows_matmul as rows_matmul
from forge_engine.kernels.backend import tl, triton
from sixteen_rows_swap import _nibbles_as_bf16


@triton.jit
def _int8_to_bf16(w, BYTE_ASM: tl.constexpr):
    "int8 -> bf16, exactly: (0x4300 | (b & 0x7F)) - (0x4300 | (b & 0x80)), 128 + (b & 127) - (128 or 256)."
    if BYTE_ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 r, a, c, n;
            mov.b32 n, 0xBF80BF80;
            prmt.b32 r, $2, 0x43434343, 0x4140;
            and.b32 a, r, 0xFF7FFF7F;
            and.b32 c, r, 0xFF80FF80;
            fma.rn.bf16x2 $0, c, n, a;
            prmt.b32 r, $2, 0x43434343, 0x4342;
            and.b32 a, r, 0xFF7FFF7F;
            and.b32 c, r, 0xFF80FF80;
            fma.rn.bf16x2 $1, c, n, a;
            }""",
            constraints="=r,=r,r",
            args=[w],
            dtype=tl.bfloat16,
            is_pure=True,
            pack=4,
        )
    b = w.to(tl.uint8, bitcast=True).to(
        tl.int32
    )  # (the same bits as the upper half of an fp32: the interpreter)
    a = (((b & 0x7F) | 0x4300) << 16).to(tl.float32, bitcast=True)
    c = (((b & 0x80) | 0x4300) << 16).to(tl.float32, bitcast=True)
    return (a - c).to(tl.bfloat16)


INT8_BITS, INT4_BITS = (
    tl.constexpr(True),
    tl.constexpr(True),
)  # which tiles `_times_x` makes through their bits


@triton.jit
def _times_x(
    acc,
    w,
    scale,
    minimum,
    xs,
    GROUP: tl.constexpr,
    INT4: tl.constexpr,
    BYTE_ASM: tl.constexpr,
    UPCAST: tl.constexpr,
):
    "chapter 09's `_times_x`, with int8 (INT8_BITS) and / or int4 (INT4_BITS) tiles made bf16 through their bits."
    x_lo, x_hi = xs
    if INT4 and INT4_BITS:
        HALF: tl.constexpr = GROUP // 2
        s = rows_matmul._per_group(scale, HALF).to(tl.bfloat16)
        m = rows_matmul._per_group(minimum, HALF).to(tl.bfloat16)
        lo, hi = _nibbles_as_bf16(w, BYTE_ASM)  # 128 + q, exactly
        if BYTE_ASM:
            w_lo = (lo - 128.0) * s + m  # one bf16x2 subtract and one FMA a pair
            w_hi = (hi - 128.0) * s + m
        else:  # the interpreter has no bf16 arithmetic: through fp32 (the same values to a rounding)
            w_lo = ((lo - 128.0) * s.to(tl.float32) + m.to(tl.float32)).to(tl.bfloat16)
            w_hi = ((hi - 128.0) * s.to(tl.float32) + m.to(tl.float32)).to(tl.bfloat16)
        acc = rows_matmul._dot(acc, w_lo.to(x_lo.dtype), x_lo, UPCAST)
        acc = rows_matmul._dot(acc, w_hi.to(x_hi.dtype), x_hi, UPCAST)
    elif GROUP > 0 and not INT4 and INT8_BITS:
        s = rows_matmul._per_group(scale, GROUP).to(tl.bfloat16)
        if BYTE_ASM:
            w = _int8_to_bf16(w, BYTE_ASM) * s  # one bf16x2 multiply a pair
        else:  # the interpreter has no bf16 arithmetic: the same two roundings through fp32
            w = (_int8_to_bf16(w, BYTE_ASM).to(tl.float32) * s.to(tl.float32)).to(tl.bfloat16)
        acc = rows_matmul._dot(acc, w.to(x_lo.dtype), x_lo, UPCAST)
    else:
        acc = _times_x_export(acc, w, scale, minimum, xs, GROUP, INT4, BYTE_ASM, UPCAST)
    return acc


_times_x_export = rows_matmul._times_x


def use_bits(int8: bool = True, int4: bool = True) -> None:
    "rows_matmul's int8 and / or int4 tiles through this `_times_x` in this process (before its kernel first compiles)."
    global INT8_BITS, INT4_BITS
    INT8_BITS, INT4_BITS = tl.constexpr(int8), tl.constexpr(int4)
    rows_matmul._times_x = _times_x


def check() -> float:
    from forge_engine.kernels.rows_matmul import rows_matmul as matmul

    gen = torch.Generator().manual_seed(3)
    worst = 0.0
    cases = (
        (2, 48, 256, 32),
        (16, 64, 320, 32),
        (5, 40, 128, 16),
        (5, 64, 256, -32),
        (16, 64, 256, -128),
    )
    for m, n, k, group in cases:  # group < 0: int4 pairs, groups of -group
        x = torch.randn(m, k, generator=gen).bfloat16()
        if group > 0:
            q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
            planes = {
                "scale": (torch.rand(n, k // group, generator=gen) + 0.5).half() / (127 * k**0.5)
            }
        else:
            q = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
            spread = (torch.rand(n, k // -group, generator=gen) + 0.5) / (8 * k**0.5)
            planes = {"scale": spread.half(), "minimum": (-7.5 * spread).half()}
        want = matmul(x, q, **planes, impl="torch").float()
        got = matmul(x, q, **planes, impl="triton", split=2).float()
        err = ((got - want).abs().max() / want.abs().max()).item()
        worst = err if err != err else max(worst, err)  # (a NaN stays)
    return worst


if __name__ == "__main__":
    use_bits()
    print(
        f"int8 and int4 tiles through their bits: within {check():.1e} of rows_matmul's reference (2e-2 allowed)"
    )
