"""PyTorch's CPU weight-only GEMMs on SmolLM2-135M's 30 layers of matrices, timed alone: what chapter 10's CPU paths
call (fp32 `F.linear`, int8 `_weight_int8pack_mm`, int4 `_weight_int4pack_mm_for_cpu` on its tiled nibbles).

Napkin math: SmolLM2's layer matrices are 106M weights: fp32 reads 425 MB a token, int8 106 MB, int4 53 MB (plus
scales); a 2-core machine reads ~32 GB/s, so at batch 1 the bytes say ~13 / 3.3 / 1.7 ms, and the rest is arithmetic
and the ops' own overhead.

Run anywhere (CPU): PYTHONPATH=. python3 kernels_lab/cpu_quant_ops.py"""

from common import best_host_s  # first: it may switch on the interpreter (these ops do not care)
import torch

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate-up, down (N, K)
LAYERS, GROUP = 30, 64


def best_ms(fn) -> float:
    return best_host_s(fn, reps=20, rounds=3) * 1e3


def main():
    torch.manual_seed(0)
    fp32 = [[torch.randn(n, k) for n, k in SHAPES] for _ in range(LAYERS)]
    int8 = [
        [
            (torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n).bfloat16())
            for n, k in SHAPES
        ]
        for _ in range(LAYERS)
    ]
    int4 = [
        [
            (
                torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                    torch.randint(0, 16, (n, k), dtype=torch.int32), 1
                ),
                torch.rand(k // GROUP, n, 2).bfloat16(),
                k,
            )
            for n, k in SHAPES
        ]
        for _ in range(LAYERS)
    ]
    print(
        f"SmolLM2-135M's {LAYERS} layers of matrices, {torch.get_num_threads()} threads, best of 3 rounds"
    )
    for rows in (1, 8):
        x = {k: torch.randn(rows, k) for _, k in SHAPES}
        xb = {k: v.bfloat16() for k, v in x.items()}
        t32 = best_ms(
            lambda: [torch.nn.functional.linear(x[w.shape[1]], w) for ws in fp32 for w in ws]
        )
        t8 = best_ms(
            lambda: [torch._weight_int8pack_mm(xb[q.shape[1]], q, s) for ws in int8 for q, s in ws]
        )
        t4 = best_ms(
            lambda: [
                torch.ops.aten._weight_int4pack_mm_for_cpu(xb[k], p, GROUP, sz)
                for ws in int4
                for p, sz, k in ws
            ]
        )
        print(
            f"  {rows} row{'s' if rows > 1 else ''}: fp32 {t32:.1f} ms, int8 {t8:.1f} ms, int4 {t4:.1f} ms"
        )


if __name__ == "__main__":
    main()
