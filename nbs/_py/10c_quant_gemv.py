# %% [markdown]
# # int4 at one to four rows: a GEMV
#
# > A few rows of x against int4 weights in one pass over each weight row (`int4_gemv`), its tiles and its launch; `int4_matmul` sends more rows to the split-K kernel.

# %% [markdown]
# At decode with a small batch the split-K kernel of chapter 10b made Qwen3-4B 2.5 times *slower* than
# BF16 on one H200 (115 tok/s against 300), though it reads a quarter of the bytes. It steps
# through K one group (64 bytes per output row) at a time, reduces every step, writes FP32
# partial sums and launches a second kernel to add them. Chapter 09's `_gemv_kernel` shows what
# reads memory at full speed for a few rows instead: a grid over the output rows only, each
# program streaming its `BLOCK_N` rows over the *whole* of K in wide loads, one launch, nothing
# written but the result.
#
# `_int4_gemv_kernel` is that kernel for packed nibbles. Per group it uses the identity
# `Σ_k x_k (s q_k + m) = s · Σ_k x_k q_k + m · Σ_k x_k`: the nibbles enter the dot product as
# they are, and scale and minimum cost two multiply-adds per group, not one per weight. It starts
# as chapter 09's GEMV does (`_start_gemv`): launched as a programmatic dependent on Hopper, so its
# programs start while the kernel before is finishing.
#
# Why count operations: at 4.19 TB/s an H200 reads 8.4 trillion 4-bit weights a second, and
# its 132 SMs issue about 33 trillion thread-instructions a second: four instructions per
# weight, for everything. A first version held the `[BLOCK_N, GROUPS, GROUP/2]` bytes of whole
# groups per step and summed each group across the threads that held it, every step: compiled
# for an H200 (`kernels_lab/gemv_sass.py`) its loop spent 13 instructions per weight, most of
# them warp shuffles and adds of those sums, and it ran at 0.69 × the BF16 decode speed.
#
# A second version gave each thread **chunks**: 8 bytes of a row, the 16 weights of one group
# that a byte `j` pairs as input `j` (low nibble) and `j + GROUP/2` (high), summed by that thread
# alone, scale and minimum applied per chunk, threads summed once at the end: 5.5 instructions a
# weight, 96 registers, and Qwen3-4B's four matrices of a layer in 47.5 µs on an H200 (1.0-1.3
# TB/s). What it still paid per weight: two byte permutes and an AND to make a float of a nibble,
# and, since a thread held one row's chunk, a conversion and a running sum of the *x* it
# multiplies, repeated for every row.
#
# `_int4_gemv_kernel` now:
#
# - gives a program `BLOCK_N` rows and each thread **the same chunk of every one of them**: x's
#   values are loaded, converted to FP32 and summed once a step for all `BLOCK_N` rows (the rows
#   are a tuple of tensors in the loop, unrolled: one load and one accumulator each);
# - lets a warp cover `32 × CHUNK` contiguous bytes of a row per step, the program's warps taking
#   interleaved slabs of K (summed across warps once, at the end);
# - makes floats of nibbles in 1.4 instructions a weight (`_nibbles_to_f32`). The float 128 is
#   0x43000000, and its mantissa's bit 16 counts ones. A byte sitting in bits 16-23, masked with
#   0x000F0000 and ORed with 0x43000000 (one LOP3), is 128 + its low nibble; a byte in bits 8-15
#   masked with 0x0000F000 is 128 + its high nibble / 16. The word itself has byte 2 in bits 16-23
#   and byte 1 in bits 8-15; shifted left by 8, bytes 1 and 0; right by 8, bytes 3 and 2; rotated
#   by 16, bytes 0 and 3: three shifts and eight LOP3s for eight weights. The offsets come out per
#   chunk with the sums the minimum needs anyway: `Σ x q = Σ x_lo (128 + q) + 16 Σ x_hi (128 + q/16)
#   − 128 Σ x_lo − 2048 Σ x_hi`. (The high nibbles sit 2^11 below their float's 128, so FP32 keeps
#   about 13 of their bits through a chunk's sum: far finer than int4's own steps.)
#
# Compiled offline for an H200 (`kernels_lab/int4_rows.py sass`): 4.1 instructions a weight at 4
# rows and 8-byte chunks (64 registers, 32 warps an SM), 3.6 at 16-byte chunks. In the chain lab
# on an H200 (36 distinct matrices per shape in one CUDA graph, one row) a layer's four matrices
# take **34.4 µs against 47.5**:
#
# | matrix | N × K | rows, warps, chunk bytes | µs a matrix | before (rows 8/4, K-tile, warps) |
# |---|---|---|---|---|
# | qkv | 6144 × 2560 | 4, 2, 8 | 6.93 | 10.30 |
# | o | 2560 × 4096 | 2, 4, 16 (4, 4, 16: 5.68) | 5.52 | 5.79 |
# | gate_up | 19456 × 2560 | 4, 1, 8 | 13.46 | 19.73 |
# | down | 2560 × 9728 | 4, 4, 16 | 8.46 | 11.64 |
#
# As chapter 09's GEMV, each program asks for its first step's weights (bytes, scales, minimums)
# before it waits for x (`early_weights`, `INT4_EARLY_WEIGHTS`; the loop compiles as before, the
# first step peeled): in the chain lab qkv 7.00 → 5.96 µs, o 5.72 → 3.75, gate-up 13.49 → 12.91,
# down 10.30 → 8.08 (a layer 36.5 → 30.7 µs); the decode step 1.851 → 1.770 ms
# (`kernels_lab/decode_overlap.py int4`), W1 522.6 → 545.6 tok/s in one call. On.
#
# Still 1.0-2.0 TB/s: at ~4 instructions a weight the loop needs the SMs' whole issue rate to
# keep up with 4.19 TB/s, so it is bound by its arithmetic and by the latency it cannot hide.
# Issuing the next step's loads before this step's arithmetic (registers double-buffered)
# measured slower (more registers and moves), and so did tensor-core (`mma`) versions in CUDA C++
# (`kernels_lab/int4_mma.py`: slower for every shape but qkv). What won is the same loop in
# integers (next section); the FP32 loop below stays as its reference (`int_dot=False`).

# %%
#| default_exp quant.gemv

# %%
#| export
# Why one module of ~860 lines: it is one kernel, `_int4_gemv_kernel`, with its tiles and its
# launch. Its weight step comes in two forms read side by side, each measured against the other
# below: in FP32 (`_int4_step_floats`, the reference, and the path for packed rows that do not
# start at whole 32-bit words) and in integers (`_int4_step_integers` and its PTX helpers, ~210
# lines), chosen at the launch (`INT4_INT_DOT`, `int_dot=`); the tile rule and register caps
# (`quant_gemv_config`, `INT4_TILE_*`) come from the same measurements, and `int4_gemv` launches
# it. About 260 lines hold one name each: the formatter writes each of the kernel's 31
# parameters, and each launch argument, on a line of its own.
from __future__ import annotations

import torch
import torch.nn.functional as F

from forge_engine.kernels.backend import (
    INTERPRETED,
    _pow2,
    _wait_for_previous,
    kernel_backend,
    pdl_supported,
    tl,
    triton,
)
from forge_engine.kernels.elementwise import _silu_times
from forge_engine.kernels.gemv import (
    _nibbles_to_f32,
    GEMV_MAX_ROWS,
    _norm_scale,
    _program_row,
    _rows_epilogue_operands,
    _start_gemv,
    check_gemv_folds,
    hand_off_operands,
)
from forge_engine.quant.formats import dequantize_int4
from forge_engine.quant.split_k import _int4_matmul_kernel, _skinny_kernel, _skinny_matmul

# %%
#| hide
import pytest
from forge_engine.kernels.elementwise import silu_mul
from forge_engine.quant.formats import int4_group_size, quantize_int4
from forge_engine.quant.split_k import assert_matches, check_kernel


# %%
#| export
@triton.jit
def _x_chunk(b0, lane, K, GROUP: tl.constexpr, CHUNK: tl.constexpr, EVEN: tl.constexpr):
    """For a step at byte b0 of the rows: whether each thread's chunk is inside the row, and the first of x's inputs
    its low nibbles multiply (the high ones': GROUP / 2 further on)."""
    start = tl.multiple_of(b0 + lane * CHUNK, [CHUNK, CHUNK])
    # x's chunk starts at a multiple of CHUNK: said, so it comes in vector loads (one-warp tiles lost that: 2-byte loads)
    return (start < K // 2) | EVEN, tl.multiple_of(
        (start // (GROUP // 2)) * GROUP + start % (GROUP // 2), [CHUNK, CHUNK]
    )


@triton.jit
def _int4_step_floats(
    accs,
    ws,
    x_ptr,
    b0,
    lane,
    M,
    K,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,
    CHUNK: tl.constexpr,
    EVEN: tl.constexpr,
    BYTE_ASM: tl.constexpr,
):
    "`_int4_step` in FP32: nibbles made floats (`_nibbles_to_f32`), multiplied and added one by one."
    HALF: tl.constexpr = (
        GROUP // 2
    )  # bytes per group and row: byte j holds inputs j (low) and j + HALF (high)
    c_ok, x_first = _x_chunk(b0, lane, K, GROUP, CHUNK, EVEN)
    x_at = x_ptr + x_first[:, :, None] + tl.arange(0, CHUNK)[None, None, :]
    xs = ()  # the inputs of the chunk's low nibbles (and + HALF, the high ones), for each row m of x
    for m in tl.static_range(ROWS):
        x_ok = c_ok[:, :, None] & ((m < M) | EVEN)
        x_lo = tl.load(x_at + m * K, mask=x_ok, other=0.0).to(tl.float32)
        x_hi = tl.load(x_at + m * K + HALF, mask=x_ok, other=0.0).to(tl.float32)
        s_lo, s_hi = tl.sum(x_lo, axis=2), tl.sum(x_hi, axis=2)
        xs = xs + ((x_lo, x_hi, 128.0 * s_lo + 2048.0 * s_hi, s_lo + s_hi),)
    new = ()
    for r in tl.static_range(BLOCK_N):
        b, s, mn = ws[r]
        s, mn = s.to(tl.float32), mn.to(tl.float32)
        f_lo, f_hi = _nibbles_to_f32(b, BYTE_ASM)  # 128 + q_lo, 128 + q_hi / 16
        for m in tl.static_range(ROWS):
            x_lo, x_hi, offset, x_sum = xs[m]
            xq = (
                tl.sum(x_lo * f_lo, axis=2) + 16.0 * tl.sum(x_hi * f_hi, axis=2) - offset
            )  # Σ x q in the chunk
            new = new + (accs[r * ROWS + m] + xq * s + x_sum * mn,)
    return new


# %% [markdown]
# ## In integers
#
# Those ~3.8 instructions a weight were the limit: the FP32 loop could not issue fast enough to
# read its bytes (the gate-up at ~2 TB/s), and with its nibbles left unconverted (wrong values,
# the same loads: `kernels_lab/int4_step_bounds.py`) the decode step took 1.305 ms instead of
# 1.429. Integers make both halves of the per-weight work cheaper (`_int4_step_integers`):
#
# - a 32-bit word of eight nibbles becomes two words of four bytes, `w & 0x0F0F0F0F` and
#   `(w >> 4) & 0x0F0F0F0F`: three instructions for eight weights, against eleven;
# - `dp2a` multiplies two bytes by two 16-bit integers and adds both products to an int32: one
#   instruction for two weights, against two FFMAs (`_nibbles_dot`: four per word).
#
# x must then be 16-bit integers. Each thread takes its step's 2 × CHUNK inputs (the low and the
# high nibbles' halves of x), finds the largest power of two 2^e at most their largest magnitude,
# and multiplies them by 2^(13 − e): every value is now under 2^14. Adding 1.5 × 2^23 rounds it to
# an integer that sits in the float's low bits (the float's unit is 1 there), and a PRMT packs the
# low halves of two such floats into one word: the pairs `dp2a` takes (`_int16_pairs`). That is
# done once a step for all the program's rows (8 for the gate-up, 4 for the others). Each input
# keeps 14 bits of its chunk's largest; a row's int32 sum for the chunk (at most 16 × 15 × 2^14 <
# 2^22) becomes a float by the same trick backwards, and is scaled by `s × 2^(e − 13)`; the
# minimum multiplies the exact FP32 `Σx` as before. (A 16-byte chunk has twice the products: its
# inputs are scaled to under 2^13, one bit fewer. Under 2^14 the bound would break: 32
# products of inputs near 2^14 by nibbles of 15 pass 2^22, and the float trick then returns
# garbage; the test below feeds exactly that.)
#
# Compiled offline (`kernels_lab/gemv_sass.py`'s `int4_loop`): 2.73 instructions a weight at the
# gate-up's 8 × 1 × 8 against 3.77, 3.45 at qkv's 4 × 2 × 8 against 4.09, 2.88 at 4 × 4 × 16
# against 3.56. A 16-byte chunk is taken as two 8-byte tiles: in one tile of 16 BF16 inputs Triton
# spread x over two threads and moved the weights through shared memory every step to match.
# Measured on an H200 (`kernels_lab/int4_dp2a.py`, 36-matrix chains, µs a matrix, FP32
# → integers): qkv 5.74 → 4.93, o 3.73 → 3.88, gate-up 12.04 → 9.90, down 7.91 → 7.00; the
# int4 decode step **1.418 → 1.250 ms**; the bench's W1 786.5 / 787.4 tok/s against BF16's 423.0
# (1.86×; FP32: 1.66×). The relative error against the dequantized matmul moved from 3.37e-3 to
# 3.42e-3 (BF16 outputs). `INT4_INT_DOT` (on) or `int_dot=` chooses; packed rows that do not start
# at whole 32-bit words take the FP32 loop.
#
# More instructions come out of the step. In 8-byte chunks (qkv, gate-up) the high
# nibbles are used where they sit, `w & 0xF0F0F0F0` (bytes of 16·q), with the high inputs scaled
# by a further 1/16 to match: two LOP3 and four `dp2a` a word instead of three and four, at the
# price of four bits of the high inputs (10 bits of their chunk's largest; 16-byte chunks would
# keep 9, so they shift). `Σx` is summed from the same 16-bit integers by one `dp2a` a pair
# (bytes (1, 1), or (16, 16) for the high pairs) instead of FP32 adds (`_x_integers`), and BF16 x
# is read as 32-bit words whose halves become floats by a shift and a mask (`_x_as_floats`).
# `Int4Linear` also keeps each group's scale and minimum side by side (`pair_scales`), so a row's
# pair is one 4-byte load.
#
# Why instructions: with each shape's chain of 36 int4 GEMVs reading one matrix from L2 instead
# of 36 from DRAM, the GEMVs gained only 7-19% (the gate-up 9.16 → 7.43 µs: 3.56 TB/s from L2;
# `kernels_lab/int4_gemv_bound.py`), so the SM, not DRAM latency, held them; and with x's
# conversion left out, or the nibbles' split (bounds with wrong values,
# `kernels_lab/int4_int_bounds.py`), the decode step took ~1.15 ms against 1.22. Offline the
# gate-up's loop went from 350 to 319 instructions a step (2.73 → 2.49 a weight). Measured on an
# H200 (`bash kernels_lab/w1_checks.sh ab`, this kernel against one without these changes, each
# in its own process): the int4 decode step **1.223 / 1.225 / 1.223 / 1.224 → 1.182 / 1.179 ms**;
# the bench's W1 834.9 / 834.3 tok/s against BF16's 419.4 in the same call (1.99×; without them:
# 807.5, 1.93×). The relative error against the dequantized matmul (one row, BF16, random
# weights): qkv 1.66e-3 → 1.71e-3, gate-up 1.67e-3 → 1.72e-3.

# %%
#| export
ROUND_TO_INTEGER = tl.constexpr(
    1.5 * 2**23
)  # v + this (|v| < 2^22) holds v rounded to an integer in its low bits


@triton.jit
def _x_as_floats(x_ptr, first, ok):
    """x's 8 inputs from `first` [SLABS, 32, 1] (a multiple of 8) as FP32 halves (inputs 0, 2, 4, 6; inputs 1, 3, 5,
    7), each [SLABS, 32, 4]. BF16 x comes as 32-bit words whose halves a shift and a mask make floats (Triton's own
    conversion spent a PRMT and a shift on each high half)."""
    if x_ptr.dtype.element_ty == tl.bfloat16:
        at = tl.multiple_of(first // 2, [4, 4, 4]) + tl.arange(0, 4)[None, None, :]
        words = tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + at, mask=ok, other=0)
        return (words << 16).to(tl.float32, bitcast=True), (words & -65536).to(
            tl.float32, bitcast=True
        )
    x = tl.load(x_ptr + first + tl.arange(0, 8)[None, None, :], mask=ok, other=0.0).to(tl.float32)
    return tl.split(tl.reshape(x, (x.shape[0], 32, 4, 2)))


@triton.jit
def _int16_pairs(even, odd, scale, BYTE_ASM: tl.constexpr):
    """x's halves (`_x_as_floats`) times scale [SLABS, 32], rounded to integers, as 16-bit pairs in 32-bit words:
    (inputs 4i and 4i + 1, inputs 4i + 2 and 4i + 3), each [SLABS, 32, 2]."""
    even = (even * scale[:, :, None] + ROUND_TO_INTEGER).to(
        tl.int32, bitcast=True
    )  # the integer in the low 16 bits
    odd = (odd * scale[:, :, None] + ROUND_TO_INTEGER).to(tl.int32, bitcast=True)
    if BYTE_ASM:  # one PRMT: the low halves of both
        pairs = tl.inline_asm_elementwise(
            asm="prmt.b32 $0, $1, $2, 0x5410;",
            constraints="=r,r,r",
            args=[even, odd],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    else:
        pairs = (even & 0xFFFF) | (odd << 16)
    return tl.split(tl.reshape(pairs, (pairs.shape[0], 32, 2, 2)))


@triton.jit
def _pairs_sum(pair, SIXTEEN: tl.constexpr, BYTE_ASM: tl.constexpr):
    "A word's two int16 added (SIXTEEN: each times 16), by one dp2a with the bytes (1, 1) or (16, 16)."
    ones = tl.full(
        pair.shape, 4112 if SIXTEEN else 257, tl.int32
    )  # (ptxas takes the constant as an immediate)
    if BYTE_ASM:
        return tl.inline_asm_elementwise(
            asm="dp2a.lo.s32.u32 $0, $1, $2, 0;",
            constraints="=r,r,r",
            args=[pair, ones],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    return _pair_dot(pair, ones)


# a word's nibbles as two words of bytes (the high ones shifted down, or IN_PLACE as bytes of 16 q), then four dp2a
# (two bytes times two int16, added): `_nibbles_dot`'s PTX
_NIBBLE_BYTES = {
    False: "and.b32 lo, $1, 0x0F0F0F0F; shr.u32 t, $1, 4; and.b32 hi, t, 0x0F0F0F0F;",
    True: "and.b32 lo, $1, 0x0F0F0F0F; and.b32 hi, $1, 0xF0F0F0F0;",
}
_FOUR_DP2A = (
    "dp2a.lo.s32.u32 t, $2, lo, 0; dp2a.hi.s32.u32 t, $3, lo, t; dp2a.lo.s32.u32 t, $4, hi, t; "
    "dp2a.hi.s32.u32 $0, $5, hi, t;"
)
_NIBBLES_DOT_ASM = tl.constexpr(
    "{ .reg .b32 lo, hi, t; " + _NIBBLE_BYTES[False] + _FOUR_DP2A + " }"
)
_NIBBLES_IN_PLACE_DOT_ASM = tl.constexpr(
    "{ .reg .b32 lo, hi, t; " + _NIBBLE_BYTES[True] + _FOUR_DP2A + " }"
)


@triton.jit
def _nibbles_dot(w, lo01, lo23, hi01, hi23, IN_PLACE: tl.constexpr, BYTE_ASM: tl.constexpr):
    """Σ over a 32-bit word's 8 nibbles (byte j: input j low, input j + HALF high) times x's 16-bit integers
    (`_int16_pairs` of the low inputs, of the high ones): an int32. IN_PLACE: the high nibbles taken where they sit,
    as bytes of 16 q (their inputs scaled by a further 1/16): two instructions for the bytes instead of three."""
    if BYTE_ASM:
        return tl.inline_asm_elementwise(
            asm=_NIBBLES_IN_PLACE_DOT_ASM if IN_PLACE else _NIBBLES_DOT_ASM,
            constraints="=r,r,r,r,r,r",
            args=[w, lo01, lo23, hi01, hi23],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    lo, hi = w & 0x0F0F0F0F, (w >> 4) & 0x0F0F0F0F
    if IN_PLACE:
        hi = hi << 4
    return (
        _pair_dot(lo01, lo & 0xFFFF)
        + _pair_dot(lo23, (lo >> 16) & 0xFFFF)
        + _pair_dot(hi01, hi & 0xFFFF)
        + _pair_dot(hi23, (hi >> 16) & 0xFFFF)
    )


@triton.jit
def _pair_dot(pair, two_bytes):
    "dp2a without the instruction: a word's two int16 times the two low bytes of `two_bytes`, added."
    return ((pair << 16) >> 16) * (two_bytes & 0xFF) + (pair >> 16) * ((two_bytes >> 8) & 0xFF)


@triton.jit
def _x_integers(
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
    """For each row m of x, this thread's chunk of a step as `_int4_step_integers` takes it: (its 16-bit pairs per 8
    bytes of weights (low inputs 01, 23, high inputs 01, 23), 2^e / 2^SHIFT, Σx): scaled by a power of two (IN_PLACE:
    the high inputs by a further 1/16), summed from the same integers."""
    HALF: tl.constexpr = GROUP // 2
    # x * 2^(SHIFT - e) is under 2^(SHIFT + 1): a row's sum of the chunk's 2 x CHUNK products by q <= 15 stays under 2^22
    SHIFT: tl.constexpr = 13 if CHUNK == 8 else 12
    c_ok, x_first = _x_chunk(b0, lane, K, GROUP, CHUNK, EVEN)
    xs = ()
    for m in tl.static_range(ROWS):
        x_ok = c_ok[:, :, None] & ((m < M) | EVEN)
        loaded = ()  # the halves (`_x_as_floats`) of the low inputs and of the high ones, for each 8 bytes of the chunk
        big = tl.zeros_like(c_ok.to(tl.float32))  # max |x| over the chunk
        for h in tl.static_range(CHUNK // 8):
            first = m * K + x_first[:, :, None] + 8 * h
            lo = _x_as_floats(x_ptr, first, x_ok)
            hi = _x_as_floats(x_ptr, first + HALF, x_ok)
            for half in tl.static_range(2):
                big = tl.maximum(
                    big,
                    tl.maximum(tl.max(tl.abs(lo[half]), axis=2), tl.max(tl.abs(hi[half]), axis=2)),
                )
            loaded = loaded + ((lo, hi),)
        # 2^e <= max |x| with e >= -100 (a chunk of zeros, or below 2^-100: zeros); x * 2^(SHIFT - e) < 2^(SHIFT + 1)
        power = tl.maximum(big.to(tl.int32, bitcast=True) & 0x7F800000, 27 << 23)
        scale = (((127 + SHIFT) << 23) - (power - (127 << 23))).to(tl.float32, bitcast=True)
        unscale = power.to(tl.float32, bitcast=True) * (1.0 / (1 << SHIFT))
        pairs = ()
        sums = tl.zeros_like(
            lane
        )  # Σ x of the chunk as the dot takes it: its integers (IN_PLACE: the high ones' x 16)
        for h in tl.static_range(CHUNK // 8):
            lo, hi = loaded[h]
            lo01, lo23 = _int16_pairs(lo[0], lo[1], scale, BYTE_ASM)
            hi01, hi23 = _int16_pairs(hi[0], hi[1], scale * 0.0625 if IN_PLACE else scale, BYTE_ASM)
            sums += tl.sum(
                _pairs_sum(lo01, False, BYTE_ASM)
                + _pairs_sum(lo23, False, BYTE_ASM)
                + _pairs_sum(hi01, IN_PLACE, BYTE_ASM)
                + _pairs_sum(hi23, IN_PLACE, BYTE_ASM),
                axis=2,
            )
            pairs = pairs + ((lo01, lo23, hi01, hi23),)
        x_sum = ((sums + 0x4B400000).to(tl.float32, bitcast=True) - ROUND_TO_INTEGER) * unscale
        xs = xs + ((pairs, unscale, x_sum),)
    return xs


@triton.jit
def _int4_step_integers(
    accs,
    ws,
    x_ptr,
    b0,
    lane,
    M,
    K,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,
    CHUNK: tl.constexpr,
    EVEN: tl.constexpr,
    BYTE_ASM: tl.constexpr,
):
    """`_int4_step` in integers: x's chunk as 16-bit integers once for all rows (`_x_integers`), each weight word's
    nibbles multiplied and added by `_nibbles_dot`, 8 bytes of a chunk at a time."""
    IN_PLACE: tl.constexpr = (
        CHUNK == 8
    )  # (16-byte chunks would keep 9 bits of their high inputs: they shift instead)
    xs = _x_integers(x_ptr, b0, lane, M, K, ROWS, GROUP, CHUNK, EVEN, IN_PLACE, BYTE_ASM)
    new = ()
    for r in tl.static_range(BLOCK_N):
        chunk, s, mn = ws[r]
        s, mn = s.to(tl.float32), mn.to(tl.float32)
        for m in tl.static_range(ROWS):
            pairs, unscale, x_sum = xs[m]
            dots = tl.zeros_like(lane)
            for h in tl.static_range(CHUNK // 8):
                lo01, lo23, hi01, hi23 = pairs[h]
                dots += tl.sum(
                    _nibbles_dot(chunk[h], lo01, lo23, hi01, hi23, IN_PLACE, BYTE_ASM), axis=2
                )
            # Σ (x scaled) q of the chunk, |.| < 2^22: a float by the rounding trick backwards
            xq = (dots + 0x4B400000).to(tl.float32, bitcast=True) - ROUND_TO_INTEGER
            new = new + (accs[r * ROWS + m] + xq * (s * unscale) + x_sum * mn,)
    return new


# %% [markdown]
# The kernel itself: a step's weights (bytes, or the same bytes as words for the integers), the
# step in either arithmetic, and chapter 09's epilogue.

# %%
#| export
@triton.jit
def _int4_weights(
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
    """A step's weights of the program's rows: per row (this thread's chunk of bytes, its group's scale and minimum).
    INT_DOT: the chunk as CHUNK / 8 tiles of two 32-bit words each (`_int4_step_integers`). PAIRED: each scale
    followed by its minimum (`pair_scales`), both in one 4-byte load."""
    start = tl.multiple_of(
        b0 + lane * CHUNK, [CHUNK, CHUNK]
    )  # [SLABS, 32] a thread's first byte in the row
    c_ok = (start < K // 2) | EVEN  # EVEN: whole steps, whole programs and ROWS == M: no masks
    g = start // (
        GROUP // 2
    )  # the chunk's group (a chunk never straddles two: half a group is whole chunks)
    ws = ()
    for r in tl.static_range(BLOCK_N):
        row, row_ok = _program_row(first_col, r, N, BLOCK_N // 2, SWIGLU)
        ok = c_ok & (row_ok | EVEN)
        at = row * (K // GROUP) + g
        if (
            INT_DOT
        ):  # 8 bytes a tile: 16 in one would be laid out over two threads, as x's 16 inputs are
            words = q_ptr.to(tl.pointer_type(tl.int32)) + tl.multiple_of(
                row * (stride_qn // 4) + start // 4, [2, 2]
            )
            chunk = ()
            for h in tl.static_range(CHUNK // 8):
                chunk = chunk + (
                    tl.load(
                        words[:, :, None] + 2 * h + tl.arange(0, 2)[None, None, :],
                        mask=ok[:, :, None],
                        other=0,
                    ),
                )
        else:
            chunk = tl.load(
                q_ptr + row * stride_qn + start[:, :, None] + tl.arange(0, CHUNK)[None, None, :],
                mask=ok[:, :, None],
                other=0,
            )
        if PAIRED:
            pair = tl.load(
                scale_ptr
                + tl.multiple_of(2 * at, [2, 2])[:, :, None]
                + tl.arange(0, 2)[None, None, :],
                mask=ok[:, :, None],
                other=0.0,
            )
            s, mn = tl.split(pair)
            ws = ws + ((chunk, s, mn),)
        else:
            ws = ws + (
                (
                    chunk,
                    tl.load(scale_ptr + at, mask=ok, other=0.0),
                    tl.load(min_ptr + at, mask=ok, other=0.0),
                ),
            )
    return ws


@triton.jit
def _int4_step(
    accs,
    ws,
    x_ptr,
    b0,
    lane,
    M,
    K,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,
    CHUNK: tl.constexpr,
    EVEN: tl.constexpr,
    BYTE_ASM: tl.constexpr,
    INT_DOT: tl.constexpr,
):
    "accs + one step: x's chunk (loaded, converted and summed once for all rows) times each row's weights `ws`."
    if INT_DOT:
        new = _int4_step_integers(
            accs, ws, x_ptr, b0, lane, M, K, ROWS, BLOCK_N, GROUP, CHUNK, EVEN, BYTE_ASM
        )
    else:
        new = _int4_step_floats(
            accs, ws, x_ptr, b0, lane, M, K, ROWS, BLOCK_N, GROUP, CHUNK, EVEN, BYTE_ASM
        )
    return new


@triton.jit
def _int4_gemv_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    min_ptr,
    out_ptr,
    res_ptr,
    sums_ptr,
    next_g_ptr,
    normed_ptr,
    M,
    N,
    K,
    stride_qn,
    stride_rm,
    eps,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,
    CHUNK: tl.constexpr,
    SLABS: tl.constexpr,
    EVEN: tl.constexpr,
    BYTE_ASM: tl.constexpr,
    PDL: tl.constexpr,
    SWIGLU: tl.constexpr,
    EARLY_W: tl.constexpr,
    RESIDUAL: tl.constexpr,
    NORM_SUMS: tl.constexpr,
    HAND_OFF: tl.constexpr,
    EARLY_EPI: tl.constexpr,
    INT_DOT: tl.constexpr,
    PAIRED: tl.constexpr,
):
    _start_gemv(PDL, not EARLY_W)  # as chapter 09's GEMV: a dependent launch
    STEP: tl.constexpr = (
        SLABS * 32 * CHUNK
    )  # bytes of a row per step: a slab of 32 x CHUNK per warp
    lane = (
        tl.arange(0, SLABS)[:, None] * 32 + tl.arange(0, 32)[None, :]
    )  # [SLABS, 32]: a thread's place in a step
    HALF_N: tl.constexpr = (
        BLOCK_N // 2
    )  # SWIGLU: rows r < HALF_N of the gate half, r >= HALF_N their up rows
    first_col = tl.program_id(0) * (
        HALF_N if SWIGLU else BLOCK_N
    )  # the program's first output column
    accs = (tl.zeros((SLABS, 32), dtype=tl.float32),) * (
        BLOCK_N * ROWS
    )  # [row r, x row m] at r * ROWS + m
    first = 0
    if (
        EARLY_W
    ):  # the first EARLY_W steps' weights asked for before waiting for x (as chapter 09's GEMV)
        early = ()
        for e in tl.static_range(EARLY_W):
            early = early + (
                _int4_weights(
                    q_ptr,
                    scale_ptr,
                    min_ptr,
                    e * STEP,
                    lane,
                    first_col,
                    N,
                    K,
                    stride_qn,
                    BLOCK_N,
                    GROUP,
                    CHUNK,
                    EVEN,
                    SWIGLU,
                    INT_DOT,
                    PAIRED,
                ),
            )
        _wait_for_previous(PDL)
        for e in tl.static_range(EARLY_W):
            accs = _int4_step(
                accs,
                early[e],
                x_ptr,
                e * STEP,
                lane,
                M,
                K,
                ROWS,
                BLOCK_N,
                GROUP,
                CHUNK,
                EVEN,
                BYTE_ASM,
                INT_DOT,
            )
        first = EARLY_W * STEP
    handed = ()  # NORM_SUMS: each row's squares summed by the GEMV before (chapter 09's `hand_off`), asked for once
    for m in tl.static_range(
        ROWS if NORM_SUMS else 0
    ):  # x is there (as chapter 09's GEMV), used at the end
        handed = handed + (tl.load(sums_ptr + m, mask=m < M, other=0.0),)
    if (
        EARLY_EPI
    ):  # the epilogue's residual and norm weights asked for before the loop (as chapter 09's GEMV)
        residuals, next_gs = _rows_epilogue_operands(
            res_ptr, next_g_ptr, first_col, M, N, stride_rm, ROWS, BLOCK_N, RESIDUAL, HAND_OFF
        )
    for b0 in tl.range(
        first, K // 2, STEP, num_stages=1
    ):  # the loop as written, as chapter 09's GEMV
        ws = _int4_weights(
            q_ptr,
            scale_ptr,
            min_ptr,
            b0,
            lane,
            first_col,
            N,
            K,
            stride_qn,
            BLOCK_N,
            GROUP,
            CHUNK,
            EVEN,
            SWIGLU,
            INT_DOT,
            PAIRED,
        )
        accs = _int4_step(
            accs, ws, x_ptr, b0, lane, M, K, ROWS, BLOCK_N, GROUP, CHUNK, EVEN, BYTE_ASM, INT_DOT
        )
    if not EARLY_EPI:
        residuals, next_gs = _rows_epilogue_operands(
            res_ptr, next_g_ptr, first_col, M, N, stride_rm, ROWS, BLOCK_N, RESIDUAL, HAND_OFF
        )
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    for m in tl.static_range(ROWS):  # chapter 09's `gemv` epilogue, one output at a time
        rstd = _norm_scale(handed[m], K, eps) if NORM_SUMS else 1.0
        squares = 0.0  # HAND_OFF: this program's share of h's squares
        for r in tl.static_range(HALF_N if SWIGLU else BLOCK_N):
            row, row_ok = _program_row(first_col, r, N, HALF_N, SWIGLU)
            ok = row_ok & (m < M)
            total = tl.sum(tl.sum(accs[r * ROWS + m], axis=1), axis=0) * rstd
            if SWIGLU:  # silu(gate) * up, rounded as the GEMV's stores and `silu_mul` round them (chapter 09)
                up = tl.sum(tl.sum(accs[(r + HALF_N) * ROWS + m], axis=1), axis=0) * rstd
                tl.store(
                    out_ptr + m * (N // 2) + row,
                    _silu_times(total.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), dtype),
                    mask=ok,
                )
            else:
                if RESIDUAL:  # added as rounded, as a separate add would find it
                    total = total.to(dtype).to(tl.float32) + residuals[r * ROWS + m]
                tl.store(out_ptr + m * N + row, total.to(dtype), mask=ok)
                if (
                    HAND_OFF
                ):  # the next norm but its 1 / rms: h x its weight stored, h's squares summed
                    h = total.to(dtype).to(tl.float32)
                    tl.store(normed_ptr + m * N + row, (h * next_gs[r]).to(dtype), mask=ok)
                    squares += tl.where(ok, h * h, 0.0)
        if HAND_OFF:
            if m < M:  # (M may be specialised to 1, so m < M a constant: an `if`, not a mask)
                tl.atomic_add(sums_ptr + m, squares, sem="relaxed")


# %% [markdown]
# Its configuration, like chapter 09's `gemv_config`, depends on the shape only (so results do
# not depend on the batch): the chain lab's winners above, as a rule. Long rows (o, down) take
# 16-byte chunks over four warps; short ones 8-byte chunks, one warp for the wide gate-up (the
# most programs), two for qkv. The gate-up takes 8 rows a program (4 gate rows with their up
# rows): in a chain of plain GEMVs 4 and 8 rows tie (12.88 and 12.98 µs a matrix), but inside the
# decode step, as the SiLU-mul GEMV it is there, 8 rows made the int4 step 1.469 ms against
# 1.496 / 1.494 with 4 (`kernels_lab/decode_overlap.py`; 6 rows 1.477). Compiled
# offline, 8 rows take 3.78 instructions a weight against 4.19 and have 64 bytes of weights a
# thread on their way against 32, at 128 registers a thread against 64. For smaller
# models (fewer outputs) `BLOCK_N` halves, down to 1, until there are at least 256 programs
# (two per SM of an H200); the halving itself is a rule, not a measurement. More rows of x (up
# to 4) take fewer weight rows a program, so the accumulators (`BLOCK_N × ROWS`) stay as many.
#
# Tiles take register caps (`INT4_TILE_MAXNREG`, by tile and arithmetic). In FP32 the gate-up's
# 8 × 1 × 8 compiles to 128 registers a thread, so 16 warps fit an SM; capped at 96 it spills
# nothing and 21 fit, and the int4 decode step took 1.426 ms against 1.470 / 1.467 uncapped
# (104 registers: 1.505). Caps that spill were slower (qkv at 56, o and down at 64).
# In integers the gate-up keeps that cap as measured (80 registers under it; uncapped 64, not
# measured), and qkv's 4 × 2 × 8 takes 80: uncapped, ptxas chose 72 registers and spilled six
# values around its early steps; at 80 it spills none and the step measured the same (1.254 ms
# against 1.250 / 1.254; at 96, 1.311). The caps hold at one row of x only, where they were measured.
# o's 4 × 2 × 16 in integers takes 66 registers uncapped (28 warps an SM). Under a cap of 80 ptxas
# uses 79 (25 warps) for the same 952 instructions a thread, under 96 it uses 87 (23 warps) for 928,
# and the step was faster for fewer warps: 1.174 ms at 80 against 1.183 / 1.181 uncapped (64: 1.180);
# then 1.173 at 96 against 1.182 / 1.181 / 1.183 uncapped and 1.176 / 1.177 at 80 (`kernels_lab/decode_overlap.py`,
# `bash kernels_lab/w1_checks.sh ab`); the bench's W1 at 96: 839.4 / 838.9 tok/s against BF16's
# 419.1 / 419.1 in the same call (2.00×). Lower caps elsewhere, which spill nothing in the integer
# step, were all slower: qkv at 64 or 72 1.215, the gate-up at 80 1.212 (88: 1.181), down at 80 1.207.
#
# Fewer registers are not a win in themselves. With K a constant of the kernel (each row a fixed
# offset from the first, no row stride) the gate-up compiled to 80 registers instead of 128 and o's
# to 56 instead of 96, with fewer instructions, yet the int4 step took 1.518 ms against 1.470 (1.812
# with each step's scales asked for a step ahead; `kernels_lab/decode_overlap.py`).
# Why is still open; only the measurement in the step decides.
#
# Two tiles ask for more than their first step of weights before they wait for x
# (`INT4_TILE_EARLY_STEPS`): qkv's 4 × 2 × 8 its whole row (three steps of 512 bytes: 95 registers,
# 20 warps an SM), down's 4 × 4 × 16 two of its three. A program that starts while the kernel before
# it still runs then has all (or most) of its weights on their way when x is ready, not one step of
# them. The int4 decode step: 1.417 / 1.420 ms against 1.429 / 1.429 / 1.428 / 1.429 without, the
# bench's W1 696.8 / 696.6 tok/s against BF16 419.4 (1.66×). More was not better: down's
# three steps 1.489 ms, the gate-up's five do not fit under its cap (they spill from two on), uncapped
# 1.431 at three. How much any of this can win is bounded: with the int4 GEMVs never waiting for the
# kernel before (wrong values, same work: `kernels_lab/int4_step_bounds.py`) the step takes 1.276 ms,
# with their nibbles also left unpacked 1.060; either alone saves about a tenth of the step.
#
# The tiles were chosen in FP32; in integers (the section above) they were measured again in the
# step (`bash kernels_lab/w1_checks.sh int4-tiles`). Offline, more rows a program pay
# off more in integers (x's conversion is shared by all of them: qkv's 8 × 2 × 8 2.75 instructions
# a weight against 4 × 2 × 8's 3.42), yet in the step every larger tile was slower (qkv 8 × 2 × 8
# 1.307 ms against 1.253 / 1.256). Two changes won: o's rows over two warps, 4 × 2 × 16 (two steps
# a row, 72 registers), 1.236 ms; and the gate-up asking for two of its five steps before its wait
# (96 registers under its cap, no spills), 1.243; together 1.225 against 1.252 / 1.247. Not taken:
# each step's weights asked for a step ahead in the loop (registers double-buffered; the gate-up
# 1.254, down 1.349) and an int4 LM head (1.234 ms: 18 µs a token for a coarser head).

# %%
#| export
GEMV_MIN_PROGRAMS = 256  # about two programs per SM of an H200 (132 SMs)
INT4_EARLY_WEIGHTS = 1  # steps of a program's weights asked for before it waits for x: the first measured faster (below)
INT4_EARLY_EPILOGUE = True  # the residual and norm weights of the epilogue asked for before the loop (chapter 09's GEMV)
# register caps a thread for tiles (BLOCK_N, warps, CHUNK, in integers) at one row of x: in FP32 the gate-up's 8 x 1 x 8
# compiles to 128, 16 warps an SM; at 96 it spills nothing and 21 fit, and the int4 decode step measured faster; in
# integers qkv's 4 x 2 x 8 with its three early steps takes 72 and spills six values, at 80 none (the step the same);
# o's 4 x 2 x 16 in integers takes 66 uncapped, 87 under a cap of 96: fewer warps an SM, yet the step measured faster
INT4_TILE_MAXNREG = {
    (8, 1, 8, False): 96,
    (8, 1, 8, True): 96,
    (4, 2, 8, True): 80,
    (4, 2, 16, True): 96,
}
# steps of weights a program asks for before its wait, for tiles (BLOCK_N, warps, CHUNK, in integers) at one row of x
# (others: INT4_EARLY_WEIGHTS): qkv's 4 x 2 x 8 its whole row (three steps), down's 4 x 4 x 16 two of its three; in
# integers the gate-up's 8 x 1 x 8 two of its five (96 registers, no spills; in FP32 they spill under its cap) (below)
INT4_TILE_EARLY_STEPS = {
    (4, 2, 8, False): 3,
    (4, 2, 8, True): 3,
    (4, 4, 16, False): 2,
    (4, 4, 16, True): 2,
    (8, 1, 8, True): 2,
}
# the GEMV's arithmetic in integers (x as 16-bit integers, nibbles as bytes, dp2a: `_int4_step_integers`) where the
# packed rows are whole 32-bit words; else in FP32 (`_int4_step_floats`): measured faster (below)
INT4_INT_DOT = True


def quant_gemv_config(n: int, k: int) -> tuple[int, int, int]:
    "(BLOCK_N, num_warps, CHUNK bytes) for the int4 GEMV of an [n, k] weight at one row (the H200 labs' winners)."
    if (
        k >= 4096
    ):  # long rows (o, down): 16-byte chunks, K split over four warps; o's 4,096 inputs over two
        block_n, warps, chunk = 4, 4 if k > 4096 else 2, 16
    else:
        block_n, warps, chunk = (4, 2, 8) if n < 16384 else (8, 1, 8)
    while block_n > 1 and triton.cdiv(n, block_n) < GEMV_MIN_PROGRAMS:
        block_n //= 2
    return block_n, warps, chunk


# %%
assert [
    quant_gemv_config(n, k) for n, k in ((6144, 2560), (19456, 2560), (2560, 4096), (2560, 9728))
] == [(4, 2, 8), (8, 1, 8), (4, 2, 16), (4, 4, 16)]  # Qwen3-4B: the labs' winners
assert (
    quant_gemv_config(576, 576)[0] == 2 and quant_gemv_config(3072, 1024)[0] == 4
)  # SmolLM2's o, a 0.6B-sized qkv


# %%
#| export
def _gemv_launch(
    kernel,
    x: torch.Tensor,
    weights: tuple,
    n: int,
    block_n: int,
    num_warps: int,
    pdl: bool | None = None,
    maxnreg: int | None = None,
    swiglu: bool = False,
    residual: torch.Tensor | None = None,
    norm_sums: torch.Tensor | None = None,
    hand_off: tuple | None = None,
    eps: float = 1e-6,
    **constexprs,
):
    """Launch a quantized GEMV kernel (grid over output tiles; x [M <= GEMV_MAX_ROWS, K], weights[0] [N, bytes per row])
    -> [M, N] (`swiglu`: [M, N / 2], a program's BLOCK_N rows half gate, half up); as a dependent launch where the GPU
    has it (default). `residual`, `norm_sums`, `hand_off`, `eps`: as
    chapter 09's `gemv` (with `hand_off`: -> (out, out x the norm's weight)).
    `maxnreg`: a cap on registers per thread for the compiler (the lab's knob: more warps resident per SM)."""
    x = x.contiguous()
    m, k = x.shape
    out = torch.empty((m, n // 2 if swiglu else n), device=x.device, dtype=x.dtype)
    sums, next_g, normed = hand_off_operands(out, norm_sums, hand_off, out)
    folds = (out if residual is None else residual, sums, next_g, normed)
    pdl = pdl_supported(x.device) if pdl is None else pdl
    if m:
        kernel[(triton.cdiv(out.shape[1], block_n // 2 if swiglu else block_n),)](
            x,
            *weights,
            out,
            *folds,
            m,
            n,
            k,
            weights[0].stride(0),
            0 if residual is None else residual.stride(0),
            eps,
            ROWS=_pow2(m),
            BLOCK_N=block_n,
            PDL=pdl,
            launch_pdl=pdl,
            num_warps=num_warps,
            **({"maxnreg": maxnreg} if maxnreg else {}),
            SWIGLU=swiglu,
            RESIDUAL=residual is not None,
            NORM_SUMS=norm_sums is not None,
            HAND_OFF=hand_off is not None,
            **constexprs,
        )
    return out if hand_off is None else (out, normed)


def pair_scales(scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """[N, groups, 2]: each group's scale followed by its minimum (`Int4Linear` keeps them so, and its `scale` and
    `minimum` are the two views): the GEMV then reads a row's pair with one 4-byte load instead of two 2-byte ones."""
    return torch.stack((scale, minimum), dim=-1)


def _scales_as_kernels_read(
    scale: torch.Tensor, minimum: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(scale, minimum, paired): the two views of one `pair_scales` tensor as they are (paired), else each contiguous
    [N, groups], the layout the kernels index."""
    n, groups = scale.shape
    paired = (
        scale.dtype == minimum.dtype
        and scale.stride() == minimum.stride() == (2 * groups, 2)
        and minimum.data_ptr() - scale.data_ptr() == scale.element_size()
    )
    return (scale, minimum, True) if paired else (scale.contiguous(), minimum.contiguous(), False)


def _early_steps(pdl: bool, early_weights: int | None, row_bytes: int, step_bytes: int) -> int:
    "Steps of weights a program asks for before its wait: none unless launched as a dependent, at most a row's steps."
    steps = INT4_EARLY_WEIGHTS if early_weights is None else int(early_weights)
    if steps < 0:
        raise ValueError(
            f"int4_gemv's early_weights is a number of steps, 0 or more, got {early_weights}"
        )
    return min(steps, triton.cdiv(row_bytes, step_bytes)) if pdl else 0


def int4_gemv(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    block_n: int | None = None,
    num_warps: int | None = None,
    chunk: int | None = None,
    byte_asm: bool | None = None,
    pdl: bool | None = None,
    maxnreg: int | None = None,
    swiglu: bool = False,
    early_weights: int | None = None,
    residual: torch.Tensor | None = None,
    norm_sums: torch.Tensor | None = None,
    hand_off: tuple | None = None,
    eps: float = 1e-6,
    int_dot: bool | None = None,
):
    """x [M <= GEMV_MAX_ROWS, K] @ dequantize_int4(packed, scale, minimum).T through `_int4_gemv_kernel`; `swiglu`:
    the weight is a gate-up matrix [gate | up] and the result silu(gate) * up [M, N / 2], in the kernel's epilogue.
    `residual`, `norm_sums`, `hand_off` (-> (h, h x the norm's weight)), `eps`: the folds of chapter 09's `gemv`.
    `early_weights`: as a dependent launch, the steps of weights asked for before the wait (True: the first; default:
    `INT4_TILE_EARLY_STEPS`'s for the tile and arithmetic at one row, else INT4_EARLY_WEIGHTS)
    `block_n` weight rows a program, `num_warps` (each a slab of K), `chunk` bytes a thread takes of each row per step
    (8 or 16): default `quant_gemv_config`, with `block_n` divided by the rows of x.
    `byte_asm`: nibbles unpacked by `_nibbles_to_f32`'s PTX (default: whenever compiled, not interpreted).
    `pdl`: as chapter 09's `gemv` (a dependent launch by default on Hopper); `maxnreg`:
    a register cap per thread (default: `INT4_TILE_MAXNREG`'s for the tile and arithmetic at one row, else the
    compiler's choice).
    `int_dot`: the arithmetic in integers (`_int4_step_integers`) or in FP32 (default: INT4_INT_DOT, where the packed
    rows start at whole 32-bit words)."""
    (m, k), n = x.shape, packed.shape[0]
    if m > GEMV_MAX_ROWS:
        raise ValueError(f"int4_gemv takes at most {GEMV_MAX_ROWS} rows, got {m}: use int4_matmul")
    pdl = pdl_supported(x.device) if pdl is None else pdl
    group = k // scale.shape[1]
    default = quant_gemv_config(n, k)
    if not block_n:
        block_n = max(2 if swiglu else 1, default[0] // _pow2(max(m, 1)))
        block_n += swiglu and block_n % 2  # (a tile of gate rows and their up rows: even)
    num_warps, chunk = (
        num_warps or default[1],
        chunk or min(default[2], group // 2),
    )  # (groups of 16: 8-byte chunks)
    if chunk not in (8, 16) or (group // 2) % chunk:
        raise ValueError(
            f"int4_gemv's chunk is 8 or 16 bytes, dividing half a group ({group // 2} bytes), got {chunk}"
        )
    if packed.numel() >= 2**31:  # the kernel's offsets are 32-bit
        raise ValueError(
            f"int4_gemv takes weights of under 2^31 bytes, got {packed.numel()}: split the matrix"
        )
    if swiglu and (n % 2 or block_n % 2):
        raise ValueError(
            f"int4_gemv with swiglu takes gate rows with their up rows: an even N and block_n, got "
            f"{n} and {block_n}"
        )
    check_gemv_folds("int4_gemv", x, n, swiglu, residual, norm_sums, hand_off)
    whole_words = packed.data_ptr() % 4 == 0 and packed.stride(0) % 4 == 0
    if int_dot and not whole_words:
        raise ValueError(
            f"int4_gemv's int_dot reads the packed rows as 32-bit words: they must start at multiples of "
            f"4 bytes, got address {packed.data_ptr()} and row stride {packed.stride(0)}"
        )
    int_dot = (INT4_INT_DOT and whole_words) if int_dot is None else int_dot
    tile = (block_n, num_warps, chunk, bool(int_dot))
    if maxnreg is None and m == 1 and not INTERPRETED:
        maxnreg = INT4_TILE_MAXNREG.get(tile)
    if early_weights is None and m == 1:
        early_weights = INT4_TILE_EARLY_STEPS.get(tile)
    step_bytes = 32 * chunk * num_warps  # of a row, per loop step
    even = n % block_n == 0 and (k // 2) % step_bytes == 0 and m == _pow2(max(m, 1))
    scale, minimum, paired = _scales_as_kernels_read(scale, minimum)
    return _gemv_launch(
        _int4_gemv_kernel,
        x,
        (packed, scale, minimum),
        n,
        block_n,
        num_warps,
        pdl,
        maxnreg,
        swiglu,
        residual,
        norm_sums,
        hand_off,
        eps,
        GROUP=group,
        CHUNK=chunk,
        SLABS=num_warps,
        EVEN=even,
        EARLY_W=_early_steps(pdl, early_weights, k // 2, step_bytes),
        EARLY_EPI=INT4_EARLY_EPILOGUE,
        BYTE_ASM=not INTERPRETED if byte_asm is None else byte_asm,
        INT_DOT=bool(int_dot),
        PAIRED=paired,
    )


# %% [markdown]
# Which kernel: `int4_matmul` and `gguf_matmul` (chapter 10d) send up to `GEMV_MAX_ROWS` (4) rows to their
# GEMV path and more rows to the split-K kernel; `kernel="gemv"` or `"split_k"` forces one (the
# tests and the lab compare them).

# %%
#| export
def int4_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    impl: str = "auto",
    kernel: str | None = None,
    **launch,
) -> torch.Tensor:
    "x [M, K] @ dequantize_int4(packed, scale, minimum).T -> [M, N] in x's dtype; `launch` goes to the kernel's launcher."
    if kernel_backend(x.device, impl) == "torch":
        return int4_matmul_reference(x, packed, scale, minimum)
    if _skinny_kernel(kernel, x.shape[0]) == "gemv":
        return int4_gemv(x, packed, scale, minimum, **launch)
    group = x.shape[1] // scale.shape[1]
    step_groups = max(
        1, 128 // group
    )  # 128 inputs a step where whole steps divide K; else a group a step
    if x.shape[1] % (step_groups * group):
        step_groups = 1
    scale, minimum, paired = _scales_as_kernels_read(scale, minimum)
    return _skinny_matmul(
        _int4_matmul_kernel,
        x,
        (packed, scale, minimum),
        packed.shape[0],
        step_groups * group,
        GROUP=group,
        STEP_GROUPS=step_groups,
        PAIRED=paired,
        **launch,
    )


def int4_matmul_reference(x, packed, scale, minimum):
    return F.linear(x, dequantize_int4(packed, scale, minimum, x.dtype))


@triton.jit
def _int4_dequantize_kernel(
    packed_ptr,
    scale_ptr,
    min_ptr,
    out_ptr,
    n_bytes,
    SCALE_STRIDE,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    "Packed bytes [N, K/2] -> weights [N, K] in out's dtype: byte j of group g holds weights j (low) and j + GROUP/2."
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_bytes
    b = tl.load(packed_ptr + offs, mask=ok, other=0)
    g, j = (
        offs // (GROUP // 2),
        offs % (GROUP // 2),
    )  # rows are whole groups: g counts groups over all rows
    s = tl.load(scale_ptr + g * SCALE_STRIDE, mask=ok, other=0.0).to(tl.float32)
    m = tl.load(min_ptr + g * SCALE_STRIDE, mask=ok, other=0.0).to(tl.float32)
    at = g * GROUP + j
    tl.store(
        out_ptr + at, ((b & 0x0F).to(tl.float32) * s + m).to(out_ptr.dtype.element_ty), mask=ok
    )
    tl.store(
        out_ptr + at + GROUP // 2,
        ((b >> 4).to(tl.float32) * s + m).to(out_ptr.dtype.element_ty),
        mask=ok,
    )


def int4_dense(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor
) -> torch.Tensor:
    """The dense path for many rows (prefill): the weights in x's dtype, then one matmul. On a GPU the weights come
    from one Triton launch (3 bytes a weight of traffic, against ~20 for PyTorch's operations on FP32 temporaries)."""
    if kernel_backend(x.device) == "torch":
        return int4_matmul_reference(x, packed, scale, minimum)
    n, groups = scale.shape
    if scale.stride(0) != groups * scale.stride(1) or minimum.stride() != scale.stride():
        raise ValueError(
            "int4_dense: scale and minimum must be rows of whole groups, laid out alike"
        )
    w = torch.empty(n, 2 * packed.shape[1], device=x.device, dtype=x.dtype)
    block = 1024
    _int4_dequantize_kernel[(triton.cdiv(packed.numel(), block),)](
        packed,
        scale,
        minimum,
        w,
        packed.numel(),
        scale.stride(1),
        GROUP=w.shape[1] // groups,
        BLOCK=block,
    )
    return F.linear(x, w)


# %% [markdown]
# The int4 split-K kernel against the reference, as chapter 10b's int8 one: 1, 2, 5 and 17 rows,
# with and without splits, ragged N, FP32 and BF16.

# %%
torch.manual_seed(0)
w = torch.randn(40, 384) * 0.1  # N = 40: not a multiple of the tiles
q4 = quantize_int4(w)
for m, dtype, launch in [
    (1, torch.float32, {}),
    (1, torch.float32, dict(split=3)),
    (2, torch.float32, dict(split=1)),
    (5, torch.float32, dict(split=2)),
    (17, torch.float32, {}),
    (1, torch.bfloat16, {}),
    (8, torch.bfloat16, dict(split=3)),
]:
    x = torch.randn(m, 384, dtype=dtype)
    check_kernel(
        lambda x, **kw: int4_matmul(x, *q4, kernel="split_k", **kw),
        lambda x: int4_matmul_reference(x, *q4),
        x,
        **launch,
    )

# %% [markdown]
# The dense path's weights, made by one Triton launch, are the reference's in FP32 and BF16 (one
# rounding of q · scale + minimum), with the scales and minimums side by side as `Int4Linear` keeps them:

# %%
gen = torch.Generator().manual_seed(1)  # (its own numbers: the cells below keep theirs)
for group in (32, 128):
    q4g = quantize_int4(torch.randn(24, 256, generator=gen), group)
    paired = pair_scales(q4g[1], q4g[2])
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(20, 256, generator=gen).to(dtype)
        got = int4_dense(x, q4g[0], paired[..., 0], paired[..., 1])
        assert_matches(got, int4_matmul_reference(x, *q4g), f"int4_dense g{group} {dtype}")

# %% [markdown]
# The int4 GEMV on 0 to 4 rows: groups of 128, 64 and 32; N not a multiple of `BLOCK_N`; K not a
# multiple of a step (the last step masked), whole steps (no masks); FP32 and BF16.

# %%
for group, k in ((128, 384), (128, 512), (64, 576), (32, 96)):  # 512: whole steps at one warp
    # N = 12 rows: not a multiple of 8 or 16, so those tiles end masked (each row costs the interpreter ~0.1 s)
    q4g = quantize_int4(torch.randn(12, k) * 0.1 + torch.linspace(-0.2, 0.5, k), group)
    reference = lambda x: int4_matmul_reference(x, *q4g)
    for m, dtype, launch in [
        (1, torch.float32, {}),
        (2, torch.float32, dict(block_n=16, num_warps=2)),
        (3, torch.float32, dict(block_n=4, chunk=16 if group > 32 else 8)),
        (4, torch.bfloat16, dict(block_n=1)),
        (1, torch.bfloat16, dict(block_n=8, num_warps=1)),
        (2, torch.bfloat16, dict(maxnreg=64)),
        (1, torch.float32, dict(block_n=8, chunk=16)),
        (1, torch.bfloat16, dict(int_dot=False)),
        (3, torch.float32, dict(int_dot=False, chunk=8)),
    ]:
        x = torch.randn(m, k, dtype=dtype)
        # in FP32 the high nibbles keep ~13 bits (above); in integers x keeps 13-14 bits of its chunk's largest input,
        # in 8-byte chunks the high nibbles' 10, with errors of either sign: here under 2^-10 of Σ|x| · scale
        check_kernel(
            lambda x, **kw: int4_matmul(x, *q4g, **kw),
            reference,
            x,
            2**-10 * q4g[1].max().item() * x.abs().sum().item(),
            **launch,
        )
assert int4_matmul(torch.zeros(0, 96), *q4g, impl="triton").shape == (0, 12)
# the integers' rounding: an input far below its chunk's largest keeps only its top bits (here none: 2^-30 of it), so
# the result moves by at most 2^-10 of that largest input per weight (2^-14 for a low nibble's): int4's own steps are far
# coarser
x = torch.randn(1, 96)
x[0, ::16] = 1000.0  # one large input in every chunk
x[0, 1::16] = 1000.0 * 2**-30
floats, integers = int4_gemv(x, *q4g, int_dot=False), int4_gemv(x, *q4g, int_dot=True)
want = int4_matmul_reference(x, *q4g)
for got in (
    floats,
    integers,
):  # (FP32 too loses bits of the small inputs next to 1000: the high nibbles' offsets)
    assert (got - want).abs().max() <= 2**-10 * 1000.0 * 15 * q4g[1].float().max() * 96
assert not torch.equal(integers, floats)
# the largest sums: every input of a thread's chunk just under a power of two and every nibble 15 (each group one weight
# 0, the rest 1): 8- and 16-byte chunks alike stay exact to FP32's rounding (a 16-byte chunk with x scaled under 2^14
# would sum past 2^22, where the float trick breaks: 45% too large)
ones = quantize_int4(torch.ones(8, 512).index_fill_(1, torch.arange(0, 512, 128), 0.0))
assert (ones[0] >> 4).min() == 15 and (ones[0] & 15).sum() == 15 * (
    8 * 256 - 8 * 4
)  # each group's first nibble 0
for value, dtype in (
    (1.9921875, torch.float32),
    (-1.9921875, torch.float32),
    (1.9921875, torch.bfloat16),
):
    flat = torch.full((1, 512), value, dtype=dtype)  # (1.9921875: the largest BF16 under 2)
    want = int4_matmul_reference(flat.float(), *ones)
    for chunk in (8, 16):
        got = int4_gemv(flat, *ones, chunk=chunk, int_dot=True).float()
        # FP32: exact integer sums, then one conversion and one scaling (2^-24 each); BF16 out: one rounding, which
        # the interpreter does by truncation (under 2^-7)
        torch.testing.assert_close(
            got, want, rtol=1e-6 if dtype == torch.float32 else 2**-7, atol=0
        )
# scales paired with their minimums (`pair_scales`, as Int4Linear keeps them): the same bits from the GEMV and the
# skinny matmul; any other layout of the two (here a transposed copy) is made contiguous first
paired = pair_scales(*q4g[1:])
for rows in (1, 3, 6):
    x_rows = torch.randn(rows, 96)
    assert torch.equal(
        int4_matmul(x_rows, q4g[0], paired[..., 0], paired[..., 1], impl="triton"),
        int4_matmul(x_rows, *q4g, impl="triton"),
    )
assert torch.equal(
    int4_gemv(x_rows[:1], q4g[0], q4g[1].t().contiguous().t(), q4g[2]), int4_gemv(x_rows[:1], *q4g)
)
# packed rows that do not start at whole 32-bit words: FP32 (the default), or an error that says so
shifted = torch.empty(q4g[0].numel() + 1, dtype=torch.uint8)[1:].view(q4g[0].shape)
shifted.copy_(q4g[0])
assert torch.equal(int4_gemv(x, shifted, *q4g[1:]), floats)
with pytest.raises(
    ValueError,
    match="int_dot reads the packed rows as 32-bit words: they must start at multiples of 4",
):
    int4_gemv(x, shifted, *q4g[1:], int_dot=True)
with pytest.raises(ValueError, match="the gemv kernels take at most 4 rows, got 5"):
    int4_matmul(torch.zeros(5, 96), *q4g, impl="triton", kernel="gemv")
with pytest.raises(ValueError, match="unknown kernel 'splitk'; choose one of gemv, split_k"):
    int4_matmul(torch.zeros(1, 96), *q4g, impl="triton", kernel="splitk")
# `swiglu`: a gate-up matrix's GEMV with SiLU-mul in its epilogue gives the bits of the GEMV followed by `silu_mul`
for m, k, launch in (
    (1, 384, {}),
    (2, 96, dict(block_n=4)),
    (1, 512, dict(block_n=8, num_warps=1)),
    (3, 576, {}),
):
    q4s = quantize_int4(
        torch.randn(24, k) * 0.1, int4_group_size(k)
    )  # 12 gate rows, then their 12 up rows
    x = torch.randn(m, k).bfloat16()
    want = silu_mul(int4_gemv(x, *q4s, **launch), impl="triton")
    assert torch.equal(int4_gemv(x, *q4s, swiglu=True, **launch), want), (m, k, launch)
with pytest.raises(ValueError, match="an even N and block_n, got 12 and 3"):
    int4_gemv(torch.zeros(1, 96), *q4g, swiglu=True, block_n=3)

# %% [markdown]
# The int4 GEMV takes chapter 09's epilogue folds too (`residual`, `hand_off`, `norm_sums`), so a
# decode step in int4 hands its norms from GEMV to GEMV as int8's does (chapter 09a):
# o and down add the residual and store h·g with h's squares summed; qkv and gate-up take h·g and
# scale by 1/rms at the end. The same bits as the plain GEMV plus chapter 09's separate kernels
# where nothing is reassociated; the consumer within rounding of `rmsnorm` then the GEMV.
# Measured (`kernels_lab/decode_overlap.py int4`, one H200): the step 1.604 → **1.556 ms**, W1
# 625.3 tok/s against BF16's 414.7 in the same call. Its residual and norm weights are asked for
# before the loop (`INT4_EARLY_EPILOGUE`; after the input wait): 1.530 → 1.519 ms. (Chapter 09's
# int8 tiles lost with theirs early: more registers, fewer programs an SM.)

# %%
from forge_engine.kernels.elementwise import add_rmsnorm, rmsnorm

# n is the next GEMV's K: one group of 64, or three of 32 with the last step masked (the interpreter's time goes as
# n times the rows of x, ~0.03 s a weight row and a row of x here)
for m, k, n, launch in (
    (1, 384, 64, {}),
    (2, 256, 96, dict(block_n=4, num_warps=1)),
    (3, 512, 96, {}),
):
    q_in, q_out = quantize_int4(torch.randn(n, k) * 0.1), quantize_int4(torch.randn(16, n) * 0.1)
    x, r = torch.randn(m, k).bfloat16(), (4 * torch.randn(m, n)).bfloat16()
    g, sums = (torch.rand(n) + 0.5).bfloat16(), torch.zeros(m)
    h, hg = int4_gemv(x, *q_in, residual=r, hand_off=(g, sums), **launch)
    plain = int4_gemv(x, *q_in, **launch)
    assert torch.equal(
        h, add_rmsnorm(plain, r, torch.ones(n, dtype=torch.bfloat16), 1e-6, impl="triton")[1]
    )
    assert torch.equal(int4_gemv(x, *q_in, residual=r, **launch), h)
    # h · g: one BF16 rounding on each side, done two ways (bit for bit on a GPU; the interpreter truncates):
    # within one BF16 step, under bf16's default rtol of 2^-6
    torch.testing.assert_close(hg, h * g)
    torch.testing.assert_close(
        sums, h.float().square().sum(-1)
    )  # FP32 sums of n squares in another order: ~n·2^-24
    for swiglu in (False, True):
        got = int4_gemv(hg, *q_out, norm_sums=sums, eps=1e-5, swiglu=swiglu)
        want = int4_gemv(rmsnorm(h, g, 1e-5, impl="triton"), *q_out, swiglu=swiglu)
        # the norm applied after the GEMV (got) or to its BF16 input (want): x · rstd · g rounded to BF16 (2^-8) at a
        # different place, and FP32 sums over n inputs: a few 2^-8 of the largest output
        torch.testing.assert_close(
            got.float(), want.float(), rtol=0, atol=2e-2 * want.float().abs().max().item()
        )
with pytest.raises(
    ValueError, match=r"int4_gemv's hand_off needs a residual and a norm weight \[12\]"
):
    int4_gemv(torch.zeros(1, 96), *q4g, hand_off=(torch.ones(12), torch.zeros(1)))
with pytest.raises(ValueError, match=r"int4_gemv's norm_sums must be float32 \[2\] on cpu"):
    int4_gemv(torch.zeros(2, 96), *q4g, norm_sums=torch.zeros(1))
with pytest.raises(
    ValueError, match=r"int4_gemv's early_weights is a number of steps, 0 or more, got -1"
):
    int4_gemv(torch.zeros(1, 96), *q4g, early_weights=-1)
