"""Paged GQA decode attention: one query token per sequence, K/V read through block tables.

Napkin math (Qwen3-4B: 32 query heads, 8 KV heads, head_dim 128, bf16, block 16): a token's
K and V take 8 x 128 x 2 x 2 = 4 KiB per layer, so a step reads 4 KiB x sum(context) per
layer; the queries and outputs are noise. 64 sequences of 1,024 tokens: 268 MB, 64 us at
4.19 TB/s. One sequence of 512 tokens: 2 MB, 0.5 us: a launch costs more, so at batch 1
attention is latency, not bandwidth (and CUDA graphs matter more than the kernel).
Arithmetic: 4 FLOPs per (query head, key, dim) = 16 per byte of K/V read at GQA 4: far
below the ~190 FLOP/byte where an H200 turns compute-bound, so every variant is judged by
bytes / time against the 4.19 TB/s read ceiling.

Variants
  v0  PyTorch, the engine's batched path today: gather every table into a padded copy, masked SDPA
  v1  Triton, one program per (sequence, query head), dot products by multiply-and-sum:
      each KV head is read once per query head of its group (4x the bytes at GQA 4)
  v2  Triton, one program per (sequence, KV head) with the group's queries as rows of a tensor-core
      tile: each KV head read once; no split (forge_engine.kernels with split_tokens = inf)
  v3  v2 + flash-decoding splits of the context and a merge kernel (forge_engine.kernels: the export)
  v4  the exported prefill kernel on the same batch (query length 1): the cost of sending decodes
      through the prefill kernel in a mixed step
"""
import math

from common import DEVICE, ON_GPU, Results, finish, selected, time_variant, validate  # first: it may switch on the interpreter
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from forge_engine.kernels import (paged_attention_reference, paged_decode_attention,
                                  paged_prefill_attention, random_paged_kv)


def v0_torch_padded(q, k_cache, v_cache, tables, ctx, scale):
    blocks = tables.long().clamp(min=0)  # padding reads block 0, masked below
    k = k_cache[blocks].flatten(1, 2).transpose(1, 2)  # [B, Hkv, L, D]
    v = v_cache[blocks].flatten(1, 2).transpose(1, 2)
    mask = (torch.arange(k.shape[2], device=q.device)[None, :] < ctx[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[:, :, 0, :]


@triton.jit
def _v1_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, ctx_ptr, out_ptr, stride_tb, stride_kb, stride_kt, stride_kh,
               qk_scale, NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    seq, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    kv_head = head // GROUP
    ctx = tl.load(ctx_ptr + seq)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (seq * NUM_Q_HEADS + head) * HEAD_DIM + offs_d).to(tl.float32)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([1], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([1], dtype=tl.float32)
    for n0 in range(0, ctx, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < ctx
        block = tl.load(tables_ptr + seq * stride_tb + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        token = block * stride_kb + (offs_n % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
        k = tl.load(k_ptr + token[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0).to(tl.float32)
        s = tl.where(n_mask, tl.sum(k * q[None, :], axis=1) * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        v = tl.load(v_ptr + token[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    tl.store(out_ptr + (seq * NUM_Q_HEADS + head) * HEAD_DIM + offs_d, (acc / l_i).to(out_ptr.dtype.element_ty))


def v1_per_query_head(q, k_cache, v_cache, tables, ctx, scale, block_n=32):
    q = q.contiguous()
    out = torch.empty_like(q)
    batch, q_heads, head_dim = q.shape
    _v1_kernel[(batch, q_heads)](q, k_cache, v_cache, tables, ctx, out, tables.stride(0), k_cache.stride(0),
                                 k_cache.stride(1), k_cache.stride(2), scale * math.log2(math.e),
                                 NUM_Q_HEADS=q_heads, GROUP=q_heads // k_cache.shape[2], HEAD_DIM=head_dim,
                                 BLOCK_N=block_n, BLOCK_SIZE=k_cache.shape[1], num_warps=4)
    return out


def exported(**knobs):
    return lambda q, k, v, t, c, s: paged_decode_attention(q, k, v, t, c, s, impl="triton", **knobs)


def v4_prefill_kernel(q, k_cache, v_cache, tables, ctx, scale):
    query_start = torch.arange(q.shape[0] + 1, device=q.device)
    return paged_prefill_attention(q, k_cache, v_cache, tables, query_start, ctx, 1, scale, impl="triton")


VARIANTS = {"v0 torch padded gather + SDPA": v0_torch_padded, "v1 program per query head": v1_per_query_head,
            "v2 GQA tile, no split": exported(split_tokens=1 << 30),
            "v3 GQA tile + splits (exported)": exported(), "v4 prefill kernel, q len 1": v4_prefill_kernel}
SWEEP = {f"v3 split={s} block_n={n} warps={w} stages={st}": exported(split_tokens=s, block_n=n, num_warps=w,
                                                                     num_stages=st)
         for s, n, w, st in [(1024, 64, 4, None), (512, 128, 4, None), (1024, 128, 4, None), (512, 64, 4, 2),
                             (512, 128, 8, None)]}


def case(lens, q_heads, kv_heads, head_dim, block_size, dtype, seed=0):
    k_cache, v_cache, tables = random_paged_kv(lens, kv_heads, head_dim, block_size, dtype=dtype, device=DEVICE,
                                               spare_blocks=0, pad_columns=0, seed=seed)
    q = torch.randn(len(lens), q_heads, head_dim, generator=torch.Generator().manual_seed(seed + 1)).to(DEVICE, dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, device=DEVICE, dtype=torch.int32)


def main():
    ok = True
    if ON_GPU:
        checks = [([1, 17, 1000, 4096], 32, 8, 128, 16, torch.bfloat16), ([3000, 40], 32, 8, 128, 16, torch.float32),
                  ([5, 700], 8, 1, 64, 32, torch.bfloat16)]
    else:
        checks = [([1, 17, 300], 8, 2, 64, 16, torch.float32), ([700, 3], 4, 4, 32, 8, torch.float32)]
    print("validation against the reference (gather + fp32 softmax)")
    for i, (lens, hq, hkv, d, bs, dtype) in enumerate(checks):
        q, k, v, t, c = case(lens, hq, hkv, d, bs, dtype)
        want = paged_attention_reference(q, k, v, t, torch.arange(len(lens) + 1, device=DEVICE), c, d**-0.5)
        limit = 1e-2 if dtype == torch.bfloat16 else 1e-5
        for name, fn in {**VARIANTS, **(SWEEP if ON_GPU and i == 0 else {})}.items():  # sweep: Qwen3 shape only
            ok &= validate(f"{name} lens={lens} G={hq // hkv} D={d} bs={bs} {dtype}", fn(q, k, v, t, c, d**-0.5),
                           want, limit)
    if ON_GPU:
        results = Results("paged_decode_attention (Qwen3-4B shapes: 32/8 heads, D 128, block 16, bf16)")
        for batch, ctx in [(1, 512), (1, 4096), (1, 32768), (8, 2048), (32, 4096), (64, 1024), (256, 512),
                           (256, 2048)]:
            q, k, v, t, c = case([ctx] * batch, 32, 8, 128, 16, torch.bfloat16)
            nbytes = batch * ctx * 8 * 128 * 2 * 2 + 2 * q.nbytes
            for name, fn in selected({**VARIANTS, **SWEEP}).items():
                if name.startswith("v1") and batch * ctx > 300_000:
                    continue  # minutes of device time for a variant already beaten at smaller sizes
                ms, how = time_variant(lambda: fn(q, k, v, t, c, 128**-0.5), graph=True)
                results.add(f"B={batch} ctx={ctx}", f"{name} [{how}]", ms, nbytes)
        results.print()
    finish(ok)


if __name__ == "__main__":
    main()
