"""The int4 GEMV's arithmetic in integers: nibbles as bytes, x as 16-bit integers, `dp2a` (chapter 10's
`_int4_step_integers`, `INT4_INT_DOT`, on).

Why: chapter 10's int4 GEMV in FP32 is bound by its instructions (~3.6-4.1 a weight: a LOP3 and 3/8 of a shift to make
a float of each nibble, an FFMA to multiply-add it, the rest per chunk), not by its bytes: the gate-up read at ~2 TB/s.
`int4_step_bounds.py` found the unpacking alone worth ~125 µs of the 1.42 ms step. Integers need less of both:
- a weight word's eight nibbles become two words of four bytes with three instructions (w & 0x0F0F0F0F, and the same
  of w >> 4): 3/8 of an instruction a weight, against 11/8;
- `dp2a.lo/hi.s32.u32` multiplies two of those bytes by two 16-bit integers and adds both to an int32: half an
  instruction a weight, against one FFMA.
x must then be 16-bit integers. Each thread scales its step's 2 x CHUNK inputs by one power of two (2^(13 - e), 2^e
the largest power of two at most max |x|: |m| < 2^14, each input within max |x| / 2^14, far finer than int4's own
steps), rounds them with one FFMA (adding 1.5 x 2^23 leaves the integer in the low bits of the float) and pairs them
with a PRMT, once for all the program's rows (8 for the gate-up, 4 for the others). A row's int32 sum for the step
(|.| < 16 x 15 x 2^14 < 2^22) becomes a float by the same trick backwards, then scale x 2^(e - 13), and the minimum
times the exact Σx, as in FP32. Compiled offline (`gemv_sass.py`'s `int4_loop`): 2.73 instructions a weight against
3.77 (gate-up's 8 x 1 x 8), 3.45 against 4.09 (qkv's 4 x 2 x 8), 2.88 against 3.56 (o / down's 4 x 4 x 16; its
16-byte chunks taken as two 8-byte tiles: in one tile of 16 bf16 inputs Triton lays x over two threads and moved
the weights through shared memory every step).

Measured (one H200, on chapter 10's kernel patched to the same arithmetic):
relative error against the dequantized matmul 3.42e-3 (FP32: 3.37e-3; bf16 outputs); chain of 36 (µs a matrix, FP32
-> integers) qkv 5.74 -> 4.93, o 3.73 -> 3.88, gate-up 12.04 -> 9.90, down 7.91 -> 7.00; the int4 decode step
1.420 / 1.417 / 1.420 / 1.419 -> 1.250 / 1.248 / 1.249 / 1.249 ms.

Variants (each in its own process, as `int4_step_bounds.py`):
  floats    chapter 10's int4 GEMV in FP32 (`INT4_INT_DOT` off)
  integers  in integers (the default)
Each first checks the GEMV against the dequantized matmul (plain, SiLU-mul, with a residual; every Qwen3-4B shape),
then prints the chain of 36 GEMVs of each shape (µs a matrix) and random:qwen3-4b's batch-1 int4 decode step (ms).
Run on a GPU from kernels_lab/: PYTHONPATH=..:. python3 int4_dp2a.py [floats,integers,floats,integers]"""

import forge_engine.quant.gemv as quant
from forge_engine.quant.formats import dequantize_int4, quantize_int4
from int4_step_bounds import main, measure

VARIANTS = ("floats", "integers", "floats", "integers")


def patch(variant: str):
    "Chapter 10's int4 GEMV in FP32 (`floats`) or integers (`integers`) for this process."
    if variant not in VARIANTS:
        raise ValueError(f"int4_dp2a.py's variants are floats and integers, got {variant!r}")
    quant.INT4_INT_DOT = variant == "integers"


def validate(variant: str):
    "The int4 GEMV against the dequantized matmul: every Qwen3-4B shape, plain, SiLU-mul, with a residual."
    import torch
    from gemv_chain_sweep import SHAPES

    gen = torch.Generator(device="cuda").manual_seed(0)
    worst = 0.0
    for label, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
        x = (
            torch.randn(1, k, device="cuda", generator=gen)
            * torch.rand(1, k, device="cuda", generator=gen)
            * 3
        ).bfloat16()
        packed = quantize_int4(w)
        want = x.float() @ dequantize_int4(*packed).T
        residual = torch.randn(1, n, device="cuda", generator=gen).bfloat16()
        gate, up = want[:, : n // 2], want[:, n // 2 :]
        for what, got, ref in (
            ("plain", quant.int4_gemv(x, *packed), want),
            (
                "SiLU-mul",
                quant.int4_gemv(x, *packed, swiglu=True),
                torch.nn.functional.silu(gate) * up,
            ),
            ("residual", quant.int4_gemv(x, *packed, residual=residual), want + residual.float()),
        ):
            err = ((got.float() - ref).norm() / ref.norm()).item()
            worst = max(worst, err)
            assert err < 1e-2, f"{variant} {label} {what}: relative error {err:.2e}"
    print(
        f"{variant:12s} valid: worst relative error {worst:.2e} (plain, SiLU-mul, residual; 4 shapes)",
        flush=True,
    )


def run(variant: str):
    patch(variant)
    validate(variant)
    measure(variant)


if __name__ == "__main__":
    main(__file__, run, VARIANTS, 170)
