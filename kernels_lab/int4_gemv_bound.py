"""What holds the int4 GEMV back: its memory or its SM?

Why: in the decode step's chains the int4 GEMVs read their bytes at ~1.4-2.6 TB/s (qkv 4.93, o 3.88,
gate-up 9.90, down 7.00 µs a matrix) against the H200's ~4.8 TB/s, while BF16's GEMVs reach ~3.6-3.9. Two readings
predict different fixes:
- bound by DRAM latency (too few bytes in flight: one step of weights a warp, a program's rows a handful of DRAM
  trips one after another): the same chain runs much faster when the weights come from L2, and what helps is more
  bytes on their way before they are needed (more early steps, shared memory), not fewer instructions;
- bound by the SM (instructions, registers, the arithmetic's latency): L2-resident weights barely help, and what
  helps is fewer instructions a weight (scales and minimums interleaved, fewer address computations).
This lab runs each Qwen3-4B shape's chain of 36 int4 GEMVs twice: 36 distinct matrices (the weights from DRAM, as in
the model) and one matrix 36 times (after the first, from the H200's 50 MB L2: every shape fits, the gate-up's 25 MB
too), in integers and in FP32, and prints µs a matrix and the bytes a second that amounts to.
Measured (one H200, integers, µs a matrix from DRAM / from L2): qkv 5.04 / 4.35, o 5.19 / 4.88, gate-up 9.16 / 7.43,
down 7.01 / 6.10: L2-resident weights gain 7-19%, so the SM holds the int4 GEMV, not DRAM latency, and chapter 10
cuts instructions a weight (`int4_int_bounds.py` says which).

Run on a GPU from kernels_lab/: PYTHONPATH=..:. python3 int4_gemv_bound.py"""

import torch

from common import DEVICE, ON_GPU, graphed_ms
from gemv_chain_sweep import LAYERS, SHAPES, product, weights


def matrix_bytes(w) -> int:
    "Bytes one GEMV reads of its int4 matrix: the packed nibbles, the group scales and minimums."
    return sum(t.numel() * t.element_size() for t in w)


def chain_us(x, layers, int_dot: bool) -> float:
    "µs a matrix of a CUDA-graph replay of the chain: one int4 GEMV for each matrix of `layers`, in turn."
    return (
        graphed_ms(lambda: [product("int4", x, w, int_dot=int_dot) for w in layers])
        * 1e3
        / len(layers)
    )


def main():
    if not ON_GPU:
        raise SystemExit("needs a GPU: the chains are CUDA graphs of the int4 GEMV")
    print(
        f"== chains of {LAYERS} int4 GEMVs a shape: distinct matrices (DRAM) against one matrix {LAYERS} times (L2)"
    )
    for label, (n, k) in SHAPES.items():
        distinct = [weights("int4", n, k) for _ in range(LAYERS)]
        same = [distinct[0]] * LAYERS
        x = torch.randn(1, k, device=DEVICE).bfloat16()
        size = matrix_bytes(distinct[0])
        for int_dot in (True, False):
            for _ in range(2):  # two rounds: the second one counts
                us = {"DRAM": chain_us(x, distinct, int_dot), "L2": chain_us(x, same, int_dot)}
            print(
                f"  {label:8s} {'integers' if int_dot else 'FP32':8s} "
                + "  ".join(
                    f"{where} {t:6.2f} µs ({size / t / 1e6:4.2f} TB/s)" for where, t in us.items()
                ),
                flush=True,
            )
        del distinct, same
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
