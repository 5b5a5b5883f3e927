"""Weight-only int4 and GGUF matmuls for decode at 1, 2 and 4 rows: y [M, N] = x [M, K] @ W.T, W quantized.

Napkin math (Qwen3-4B layer matrices, bf16 activations): at M <= 4 a matmul reads the weight once
and does 2 FLOPs per weight and row, so it is bandwidth-bound and the figure of merit is bytes /
time against the 4.19 TB/s read ceiling. Bytes per weight: bf16 2, int4 0.5 + 4 / 128 (fp16
scale and minimum per group of 128), GGUF Q8_0 34/32, Q6_K 210/256, Q4_K 144/256. For gate_up
(2560 -> 19456, 49.8M weights): bf16 99.6 MB = 23.8 us at the ceiling, int4 26.5 MB = 6.3 us.
At 4.19 TB/s an H200 reads 8.4e12 nibbles/s and issues ~3.3e13 thread-instructions/s: about four
instructions per int4 weight, so decoding the nibbles cheaply matters as much as the loads.

Shapes (N x K, the weight): qkv 6144x2560, o 2560x4096, gate_up 19456x2560, down 2560x9728.

Variants (times are CUDA-graph replays, L2 flushed)
  v0  bf16 F.linear (cuBLAS)
  v1  bf16 forge_engine.kernels.gemv (chapter 09, the engine's one-row path)
  v2  int4 split-K kernel (`int4_matmul(kernel="split_k")`)
  v3  int4 GEMV, the export (`int4_gemv`, `quant_gemv_config`)
  v4  int4 GEMV sweep: BLOCK_N x num_warps x chunk bytes, at M = 1 and 4; the best per shape is printed
  g1  GGUF split-K kernel (Q8_0, Q6_K, Q4_K: random blocks with sane scales), M = 1 and 4
  g2  GGUF GEMV launch, the export (`gguf_matmul` at <= 4 rows, `gguf_gemv_config`), M = 1 and 4
  g3  GGUF GEMV sweep (M = 1), if time is left

Environment: QUANT_ROWS=1,2,4 (rows), LAB_VARIANTS=v0,v3 (prefixes), LAB_BUDGET_S=140 (no new case
or sweep configuration starts after this many seconds, so the file stays under 3 minutes on an H200;
most of the time is Triton compiling the ~100 configurations). Prints rows as they come, then a table.
"""

import itertools
import os
import time

from common import (
    DEVICE,
    ON_GPU,
    Results,
    finish,
    selected,
    time_variant,
    validate,
)  # first: it may switch on the interpreter
import torch
import torch.nn.functional as F
from forge_engine.kernels.gemv import gemv
from forge_engine.quant.formats import quantize_int4
from forge_engine.quant.gemv import int4_gemv, int4_matmul, int4_matmul_reference
from forge_engine.quant.gguf_blocks import KEPT_GGUF_TYPES, gguf_matmul

SHAPES = {
    "qkv 6144x2560": (6144, 2560),
    "o 2560x4096": (2560, 4096),
    "gate_up 19456x2560": (19456, 2560),
    "down 2560x9728": (2560, 9728),
}
GGUF_TYPES = {"Q8_0": 8, "Q6_K": 14, "Q4_K": 12}
INT4_SWEEP = list(
    itertools.product((1, 2, 4, 8), (8, 16), (1, 2, 4))
)  # (block_n, chunk bytes, num_warps)
GGUF_ROWS = (1, 4)  # the GGUF rows at M = 2 would cost more compile time than they teach
GGUF_SWEEP = list(itertools.product((2, 4, 8), (512, 1024), (4, 8)))
START = time.perf_counter()
BUDGET_S = float(os.environ.get("LAB_BUDGET_S", "140"))


def time_left() -> bool:
    return time.perf_counter() - START < BUDGET_S


def random_gguf(qtype: int, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    "Random blocks of `qtype` for an [n, k] weight, [n, bytes per row] uint8, with small finite float16 scales."
    _, block, type_size = KEPT_GGUF_TYPES[qtype]
    raw = torch.randint(0, 256, (n, k // block, type_size), generator=gen, dtype=torch.uint8)
    for at in [208] if qtype == 14 else [0, 2]:  # d (and m / dmin); Q6_K keeps d last
        raw[..., at : at + 2] = (
            (torch.rand(n, k // block, 1, generator=gen) * 0.01).half().view(torch.uint8)
        )
    return raw.reshape(n, -1).to(DEVICE)


def gguf_reference(x, raw, qtype):
    "Chapter 01a's dequantizers when the gguf package is here; else None (the GEMV is then checked against split-K)."
    try:
        from forge_engine.quant.gguf_blocks import gguf_matmul_reference

        return gguf_matmul_reference(x.float(), raw, qtype)
    except ImportError:
        return None


def validation(gen) -> bool:
    ok = True
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    limit = 1e-2 if ON_GPU else 1e-5
    shapes = [(2560, 9728), (1001, 384)] if ON_GPU else [(40, 384), (13, 576)]  # ragged N, long K
    print("validation: int4 and GGUF kernels against the dequantize-then-matmul references")
    for (n, k), m in itertools.product(shapes, (1, 2, 3, 4)):
        w = (torch.randn(n, k, generator=gen) * 0.02).to(DEVICE)
        packed, scale, minimum = quantize_int4(w)
        x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
        want = int4_matmul_reference(x.float(), packed, scale, minimum)
        ok &= validate(
            f"int4 gemv N={n} K={k} M={m}", int4_gemv(x, packed, scale, minimum), want, limit
        )
        ok &= validate(
            f"int4 split-K N={n} K={k} M={m}",
            int4_matmul(x, packed, scale, minimum, impl="triton", kernel="split_k"),
            want,
            limit,
        )
    for (name, qtype), m in itertools.product(GGUF_TYPES.items(), (1, 4)):
        n, k = (2560, 4096) if ON_GPU else (24, 512)
        raw = random_gguf(qtype, n, k, gen)
        x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
        split_k = gguf_matmul(x, raw, qtype, impl="triton", kernel="split_k")
        want = gguf_reference(x, raw, qtype)
        if want is None:
            print("  (no gguf package: the GGUF GEMV is checked against the split-K kernel)")
            want = split_k.float()
        else:
            ok &= validate(f"{name} split-K N={n} K={k} M={m}", split_k, want, limit)
        ok &= validate(
            f"{name} gemv N={n} K={k} M={m}", gguf_matmul(x, raw, qtype, impl="triton"), want, limit
        )
    return ok


def timed(results, case, variant, fn, nbytes) -> float:
    try:
        ms, how = time_variant(fn, graph=True)
    except Exception as e:  # e.g. out of registers or shared memory for a large tile
        print(f"  skip {case} {variant}: {str(e).splitlines()[0][:100]}")
        return float("inf")
    results.add(case, f"{variant} [{how}]", ms, nbytes)
    return ms


def benchmark(gen, rows):
    results, best = Results("quant_gemv"), {}
    variants = lambda d: selected(d).items()
    for m, (label, (n, k)) in itertools.product(
        rows, SHAPES.items()
    ):  # M = 1 first: a cut-short run keeps it
        if not time_left():
            print(f"  budget of {BUDGET_S:.0f} s spent: no {label} M={m}")
            continue
        w = (torch.randn(n, k, generator=gen) * 0.02).to(DEVICE)
        wb, (packed, scale, minimum) = w.bfloat16(), quantize_int4(w)
        x = torch.randn(m, k, generator=gen).to(DEVICE, torch.bfloat16)
        case, int4_bytes = f"{label} M={m}", packed.numel() + 2 * (scale.numel() + minimum.numel())
        dense = {
            "v0 bf16 F.linear (cuBLAS)": lambda: F.linear(x, wb),
            "v1 bf16 gemv (chapter 09)": lambda: gemv(x, wb),
        }
        for name, fn in variants(dense):
            timed(results, case, name, fn, 2 * n * k)
        int4 = {
            "v2 int4 split-K": lambda: int4_matmul(x, packed, scale, minimum, kernel="split_k"),
            "v3 int4 gemv (export)": lambda: int4_gemv(x, packed, scale, minimum),
        }
        for name, fn in variants(int4):
            timed(results, case, name, fn, int4_bytes)
        for qname, qtype in GGUF_TYPES.items() if m in GGUF_ROWS else ():
            raw = random_gguf(qtype, n, k, gen)
            gguf = {
                f"g1 {qname} split-K": lambda: gguf_matmul(x, raw, qtype, kernel="split_k"),
                f"g2 {qname} gemv (export)": lambda: gguf_matmul(x, raw, qtype),
            }
            for name, fn in variants(gguf):
                timed(results, case, name, fn, raw.numel())
    sweeps = [
        ("v4 int4", INT4_SWEEP, (1, 4)),
        ("g3 Q4_K", GGUF_SWEEP, (1,)),
        ("g3 Q6_K", GGUF_SWEEP, (1,)),
    ]
    for prefix, configs, sweep_rows in sweeps:
        if not selected({prefix: None}):
            continue
        for (label, (n, k)), m in itertools.product(
            SHAPES.items(), [r for r in sweep_rows if r in rows]
        ):
            w = (torch.randn(n, k, generator=gen) * 0.02).to(DEVICE)
            x = torch.randn(m, k, generator=gen).to(DEVICE, torch.bfloat16)
            if prefix.startswith("v4"):
                packed, scale, minimum = quantize_int4(w)
                nbytes = packed.numel() + 2 * (scale.numel() + minimum.numel())
                run = lambda bn, chunk, nw: int4_gemv(
                    x, packed, scale, minimum, block_n=bn, chunk=chunk, num_warps=nw
                )
            else:
                qtype = GGUF_TYPES[prefix.split()[1]]
                raw = random_gguf(qtype, n, k, gen)
                nbytes = raw.numel()
                run = lambda bn, bk, nw: gguf_matmul(
                    x, raw, qtype, block_n=bn, block_k=bk, num_warps=nw
                )
            for bn, bk, nw in configs:
                if not time_left():
                    print(f"  budget of {BUDGET_S:.0f} s spent: {prefix} stops at {label} M={m}")
                    break
                name = f"bn={bn} {'chunk' if prefix.startswith('v4') else 'bk'}={bk} w={nw}"  # (int4: bk is the chunk)
                ms = timed(
                    results, f"{label} M={m}", f"{prefix} {name}", lambda: run(bn, bk, nw), nbytes
                )
                if ms < best.get((prefix, label, m), (float("inf"),))[0]:
                    best[prefix, label, m] = (ms, name, nbytes)
    results.print()
    print(
        "\n== best sweep configuration per shape (export: forge_engine.quant.gemv.quant_gemv_config, forge_engine.quant.gguf_blocks.gguf_gemv_config)"
    )
    for (prefix, label, m), (ms, config, nbytes) in best.items():
        print(
            f"{prefix:8s} {label:22s} M={m}  {config:22s} {ms * 1e3:8.1f} us  {nbytes / ms / 1e6:7.0f} GB/s"
        )


def main():
    gen = torch.Generator().manual_seed(0)
    ok = validation(gen)
    if ON_GPU:
        benchmark(gen, [int(r) for r in os.environ.get("QUANT_ROWS", "1,2,4").split(",")])
    print(f"\n{time.perf_counter() - START:.0f} s in all")
    finish(ok)


if __name__ == "__main__":
    main()
