"""The int4 GEMV in integers (chapter 10's `_int4_step_integers`): what its x conversion and its nibble arithmetic cost
in the decode step. Bounds, not kernels: variants that compute wrong values with the same loads.

Why: `int4_gemv_bound.py` ran each shape's chain of 36 int4 GEMVs with its weights in L2 instead of DRAM
and gained only 7-19% (gate-up 9.16 -> 7.43 µs, 3.56 TB/s from L2): the int4 GEMV is held by its SM, not by DRAM
latency. At ~2.7 instructions a weight the gate-up's 50 M weights are ~4 M warp instructions, ~4 µs of an H200's
issue at its best. So instructions a weight are what to cut, and these bounds say where they are.

Variants (each in its own process: a jitted function's globals are fixed once it compiles):
  int          chapter 10's kernel
  no-x         x's words taken as the 16-bit pairs: no conversion, no sum, no scale (wrong values)
  no-dot       one dp2a a word, no nibbles split (wrong values)
  no-wait      the int4 GEMVs never wait for the kernel before (`int4_step_bounds.py`'s, in integers; wrong values)
Each prints the relative error of each Qwen3-4B shape's GEMV against the dequantized matmul, the chain of 36 GEMVs a
shape (µs a matrix) and random:qwen3-4b's batch-1 int4 decode step (graph replay, ms; twice).
Measured (one H200, on chapter 10's kernel before the two changes below): step 1.220 / 1.220 ms; no-x 1.151 / 1.149;
no-dot 1.149 / 1.148. Two real variants, both in chapter 10: the high nibbles used in place ("lean") 1.210 / 1.209,
and with x's sum by dp2a 1.202 / 1.199 (relative error qkv 1.66e-3 -> 1.71e-3, o 1.61e-3 -> 2.05e-3, gate-up 1.67e-3
-> 1.72e-3, down 1.62e-3 -> 2.06e-3).
Run on a GPU from kernels_lab/: PYTHONPATH=..:. python3 int4_int_bounds.py [variant[,variant...]]"""

import forge_engine.quant.gemv as quant  # first: on a CPU it switches on the interpreter, which must precede `import triton`
import triton
import triton.language as tl
from forge_engine.quant.formats import dequantize_int4
from forge_engine.quant.gemv import _x_chunk

from int4_step_bounds import main, measure, no_wait

VARIANTS = ("int", "no-x", "no-dot", "no-wait", "int")


@triton.jit
def one_dp2a(w, lo01, lo23, hi01, hi23, IN_PLACE: tl.constexpr, BYTE_ASM: tl.constexpr):
    return tl.inline_asm_elementwise(
        asm="dp2a.lo.s32.u32 $0, $2, $1, 0;",
        constraints="=r,r,r",
        args=[w, lo01],
        dtype=tl.int32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def x_words_as_pairs(
    x_ptr,
    b0,
    lane,
    M,
    K,
    ROWS: tl.constexpr,
    GROUP: tl.constexpr,
    CHUNK: tl.constexpr,
    EVEN: tl.constexpr,
    IN_PLACE: tl.constexpr,
    BYTE_ASM: tl.constexpr,
):
    "chapter 10's `_x_integers` without the work: x's words taken as its pairs (the same loads), 1, no sum"
    HALF: tl.constexpr = GROUP // 2
    c_ok, x_first = _x_chunk(b0, lane, K, GROUP, CHUNK, EVEN)
    xs = ()
    for m in tl.static_range(ROWS):
        x_ok = c_ok[:, :, None] & ((m < M) | EVEN)
        pairs = ()
        for h in tl.static_range(CHUNK // 8):
            at = (
                x_ptr.to(tl.pointer_type(tl.int32))
                + (m * K + x_first[:, :, None] + 8 * h) // 2
                + tl.arange(0, 4)[None, None, :]
            )
            lo = tl.load(at, mask=x_ok, other=0)
            hi = tl.load(at + HALF // 2, mask=x_ok, other=0)
            pairs = pairs + (
                tl.split(tl.reshape(lo, (lo.shape[0], 32, 2, 2)))
                + tl.split(tl.reshape(hi, (hi.shape[0], 32, 2, 2))),
            )
        xs = xs + ((pairs, 1.0, tl.zeros_like(c_ok.to(tl.float32))),)
    return xs


def relative_errors() -> str:
    "Each Qwen3-4B shape's int4 GEMV (one row of x) against the dequantized matmul: |out - ref| / |ref|."
    import torch
    import torch.nn.functional as F
    from common import DEVICE
    from gemv_chain_sweep import SHAPES, weights

    torch.manual_seed(0)
    errors = []
    for name, (n, k) in SHAPES.items():
        w = weights("int4", n, k)
        x = torch.randn(1, k, device=DEVICE).bfloat16()
        ref = F.linear(x.float(), dequantize_int4(*w))
        out = quant.int4_gemv(x, *w).float()
        errors.append(f"{name} {((out - ref).norm() / ref.norm()).item():.3e}")
    return "error " + " ".join(errors)


def patch(variant: str):
    "The kernel's pieces replaced for this process, before anything compiles."
    if variant == "no-x":
        quant._x_integers = x_words_as_pairs
    if variant == "no-dot":
        quant._nibbles_dot = one_dp2a
    if variant == "no-wait":
        quant._wait_for_previous = no_wait


def run(variant: str):
    patch(variant)
    print(f"{variant:12s} {relative_errors()}", flush=True)
    measure(variant)


if __name__ == "__main__":
    main(__file__, run, VARIANTS, 200)
