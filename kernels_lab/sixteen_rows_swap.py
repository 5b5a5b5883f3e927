"""16 rows of x against chapter 10g's repacked GGUF matrices with the weights on the tensor cores' *wide* side: each
program's tile of weights [BLOCK_N, BLOCK_K], dequantized in registers, is the left operand of `tl.dot` and x's 16
rows (transposed, [BLOCK_K, 16]) the right one, so the product is [BLOCK_N, 16]. Chapter 10b's split-K puts x on
the left ([16, BLOCK_K]) and the weight tile on the right; Hopper's wgmma reads its right operand from shared memory
only, so every step of that kernel writes its dequantized tile to shared memory and waits on a barrier before the
product. On the left a wgmma takes its operand from registers: the dequantized tile goes straight in.

Variants, per matrix of Qwen3-4B (qkv, o, gate_up, down) as Q8_0 (int8 planes, fp16 scales per 32) and Q4_K (int4,
groups of 32, scale and minimum side by side):
  one    the one-row GEMV of the package: the time to read the matrix once, what 16 rows cost if bandwidth-bound
  split  the package at 16 rows (chapter 10b's split-K, tiles as exported)
  swap   this file's kernel, a sweep of (BLOCK_N, BLOCK_K or groups a step, warps, stages); split-K as chapter 10b
  bf16   cuBLAS at 16 rows on bf16 weights of the same shape (twice the bytes): what a tensor-core GEMM reads at 16
         rows on this GPU

Measured on one H100 (LAB_TYPES=Q8_0, then LAB_TYPES=bf16): the swap kernel is no faster. Q8_0 at 16 rows, best
tile against the package's split-K: qkv 18.7 against 18.8 us, o 16.6 / 17.2, gate_up 41.6 / 39.5, down 25.2 / 28.3
(0.89-1.05x; the one-row GEMV: 13.2, 11.5, 30.1, 18.5). bf16 at 5 and 16 rows against cuBLAS: 0.97-1.05x. Its loop
issues fewer instructions a weight (offline: 6.3 against 10.0 for Q8_0), so these kernels are not bound by issuing
instructions: at these sizes (16-100 MB a matrix) every kernel, one-row GEMV included, reads below 2.2 TB/s.

Run on the GPU machine from the repository root: PYTHONPATH=. python3 kernels_lab/sixteen_rows_swap.py
`--sass` compiles the swap kernels for sm_90 on any machine and counts their loop's instructions (no GPU needed;
run with TRITON_INTERPRET=0)."""

import collections
import os
import re
import sys

if "--sass" not in sys.argv:
    from common import (
        DEVICE,
        ON_GPU,
        finish,
        time_variant,
        validate,
    )  # first: may switch on the interpreter
import torch
import triton
import triton.language as tl

from forge_engine.kernels.backend import INTERPRETED
from forge_engine.kernels.gemv import _int8x4_to_f32
from forge_engine.kernels.rows_matmul import _nibbles_as_bf16
from forge_engine.quant.gemv import _nibbles_to_f32
from forge_engine.kernels.backend import split_k_programs
from forge_engine.quant.split_k import _sum_splits_kernel

SHAPES = {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}
ROWS = 16


@triton.jit
def _int8x2_to_f32(w):
    "int8 -> fp32, two weights a 16-bit register: w + 128 (XOR of the sign bits) under 2^23's exponent, minus it."
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 u;
        cvt.u32.u16 u, $2;
        xor.b32 u, u, 0x8080;
        prmt.b32 $0, u, 0x4B000000, 0x7440;
        prmt.b32 $1, u, 0x4B000000, 0x7441;
        sub.f32 $0, $0, 0f4B000080;
        sub.f32 $1, $1, 0f4B000080;
        }""",
        constraints="=r,=r,h",
        args=[w],
        dtype=tl.float32,
        is_pure=True,
        pack=2,
    )


@triton.jit
def _program_slice(N, K, k_per_split, BLOCK_N: tl.constexpr):
    """This program's split index, outputs (and as int64 rows, and which are inside N), and slice [k_start, k_end) of
    K; the grid is (output tiles, splits)."""
    pid_k = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = pid_k * k_per_split
    return (
        pid_k,
        offs_n,
        offs_n.to(tl.int64)[:, None],
        (offs_n < N)[:, None],
        k_start,
        tl.minimum(k_start + k_per_split, K),
    )


@triton.jit
def _x_columns(x_ptr, offs_k, M, K, ROWS: tl.constexpr):
    "x's rows as the columns of a [len(offs_k), ROWS] tile (rows past M read 0)."
    offs_m = tl.arange(0, ROWS)
    return tl.load(
        x_ptr + offs_m[None, :] * K + offs_k[:, None], mask=(offs_m < M)[None, :], other=0.0
    )


@triton.jit
def _x_halves(x_ptr, k0, M, K, GROUPS: tl.constexpr, HALF: tl.constexpr, ROWS: tl.constexpr):
    """x's rows as columns for GROUPS groups from input k0, split into each group's first and second halves: two
    [GROUPS * HALF, ROWS] tiles (the inputs of the low and the high nibbles), runs of HALF contiguous inputs."""
    t = tl.arange(0, GROUPS * HALF)
    lo_at = tl.max_contiguous(tl.multiple_of((t // HALF) * (2 * HALF) + t % HALF, HALF), HALF)
    return _x_columns(x_ptr, k0 + lo_at, M, K, ROWS), _x_columns(
        x_ptr, k0 + HALF + lo_at, M, K, ROWS
    )


@triton.jit
def _swap_dot(acc, w, xt, UPCAST: tl.constexpr):
    "acc [BN, ROWS] += w [BN, BK] @ xt [BK, ROWS]; w rounded to x's dtype first (the interpreter: fp32)."
    if UPCAST:
        return tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(w.to(xt.dtype), xt, acc)


@triton.jit
def _store_columns(out_ptr, acc, offs_n, M, N, pid_k, ROWS: tl.constexpr):
    "acc [BN, ROWS] into out[pid_k] ([split, M, N]) transposed."
    offs_m = tl.arange(0, ROWS)
    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    ptrs = out_ptr + pid_k * M * N + offs_m[None, :] * N + offs_n[:, None]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _int8_group_swap_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per_split,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    UPCAST: tl.constexpr,
    PRMT: tl.constexpr,  # how int8 becomes fp32: 0 I2F, 1 PRMT four bytes a register, 2 two bytes a register
):
    pid_k, offs_n, rows, n_mask, k_start, k_end = _program_slice(N, K, k_per_split, BLOCK_N)
    acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):  # whole steps (the launcher checks)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        q = tl.load(q_ptr + rows * K + offs_k[None, :], mask=n_mask, other=0)
        offs_g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        s = tl.load(scale_ptr + rows * (K // GROUP) + offs_g[None, :], mask=n_mask, other=0.0)
        s = tl.reshape(
            tl.broadcast_to(s.to(tl.float32)[:, :, None], (BLOCK_N, BLOCK_K // GROUP, GROUP)),
            (BLOCK_N, BLOCK_K),
        )
        if UPCAST or PRMT == 0:
            w = q.to(tl.float32)  # I2F: a conversion, issued at a quarter of the FP32 rate
        elif PRMT == 1:  # chapter 09's PRMT + FADD, four bytes a register
            w = _int8x4_to_f32(q)
        else:  # the same, two bytes a register: as the tensor cores' operand holds them
            w = _int8x2_to_f32(q)
        acc = _swap_dot(acc, w * s, _x_columns(x_ptr, offs_k, M, K, ROWS), UPCAST)
    _store_columns(out_ptr, acc, offs_n, M, N, pid_k, ROWS)


@triton.jit
def _bf16_swap_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per_split,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROWS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    "bf16 weights as they are: the tile goes from memory to the tensor cores through shared memory only."
    pid_k, offs_n, rows, n_mask, k_start, k_end = _program_slice(N, K, k_per_split, BLOCK_N)
    acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows * K + offs_k[None, :], mask=n_mask, other=0.0)
        acc = _swap_dot(acc, w, _x_columns(x_ptr, offs_k, M, K, ROWS), UPCAST)
    _store_columns(out_ptr, acc, offs_n, M, N, pid_k, ROWS)


@triton.jit
def _per_group(t, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, EACH: tl.constexpr):
    "[BLOCK_N, GROUPS] repeated over each group's EACH columns: [BLOCK_N, GROUPS * EACH]."
    return tl.reshape(
        tl.broadcast_to(t[:, :, None], (BLOCK_N, GROUPS, EACH)), (BLOCK_N, GROUPS * EACH)
    )


@triton.jit
def _int4_product(
    acc,
    q_ptr,
    sm_ptr,
    rows,
    n_mask,
    k0,
    K,
    x_ptr,
    M,
    BLOCK_N: tl.constexpr,
    STEP_GROUPS: tl.constexpr,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """acc [BLOCK_N, ROWS] += chapter 10's int4 weight `rows` ([BLOCK_N, 1] int64, `n_mask` inside N; byte j of a
    group: input j low, j + GROUP/2 high; scale and minimum side by side, `pair_scales`) at STEP_GROUPS groups from
    input k0 times x: the low nibbles times their inputs, then the high ones, two products."""
    HALF: tl.constexpr = GROUP // 2
    t = tl.arange(0, STEP_GROUPS * HALF)
    b = tl.load(q_ptr + rows * (K // 2) + k0 // 2 + t[None, :], mask=n_mask, other=0)
    at = (rows * (K // GROUP) + k0 // GROUP + tl.arange(0, STEP_GROUPS)[None, :]) * 2
    pair = tl.load(
        sm_ptr + at[:, :, None] + tl.arange(0, 2)[None, None, :], mask=n_mask[:, :, None]
    )
    s, m = tl.split(pair.to(tl.float32))
    # nibbles as 128 + q (low) and 128 + q / 16 (high), exact (chapter 10c): w = v * s' + (m - 128 s') in one FFMA
    lo, hi = _nibbles_to_f32(b, not UPCAST)
    s_lo = _per_group(s, BLOCK_N, STEP_GROUPS, HALF)
    s_hi = _per_group(s * 16.0, BLOCK_N, STEP_GROUPS, HALF)
    c_lo = _per_group(m - 128.0 * s, BLOCK_N, STEP_GROUPS, HALF)
    c_hi = _per_group(m - 2048.0 * s, BLOCK_N, STEP_GROUPS, HALF)
    x_lo, x_hi = _x_halves(x_ptr, k0, M, K, STEP_GROUPS, HALF, ROWS)
    acc = _swap_dot(acc, lo * s_lo + c_lo, x_lo, UPCAST)
    return _swap_dot(acc, hi * s_hi + c_hi, x_hi, UPCAST)


@triton.jit
def _int4_swap_kernel(
    x_ptr,
    q_ptr,
    sm_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per_split,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,
    STEP_GROUPS: tl.constexpr,
    ROWS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    "Chapter 10's int4 with scale and minimum side by side (`pair_scales`), `_int4_product` a step."
    pid_k, offs_n, rows, n_mask, k_start, k_end = _program_slice(N, K, k_per_split, BLOCK_N)
    acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    for k0 in range(k_start, k_end, STEP_GROUPS * GROUP):
        acc = _int4_product(
            acc, q_ptr, sm_ptr, rows, n_mask, k0, K, x_ptr, M, BLOCK_N, STEP_GROUPS, GROUP, ROWS, UPCAST
        )  # fmt: skip
    _store_columns(out_ptr, acc, offs_n, M, N, pid_k, ROWS)


@triton.jit
def _int4_groups_kernel(
    x_ptr,
    q_ptr,
    sm_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per_split,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,
    STEP_GROUPS: tl.constexpr,
    ROWS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """int4 with the scale and minimum after the product, a group at a time: the tensor cores multiply 128 + q (bf16,
    exact, straight from the nibbles) by x, then acc += s * dot + (m - 128 s) * sum(x over the group). No conversion
    to float and no rounding of a weight: per weight half a LOP3 and, for 16 rows, one FMA of the epilogue."""
    HALF: tl.constexpr = GROUP // 2
    pid_k, offs_n, rows, n_mask, k_start, k_end = _program_slice(N, K, k_per_split, BLOCK_N)
    j = tl.arange(0, HALF)
    groups = K // GROUP
    acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    for k0 in range(k_start, k_end, STEP_GROUPS * GROUP):
        for g in tl.static_range(STEP_GROUPS):
            kg = k0 + g * GROUP
            b = tl.load(q_ptr + rows * (K // 2) + kg // 2 + j[None, :], mask=n_mask, other=0)
            at = (offs_n.to(tl.int64) * groups + kg // GROUP) * 2
            s = tl.load(sm_ptr + at, mask=offs_n < N, other=0.0).to(tl.float32)
            m = tl.load(sm_ptr + at + 1, mask=offs_n < N, other=0.0).to(tl.float32)
            x_lo = _x_columns(x_ptr, kg + j, M, K, ROWS)
            x_hi = _x_columns(x_ptr, kg + HALF + j, M, K, ROWS)
            x_sum = tl.sum(x_lo.to(tl.float32), axis=0) + tl.sum(x_hi.to(tl.float32), axis=0)
            lo, hi = _nibbles_as_bf16(b, not UPCAST)
            if UPCAST:
                d = tl.dot(lo.to(tl.float32), x_lo.to(tl.float32), input_precision="ieee")
                d = tl.dot(hi.to(tl.float32), x_hi.to(tl.float32), d, input_precision="ieee")
            else:
                d = tl.dot(hi, x_hi, tl.dot(lo, x_lo))
            acc += s[:, None] * d + (m - 128.0 * s)[:, None] * x_sum[None, :]
    _store_columns(out_ptr, acc, offs_n, M, N, pid_k, ROWS)


def int4_groups(x, packed, paired, block_n=128, step_groups=4, warps=4, stages=3):
    group = x.shape[1] // paired.shape[1]
    return _launch_swap(
        _int4_groups_kernel, x, (packed, paired), packed.shape[0], step_groups * group, block_n, warps, stages,
        GROUP=group, STEP_GROUPS=step_groups,
    )  # fmt: skip


def _launch_swap(kernel, x, weights, n, k_step, block_n, warps, stages, split=None, **constexprs):
    "Chapter 10b's split-K launch for the swap kernels: about four programs an SM, partials summed in order."
    x = x.contiguous()
    m, k = x.shape
    assert m <= ROWS and k % k_step == 0, (m, k, k_step)
    n_tiles, k_steps = triton.cdiv(n, block_n), k // k_step
    if split is None:
        split = max(1, min(k_steps, split_k_programs(x.device) // n_tiles))
    per_split = triton.cdiv(k_steps, split)
    split = triton.cdiv(k_steps, per_split)
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    partials = (
        out if split == 1 else torch.empty((split, m, n), device=x.device, dtype=torch.float32)
    )
    kernel[(n_tiles, split)](
        x,
        *weights,
        partials,
        m,
        n,
        k,
        per_split * k_step,
        BLOCK_N=block_n,
        ROWS=ROWS,
        UPCAST=INTERPRETED,
        num_warps=warps,
        num_stages=stages,
        **constexprs,
    )
    if split > 1:
        _sum_splits_kernel[(triton.cdiv(m * n, 1024),)](
            partials, out, m * n, SPLIT=split, BLOCK=1024
        )
    return out


def int8_group_swap(x, q, scale, block_n=128, block_k=128, warps=4, stages=3, prmt=False):
    group = q.shape[1] // scale.shape[1]
    return _launch_swap(
        _int8_group_swap_kernel, x, (q, scale), q.shape[0], block_k, block_n, warps, stages,
        BLOCK_K=block_k, GROUP=group, PRMT=prmt,
    )  # fmt: skip


def int4_swap(x, packed, paired, block_n=128, step_groups=4, warps=4, stages=3):
    "paired: [N, groups, 2] scale and minimum (`pair_scales`)."
    group = x.shape[1] // paired.shape[1]
    return _launch_swap(
        _int4_swap_kernel, x, (packed, paired), packed.shape[0], step_groups * group, block_n, warps, stages,
        GROUP=group, STEP_GROUPS=step_groups,
    )  # fmt: skip


def bf16_swap(x, w, block_n=128, block_k=128, warps=4, stages=4):
    return _launch_swap(
        _bf16_swap_kernel, x, (w,), w.shape[0], block_k, block_n, warps, stages, BLOCK_K=block_k
    )


BF16_SWEEP = [
    (bn, bk, w, st) for bn in (64, 128) for bk in (64, 128) for w in (4, 8) for st in (3, 4, 6)
]
INT8_SWEEP = [  # the last item: 0 I2F, 1 PRMT four bytes a register, 2 PRMT two bytes a register
    (bn, bk, w, st, p)
    for bn in (64, 128)
    for bk in (128, 256)
    for w in (4, 8)
    for st in (3, 4)
    for p in (0, 2)
]
INT4_SWEEP = [  # the last item: 0 the weights dequantized before the product, 1 the scales after it, a group at a time
    (bn, 4, w, st, v) for bn in (64, 128) for w in (4, 8) for st in (3, 4) for v in (0, 1)
]


def sass(kernel, signature, constexprs, warps, stages) -> tuple[list[str], int]:
    "Compiled for sm_90 offline (no GPU): the instructions of its main loop and its registers a thread."
    from gemv_sass import ALIGNED, loop_sass

    signature = {**signature, **{k: "constexpr" for k in constexprs}}
    aligned = (*ALIGNED, "k_per_split")
    return loop_sass(kernel, signature, constexprs, warps, num_stages=stages, aligned=aligned)


def _loop_report(label, body, registers, weights_a_thread):
    ops = collections.Counter(
        re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body
    )
    top = ", ".join(f"{k} {v}" for k, v in ops.most_common(12))
    print(
        f"{label}: {registers} regs, {len(body) / weights_a_thread:.2f} instructions a weight: {top}"
    )


def sass_report():
    common = {
        "x_ptr": "*bf16",
        "out_ptr": "*fp32",
        "M": "i32",
        "N": "i32",
        "K": "i32",
        "k_per_split": "i32",
    }
    for bn, bk, w, st, p in [
        (128, 128, 4, 3, 0),
        (128, 128, 4, 3, 1),
        (128, 128, 4, 3, 2),
        (64, 256, 4, 3, 0),
        (128, 256, 8, 3, 0),
    ]:
        sig = {**common, "q_ptr": "*i8", "scale_ptr": "*fp16"}
        constexprs = {
            "BLOCK_N": bn,
            "BLOCK_K": bk,
            "GROUP": 32,
            "ROWS": ROWS,
            "UPCAST": False,
            "PRMT": p,
        }
        body, regs = sass(_int8_group_swap_kernel, sig, constexprs, w, st)
        _loop_report(f"int8 swap {bn}x{bk} w{w} s{st} prmt {p}", body, regs, bn * bk / (32 * w))
    for bn, bk, w, st in [(128, 128, 4, 4), (64, 128, 4, 4)]:
        sig = {**common, "w_ptr": "*bf16"}
        constexprs = {"BLOCK_N": bn, "BLOCK_K": bk, "ROWS": ROWS, "UPCAST": False}
        body, regs = sass(_bf16_swap_kernel, sig, constexprs, w, st)
        _loop_report(f"bf16 swap {bn}x{bk} w{w} s{st}", body, regs, bn * bk / (32 * w))
    for bn, sg, w, st in [(128, 4, 4, 3), (64, 4, 4, 3), (128, 2, 8, 3)]:
        sig = {**common, "q_ptr": "*u8", "sm_ptr": "*fp16"}
        constexprs = {"BLOCK_N": bn, "GROUP": 32, "STEP_GROUPS": sg, "ROWS": ROWS, "UPCAST": False}
        body, regs = sass(_int4_groups_kernel, sig, constexprs, w, st)
        _loop_report(f"int4 groups {bn}x{sg}g w{w} s{st}", body, regs, bn * sg * 32 / (32 * w))
    for bn, sg, w, st in [(128, 4, 4, 3), (64, 8, 4, 3), (64, 4, 4, 3)]:
        sig = {**common, "q_ptr": "*u8", "sm_ptr": "*fp16"}
        constexprs = {"BLOCK_N": bn, "GROUP": 32, "STEP_GROUPS": sg, "ROWS": ROWS, "UPCAST": False}
        body, regs = sass(_int4_swap_kernel, sig, constexprs, w, st)
        _loop_report(f"int4 swap {bn}x{sg}g w{w} s{st}", body, regs, bn * sg * 32 / (32 * w))


def bf16_section(only) -> bool:
    """bf16 weights at 5 rows (a k = 4 verify step, chapter 08c) and 16: cuBLAS, the one-row GEMV, the swap kernel."""
    from forge_engine.kernels.gemv import gemv

    ok = True
    for name, (n, k) in SHAPES.items():
        if only and name not in only:
            continue
        if not ON_GPU:
            n, k = 128, 512
        w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.02
        x1 = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
        for rows in (5, ROWS):
            x = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16)
            want = x.float() @ w.float().T
            for c in BF16_SWEEP[:: 1 if ON_GPU else 12]:
                ok &= validate(
                    f"bf16 {name} swap {c} {rows} rows", bf16_swap(x, w, *c).float(), want, 1e-2
                )
            if not ON_GPU:
                continue
            one, _ = time_variant(lambda: gemv(x1, w), graph=True)
            cublas, _ = time_variant(lambda: x @ w.T, graph=True)
            results = sorted(
                (time_variant(lambda: bf16_swap(x, w, *c), graph=True)[0], c) for c in BF16_SWEEP
            )
            best, c = results[0]
            print(
                f"  bf16 {name:8s} {rows:2d} rows: one-row GEMV {one * 1e3:6.1f} us; cuBLAS {cublas * 1e3:6.1f} us;"
                f" swap {best * 1e3:6.1f} us {c} ({2 * n * k / best / 1e9:4.2f} TB/s, {best / cublas:4.2f}x cuBLAS)",
                flush=True,
            )
    return ok


def main():
    from forge_engine.quant.gemv import int4_matmul, int4_matmul_reference, pair_scales
    from forge_engine.quant.gguf_blocks import gguf_bytes
    from forge_engine.quant.gguf_gpu import (
        int8_group_matmul,
        int8_group_matmul_reference,
        q4_k_as_int4,
        q8_0_as_int8,
    )

    ok = True
    torch.manual_seed(0)
    only = [s for s in os.environ.get("LAB_SHAPES", "").split(",") if s]
    if "bf16" in os.environ.get("LAB_TYPES", "bf16,Q8_0,Q4_K"):
        ok &= bf16_section(only)
    for type_name, qtype in (("Q8_0", 8), ("Q4_K", 12)):
        if type_name not in os.environ.get("LAB_TYPES", "bf16,Q8_0,Q4_K"):
            continue
        for name, (n, k) in SHAPES.items():
            if only and name not in only:
                continue
            if not ON_GPU:
                n, k = 128, 512
            raw = gguf_bytes(qtype, n, k).to(DEVICE)
            if qtype == 12:
                packed, s, m = q4_k_as_int4(raw)
                paired = pair_scales(s, m).contiguous()
                s, m = paired[..., 0], paired[..., 1]
                weights = (packed, paired)
                nbytes = packed.numel() + 4 * s.numel()

                def export(x):
                    return int4_matmul(x, packed, s, m, impl="triton")

                def reference(x):
                    return int4_matmul_reference(x, packed, s, m)

                def swap(x, c):
                    return (int4_groups if c[4] else int4_swap)(x, *weights, *c[:4])

                sweep = INT4_SWEEP
            else:
                q, scale = q8_0_as_int8(raw)
                nbytes = q.numel() + 2 * scale.numel()

                def export(x):
                    return int8_group_matmul(x, q, scale, impl="triton")

                def reference(x):
                    return int8_group_matmul_reference(x, q, scale)

                def swap(x, c):
                    return int8_group_swap(x, q, scale, *c)

                sweep = INT8_SWEEP
            label = f"{type_name} {name}"
            x1 = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
            want = {}
            for rows in (ROWS, 5):
                x = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16)
                want[rows] = (x, reference(x).float())
                for c in sweep[:: 1 if ON_GPU else 12]:
                    ok &= validate(
                        f"{label} swap {c} {rows} rows", swap(x, c).float(), want[rows][1], 1e-2
                    )
            if not ON_GPU:
                continue
            x16 = want[ROWS][0]
            one, _ = time_variant(lambda: export(x1), graph=True)
            split, _ = time_variant(lambda: export(x16), graph=True)
            w16 = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16)
            bf16, _ = time_variant(lambda: x16 @ w16.T, graph=True)
            print(
                f"  {label:12s} one row {one * 1e3:6.1f} us ({nbytes / one / 1e9:4.2f} TB/s); 16 rows split-K"
                f" {split * 1e3:6.1f} us ({nbytes / split / 1e9:4.2f}); cuBLAS bf16 {bf16 * 1e3:6.1f} us"
                f" ({2 * n * k / bf16 / 1e9:4.2f} TB/s)",
                flush=True,
            )
            results = []
            for c in sweep:
                try:
                    ms, _ = time_variant(lambda: swap(x16, c), graph=True)
                except Exception as e:  # a tile the compiler refuses: say so, go on
                    print(f"  {label:12s} {c}: {type(e).__name__} {str(e)[:80]}")
                    continue
                results.append((ms, c))
            results.sort()
            for ms, c in results[:3]:
                print(
                    f"  {label:12s} swap {c}: {ms * 1e3:6.1f} us ({nbytes / ms / 1e9:4.2f} TB/s,"
                    f" {ms / one:4.2f}x one row, {ms / split:4.2f}x split-K)",
                    flush=True,
                )
    finish(ok)


if __name__ == "__main__":
    if "--sass" in sys.argv:
        sass_report()
    else:
        main()
