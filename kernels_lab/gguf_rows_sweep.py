"""A GGUF file's repacked layers (chapter 10g) at 16 rows, the decode step of 16 sequences, and at 512 (prefill):
chapter 10b's split-K launch with a tile dequantized in registers and `tl.dot`, over a sweep of its tiles (BLOCK_N,
warps, pipeline stages), against the one-row GEMV of the same matrix (the time to read it once: what 16 rows should
cost when they are bandwidth-bound), and the dense path (one Triton launch makes the weights, then one matmul).
Qwen3-4B's matrices as Q8_0 and Q6_K (int8 planes, groups of 32 and 16) and Q4_K (int4, groups of 32).

Napkin math: at 16 rows a weight is used 16 times, 32 FLOP a byte for int8: far under the H200's ~190 FLOP a byte of
tensor-core BF16, so 16 rows are bound by reading the weights, as one row is. 512 rows: 1,024 FLOP a byte, bound by
the matmul.

Run on the GPU machine from the repository root: PYTHONPATH=. python3 kernels_lab/gguf_rows_sweep.py"""

from common import (
    DEVICE,
    ON_GPU,
    finish,
    time_variant,
    validate,
)  # first: may switch on the interpreter
import torch

from forge_engine.quant.gemv import int4_dense, int4_matmul, int4_matmul_reference
from forge_engine.quant.gguf_blocks import gguf_bytes, gguf_matmul_reference
from forge_engine.quant.gguf_gpu import (
    int8_group_dense,
    int8_group_matmul,
    int8_group_matmul_reference,
    q4_k_as_int4,
    q6_k_as_int8,
    q8_0_as_int8,
)
from forge_engine.quant.layers import pair_scales

SHAPES = {
    "qkv": (6144, 2560),
    "o": (2560, 4096),
    "gate_up": (19456, 2560),
    "down": (2560, 9728),
}
TYPES = {"Q4_K": 12, "Q6_K": 14, "Q8_0": 8}
SWEEP = [(bn, w, st) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]

ok = True
torch.manual_seed(0)
for type_name, qtype in TYPES.items():
    for name, (n, k) in SHAPES.items():
        if not ON_GPU:
            n, k = 64, 512
        raw = gguf_bytes(qtype, n, k).to(DEVICE)
        if qtype == 12:
            packed, s, m = q4_k_as_int4(raw)
            paired = pair_scales(s, m)
            s, m = paired[..., 0], paired[..., 1]

            def run(x, **launch):
                return int4_matmul(
                    x,
                    packed,
                    s,
                    m,
                    impl="triton",
                    kernel="split_k" if x.shape[0] > 1 else None,
                    **launch,
                )

            def dense(x):
                return int4_dense(x, packed, s, m)

            def reference(x):
                return int4_matmul_reference(x, packed, s, m)

            nbytes = packed.numel() + 4 * s.numel()
        else:
            q, scale = (q8_0_as_int8 if qtype == 8 else q6_k_as_int8)(raw)

            def run(x, **launch):
                if not launch or x.shape[0] <= 4:
                    return int8_group_matmul(x, q, scale, impl="triton")
                from forge_engine.quant.gguf_gpu import _int8_group_matmul_kernel
                from forge_engine.quant.split_k import _skinny_matmul

                return _skinny_matmul(
                    _int8_group_matmul_kernel,
                    x,
                    (q, scale),
                    n,
                    256,
                    BLOCK_K=256,
                    GROUP=k // scale.shape[1],
                    **launch,
                )

            def dense(x):
                return int8_group_dense(x, q, scale)

            def reference(x):
                return int8_group_matmul_reference(x, q, scale)

            nbytes = q.numel() + 2 * scale.numel()
        label = f"{type_name} {name}"
        x1 = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
        x16 = torch.randn(16, k, device=DEVICE, dtype=torch.bfloat16)
        x512 = torch.randn(512, k, device=DEVICE, dtype=torch.bfloat16)
        want16 = gguf_matmul_reference(x16.float(), raw, qtype)
        ok &= validate(f"{label} 16 rows", run(x16).float(), want16, 2e-2)
        ok &= validate(
            f"{label} 512 rows dense", dense(x512).float(), reference(x512).float(), 1e-2
        )
        if not ON_GPU:
            break
        one, _ = time_variant(lambda: run(x1), graph=True)
        now, _ = time_variant(lambda: run(x16), graph=True)
        print(
            f"  {label:13s}  1 row GEMV {one * 1e3:6.1f} us ({nbytes / one / 1e9:4.2f} TB/s); 16 rows as built {now * 1e3:6.1f} us"
        )
        results = []
        for block_n, warps, stages in SWEEP:
            try:
                ms, _ = time_variant(
                    lambda: run(x16, block_n=block_n, num_warps=warps, num_stages=stages),
                    graph=True,
                )
            except Exception as e:  # a tile the compiler refuses: say so, go on
                print(f"  {label:13s} {(block_n, warps, stages)}: {type(e).__name__} {str(e)[:80]}")
                continue
            results.append((ms, (block_n, warps, stages)))
        results.sort()
        for ms, config in results[:3]:
            print(
                f"  {label:13s} 16 rows (BLOCK_N, warps, stages) {config}: {ms * 1e3:6.1f} us ({nbytes / ms / 1e9:4.2f} TB/s)"
            )
        d, _ = time_variant(lambda: dense(x512), graph=True)
        r, _ = time_variant(lambda: reference(x512), graph=True)
        print(
            f"  {label:13s} 512 rows dense {d * 1e3:7.1f} us; PyTorch dequantize + matmul {r * 1e3:7.1f} us"
        )
finish(ok)
