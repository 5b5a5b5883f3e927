# %% [markdown]
# # Kernels: matrix-vector products for small batches
#
# > The GEMV for one to four rows of x (BF16 and int8 weights, a Triton-placed tile or the `rows` layout), and what its epilogue folds in: SiLU-mul, the residual add, the RMSNorms, norms handed from GEMV to GEMV.

# %%
#| default_exp kernels.gemv

# %%
#| export
# Why one module of ~800 lines: it is one concept, the GEMV for one to four rows, and its parts
# are not used apart. The two layouts (`_gemv_kernel`, `_gemv_rows_kernel`) share the int8
# conversion, the norm folds and the dependent-launch start; `gemv` checks the folds, picks the
# layout and the tile (`gemv_layout`, `gemv_config`: the measured winners) and launches one of
# them; chapter 10's int4 GEMV imports the same pieces. About a quarter of the lines hold one name
# each: the formatter writes each of the kernels' 32 and 25 parameters, and each launch argument,
# on a line of its own.
import torch
import torch.nn.functional as F

from forge_engine.kernels.backend import (
    INTERPRETED,
    _pow2,
    _stages,
    _wait_for_previous,
    kernel_backend,
    pdl_supported,
    tl,
    triton,
)
from forge_engine.kernels.elementwise import _silu_times, add_rmsnorm_reference, silu_mul

# %%
#| hide
import pytest
from forge_engine.kernels.elementwise import add_rmsnorm, rmsnorm, silu_mul_reference

gen = torch.Generator().manual_seed(2)

# %% [markdown]
# At batch 1 a decode step is four matrix-*vector* products per layer, and their time is the
# time to read the weights: 8 GB per token for Qwen3-4B, 1.92 ms at the H200's 4.19 TB/s.
# cuBLAS, asked for `x @ W.T` with one row, reaches about 65% of that (a CUDA graph of cuBLAS
# `F.linear` calls over all the weights: 2.95 ms). A GEMV needs no tensor cores; what it needs is every SM streaming weights from the
# first microsecond to the last: many independent programs, each owning `BLOCK_N` output rows,
# loading `BLOCK_K`-wide tiles of those rows as wide vector loads, multiplying by the (tiny,
# cached) input rows and keeping fp32 partial sums in registers; one reduction at the end.
# Several input rows share every weight tile (batch 2 and 4 read the weights once, not twice or
# four times): up to `GEMV_MAX_ROWS` in the tile layout, 8 in the rows layout (below). The
# model sends it one row: BF16 steps of 2-16 rows go to the tensor cores, with the same folds
# (chapter 09_kernels_rows_matmul).
#
# ```
#                      K (inputs) ──────────────────────────────────────────▶
#            ┌──────────┬──────────┬──────────┬──────────┬──────────┐
# program 0  │  tile    │  tile    │  tile    │  tile    │  tile    │  BLOCK_N rows of W
#            ├──────────┼──────────┼──────────┼──────────┼──────────┤
# program 1  │          │          │          │          │          │  each program walks its rows
#            ├──────────┼──────────┼──────────┼──────────┼──────────┤  left to right, BLOCK_K at a
#   ...      │          │          │          │          │          │  time, the fp32 partial sums
#            ├──────────┼──────────┼──────────┼──────────┼──────────┤  staying in registers
# program    │          │          │          │          │          │
# N/BLOCK_N  └──────────┴──────────┴──────────┴──────────┴──────────┘
#               ▲ x[0:BLOCK_K] (1-4 rows, read from L2 by every program)
#   out[n] = Σ_k W[n, k] · x[k]: one reduction of the tile's columns at the end; no partials in memory
# ```
#
# Measured against cuBLAS (`kernels_lab/gemv.py`, one H200, a CUDA-graph replay each, L2
# flushed): one row takes 15.9 / 13.0 / 35.5 / 22.3 / 185 µs for Qwen3-4B's qkv / o / gate-up /
# down / LM head against cuBLAS's 16.8 / 15.0 / 38.3 / 24.4 / 196 µs, 5-13% faster. At two and
# four rows cuBLAS is faster, so the model sends this kernel one row only.
#
# **Tiles.** A step runs each shape 36 times, one layer after another, and that is how the tiles
# are chosen: `kernels_lab/gemv_chain_sweep.py` times 36 distinct matrices of one shape in one
# CUDA graph per configuration, and `gemv_config` holds the winners (the gate-up projection: 4
# rows x 512 inputs, 4 warps, 26.0 µs a matrix, 3.84 TB/s, where the best tile timed alone took
# 29.4). At one row the tile is 2-D, `[BLOCK_N, BLOCK_K]`, in the layout the weights are loaded
# in; the general `[ROWS, BLOCK_N, BLOCK_K]` product would move its operands through shared
# memory on every step. `kernels_lab/gemv_sass.py` compiles the kernel for an H200 on any machine
# and counts the instructions of its loop per weight.
#
# **int8 weights** (chapter 10: one scale per output row) are converted in registers and the
# scale applied to the finished sums. At one row a GEMV does one multiply-add per weight, so at
# int8's 16 bytes per SM and cycle an SM has about 8 instructions per weight for everything, and
# the GPU's int-to-float instruction runs at a quarter of the FMA rate. So `_as_f32` builds the
# float from its bits: 2^23 + byte is the float whose bits are 0x4B0000 followed by the byte, and
# subtracting 2^23 + 128 leaves the signed weight, exactly. Compiled for a GPU that is PTX, per
# 32-bit register of four weights (`_int8x4_to_f32`): one XOR flips the four sign bits, one
# `prmt` (byte permute) per weight places its byte under the exponent: 4.1-4.5 instructions per
# weight. The int8 loads are 8 bytes a thread, as x's 8 bf16 values, so both tiles share one
# layout. In the chain lab the int8 GEMVs take 8.4 / 6.8 / 16.3 / 13.8 µs (qkv / o / gate-up /
# down) with the PTX conversion against 11.0 / 8.0 / 18.2 / 17.7 with `cvt`.
#
# **Programmatic dependent launch** (Hopper). The fixed cost per launch is the gap between
# kernels: each waits for the one before to finish completely before its programs start. Launched
# as a dependent, a kernel starts while the one before is finishing, once that one allows it
# (`_let_next_start`), and waits (`gdc_wait`) before it reads what that kernel writes. Every
# kernel of a decode step does both, in steps of at most `DEPENDENT_LAUNCH_MAX_ROWS` rows (a
# decode attention of 256 sequences launched early holds SMs the projection before it needs).
# Without Hopper both are no-ops. Measured (`kernels_lab/decode_overlap.py`, random:qwen3-4b, one
# sequence's decode step as a CUDA graph, one H200): the BF16 step 2.458 ms against 2.548 with
# the small kernels launched the ordinary way.
#
# **The first weights before the wait** (`early_weights`, `EARLY_W`). A GEMV's weights do not
# depend on the kernel before it, only its input row does, so a program launched early issues its
# first step's weight loads, then waits for x; the loop is unchanged (the first step is peeled).
# The peeled step's inputs are written as the loop's are, `k0 + offs_k` with a `k0` the compiler
# cannot see is 0 (`tl.program_id(1) * BLOCK_K`): with a plain `0 + offs_k` it gives that step
# 16-byte int8 loads and moves every later step's tile through shared memory into their layout
# (`tests/test_gemv_sass.py` keeps such trips out of the loops). The decode step: BF16 2.608 ms
# against 2.666, int8 1.742 against 1.778 (`kernels_lab/decode_overlap.py bf16,int8`).
#
# **The loop loads one step at a time.** Three ways to keep more bytes in flight measured slower
# in the decode step, and the kernel has none of them (`kernels_lab/decode_overlap.py`'s
# docstring has the numbers): each program asking for its weight rows into L2 before the wait
# (one `cp.async.bulk.prefetch` a warp; the BF16 step 3.326 ms against 2.851), Triton's software
# pipeliner on the loop (`num_stages` 3: 2.883 against 2.851; the loop keeps `num_stages=1`), and
# the next step's weights held in registers while a step computes (2.509 against 2.410).
#
# **SwiGLU in the epilogue** (`swiglu=True`). `silu(gate) * up` needs, for output `i`, rows `i`
# and `I + i` of the gate-up matrix and nothing else. A program takes `BLOCK_N / 2` gate rows and
# their up rows in one tile (the same bytes and programs), and its epilogue writes the activation
# instead of the two halves: no `silu_mul` launch, and the down projection reads half as many
# numbers. The rounding follows the two launches it replaces step by step (the GEMV's bf16 store,
# then SiLU rounded like `F.silu`), so the bits are theirs (tested below); the compiled loop is
# the plain one's. The Qwen3-4B step: 2.631 ms against 2.706 with `silu_mul` launched
# (`kernels_lab/decode_overlap.py bf16`).
#
# **The rows layout** (`_gemv_rows_kernel`, `layout="rows"`), chapter 10's int4 GEMV layout for
# BF16 and int8. `_gemv_kernel` leaves the placement of its `[BLOCK_N, BLOCK_K]` tile on threads to
# Triton; here it is explicit: a program's `BLOCK_N` rows are a tuple of tensors `[SLABS, 32,
# CHUNK]`, so each thread takes the *same* CHUNK inputs of every row of the program, each warp a
# slab of K. x's chunk is loaded and converted once for all the rows, and a thread has every
# row's load in flight at once. It wins for the gate-up shape only, so `gemv_layout` picks it
# there (BF16, and int8 from `GEMV_ROWS_INT8_MIN_N` outputs on): in the chain lab the BF16 gate-up
# takes 23.91 µs a matrix against the tile kernel's 25.69 (4.17 TB/s; `kernels_lab/gemv_rows.py`),
# and the int8 decode step 1.679 ms against 1.702 (`kernels_lab/decode_overlap.py int8`).
#
# **Several rows of x in the rows layout** (up to `GEMV_ROWS_LAYOUT_MAX_ROWS`, 8: a verify step's
# 1 + k rows, chapter 08c). Each thread's chunk of every weight row is converted once and
# multiplied by the same chunk of each row of x, into `BLOCK_N × ROWS` accumulators. Rows add
# instructions, not bytes: five rows are five multiply-adds a weight, and an H100 SM issues about
# 18 instructions per bf16 weight it receives at full bandwidth (an H200 about 14). So the loop
# does nothing else it can avoid: each chunk's products chain into their accumulator
# (`_chunk_values`), bf16 becomes fp32 by one shift or one mask (`_bf16x2_to_f32`), and several
# rows take their norms handed off by the GEMV before (`gemv_hands_off_norms`): 8.2 instructions
# a weight at 5 rows, 5 of them the multiply-adds (`kernels_lab/gemv_sass.py`;
# `tests/test_gemv_sass.py` keeps it so). It still reads no faster than cuBLAS: at 5 rows on an
# H100 it is behind on qkv, o, gate-up and down (down 28.5 µs against 25.3) and ahead only on the
# LM head, and the k = 4 verify step of random Qwen3-4B in its best tiles takes **1.34x** a decode
# step against cuBLAS's 1.30x (`LAB_FOLD=handoff LAB_BEST_OUT=rows.json python3
# kernels_lab/few_rows_matmul.py 5`, then `LAB_ROWS_CONFIGS=rows.json python3
# kernels_lab/verify_step.py bf16`). So chapter 09a sends BF16 steps of 2-16 rows to the
# tensor-core matmul of chapter 09_kernels_rows_matmul instead (`decode_matmul`), and the
# several-row form is there for the tests and the lab.
#
# **The add + RMSNorm folded in** (`norm`, `residual`). `gemv(x, w, norm=g, eps=...)` multiplies
# x by the norm weight as it loads it and sums x² on the side (`_normed_x`); the program, which
# reads all of x anyway, scales its sums by 1/rms at the end (`_norm_scale`). `residual=r` adds r
# to the output in the epilogue, rounded as the separate add would find it (the bits of the GEMV
# followed by `add_rmsnorm`'s add: tested below). Chapter 09a then runs a batch-1 layer as four
# launches: qkv(norm(x)), attention, x + o(·), gate-up(norm(·)) with SiLU-mul, h + down(·). The
# norm's arithmetic differs from `rmsnorm` followed by the GEMV (x·g is never rounded to bf16), so
# logits agree within bf16, not bit for bit (tests/test_gpu.py). `gemv_folds_norms` takes it for
# 2-byte weights: the BF16 step 2.451 ms against 2.464 unfolded, the int8 step 1.842 against 1.795
# (its tiles share each x value among only 4 rows: the extra load and multiply per x value cost
# more than the launches; int8 hands its norms off instead, below).

# %%
#| export
GEMV_MAX_ROWS = 4  # the tile layout's limit (and chapter 10's int4 GEMV's)
GEMV_ROWS_LAYOUT_MAX_ROWS = 8  # the rows layout's: a verify step of 1 + 7 drafts


def gemv_folds_norms(weight: torch.Tensor, rows: int = 1) -> bool:
    """Whether a decode step of `rows` rows folds its add + RMSNorm into the GEMVs of `weight`'s format (`norm`,
    `residual`; below): for one row of 2-byte weights (int8's tiles measured slower with it)."""
    return weight.element_size() == 2 and rows == 1


def gemv_hands_off_norms(weight: torch.Tensor, rows: int = 1) -> bool:
    """Whether a decode step of `rows` rows hands its norms between the GEMVs of `weight`'s format instead (`gemv`'s
    `hand_off` and `norm_sums`): for 1-byte weights (int8; chapter 10's int4, two to a byte, in its own GEMV), and
    for several rows (the rows layout: a norm folded in costs its loop a multiply and a square a row and input)."""
    return weight.element_size() == 1 or rows > 1


GEMV_ROWS_MAX_N = 65536  # `_gemv_rows_kernel` for fewer rows than this: the LM head (151,936 rows) keeps the tile kernel
GEMV_ROWS_INT8_MIN_N = (
    16384  # int8 short rows (k < 4096) through the rows kernel from this many outputs on (gate-up)
)


def gemv_layout(n: int, k: int, weight_bytes: int = 2, rows: int = 1) -> str:
    """The GEMV kernel for an [n, k] weight at `rows` input rows: 'rows' (`_gemv_rows_kernel`, below) for several
    rows, and at one row for the gate-up shape in BF16 and int8 (int8 from GEMV_ROWS_INT8_MIN_N outputs on), where
    the chain lab and the decode step measured it faster, else 'tile' (`_gemv_kernel`)."""
    if rows > 1:
        return "rows"
    if (
        n < GEMV_ROWS_MAX_N
        and k < 4096
        and (
            (weight_bytes == 2 and 16384 <= n and 512 <= k)
            or (weight_bytes == 1 and GEMV_ROWS_INT8_MIN_N <= n)
        )
    ):
        return "rows"
    return "tile"


def gemv_config(
    n: int, k: int, weight_bytes: int = 2, layout: str | None = None, rows: int = 1
) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an [n, k] weight of 2-byte or 1-byte (int8) elements in `layout` (default
    `gemv_layout`'s): the sweeps' winners as a rule (kernels_lab/gemv_chain_sweep.py and gemv_rows.py: 36 matrices of
    a shape in one graph; the LM head from kernels_lab/gemv.py)."""
    if (layout or gemv_layout(n, k, weight_bytes, rows)) == "rows":
        if (
            weight_bytes == 1
        ):  # int8: 8 rows, 8 bytes of each a thread and step, 2 warps; fewer outputs 2, 16 bytes, 1
            return (8, 512, 2) if n >= 16384 else (2, 512, 1)
        return (
            4,
            2 * 32 * 16 // weight_bytes,
            2,
        )  # 4 rows, 16 bytes of each a thread and step, 2 warps
    if (
        weight_bytes == 1 and n < 65536
    ):  # int8 (its LM head takes BF16's tile: the decode step's sweep)
        return (4, 2048, 4) if k >= 4096 else ((4, 1024, 4) if n < 16384 else (8, 512, 2))
    if k >= 4096:  # long rows (o, down): wide K tiles, few rows a program
        return 2, 1024, 4
    if n < 16384:  # qkv
        return 8, 512, 4
    return (4, 512, 4) if n < 65536 else (4, 512, 2)  # gate-up; the LM head


@triton.jit
def _int8x4_to_f32(w):
    "int8 -> fp32 on an NVIDIA GPU, four weights a register: w + 128 (XOR of the sign bits) placed under 2^23's exponent."
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 u;
        xor.b32 u, $4, 0x80808080;
        prmt.b32 $0, u, 0x4B000000, 0x7440;
        prmt.b32 $1, u, 0x4B000000, 0x7441;
        prmt.b32 $2, u, 0x4B000000, 0x7442;
        prmt.b32 $3, u, 0x4B000000, 0x7443;
        sub.f32 $0, $0, 0f4B000080;
        sub.f32 $1, $1, 0f4B000080;
        sub.f32 $2, $2, 0f4B000080;
        sub.f32 $3, $3, 0f4B000080;
        }""",
        constraints="=r,=r,=r,=r,r",
        args=[w],
        dtype=tl.float32,
        is_pure=True,
        pack=4,
    )


@triton.jit
def _bf16x2_to_f32(v):
    "bf16 -> fp32 on an NVIDIA GPU, two values a register: one shift or one mask each (the compiler's way: up to two)."
    return tl.inline_asm_elementwise(
        asm="""{
        shl.b32 $0, $2, 16;
        and.b32 $1, $2, 0xFFFF0000;
        }""",
        constraints="=r,=r,r",
        args=[v],
        dtype=tl.float32,
        is_pure=True,
        pack=2,
    )


@triton.jit
def _as_f32(w, BYTE_ASM: tl.constexpr):
    "A weight tile in fp32. int8 through the float's bits (2^23 + byte), not the int->float unit: that runs at a quarter rate."
    if w.dtype == tl.int8:
        if BYTE_ASM:  # compiled for the GPU (the interpreter runs no PTX)
            return _int8x4_to_f32(w)
        bits = (
            w.to(tl.uint8, bitcast=True).to(tl.uint32) ^ 0x80
        ) | 0x4B000000  # 2^23 + (w + 128), exactly
        return bits.to(tl.float32, bitcast=True) - 8388736.0  # - (2^23 + 128)
    return w.to(tl.float32)


@triton.jit
def _nibbles_to_f32(b, BYTE_ASM: tl.constexpr):
    """A uint8 tile -> (128 + low nibble, 128 + high nibble / 16) in fp32, exactly: the low nibble in the mantissa
    bits 16-19 of 128 (0x43000000), the high one in bits 12-15 (chapter 10c tells the trick; its int4 GEMV and
    `rows_matmul` read chapter 10's nibbles through it)."""
    if (
        BYTE_ASM
    ):  # compiled for an NVIDIA GPU: per four bytes three shifts, per weight one LOP3 (and + or)
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 l, r, t;
            shl.b32 l, $8, 8;
            shr.b32 r, $8, 8;
            prmt.b32 t, $8, 0, 0x1032;
            lop3.b32 $0, t, 0x000F0000, 0x43000000, 0xEA;
            lop3.b32 $1, l, 0x000F0000, 0x43000000, 0xEA;
            lop3.b32 $2, $8, 0x000F0000, 0x43000000, 0xEA;
            lop3.b32 $3, r, 0x000F0000, 0x43000000, 0xEA;
            lop3.b32 $4, l, 0x0000F000, 0x43000000, 0xEA;
            lop3.b32 $5, $8, 0x0000F000, 0x43000000, 0xEA;
            lop3.b32 $6, r, 0x0000F000, 0x43000000, 0xEA;
            lop3.b32 $7, t, 0x0000F000, 0x43000000, 0xEA;
            }""",
            constraints="=r,=r,=r,=r,=r,=r,=r,=r,r",
            args=[b],
            dtype=(tl.float32, tl.float32),
            is_pure=True,
            pack=4,
        )
    b = b.to(tl.int32)
    low = ((b & 0x0F) << 16) | 0x43000000
    high = ((b >> 4) << 12) | 0x43000000
    return low.to(tl.float32, bitcast=True), high.to(tl.float32, bitcast=True)


@triton.jit
def _rows_f32(v, BYTE_ASM: tl.constexpr):
    "A rows-layout operand (weights, x, the norm's weight) in fp32: bf16 by `_bf16x2_to_f32` where compiled, else `_as_f32`."
    if v.dtype == tl.bfloat16 and BYTE_ASM:
        return _bf16x2_to_f32(v)
    return _as_f32(v, BYTE_ASM)


@triton.jit
def _start_gemv(PDL: tl.constexpr, WAIT: tl.constexpr):
    """A GEMV program's start. Launched as a dependent (PDL): let the next kernel launch, then (WAIT) wait for this
    one's input (without WAIT the program waits later, after asking for its first weights: `EARLY_W`)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        if WAIT:
            tl.extra.cuda.gdc_wait()


@triton.jit
def _normed_x(x, sq, g_ptr, at, ok, NORM: tl.constexpr):
    """A GEMV step's inputs x (fp32) as the matmul takes them. With NORM (an RMSNorm folded in): x's squares added to
    `sq`, and x times the norm's weight at inputs `at`; the norm's 1 / rms scales the outputs at the end."""
    if NORM:
        sq += x * x
        x = x * tl.load(g_ptr + at, mask=ok, other=0.0).to(tl.float32)
    return x, sq


@triton.jit
def _norm_scale(sq, K, eps):
    "1 / rms of x from its summed squares (`_normed_x`), as `_add_rmsnorm_kernel` computes it."
    return 1.0 / tl.sqrt(sq / K + eps)


@triton.jit
def _gemv_step(
    acc,
    sq,
    x_rows,
    w_rows,
    g_ptr,
    k,
    K,
    m_ok,
    n_ok,
    EVEN_K: tl.constexpr,
    ROWS: tl.constexpr,
    BYTE_ASM: tl.constexpr,
    NORM: tl.constexpr,
    w=None,
):
    """(acc + one step of the GEMV, sq): inputs k of x's rows and of the weight rows (`w`: that tile, already loaded);
    `sq`, `g_ptr`, NORM: `_normed_x`."""
    if EVEN_K:
        if w is None:
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0)
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None], other=0.0)
    else:
        if w is None:
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k[None, :] < K), other=0)
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & (k[None, :] < K), other=0.0)
    x, sq = _normed_x(x.to(tl.float32), sq, g_ptr, k[None, :], (k < K)[None, :] | EVEN_K, NORM)
    if ROWS == 1:
        acc += x * _as_f32(w, BYTE_ASM)  # x [1, BLOCK_K] broadcast over the rows of w
    else:
        acc += x[:, None, :] * _as_f32(w, BYTE_ASM)[None, :, :]
    return acc, sq


@triton.jit
def _step_inputs(w_ptr, k0, offs_k):
    "The inputs of a GEMV step from k0; int8 weights: loaded 8 bytes at a time, as x's 8 bf16 (both share one layout)."
    k = k0 + offs_k
    return tl.max_contiguous(k, 8) if w_ptr.dtype.element_ty == tl.int8 else k


@triton.jit
def _tile_constants(
    scale_ptr,
    b_ptr,
    next_g_ptr,
    offs_n,
    n_ok,
    BLOCK_N: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAND_OFF: tl.constexpr,
):
    """A tile GEMV's epilogue constants, fp32 [BLOCK_N]: its rows' scales, biases and (HAND_OFF) the next norm's
    weights (zeros where there are none: unused, compiled away)."""
    none = tl.zeros([BLOCK_N], dtype=tl.float32)
    scale = tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32) if HAS_SCALE else none
    bias = tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32) if HAS_BIAS else none
    next_g = tl.load(next_g_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32) if HAND_OFF else none
    return scale, bias, next_g


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    b_ptr,
    g_ptr,
    res_ptr,
    out_ptr,
    sums_ptr,
    next_g_ptr,
    normed_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_rm,
    stride_om,
    eps,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
    BYTE_ASM: tl.constexpr,
    SWIGLU: tl.constexpr,
    EARLY_W: tl.constexpr,
    NORM: tl.constexpr,
    RESIDUAL: tl.constexpr,
    NORM_SUMS: tl.constexpr,
    HAND_OFF: tl.constexpr,
):
    _start_gemv(PDL, not EARLY_W)
    if SWIGLU:  # rows [gate | up] of the gate-up matrix: a program takes BLOCK_N / 2 gate rows and their up rows
        lane = tl.arange(0, BLOCK_N)
        cols = tl.program_id(0) * (BLOCK_N // 2) + lane % (
            BLOCK_N // 2
        )  # the output columns (of N / 2)
        offs_n, n_ok = cols + (lane // (BLOCK_N // 2)) * (N // 2), cols < N // 2
    else:
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
    offs_m, offs_k = tl.arange(0, ROWS), tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    out_ok = m_ok[:, None] & n_ok[None, :]
    w_rows = (
        w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    )  # the LM head has 389M elements: int64 offsets
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    # one row (decode): a 2-D tile in the weights' own layout; more rows: [ROWS, BLOCK_N, BLOCK_K] (its layout
    # differs from the loads', which costs a trip through shared memory per step)
    acc = tl.zeros((BLOCK_N, BLOCK_K) if ROWS == 1 else (ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
    sq = tl.zeros(
        (ROWS, BLOCK_K), dtype=tl.float32
    )  # NORM: x's squares (unused, and compiled away, without)
    first = 0
    if EARLY_W:  # the first step's weights asked for before waiting for x: they do not depend on the kernel before
        # (step 0's inputs in the form of the loop's, k0 + offs_k, k0 unknown to the compiler: with a plain 0 it gave
        # int8 16-byte loads and moved every later step's tile through shared memory into that layout)
        k = _step_inputs(w_ptr, tl.program_id(1) * BLOCK_K, offs_k)
        w = tl.load(
            w_rows + k[None, :],
            mask=n_ok[:, None] if EVEN_K else n_ok[:, None] & (k < K)[None, :],
            other=0,
        )
        _wait_for_previous(PDL)
        acc, sq = _gemv_step(
            acc, sq, x_rows, w_rows, g_ptr, k, K, m_ok, n_ok, EVEN_K, ROWS, BYTE_ASM, NORM, w
        )
        first = BLOCK_K
    if NORM_SUMS:  # x came normalised but for its 1 / rms; its squares, summed by the GEMV before (HAND_OFF): asked
        handed = tl.load(
            sums_ptr + offs_m, mask=m_ok, other=0.0
        )  # for once x is there, used at the end
    for k0 in tl.range(
        first, K, BLOCK_K, num_stages=1
    ):  # the loop as written (pipelined by Triton: slower, above)
        acc, sq = _gemv_step(
            acc,
            sq,
            x_rows,
            w_rows,
            g_ptr,
            _step_inputs(w_ptr, k0, offs_k),
            K,
            m_ok,
            n_ok,
            EVEN_K,
            ROWS,
            BYTE_ASM,
            NORM,
        )
    # the epilogue's operands, asked for together: one wait for all of them (asked for before the loop they hold
    # registers through it, and some GEMVs then fit fewer programs an SM: measured slower)
    scale, bias, next_g = _tile_constants(
        scale_ptr, b_ptr, next_g_ptr, offs_n, n_ok, BLOCK_N, HAS_SCALE, HAS_BIAS, HAND_OFF
    )
    if RESIDUAL:
        residual = tl.load(
            res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=out_ok, other=0.0
        )
    out = tl.sum(acc, axis=1)[None, :] if ROWS == 1 else tl.sum(acc, axis=2)  # [ROWS, BLOCK_N]
    if NORM:
        out *= _norm_scale(tl.sum(sq, axis=1), K, eps)[:, None]
    if NORM_SUMS:
        out *= _norm_scale(handed, K, eps)[:, None]
    if HAS_SCALE:
        out *= scale[None, :]
    if HAS_BIAS:
        out += bias[None, :]
    if SWIGLU:  # silu(gate) * up, rounded at each step as the GEMV's stores and `_silu_mul_kernel` round them
        half: tl.constexpr = BLOCK_N // 2
        h = out.to(out_ptr.dtype.element_ty).to(tl.float32)
        gate, up = tl.split(
            tl.permute(tl.reshape(h, [ROWS, 2, half]), [0, 2, 1])
        )  # [ROWS, half] each
        cols = tl.program_id(0) * half + tl.arange(0, half)
        tl.store(
            out_ptr + offs_m[:, None] * stride_om + cols[None, :],
            _silu_times(gate, up, out_ptr.dtype.element_ty),
            mask=m_ok[:, None] & (cols < N // 2)[None, :],
        )
    else:
        if (
            RESIDUAL
        ):  # added to the output as rounded (as a separate add after the GEMV's store would)
            out = out.to(out_ptr.dtype.element_ty).to(tl.float32) + residual.to(tl.float32)
        tl.store(
            out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_ok,
        )
        if HAND_OFF:  # the next RMSNorm's work but its 1 / rms: h (as stored) x the norm's weight, and h's squares,
            h = out.to(out_ptr.dtype.element_ty).to(
                tl.float32
            )  # summed over the programs into sums_ptr
            tl.store(
                normed_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
                (h * next_g[None, :]).to(out_ptr.dtype.element_ty),
                mask=out_ok,
            )
            tl.atomic_add(
                sums_ptr + offs_m,
                tl.sum(tl.where(out_ok, h * h, 0.0), axis=1),
                mask=m_ok,
                sem="relaxed",
            )


@triton.jit
def _program_row(first_col, r, N, HALF_N: tl.constexpr, SWIGLU: tl.constexpr):
    """The weight row of a rows-layout program's r-th row, and whether it exists: with SWIGLU, HALF_N gate rows, then
    their up rows (N // 2 further on). (Chapter 10's int4 GEMV takes the same rows.)"""
    if SWIGLU:
        col = first_col + r % HALF_N
        return col + (r // HALF_N) * (N // 2), col < N // 2
    return first_col + r, first_col + r < N


@triton.jit
def _rows_chunk(k0, lane, K, CHUNK: tl.constexpr, EVEN: tl.constexpr):
    """A step's inputs in a rows-layout program: each thread's CHUNK from k0 + lane * CHUNK on ([SLABS, 32, CHUNK]
    offsets), and which exist."""
    at = (
        tl.multiple_of(k0 + lane * CHUNK, [CHUNK, CHUNK])[:, :, None]
        + tl.arange(0, CHUNK)[None, None, :]
    )
    return at, (at < K) | EVEN


@triton.jit
def _rows_weights(w_ptr, rows, row_ok, at, ok, BLOCK_N: tl.constexpr):
    """One step's weights: for each of the program's rows (`rows`: their offsets), this thread's inputs `at`; every
    row's loads in flight at once."""
    ws = ()
    for r in tl.static_range(BLOCK_N):
        ws = ws + (tl.load(w_ptr + rows[r] + at, mask=ok & row_ok[r], other=0),)
    return ws


@triton.jit
def _chunk_values(t, CHUNK: tl.constexpr):
    """t [SLABS, 32, CHUNK] as CHUNK tensors [SLABS, 32]: a thread's chunk one value at a time (halved and split; the
    order is the same for every tensor so split)."""
    pieces = (t,)
    for _ in tl.static_range(CHUNK.bit_length() - 1):
        halves = ()
        for i in tl.static_range(len(pieces)):
            p = pieces[i]
            a, b = tl.split(tl.reshape(p, [p.shape[0], p.shape[1], p.shape[2] // 2, 2]))
            halves = halves + (a, b)
        pieces = halves
    values = ()
    for i in tl.static_range(CHUNK):
        values = values + (tl.reshape(pieces[i], [t.shape[0], t.shape[1]]),)
    return values


@triton.jit
def _rows_step(
    accs,
    sqs,
    ws,
    x_ptr,
    stride_xm,
    g_ptr,
    at,
    ok,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
    BYTE_ASM: tl.constexpr,
    NORM: tl.constexpr,
):
    """(accs + one step, sqs): each of x's ROWS rows at inputs `at` (loaded and converted once for every weight row)
    times each weight row's `ws` (converted once for every x row); accs[r * ROWS + m] for weight row r and x row m,
    each a chain of multiply-adds over the thread's chunk (`_chunk_values`: no separate multiply and add).
    With NORM (`_normed_x`): x times the norm's weight (loaded once for all rows), its squares added to sqs[m].
    One row (the decode step's gate-up) keeps the loop the chain lab measured: products summed per step."""
    if ROWS == 1:
        x, sq = _normed_x(
            tl.load(x_ptr + at, mask=ok, other=0.0).to(tl.float32), sqs[0], g_ptr, at, ok, NORM
        )
        new, new_sqs = (), (sq,)
        for r in tl.static_range(BLOCK_N):
            new = new + (accs[r] + tl.sum(x * _as_f32(ws[r], BYTE_ASM), axis=2),)
    else:
        wf = ()
        for r in tl.static_range(BLOCK_N):
            wf = wf + (_chunk_values(_rows_f32(ws[r], BYTE_ASM), CHUNK),)
        if NORM:
            g = _chunk_values(_rows_f32(tl.load(g_ptr + at, mask=ok, other=0.0), BYTE_ASM), CHUNK)
        xs, new_sqs = (), ()
        for m in tl.static_range(ROWS):
            x = tl.load(x_ptr + m * stride_xm + at, mask=ok, other=0.0)
            x = _chunk_values(_rows_f32(x, BYTE_ASM), CHUNK)
            sq = sqs[m]
            if NORM:
                normed = ()
                for c in tl.static_range(CHUNK):
                    sq += x[c] * x[c]
                    normed = normed + (x[c] * g[c],)
                x = normed
            xs, new_sqs = xs + (x,), new_sqs + (sq,)
        new = ()
        for r in tl.static_range(BLOCK_N):
            for m in tl.static_range(ROWS):
                acc = accs[r * ROWS + m]
                for c in tl.static_range(CHUNK):
                    acc += xs[m][c] * wf[r][c]
                new = new + (acc,)
    return new, new_sqs


@triton.jit
def _rows_constants(
    scale_ptr,
    b_ptr,
    first_col,
    N,
    BLOCK_N: tl.constexpr,
    SWIGLU: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    "A rows-layout program's epilogue constants, fp32: (each row's scale, each row's bias), each () where there are none."
    scales, biases = (), ()
    for r in tl.static_range(BLOCK_N):
        row, real = _program_row(first_col, r, N, BLOCK_N // 2, SWIGLU)
        if HAS_SCALE:
            scales = scales + (tl.load(scale_ptr + row, mask=real, other=0.0).to(tl.float32),)
        if HAS_BIAS:
            biases = biases + (tl.load(b_ptr + row, mask=real, other=0.0).to(tl.float32),)
    return scales, biases


@triton.jit
def _rows_epilogue_operands(
    res_ptr,
    next_g_ptr,
    first_col,
    M,
    N,
    stride_rm,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RESIDUAL: tl.constexpr,
    HAND_OFF: tl.constexpr,
):
    """A rows-layout program's epilogue operands, fp32 (no SwiGLU): the residual at each (row r, x row m),
    r * ROWS + m, and (HAND_OFF) the next norm's weight at each row r. (Chapter 10's int4 GEMV's too.)"""
    residuals, next_gs = (), ()
    for r in tl.static_range(BLOCK_N):
        row = first_col + r
        if HAND_OFF:
            next_gs = next_gs + (tl.load(next_g_ptr + row, mask=row < N, other=0.0).to(tl.float32),)
        for m in tl.static_range(ROWS if RESIDUAL else 0):
            residuals = residuals + (
                tl.load(res_ptr + m * stride_rm + row, mask=(row < N) & (m < M), other=0.0).to(
                    tl.float32
                ),
            )
    return residuals, next_gs


@triton.jit
def _gemv_rows_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    b_ptr,
    g_ptr,
    res_ptr,
    out_ptr,
    sums_ptr,
    next_g_ptr,
    normed_ptr,
    N,
    K,
    stride_wn,
    stride_xm,
    stride_rm,
    stride_om,
    eps,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr,
    SLABS: tl.constexpr,
    EVEN: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
    BYTE_ASM: tl.constexpr,
    SWIGLU: tl.constexpr,
    EARLY_W: tl.constexpr,
    NORM: tl.constexpr,
    RESIDUAL: tl.constexpr,
    NORM_SUMS: tl.constexpr,
    HAND_OFF: tl.constexpr,
):
    _start_gemv(PDL, not EARLY_W)
    STEP: tl.constexpr = (
        SLABS * 32 * CHUNK
    )  # inputs of a row per step: a slab of 32 x CHUNK per warp
    HALF_N: tl.constexpr = BLOCK_N // 2
    lane = (
        tl.arange(0, SLABS)[:, None] * 32 + tl.arange(0, 32)[None, :]
    )  # [SLABS, 32]: a thread's place in a step
    first_col = tl.program_id(0) * (
        HALF_N if SWIGLU else BLOCK_N
    )  # the program's first output column
    rows, row_ok = (), ()
    for r in tl.static_range(BLOCK_N):
        row, real = _program_row(first_col, r, N, HALF_N, SWIGLU)
        rows, row_ok = rows + (row.to(tl.int64) * stride_wn,), row_ok + (real | EVEN,)
    accs = (tl.zeros((SLABS, 32), dtype=tl.float32),) * (
        BLOCK_N * ROWS
    )  # [weight row r, x row m] at r * ROWS + m
    sqs = (  # NORM: each x row's squares (`_rows_step`)
        tl.zeros((SLABS, 32, CHUNK) if ROWS == 1 else (SLABS, 32), dtype=tl.float32),
    ) * ROWS
    first = 0
    if EARLY_W:  # the first step's weights asked for before waiting for x (as `_gemv_kernel`)
        at, ok = _rows_chunk(0, lane, K, CHUNK, EVEN)
        ws = _rows_weights(w_ptr, rows, row_ok, at, ok, BLOCK_N)
        _wait_for_previous(PDL)
        accs, sqs = _rows_step(
            accs, sqs, ws, x_ptr, stride_xm, g_ptr, at, ok, BLOCK_N, ROWS, CHUNK, BYTE_ASM, NORM
        )
        first = STEP
    handed = ()  # NORM_SUMS: (as `_gemv_kernel`'s) each x row's, asked for once x is there
    for m in tl.static_range(ROWS if NORM_SUMS else 0):
        handed = handed + (tl.load(sums_ptr + m),)
    for k0 in tl.range(first, K, STEP):
        at, ok = _rows_chunk(k0, lane, K, CHUNK, EVEN)
        accs, sqs = _rows_step(
            accs,
            sqs,
            _rows_weights(w_ptr, rows, row_ok, at, ok, BLOCK_N),
            x_ptr,
            stride_xm,
            g_ptr,
            at,
            ok,
            BLOCK_N,
            ROWS,
            CHUNK,
            BYTE_ASM,
            NORM,
        )
    scales, biases = _rows_constants(
        scale_ptr, b_ptr, first_col, N, BLOCK_N, SWIGLU, HAS_SCALE, HAS_BIAS
    )  # together
    residuals, next_gs = _rows_epilogue_operands(  # (as `_gemv_kernel`'s) residuals at r * ROWS + m
        res_ptr, next_g_ptr, first_col, ROWS, N, stride_rm, ROWS, BLOCK_N, RESIDUAL, HAND_OFF
    )
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    for m in tl.static_range(ROWS):
        rstd = 1.0
        if NORM:
            squares = tl.sum(sqs[m], axis=2) if ROWS == 1 else sqs[m]
            rstd = _norm_scale(tl.sum(tl.sum(squares, axis=1), axis=0), K, eps)
        if NORM_SUMS:
            rstd = _norm_scale(handed[m], K, eps)
        outs = ()
        for r in tl.static_range(BLOCK_N):
            total = tl.sum(tl.sum(accs[r * ROWS + m], axis=1), axis=0)
            if NORM or NORM_SUMS:
                total *= rstd
            if HAS_SCALE:
                total *= scales[r]
            if HAS_BIAS:
                total += biases[r]
            outs = outs + (total,)
        squares = 0.0  # HAND_OFF: this program's share of h's squares
        for r in tl.static_range(HALF_N if SWIGLU else BLOCK_N):
            row, real = _program_row(first_col, r, N, HALF_N, SWIGLU)
            if SWIGLU:  # silu(gate) * up, rounded as `_gemv_kernel`'s epilogue rounds them
                gate = outs[r].to(dtype).to(tl.float32)
                up = outs[r + HALF_N].to(dtype).to(tl.float32)
                tl.store(out_ptr + m * stride_om + row, _silu_times(gate, up, dtype), mask=real)
            else:
                h = outs[r]
                if RESIDUAL:  # added as rounded, as `_gemv_kernel`'s
                    h = h.to(dtype).to(tl.float32) + residuals[r * ROWS + m]
                tl.store(out_ptr + m * stride_om + row, h.to(dtype), mask=real)
                if (
                    HAND_OFF
                ):  # (as `_gemv_kernel`'s) h x the next norm's weight stored, h's squares summed
                    h = h.to(dtype).to(tl.float32)
                    tl.store(
                        normed_ptr + m * stride_om + row, (h * next_gs[r]).to(dtype), mask=real
                    )
                    squares += tl.where(real, h * h, 0.0)
        if HAND_OFF:
            tl.atomic_add(sums_ptr + m, squares, sem="relaxed")


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias=None, scale=None) -> torch.Tensor:
    "PyTorch: `F.linear`, the weight converted to x's dtype and each output scaled where it is int8."
    out = F.linear(x, weight.to(x.dtype))
    if scale is not None:
        out = out * scale.to(x.dtype)
    return out if bias is None else out + bias


def gemv_folds_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    *,
    swiglu: bool = False,
    out: torch.Tensor | None = None,
    norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    norm_sums: torch.Tensor | None = None,
    hand_off: tuple[torch.Tensor, torch.Tensor] | None = None,
    backend: str = "torch",
):
    """PyTorch: what `gemv` returns with these folds (its arguments, checked by it), each step a launch of its own
    (`backend`'s SiLU-mul). Also the reference of chapter 09's tensor-core matmul for several rows."""
    if norm is not None:
        x = add_rmsnorm_reference(x, None, norm, eps)[0]
    if norm_sums is not None:
        x = (x.float() * torch.rsqrt(norm_sums[:, None] / x.shape[1] + eps)).to(x.dtype)
    result = gemv_reference(x, weight, bias, scale)
    return output_folds(
        result, swiglu=swiglu, out=out, residual=residual, hand_off=hand_off, backend=backend
    )


def output_folds(
    result: torch.Tensor,
    *,
    swiglu: bool = False,
    out: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    hand_off: tuple[torch.Tensor, torch.Tensor] | None = None,
    backend: str = "torch",
):
    """The folds `gemv` applies to a product already made (`result`, [M, N]), each a launch of its own: SiLU-mul
    (`swiglu`), the residual add, `out`, the hand-off to the next norm (its squares summed into hand_off[1])."""
    if swiglu:
        return silu_mul(result, backend)
    if residual is not None:
        result = residual + result
    result = result if out is None else out.copy_(result)
    if hand_off is None:
        return result
    hand_off[1].add_(result.float().square().sum(-1))
    return result, result * hand_off[0].to(result.dtype)


def hand_off_operands(
    out: torch.Tensor, norm_sums: torch.Tensor | None, hand_off: tuple | None, unused: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GEMV launch's (sums, next norm's weight, normed output) for its folds `norm_sums` / `hand_off` (the normed
    output new, shaped as `out`); `unused` in the places the launch does not read (also chapter 10's int4 GEMV)."""
    if hand_off is None:
        return (unused if norm_sums is None else norm_sums), unused, unused
    return hand_off[1], hand_off[0], torch.empty_like(out)


def check_gemv_folds(
    kernel: str,
    x: torch.Tensor,
    n: int,
    swiglu: bool,
    residual: torch.Tensor | None,
    norm_sums: torch.Tensor | None,
    hand_off: tuple | None,
):
    """Raise a ValueError naming `kernel` where a GEMV's epilogue folds (`gemv`'s `residual`, `norm_sums`, `hand_off`,
    also chapter 10's int4 GEMV's) do not fit x [M, K] and N outputs."""
    m = x.shape[0]
    if residual is not None and (swiglu or residual.shape != (m, n) or residual.stride(-1) != 1):
        raise ValueError(
            f"{kernel}'s residual must be [{m}, {n}] with unit stride in its last dimension (and no "
            f"swiglu), got {tuple(residual.shape)}"
        )
    for name, sums in (
        ("norm_sums", norm_sums),
        ("hand_off's sums", None if hand_off is None else hand_off[1]),
    ):
        if sums is not None and (
            sums.dtype != torch.float32 or sums.shape != (m,) or sums.device != x.device
        ):
            raise ValueError(
                f"{kernel}'s {name} must be float32 [{m}] on {x.device}, got {sums.dtype} "
                f"{tuple(sums.shape)} on {sums.device}"
            )
    if hand_off is not None and (residual is None or hand_off[0].shape != (n,)):
        raise ValueError(
            f"{kernel}'s hand_off needs a residual and a norm weight [{n}], got "
            f"{'no residual' if residual is None else 'a residual'} and {tuple(hand_off[0].shape)}"
        )


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    impl: str = "auto",
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    pdl: bool | None = None,
    byte_asm: bool | None = None,
    swiglu: bool = False,
    out: torch.Tensor | None = None,
    early_weights: bool = True,
    layout: str | None = None,
    norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    norm_sums: torch.Tensor | None = None,
    hand_off: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """x [M, K] (M <= GEMV_MAX_ROWS) @ weight [N, K].T (x scale[N] for int8 weights) (+ bias) -> [M, N], written into
    `out` where given (contiguous, x's dtype: chapter 09c's all-reduce buffer), else into a new tensor.
    `norm`: an RMSNorm's weight [K]: x is normalised first (`rmsnorm(x, norm, eps)`), inside the GEMV.
    `residual` [M, N]: added to the result (rounded to x's dtype first, as a separate add would find it).
    `hand_off` (with `residual`): (an RMSNorm's weight g [N], sums [M] float32): the norm that follows, handed to the
    GEMV after: returns (h, h x g) for h the result, h's squares added to `sums` (which must start at 0).
    `norm_sums` [M] float32: x is such an h x g, and these its h's squares: x is normalised (x 1 / rms) in the GEMV.
    `swiglu`: weight is a gate-up matrix [gate | up] (N = 2I): -> silu(gate) * up [M, I], in the GEMV's epilogue.
    `byte_asm`: int8 converted by `_int8x4_to_f32`'s PTX (default: whenever compiled, not interpreted).
    `early_weights`: launched as a dependent, each program asks for its first step's weights before it waits for x
    (measured faster; False: it waits first).
    `layout`: 'tile' (`_gemv_kernel`, M <= GEMV_MAX_ROWS) or 'rows' (`_gemv_rows_kernel`, M <= 8); default `gemv_layout`'s
    choice at one row, else 'tile'."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"gemv needs x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if layout not in (None, "tile", "rows"):
        raise ValueError(f"gemv's layout is 'tile' or 'rows', got {layout!r}")
    (m, k), n = x.shape, weight.shape[0]
    one_row_hand_off = m == 1 and hand_off is not None  # (the tile layout's, as measured for int8)
    layout = layout or ("tile" if one_row_hand_off else gemv_layout(n, k, weight.element_size(), m))
    limit = GEMV_ROWS_LAYOUT_MAX_ROWS if layout == "rows" else GEMV_MAX_ROWS
    if m > limit:
        raise ValueError(
            f"gemv takes at most {limit} rows in its {layout} layout, got {m}: use F.linear"
        )
    if weight.dtype == torch.int8 and scale is None:
        raise ValueError("gemv: int8 weights need their per-row scale")
    if swiglu and weight.shape[0] % 2:
        raise ValueError(
            f"gemv with swiglu needs a [gate | up] weight with an even number of rows, got {weight.shape[0]}"
        )
    if out is not None and (
        swiglu or out.shape != (m, n) or out.dtype != x.dtype or not out.is_contiguous()
    ):
        raise ValueError(
            f"gemv's out must be a contiguous {x.dtype} [{m}, {n}] (and no swiglu), got "
            f"{out.dtype} {tuple(out.shape)}{'' if out.is_contiguous() else ' not contiguous'}"
        )
    if norm is not None and norm.shape != (k,):
        raise ValueError(f"gemv's norm is an RMSNorm weight [{k}], got {tuple(norm.shape)}")
    if norm_sums is not None and norm is not None:
        raise ValueError(
            "gemv takes a norm to apply (norm) or the sums of one applied before it (norm_sums), not both"
        )
    check_gemv_folds("gemv", x, n, swiglu, residual, norm_sums, hand_off)
    backend = kernel_backend(x.device, impl)
    if backend == "torch" or x.stride(-1) != 1 or weight.stride(-1) != 1:
        return gemv_folds_reference(
            x, weight, bias, scale, swiglu=swiglu, out=out, norm=norm, eps=eps, residual=residual,
            norm_sums=norm_sums, hand_off=hand_off, backend=backend,
        )  # fmt: skip
    default = gemv_config(
        n, k, weight.element_size(), layout, m
    )  # the measured configuration, where none is asked for
    block_n, block_k, num_warps = (
        block_n or default[0],
        block_k or default[1],
        num_warps or default[2],
    )
    block_k = min(block_k, max(16, _pow2(k)))
    if swiglu and (block_n < 2 or block_n % 2):
        raise ValueError(
            f"gemv with swiglu takes gate rows and their up rows together: an even block_n, got {block_n}"
        )
    out = (
        torch.empty(m, n // 2 if swiglu else n, dtype=x.dtype, device=x.device)
        if out is None
        else out
    )
    pdl = pdl_supported(x.device) if pdl is None else pdl
    early = pdl and early_weights
    grid = (triton.cdiv(out.shape[1], block_n // 2 if swiglu else block_n),)
    sums, next_g, normed = hand_off_operands(out, norm_sums, hand_off, weight)
    operands = (
        x,
        weight,
        *(t if t is not None else weight for t in (scale, bias, norm, residual)),
        out,
        sums,
    )
    folds = dict(
        NORM=norm is not None, RESIDUAL=residual is not None, NORM_SUMS=norm_sums is not None
    )
    byte_asm = not INTERPRETED if byte_asm is None else byte_asm
    if layout == "rows":
        chunk = block_k // (32 * num_warps)  # inputs of a row a thread takes per step
        if chunk < 1 or block_k % (32 * num_warps):
            raise ValueError(
                f"gemv's rows layout steps over 32 x num_warps x a chunk of inputs: block_k {block_k} "
                f"is no multiple of 32 x {num_warps}"
            )
        whole_rows = (n // 2) % (block_n // 2) == 0 if swiglu else n % block_n == 0
        if m:
            _gemv_rows_kernel[grid](
                *operands,
                next_g,
                normed,
                n,
                k,
                weight.stride(0),
                x.stride(0),
                0 if residual is None else residual.stride(0),
                out.stride(0),
                eps,
                ROWS=m,
                BLOCK_N=block_n,
                CHUNK=chunk,
                SLABS=num_warps,
                EVEN=whole_rows and k % block_k == 0,
                HAS_SCALE=scale is not None,
                HAS_BIAS=bias is not None,
                PDL=pdl,
                launch_pdl=pdl,
                BYTE_ASM=byte_asm,
                SWIGLU=swiglu,
                EARLY_W=early,
                **folds,
                HAND_OFF=hand_off is not None,
                num_warps=num_warps,
                **_stages(num_stages),
            )
    elif m:
        _gemv_kernel[grid](
            *operands,
            next_g,
            normed,
            m,
            n,
            k,
            x.stride(0),
            weight.stride(0),
            0 if residual is None else residual.stride(0),
            out.stride(0),
            eps,
            ROWS=max(1, _pow2(m)),
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            EVEN_K=k % block_k == 0,
            HAS_SCALE=scale is not None,
            HAS_BIAS=bias is not None,
            PDL=pdl,
            launch_pdl=pdl,
            BYTE_ASM=byte_asm,
            SWIGLU=swiglu,
            EARLY_W=early,
            **folds,
            HAND_OFF=hand_off is not None,
            num_warps=num_warps,
            **_stages(num_stages),
        )
    return out if hand_off is None else (out, normed)


# %% [markdown]
# Against its PyTorch path: plain, with a bias, with a K that is not a multiple of the tile, in
# bf16, and with int8 weights and their scales.

# %%
# fp32: K <= 1,024 products summed in another order, each add rounding 2^-24 of a partial sum of O(sqrt(K)): ~1e-5 on
# outputs of O(30) (measured 1.9e-5), so 1e-4. bf16: the interpreter truncates the output, PyTorch rounds it: one ulp,
# 2^-7 relative, on outputs of O(16): rtol 2e-2, atol 5e-2
for m, n, k, with_bias in ((1, 12, 64, False), (3, 10, 100, True), (4, 8, 1024, False)):
    x, weight = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    torch.testing.assert_close(
        gemv(x, weight, bias, impl="triton", block_k=64),
        F.linear(x, weight, bias),
        rtol=1e-4,
        atol=1e-4,
    )
    q, scale = (
        torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8),
        torch.rand(n, generator=gen) / 64,
    )
    torch.testing.assert_close(
        gemv(x, q, bias, scale, impl="triton", block_k=64),
        gemv_reference(x, q, bias, scale),
        rtol=1e-4,
        atol=1e-4,
    )
xb, wb = (
    torch.randn(2, 256, generator=gen).bfloat16(),
    torch.randn(16, 256, generator=gen).bfloat16(),
)
torch.testing.assert_close(
    gemv(xb, wb, impl="triton", block_k=128), F.linear(xb, wb), rtol=2e-2, atol=5e-2
)
# `out`: the result written where the caller says (chapter 09c writes into its all-reduce buffer), the same bits
for impl in ("triton", "torch"):
    into = torch.full((2, 16), float("nan")).bfloat16()
    assert gemv(xb, wb, impl=impl, block_k=128, out=into) is into
    assert torch.equal(into, gemv(xb, wb, impl=impl, block_k=128)), impl
with pytest.raises(ValueError, match=r"out must be a contiguous torch.bfloat16 \[2, 16\]"):
    gemv(xb, wb, impl="triton", out=torch.empty(16, 2).bfloat16().t())
# `swiglu`: the gate-up GEMV with SiLU-mul in its epilogue gives the bits of the GEMV followed by `silu_mul`
# in fp32 and bf16, with int8 weights, over 1-2 rows and a K that is not a multiple of the tile
for m, inter, k, dtype, int8 in (
    (1, 24, 64, torch.float32, False),
    (2, 40, 100, torch.float32, True),
    (1, 48, 256, torch.bfloat16, False),
    (1, 20, 64, torch.bfloat16, True),
):
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(2 * inter, k, generator=gen).to(dtype)
    scale = None
    if int8:
        w, scale = (
            torch.randint(-127, 128, (2 * inter, k), generator=gen, dtype=torch.int8),
            torch.rand(2 * inter, generator=gen) / 64,
        )
    want = silu_mul(gemv(x, w, None, scale, impl="triton", block_k=64), impl="triton")
    assert torch.equal(gemv(x, w, None, scale, impl="triton", block_k=64, swiglu=True), want), (
        m,
        inter,
    )
    # fp32: as the GEMV above; bf16: the GEMV's output, SiLU and the product each truncated here: three ulps, 2.3e-2
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=4e-2, atol=4e-2)
    torch.testing.assert_close(
        want.float(), silu_mul_reference(gemv_reference(x, w, None, scale)).float(), **tol
    )
with pytest.raises(ValueError, match="even number of rows"):
    gemv(torch.zeros(1, 8), torch.zeros(3, 8), swiglu=True)
with pytest.raises(ValueError, match="an even block_n, got 3"):
    gemv(
        torch.zeros(1, 64),
        torch.zeros(8, 64),
        impl="triton",
        swiglu=True,
        layout="rows",
        block_n=3,
        block_k=64,
        num_warps=1,
    )
with pytest.raises(ValueError, match="at most 4 rows in its tile layout"):
    gemv(torch.zeros(5, 8), torch.zeros(2, 8), layout="tile")
with pytest.raises(ValueError, match="need their per-row scale"):
    gemv(torch.zeros(1, 8), torch.zeros(2, 8, dtype=torch.int8))
# the rows layout: against the reference in fp32 and bf16, one to eight rows of x, with int8 weights and their scales,
# a bias, rows and inputs that fill no whole program or step; with `swiglu`, the bits of its own GEMV followed by
# `silu_mul`; each of several rows of x the bits it gets among fewer (a row's sums do not depend on the others)
for m, n, k, dtype, int8, with_bias, block_k, warps in (
    (1, 12, 256, torch.float32, False, True, 128, 2),
    (3, 10, 100, torch.float32, True, False, 64, 1),
    (5, 16, 512, torch.bfloat16, False, False, 512, 2),
    (8, 8, 192, torch.bfloat16, True, True, 128, 1),
):
    x, w, scale = (
        torch.randn(m, k, generator=gen).to(dtype),
        torch.randn(n, k, generator=gen).to(dtype),
        None,
    )
    if int8:
        w, scale = (
            torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8),
            torch.rand(n, generator=gen) / 64,
        )
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    rows = dict(impl="triton", layout="rows", block_k=block_k, num_warps=warps)
    tol = (
        dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    )  # as for the tile GEMV
    torch.testing.assert_close(
        gemv(x, w, bias, scale, **rows).float(), gemv_reference(x, w, bias, scale).float(), **tol
    )
    assert torch.equal(
        gemv(x, w, None, scale, swiglu=True, **rows),
        silu_mul(gemv(x, w, None, scale, **rows), impl="triton"),
    ), (n, k, dtype)
    if m > 2:  # (one row takes the loop of its own: its sums add in another order)
        assert torch.equal(
            gemv(x, w, bias, scale, **rows)[-2:], gemv(x[-2:], w, bias, scale, **rows)
        ), m
assert gemv_layout(19456, 2560) == "rows" and gemv_config(19456, 2560) == (
    4,
    512,
    2,
)  # Qwen3-4B's gate-up in BF16
assert gemv_layout(19456, 2560, 1) == "rows" and gemv_config(19456, 2560, 1) == (
    8,
    512,
    2,
)  # ... and in int8
assert gemv_layout(6144, 2560) == gemv_layout(6144, 2560, 1) == gemv_layout(151936, 2560) == "tile"
assert (
    gemv_layout(2560, 9728, 1) == gemv_layout(151936, 2560, 1) == "tile"
)  # int8 down, the int8 LM head
with pytest.raises(ValueError, match="'tile' or 'rows', got 'diagonal'"):
    gemv(torch.zeros(1, 8), torch.zeros(2, 8), impl="triton", layout="diagonal")
with pytest.raises(ValueError, match="at most 8 rows in its rows layout, got 9"):
    gemv(torch.zeros(9, 8), torch.zeros(2, 8), impl="triton", layout="rows")
with pytest.raises(ValueError, match="block_k 32 is no multiple of 32 x 2"):
    gemv(
        torch.zeros(1, 32),
        torch.zeros(2, 32),
        impl="triton",
        layout="rows",
        block_k=32,
        num_warps=2,
    )
# `norm` and `residual` folded in (the batch-1 decode step's add + RMSNorm kernels gone, below): in both layouts, fp32
# and bf16, several rows, a K that fills no whole step, with a bias, int8 weights and `swiglu`. The residual add is the
# bits of the GEMV followed by `add_rmsnorm`'s add; the norm agrees with `rmsnorm` then the GEMV to rounding (here x is normalised
# in fp32 and never rounded)
for layout, m, n, k, dtype, int8, with_bias, swiglu in (
    ("tile", 1, 12, 256, torch.float32, False, True, False),
    ("tile", 3, 10, 100, torch.float32, True, False, False),
    ("rows", 1, 16, 512, torch.bfloat16, False, False, False),
    ("tile", 2, 16, 192, torch.bfloat16, False, False, True),
    ("rows", 1, 24, 200, torch.bfloat16, True, True, False),
    ("rows", 1, 16, 256, torch.float32, False, False, True),
    ("rows", 5, 16, 192, torch.bfloat16, False, True, False),
    ("rows", 3, 24, 200, torch.float32, True, False, True),
):
    x, g = (
        (3 * torch.randn(m, k, generator=gen)).to(dtype),
        (torch.rand(k, generator=gen) + 0.5).to(dtype),
    )
    w, scale = torch.randn(n, k, generator=gen).to(dtype), None
    if int8:
        w, scale = (
            torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8),
            torch.rand(n, generator=gen) / 64,
        )
    bias, res = (
        torch.randn(n, generator=gen).to(dtype) if with_bias else None,
        torch.randn(m, n, generator=gen).to(dtype),
    )
    launch = dict(impl="triton", layout=layout, block_k=64, num_warps=1, swiglu=swiglu)
    normed = gemv(x, w, bias, scale, norm=g, eps=1e-5, **launch).float()
    want = gemv(rmsnorm(x, g, 1e-5, impl="triton"), w, bias, scale, **launch).float()
    # bf16: here x is normalised in fp32, there `rmsnorm` rounds it twice (2^-7 each, truncating): errors of random sign
    # that add up over K as the outputs do, ~2^-7 of a typical output, plus the output's own rounding: 1e-2 of the largest
    bf16_tol = (
        3e-2 if swiglu else 1e-2
    ) * want.abs().max().item()  # (SiLU-mul multiplies two gate / up errors)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=0, atol=bf16_tol)
    torch.testing.assert_close(
        normed, want, **tol
    )  # (bf16: a few units of the largest output's last place)
    if dtype == torch.bfloat16:
        tol["atol"] *= 3  # the PyTorch path rounds x, x · g and (int8) the scales to bf16 too
    torch.testing.assert_close(
        normed,
        gemv(
            x, w, bias, scale, impl="torch", layout=layout, norm=g, eps=1e-5, swiglu=swiglu
        ).float(),
        **tol,
    )
    if not swiglu:
        added = add_rmsnorm(
            gemv(x, w, bias, scale, **launch), res, torch.ones(n, dtype=dtype), 1e-6, impl="triton"
        )[1]
        assert torch.equal(gemv(x, w, bias, scale, residual=res, **launch), added), (
            layout
        )  # (the add it replaces)
        added = add_rmsnorm(
            gemv(x, w, bias, scale, impl="torch", layout=layout),
            res,
            torch.ones(n, dtype=dtype),
            1e-6,
            impl="torch",
        )[1]
        assert torch.equal(
            gemv(x, w, bias, scale, impl="torch", layout=layout, residual=res), added
        )  # (and on the PyTorch path)
with pytest.raises(ValueError, match=r"norm is an RMSNorm weight \[8\], got \(4,\)"):
    gemv(torch.zeros(1, 8), torch.zeros(2, 8), norm=torch.ones(4))
with pytest.raises(
    ValueError, match=r"residual must be \[1, 4\] .*\(and no swiglu\), got \(1, 2\)"
):
    gemv(torch.zeros(1, 8), torch.zeros(4, 8), residual=torch.zeros(1, 2))

# %% [markdown]
# **The norm handed off** (`hand_off`, `norm_sums`; `gemv_hands_off_norms`: 1-byte weights). For
# int8 the fold above costs the loop more than the launches it saves. But the RMSNorm between two
# GEMVs splits in two: the GEMV that adds the residual (o, down) has h = r + W·x in its epilogue
# anyway, so it also stores h·g (the next norm's weight) and adds h's squares, one atomic add a
# program, to a float in memory; the GEMV after (qkv, gate-up) reads h·g as its x and scales its
# sums by 1/rms from that float at the end, nothing added to its loop. (The float must start at 0:
# chapter 09a zeroes one per norm at the start of a step.) The adds' order varies, so the last
# bits of a norm may differ from run to run. Chapter 10's int4 GEMV takes the same folds
# (`check_gemv_folds` checks them for both). The int8 decode step: 1.617 ms against 1.678 with the
# add + RMSNorm launches (`kernels_lab/decode_overlap.py int8`); int4 1.556 against 1.604.
#
# The epilogue's operands (an int8 row's scale, the next norm's weight, the residual) are asked
# for together after the loop (`_tile_constants`, `_rows_constants`): one wait at the end of the
# kernel. Asked for before the loop they hold registers through it (the int8 o GEMV with the
# hand-off 96 → 113 a thread), fewer programs fit an SM, and the int8 step takes 1.746 ms against
# 1.579. The int8 LM head takes BF16's head tile, (4, 512, 2).

# %%
# h = r + W1·x with norm(h)·g handed to W2: h is the plain residual GEMV's bits, h·g its product
# rounded once, the sums h's squares; W2 over (h·g, sums) agrees with W2 over `rmsnorm(h, g)` to
# rounding (x·g·(1/rms) is not rounded in between); both layouts for the consumer, int8 and bf16
for m, n, k, dtype, int8, layout in (
    (1, 48, 96, torch.bfloat16, True, "rows"),
    (2, 40, 64, torch.float32, False, "tile"),
    (1, 32, 80, torch.bfloat16, False, "tile"),
    (3, 40, 64, torch.float32, True, "rows"),
):
    x, r = (
        torch.randn(m, k, generator=gen).to(dtype),
        (4 * torch.randn(m, n, generator=gen)).to(dtype),
    )
    w1, scale1 = torch.randn(n, k, generator=gen).to(dtype), None
    w2, scale2 = torch.randn(64, n, generator=gen).to(dtype), None
    if int8:
        w1, scale1 = (
            torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8),
            torch.rand(n, generator=gen) / 64,
        )
        w2, scale2 = (
            torch.randint(-127, 128, (64, n), generator=gen, dtype=torch.int8),
            torch.rand(64, generator=gen) / 64,
        )
    g = (torch.rand(n, generator=gen) + 0.5).to(dtype)
    sums = torch.zeros(m)
    tile = dict(
        impl="triton", block_k=32, num_warps=1, block_n=8, layout=layout
    )  # (the producer's too)
    h, hg = gemv(x, w1, None, scale1, residual=r, hand_off=(g, sums), **tile)
    assert torch.equal(h, gemv(x, w1, None, scale1, residual=r, **tile))
    # (bit for bit on a GPU; the interpreter truncates to bf16: one ulp, 2^-7, within the default bf16 rtol 1.6e-2)
    torch.testing.assert_close(hg, h * g)
    torch.testing.assert_close(
        sums, h.float().square().sum(-1)
    )  # (default fp32 tolerance: 40-48 squares, another order)
    got = gemv(
        hg,
        w2,
        None,
        scale2,
        impl="triton",
        norm_sums=sums,
        eps=1e-5,
        layout=layout,
        block_k=64,
        num_warps=1,
    )
    want = gemv(
        rmsnorm(h, g, 1e-5, impl="triton"),
        w2,
        None,
        scale2,
        impl="triton",
        layout=layout,
        block_k=64,
        num_warps=1,
    )
    # fp32: sums in another order (as the GEMV above); bf16: the consumer's x·g·(1/rms) not rounded in between, h·g
    # truncated: a couple of ulps of the largest output, 2^-7 of it each
    tol = 1e-4 if dtype == torch.float32 else 2e-2 * want.float().abs().max().item()
    torch.testing.assert_close(
        got.float(), want.float(), rtol=tol if dtype == torch.float32 else 0, atol=tol
    )
    torch_sums = torch.zeros(m)  # the PyTorch path: the same three results as the kernels
    h_t, hg_t = gemv(
        x, w1, None, scale1, impl="torch", layout=layout, residual=r, hand_off=(g, torch_sums)
    )
    # h_t is PyTorch's GEMV + r, h the kernel's: in bf16 (truncated here) W·x and the sum h each an ulp apart, 2^-7 of
    # |W·x| + |h|; so the sums of squares up to twice that, ~3e-2, and h·g a couple of ulps of the largest; fp32: 2^-24
    fp32 = dtype == torch.float32
    torch.testing.assert_close(torch_sums, sums, rtol=1e-5 if fp32 else 3e-2, atol=0)
    torch.testing.assert_close(
        hg_t,
        hg,
        rtol=1e-5 if fp32 else 0,
        atol=1e-5 if fp32 else 2e-2 * hg.float().abs().max().item(),
    )
    # (the PyTorch path rounds x·(1/rms) to the dtype before its GEMV, and its h·g differs as above: three times the bound)
    torch.testing.assert_close(
        gemv(
            hg_t, w2, None, scale2, impl="torch", layout=layout, norm_sums=torch_sums, eps=1e-5
        ).float(),
        want.float(),
        rtol=3 * tol if dtype == torch.float32 else 0,
        atol=3 * tol,
    )
with pytest.raises(
    ValueError, match=r"norm_sums must be float32 \[1\] on cpu, got torch.float16 \(1,\)"
):
    gemv(torch.zeros(1, 8), torch.zeros(2, 8), norm_sums=torch.zeros(1, dtype=torch.float16))
with pytest.raises(ValueError, match="hand_off needs a residual"):
    gemv(torch.zeros(1, 8), torch.zeros(2, 8), hand_off=(torch.ones(2), torch.zeros(1)))
with pytest.raises(ValueError, match="norm to apply .* not both"):
    gemv(torch.zeros(1, 8), torch.zeros(2, 8), norm=torch.ones(8), norm_sums=torch.zeros(1))
