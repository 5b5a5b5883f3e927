"""Chapter 09_kernels_cpu's decode attention against builds of its source with one choice undone: its rows asked for
`ROWS_AHEAD` positions ahead (0 asks for the row being read, which is no prefetch at all; 8 twice as far), and the
head size as a constant of the common sizes (`attend_head`) or read at run time. One sequence of Qwen3-4B's heads
(32 query heads, 8 KV heads of 128) over 1,024 and 4,096 positions in a pool of 16-position blocks scattered at
random, bf16 and float32. The builds run interleaved, 9 rounds, and the median is printed in µs; every build's output
is checked equal to the export's, or (head size at run time) within 1e-6 of it: the same sums, unrolled.

Napkin math: at 4,096 positions a layer's keys and values are 16.8 MB in bf16, read once a step; a head's rows lie
Hkv * D apart inside a block and the blocks anywhere, a pattern a core's own prefetchers do not follow. A position
costs each KV head its row conversions, the group's 4 dot products of 128 and 4 multiply-adds of a value row into
the outputs: a few hundred instructions, so once the rows arrive in time the loops' overhead is what is left.
(Value rows four at a time, each output loaded and stored once for them, ran bf16 12-16% faster and float32 10-13%
slower at 4,096 positions: not kept.)

Run anywhere from the repository root (a C compiler builds the kernel):
    PYTHONPATH=. python3 kernels_lab/cpu_attention_builds.py"""

from common import c_build_with  # first: it may switch on the interpreter (these ops do not care)
import ctypes
import statistics
import time

import torch

from forge_engine.kernels.cpu import ATTENTION_CPU_SOURCE

HQ, HKV, D, BLOCK = 32, 8, 128, 16
ROUNDS = 9
AHEAD_LINE = "enum { ROWS_AHEAD = 4 };"
HEAD_CALL = "BY_DTYPE(bf16, attend_head,"
BUILDS = {  # name: (the source's line, what it becomes)
    "export": (AHEAD_LINE, AHEAD_LINE),
    "ROWS_AHEAD 0": (AHEAD_LINE, "enum { ROWS_AHEAD = 0 };"),
    "ROWS_AHEAD 8": (AHEAD_LINE, "enum { ROWS_AHEAD = 8 };"),
    "head size at run time": (HEAD_CALL, "BY_DTYPE(bf16, attend,"),
}


def build(name: str):
    "`decode_attention` built with BUILDS[name]'s change."
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    line, value = BUILDS[name]
    return c_build_with(
        "decode_attention_" + name.replace(" ", "_"), ATTENTION_CPU_SOURCE, line, value, "decode_attention",
        p, i, i, i, i, p, p, i, i, p, i, p, f, p, i, i,
    )  # fmt: skip


def main():
    print(f"{torch.get_num_threads()} threads; µs an attention")
    kernels = {name: build(name) for name in BUILDS}
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for length in (1024, 4096):
            blocks = length // BLOCK
            k = torch.randn(2 * blocks, BLOCK, HKV, D, dtype=dtype)
            v = torch.randn_like(k)
            tables = torch.randperm(2 * blocks)[None, :blocks].to(torch.int64).contiguous()
            lens, q = torch.tensor([length], dtype=torch.int64), torch.randn(1, HQ, D, dtype=dtype)
            times, export = {name: [] for name in BUILDS}, None
            for _ in range(ROUNDS):
                for name, kernel in kernels.items():
                    out = torch.empty_like(q)
                    start = time.perf_counter()
                    code = kernel(
                        q.data_ptr(), 1, HQ, HKV, D, k.data_ptr(), v.data_ptr(), 2 * blocks, BLOCK,
                        tables.data_ptr(), blocks, lens.data_ptr(), D**-0.5, out.data_ptr(),
                        torch.get_num_threads(), dtype == torch.bfloat16,
                    )  # fmt: skip
                    times[name].append(time.perf_counter() - start)
                    export = out if export is None else export
                    assert code == 0, (dtype, length, name)
                    if name.startswith("ROWS_AHEAD"):
                        assert torch.equal(out, export), (dtype, length, name)
                    else:
                        torch.testing.assert_close(
                            out.float(), export.float(), rtol=1e-6, atol=1e-6
                        )
            cells = "  ".join(f"{n}: {statistics.median(t) * 1e6:6.0f}" for n, t in times.items())
            print(f"{str(dtype):15s} {length:5d} positions  {cells}", flush=True)


if __name__ == "__main__":
    main()
