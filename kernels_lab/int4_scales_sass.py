"""Offline (no GPU): chapter 10's int4 GEMV loop with its group scales / minimums stored group-major ([groups, N]: one
pointer a step for a program's rows, each row an offset from it) against row-major ([N, groups], as chapter 10 stores
them: a 64-bit address a row, scale and minimum). The kernel's `_int4_weights` swapped for the variant below, each
layout compiled in its own process (Triton caches a kernel's dependencies): registers, instructions in the loop, its
loads and integer arithmetic. Not a kernel of the package: the layout would change `Int4Linear`'s buffers (and the
prefill's `int4_matmul`), so it is measured here first.

Compiled (Triton 3.7, sm_90): the gate-up's (8, 1, 8) 475 -> 451 instructions a step (3.71 -> 3.52 a weight),
128 registers either way; (4, 2, 8) 68 -> 64 registers (28 -> 32 warps an SM); (4, 4, 16) 80 -> 72 (24 -> 28 warps).
The 2-byte loads stay 2 a row (not merged into vectors).

Both in the FP32 loop (`int_dot=False`), before chapter 10 stored its row-major scales and minimums in pairs
(`pair_scales`); not compiled against that layout.
Run: PYTHONPATH=. python3 kernels_lab/int4_scales_sass.py row-major|group-major   (TRITON_ALWAYS_COMPILE is set)"""

import os

os.environ["TRITON_ALWAYS_COMPILE"] = "1"
os.environ.setdefault("TRITON_INTERPRET", "0")
import collections
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import triton
import triton.language as tl
import forge_engine.quant.gemv as quant
from forge_engine.kernels.gemv import _program_row
from gemv_sass import int4_loop, resident_warps

ROW_MAJOR = quant._int4_weights
LAYOUT = sys.argv[1] if len(sys.argv) > 1 else "row-major"
if LAYOUT not in ("row-major", "group-major"):
    sys.exit(f"usage: int4_scales_sass.py row-major|group-major, got {LAYOUT!r}")


@triton.jit
def _int4_weights_group_major(
    q_ptr,
    scale_ptr,
    min_ptr,
    b0,
    lane,
    first_col,
    N,
    K,
    stride_qn,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,
    CHUNK: tl.constexpr,
    EVEN: tl.constexpr,
    SWIGLU: tl.constexpr,
    INT_DOT: tl.constexpr,
    PAIRED: tl.constexpr,
):
    "(the FP32 loop's weights: chapter 10's INT_DOT and PAIRED are not taken here)"
    start = tl.multiple_of(b0 + lane * CHUNK, [CHUNK, CHUNK])
    c_ok = (start < K // 2) | EVEN
    g = start // (GROUP // 2)
    s_base, m_base = (
        scale_ptr + g * N,
        min_ptr + g * N,
    )  # the group's row of constants: one pointer a step
    ws = ()
    for r in tl.static_range(BLOCK_N):
        row, row_ok = _program_row(first_col, r, N, BLOCK_N // 2, SWIGLU)
        ok = c_ok & (row_ok | EVEN)
        ws = ws + (
            (
                tl.load(
                    q_ptr
                    + row * stride_qn
                    + start[:, :, None]
                    + tl.arange(0, CHUNK)[None, None, :],
                    mask=ok[:, :, None],
                    other=0,
                ),
                tl.load(s_base + row, mask=ok, other=0.0),
                tl.load(m_base + row, mask=ok, other=0.0),
            ),
        )
    return ws


for tile in ((8, 1, 8), (4, 2, 8), (4, 4, 16), (4, 1, 8)):
    for name, fn in [
        (n, f)
        for n, f in (("row-major", ROW_MAJOR), ("group-major", _int4_weights_group_major))
        if n == LAYOUT
    ]:
        quant._int4_weights = fn
        body, per, regs = int4_loop(*tile, byte_asm=True, early=True, int_dot=False)
        ops = collections.Counter(t.split()[1 if t.startswith("@") else 0] for t in body)
        top = {k: v for k, v in ops.items() if k.startswith(("LDG", "IMAD", "IADD"))}
        print(
            tile,
            f"{name:12s} regs {regs:3d} warps/SM {resident_warps(regs, tile[1]):2d} instr {len(body):3d} "
            f"({len(body) / per:.2f} a weight) {top}",
            flush=True,
        )
