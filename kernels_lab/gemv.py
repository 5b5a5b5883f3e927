"""Matrix-vector products for decode at batch 1-4: y = x @ W.T with x [M <= 4, K], W [N, K] bf16.

Napkin math (Qwen3-4B, bf16): every output needs its whole weight row, so a GEMV reads N x K x 2
bytes and does 2 FLOPs per weight and input row: 1 FLOP/byte at M = 1, far below the ~190 where
an H200 turns compute-bound. Time = bytes / bandwidth. Per layer: qkv 6144 x 2560 (31.5 MB),
o 2560 x 4096 (21.0 MB), gate_up 19456 x 2560 (99.6 MB), down 2560 x 9728 (49.8 MB);
the LM head 151936 x 2560 (778 MB). All 36 layers + LM head = 8.04 GB: 1.92 ms at 4.19 TB/s,
which is the batch-1 decode ceiling of 521 tok/s. cuBLAS reaches 2.95 ms over the same chain.

Variants
  v0  cuBLAS through F.linear (the baseline)
  v1  forge_engine.kernels.gemv, the exported defaults
  v2  the same kernel over a sweep of (BLOCK_N, BLOCK_K, num_warps, num_stages): the best per shape is
      printed at the end, and the exported defaults come from it
  v3  the same kernel on int8 weights with one scale per row (chapter 10's int8): half the bytes
  v4  v3 over the sweep (BLOCK_K counted in elements: 1-byte weights)
GEMV_WEIGHTS=bf16,int8 picks the weight formats (default both); the sweep runs for M = 1.
"""

import itertools
import os

from common import (
    DEVICE,
    ON_GPU,
    Results,
    finish,
    time_variant,
    validate,
)  # first: it may switch on the interpreter
import torch
import torch.nn.functional as F
from forge_engine.kernels.gemv import gemv

SHAPES = {
    "qkv 6144x2560": (6144, 2560),
    "o 2560x4096": (2560, 4096),
    "gate_up 19456x2560": (19456, 2560),
    "down 2560x9728": (2560, 9728),
    "lm_head 151936x2560": (151936, 2560),
}
SWEEP = list(
    itertools.product((1, 2, 4, 8), (256, 512, 1024), (2, 4, 8), (None, 4))
)  # None: Triton's default, 3


def main():
    ok = True
    print("validation against F.linear (fp32 reference of bf16 inputs)")
    cases = (
        [(1, 6144, 2560), (2, 2560, 9728), (4, 19456, 2560), (3, 1000, 300)]
        if ON_GPU
        else [(1, 16, 64), (3, 9, 100)]
    )
    for m, n, k in cases:
        x = torch.randn(m, k, device=DEVICE).bfloat16()
        w = (torch.randn(n, k, device=DEVICE) / k**0.5).bfloat16()
        want = F.linear(x.float(), w.float())
        ok &= validate(
            f"gemv M={m} N={n} K={k}",
            gemv(x, w, impl="triton", block_k=64 if not ON_GPU else 512),
            want,
            1e-2,
        )
    if not ON_GPU:
        finish(ok)
    results = Results("gemv")
    best: dict[tuple[str, int], tuple[float, str]] = {}
    rows = [int(r) for r in os.environ.get("GEMV_ROWS", "1,2,4").split(",")]
    formats = os.environ.get("GEMV_WEIGHTS", "bf16,int8").split(",")
    for (label, (n, k)), m, fmt in itertools.product(SHAPES.items(), rows, formats):
        x = torch.randn(m, k, device=DEVICE).bfloat16()
        if fmt == "int8":
            w = torch.randint(-127, 128, (n, k), device=DEVICE, dtype=torch.int8)
            scale = torch.rand(n, device=DEVICE) / 127
            nbytes, case, first, swept = n * k, f"{label} M={m} int8", "v3", "v4"
        else:
            w, scale = (torch.randn(n, k, device=DEVICE) / k**0.5).bfloat16(), None
            nbytes, case, first, swept = n * k * 2, f"{label} M={m}", "v1", "v2"
            ms, how = time_variant(lambda: F.linear(x, w), graph=True)
            results.add(case, f"v0 cuBLAS [{how}]", ms, nbytes)
        ms, how = time_variant(lambda: gemv(x, w, None, scale), graph=True)
        results.add(case, f"{first} exported [{how}]", ms, nbytes)
        sweep = SWEEP if m == 1 or os.environ.get("GEMV_SWEEP_ALL") else []
        if fmt == "int8":
            sweep = [
                c for c in sweep if c[3] is None
            ]  # half the sweep: stages made no difference for bf16
        for bn, bk, warps, stages in sweep:
            name = f"{swept} bn={bn} bk={bk} w={warps} s={stages}"
            try:
                ms, _ = time_variant(
                    lambda: gemv(
                        x,
                        w,
                        None,
                        scale,
                        block_n=bn,
                        block_k=bk * 2 // w.element_size(),
                        num_warps=warps,
                        num_stages=stages,
                    ),
                    graph=True,
                )
            except Exception as e:  # e.g. out of registers / shared memory for a big tile
                print(f"  skip {name}: {str(e).splitlines()[0][:80]}")
                continue
            if ms < best.get((case, nbytes), (float("inf"), ""))[0]:
                best[case, nbytes] = (ms, name)
    results.print()
    print(
        "\n== best sweep config per shape (bk in bf16-element units: bytes / 2), vs the exported default"
    )
    exported = {r["case"]: r["us"] for r in results.rows if r["variant"][:2] in ("v1", "v3")}
    for (case, nbytes), (ms, name) in best.items():
        print(
            f"{case:30s} {name:32s} {ms * 1e3:8.1f} us  {nbytes / ms / 1e6:7.0f} GB/s  exported {exported[case]:8.1f} us"
        )
    finish(ok)


if __name__ == "__main__":
    main()
