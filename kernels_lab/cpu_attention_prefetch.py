"""How far ahead chapter 09_kernels_cpu's decode attention asks for its key and value rows (`ROWS_AHEAD`): one
sequence of Qwen3-4B's heads (32 query heads, 8 KV heads of 128) over 1,024 and 4,096 positions in a pool of
16-position blocks scattered at random, bf16 and float32. 0 asks for the row being read, which is no prefetch at all.
Each setting is a build of the same source; they run interleaved, 9 rounds, and the median is printed in µs. Every
build's output is checked equal to the first's.

Napkin math: at 4,096 positions a layer's keys and values are 16.8 MB in bf16, read once a step; a head's rows lie
Hkv * D apart inside a block and the blocks anywhere, a pattern a core's own prefetchers do not follow.

Run anywhere from the repository root (a C compiler builds the kernel):
    PYTHONPATH=. python3 kernels_lab/cpu_attention_prefetch.py"""

from common import c_build_with  # first: it may switch on the interpreter (these ops do not care)
import ctypes
import statistics
import time

import torch

from forge_engine.kernels.cpu import ATTENTION_CPU_SOURCE

AHEAD = (0, 2, 4, 8)
HQ, HKV, D, BLOCK = 32, 8, 128, 16
ROUNDS = 9


def build(ahead: int):
    "`decode_attention` built with ROWS_AHEAD = ahead."
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    return c_build_with(
        f"decode_attention_ahead_{ahead}", ATTENTION_CPU_SOURCE, "enum { ROWS_AHEAD = 4 };",
        f"enum {{ ROWS_AHEAD = {ahead} }};", "decode_attention", p, i, i, i, i, p, p, i, i, p, i, p, f, p, i, i,
    )  # fmt: skip


def main():
    print(f"{torch.get_num_threads()} threads; µs an attention; ROWS_AHEAD: {AHEAD}")
    kernels = {a: build(a) for a in AHEAD}
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for length in (1024, 4096):
            blocks = length // BLOCK
            k = torch.randn(2 * blocks, BLOCK, HKV, D, dtype=dtype)
            v = torch.randn_like(k)
            tables = torch.randperm(2 * blocks)[None, :blocks].to(torch.int64).contiguous()
            lens, q = torch.tensor([length], dtype=torch.int64), torch.randn(1, HQ, D, dtype=dtype)
            times, first = {a: [] for a in AHEAD}, None
            for _ in range(ROUNDS):
                for ahead, kernel in kernels.items():
                    out = torch.empty_like(q)
                    start = time.perf_counter()
                    code = kernel(
                        q.data_ptr(), 1, HQ, HKV, D, k.data_ptr(), v.data_ptr(), 2 * blocks, BLOCK,
                        tables.data_ptr(), blocks, lens.data_ptr(), D**-0.5, out.data_ptr(),
                        torch.get_num_threads(), dtype == torch.bfloat16,
                    )  # fmt: skip
                    times[ahead].append(time.perf_counter() - start)
                    first = out if first is None else first
                    assert code == 0 and torch.equal(out, first), (dtype, length, ahead)
            cells = "  ".join(f"{a}: {statistics.median(t) * 1e6:6.0f}" for a, t in times.items())
            print(f"{str(dtype):15s} {length:5d} positions  {cells}", flush=True)


if __name__ == "__main__":
    main()
