"""GEMV tile sizes chosen where they run: in a chain. A batch-1 decode step runs each matrix shape 36 times, one
layer after another, so a configuration is timed as one CUDA-graph replay of 36 GEMVs over 36 distinct weights of
one Qwen3-4B shape (nothing stays in the 50 MB L2), not as one matrix alone with the L2 flushed (kernels_lab/gemv.py).

Napkin math: bf16 reads 2 bytes a weight, int8 one, so at the 4.19 TB/s read ceiling an int8 chain should take
half the bf16 time. In session 3 both took ~2.25 ms for a layer's four matrices: int8 is held back by the work per
weight (its conversion to float) or by too few bytes in flight per SM, not by bytes.

Variants per shape and weight format: the exported configuration (gemv_config), then a grid of
(BLOCK_N, BLOCK_K, num_warps); int8 also with the conversion written in Triton (byte_asm=False) against the
PTX byte permute (export). Prints per shape the best configuration and the exported one's time.
Run on a GPU from the repository root: PYTHONPATH=. python3 kernels_lab/gemv_chain_sweep.py [bf16,int8]"""
import itertools
import os
import sys
import time

from common import DEVICE, HBM_BYTES_PER_S, ON_GPU, finish, graphed_ms, validate  # first: it may switch on the interpreter
import torch
import torch.nn.functional as F
from forge_engine.kernels import gemv, gemv_config

SHAPES = {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}
GRID = [(bn, bk, w) for bn, bk, w in itertools.product((4, 8, 16), (512, 1024, 2048), (2, 4, 8))
        if 2048 <= bn * bk <= 16384 and (w < 8 if bn * bk <= 4096 else w > 2)]  # 16 tiles, warps by tile size
BUDGET_S = float(os.environ.get("LAB_BUDGET_S", 25))  # per shape and format: the grid stops there (the export always runs)
LAYERS = 36


def weights(fmt, n, k, count):
    if fmt == "int8":
        return [(torch.randint(-127, 128, (n, k), device=DEVICE, dtype=torch.int8),
                 torch.rand(n, device=DEVICE) / 127 / k ** 0.5) for _ in range(count)]
    return [((torch.randn(n, k, device=DEVICE) / k ** 0.5).bfloat16(), None) for _ in range(count)]


def main():
    formats = (sys.argv[1] if len(sys.argv) > 1 else "bf16,int8").split(",")
    ok = True
    for fmt in formats:  # validation: PTX conversion and Triton conversion against F.linear
        for m, (n, k) in ((1, (96, 512)), (2, (40, 1024)), (1, (2560, 4096))) if ON_GPU else ((1, (8, 64)),):
            (w, scale), = weights(fmt, n, k, 1)
            x = torch.randn(m, k, device=DEVICE).bfloat16()
            want = F.linear(x.float(), w.float()) * (scale[None, :] if scale is not None else 1)
            for asm in ((True, False) if ON_GPU and fmt == "int8" else (None,)):
                got = gemv(x, w, None, scale, impl="triton", block_k=min(512, k), byte_asm=asm)
                ok &= validate(f"{fmt} M={m} N={n} K={k} byte_asm={asm}", got.float(), want, 1e-2)
    if not ON_GPU:
        finish(ok)
    print(f"\n== {LAYERS} GEMVs of one shape, distinct weights, one CUDA-graph replay; ceiling {HBM_BYTES_PER_S / 1e12:.2f} TB/s")
    for fmt, (label, (n, k)) in itertools.product(formats, SHAPES.items()):
        layers = weights(fmt, n, k, LAYERS)
        x = torch.randn(1, k, device=DEVICE).bfloat16()
        nbytes = LAYERS * n * k * (1 if fmt == "int8" else 2)

        def timed(**launch):
            try:
                ms = graphed_ms(lambda: [gemv(x, w, None, s, **launch) for w, s in layers])
            except Exception as e:  # (a configuration the compiler refuses: out of registers or shared memory)
                print(f"  {fmt} {label} {launch}: failed ({type(e).__name__})")
                return float("inf")
            return ms

        start = time.monotonic()
        export = gemv_config(n, k, 1 if fmt == "int8" else 2)
        results = {"export " + str(export): timed()}
        if fmt == "int8":
            results["export, Triton conversion"] = timed(byte_asm=False)
        for bn, bk, w in GRID:
            if time.monotonic() - start > BUDGET_S: break
            results[f"({bn}, {bk}, {w})"] = timed(block_n=bn, block_k=bk, num_warps=w)
        best = sorted(results.items(), key=lambda kv: kv[1])
        for name, ms in [r for r in results.items() if not r[0].startswith("(")] + best[:3]:
            print(f"  {fmt:5s} {label:8s} {name:28s} {ms * 1e3 / LAYERS:7.2f} us/matrix  "
                  f"{nbytes / ms / 1e9:6.2f} TB/s  {100 * nbytes / (ms / 1e3) / HBM_BYTES_PER_S:5.1f}%", flush=True)
        del layers
        torch.cuda.empty_cache()
    finish(ok)


if __name__ == "__main__":
    main()
