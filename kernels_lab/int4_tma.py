"""int4 decode GEMV with its weights brought in by the tensor memory accelerator (TMA): the contender to chapter 10's
`int4_gemv` (t0), whose bandwidth is capped by the bytes it can have in flight.

Why: offline compiles (`gemv_sass.py`) put chapter 10's int4 tiles at 64-72 registers a thread and 28-32 warps an SM,
each warp with one step of weights requested (4 rows x 8 bytes a thread): ~32 KB on their way an SM, against ~48 for
the BF16 GEMV, and the int4 GEMVs read at 1.4-2.0 TB/s where the BF16 and int8 ones reach 3.5-3.8 (Little's law: the
bytes in flight over the memory's latency). A TMA load asks for a whole [BLOCK_N, BK] tile of weight bytes with one
instruction into shared memory, no registers held while it travels; Triton's loop pipelining (`tl.range(...,
num_stages=STAGES)`) keeps STAGES - 1 tiles of a program on their way while it computes on one. So the bytes in flight
are set by shared memory (228 KB an SM), not registers.

The arithmetic is chapter 10's: `_nibbles_to_f32` (128 + low nibble, 128 + high nibble / 16, exactly, one LOP3 a
weight), the 128 x Σ x and 2048 x Σ x offsets taken off per group, then scale and minimum; a program's BLOCK_N rows
share x's loads (from L2). The packing is chapter 10's too: per group of 128 inputs 64 bytes, byte j input j in its
low nibble and input j + 64 in its high one.

Variants: t0 the export; tma-BN-BK-S-W: BLOCK_N rows, BK bytes of a row a step, S stages, W warps; "late" the wait for
x before the loop (the pipeline's first tiles then also wait), else the wait sits in the loop before x's load (asked
every step: once the kernel before has finished it returns at once). Each timed as a CUDA graph of 36 distinct
matrices of a Qwen3-4B shape (nothing stays in L2), dependent launches on for all.

Run: PYTHONPATH=. python3 kernels_lab/int4_tma.py   (GPU: sm_90; on a CPU the interpreter checks a small case)"""

import os
import sys

from common import ON_GPU, finish, validate  # first: on a CPU it switches on the interpreter
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from forge_engine.kernels.backend import pdl_supported
from forge_engine.quant.formats import dequantize_int4, quantize_int4
from forge_engine.quant.gemv import _nibbles_to_f32, int4_gemv

SHAPES = {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}
CONFIGS = [
    (bn, bk, s, w, late)
    for bn, bk, s, w in (
        (8, 256, 3, 4),
        (8, 256, 4, 4),
        (16, 256, 3, 4),
        (16, 128, 4, 4),
        (4, 256, 4, 2),
        (8, 128, 4, 2),
        (16, 256, 2, 8),
        (32, 128, 3, 4),
    )
    for late in (False,)
] + [(8, 256, 4, 4, True), (16, 256, 3, 4, True)]


@triton.jit
def _int4_tma_kernel(
    x_ptr,
    w_desc,
    scale_ptr,
    min_ptr,
    out_ptr,
    N,
    K,
    BLOCK_N: tl.constexpr,
    BK: tl.constexpr,
    STAGES: tl.constexpr,
    GROUP: tl.constexpr,
    PDL: tl.constexpr,
    LATE_WAIT: tl.constexpr,
    BYTE_ASM: tl.constexpr,
):
    HALF: tl.constexpr = GROUP // 2  # bytes of a row per group
    G: tl.constexpr = BK // HALF  # groups a step
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        if LATE_WAIT:
            tl.extra.cuda.gdc_wait()
    row0 = tl.program_id(0) * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    groups = K // GROUP
    acc = tl.zeros((BLOCK_N, G), dtype=tl.float32)
    for b0 in tl.range(0, K // 2, BK, num_stages=STAGES):
        w = tl.reshape(w_desc.load([row0, b0]), (BLOCK_N, G, HALF))  # [rows, groups, bytes]
        if PDL and not LATE_WAIT:
            tl.extra.cuda.gdc_wait()  # x comes from the kernel before
        g = b0 // HALF + tl.arange(0, G)
        x_at = g[:, None] * GROUP + tl.arange(0, HALF)[None, :]
        x_lo = tl.load(x_ptr + x_at).to(tl.float32)  # [groups, bytes]: the low nibbles' inputs
        x_hi = tl.load(x_ptr + x_at + HALF).to(tl.float32)  # ... the high ones'
        s_lo, s_hi = tl.sum(x_lo, axis=1), tl.sum(x_hi, axis=1)
        f_lo, f_hi = _nibbles_to_f32(w, BYTE_ASM)  # 128 + q_lo, 128 + q_hi / 16
        xq = (
            tl.sum(f_lo * x_lo[None, :, :], axis=2)
            + 16.0 * tl.sum(f_hi * x_hi[None, :, :], axis=2)
            - (128.0 * s_lo + 2048.0 * s_hi)[None, :]
        )  # Σ x q per row and group
        at = rows[:, None] * groups + g[None, :]
        scale = tl.load(scale_ptr + at, mask=row_ok[:, None], other=0.0).to(tl.float32)
        minimum = tl.load(min_ptr + at, mask=row_ok[:, None], other=0.0).to(tl.float32)
        acc += xq * scale + (s_lo + s_hi)[None, :] * minimum
    tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=row_ok)


def descriptor(packed: torch.Tensor, block_n: int, bk: int) -> TensorDescriptor:
    "The TMA descriptor of a packed int4 weight [N, K / 2] for [block_n, bk]-byte tiles (made once per weight)."
    return TensorDescriptor.from_tensor(packed, [block_n, bk])


def int4_tma_gemv(
    x: torch.Tensor,
    desc: TensorDescriptor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    block_n: int,
    bk: int,
    stages: int,
    warps: int,
    late: bool,
) -> torch.Tensor:
    "y [1, N] = x [1, K] @ W.T, W int4 (chapter 10's packing) read through `desc` (from `descriptor`)."
    n, k = desc.shape[0], x.shape[1]
    group = k // scale.shape[1]
    if x.shape[0] != 1 or (k // 2) % bk or bk % (group // 2):
        raise ValueError(
            f"one row of x and whole steps of whole groups: K {k}, BK {bk}, group {group}"
        )
    out = torch.empty((1, n), device=x.device, dtype=x.dtype)
    pdl = pdl_supported(x.device)
    _int4_tma_kernel[(triton.cdiv(n, block_n),)](
        x,
        desc,
        scale,
        minimum,
        out,
        n,
        k,
        BLOCK_N=block_n,
        BK=bk,
        STAGES=stages,
        GROUP=group,
        PDL=pdl,
        LATE_WAIT=late,
        BYTE_ASM=ON_GPU,
        num_warps=warps,
        launch_pdl=pdl,
    )
    return out


def reference(x, mat):
    return F.linear(x.float(), dequantize_int4(*mat))


def check_small(device) -> bool:
    "Against the dequantized matmul: a partial last tile of rows, several steps, each variant's arithmetic."
    ok = True
    torch.manual_seed(0)
    for n, k in ((40, 1024), (24, 512)):
        w = (torch.randn(n, k, device=device) / k**0.5).bfloat16()
        mat = quantize_int4(w)
        x = torch.randn(1, k, device=device).bfloat16()
        want = reference(x, mat)
        for block_n, bk, stages, warps, late in ((16, 128, 2, 4, False), (8, 256, 3, 2, True)):
            if (k // 2) % bk:
                continue
            got = int4_tma_gemv(
                x, descriptor(mat[0], block_n, bk), *mat[1:], block_n, bk, stages, warps, late
            )
            ok &= validate(
                f"{n}x{k} tma-{block_n}-{bk}-{stages}-{warps}{'-late' if late else ''}",
                got.float(),
                want,
                2e-2,
            )
    return ok


def chain_ms(fn, matrices) -> float:
    "Median ms of one CUDA-graph replay of fn over the 36 matrices (each a distinct weight: nothing stays in L2)."
    from common import graphed_ms

    return graphed_ms(lambda: [fn(m) for m in matrices]) / len(matrices)


def main():
    if not ON_GPU:
        sys.exit(0 if check_small("cpu") else 1)
    ok = check_small("cuda")
    budget = float(os.environ.get("LAB_BUDGET_S", "400"))
    import time

    began = time.time()
    for name, (n, k) in SHAPES.items():
        x = torch.randn(1, k, device="cuda").bfloat16()
        mats = [
            quantize_int4((torch.randn(n, k, device="cuda") / k**0.5).bfloat16()) for _ in range(36)
        ]
        want = reference(x, mats[0])
        nbytes = sum(t.nbytes for t in mats[0])
        ok &= validate(f"{name} t0", int4_gemv(x, *mats[0]).float(), want, 2e-2)
        t0 = chain_ms(lambda m: int4_gemv(x, *m), mats)
        print(
            f"{name:8s} t0 (export)          {t0 * 1e3:7.2f} us a matrix, {nbytes / t0 / 1e9:5.2f} TB/s",
            flush=True,
        )
        for block_n, bk, stages, warps, late in CONFIGS:
            if time.time() - began > budget or (k // 2) % bk:
                continue
            label = f"tma-{block_n}-{bk}-{stages}-{warps}{'-late' if late else ''}"
            descs = [(descriptor(m[0], block_n, bk), *m[1:]) for m in mats]
            fn = lambda m: int4_tma_gemv(x, *m, block_n, bk, stages, warps, late)  # noqa: E731
            try:
                ok &= validate(f"{name} {label}", fn(descs[0]).float(), want, 2e-2)
                ms = chain_ms(fn, descs)
            except Exception as error:  # a configuration the compiler refuses (shared memory, TMA box): said, skipped
                print(
                    f"{name:8s} {label:20s} failed: {type(error).__name__}: {str(error)[:200]}",
                    flush=True,
                )
                continue
            print(
                f"{name:8s} {label:20s} {ms * 1e3:7.2f} us a matrix, {nbytes / ms / 1e9:5.2f} TB/s",
                flush=True,
            )
        del mats
        torch.cuda.empty_cache()
    finish(ok)


if __name__ == "__main__":
    main()
