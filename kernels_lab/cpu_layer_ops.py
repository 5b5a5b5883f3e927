"""A decoder layer's small steps on a CPU in bf16, one decode token (what the CPU's layers of a model split with a
GPU run besides their products, chapter 10h): chapter 03's PyTorch against chapter 09_kernels_cpu's C calls, at
Qwen3-14B's shapes (hidden 5120, 40 query heads and 8 KV heads of 128, intermediate 17408).

Napkin math: the steps read and write a few rows of 5-35 thousand numbers and a context of K/V (8 heads x 128 x
2 bytes x 2 a key: 4 KB a position, 1.6 MB at 400): tens of microseconds at the CPU's bandwidth. In PyTorch each
is several small operations of a few microseconds of dispatch each, and its attention gathers the context through
the block table before two matmuls.

Per step (µs a layer): add + RMSNorm (twice a layer), RoPE on q and k, SiLU-mul, decode attention (a paged pool of
blocks of 16, the context at 160 and 1000 keys), and their sum a layer.
Run anywhere from the repository root: PYTHONPATH=. python3 kernels_lab/cpu_layer_ops.py"""

from common import best_host_s  # first: it may switch on the interpreter (unused here)
import torch
import torch.nn.functional as F

from forge_engine.kernels.cpu import cpu_add_rms_norm, cpu_decode_attention, cpu_rope, cpu_silu_mul
from forge_engine.kv_cache import single_query_attention
from forge_engine.model import RMSNorm, apply_rope, rope_cos_sin

HIDDEN, HEADS, KV_HEADS, DIM, INTERMEDIATE, BLOCK = 5120, 40, 8, 128, 17408, 16


def best_us(fn) -> float:
    return best_host_s(fn) * 1e6


def main():
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    print(f"{torch.get_num_threads()} threads, bf16, one decode token; µs a layer: PyTorch, C")
    norm = RMSNorm(HIDDEN, 1e-6).to(bf16)
    x, residual = torch.randn(2, 1, HIDDEN, dtype=bf16)
    gate_up = torch.randn(1, 2 * INTERMEDIATE, dtype=bf16)
    qkv = torch.randn(1, (HEADS + 2 * KV_HEADS) * DIM, dtype=bf16)
    q = qkv[:, : HEADS * DIM].view(1, HEADS, DIM)
    cos, sin = rope_cos_sin(torch.tensor([300]), DIM, 1e6)

    def silu_mul():
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    steps = {
        "add + RMSNorm (x2)": (
            lambda: norm.add_and_norm(x, residual),
            lambda: cpu_add_rms_norm(x, residual, norm.weight.data, norm.eps),
            2,
        ),
        "RoPE, q and k": (
            lambda: apply_rope(q, cos, sin),
            lambda: cpu_rope(q, cos, sin),
            1 + KV_HEADS / HEADS,  # k's heads, in proportion
        ),
        "SiLU-mul": (silu_mul, lambda: cpu_silu_mul(gate_up), 1),
    }
    for ctx in (160, 1000):
        blocks = -(-ctx // BLOCK)
        k_pool, v_pool = (torch.randn(blocks, BLOCK, KV_HEADS, DIM, dtype=bf16) for _ in range(2))
        table = torch.randperm(blocks)[None, :]
        lens = torch.tensor([ctx])
        qc = q.contiguous()

        def gathered(k_pool=k_pool, v_pool=v_pool, table=table, ctx=ctx, qc=qc):
            # chapter 05's path for one decoding sequence: gather, then two matmuls
            rows = table[0].long()
            return single_query_attention(
                qc, k_pool[rows].flatten(0, 1)[:ctx], v_pool[rows].flatten(0, 1)[:ctx]
            )

        torch.testing.assert_close(
            cpu_decode_attention(qc, k_pool, v_pool, table, lens), gathered()
        )
        steps[f"attention, {ctx} keys"] = (
            gathered,
            lambda k_pool=k_pool, v_pool=v_pool, table=table, lens=lens, qc=qc: (
                cpu_decode_attention(qc, k_pool, v_pool, table, lens)
            ),
            1,
        )
    totals = {}
    for name, (torch_step, c_step, times) in steps.items():
        assert c_step() is not None, f"{name}: the C kernel does not run here"
        torch_us, c_us = best_us(torch_step) * times, best_us(c_step) * times
        print(f"  {name:22s} {torch_us:8.1f} {c_us:8.1f}  ({torch_us / c_us:.1f}x)")
        for ctx in (160, 1000):
            if not name.startswith("attention") or name.endswith(f" {ctx} keys"):
                before, after = totals.get(ctx, (0.0, 0.0))
                totals[ctx] = (before + torch_us, after + c_us)
    for ctx, (torch_us, c_us) in totals.items():
        print(
            f"  a layer at {ctx:4d} keys     {torch_us:8.1f} {c_us:8.1f}  ({torch_us / c_us:.1f}x)"
        )


if __name__ == "__main__":
    main()
