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
  v0  PyTorch, the engine's batched path without Triton: gather every table into a padded copy, masked SDPA
  v1  Triton, one program per (sequence, query head), dot products by multiply-and-sum:
      each KV head is read once per query head of its group (4x the bytes at GQA 4)
  v2  Triton, one program per (sequence, KV head) with the group's queries as rows of a tensor-core
      tile: each KV head read once; no split (the export with split_tokens = inf)
  v3  v2 + flash-decoding splits of the context (fixed, 512 keys) and a merge kernel (the export with `merge=False`)
  v4  the exported prefill kernel on the same batch (query length 1): the cost of sending decodes
      through the prefill kernel in a mixed step
  v5  v3's splits with no merge kernel: the last program of a (sequence, KV head) to finish merges every
      split's partials (an atomic counter per pair, reset by that program for the next call). At batch 1 and a
      few hundred keys v2 runs 8 programs, one per KV head, walking the context tile after tile (7 us a layer in
      the engine), and v3's splits pay a second launch; v5 asks whether short splits (128-256 keys)
      in one launch beat both. Memory order: every thread fences its partials (fence.acq_rel.gpu) before the
      CTA barrier and the acq_rel atomic; the merging program reads the partials past L1 (.cg).
  v6  (removed: v3 walking the whole tiles, then the last partial tile in a second loop, whose table and K/V loads
      the software pipeliner cannot issue during the first, against one masked loop over every tile. One masked loop
      won (300 keys 12.7 us against 13.8, 460 keys 15.1 against 16.1) and is the only loop the export has now: v3
      and every later variant use it.)
  v7  the export with `merge=True` (its default), fixed 512-key splits: v5's last-program merge inside
      the exported kernel, and only the splits that hold keys count in (a sequence within one split writes its output
      directly, empty splits write nothing). The W2-like step's timeline (256 sequences of 600 keys, tables 2K wide in
      the engine's graphs: 4 splits, 2 of them empty) spent 202 us a layer in the decode kernel and 24 in the merge,
      against ~150 for the bytes: the "xW" cases below pad the tables to that width, as the engine's graphs do.
  v8  v7 with the split length from the batch's size too (the export's default: splits of DECODE_MIN_SPLIT keys and up, as many
      as bring the programs to ~256; none for 256 sequences). v7 with splits of 128 / 512 / 1,024: one
      sequence of 460 keys 11.6 / 15.1 / 15.0 us; 256 sequences of 600 keys (2K tables) 296 / 197 / 169 us.
      Its sweep asks whether shorter splits and tiles pay at batch 1, where the engine's graph for W1 (tables 512
      keys wide) runs 8-24 programs of one 128-key tile each (8.2 us a layer in the step): 64-key splits do
      (chapter 09's DECODE_MIN_SPLIT).

Measured (one H200, B=1): 256 keys v2 10.9 us, v3 11.2, v5 11.1 (splits of 128); 512 keys v3 15.8, v5 13.4.
"""

import math
import os

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
from forge_engine.kernels import (
    paged_attention as kernels,
)  # (its tuning constants, set for a call)
from forge_engine.kernels.backend import INTERPRETED, _dot_precision, _pow2
from forge_engine.kernels.paged_attention import (
    DECODE_BLOCK_N,
    DECODE_SPLIT_TOKENS,
    _attend_keys,
    _fence_gpu,
    decode_split_len,
    paged_attention_reference,
    paged_decode_attention,
    random_paged_kv,
)
from forge_engine.kernels.prefill_attention import paged_prefill_attention


def v0_torch_padded(q, k_cache, v_cache, tables, ctx, scale):
    blocks = tables.long().clamp(min=0)  # padding reads block 0, masked below
    k = k_cache[blocks].flatten(1, 2).transpose(1, 2)  # [B, Hkv, L, D]
    v = v_cache[blocks].flatten(1, 2).transpose(1, 2)
    mask = (torch.arange(k.shape[2], device=q.device)[None, :] < ctx[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out[:, :, 0, :]


@triton.jit
def _v1_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    ctx_ptr,
    out_ptr,
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
        block = tl.load(
            tables_ptr + seq * stride_tb + offs_n // BLOCK_SIZE, mask=n_mask, other=0
        ).to(tl.int64)
        token = block * stride_kb + (offs_n % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
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
        out_ptr + (seq * NUM_Q_HEADS + head) * HEAD_DIM + offs_d,
        (acc / l_i).to(out_ptr.dtype.element_ty),
    )


def v1_per_query_head(q, k_cache, v_cache, tables, ctx, scale, block_n=32):
    q = q.contiguous()
    out = torch.empty_like(q)
    batch, q_heads, head_dim = q.shape
    _v1_kernel[(batch, q_heads)](
        q,
        k_cache,
        v_cache,
        tables,
        ctx,
        out,
        tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        scale * math.log2(math.e),
        NUM_Q_HEADS=q_heads,
        GROUP=q_heads // k_cache.shape[2],
        HEAD_DIM=head_dim,
        BLOCK_N=block_n,
        BLOCK_SIZE=k_cache.shape[1],
        num_warps=4,
    )
    return out


@triton.jit
def _v5_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    context_lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    count_ptr,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_tb,
    stride_kb,
    stride_kt,
    stride_kh,
    qk_scale,
    num_q_heads,
    num_kv_heads,
    split_len,
    num_splits,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    FENCE: tl.constexpr,
):
    seq, kv_head, split = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq).to(tl.int32)
    start = split * split_len
    end = tl.maximum(tl.minimum(start + split_len, ctx), start)
    full_end = start + (end - start) // BLOCK_N * BLOCK_N
    rows = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=mask, other=0.0
    )
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    k_ptr, v_ptr, tables_ptr = (
        k_ptr + kv_head * stride_kh,
        v_ptr + kv_head * stride_kh,
        tables_ptr + seq * stride_tb,
    )
    row_pos = tl.full([BLOCK_G], 0, tl.int32) + ctx - 1
    acc, m_i, l_i = _attend_keys(
        q,
        row_pos,
        acc,
        m_i,
        l_i,
        k_ptr,
        v_ptr,
        tables_ptr,
        start,
        full_end,
        stride_kb,
        stride_kt,
        offs_d,
        d_mask,
        qk_scale,
        False,
        BLOCK_N,
        BLOCK_SIZE,
        UPCAST,
        PRECISION,
    )
    acc, m_i, l_i = _attend_keys(
        q,
        row_pos,
        acc,
        m_i,
        l_i,
        k_ptr,
        v_ptr,
        tables_ptr,
        full_end,
        end,
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
    part = (seq * num_q_heads + heads) * num_splits  # [BLOCK_G] first split of each head
    tl.store(part_acc_ptr + (part + split)[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=mask)
    tl.store(part_m_ptr + part + split, m_i, mask=row_mask)
    tl.store(part_l_ptr + part + split, l_i, mask=row_mask)
    _fence_gpu(
        split, FENCE
    )  # this thread's partials, visible GPU-wide before the count says they are there
    tl.debug_barrier()
    counter = count_ptr + seq * num_kv_heads + kv_head
    done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if done == num_splits - 1:  # the last: every other split's partials are written; merge them all
        _fence_gpu(done, FENCE)
        m_all = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_all = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc_all = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        for s in range(0, num_splits):
            m_s = tl.load(
                part_m_ptr + part + s, mask=row_mask, other=float("-inf"), cache_modifier=".cg"
            )
            l_s = tl.load(part_l_ptr + part + s, mask=row_mask, other=0.0, cache_modifier=".cg")
            a_s = tl.load(
                part_acc_ptr + (part + s)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=mask,
                other=0.0,
                cache_modifier=".cg",
            )
            m_new = tl.maximum(m_all, m_s)
            m_use = tl.where(
                m_new == float("-inf"), 0.0, m_new
            )  # no key seen yet (empty splits weigh 0)
            alpha, beta = tl.exp2(m_all - m_use), tl.exp2(m_s - m_use)
            acc_all = acc_all * alpha[:, None] + a_s * beta[:, None]
            l_all = l_all * alpha + l_s * beta
            m_all = m_new
        out = acc_all / tl.where(l_all == 0.0, 1.0, l_all)[:, None]
        tl.store(
            out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mask,
        )
        tl.atomic_xchg(
            counter, 0, sem="relaxed", scope="gpu"
        )  # ready for the next call (a graph replays it)


_V5_COUNTERS = {}  # (device, sequences x KV heads) -> zeroed counters, kept across calls (a lab's cache)


def v5_last_program_merges(
    q, k_cache, v_cache, tables, ctx, scale, split_tokens=256, block_n=DECODE_BLOCK_N, num_warps=4
):
    batch, q_heads, head_dim = q.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    split_len, num_splits = decode_split_len(tables.shape[1], block_size, split_tokens, block_n)
    key = (q.device, batch * kv_heads)
    if key not in _V5_COUNTERS:
        _V5_COUNTERS[key] = torch.zeros(batch * kv_heads, device=q.device, dtype=torch.int32)
    out = torch.empty_like(q)
    part_acc = torch.empty(
        batch, q_heads, num_splits, head_dim, device=q.device, dtype=torch.float32
    )
    part_m, part_l = (
        torch.empty(batch, q_heads, num_splits, device=q.device, dtype=torch.float32)
        for _ in range(2)
    )
    _v5_kernel[(batch, kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        tables,
        ctx,
        out,
        part_acc,
        part_m,
        part_l,
        _V5_COUNTERS[key],
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        scale * math.log2(math.e),
        q_heads,
        kv_heads,
        split_len,
        num_splits,
        GROUP=q_heads // kv_heads,
        BLOCK_G=max(16, _pow2(q_heads // kv_heads)),
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, _pow2(head_dim)),
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        UPCAST=INTERPRETED,
        PRECISION=_dot_precision(q.dtype),
        FENCE=not INTERPRETED,
        num_warps=num_warps,
    )
    return out


def exported(**knobs):
    return lambda q, k, v, t, c, s: paged_decode_attention(q, k, v, t, c, s, impl="triton", **knobs)


_MERGE_COUNTERS = {}  # device -> zeroed counters, kept across calls as the engine's decode backend keeps them


def exported_merging(**knobs):
    def run(q, k, v, t, c, s):
        need = q.shape[0] * k.shape[2]
        if _MERGE_COUNTERS.get(q.device) is None or _MERGE_COUNTERS[q.device].numel() < need:
            _MERGE_COUNTERS[q.device] = torch.zeros(
                max(need, 4096), device=q.device, dtype=torch.int32
            )
        return paged_decode_attention(
            q, k, v, t, c, s, impl="triton", merge=True, counters=_MERGE_COUNTERS[q.device], **knobs
        )

    return run


def with_switches(fn, **switches):
    "fn with chapter 09_kernels_paged_attention's tuning constants set for the call, whatever their defaults (a graph records the launch)."

    def run(*args):
        defaults = {name: getattr(kernels, name) for name in switches}
        try:
            for name, value in switches.items():
                setattr(kernels, name, value)
            return fn(*args)
        finally:
            for name, value in defaults.items():
                setattr(kernels, name, value)

    return run


def v4_prefill_kernel(q, k_cache, v_cache, tables, ctx, scale):
    query_start = torch.arange(q.shape[0] + 1, device=q.device)
    return paged_prefill_attention(
        q, k_cache, v_cache, tables, query_start, ctx, 1, scale, impl="triton"
    )


VARIANTS = {
    "v0 torch padded gather + SDPA": v0_torch_padded,
    "v1 program per query head": v1_per_query_head,
    "v2 GQA tile, no split": exported(split_tokens=1 << 30),
    "v3 GQA tile + splits (exported)": exported(split_tokens=DECODE_SPLIT_TOKENS, merge=False),
    "v4 prefill kernel, q len 1": v4_prefill_kernel,
    "v5 splits of 256, last program merges": v5_last_program_merges,
    "v7 export, last split merges": exported_merging(split_tokens=DECODE_SPLIT_TOKENS),
    "v8 v7, splits by work": exported_merging(),
}
SWEEP = {
    f"v3 split={s} block_n={n} warps={w} stages={st}": exported(
        split_tokens=s, block_n=n, num_warps=w, num_stages=st, merge=False
    )
    for s, n, w, st in [
        (1024, 64, 4, None),
        (512, 128, 4, None),
        (1024, 128, 4, None),
        (512, 64, 4, 2),
        (512, 128, 8, None),
    ]
}
SWEEP.update(
    {
        f"v5 split={s} block_n={n}": (
            lambda s, n: lambda *a: v5_last_program_merges(*a, split_tokens=s, block_n=n)
        )(s, n)
        for s, n in [(128, 64), (128, 128), (256, 128), (512, 128)]
    }
)
SWEEP.update({f"v7 split={s}": exported_merging(split_tokens=s) for s in (128, 256, 1024)})
SWEEP.update(
    {
        f"v8 min split={s} block_n={n} warps={w}": with_switches(
            exported_merging(block_n=n, num_warps=w), DECODE_MIN_SPLIT=s
        )
        for s, n, w in [
            (64, 64, 4),
            (64, 64, 2),
            (32, 32, 4),
            (32, 32, 2),
            (64, 32, 4),
            (128, 64, 4),
        ]
    }
)


def case(lens, q_heads, kv_heads, head_dim, block_size, dtype, seed=0, width=0):
    "Random pools and queries; `width` (tokens): the tables padded to that many columns of blocks, as a graph's are."
    pad = max(0, -(-width // block_size) - -(-max(lens) // block_size))
    k_cache, v_cache, tables = random_paged_kv(
        lens,
        kv_heads,
        head_dim,
        block_size,
        dtype=dtype,
        device=DEVICE,
        spare_blocks=0,
        pad_columns=pad,
        seed=seed,
    )
    q = torch.randn(
        len(lens), q_heads, head_dim, generator=torch.Generator().manual_seed(seed + 1)
    ).to(DEVICE, dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, device=DEVICE, dtype=torch.int32)


def main():
    ok = True
    if ON_GPU:
        checks = [
            ([1, 17, 1000, 4096], 32, 8, 128, 16, torch.bfloat16),
            ([3000, 40], 32, 8, 128, 16, torch.float32),
            ([5, 700], 8, 1, 64, 32, torch.bfloat16),
        ]
    else:
        checks = [
            ([1, 17, 300], 8, 2, 64, 16, torch.float32),
            ([700, 3], 4, 4, 32, 8, torch.float32),
        ]
    print("validation against the reference (gather + fp32 softmax)")
    for i, (lens, hq, hkv, d, bs, dtype) in enumerate(checks):
        q, k, v, t, c = case(lens, hq, hkv, d, bs, dtype)
        want = paged_attention_reference(
            q, k, v, t, torch.arange(len(lens) + 1, device=DEVICE), c, d**-0.5
        )
        limit = 1e-2 if dtype == torch.bfloat16 else 1e-5
        for name, fn in {
            **VARIANTS,
            **(SWEEP if ON_GPU and i == 0 else {}),
        }.items():  # sweep: Qwen3 shape only
            for call in range(
                2 if name.startswith(("v5", "v7")) else 1
            ):  # their counters must be back at zero
                ok &= validate(
                    f"{name} lens={lens} G={hq // hkv} D={d} bs={bs} {dtype}" + " (again)" * call,
                    fn(q, k, v, t, c, d**-0.5),
                    want,
                    limit,
                )
    if ON_GPU:
        results = Results(
            "paged_decode_attention (Qwen3-4B shapes: 32/8 heads, D 128, block 16, bf16)"
        )
        shapes = [
            (1, 256, 0),
            (1, 300, 0),
            (1, 384, 0),
            (1, 460, 0),
            (1, 512, 0),
            (1, 4096, 0),
            (1, 32768, 0),
            (8, 2048, 0),
            (32, 4096, 0),
            (64, 1024, 0),
            (256, 512, 0),
            (256, 2048, 0),
            (1, 1000, 2048),
            (64, 1500, 2048),
            (256, 600, 2048),
            (256, 1000, 2048),
        ]  # the last: graph-wide tables
        if os.environ.get("LAB_SHAPES"):  # e.g. LAB_SHAPES="1x300,256x600x2048"
            shapes = [
                tuple(map(int, (x + "x0").split("x")[:3]))
                for x in os.environ["LAB_SHAPES"].split(",")
            ]
        for batch, ctx, width in shapes:
            q, k, v, t, c = case([ctx] * batch, 32, 8, 128, 16, torch.bfloat16, width=width)
            nbytes = batch * ctx * 8 * 128 * 2 * 2 + 2 * q.nbytes
            for name, fn in selected({**VARIANTS, **SWEEP}).items():
                if name.startswith("v1") and batch * ctx > 300_000:
                    continue  # minutes of device time for a variant already beaten at smaller sizes
                ms, how = time_variant(lambda: fn(q, k, v, t, c, 128**-0.5), graph=True)
                results.add(
                    f"B={batch} ctx={ctx}" + (f" {width}W" if width else ""),
                    f"{name} [{how}]",
                    ms,
                    nbytes,
                )
        results.print()
    finish(ok)


if __name__ == "__main__":
    main()
