"""Causal prefill attention over a flattened varlen batch, K/V read through block tables.

Sequence b brings num_new tokens at positions num_computed .. num_computed + num_new - 1 (a
whole prompt, a chunk of one, or the rest after a prefix-cache hit) and each attends to keys
0 .. its position, all already in the paged pool.

Napkin math (Qwen3-4B: 32 query heads, 8 KV heads, head_dim 128, bf16): FLOPs are
4 x head_dim x q_heads x (visible keys summed over the new tokens); a 2,048-token prompt
has 2.1M visible (query, key) pairs: 34 GFLOP per layer, 43 us at 790 TFLOP/s. Its K/V is
8 MiB, 2 us at 4.19 TB/s: prefill is compute-bound, so variants are judged in TFLOP/s. A
causal kernel also wastes the masked half of its diagonal tiles.

Variants
  v0    PyTorch, the engine's path without Triton: per sequence, gather its K/V and run SDPA with a mask
  v1    Triton, one program per (query token, query head), multiply-and-sum (no tensor cores)
  v2    Triton, tiled flash attention: one program per (BLOCK_M query tokens, query head), tensor cores;
        each KV head is read by each of the 4 query heads of its group; every tile masked
  v3    Triton, v2 with the GQA group packed into the tile's rows: (tokens x heads of the group) x head_dim,
        so one K/V tile serves the whole group, and no mask on the tiles below the diagonal
        (forge_engine.kernels: the export), by rows / block_n / warps / pipeline stages
  peer  SDPA is_causal on contiguous K/V (no paging, the group expanded): what PyTorch's flash kernel does
"""

import math

from common import (
    DEVICE,
    ON_GPU,
    Results,
    finish,
    selected,
    time_variant,
    validate,
)  # first: it may switch on the interpreter
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from forge_engine.kernels.backend import INTERPRETED, _dot_precision
from forge_engine.kernels.paged_attention import (
    _attend_keys,
    paged_attention_reference,
    random_paged_kv,
)
from forge_engine.kernels.prefill_attention import paged_prefill_attention
from forge_engine.model import causal_attention


def v0_torch(q, k_cache, v_cache, tables, query_start, ctx, max_query_len, scale):
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    for b, (start, end, n) in enumerate(
        zip(query_start[:-1].tolist(), query_start[1:].tolist(), ctx.tolist())
    ):
        blocks = tables[b, : -(-n // block_size)].long()
        k, v = k_cache[blocks].flatten(0, 1)[:n], v_cache[blocks].flatten(0, 1)[:n]
        out[start:end] = causal_attention(q[start:end], k, v, q_offset=n - (end - start))
    return out


@triton.jit
def _v1_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    query_start_ptr,
    ctx_ptr,
    out_ptr,
    seq_of_row_ptr,
    stride_tb,
    stride_kb,
    stride_kt,
    stride_kh,
    qk_scale,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    row, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    seq = tl.load(seq_of_row_ptr + row).to(tl.int64)
    q_end = tl.load(query_start_ptr + seq + 1)
    pos = tl.load(ctx_ptr + seq) - (q_end - row)  # this token's position
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (row * NUM_Q_HEADS + head) * HEAD_DIM + offs_d).to(tl.float32)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([1], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([1], dtype=tl.float32)
    for n0 in range(0, pos + 1, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n <= pos
        block = tl.load(
            tables_ptr + seq * stride_tb + offs_n // BLOCK_SIZE, mask=n_mask, other=0
        ).to(tl.int64)
        token = block * stride_kb + (offs_n % BLOCK_SIZE) * stride_kt + (head // GROUP) * stride_kh
        k = tl.load(k_ptr + token[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0).to(
            tl.float32
        )
        s = tl.where(n_mask, tl.sum(k * q[None, :], axis=1) * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        v = tl.load(v_ptr + token[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0).to(
            tl.float32
        )
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    tl.store(
        out_ptr + (row * NUM_Q_HEADS + head) * HEAD_DIM + offs_d,
        (acc / l_i).to(out_ptr.dtype.element_ty),
    )


def v1_per_row(q, k_cache, v_cache, tables, query_start, ctx, max_query_len, scale):
    q = q.contiguous()
    out = torch.empty_like(q)
    lens = query_start[1:] - query_start[:-1]
    seq_of_row = torch.repeat_interleave(torch.arange(len(lens), device=q.device), lens)
    _v1_kernel[(q.shape[0], q.shape[1])](
        q,
        k_cache,
        v_cache,
        tables,
        query_start,
        ctx,
        out,
        seq_of_row,
        tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        scale * math.log2(math.e),
        NUM_Q_HEADS=q.shape[1],
        GROUP=q.shape[1] // k_cache.shape[2],
        HEAD_DIM=q.shape[2],
        BLOCK_N=32,
        BLOCK_SIZE=k_cache.shape[1],
        num_warps=4,
    )
    return out


@triton.jit
def _v2_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    query_start_ptr,
    ctx_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_tb,
    stride_kb,
    stride_kt,
    stride_kh,
    qk_scale,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile, seq, head = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_ptr + seq + 1).to(tl.int32) - q_start
    first = tile * BLOCK_M
    if first >= q_len:
        return
    ctx = tl.load(ctx_ptr + seq).to(tl.int32)
    token = first + tl.arange(0, BLOCK_M)
    row_mask = token < q_len
    offs_d = tl.arange(0, HEAD_DIM)
    d_mask = offs_d < HEAD_DIM
    rows = (q_start + token).to(tl.int64)[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + rows, mask=row_mask[:, None], other=0.0)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    kv_head = head // GROUP
    acc, m_i, l_i = _attend_keys(
        q,
        ctx - q_len + token,
        acc,
        m_i,
        l_i,
        k_ptr + kv_head * stride_kh,
        v_ptr + kv_head * stride_kh,
        tables_ptr + seq * stride_tb,
        0,
        tl.minimum(ctx, ctx - q_len + first + BLOCK_M),
        stride_kb,
        stride_kt,
        offs_d,
        d_mask,
        qk_scale,
        True,
        BLOCK_N,
        BLOCK_SIZE,
        UPCAST,
        PRECISION,
    )
    tl.store(
        out_ptr + rows, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=row_mask[:, None]
    )


def v2_per_head(
    q, k_cache, v_cache, tables, query_start, ctx, max_query_len, scale, block_m=64, block_n=64
):
    out = torch.empty_like(q)
    grid = (-(-max_query_len // block_m), tables.shape[0], q.shape[1])
    _v2_kernel[grid](
        q,
        k_cache,
        v_cache,
        tables,
        query_start,
        ctx,
        out,
        q.stride(0),
        q.stride(1),
        tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        scale * math.log2(math.e),
        GROUP=q.shape[1] // k_cache.shape[2],
        BLOCK_M=block_m,
        HEAD_DIM=q.shape[2],
        BLOCK_N=block_n,
        BLOCK_SIZE=k_cache.shape[1],
        UPCAST=INTERPRETED,
        PRECISION=_dot_precision(q.dtype),
        num_warps=4,
    )
    return out


def exported(**knobs):
    return lambda q, k, v, t, qs, c, mq, s: paged_prefill_attention(
        q, k, v, t, qs, c, mq, s, impl="triton", **knobs
    )


VARIANTS = {
    "v0 torch gather + SDPA per sequence": v0_torch,
    "v1 program per (token, head)": v1_per_row,
    "v2 flash tile per query head": v2_per_head,
    "v3 GQA-packed flash tile (exported)": exported(),
}
SWEEP = {
    f"v3 rows={r} block_n={n} warps={w} stages={st}": exported(
        rows=r, block_n=n, num_warps=w, num_stages=st
    )
    for r, n, w, st in [
        (64, 32, 4, None),
        (64, 64, 4, 2),
        (64, 64, 4, 4),
        (128, 64, 8, None),
        (128, 128, 8, None),
    ]
}


def case(chunks, q_heads=32, kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16, seed=0):
    lens = [c + n for c, n in chunks]
    k_cache, v_cache, tables = random_paged_kv(
        lens,
        kv_heads,
        head_dim,
        block_size,
        dtype=dtype,
        device=DEVICE,
        spare_blocks=0,
        pad_columns=0,
        seed=seed,
    )
    num_new = [n for _, n in chunks]
    q = torch.randn(
        sum(num_new), q_heads, head_dim, generator=torch.Generator().manual_seed(seed + 1)
    )
    query_start = torch.tensor([0, *num_new], device=DEVICE).cumsum(0)
    return (
        q.to(DEVICE, dtype),
        k_cache,
        v_cache,
        tables,
        query_start,
        torch.tensor(lens, device=DEVICE),
        max(num_new),
    )


def flops(chunks, q_heads=32, head_dim=128):
    return 4 * head_dim * q_heads * sum(n * c + n * (n + 1) // 2 for c, n in chunks)


def peer_sdpa(chunks, args):
    "SDPA is_causal on contiguous K/V of equal fresh prompts, the group expanded: no paging, flash kernel."
    q, k_cache, v_cache, tables, _, _, _ = args
    batch, n = len(chunks), chunks[0][1]
    k = (
        k_cache[tables.long()]
        .flatten(1, 2)[:, :n]
        .transpose(1, 2)
        .repeat_interleave(4, dim=1)
        .contiguous()
    )
    v = (
        v_cache[tables.long()]
        .flatten(1, 2)[:, :n]
        .transpose(1, 2)
        .repeat_interleave(4, dim=1)
        .contiguous()
    )
    qb = q.view(batch, n, 32, 128).transpose(1, 2).contiguous()
    return lambda: F.scaled_dot_product_attention(qb, k, v, is_causal=True)


def main():
    ok = True
    if ON_GPU:
        checks = [
            ([(0, 300), (100, 77), (999, 1)], 32, 8, 128, 16, torch.bfloat16),
            ([(0, 130), (64, 64)], 32, 8, 128, 16, torch.float32),
            ([(16, 40), (0, 9)], 8, 1, 64, 32, torch.bfloat16),
        ]
    else:
        checks = [
            ([(0, 40), (25, 9), (70, 1)], 8, 2, 64, 16, torch.float32),
            ([(3, 20)], 4, 4, 32, 8, torch.float32),
        ]
    print("validation against the reference (gather + fp32 softmax)")
    for i, (chunks, hq, hkv, d, bs, dtype) in enumerate(checks):
        args = case(chunks, hq, hkv, d, bs, dtype)
        want = paged_attention_reference(*args[:6], d**-0.5)
        limit = 1e-2 if dtype == torch.bfloat16 else 1e-5
        for name, fn in {
            **VARIANTS,
            **(SWEEP if ON_GPU and i == 0 else {}),
        }.items():  # sweep: Qwen3 shape only
            ok &= validate(
                f"{name} {chunks} G={hq // hkv} D={d} bs={bs} {dtype}",
                fn(*args, d**-0.5),
                want,
                limit,
            )
    if ON_GPU:
        results = Results(
            "paged_prefill_attention (Qwen3-4B shapes: 32/8 heads, D 128, block 16, bf16)"
        )
        cases = {
            "1 prompt of 2048": [(0, 2048)],
            "8 prompts of 512": [(0, 512)] * 8,
            "16 prompts of 128": [(0, 128)] * 16,
            "chunk of 512 after 3584": [(3584, 512)],
            "2 chunks of 256 + 64 decodes": [(0, 256), (512, 256)] + [(1023, 1)] * 64,
        }
        for label, chunks in cases.items():
            args = case(chunks)
            for name, fn in selected({**VARIANTS, **SWEEP}).items():
                if name.startswith("v1") and flops(chunks) > 5e10:
                    continue  # seconds per call: beaten already at the smaller cases
                ms, how = time_variant(
                    lambda: fn(*args, 128**-0.5), graph=not name.startswith("v0")
                )  # v0 syncs
                results.add(label, f"{name} [{how}]", ms, flops=flops(chunks))
            if all(c == 0 and n == chunks[0][1] for c, n in chunks):
                ms, how = time_variant(peer_sdpa(chunks, args), graph=True)
                results.add(
                    label, f"peer SDPA is_causal, contiguous [{how}]", ms, flops=flops(chunks)
                )
        results.print()
    finish(ok)


if __name__ == "__main__":
    main()
