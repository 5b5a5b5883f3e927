"""The Q8_0 LM head of a GGUF file on a CPU (SmolLM2-135M's: 49,152 x 576, a scale d per block of 32 weights), at 1
and 8 rows: chapter 10e's `_q8_0_blocks_mm` against the loop it replaced and two shapes of the same work.

  blocks_sum   PyTorch's int8 GEMM once per block of 32 inputs (scale 1), each block's [M, N] sums times its d
               and added to the output: six operations a block
  addcmul      the same GEMMs, each added with its d by one `addcmul_`, from one transposed copy of x
               (chapter 10e's `_q8_0_blocks_mm`)
  per_channel  one int8 GEMM over all 576 inputs with one scale per row: the bytes and arithmetic of the head
               without its per-block scales; not the file's numbers, for scale only
  compiled     torch.compile (inductor's C++) of the blocks' dot products times d, summed: one generated loop
               (first call compiles; skipped where inductor has no C++ compiler)
Napkin math: the int8 weights are 28 MB, a 2-core machine reads ~30 GB/s: ~1 ms of bytes at one row.
Run anywhere from the repository root: PYTHONPATH=. python3 kernels_lab/cpu_gguf_head.py"""

from common import best_host_s  # first: it may switch on the interpreter (these ops do not care)
import torch

from forge_engine.quant.layers import _q8_0_blocks_mm

N, K = 49_152, 576
G = K // 32
torch.manual_seed(0)
q = torch.randint(-127, 128, (G, N, 32), dtype=torch.int8)  # chapter 10e's operands: [K/32, N, 32]
d = torch.rand(G, N) / 100  # [K/32, N]
ones = torch.ones(N, dtype=torch.bfloat16)
q_rows = q.permute(1, 0, 2).reshape(N, K).contiguous()


def blocks_sum(x):
    xb = x.to(torch.bfloat16)
    out = torch.zeros(x.shape[0], N)
    for b in range(G):
        out += (
            torch._weight_int8pack_mm(xb[:, 32 * b : 32 * b + 32].contiguous(), q[b], ones).float()
            * d[b]
        )
    return out


def per_channel(x):
    return torch._weight_int8pack_mm(x.to(torch.bfloat16), q_rows, ones).float()


def head_loop(x, q_rows, d_rows):
    blocks = x.reshape(x.shape[0], 1, G, 32)
    return ((q_rows.reshape(N, G, 32).float() * blocks).sum(-1) * d_rows).sum(-1)


compiled = torch.compile(head_loop, dynamic=False)
d_rows = d.t().contiguous()
for m in (1, 8):
    x = torch.randn(m, K)
    ref = blocks_sum(x)
    print(f"{m} row{'s' if m > 1 else ''}:")
    variants = {
        "blocks_sum": lambda: blocks_sum(x),
        "addcmul": lambda: _q8_0_blocks_mm(x, (q, d, ones)),
        "per_channel": lambda: per_channel(x),
        "compiled": lambda: compiled(x, q_rows, d_rows),
    }
    for name, fn in variants.items():
        try:
            seconds = best_host_s(fn, reps=10, rounds=3)
        except Exception as e:  # (no C++ compiler for inductor)
            print(f"  {name:12s} skipped: {type(e).__name__}")
            continue
        err = (
            ""
            if name == "per_channel"
            else f"  max |diff| to blocks_sum {(fn() - ref).abs().max():.1e}"
        )
        print(f"  {name:12s} {seconds * 1e3:6.2f} ms{err}")
