"""How far ahead chapter 10da's C kernel asks for its weights (`PREFETCH_BYTES`), on matrices too large for the CPU's
caches: Qwen3-14B's gate_up (34,816 x 5,120, what a split model's CPU layers stream, chapter 10h) and Qwen3-4B's
(19,456 x 2,560, a laptop's GGUF decode), each GGUF type the kernel takes, 1 and 4 rows. 0 asks for the block being
read, which is no prefetch at all. Each distance is a build of the same source; they run interleaved, 7 rounds, and
the median is printed in ms (GB/s of the weight bytes). Every build's outputs are checked equal to the first's.

Napkin math: a core streaming one row after another has a handful of cache misses in flight when nothing asks ahead;
at ~100 ns a miss that is a few GB/s, under what the integer dot products sustain on data in the cache.

Run anywhere from the repository root (a C compiler builds the kernel; `gguf` makes the blocks):
    PYTHONPATH=. python3 kernels_lab/cpu_gguf_prefetch.py"""

from common import c_build_with  # first: it may switch on the interpreter (these ops do not care)
import ctypes
import statistics
import time

import torch

from forge_engine.quant.cpu_gguf import GGUF_CPU_SOURCE, _run_gguf_kernel
from forge_engine.quant.gguf_blocks import KEPT_GGUF_TYPES, gguf_bytes

DISTANCES = (0, 1024, 2048, 4096, 8192)
MATRICES = {"14B gate_up": (34816, 5120), "4B gate_up": (19456, 2560)}
TYPES = (3, 8, 12, 14)  # Q4_1, Q8_0, Q4_K, Q6_K
ROUNDS = 7


def build(distance: int):
    "`gguf_matmul` built with PREFETCH_BYTES = distance."
    p, i = ctypes.c_void_p, ctypes.c_int
    return c_build_with(
        f"gguf_matmul_prefetch_{distance}", GGUF_CPU_SOURCE, "enum { PREFETCH_BYTES = 4096 };",
        f"enum {{ PREFETCH_BYTES = {distance} }};", "gguf_matmul", p, i, i, p, i, i, p, i,
    )  # fmt: skip


def main():
    print(f"{torch.get_num_threads()} threads; ms a product (GB/s); PREFETCH_BYTES: {DISTANCES}")
    kernels = {d: build(d) for d in DISTANCES}
    torch.manual_seed(0)
    for label, (n, k) in MATRICES.items():
        for qtype in TYPES:
            raw = gguf_bytes(qtype, n, k)
            for rows in (1, 4):
                x = torch.randn(rows, k)
                want = _run_gguf_kernel(kernels[0], x, raw, qtype)
                times = {d: [] for d in DISTANCES}
                for _ in range(ROUNDS):
                    for d, kernel in kernels.items():
                        start = time.perf_counter()
                        got = _run_gguf_kernel(kernel, x, raw, qtype)
                        times[d].append(time.perf_counter() - start)
                        assert torch.equal(got, want), (label, qtype, rows, d)
                cells = "  ".join(
                    f"{d:5d}: {statistics.median(t) * 1e3:6.2f} ({raw.numel() / statistics.median(t) / 1e9:4.1f})"
                    for d, t in times.items()
                )
                print(
                    f"{label:12s} {KEPT_GGUF_TYPES[qtype][0]:5s} {rows} rows  {cells}", flush=True
                )


if __name__ == "__main__":
    main()
