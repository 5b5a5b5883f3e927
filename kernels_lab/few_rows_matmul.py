"""A few rows (2-8) times a BF16 weight matrix: a verify step's rows (chapter 08c) or a small decode batch.

At these sizes a matmul reads the weights once and does almost no arithmetic, so it should take what one row's GEMV
takes: weight bytes / read bandwidth. cuBLAS at 5 rows made random Qwen3-4B's verify step (1 + 4 rows) cost 1.33x a
one-row decode step on an H100 (`kernels_lab/verify_step.py`).

Variants (each validated against x.float() @ w.float().T):
- cublas: F.linear.
- gemv1: chapter 09's GEMV on one row (the floor: what one row costs).
- rows: chapter 09's GEMV in its rows layout on all the rows at once (each thread the same inputs of BLOCK_N weight
  rows, converted once and multiplied by every row of x: ROWS x BLOCK_N accumulators), swept over BLOCK_N x warps x
  a thread's chunk of inputs; the first rows count sweeps the whole grid, the others try its best three.
(A `tl.dot` tile padding the rows to 16, with and without split-K, lost to cuBLAS here: chapter 09 says by how much.)

Timed as one CUDA graph replay over COPIES distinct weight copies (more bytes than the L2 holds), per matrix.
LAB_FOLD=1: each GEMV with what a BF16 step folds into it (the norms, SiLU-mul, the residual adds: chapter 09a;
cuBLAS and gemv1 without); LAB_FOLD=handoff: the norms handed from GEMV to GEMV instead (the hand-off's sums grow
from replay to replay: timing only). LAB_BEST_OUT=FILE: the best rows configuration per (N, K, rows) as JSON, which verify_step.py's LAB_ROWS_CONFIGS reads.

Run on a GPU from the repository root: PYTHONPATH=. python3 kernels_lab/few_rows_matmul.py [rows,...]"""

import functools
import itertools
import json
import os
import sys

from common import HBM_BYTES_PER_S, ON_GPU, graphed_ms  # first: it may switch on the interpreter
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from forge_engine.kernels.gemv import gemv

SHAPES = {  # (N, K) of Qwen3-4B's matrices
    "qkv": (6144, 2560),
    "o": (2560, 4096),
    "gate_up": (19456, 2560),
    "down": (2560, 9728),
    "head": (151936, 2560),
}
COPIES = 4


ROWS_GRID = [  # (BLOCK_N, warps, chunk of inputs a thread): BLOCK_K = 32 x warps x chunk
    (bn, warps, 8) for bn in (2, 4, 8) for warps in (1, 2, 4)
] + [(2, 2, 16), (4, 2, 16)]


def rows_gemv(bn: int, warps: int, chunk: int):
    return functools.partial(
        gemv, block_n=bn, block_k=32 * warps * chunk, num_warps=warps, layout="rows"
    )


def step_folds(name: str, m: int, n: int, k: int, device: str, hand_off: bool) -> dict:
    """What a BF16 step folds into each GEMV (chapter 09a): the norms into qkv and gate-up (with SiLU-mul), the
    residual adds into o and down; `hand_off`: each norm handed from o / down (its squares summed there, x·g stored)
    to qkv / gate-up (x·g read, scaled by 1 / rms at the end) instead of applied in the loop."""
    if name in ("qkv", "gate_up", "small"):
        folds = dict(swiglu=name == "gate_up")
        if hand_off:
            return dict(folds, norm_sums=torch.full((m,), float(k), device=device))
        return dict(folds, norm=torch.rand(k, device=device, dtype=torch.bfloat16) + 0.5)
    if name in ("o", "down"):
        folds = dict(residual=torch.randn(m, n, device=device, dtype=torch.bfloat16))
        if hand_off:
            g = torch.rand(n, device=device, dtype=torch.bfloat16) + 0.5
            return dict(folds, hand_off=(g, torch.zeros(m, device=device)))
        return folds
    return {}


def first(result):
    "A GEMV's output (with `hand_off` it returns two)."
    return result[0] if isinstance(result, tuple) else result


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).abs().max() / want.abs().max()).item()


def main(rows_list):
    device = "cuda" if ON_GPU else "cpu"
    shapes = SHAPES if ON_GPU else {"small": (96, 80)}
    best_configs = {}
    for name, (n, k) in shapes.items():
        weights = [
            torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5 for _ in range(COPIES)
        ]
        nbytes = n * k * 2
        ranked = None  # the first rows count's configurations, fastest first
        for m in rows_list:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            fold = os.environ.get("LAB_FOLD")
            folds = step_folds(name, m, n, k, device, fold == "handoff") if fold else {}
            want = first(gemv(x, weights[0], impl="torch", layout="rows", **folds)).float()
            line = {}
            if ON_GPU:
                line["cublas"] = graphed_ms(lambda: [F.linear(x, w) for w in weights]) / COPIES
                line["gemv1"] = graphed_ms(lambda: [gemv(x[:1], w) for w in weights]) / COPIES
            grid = ROWS_GRID if ON_GPU else [(2, 1, 8), (4, 2, 8)]
            timed = []
            for cfg in grid if ranked is None else ranked[:3]:
                run = rows_gemv(*cfg)
                err = rel_err(first(run(x, weights[0], **folds)), want)
                if err > 2e-2:
                    print(f"  FAIL {name} m={m} rows {cfg}: rel error {err:.2e}")
                    continue
                if ON_GPU:
                    timed.append(
                        (graphed_ms(lambda: [run(x, w, **folds) for w in weights]) / COPIES, cfg)
                    )
            timed.sort()
            ranked = ranked or [cfg for _, cfg in timed]
            if timed:
                line["rows best"] = timed[0][0]
                best_configs[f"{n},{k},{m}"] = timed[0][1]
            if ON_GPU:
                print(
                    f"{name:8s} N={n:6d} K={k:5d} m={m:2d}: "
                    + ", ".join(
                        f"{key} {v * 1e3:7.1f} us ({nbytes / (v * 1e-3) / 1e12:.2f} TB/s)"
                        for key, v in line.items()
                    )
                    + f"  rows {timed[0][1] if timed else None} (BLOCK_N, warps, chunk)"
                )
            else:
                print(f"{name} m={m}: every variant within tolerance")
    if os.environ.get("LAB_BEST_OUT"):
        with open(os.environ["LAB_BEST_OUT"], "w") as f:
            json.dump(best_configs, f, indent=1)


if __name__ == "__main__":
    main([int(r) for r in (sys.argv[1] if len(sys.argv) > 1 else "5,2,8").split(",")])
    print(f"(read ceiling {HBM_BYTES_PER_S / 1e12:.2f} TB/s)")
