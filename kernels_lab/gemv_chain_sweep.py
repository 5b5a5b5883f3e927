"""GEMV tile sizes chosen where they run: in a chain. A batch-1 decode step runs each matrix shape 36 times, one
layer after another, so a configuration is timed as one CUDA-graph replay of 36 GEMVs over 36 distinct weights of
one Qwen3-4B shape (nothing stays in the 50 MB L2), not as one matrix alone with the L2 flushed (kernels_lab/gemv.py).

Napkin math: bf16 reads 2 bytes a weight, int8 one, so at the 4.19 TB/s read ceiling an int8 chain should take half
the bf16 time. With int8's conversion written in Triton (`byte_asm=False`) both took ~2.25 ms for a layer's four
matrices: int8 was held back by the work per weight (its conversion to float) or by too few bytes in flight per SM,
not by bytes.

Variants per shape and weight format (bf16, int8 with a scale per row, int4 in groups: chapter 10): the exported
configuration (gemv_config, quant_gemv_config), then a grid of (BLOCK_N, BLOCK_K, num_warps) (int4: (BLOCK_N,
num_warps, chunk bytes)); int8 and int4 also
with their conversions written in Triton (byte_asm=False) against the PTX byte permutes (export), int4 also under a
register cap (maxnreg 80 and 64, or `LAB_INT4_CAPS`: more warps resident an SM; `LAB_INT4_GRID`: int4's grid). Prints per shape the exported configuration's time, its
variants, and the best three of the grid (`LAB_ROWS=1`: the grid of chapter 09's rows layout for bf16 / int8;
`LAB_SHAPES=o,down`: some shapes). `LAB_FOLD=1`: bf16 and int8 with the batch-1 step's add + RMSNorm fold (the norm
in qkv and gate-up, the residual in o and down: which int8 tiles would the fold want).
Run on a GPU from the repository root: PYTHONPATH=. python3 kernels_lab/gemv_chain_sweep.py [bf16,int8,int4]"""

import itertools
import os
import sys
import time

from common import (
    DEVICE,
    HBM_BYTES_PER_S,
    ON_GPU,
    finish,
    graphed_ms,
    validate,
)  # first: it may switch on the interpreter
import torch
import torch.nn.functional as F
from forge_engine.kernels.gemv import gemv, gemv_config
from forge_engine.quant.formats import dequantize_int4, quantize_int4
from forge_engine.quant.gemv import int4_gemv, quant_gemv_config

SHAPES = {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}
GRID = [
    (bn, bk, w)
    for bn, bk, w in itertools.product((4, 8, 16), (512, 1024, 2048), (2, 4, 8))
    if 2048 <= bn * bk <= 16384 and (w < 8 if bn * bk <= 4096 else w > 2)
]  # 16 tiles, warps by tile size
GRID_INT4 = list(
    itertools.product((2, 4, 8), (1, 2, 4), (8, 16))
)  # (BLOCK_N rows, warps, chunk bytes): chapter 10
if os.environ.get(
    "LAB_INT4_GRID"
):  # e.g. "6:1:8,4:2:8": another grid (BLOCK_N need not be a power of two)
    GRID_INT4 = [
        tuple(int(v) for v in c.split(":")) for c in os.environ["LAB_INT4_GRID"].split(",")
    ]
INT4_CAPS = [
    int(c) for c in os.environ.get("LAB_INT4_CAPS", "80,64").split(",")
]  # the export under register caps
BUDGET_S = float(
    os.environ.get("LAB_BUDGET_S", 25)
)  # per shape and format: the grid stops there (the export always runs)
FOLD = bool(
    os.environ.get("LAB_FOLD")
)  # bf16 / int8: each GEMV with the batch-1 step's fold (chapter 09's `norm` for
# qkv and gate-up, `residual` for o and down), as the decode step would run it folded
ROWS = bool(
    os.environ.get("LAB_ROWS")
)  # bf16 / int8: the grid of chapter 09's rows layout instead of the tile's
# (BLOCK_N rows, warps, 8, 16 or 32 bytes of each row a thread and step: block_k = 32 x warps x that many weights)
GRID_ROWS = [
    (bn, w, c)
    for bn, w, c in itertools.product((2, 4, 8), (1, 2, 4, 8), (8, 16, 32))
    if bn * c <= 128
]
ONLY = os.environ.get("LAB_SHAPES")  # some of SHAPES, by name (comma-separated; default all)
LAYERS = 36


def weights(fmt, n, k):
    "One matrix in `fmt`: the tensors its kernel takes after x."
    if fmt == "int8":
        return torch.randint(-127, 128, (n, k), device=DEVICE, dtype=torch.int8), torch.rand(
            n, device=DEVICE
        ) / 127 / k**0.5
    w = (torch.randn(n, k, device=DEVICE) / k**0.5).bfloat16()
    return quantize_int4(w) if fmt == "int4" else (w,)


def product(fmt, x, w, **launch):
    "x @ w.T by the format's GEMV (launch: tiles, warps, byte_asm)."
    if fmt == "int4":
        return int4_gemv(x, *w, **launch)
    return gemv(x, w[0], None, w[1] if fmt == "int8" else None, impl="triton", **launch)


def reference(fmt, x, w):
    if fmt == "int4":
        return F.linear(x.float(), dequantize_int4(*w))
    return F.linear(x.float(), w[0].float()) * (w[1][None, :] if fmt == "int8" else 1)


def exported(fmt, n, k):
    return (
        quant_gemv_config(n, k) if fmt == "int4" else gemv_config(n, k, 1 if fmt == "int8" else 2)
    )


BYTES_PER_WEIGHT = {
    "bf16": 2,
    "int8": 1,
    "int4": 0.5,
}  # (int4's scales and minimums add 3%: not counted)


def main():
    formats = (sys.argv[1] if len(sys.argv) > 1 else "bf16,int8,int4").split(",")
    ok = True
    for fmt in formats:  # validation: the PTX conversions and their Triton twins against F.linear
        for m, (n, k) in (
            ((1, (96, 512)), (2, (40, 1024)), (1, (2560, 4096))) if ON_GPU else ((1, (8, 256)),)
        ):
            w, x = weights(fmt, n, k), torch.randn(m, k, device=DEVICE).bfloat16()
            for asm in (True, False) if ON_GPU and fmt != "bf16" else (None,):
                got = product(
                    fmt, x, w, byte_asm=asm, **({} if fmt == "int4" else dict(block_k=min(512, k)))
                )
                ok &= validate(
                    f"{fmt} M={m} N={n} K={k} byte_asm={asm}",
                    got.float(),
                    reference(fmt, x, w),
                    1e-2,
                )
    if not ON_GPU:
        finish(ok)
    print(
        f"\n== {LAYERS} GEMVs of one shape, distinct weights, one CUDA-graph replay; ceiling {HBM_BYTES_PER_S / 1e12:.2f} TB/s"
    )
    for fmt, (label, (n, k)) in itertools.product(formats, SHAPES.items()):
        if ONLY and label not in ONLY.split(","):
            continue
        layers = [weights(fmt, n, k) for _ in range(LAYERS)]
        x = torch.randn(1, k, device=DEVICE).bfloat16()
        nbytes = LAYERS * n * k * BYTES_PER_WEIGHT[fmt]
        fold = {}
        if FOLD and fmt != "int4":  # (chapter 10's int4 GEMV has no fold)
            fold = (
                dict(norm=1 + 0.1 * torch.randn(k, device=DEVICE).bfloat16())
                if label in ("qkv", "gate_up")
                else dict(residual=torch.randn(1, n, device=DEVICE).bfloat16())
            )

        def timed(**launch):
            try:
                ms = graphed_ms(lambda: [product(fmt, x, w, **fold, **launch) for w in layers])
            except (
                Exception
            ) as e:  # (a configuration the compiler refuses: out of registers or shared memory)
                print(f"  {fmt} {label} {launch}: failed ({type(e).__name__})")
                return float("inf")
            return ms

        start = time.monotonic()
        results = {"export " + str(exported(fmt, n, k)): timed()}
        if fmt != "bf16":
            results["export, Triton conversion"] = timed(byte_asm=False)
        for early in (
            True,
            False,
        ):  # each program's first weights asked for before it waits for x, or not
            results[f"export, first weights early={early}"] = timed(early_weights=early)
        if (
            fmt == "int4"
        ):  # a register cap: more warps an SM (gemv_sass.py: 80 spills nothing, 64 spills)
            for cap in INT4_CAPS:
                results[f"export, maxnreg={cap}"] = timed(maxnreg=cap)
        rows = ROWS and fmt != "int4"
        for config in GRID_INT4 if fmt == "int4" else GRID_ROWS if rows else GRID:
            if time.monotonic() - start > BUDGET_S:
                break
            if rows:  # (block_n, warps, bytes) -> the rows layout's launch
                block_n, warps, chunk = config
                results["rows " + str(config)] = timed(
                    layout="rows",
                    block_n=block_n,
                    num_warps=warps,
                    block_k=32 * warps * chunk // int(BYTES_PER_WEIGHT[fmt]),
                )
                continue
            names = (
                ("block_n", "num_warps", "chunk")
                if fmt == "int4"
                else ("block_n", "block_k", "num_warps")
            )
            results[str(config)] = timed(**dict(zip(names, config)))
        best = sorted(results.items(), key=lambda kv: kv[1])
        for name, ms in [r for r in results.items() if not r[0].startswith(("(", "rows"))] + best[
            :3
        ]:
            print(
                f"  {fmt:5s} {label:8s} {'fold ' if fold else ''}{name:28s} {ms * 1e3 / LAYERS:7.2f} us/matrix  "
                f"{nbytes / ms / 1e9:6.2f} TB/s  {100 * nbytes / (ms / 1e3) / HBM_BYTES_PER_S:5.1f}%",
                flush=True,
            )
        layers = None  # (freed; not `del`: the lambdas above name it)
        torch.cuda.empty_cache()
    finish(ok)


if __name__ == "__main__":
    main()
