"""Weight-only int8 / int4 matmul for decode: y [M, N] = x [M, K] @ W.T with W quantized, M small.

Napkin math (Qwen3-4B layer matrices, bf16 activations): at M = 1 a matmul reads the weight
once and does 2 FLOPs per weight, so it is bandwidth-bound and the figure of merit is bytes / time
against the 4.19 TB/s read ceiling. Bytes per weight: bf16 2, int8 1 (+ 4 bytes of scale per
row), int4 0.5 + 4 / 128 (fp16 scale and minimum per group of 128). For gate_up (2560 -> 19456,
49.8M weights): bf16 99.6 MB = 23.8 us at the ceiling, int8 49.9 MB = 11.9 us, int4 26.5 MB =
6.3 us. Arithmetic stays under the ridge (~190 FLOP/byte) up to M ~ 100 for int8, ~ 50 for int4,
so a fused kernel should stay near the bytes-bound time for the whole M = 1..64 decode range,
while dequantize-then-matmul moves 1 (or 0.5) + 2 + 2 bytes per weight: always slower than bf16
at small M, and only right once M is large enough that the matmul's arithmetic dominates.

Shapes (K -> N): qkv 2560 -> 6144, gate_up 2560 -> 19456, down 9728 -> 2560, o 4096 -> 2560.
down and o have only 2,560 outputs: 40 programs of 64 rows for 132 SMs, hence split-K.

Variants
  v0  bf16 F.linear (cuBLAS): the dense baseline the quantized kernels must beat
  v1  dequantize to bf16, then F.linear: what the engine does for prefill (M > SKINNY_MAX_ROWS)
  v2  fused Triton kernel (forge_engine.quant), no split along K
  v3  fused Triton kernel with split-K into fp32 partials + sum (the export: about 4 programs per SM)
  v3 sweeps: block_n, num_warps, split at M = 1 and M = 16
"""
import os

from common import DEVICE, ON_GPU, Results, finish, selected, time_variant, validate  # first: it may switch on the interpreter
import torch
import torch.nn.functional as F
from forge_engine.quant import (dequantize_int4, int4_matmul, int4_matmul_reference, int8_matmul,
                                int8_matmul_reference, quantize_int4, quantize_int8)

SHAPES = {"qkv": (2560, 6144), "gate_up": (2560, 19456), "down": (9728, 2560), "o": (4096, 2560)}
ROWS = (1, 8, 16, 32, 64, 128, 256)


def quantized(fmt, w):
    "The format's data and its (fused, reference, dequantize) functions."
    if fmt == "int8":
        q, s = quantize_int8(w)
        return ((lambda x, **kw: int8_matmul(x, q, s, impl="triton", **kw)), (lambda x: int8_matmul_reference(x, q, s)),
                (lambda dtype: (q.to(dtype) * s[:, None].to(dtype))), q.numel() + 4 * s.numel())
    p, s, m = quantize_int4(w)
    return ((lambda x, **kw: int4_matmul(x, p, s, m, impl="triton", **kw)), (lambda x: int4_matmul_reference(x, p, s, m)),
            (lambda dtype: dequantize_int4(p, s, m, dtype)), p.numel() + 2 * (s.numel() + m.numel()))


def variants(fmt, w):
    fused, reference, dequantize, _ = quantized(fmt, w)
    wb = w.to(torch.bfloat16)
    out = {"v0 bf16 F.linear (cuBLAS)": lambda x: F.linear(x, wb),
           "v1 dequantize + F.linear": lambda x: F.linear(x, dequantize(x.dtype)),
           "v2 fused, no split": lambda x: fused(x, split=1),
           "v3 fused + split-K (export)": lambda x: fused(x)}
    return out, reference


def sweep(fmt, w):
    fused = quantized(fmt, w)[0]
    out = {}
    for block_n in (16, 32, 64, 128):
        for warps in (2, 4, 8):
            out[f"v3 block_n={block_n} warps={warps}"] = (lambda b, nw: lambda x: fused(x, block_n=b, num_warps=nw))(block_n, warps)
    for split in (2, 4, 8, 16):
        out[f"v3 split={split}"] = (lambda s: lambda x: fused(x, split=s))(split)
    return out


def main():
    ok = True
    gen = torch.Generator().manual_seed(0)
    sizes = ({name: shape for name, shape in SHAPES.items()} if ON_GPU
             else {"small": (256, 96), "ragged": (384, 40)})
    rows = (1, 2, 8, 64) if ON_GPU else (1, 2, 5)
    print("validation against the dequantize-then-matmul reference (bf16 activations; fp32 on a CPU)")
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    for name, (k, n) in sizes.items():
        w = (torch.randn(n, k, generator=gen) * 0.02).to(DEVICE)
        for fmt in ("int8", "int4"):
            fns, reference = variants(fmt, w)
            for m in rows:
                x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
                want = reference(x)
                for vname, fn in fns.items():
                    if vname.startswith("v0"): continue  # not the same weights
                    ok &= validate(f"{fmt} {name} M={m} {vname}", fn(x), want, 1e-2 if dtype == torch.bfloat16 else 1e-5)
    if ON_GPU:
        results = Results("quant_gemv")
        for name, (k, n) in SHAPES.items():
            w = (torch.randn(n, k, generator=gen) * 0.02).to(DEVICE)
            for fmt in ("int8", "int4"):
                fns, _ = variants(fmt, w)
                qbytes = quantized(fmt, w)[3]
                for m in ROWS:
                    x = torch.randn(m, k, generator=gen).to(DEVICE, torch.bfloat16)
                    io = 2 * m * (k + n)
                    extra = sweep(fmt, w) if m in (1, 16) and os.environ.get("LAB_SWEEP", "1") == "1" else {}
                    for vname, fn in selected({**fns, **extra}).items():
                        nbytes = (2 * n * k if vname.startswith("v0") else qbytes) + io
                        ms, how = time_variant(lambda: fn(x), graph=True)
                        results.add(f"{fmt} {name} {k}->{n} M={m}", f"{vname} [{how}]", ms, nbytes, 2 * m * n * k)
        results.print()
    finish(ok)


if __name__ == "__main__":
    main()
