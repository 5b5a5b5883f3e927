# %% [markdown]
# # Kernels: a few rows on the tensor cores
#
# > The matmul for 2-16 rows of x and BF16 weights, int8 ones with a scale a group, or int4 ones with a scale and a minimum (a verify step's 1 + k rows, a decode step of a few sequences), on the tensor cores, split along K in one launch, with the GEMV's folds in its epilogue.

# %%
#| default_exp kernels.rows_matmul

# %%
#| export
import torch

from forge_engine.kernels.backend import (
    INTERPRETED,
    _wait_for_previous,
    kernel_backend,
    pdl_supported,
    split_k_programs,
    tl,
    triton,
)
from forge_engine.kernels.elementwise import _silu_times
from forge_engine.kernels.gemv import (
    _as_f32,
    _nibbles_to_f32,
    _norm_scale,
    check_gemv_folds,
    gemv_folds_reference,
)

# %%
#| hide
import pytest

gen = torch.Generator().manual_seed(9)

# %% [markdown]
# A step of a few rows (a verify step of 1 + 4 tokens, chapter 08c; a decode step of a few
# sequences) reads every weight once, as a one-row step does, so it should cost about what a
# one-row step costs. Sent to cuBLAS it did not: on an H100 the verify step of random Qwen3-4B
# took 1.31x a decode step. Its matmuls read the weights no faster than the one-row GEMV, and
# around them ran what the GEMV folds away: split-K reductions, add + RMSNorm twice a layer,
# SiLU-mul, each a launch of its own (145 matmuls and 289 small launches a step).
#
# This kernel multiplies on the tensor cores and keeps the GEMV's folds (chapter 09's `gemv`:
# `swiglu`, `residual`, `norm_sums`, `hand_off`). Two things make a 16-wide `tl.dot` fit a step
# of 2-16 rows:
#
# - **The weights are the left operand.** `tl.dot` needs at least 16 rows on each side; x has
#   only a few. So a program multiplies its `BLOCK_N` weight rows `[BLOCK_N, BLOCK_K]` by x's rows
#   as columns `[BLOCK_K, 16]` (rows past M read as 0) into `acc [BLOCK_N, 16]`, the output
#   transposed, and stores it back in rows. The padding costs tensor-core work, which a step of a
#   few rows has to spare; the bytes read are the weights' alone.
# - **Split along K in the same launch.** Qwen3-4B's o and down matrices have 2,560 outputs: 80
#   tiles of 32, too few programs for 132 SMs. So each tile's K is split over programs
#   (`split_k_programs`: about four an SM). Each program stores its partial sums; the last of a
#   tile's programs to finish (a ticket a tile, taken with an atomic add) adds the tile's partials
#   in split order, the same sums every time, and runs the epilogue. No second launch, no
#   reduction kernel.
#
# ```
#            K ──────────────────────────────────────────▶
#          ┌──────────────┬──────────────┬──────────────┐
# tile 0   │ program k=0  │ program k=1  │ program k=2  │  BLOCK_N weight rows
#          └──────┬───────┴──────┬───────┴──────┬───────┘
#                 ▼ partials     ▼ partials     ▼ partials (fp32, [split, M, N])
#            ticket += 1 ... the third to arrive sums them, k = 0, 1, 2, and runs the epilogue
#                             (1/rms, bias, SiLU-mul or + residual, the next norm handed on)
# ```
#
# **Launched as a dependent** (Hopper, chapter 09's GEMV tells what it is): a program asks for its
# first weights before it waits for x, and lets the next kernel launch only once its weights are
# read. Letting the next kernel launch at once, as the one-row GEMV does, was slower: the next
# kernel's programs then sit on the SMs waiting while these still stream weights (on an H100 the
# verify step 1.273x against 1.158x; `kernels_lab/folded_rows_matmul.py`'s `LAB_FOLDED_PDL`).
#
# **The tile** (`ROWS_MATMUL_TILE`): 32 weight rows by 128 inputs, 2 warps, 3 stages, launched at
# four programs an SM. Compiled for Hopper, BF16 weights reach `mma.sync` (HMMA) through shared
# memory that `cp.async` (LDGSTS) fills two steps ahead: 80 registers a thread, 96 with the norm
# folded in, 124 for gate-up's SwiGLU pair, no spills (`TRITON_INTERPRET=0 PYTHONPATH=. python3
# kernels_lab/rows_matmul_shapes.py sass`). Tiles were chosen in the whole step, not one matrix
# at a time: the tiles that win a matrix timed alone lose inside the step.
#
# | tile (BLOCK_N, BLOCK_K, warps, stages) | H100, verify 1 + 4 rows ÷ decode step |
# |---|---|
# | 32, 128, 2, 3 | **1.158** |
# | 32, 128, 1, 3 | 1.164 |
# | 32, 128, 4, 3 | 1.173 |
# | 16, 128, 2, 3 | 1.193 |
# | 64, 128, 2, 3 | 1.209 |
# | cuBLAS and the small kernels | 1.310 |
#
# Reproduce: `OUT=DIR bash kernels_lab/folded_rows_checks.sh verify` (random Qwen3-4B).
#
# Chapter 09a sends it every step of 2-16 rows with 2-byte weights (`GEMV_ROWS_BF16`), and those
# steps hand their norms from matmul to matmul. Its split-K tickets belong to the caller: int32
# zeros, which the kernel leaves zero; a decode step takes one zeroed buffer for all its layers
# (one memset a step, as the handed norms' sums).
#
# As the package runs it, on an H100: the verify step of 1 + 4 rows **1.167x** a decode step of
# 3.226 ms (the lab kernel in the same run 1.162x; `LAB_GEMV_ROWS=5 LAB_STEPS_ONLY=1
# LAB_FOLDED=32,128,2,3 LAB_FOLDED_PDL=late PYTHONPATH=. python3 kernels_lab/verify_step.py
# bf16`). Decode steps of several sequences gain too: 2 sequences 3.704 ms against 4.200 with
# their rows on cuBLAS, 16 sequences 4.035 against 4.450 (`LAB_GEMV_ROWS=1 LAB_STEPS_ONLY=1
# LAB_DECODE_ROWS=2,16 ...`, the same file).
#
# **int8 weights with a scale a group of inputs** (`scale`: chapter 10g's planes of a GGUF file's
# Q8_0 and Q6_K blocks) take the same kernel: each tile is loaded as int8 and dequantized in
# registers, times its group's scale broadcast over the group (how, below). Chapter 10g sends a decode step
# of 2-16 sequences on such a file here: on an H100 with every matrix of random Qwen3-4B as Q8_0
# planes, the 16-sequence decode graph takes 3.210 ms against 3.722 through chapter 10g's split-K
# and the separate small kernels (`PYTHONPATH=. python3 kernels_lab/sixteen_seqs_step.py
# export,split`). Its tile there, in one run of the sweep: 32,128,2,3 3.215 ms; 32,256,2,3 3.198;
# 32,128,2,4 3.480; 32,128,4,3 3.537; 64,128,4,3 3.560 (`... sixteen_seqs_step.py
# tile=32/256/2/3,...`). The BF16 tile is kept for both.
#
# **int4 weights with a scale and a minimum a group** (`scale`, `minimum`: chapter 10's layout,
# `Int4Linear`'s, which a GGUF file's Q4_K blocks repack into) take it too: a step's bytes are
# unpacked in registers into q * scale + minimum (how, below), and the low nibbles multiply the
# first half of each group's inputs, the high ones the second half: two products a step. Twice the weights a byte cost twice the
# arithmetic a byte, and the tile that wins is another (`ROWS_MATMUL_INT4_TILE`): on an H100, the
# 16-sequence decode graph of random Qwen3-4B, on one machine (`LAB_PLANES=int4 PYTHONPATH=. python3
# kernels_lab/sixteen_seqs_step.py export,split`; `LAB_PLANES=q4_k` for Q4_K planes, `tile4=BN/BK/W/ST`
# for another int4 tile; `split` is the route before: chapter 10's split-K with the separate small
# kernels):
#
# | layers | `split` | 32, 128, 2, 3 | **64, 128, 4, 3** | S_TG 16 sequences, `split` → 64, 128, 4, 3 |
# |---|---|---|---|---|
# | `--quantization int4` (groups of 128) | 3.287 ms | 3.026 | **2.623** | 4,584 → 6,113 tok/s |
# | Q4_K planes (groups of 32) | 3.940 | 4.013 | **3.334** | 4,048 → 4,686 |
#
# Other int4 tiles on the Q4_K planes: 32,256,2,3 3.794 ms; 128,128,4,3 4.097; 16,256,2,3 5.381;
# 64,128,8,3 5.549. In those runs the tile was every kind's, so the Q8_0 head's matmul took it
# too; as exported the int8 and BF16 weights keep theirs (on Q8_0 planes 64,128,4,3 lost: 3.560 ms
# against 3.215).
#
# **Dequantized through their bits.** At 16 rows the int8 tile went through fewer weights a second
# than the BF16 tile although it reads half the bytes: turning each int8 into a float (through
# fp32's bits, chapter 09's `_as_f32`), times its scale, rounded to bf16 took four instructions and
# a half a weight. For bf16 x the weights are now made bf16 in bf16's own bits, two a register:
#
# - int8 (`_int8_as_bf16`): a PRMT puts each byte under 0x43, the exponent of 128 with bf16's 7
#   mantissa bits; one LOP3 keeps the byte's low 7 bits (128 + (b & 127)), one its sign bit (128,
#   or 256 where b < 0); one bf16x2 FMA takes the second from the first, b exactly (every int8 is a
#   bf16 integer). Then one bf16x2 multiply by the group's scale.
# - int4 (`_nibbles_as_bf16`): each nibble under 0x4300 in one LOP3 a pair (128 + q, exactly), then
#   one bf16x2 subtract of 136 and one bf16x2 FMA, centred: (q - 8) * scale + (minimum + 8 scale).
#
# The scale and minimum are rounded to bf16 before they multiply, so a weight is rounded twice
# where the fp32 path rounds once (within 2% of `dequantized_groups`' product below, 4% for SwiGLU's
# product of two outputs). A rounded scale moves its whole group together. So would a rounded
# minimum, and a Q4_K minimum is about -7.5 scales: rounded as it is, it tripled the product's
# error; centred, the added term is about one scale. Gaussian weights quantized as GGUF stores
# them, 16 rows of bf16 x, the product's error against fp64's (RMS, relative; `PYTHONPATH=.
# python3 kernels_lab/bf16_dequant_error.py`, on a CPU):
#
# | weights | fp32, rounded once (split-K, cuBLAS) | the tile |
# |---|---|---|
# | Q8_0 | 1.66e-3 | 2.32e-3 |
# | Q4_K | 1.66e-3 | 2.51e-3 centred (5.34e-3 with the minimum as stored) |
#
# fp16 x keeps
# the fp32 path: a bf16 weight would lose its small values in fp16. Compiled for sm_90, with groups
# of 32: the int8 loop 326 instructions a step against 402, the int4 loop 378 against 448.
#
# **Programs an SM.** With the conversion cheaper, the int8 launches want more programs in flight
# (`ROWS_MATMUL_INT8_PROGRAMS`: eight an SM, split along K; BF16 and int4 keep
# `split_k_programs`' four). The 16-sequence decode graph of random Qwen3-4B on one H100, graph
# time and S_TG, the exported choice in bold (the bits columns: `LAB_PLANES=q8_0|q4_k PYTHONPATH=.
# python3 kernels_lab/sixteen_seqs_step.py export,programs=4,programs=8,programs=16`; the fp32
# columns are the kernel before it took the bits):
#
# | layers | fp32, 4 an SM | fp32, 8 an SM | bits, 4 an SM | bits, 8 an SM | bits, 16 an SM |
# |---|---|---|---|---|---|
# | Q8_0 planes | 3.133 ms (4,981 tok/s) | 2.955 (5,289) | 3.046 (5,092) | **2.865 (5,330)** | 3.457 (4,536) |
# | Q4_K planes (head Q8_0) | 3.293 (4,690) | | **3.095 (5,098)** | 3.625 (4,342) | |
#
# In the Q4_K runs the Q8_0 head went through the int8 kernel's fp32 path, at the int4 column's
# programs an SM: the exported mix (the head through the bits at eight an SM) was not run. Two
# programs an SM (fp32): 3.338 ms on the Q8_0 planes. At eight an SM the BF16 verify step of 1 + 4
# rows lost as well (1.225x a decode step, against 1.167-1.177x at four).
#
# **One wave for SwiGLU pairs** (`ROWS_MATMUL_INT8_SWIGLU_PROGRAMS`). A program of the int8 gate-up
# launch holds two weight tiles: 168 registers, so six fit an SM, not eight. Aimed at eight, its
# 912 programs ran as 1.15 waves (ncu, `kernels_lab/rows_matmul_shapes.py profile`); aimed at six
# they run as one. The 16-sequence decode graph on Q8_0 planes, one H100, two runs in two calls
# (`LAB_PLANES=q8_0 PYTHONPATH=. python3 kernels_lab/sixteen_seqs_step.py export`, the package
# with SwiGLU at eight, six and four an SM in turn): **2.802-2.803 ms** (S_TG 5,498-5,567 tok/s)
# at six against 2.862 ms (5,426-5,456) at eight and 2.989 ms (5,212) at four. int4 weights keep
# their own four an SM.

# %%
#| export
ROWS_MATMUL_MAX_ROWS = (
    16  # the rows of x a program takes: the narrowest side of a tensor-core product
)
ROWS_MATMUL_TILE = (
    32,
    128,
    2,
    3,
)  # (BLOCK_N, BLOCK_K, warps, stages) for BF16 and int8 weights: the verify step's winner, above
ROWS_MATMUL_INT4_TILE = (
    64,
    128,
    4,
    3,
)  # for int4 weights: the 16-sequence step's winner (below; the same BLOCK_K: a step holds the same groups)
ROWS_MATMUL_INT8_PROGRAMS = (
    8  # an SM, for int8 weights (BF16 and int4: split_k_programs' four); measured below
)
ROWS_MATMUL_INT8_SWIGLU_PROGRAMS = (
    6  # an SM, for int8 SwiGLU pairs: two weight tiles a program, six fit an SM
)


def fits_rows_matmul(x: torch.Tensor, group: int = 0) -> bool:
    """Whether `rows_matmul` takes x: at most ROWS_MATMUL_MAX_ROWS rows of bf16 or fp16; and for weights with a scale
    a `group` of inputs, whether a step holds its groups whole (16 inputs or a multiple that divides the tile's)."""
    whole = group == 0 or _holds_group(group)
    return (
        whole and x.shape[0] <= ROWS_MATMUL_MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)
    )


def _holds_group(group: int) -> bool:
    "Whether a step of the kernel holds whole groups of `group` inputs: 16 or a multiple that divides its BLOCK_K."
    return group % 16 == 0 and ROWS_MATMUL_TILE[1] % group == 0


def rows_matmul_tiles(n: int, swiglu: bool = False, int4: bool = False) -> int:
    "The tiles (and split-K tickets) of a `rows_matmul` over an [n, K] weight (`int4`: int4 pairs): one per BLOCK_N outputs."
    return triton.cdiv(
        n // 2 if swiglu else n, (ROWS_MATMUL_INT4_TILE if int4 else ROWS_MATMUL_TILE)[0]
    )


@triton.jit
def _weight_rows(
    w_ptr,
    scale_ptr,
    min_ptr,
    rows,
    n_ok,
    k0,
    K,
    stride_wn,
    stride_sn,
    stride_sg,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    GROUP: tl.constexpr,
    INT4: tl.constexpr,
):
    """The weight rows `rows` at inputs k0 .. k0 + BLOCK_K as loaded: (w, scale, minimum). w [BLOCK_N, BLOCK_K] (int8
    or x's dtype), or with INT4 its bytes [BLOCK_N, BLOCK_K / 2] (chapter 10's nibbles: byte j of a group holds input j
    in its low nibble, input j + GROUP / 2 in its high one). With GROUP > 0 the scales [BLOCK_N, BLOCK_K / GROUP], one
    a group of GROUP inputs (k0 starts a group), and with INT4 the minimums beside them; else w stands in for both.
    Rows and inputs past the end read 0."""
    width: tl.constexpr = BLOCK_K // 2 if INT4 else BLOCK_K
    offs = (k0 // 2 if INT4 else k0) + tl.arange(0, width)
    mask = n_ok[:, None]
    if not EVEN_K:
        mask = mask & (offs < (K // 2 if INT4 else K))[None, :]
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_wn + offs[None, :], mask=mask, other=0)
    scale, minimum = w, w
    if GROUP > 0:
        offs_g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        at = rows.to(tl.int64)[:, None] * stride_sn + offs_g[None, :] * stride_sg
        g_ok = n_ok[:, None] & (offs_g < K // GROUP)[None, :]
        scale = tl.load(scale_ptr + at, mask=g_ok, other=0.0)
        if INT4:
            minimum = tl.load(min_ptr + at, mask=g_ok, other=0.0)
    return w, scale, minimum


@triton.jit
def _x_columns(x_ptr, offs_k, M, K, stride_xm, ROWS: tl.constexpr, EVEN_K: tl.constexpr):
    "x's rows at inputs offs_k as the columns of a [BLOCK_K, ROWS] tile (rows past M read 0)."
    offs_m = tl.arange(0, ROWS)
    mask = (offs_m < M)[None, :]
    if not EVEN_K:
        mask = mask & (offs_k < K)[:, None]
    return tl.load(x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None], mask=mask, other=0.0)


@triton.jit
def _x_step(
    x_ptr,
    k0,
    M,
    K,
    stride_xm,
    BLOCK_K: tl.constexpr,
    ROWS: tl.constexpr,
    EVEN_K: tl.constexpr,
    GROUP: tl.constexpr,
    INT4: tl.constexpr,
):
    """x's columns for the step at input k0, as a pair: ([BLOCK_K, ROWS] twice), or with INT4 the inputs of the low
    nibbles and those of the high ones ([BLOCK_K / 2, ROWS] each: the first and second half of every group)."""
    if INT4:
        HALF: tl.constexpr = GROUP // 2
        t = tl.arange(0, BLOCK_K // 2)
        low = tl.max_contiguous(tl.multiple_of((t // HALF) * GROUP + t % HALF, HALF), HALF)
        first = _x_columns(x_ptr, k0 + low, M, K, stride_xm, ROWS, EVEN_K)
        second = _x_columns(x_ptr, k0 + HALF + low, M, K, stride_xm, ROWS, EVEN_K)
    else:
        first = _x_columns(x_ptr, k0 + tl.arange(0, BLOCK_K), M, K, stride_xm, ROWS, EVEN_K)
        second = first
    return first, second


@triton.jit
def _per_group(t, EACH: tl.constexpr):
    "t [BLOCK_N, groups] repeated over each group's EACH columns: [BLOCK_N, groups * EACH], in fp32."
    block_n: tl.constexpr = t.shape[0]
    groups: tl.constexpr = t.shape[1]
    return tl.reshape(
        tl.broadcast_to(t.to(tl.float32)[:, :, None], (block_n, groups, EACH)),
        (block_n, groups * EACH),
    )


@triton.jit
def _dot(acc, w, xt, UPCAST: tl.constexpr):
    "acc [BLOCK_N, ROWS] += w [BLOCK_N, BK] @ xt [BK, ROWS] (the interpreter, UPCAST: in float32)."
    if UPCAST:
        return tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(w, xt, acc)


@triton.jit
def _int8_as_bf16(w, BYTE_ASM: tl.constexpr):
    """int8 -> bf16, exactly (every int8 is a bf16 integer), two a register: a PRMT puts each byte under 0x43 (the
    exponent of 128, 7 mantissa bits), one LOP3 keeps its low 7 bits (128 + (b & 127)), one its sign bit (128, or 256
    where b < 0), and one bf16x2 FMA takes the second from the first: b."""
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
    )  # the interpreter: the same bits, as the top half of an fp32
    low = (((b & 0x7F) | 0x4300) << 16).to(tl.float32, bitcast=True)
    sign = (((b & 0x80) | 0x4300) << 16).to(tl.float32, bitcast=True)
    return (low - sign).to(tl.bfloat16)


@triton.jit
def _nibbles_as_bf16(b, BYTE_ASM: tl.constexpr):
    """A uint8 tile -> (128 + low nibble, 128 + high nibble) in bf16, exactly: each nibble under the exponent of 128
    (0x4300), two weights a register; per four bytes two PRMT, two shifts and four LOP3."""
    if BYTE_ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t, u;
            prmt.b32 t, $4, 0, 0x4140;
            prmt.b32 u, $4, 0, 0x4342;
            lop3.b32 $0, t, 0x000F000F, 0x43004300, 0xEA;
            lop3.b32 $1, u, 0x000F000F, 0x43004300, 0xEA;
            shr.b32 t, t, 4;
            shr.b32 u, u, 4;
            lop3.b32 $2, t, 0x000F000F, 0x43004300, 0xEA;
            lop3.b32 $3, u, 0x000F000F, 0x43004300, 0xEA;
            }""",
            constraints="=r,=r,=r,=r,r",
            args=[b],
            dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True,
            pack=4,
        )
    low = (b & 0x0F).to(tl.float32) + 128.0
    high = (b >> 4).to(tl.float32) + 128.0
    return low.to(tl.bfloat16), high.to(tl.bfloat16)


@triton.jit
def _bf16_scaled(v, SHIFT: tl.constexpr, s, m, BYTE_ASM: tl.constexpr):
    """(v - SHIFT) * s, plus m where given, on bf16 tiles in bf16 arithmetic (bf16x2: a pair an instruction); the
    interpreter, which has no bf16 arithmetic, through fp32 (the same values: v - SHIFT and v * s are exact there)."""
    if BYTE_ASM:
        r = (v - SHIFT) * s
        if m is not None:
            r = r + m
    else:
        r = (v.to(tl.float32) - SHIFT) * s.to(tl.float32)
        if m is not None:
            r = r + m.to(tl.float32)
        r = r.to(tl.bfloat16)
    return r


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
    """acc [BLOCK_N, ROWS] += the step's weights @ its x columns `xs` (`_x_step`'s pair). GROUP > 0: w is int8 times
    its `scale` a group; INT4: w is nibbles, each q * scale + minimum, the low nibbles times the first columns, the
    high ones the second. For bf16 x both are made bf16 through their bits and scaled in bf16 (the scale and minimum
    rounded to bf16 first); for fp16 x through fp32, rounded once to fp16 (as chapter 10g's dense path)."""
    x_lo, x_hi = xs
    if INT4:
        HALF: tl.constexpr = GROUP // 2
        if x_lo.dtype == tl.bfloat16:
            lo, hi = _nibbles_as_bf16(w, BYTE_ASM)  # 128 + q, exactly
            # centred: (q - 8) * s + (m + 8 s). A Q4_K minimum is about -7.5 scales, so m rounded to bf16 would
            # move the whole group by 2^-9 of it; m + 8 s is about one scale, and its rounding an eighth as much
            s32 = scale.to(tl.float32)
            s = _per_group(s32, HALF).to(tl.bfloat16)
            m = _per_group(minimum.to(tl.float32) + 8.0 * s32, HALF).to(tl.bfloat16)
            acc = _dot(acc, _bf16_scaled(lo, 136.0, s, m, BYTE_ASM), x_lo, UPCAST)
            acc = _dot(acc, _bf16_scaled(hi, 136.0, s, m, BYTE_ASM), x_hi, UPCAST)
        else:
            lo, hi = _nibbles_to_f32(
                w, BYTE_ASM
            )  # 128 + q (low nibbles), 128 + q / 16 (high ones), exactly
            s, m = scale.to(tl.float32), minimum.to(tl.float32)
            w_lo = lo * _per_group(s, HALF) + _per_group(m - 128.0 * s, HALF)
            acc = _dot(acc, w_lo.to(x_lo.dtype), x_lo, UPCAST)
            w_hi = hi * _per_group(16.0 * s, HALF) + _per_group(m - 2048.0 * s, HALF)
            acc = _dot(acc, w_hi.to(x_hi.dtype), x_hi, UPCAST)
    elif GROUP > 0:
        if x_lo.dtype == tl.bfloat16:
            s = _per_group(scale, GROUP).to(tl.bfloat16)
            acc = _dot(
                acc, _bf16_scaled(_int8_as_bf16(w, BYTE_ASM), 0.0, s, None, BYTE_ASM), x_lo, UPCAST
            )
        else:
            acc = _dot(
                acc, (_as_f32(w, BYTE_ASM) * _per_group(scale, GROUP)).to(x_lo.dtype), x_lo, UPCAST
            )
    else:
        acc = _dot(acc, w, x_lo, UPCAST)
    return acc


@triton.jit
def _rows_epilogue(
    acc,
    acc_up,
    offs_n,
    n_ok,
    M,
    OUT_N,
    K,
    eps,
    b_ptr,
    out_ptr,
    res_ptr,
    stride_rm,
    in_sums_ptr,
    out_sums_ptr,
    next_g_ptr,
    normed_ptr,
    ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
    RESIDUAL: tl.constexpr,
    NORM_SUMS: tl.constexpr,
    HAND_OFF: tl.constexpr,
):
    """A tile's whole sums acc [BLOCK_N, ROWS] (and acc_up, SWIGLU's up rows) through the folds into out [M, OUT_N],
    in `gemv`'s order and roundings: 1 / rms, bias, then SiLU-mul, or the residual and the next norm handed on."""
    offs_m = tl.arange(0, ROWS)
    m_ok = offs_m < M
    mask = n_ok[:, None] & m_ok[None, :]
    at = offs_m[None, :] * OUT_N + offs_n[:, None]  # out's tile, transposed as acc is
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    if NORM_SUMS:
        rstd = _norm_scale(tl.load(in_sums_ptr + offs_m, mask=m_ok, other=1.0), K, eps)
        acc = acc * rstd[None, :]
        acc_up = acc_up * rstd[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        if SWIGLU:
            acc_up += tl.load(b_ptr + OUT_N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    if SWIGLU:  # rounded at each step as the matmul's store and `silu_mul` round them
        gate, up = acc.to(dtype).to(tl.float32), acc_up.to(dtype).to(tl.float32)
        tl.store(out_ptr + at, _silu_times(gate, up, dtype), mask=mask)
    else:
        h = acc
        if RESIDUAL:  # added to the output as rounded, as a separate add would find it
            residual = tl.load(
                res_ptr + offs_m[None, :] * stride_rm + offs_n[:, None], mask=mask, other=0.0
            )
            h = h.to(dtype).to(tl.float32) + residual.to(tl.float32)
        tl.store(out_ptr + at, h.to(dtype), mask=mask)
        if (
            HAND_OFF
        ):  # the next RMSNorm but its 1 / rms: h x its weight, and h's squares into its sums
            h = h.to(dtype).to(tl.float32)
            g = tl.load(next_g_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            tl.store(normed_ptr + at, (h * g[:, None]).to(dtype), mask=mask)
            squares = tl.sum(tl.where(mask, h * h, 0.0), axis=0)
            tl.atomic_add(out_sums_ptr + offs_m, squares, mask=m_ok, sem="relaxed")


@triton.jit
def _sum_splits_if_last(
    acc,
    acc_up,
    partials_ptr,
    tickets_ptr,
    pid_n,
    pid_k,
    offs_n,
    n_ok,
    M,
    OUT_N,
    ROWS: tl.constexpr,
    SPLIT: tl.constexpr,
    SWIGLU: tl.constexpr,
):
    """Split along K (SPLIT > 1): store this program's sums as partials [SPLIT, parts, M, OUT_N] and take the tile's
    ticket; the tile's last program gets (True, the whole sums, added in split order) and leaves the ticket zero, the
    others (False, ...). Unsplit: (True, acc, acc_up)."""
    finish = True
    if SPLIT > 1:
        parts: tl.constexpr = 2 if SWIGLU else 1
        mask = n_ok[:, None] & (tl.arange(0, ROWS) < M)[None, :]
        at = tl.arange(0, ROWS)[None, :] * OUT_N + offs_n[:, None]
        tl.store(partials_ptr + pid_k * parts * M * OUT_N + at, acc, mask=mask)
        if SWIGLU:
            tl.store(partials_ptr + (pid_k * 2 + 1) * M * OUT_N + at, acc_up, mask=mask)
        tl.debug_barrier()  # every thread's partials stored before the ticket is taken
        finish = tl.atomic_add(tickets_ptr + pid_n, 1, sem="acq_rel") == SPLIT - 1
        if finish:
            acc = tl.zeros_like(acc)
            acc_up = tl.zeros_like(acc_up)
            for s in tl.static_range(SPLIT):
                at_s = partials_ptr + s * parts * M * OUT_N + at
                acc += tl.load(at_s, mask=mask, other=0.0, cache_modifier=".cg")
                if SWIGLU:
                    acc_up += tl.load(at_s + M * OUT_N, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(tickets_ptr + pid_n, 0)  # left zero for the next launch
    return finish, acc, acc_up


@triton.jit
def _rows_matmul_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    min_ptr,
    b_ptr,
    partials_ptr,
    tickets_ptr,
    out_ptr,
    res_ptr,
    in_sums_ptr,
    out_sums_ptr,
    next_g_ptr,
    normed_ptr,
    M,
    OUT_N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_sg,
    stride_rm,
    eps,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROWS: tl.constexpr,
    SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
    RESIDUAL: tl.constexpr,
    NORM_SUMS: tl.constexpr,
    HAND_OFF: tl.constexpr,
    GROUP: tl.constexpr,
    INT4: tl.constexpr,
    BYTE_ASM: tl.constexpr,
    UPCAST: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # this program's outputs
    n_ok = offs_n < OUT_N
    up_n = offs_n + OUT_N  # SWIGLU: the up rows, after the gate rows
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    # the first step's weights asked for before waiting for x, which the kernel before writes
    w, scale, minimum = _weight_rows(
        w_ptr, scale_ptr, min_ptr, offs_n, n_ok, k_start, K, stride_wn, stride_sn, stride_sg, BLOCK_K, EVEN_K,
        GROUP, INT4,
    )  # fmt: skip
    w_up, scale_up, minimum_up = w, scale, minimum
    if SWIGLU:
        w_up, scale_up, minimum_up = _weight_rows(
            w_ptr, scale_ptr, min_ptr, up_n, n_ok, k_start, K, stride_wn, stride_sn, stride_sg, BLOCK_K, EVEN_K,
            GROUP, INT4,
        )  # fmt: skip
    _wait_for_previous(PDL)
    xs = _x_step(x_ptr, k_start, M, K, stride_xm, BLOCK_K, ROWS, EVEN_K, GROUP, INT4)
    acc = _times_x(
        tl.zeros([BLOCK_N, ROWS], dtype=tl.float32),
        w,
        scale,
        minimum,
        xs,
        GROUP,
        INT4,
        BYTE_ASM,
        UPCAST,
    )
    acc_up = acc
    if SWIGLU:
        acc_up = _times_x(
            tl.zeros([BLOCK_N, ROWS], dtype=tl.float32), w_up, scale_up, minimum_up, xs, GROUP, INT4, BYTE_ASM,
            UPCAST,
        )  # fmt: skip
    for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
        xs = _x_step(x_ptr, k0, M, K, stride_xm, BLOCK_K, ROWS, EVEN_K, GROUP, INT4)
        w, scale, minimum = _weight_rows(
            w_ptr, scale_ptr, min_ptr, offs_n, n_ok, k0, K, stride_wn, stride_sn, stride_sg, BLOCK_K, EVEN_K,
            GROUP, INT4,
        )  # fmt: skip
        acc = _times_x(acc, w, scale, minimum, xs, GROUP, INT4, BYTE_ASM, UPCAST)
        if SWIGLU:
            w_up, scale_up, minimum_up = _weight_rows(
                w_ptr, scale_ptr, min_ptr, up_n, n_ok, k0, K, stride_wn, stride_sn, stride_sg, BLOCK_K, EVEN_K,
                GROUP, INT4,
            )  # fmt: skip
            acc_up = _times_x(acc_up, w_up, scale_up, minimum_up, xs, GROUP, INT4, BYTE_ASM, UPCAST)
    if (
        PDL
    ):  # this program's weights are read: the next kernel may launch (it waits for our results)
        tl.extra.cuda.gdc_launch_dependents()
    finish, acc, acc_up = _sum_splits_if_last(
        acc,
        acc_up,
        partials_ptr,
        tickets_ptr,
        pid_n,
        pid_k,
        offs_n,
        n_ok,
        M,
        OUT_N,
        ROWS,
        SPLIT,
        SWIGLU,
    )
    if finish:
        _rows_epilogue(
            acc, acc_up, offs_n, n_ok, M, OUT_N, K, eps, b_ptr, out_ptr, res_ptr, stride_rm, in_sums_ptr,
            out_sums_ptr, next_g_ptr, normed_ptr, ROWS, HAS_BIAS, SWIGLU, RESIDUAL, NORM_SUMS, HAND_OFF,
        )  # fmt: skip


# %%
#| export
def _check_rows_operands(
    x, weight, scale, minimum, bias, swiglu, out, tickets, residual, norm_sums, hand_off
):
    "Raise a ValueError that names what of a `rows_matmul` call does not fit."
    int4 = minimum is not None
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] * (2 if int4 else 1):
        want = "weight [N, K / 2] (two int4 weights a byte)" if int4 else "weight [N, K]"
        raise ValueError(
            f"rows_matmul needs x [M, K] and {want}, got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    (m, k), n = x.shape, weight.shape[0]
    if m > ROWS_MATMUL_MAX_ROWS:
        raise ValueError(
            f"rows_matmul takes at most {ROWS_MATMUL_MAX_ROWS} rows, got {m}: use F.linear"
        )
    stored = x.dtype if scale is None else torch.uint8 if int4 else torch.int8
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != stored:
        given = "" if scale is None else " with a scale and a minimum" if int4 else " with a scale"
        raise ValueError(
            f"rows_matmul multiplies bf16 or fp16 x by weights of the same dtype, int8 ones with a scale, or uint8 "
            f"int4 pairs with a scale and a minimum, got {x.dtype} and {weight.dtype}{given}"
        )
    if scale is not None and not _whole_groups(k, n, scale, minimum):
        raise ValueError(
            f"rows_matmul's scale{' and minimum' if int4 else ''} must be [{n}, K / group]"
            f"{' with the same strides' if int4 else ''} for groups of 16 inputs "
            f"or a multiple that divide {ROWS_MATMUL_TILE[1]}, got {tuple(scale.shape)}"
            f"{'' if not int4 else f' and {tuple(minimum.shape)}'} for K = {k}"
        )
    if swiglu and n % 2:
        raise ValueError(
            f"rows_matmul with swiglu needs a [gate | up] weight with an even number of rows, got {n}"
        )
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"rows_matmul's bias must be [{n}], got {tuple(bias.shape)}")
    if out is not None and (
        swiglu or out.shape != (m, n) or out.dtype != x.dtype or not out.is_contiguous()
    ):
        raise ValueError(
            f"rows_matmul's out must be a contiguous {x.dtype} [{m}, {n}] (and no swiglu), got {out.dtype} "
            f"{tuple(out.shape)}{'' if out.is_contiguous() else ' not contiguous'}"
        )
    tiles = rows_matmul_tiles(n, swiglu, int4)
    if tickets is not None and (
        tickets.dtype != torch.int32 or tickets.numel() < tiles or tickets.device != x.device
    ):
        raise ValueError(
            f"rows_matmul's tickets must be int32 zeros on {x.device} with at least {tiles} elements (one a tile), "
            f"got {tickets.dtype} [{tickets.numel()}] on {tickets.device}"
        )
    check_gemv_folds("rows_matmul", x, n, swiglu, residual, norm_sums, hand_off)


def _whole_groups(k: int, n: int, scale: torch.Tensor, minimum: torch.Tensor | None = None) -> bool:
    """Whether `scale` (and `minimum`, with the same strides: two views of chapter 10's `pair_scales`, or each
    contiguous) gives n weight rows of k inputs a value a group of inputs that the kernel's steps hold whole."""
    groups = scale.shape[-1]
    group = k // max(groups, 1)
    return (
        scale.dim() == 2
        and scale.shape[0] == n
        and group * groups == k
        and _holds_group(group)
        and (
            minimum is None or (minimum.shape == scale.shape and minimum.stride() == scale.stride())
        )
    )


def dequantized_groups(
    weight: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    minimum: torch.Tensor | None = None,
) -> torch.Tensor:
    """int8 weights [N, K] times their scale [N, K / group] a group of inputs, in fp32, rounded once to `dtype`. With a
    `minimum` [N, K / group]: chapter 10's int4 pairs [N, K / 2] (`dequantize_int4`), each q * scale + minimum."""
    n, groups = scale.shape
    b = weight.reshape(n, groups, -1)
    if minimum is None:
        w = b.float() * scale.float()[:, :, None]
    else:
        # the codes written into one FP32 buffer, then scaled and shifted in place: no temporaries beside it (7x
        # faster on a CPU than concatenating, converting and scaling into new tensors, the same values)
        half = b.shape[-1]
        w = torch.empty(n, groups, 2 * half, device=weight.device)
        w[..., :half] = b & 0x0F
        w[..., half:] = b >> 4
        w.mul_(scale.float()[..., None]).add_(minimum.float()[..., None])
    return w.reshape(n, -1).to(dtype)


def rows_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    scale: torch.Tensor | None = None,
    minimum: torch.Tensor | None = None,
    swiglu: bool = False,
    residual: torch.Tensor | None = None,
    norm_sums: torch.Tensor | None = None,
    hand_off: tuple[torch.Tensor, torch.Tensor] | None = None,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    tickets: torch.Tensor | None = None,
    split: int | None = None,
    impl: str = "auto",
):
    """x [M, K] (M <= ROWS_MATMUL_MAX_ROWS) @ weight [N, K].T (+ bias), bf16 or fp16, with `gemv`'s folds (`swiglu`,
    `residual`, `norm_sums`, `hand_off`: chapter 09's `gemv` says what each does) -> [M, N], or (h, h x g) with
    hand_off; written into `out` where given (contiguous, x's dtype), else a new tensor. `scale`: weight is int8,
    times scale [N, K / group] a group of inputs (chapter 10g's planes of a GGUF file's Q8_0 and Q6_K blocks),
    dequantized as it is read (`dequantized_groups`' roundings). `scale` and `minimum`: weight is chapter 10's int4
    pairs, uint8 [N, K / 2], each weight q * scale + minimum a group (`Int4Linear`'s, and a GGUF file's Q4_K blocks).
    `tickets`: int32 zeros, at least `rows_matmul_tiles` of them, which the launch leaves zero; a launch split along
    K counts its finished programs on them (default: new zeros, a memset each call). Two launches must not use the
    same tickets at once. `split`: programs along K a tile (default: about `split_k_programs` in all)."""
    _check_rows_operands(
        x, weight, scale, minimum, bias, swiglu, out, tickets, residual, norm_sums, hand_off
    )
    if kernel_backend(x.device, impl) == "torch" or weight.stride(-1) != 1:
        if scale is not None:
            weight = dequantized_groups(weight, scale, x.dtype, minimum)
        return gemv_folds_reference(
            x, weight, bias, swiglu=swiglu, out=out, eps=eps, residual=residual, norm_sums=norm_sums,
            hand_off=hand_off,
        )  # fmt: skip
    int4 = minimum is not None
    block_n, block_k, warps, stages = ROWS_MATMUL_INT4_TILE if int4 else ROWS_MATMUL_TILE
    (m, k), n = x.shape, weight.shape[0]
    out_n = n // 2 if swiglu else n
    out = torch.empty(m, out_n, device=x.device, dtype=x.dtype) if out is None else out
    normed = torch.empty_like(out) if hand_off is not None else out
    if m == 0:
        return (out, normed) if hand_off is not None else out
    x = x if x.stride(-1) == 1 else x.contiguous()
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    tiles, k_steps = rows_matmul_tiles(n, swiglu, int4), triton.cdiv(k, block_k)
    if split is None:
        int8 = scale is not None and not int4
        programs = (
            split_k_programs(
                x.device,
                ROWS_MATMUL_INT8_SWIGLU_PROGRAMS if swiglu else ROWS_MATMUL_INT8_PROGRAMS,
            )
            if int8
            else split_k_programs(x.device)
        )
        split = max(1, min(k_steps, programs // tiles))
    per_split = triton.cdiv(k_steps, max(1, min(split, k_steps)))
    split = triton.cdiv(k_steps, per_split)  # no program without a step
    if split > 1 and tickets is None:
        tickets = torch.zeros(tiles, device=x.device, dtype=torch.int32)
    parts = 2 if swiglu else 1
    partials = torch.empty(
        split * parts * m * out_n if split > 1 else 1, device=x.device, dtype=torch.float32
    )
    pdl = pdl_supported(x.device)
    next_g, out_sums = (out, out) if hand_off is None else hand_off
    scale = weight if scale is None else scale
    minimum = scale if minimum is None else minimum
    _rows_matmul_kernel[(tiles, split)](
        x, weight, scale, minimum, out if bias is None else bias, partials, partials if tickets is None else tickets,
        out, out if residual is None else residual, out if norm_sums is None else norm_sums, out_sums, next_g, normed,
        m, out_n, k, per_split * block_k, x.stride(0), weight.stride(0), scale.stride(0), scale.stride(-1),
        0 if residual is None else residual.stride(0), eps,
        BLOCK_N=block_n, BLOCK_K=block_k, ROWS=ROWS_MATMUL_MAX_ROWS, SPLIT=split, EVEN_K=k % block_k == 0,
        HAS_BIAS=bias is not None, SWIGLU=swiglu, RESIDUAL=residual is not None, NORM_SUMS=norm_sums is not None,
        HAND_OFF=hand_off is not None, GROUP=0 if scale is weight else k // scale.shape[1],
        INT4=int4,
        BYTE_ASM=not INTERPRETED, UPCAST=INTERPRETED, PDL=pdl, launch_pdl=pdl, num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    return (out, normed) if hand_off is not None else out


# %% [markdown]
# Against `gemv`'s PyTorch path with the same folds (`gemv_folds_reference`), under Triton's
# interpreter here: 2-16 rows, K a multiple of the tile and not, split 1, 3 and the default, each
# fold, a bias, `out`. The sums run in another order and bf16 rounds each output, so the outputs
# agree within a few bf16 steps, not bit for bit.

# %%
def close(got, want, what, tolerance=2e-2):
    "Within 2% of the largest output (a few bf16 roundings: the interpreter truncates to bf16 where a GPU rounds)."
    err = (got.float() - want.float()).abs().max().item() / want.float().abs().max().item()
    assert err < tolerance, (what, err)


def operands(m, n, k):
    "x [m, k], a weight [n, k] and a residual [m, n] in bf16, of unit-ish outputs."
    x = torch.randn(m, k, generator=gen).bfloat16()
    return (
        x,
        (torch.randn(n, k, generator=gen) / k**0.5).bfloat16(),
        torch.randn(m, n, generator=gen).bfloat16(),
    )


for m, n, k in ((2, 48, 256), (5, 40, 320), (16, 64, 128)):
    x, w, res = operands(m, n, k)
    bias = torch.randn(n, generator=gen).bfloat16()
    g, sums = torch.rand(n, generator=gen).bfloat16() + 0.5, torch.rand(m, generator=gen) * k + 1
    for split in (1, 3, None):
        case = f"m={m} n={n} k={k} split={split}"
        close(rows_matmul(x, w, impl="triton", split=split), gemv_folds_reference(x, w), case)
        close(
            rows_matmul(x, w, bias, impl="triton", split=split),
            gemv_folds_reference(x, w, bias),
            case + " bias",
        )
        close(
            rows_matmul(x, w, swiglu=True, norm_sums=sums, impl="triton", split=split),
            gemv_folds_reference(x, w, swiglu=True, norm_sums=sums),
            case + " swiglu, norm_sums",
        )
        want_sums, got_sums = torch.zeros(m), torch.zeros(m)
        want = gemv_folds_reference(x, w, residual=res, hand_off=(g, want_sums))
        got = rows_matmul(x, w, residual=res, hand_off=(g, got_sums), impl="triton", split=split)
        for name, a, b in (
            ("h", got[0], want[0]),
            ("h x g", got[1], want[1]),
            ("sums", got_sums, want_sums),
        ):
            close(a, b, f"{case} residual, hand_off: {name}")

# %% [markdown]
# int8 weights with a scale a group of inputs (chapter 10g's planes of a GGUF file: Q8_0's groups
# of 32, Q6_K's of 16) take the same kernel, each tile dequantized in registers as it is read:
# against the same folds on the weights dequantized first (`dequantized_groups`), for bf16 x (the
# weights through bf16's bits) and fp16 x (through fp32).

# %%
for (m, n, k), group in (((2, 48, 256), 32), ((16, 64, 320), 32), ((5, 40, 128), 16)):
    x, _, res = operands(m, n, k)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = (torch.rand(n, k // group, generator=gen) * 2 + 1).half() / (127 * k**0.5)
    w = dequantized_groups(q, scale, torch.bfloat16)
    sums = torch.rand(m, generator=gen) * k + 1
    for split in (1, 3):
        case = f"int8 m={m} n={n} k={k} group={group} split={split}"
        close(
            rows_matmul(x, q, scale=scale, impl="triton", split=split),
            gemv_folds_reference(x, w),
            case,
        )
        close(
            rows_matmul(x, q, scale=scale, swiglu=True, norm_sums=sums, impl="triton", split=split),
            gemv_folds_reference(x, w, swiglu=True, norm_sums=sums),
            case + " swiglu, norm_sums",
            4e-2,  # silu(gate) * up: the product of two outputs, each within 2%
        )
        close(
            rows_matmul(x, q, scale=scale, residual=res, impl="triton", split=split),
            gemv_folds_reference(x, w, residual=res),
            case + " residual",
        )
    assert torch.equal(rows_matmul(x, q, scale=scale, impl="torch"), gemv_folds_reference(x, w))

# %% [markdown]
# Chapter 10's int4 weights (two a byte: byte j of a group holds input j in its low nibble and
# input j + group / 2 in its high one; each weight q * scale + minimum a group) take it too: a
# step's bytes are unpacked by chapter 09's `_nibbles_to_f32`, the low nibbles multiply the first
# half of each group's inputs and the high ones the second half, two products a step. The scales
# and minimums come as `Int4Linear` keeps them, two views of one [N, groups, 2] tensor, or each
# contiguous.

# %%
for (m, n, k), group in (((2, 48, 256), 128), ((16, 64, 320), 32), ((5, 40, 128), 64)):
    x, _, res = operands(m, n, k)
    q = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    pairs = torch.stack(
        (
            torch.rand(n, k // group, generator=gen) + 0.5,
            -8 * torch.rand(n, k // group, generator=gen) - 4,
        ),
        -1,
    ).half() / (16 * k**0.5)
    scale, minimum = pairs[..., 0], pairs[..., 1]
    w = dequantized_groups(q, scale, torch.bfloat16, minimum)
    sums = torch.rand(m, generator=gen) * k + 1
    for split in (1, 3):
        case = f"int4 m={m} n={n} k={k} group={group} split={split}"
        close(
            rows_matmul(x, q, scale=scale, minimum=minimum, impl="triton", split=split),
            gemv_folds_reference(x, w),
            case,
        )
        close(
            rows_matmul(
                x,
                q,
                scale=scale,
                minimum=minimum,
                swiglu=True,
                norm_sums=sums,
                impl="triton",
                split=split,
            ),
            gemv_folds_reference(x, w, swiglu=True, norm_sums=sums),
            case + " swiglu, norm_sums",
            4e-2,  # silu(gate) * up: the product of two outputs, each within 2%
        )
        close(
            rows_matmul(
                x,
                q,
                scale=scale.contiguous(),
                minimum=minimum.contiguous(),
                residual=res,
                impl="triton",
                split=split,
            ),
            gemv_folds_reference(x, w, residual=res),
            case + " residual, contiguous scales",
        )
    assert torch.equal(
        rows_matmul(x, q, scale=scale, minimum=minimum, impl="torch"), gemv_folds_reference(x, w)
    )

# %% [markdown]
# fp16 x takes the fp32 path for both kinds (the weights rounded once, to fp16):

# %%
x = torch.randn(5, 256, generator=gen).half()
q8 = torch.randint(-127, 128, (48, 256), generator=gen, dtype=torch.int8)
scale = (torch.rand(48, 8, generator=gen) + 0.5).half() / (127 * 16)
close(
    rows_matmul(x, q8, scale=scale, impl="triton", split=2),
    gemv_folds_reference(x, dequantized_groups(q8, scale, torch.float16)),
    "int8, fp16 x",
)
q4 = torch.randint(0, 256, (48, 128), generator=gen, dtype=torch.uint8)
minimum = (-8 * scale.float()).half()
close(
    rows_matmul(x, q4, scale=scale, minimum=minimum, impl="triton", split=2),
    gemv_folds_reference(x, dequantized_groups(q4, scale, torch.float16, minimum)),
    "int4, fp16 x",
)

# %% [markdown]
# A launch split along K leaves its tickets zero, so a caller's buffer serves launch after launch;
# `out` takes the result in place; and what does not fit is named.

# %%
x, w, _ = operands(4, 64, 512)
tickets = torch.zeros(rows_matmul_tiles(64), dtype=torch.int32)
into = torch.full((4, 64), float("nan")).bfloat16()
for _ in range(2):
    assert rows_matmul(x, w, tickets=tickets, split=4, out=into, impl="triton") is into
    assert not tickets.any()
    close(into, gemv_folds_reference(x, w), "out, tickets")
assert torch.equal(rows_matmul(x, w, impl="torch"), gemv_folds_reference(x, w))
for call, message in (
    (lambda: rows_matmul(torch.randn(17, 512).bfloat16(), w), "at most 16 rows, got 17"),
    (lambda: rows_matmul(x.float(), w.float()), "bf16 or fp16 x"),
    (lambda: rows_matmul(x, w.to(torch.int8)), "int8 ones with a scale, or uint8 int4 pairs"),
    (
        lambda: rows_matmul(x, w.to(torch.int8), scale=torch.ones(64, 3).half()),
        r"scale must be \[64, K / group\]",
    ),
    (
        lambda: rows_matmul(
            x, w.to(torch.uint8), scale=torch.ones(64, 4).half(), minimum=torch.ones(64, 4).half()
        ),
        r"weight \[N, K / 2\] \(two int4 weights a byte\)",
    ),
    (
        lambda: rows_matmul(
            x,
            w[:, :256].to(torch.uint8),
            scale=torch.ones(64, 4).half(),
            minimum=torch.ones(64, 2).half(),
        ),
        r"scale and minimum must be \[64, K / group\]",
    ),
    (
        lambda: rows_matmul(
            x,
            w[:, :256].to(torch.uint8),
            scale=torch.ones(64, 4).half(),
            minimum=torch.ones(4, 64).half().t(),
        ),
        r"\[64, K / group\] with the same strides",
    ),
    (lambda: rows_matmul(x, w, tickets=torch.zeros(1, dtype=torch.int32)), r"at least 2 elements"),
    (lambda: rows_matmul(x, w[:63], swiglu=True), "even number of rows"),
    (
        lambda: rows_matmul(x, w, residual=torch.zeros(4, 63).bfloat16()),
        r"residual must be \[4, 64\]",
    ),
):
    with pytest.raises(ValueError, match=message):
        call()
