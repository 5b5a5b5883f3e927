"""A few rows (2-16) times a BF16 weight matrix: a verify step's rows (chapter 08c) or a small decode batch.

At these sizes a matmul reads the weights once and does almost no arithmetic, so it should take what one row's GEMV
takes: weight bytes / read bandwidth. cuBLAS at 5 rows made random Qwen3-4B's verify step (1 + 4 rows) cost 1.41x a
one-row decode step (`kernels_lab/verify_step.py`), 3.54 ms against 2.51.

Variants (each validated against x.float() @ w.float().T):
- cublas: F.linear.
- gemv1: chapter 09's GEMV on one row (the floor: what one row costs).
- tile: one program per BLOCK_N outputs, the rows padded to 16 for `tl.dot`, a loop over K in BLOCK_K steps, swept
  over BLOCK_N x BLOCK_K x warps x stages.
- split: the same, K split over SPLIT programs that add FP32 partial sums with atomics, then one cast.
- gemv: chapter 09's GEMV on all the rows at once (its 'tile' layout, a [rows, BLOCK_N, BLOCK_K] accumulator; its row
  limit lifted to 8 here), swept over BLOCK_N x BLOCK_K x warps.

Timed as one CUDA graph replay over COPIES distinct weight copies (more bytes than the L2 holds), per matrix.

Run on a GPU from the repository root: PYTHONPATH=. python3 kernels_lab/few_rows_matmul.py [rows,...]
(LAB_GEMV_ONLY=1: cuBLAS and the GEMV only)"""

import functools
import itertools
import os
import sys

from common import HBM_BYTES_PER_S, ON_GPU, graphed_ms  # first: it may switch on the interpreter
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import forge_engine.kernels.gemv as gemv_module
from forge_engine.kernels.gemv import gemv

gemv_module.GEMV_MAX_ROWS = 8  # the lab tries the GEMV past the package's limit
GEMV_GRID = list(itertools.product((1, 2, 4), (256, 512, 1024), (2, 4)))

SHAPES = {  # (N, K) of Qwen3-4B's matrices
    "qkv": (6144, 2560),
    "o": (2560, 4096),
    "gate_up": (19456, 2560),
    "down": (2560, 9728),
    "head": (151936, 2560),
}
COPIES = 4


@triton.jit
def _tile_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_o,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT) * BLOCK_K
    start = pid_k * per_split
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(start, tl.minimum(start + per_split, K), BLOCK_K):
        at = k0 + offs_k
        x = tl.load(
            x_ptr + rows[:, None] * stride_x + at[None, :],
            mask=(rows[:, None] < M) & (at[None, :] < K),
            other=0.0,
        )
        w = tl.load(
            w_ptr + cols[:, None] * stride_w + at[None, :],
            mask=(cols[:, None] < N) & (at[None, :] < K),
            other=0.0,
        )
        acc = tl.dot(x, tl.trans(w), acc)
    where = out_ptr + rows[:, None] * stride_o + cols[None, :]
    ok = (rows[:, None] < M) & (cols[None, :] < N)
    if SPLIT == 1:
        tl.store(where, acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.atomic_add(where, acc, mask=ok, sem="relaxed")


def tile_matmul(x, w, block_n, block_k, warps, stages, split=1):
    m, k = x.shape
    n = w.shape[0]
    out = (
        torch.zeros(m, n, device=x.device, dtype=torch.float32) if split > 1 else x.new_empty(m, n)
    )
    grid = (triton.cdiv(n, block_n), split)
    _tile_kernel[grid](
        x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out.to(x.dtype) if split > 1 else out


def main(rows_list):
    device = "cuda" if ON_GPU else "cpu"
    shapes = SHAPES if ON_GPU else {"small": (96, 80)}
    grid = (
        list(itertools.product((16, 32, 64), (128, 256, 512), (4,), (3, 4), (1, 2, 4)))
        if ON_GPU
        else [(16, 32, 4, 2, 1), (32, 64, 4, 2, 2)]
    )
    for name, (n, k) in shapes.items():
        weights = [
            torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5 for _ in range(COPIES)
        ]
        nbytes = n * k * 2
        for m in rows_list:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            want = x.float() @ weights[0].float().T
            line = {}
            if ON_GPU:
                line["cublas"] = graphed_ms(lambda: [F.linear(x, w) for w in weights]) / COPIES
                line["gemv1"] = graphed_ms(lambda: [gemv(x[:1], w) for w in weights]) / COPIES
            best = (float("inf"), None)
            for bn, bk, warps, stages, split in [] if os.environ.get("LAB_GEMV_ONLY") else grid:
                if split > 1 and n >= 8192:
                    continue
                try:
                    got = tile_matmul(x, weights[0], bn, bk, warps, stages, split).float()
                except Exception as e:  # (out of shared memory: a config too large)
                    print(f"  skip {bn, bk, warps, stages, split}: {str(e).splitlines()[0][:80]}")
                    continue
                err = ((got - want).abs().max() / want.abs().max()).item()
                if err > 2e-2:
                    print(
                        f"  FAIL {name} m={m} {bn, bk, warps, stages, split}: rel error {err:.2e}"
                    )
                    continue
                if ON_GPU:
                    ms = (
                        graphed_ms(
                            lambda: [
                                tile_matmul(x, w, bn, bk, warps, stages, split) for w in weights
                            ]
                        )
                        / COPIES
                    )
                    best = min(best, (ms, (bn, bk, warps, stages, split)))
            best_gemv = (float("inf"), None)
            for bn, bk, warps in GEMV_GRID if ON_GPU else [(2, 32, 4)]:
                run = functools.partial(
                    gemv, block_n=bn, block_k=bk, num_warps=warps, layout="tile"
                )
                err = ((run(x, weights[0]).float() - want).abs().max() / want.abs().max()).item()
                if err > 2e-2:
                    print(f"  FAIL {name} m={m} gemv {bn, bk, warps}: rel error {err:.2e}")
                    continue
                if ON_GPU:
                    ms = graphed_ms(lambda: [run(x, w) for w in weights]) / COPIES
                    best_gemv = min(best_gemv, (ms, (bn, bk, warps)))
            if ON_GPU:
                ms, cfg = best
                line["tile best"] = ms
                line["gemv best"] = best_gemv[0]
                print(f"  best gemv {best_gemv[1]}")
                print(
                    f"{name:8s} N={n:6d} K={k:5d} m={m:2d}: "
                    + ", ".join(
                        f"{key} {v * 1e3:7.1f} us ({nbytes / (v * 1e-3) / 1e12:.2f} TB/s)"
                        for key, v in line.items()
                    )
                    + f"  best tile {cfg}"
                )
            else:
                print(f"{name} m={m}: every variant within tolerance")


if __name__ == "__main__":
    main([int(r) for r in (sys.argv[1] if len(sys.argv) > 1 else "5,16").split(",")])
    print(f"(read ceiling {HBM_BYTES_PER_S / 1e12:.2f} TB/s)")
