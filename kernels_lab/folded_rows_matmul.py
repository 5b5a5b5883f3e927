"""A verify step's few rows (1 + k) times each BF16 matrix on the tensor cores, with what the one-row GEMV folds in:
the matmul and the small steps around it as one launch, not cuBLAS and a kernel for each small step.

Why: on an H200 a k = 4 verify step of random Qwen3-4B costs 1.39x a decode step (`verify_step.py`): its cuBLAS
matmuls alone take 2,466 µs and their split-K reductions 129, as long as the whole one-row step, and the small steps
the one-row GEMVs fold in (add + RMSNorm twice a layer, SiLU-mul) another 270, each a launch of its own. A kernel
that matches cuBLAS per matrix and folds those in saves the 400 µs of launches: about 1.23x.

The kernel is `sixteen_rows_swap.py`'s (the weight tile as the left operand of `tl.dot`, x's rows padded to 16 as the
right one) with chapter 09's folds, as `gemv` takes them for several rows (the norms handed off):
- `norm_sums`: x is h x g of the norm before, these h's squares: the outputs are scaled by 1 / rms at the end;
- `swiglu`: the program's gate rows and their up rows (N / 2 further on), silu(gate) x up stored;
- `residual`: added to the result (rounded first, as a separate add would find it);
- `hand_off` (with `residual`): (g, sums): h x g stored as well, h's squares added to sums.
LAB_FOLDED_PDL=1 launches it as a dependent (PDL) on Hopper, as chapter 09's GEMV: each program lets the next kernel
launch at once and asks for its first weights before it waits for x; `late` lets the next kernel launch only once the
program's weights are read (the fastest verify step: below), `wait` waits for x first. Split-K without a second
launch: each program stores its partial sums, and the program of a tile that finishes last (a ticket a tile, taken
with an atomic add; reset by that program) adds the tile's partials in split order (the same sums every replay) and
runs the epilogue.

Checked against `gemv(..., impl="torch")` with the same folds, every fold, split 1 and more (on a CPU under Triton's
interpreter, small shapes). On a GPU, per Qwen3-4B matrix at 5 rows in a CUDA graph over COPIES weight copies: the
folded kernel in a sweep of tiles against cuBLAS with the small steps the export runs around it (add + RMSNorm before
qkv and gate-up, SiLU-mul after gate-up) and against the one-row GEMV with its folds (the floor). The whole verify
step through it: verify_step.py's LAB_FOLDED (`route_rows`, also checked here as chapter 09a's `folded_gemv` calls
it). LAB_BEST_OUT=FILE: the best tile per matrix as JSON, which verify_step.py's LAB_FOLDED_TILES reads.

The same kernel takes chapter 10g's int8 planes with an fp16 scale a group of 32 (a Q8_0 file's), dequantized in
registers: `q8_0` times them at 16 rows (16 sequences of a GGUF file, where the 16-row step's split-K sums, add +
RMSNorm and SiLU-mul take 425 of its 3,615 µs on an H200: `sixteen_seqs_step.py`) against chapter 10g's split-K with
its sums and the one-row int8 group GEMV. With `int8_dot` it does not dequantize them: x is quantized to int8 a group
of 32 inputs a row with a scale each (llama.cpp's Q8_1 blocks), each group's product taken on the int8 tensor cores
(int32 sums) and scaled by both scales, as llama.cpp multiplies a Q8_0 file's matrices by several rows; within 2% of
the dequantized product under the interpreter, compiled for sm_90 offline (mma.sync on s8). With `int4_pairs` it takes
chapter 10's int4 planes (a GGUF file's Q4_K blocks as chapter 10g repacks them), dequantized in registers as
`sixteen_rows_swap.py`'s int4 tile does (the low nibbles by their inputs, then the high ones): within 2% of `gemv`'s
reference on every fold under the interpreter (within 2%), not yet timed on a GPU (`sixteen_seqs_step.py`'s LAB_PLANES=q4_k).

Measured on an H100 (`OUT=DIR bash kernels_lab/folded_rows_checks.sh verify|sixteen`; decode step 3.226 ms):
- 1 + 4 BF16 rows, per matrix (µs; cuBLAS + the small steps around it / the folded kernel / the one-row GEMV): qkv
  19.5 / 17.2 / 16.5, o 15.3 / 14.5 / 20.9, gate-up 46.6 / 41.0 / 39.1, down 25.3 / 24.6 / 31.0. The verify graph of
  1 + 4 rows with its rows through it in those tiles: 3.963 ms = 1.228x a decode step, against 1.316x as exported.
  Its matmuls take 3,353 µs in 145 launches (the LM head's included), against cuBLAS's 3,240 + split-K reductions
  125 + the small steps 171: the folds pay, the tensor-core tile reads the weights no faster than cuBLAS (2.0-2.4 TB/s).
- Launched as a dependent (LAB_FOLDED_PDL=1) it is slower: the verify graph 1.273x; the 16-sequence step 5.204 ms
  against 3.681 without and 3.709 as exported (its programs wait on the SMs for x while the kernel before still runs).
- Launched as a dependent that lets the next kernel launch once its weights are read (LAB_FOLDED_PDL=late), in one
  tile for every matrix (LAB_FOLDED), the verify graph of 1 + 4 rows: 32,128,2,3 **1.158x** (again: 1.160x), 32,128,1,3
  1.164x, 32,128,4,3 1.173x, 32,128,2,4 1.183x, 16,128,2,3 1.193x, 64,128,2,3 1.209x, 64,64,4,3 1.232x, 32,128,8,4
  1.314x; the sweep's best tiles per matrix (timed alone) 1.179x, 1.205x with the small kernels launched as
  dependents too (LAB_DEPENDENT_ROWS=5); `wait` 1.321x. As exported in the same calls: 1.310-1.313x (decode step
  3.226-3.231 ms). The tiles that win alone do not win in the step. Compiled for sm_90 (gate-up's folds, `late`):
  32,128 at 2 warps multiplies by mma.sync (HMMA) from weights loaded through registers (LDG, then STS), 255 registers
  a thread and no spills, four programs an SM; 64,64 at 4 warps by wgmma (HGMMA).
- x quantized to int8 and int8 products (`int8_dot`), 16 rows of Q8_0 planes: qkv 35.1 µs, o 29.9, gate-up 104.2,
  down 54.1, two to two and a half times the dequantizing kernel (16.0 / 14.3 / 41.2 / 21.6): every program quantizes
  x again, and the groups' products (a batched `tl.dot` of 32 inputs each) do not take the wide tensor-core path.
- 16 rows on Q8_0 planes (µs; chapter 10g's split-K + its sums and small steps / folded / one row): qkv 18.5 / 13.7 /
  10.7, o 14.8 / 12.3 / 8.8, gate-up 39.5 / 41.6 / 23.4, down 24.3 / 19.1 / 14.7. The 16-sequence step through it:
  3.681 ms against 3.709 as exported (S_TG 4,253 against 4,238 tok/s): 143 launches of it take 3,080 µs and two of
  chapter 10g's split-K (the LM head's among them) 214, against the export's 145 matmuls 2,937, their split-K sums
  206 and the small steps 217. At 16 rows it does not read the int8 planes fast enough to pay.

Run from the repository root (a GPU for timings):
    PYTHONPATH=. python3 kernels_lab/folded_rows_matmul.py [rows] [bf16|q8_0]"""

import functools
import json
import os
import sys

from common import ON_GPU, graphed_ms  # first: it may switch on the interpreter
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import forge_engine.fused_layers as fused_layers
from forge_engine.kernels.backend import INTERPRETED, _wait_for_previous, pdl_supported
from forge_engine.kernels.elementwise import add_rmsnorm, silu_mul
from forge_engine.kernels.gemv import _start_gemv, gemv
from forge_engine.kernels.rows_matmul import _rows_epilogue, _sum_splits_if_last
from forge_engine.quant.gguf_gpu import int8_group_gemv, int8_group_matmul
from forge_engine.kernels.backend import split_k_programs
from few_rows_matmul import SHAPES, step_folds
from sixteen_rows_swap import ROWS, _int4_product, _swap_dot, _x_columns

COPIES = 4
# largest error against the export's GEMV, relative to the largest output: a few bf16 roundings apart on a GPU; Triton's
# interpreter truncates float32 to bf16 where a GPU rounds to nearest, and SwiGLU rounds four times (a slip of gate
# and up: 0.8)
TOLERANCE = 2e-2 if ON_GPU else 4e-2
PDL_MODES = {  # LAB_FOLDED_PDL: "1" as chapter 09's GEMV (the next kernel launched at once, the first weights asked for
    # before waiting for x); "late": the next kernel launched once this one's weights are read; "wait": launched at once,
    # x waited for first
    "0": dict(PDL=False, EARLY_W=False, LATE_TRIGGER=False),
    "1": dict(PDL=True, EARLY_W=True, LATE_TRIGGER=False),
    "late": dict(PDL=True, EARLY_W=True, LATE_TRIGGER=True),
    "wait": dict(PDL=True, EARLY_W=False, LATE_TRIGGER=False),
}
TILES = [  # (BLOCK_N, BLOCK_K, warps, stages); BLOCK_K 256 and 4 stages at 4 warps won no matrix on an H100
    (bn, bk, w, st) for bn in (32, 64, 128) for bk in (64, 128) for w, st in ((4, 3), (8, 4))
]


@triton.jit
def _weight_tile(
    w_ptr,
    scale_ptr,
    offs_n,
    n_ok,
    k0,
    K,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
):
    """The weight rows offs_n at inputs k0 .. k0 + BLOCK_K as the product takes them: bf16 as they are, or (GROUP > 0) int8 times
    their fp16 scale a group of GROUP inputs (chapter 10g's planes of a Q8_0 or Q6_K file), dequantized in registers."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    w = tl.load(
        w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :], mask=n_ok[:, None], other=0
    )
    if GROUP > 0:
        offs_g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        s = tl.load(
            scale_ptr + offs_n.to(tl.int64)[:, None] * (K // GROUP) + offs_g[None, :],
            mask=n_ok[:, None],
            other=0.0,
        ).to(tl.float32)
        s = tl.reshape(
            tl.broadcast_to(s[:, :, None], (BLOCK_N, BLOCK_K // GROUP, GROUP)), (BLOCK_N, BLOCK_K)
        )
        w = w.to(tl.float32) * s
    return w


@triton.jit
def _quantized_x(x_ptr, k0, M, K, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr):
    """x's rows at inputs k0 .. k0 + BLOCK_K quantized to int8 a group of GROUP inputs a row, with a scale each (as
    llama.cpp's Q8_1 blocks): ([BLOCK_K / GROUP, GROUP, ROWS] int8, [BLOCK_K / GROUP, ROWS] float32)."""
    xt = _x_columns(x_ptr, k0 + tl.arange(0, BLOCK_K), M, K, ROWS).to(tl.float32)
    x3 = tl.reshape(xt, (BLOCK_K // GROUP, GROUP, ROWS))
    scale = tl.max(tl.abs(x3), axis=1) / 127.0
    scaled = x3 / tl.where(scale == 0.0, 1.0, scale)[:, None, :]
    return (scaled + tl.where(scaled >= 0.0, 0.5, -0.5)).to(
        tl.int8
    ), scale  # rounded half away from zero


@triton.jit
def _int8_product(
    acc,
    w_ptr,
    scale_ptr,
    offs_n,
    n_ok,
    k0,
    K,
    xq,
    x_scale,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
):
    """acc [BLOCK_N, ROWS] += the int8 weight rows offs_n at inputs k0 .. k0 + BLOCK_K times `_quantized_x`'s xq: one
    int8 product a group (int32 sums), scaled by the weights' and x's scales of that group."""
    groups: tl.constexpr = BLOCK_K // GROUP
    offs_k = k0 + tl.arange(0, BLOCK_K)
    w = tl.load(
        w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :], mask=n_ok[:, None], other=0
    )
    w3 = tl.permute(tl.reshape(w, (BLOCK_N, groups, GROUP)), (1, 0, 2))  # [groups, BLOCK_N, GROUP]
    offs_g = k0 // GROUP + tl.arange(0, groups)
    w_scale = tl.load(
        scale_ptr + offs_n.to(tl.int64)[None, :] * (K // GROUP) + offs_g[:, None],
        mask=n_ok[None, :],
        other=0.0,
    ).to(tl.float32)  # [groups, BLOCK_N]
    sums = tl.dot(w3, xq, out_dtype=tl.int32).to(tl.float32)  # [groups, BLOCK_N, ROWS]
    return acc + tl.sum(sums * w_scale[:, :, None] * x_scale[:, None, :], axis=0)


@triton.jit
def _folded_rows_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
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
    eps,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROWS: tl.constexpr,
    SPLIT: tl.constexpr,
    SWIGLU: tl.constexpr,
    RESIDUAL: tl.constexpr,
    NORM_SUMS: tl.constexpr,
    HAND_OFF: tl.constexpr,
    UPCAST: tl.constexpr,
    PDL: tl.constexpr,
    EARLY_W: tl.constexpr,
    LATE_TRIGGER: tl.constexpr,
    GROUP: tl.constexpr,
    INT8_DOT: tl.constexpr,
    INT4: tl.constexpr,
):
    if not LATE_TRIGGER:
        _start_gemv(PDL, not EARLY_W)  # as chapter 09's GEMV: the next kernel may launch now
    elif not EARLY_W:
        _wait_for_previous(PDL)
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # this program's outputs
    n_ok = offs_n < OUT_N
    up_n = offs_n + OUT_N  # SWIGLU: the up rows after the gate rows
    acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    # INT4: chapter 10's int4 planes (w: the nibbles, scale_ptr: the pairs), dequantized in registers
    if INT4:
        if EARLY_W:
            _wait_for_previous(PDL)
        for k0 in range(k_start, k_end, BLOCK_K):
            acc = _int4_product(
                acc, w_ptr, scale_ptr, offs_n.to(tl.int64)[:, None], n_ok[:, None], k0, K, x_ptr, M, BLOCK_N,
                BLOCK_K // GROUP, GROUP, ROWS, UPCAST,
            )  # fmt: skip
            if SWIGLU:
                acc_up = _int4_product(
                    acc_up, w_ptr, scale_ptr, up_n.to(tl.int64)[:, None], n_ok[:, None], k0, K, x_ptr, M, BLOCK_N,
                    BLOCK_K // GROUP, GROUP, ROWS, UPCAST,
                )  # fmt: skip
    elif (
        INT8_DOT
    ):  # int8 planes times x quantized to int8: int8 tensor-core products (no early weights)
        if EARLY_W:
            _wait_for_previous(PDL)
        for k0 in range(k_start, k_end, BLOCK_K):
            xq, x_scale = _quantized_x(x_ptr, k0, M, K, BLOCK_K, GROUP, ROWS)
            acc = _int8_product(
                acc, w_ptr, scale_ptr, offs_n, n_ok, k0, K, xq, x_scale, BLOCK_N, BLOCK_K, GROUP, ROWS
            )  # fmt: skip
            if SWIGLU:
                acc_up = _int8_product(
                    acc_up, w_ptr, scale_ptr, up_n, n_ok, k0, K, xq, x_scale, BLOCK_N, BLOCK_K, GROUP, ROWS
                )  # fmt: skip
    else:
        # the first step's weights asked for before waiting for x (EARLY_W: launched as a dependent, as chapter 09's GEMV)
        offs_k = k_start + tl.arange(0, BLOCK_K)
        w = _weight_tile(w_ptr, scale_ptr, offs_n, n_ok, k_start, K, BLOCK_N, BLOCK_K, GROUP)
        w_up = w
        if SWIGLU:
            w_up = _weight_tile(w_ptr, scale_ptr, up_n, n_ok, k_start, K, BLOCK_N, BLOCK_K, GROUP)
        if EARLY_W:
            _wait_for_previous(PDL)
        xt = _x_columns(x_ptr, offs_k, M, K, ROWS)
        acc = _swap_dot(acc, w, xt, UPCAST)
        if SWIGLU:
            acc_up = _swap_dot(acc_up, w_up, xt, UPCAST)
        for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):  # whole steps (the launcher checks)
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xt = _x_columns(x_ptr, offs_k, M, K, ROWS)
            acc = _swap_dot(
                acc,
                _weight_tile(w_ptr, scale_ptr, offs_n, n_ok, k0, K, BLOCK_N, BLOCK_K, GROUP),
                xt,
                UPCAST,
            )
            if SWIGLU:
                w_up = _weight_tile(w_ptr, scale_ptr, up_n, n_ok, k0, K, BLOCK_N, BLOCK_K, GROUP)
                acc_up = _swap_dot(acc_up, w_up, xt, UPCAST)
    if PDL and LATE_TRIGGER:  # the next kernel may launch once this one's weights are read
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
    if finish:  # (residual rows are contiguous here: their stride is OUT_N)
        _rows_epilogue(
            acc, acc_up, offs_n, n_ok, M, OUT_N, K, eps, out_ptr, out_ptr, res_ptr, OUT_N, in_sums_ptr, out_sums_ptr,
            next_g_ptr, normed_ptr, ROWS, False, SWIGLU, RESIDUAL, NORM_SUMS, HAND_OFF,
        )  # fmt: skip


@functools.cache
def _ticket_pair(tiles: int, device: str) -> list:
    "A launch shape's two ticket buffers, zero between launches (each tile's last program resets its own)."
    return [torch.zeros(tiles, dtype=torch.int32, device=device) for _ in range(2)]


def _tickets(tiles: int, device: str) -> torch.Tensor:
    """The next launch's tickets: the pair's buffers in turn, so a launch as a dependent never takes the tickets of the
    launch before it, which may still be finishing (two launches back has finished: the one between waited for it)."""
    pair = _ticket_pair(tiles, device)
    pair.reverse()
    return pair[0]


def folded_rows_matmul(
    x,
    w,
    swiglu=False,
    residual=None,
    norm_sums=None,
    hand_off=None,
    eps=1e-6,
    tile=(64, 128, 4, 3),
    split=None,
    scale=None,
    int8_dot=False,
    int4_pairs=None,
):
    """x [M, K] @ w [N, K].T with `gemv`'s folds (see the module's docstring) -> out, or (out, out x g) with hand_off.
    tile: (BLOCK_N, BLOCK_K, warps, stages); split: programs along K (default: about four programs an SM); scale: w is
    int8 with an fp16 scale a group of inputs [N, K / group] (chapter 10g's planes), else w is bf16; int8_dot (with
    scale): x quantized to int8 a group a row (its own scale) and multiplied on the int8 tensor cores, as llama.cpp
    multiplies a Q8_0 file's matrices, not the weights dequantized to bf16; int4_pairs: w is chapter 10's int4 nibbles
    [N, K / 2] with these scales and minimums [N, K / group, 2] (`pair_scales`)."""
    block_n, block_k, warps, stages = tile
    (m, k), n = x.shape, w.shape[0]
    if int4_pairs is not None:
        scale = int4_pairs[..., 0]  # (its groups, for the checks below)
    # LAB_FOLDED_PDL: how it is launched as a dependent on Hopper (PDL_MODES; off unless named: the module's docstring)
    pdl_mode = (
        PDL_MODES[os.environ.get("LAB_FOLDED_PDL", "0")]
        if pdl_supported(x.device)
        else PDL_MODES["0"]
    )
    pdl = pdl_mode["PDL"]
    assert m <= ROWS and k % block_k == 0 and not (swiglu and residual is not None), (m, k, block_k)
    assert scale is None or block_k % (k // scale.shape[1]) == 0, (block_k, k // scale.shape[1])
    out_n = n // 2 if swiglu else n
    tiles, k_steps = triton.cdiv(out_n, block_n), k // block_k
    if split is None:
        split = max(1, min(k_steps, split_k_programs(x.device) // tiles))
    per_split = triton.cdiv(k_steps, split)
    split = triton.cdiv(k_steps, per_split)
    out = torch.empty(m, out_n, device=x.device, dtype=x.dtype)
    normed = torch.empty_like(out) if hand_off is not None else out
    partials = torch.empty(
        split if split > 1 else 1, 2, m, out_n, device=x.device, dtype=torch.float32
    )
    unused = out
    _folded_rows_kernel[(tiles, split)](
        x.contiguous(), w, w if scale is None else scale if int4_pairs is None else int4_pairs, partials, _tickets(tiles, str(x.device)), out,
        unused if residual is None else residual,
        unused if norm_sums is None else norm_sums,
        unused if hand_off is None else hand_off[1],
        unused if hand_off is None else hand_off[0],
        normed, m, out_n, k, per_split * block_k, eps,
        BLOCK_N=block_n, BLOCK_K=block_k, ROWS=ROWS, SPLIT=split, SWIGLU=swiglu, RESIDUAL=residual is not None,
        NORM_SUMS=norm_sums is not None, HAND_OFF=hand_off is not None, UPCAST=INTERPRETED, **pdl_mode,
        GROUP=0 if scale is None else k // scale.shape[1], INT8_DOT=int8_dot, INT4=int4_pairs is not None,
        launch_pdl=pdl, num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    return (out, normed) if hand_off is not None else out


def route_rows(tile: tuple[int, ...], per_shape: dict | None = None):
    """Chapter 09a's matmuls of 2-16 BF16 rows (`decode_matmul`'s calls of chapter 09's `rows_matmul`) through
    `folded_rows_matmul` in `tile`, or per_shape[(N, K)]'s; returns the function that undoes it."""
    exported = fused_layers.rows_matmul

    def rows_matmul(x, weight, bias=None, *, tickets=None, out=None, eps=1e-6, **folds):
        if bias is not None:
            return exported(x, weight, bias, tickets=tickets, out=out, eps=eps, **folds)
        shape_tile = (per_shape or {}).get(tuple(weight.shape), tile)
        y = folded_rows_matmul(x, weight, eps=eps, tile=shape_tile, **folds)
        return y if out is None else out.copy_(y)

    fused_layers.rows_matmul = rows_matmul
    return lambda: setattr(fused_layers, "rows_matmul", exported)


def check_int4(device: str) -> float:
    """The kernel on chapter 10's int4 planes (`int4_pairs`) against `gemv(impl='torch')`'s folds on the same weights
    dequantized, every fold, splits 1, 2 and the default, groups of 32 and 64: its largest relative error."""
    from forge_engine.quant.formats import dequantize_int4, quantize_int4
    from forge_engine.quant.gemv import pair_scales

    worst = 0.0
    for m, n, k, group in ((16, 64, 256, 32), (5, 96, 512, 32), (3, 64, 256, 64)):
        x = torch.randn(m, k, device=device).bfloat16()
        packed, scale, minimum = quantize_int4(torch.randn(n, k, device=device) / k**0.5, group)
        pairs, w = (
            pair_scales(scale, minimum),
            dequantize_int4(packed, scale, minimum, torch.bfloat16),
        )
        folds = {
            "plain": {},
            "swiglu": dict(swiglu=True, norm_sums=torch.rand(m, device=device) * k + 1),
            "residual": dict(
                residual=torch.randn(m, n, device=device).bfloat16(),
                hand_off=(
                    (torch.rand(n, device=device) + 0.5).bfloat16(),
                    torch.zeros(m, device=device),
                ),
            ),
        }
        for fold in folds.values():
            for split in (1, 2, None):
                want_folds, got_folds = fresh_folds(fold), fresh_folds(fold)
                want = reference(x, w, want_folds)
                got = folded_rows_matmul(
                    x, packed, int4_pairs=pairs, tile=(32, 128, 2, 3), split=split, **got_folds
                )
                pairs_out = list(zip(want, got)) if isinstance(want, tuple) else [(want, got)]
                if "hand_off" in fold:
                    pairs_out.append((want_folds["hand_off"][1], got_folds["hand_off"][1]))
                worst = max(
                    worst,
                    *(
                        (g.float() - v.float()).abs().max().item() / v.float().abs().max().item()
                        for v, g in pairs_out
                    ),
                )
    return worst


def check_route(device: str) -> float:
    """`route_rows` as chapter 09a's `folded_gemv` calls it, each fold, against the export's GEMV (PyTorch): the
    largest error relative to the largest output."""
    n, k, m = 96, 256, 5
    layer = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    layer.__class__ = fused_layers.FusedLinear
    g = torch.nn.Module()  # the norm handed on: its weight (per matrix, below) and eps
    g.eps = 1e-6
    worst = 0.0
    for name in ("qkv", "o", "gate_up"):
        folds = step_folds(name, m, n, k, device, hand_off=True)
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        args = {key: folds[key] for key in ("residual", "swiglu") if key in folds}
        handed_in = fused_layers.HandedNorm(g, folds["norm_sums"]) if "norm_sums" in folds else None
        hand_off = None
        if "hand_off" in folds:
            g.weight = folds["hand_off"][0]
            hand_off = fused_layers.HandedNorm(g, torch.zeros(m, device=device))
        want = fused_layers.folded_gemv(layer, x, handed_in=handed_in, hand_off=hand_off, **args)
        undo = route_rows((32, 64, 4, 3))
        try:
            got = fused_layers.folded_gemv(
                layer, x, handed_in=handed_in,
                hand_off=None if hand_off is None else hand_off._replace(sums=torch.zeros(m, device=device)),
                **args,
            )  # fmt: skip
        finally:
            undo()
        pairs = list(zip(want, got)) if isinstance(want, tuple) else [(want, got)]
        for v, r in pairs:
            worst = max(worst, ((r.float() - v.float()).abs().max() / v.float().abs().max()).item())
    return worst


def fresh_folds(folds: dict) -> dict:
    "The folds with the hand-off's sums zeroed (they add up from call to call) and everything else as it is."
    if "hand_off" in folds:
        g, sums = folds["hand_off"]
        return dict(folds, hand_off=(g, torch.zeros_like(sums)))
    return folds


def make_weights(kind: str, n: int, k: int, device: str) -> list[tuple]:
    "COPIES random weights (w, scale): bf16 (scale None), or q8_0: int8 with an fp16 scale a group of 32 (chapter 10g)."
    if kind == "bf16":
        return [
            (torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5, None)
            for _ in range(COPIES)
        ]
    return [
        (
            torch.randint(-127, 128, (n, k), device=device, dtype=torch.int8),
            (torch.rand(n, k // 32, device=device) * 2e-4 + 1e-4).to(torch.float16),
        )
        for _ in range(COPIES)
    ]


def dense(weight: tuple) -> torch.Tensor:
    "The weight in bf16, dequantized where it is int8: what the kernel multiplies."
    w, scale = weight
    if scale is None:
        return w
    group = w.shape[1] // scale.shape[1]
    deq = w.view(w.shape[0], -1, group).float() * scale.float()[:, :, None]
    return deq.reshape(w.shape).to(torch.bfloat16)


def reference(x, w, folds, rows: int = 8):
    "`gemv(impl='torch')` with `folds`, `rows` rows at a time (its rows layout's most): what the folded kernel gives."
    outs = []
    for a in range(0, x.shape[0], rows):
        part = {
            k: v[a : a + rows] if k in ("residual", "norm_sums") else v for k, v in folds.items()
        }
        if "hand_off" in folds:
            part["hand_off"] = (folds["hand_off"][0], folds["hand_off"][1][a : a + rows])
        outs.append(gemv(x[a : a + rows], w, impl="torch", layout="rows", **part))
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*outs))
    return torch.cat(outs)


def check(x, weight, folds, tile, split, int8_dot=False) -> float:
    "The folded kernel's largest error against `gemv(impl='torch')`, relative to the largest output, both outputs."
    want_folds, got_folds = fresh_folds(folds), fresh_folds(folds)
    want = reference(x, dense(weight), want_folds)
    got = folded_rows_matmul(
        x, weight[0], scale=weight[1], tile=tile, split=split, int8_dot=int8_dot, **got_folds
    )
    pairs = list(zip(want, got)) if isinstance(want, tuple) else [(want, got)]
    if "hand_off" in folds:
        pairs.append((want_folds["hand_off"][1], got_folds["hand_off"][1]))
    return max(
        (g.float() - v.float()).abs().max().item() / v.float().abs().max().item() for v, g in pairs
    )


def package_matmul(x, weight):
    "What the package multiplies these rows with: cuBLAS for bf16, chapter 10g's split-K and its sums for int8."
    w, scale = weight
    return F.linear(x, w) if scale is None else int8_group_matmul(x, w, scale)


def export_small_steps(name, x, weight, folds):
    """What the export runs for this matrix at several rows: its matmul, with add + RMSNorm before qkv and gate-up (the
    norm handed in: here one launch of `add_rmsnorm`) and SiLU-mul after gate-up."""
    if name in ("qkv", "gate_up"):
        x, _ = add_rmsnorm(x, x, torch.ones(x.shape[1], device=x.device, dtype=x.dtype), 1e-6)
    y = package_matmul(x, weight)
    return silu_mul(y) if name == "gate_up" else y


def time_tile(fn):
    "graphed_ms of fn, or infinity where the tile needs more shared memory than the GPU has (SwiGLU's two weight tiles)."
    try:
        return graphed_ms(fn)
    except triton.runtime.errors.OutOfResources:
        return float("inf")


def one_row(name, x, weight, n, k, device):
    "The one-row step's GEMV: chapter 09's with its folds (bf16), chapter 10g's (int8 groups, no folds)."
    w, scale = weight
    if scale is None:
        return gemv(x[:1], w, **step_folds(name, 1, n, k, device, hand_off=True))
    return int8_group_gemv(x[:1], w, scale)


def main(m: int, kind: str):
    device = "cuda" if ON_GPU else "cpu"
    shapes = (
        SHAPES
        if ON_GPU
        else {"qkv": (96, 256), "o": (80, 256), "gate_up": (192, 256), "down": (80, 384)}
    )
    tiles = TILES if ON_GPU else [(32, 64, 4, 3), (64, 128, 4, 3)]
    worst = check_route(device)
    assert worst < TOLERANCE, worst
    print(f"route_rows through chapter 09a's folded_gemv: within {worst:.1e} of the export's GEMV")
    worst = check_int4(device)
    assert worst < TOLERANCE, worst
    print(
        f"chapter 10's int4 planes (int4_pairs): within {worst:.1e} of gemv's reference on them dequantized"
    )
    best = {}
    for name, (n, k) in shapes.items():
        if name == "head":
            continue
        weights = make_weights(kind, n, k, device)
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        folds = step_folds(name, m, n, k, device, hand_off=True)
        worst = max(
            check(x, weights[0], folds, tile, split, int8_dot)
            for tile in tiles[:2]
            for split in (1, 3, None)
            for int8_dot in ((False, True) if kind == "q8_0" else (False,))
        )
        assert worst < TOLERANCE, (name, worst)
        if not ON_GPU:
            print(
                f"{name} {kind} m={m}: the folded kernel within {worst:.1e} of gemv's reference, splits 1, 3, auto"
            )
            continue
        nbytes = sum(t.numel() * t.element_size() for t in weights[0] if t is not None)
        line = {
            "package + small steps": graphed_ms(
                lambda: [export_small_steps(name, x, wt, folds) for wt in weights]
            ),
            "package": graphed_ms(lambda: [package_matmul(x, wt) for wt in weights]),
            "1 row": graphed_ms(lambda: [one_row(name, x, wt, n, k, device) for wt in weights]),
        }
        timed = sorted(
            (
                time_tile(
                    lambda: [
                        folded_rows_matmul(x, wt[0], scale=wt[1], tile=t, **folds) for wt in weights
                    ]
                ),
                t,
            )
            for t in tiles
        )
        line[f"folded {timed[0][1]}"] = timed[0][0]
        if kind == "q8_0":  # x quantized, int8 products
            by_int8 = min(
                (
                    time_tile(
                        lambda: [
                            folded_rows_matmul(
                                x, wt[0], scale=wt[1], tile=t, int8_dot=True, **folds
                            )
                            for wt in weights
                        ]
                    ),
                    t,
                )
                for t in tiles
            )
            line[f"folded int8 products {by_int8[1]}"] = by_int8[0]
        best[f"{n},{k}"] = timed[0][1]
        print(
            f"{name:8s} {kind} N={n:6d} K={k:5d} m={m}: "
            + ", ".join(
                f"{key} {v / COPIES * 1e3:6.1f} us ({nbytes * COPIES / (v * 1e-3) / 1e12:.2f} TB/s)"
                for key, v in line.items()
            )
            + f"; next tiles {[t for _, t in timed[1:4]]}",
            flush=True,
        )
        if os.environ.get("LAB_BEST_OUT"):  # verify_step.py's LAB_FOLDED_TILES, matrix by matrix
            with open(os.environ["LAB_BEST_OUT"], "w") as f:
                json.dump(best, f, indent=1)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5, sys.argv[2] if len(sys.argv) > 2 else "bf16")
