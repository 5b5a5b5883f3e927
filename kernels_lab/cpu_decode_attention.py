"""Decode attention on a CPU (chapter 05's PyTorch path): one query per sequence that sees every key.

Napkin math: SmolLM2-135M (9 query heads, 3 KV heads, D 64) over 400 keys reads 2 x 400 x 3 x 64 x 4 = 614 KB of
FP32 K/V and does ~0.9 MFLOP: microseconds of memory and arithmetic on any laptop. What is left is overhead.

Variants, per (heads, context, batch):
  sdpa     chapter 03's `causal_attention` on the gathered K/V (F.scaled_dot_product_attention, no mask)
  matmul   chapter 05's `single_query_attention` (each KV head's query group as the rows of two small matmuls)
  batched  chapter 05's `paged_decode_attention_torch`: every sequence padded to the longest, one masked SDPA
  loop     `single_query_attention` sequence by sequence (what PagedAttention does on a CPU), gathers included
Run anywhere from the repository root: PYTHONPATH=. python3 kernels_lab/cpu_decode_attention.py"""

from common import best_host_s  # first: it may switch on the interpreter (unused here)
import torch

from forge_engine.kv_cache import paged_decode_attention_torch, single_query_attention
from forge_engine.model import causal_attention


def best_us(fn) -> float:
    return best_host_s(fn) * 1e6


def main():
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} threads, fp32; µs per layer")
    block = 16
    for name, (q_heads, kv_heads, dim) in {
        "SmolLM2-135M": (9, 3, 64),
        "Qwen3-4B": (32, 8, 128),
    }.items():
        for ctx in (160, 400, 1000):
            q = torch.randn(1, q_heads, dim)
            k, v = torch.randn(ctx, kv_heads, dim), torch.randn(ctx, kv_heads, dim)
            torch.testing.assert_close(
                single_query_attention(q, k, v),
                causal_attention(q, k, v, q_offset=ctx - 1),
                rtol=1e-4,
                atol=1e-5,
            )
            sdpa = best_us(lambda: causal_attention(q, k, v, q_offset=ctx - 1))
            matmul = best_us(lambda: single_query_attention(q, k, v))
            print(
                f"  {name:13s} 1 sequence, {ctx:5d} keys: sdpa {sdpa:8.1f}  matmul {matmul:7.1f}  ({sdpa / matmul:.1f}x)"
            )
        for batch, ctx in ((8, 160), (8, 400)):
            blocks = -(-ctx // block)
            k_pool, v_pool = (torch.randn(batch * blocks, block, kv_heads, dim) for _ in range(2))
            tables = torch.arange(batch * blocks).view(batch, blocks).int()
            lens = torch.full((batch,), ctx, dtype=torch.int32)
            q = torch.randn(batch, q_heads, dim)

            def loop():
                out = torch.empty_like(q)
                for b in range(batch):
                    rows = tables[b].long()
                    out[b : b + 1] = single_query_attention(
                        q[b : b + 1],
                        k_pool[rows].flatten(0, 1)[:ctx],
                        v_pool[rows].flatten(0, 1)[:ctx],
                    )
                return out

            torch.testing.assert_close(
                loop(),
                paged_decode_attention_torch(q, k_pool, v_pool, tables, lens),
                rtol=1e-4,
                atol=1e-5,
            )
            batched = best_us(lambda: paged_decode_attention_torch(q, k_pool, v_pool, tables, lens))
            looped = best_us(loop)
            print(
                f"  {name:13s} {batch} sequences, {ctx:4d} keys: batched {batched:8.1f}  loop {looped:7.1f}  "
                f"({batched / looped:.1f}x)"
            )


if __name__ == "__main__":
    main()
