"""A verify step's attention with one program per (KV head, split) for all of a sequence's rows: is that where the
verify step's extra attention time goes?

Why: chapter 09's decode kernel gives each row of a verify step (1 + k positions of one sequence, chapter 08c) programs
of its own, (row, KV head, split), and each reads the sequence's keys again. Its q tile is BLOCK_G = 16 rows for
Qwen3's 4 query heads a KV head: 12 of them padding. Four positions x four heads fill that tile exactly, so one program
can take every row of a sequence (up to 16 / GROUP of them; 5 rows take a tile of 32) for the same keys read once and
no more tensor-core work. On an H100 the verify graph of 1 + 4 rows spent ~520 µs a step in its attention
(`verify_step.py`'s LAB_PROFILE, an earlier run; the decode graph's attention was not profiled beside it), a sixth of
a decode step: if the rows' reading the keys again is most of it, this is the next lever after the matmuls.

Here the plain form of each, K/V already in the pool and q already rotated (the package's verify kernel also stores the
new K/V and normalises and rotates q and k inside; these do neither): `rows` (this file: a program per (sequence, KV
head, split) over the sequence's R rows, each row's own causal mask, partials merged by a second launch) against
`per_row` (chapter 09's `paged_decode_attention`, each row a sequence of its own with its context up to its position:
the package's split rule and merge), for R = 1, 2, 4, 5 rows of one sequence at a few context lengths, and beside them
the package's fused verify call as the verify graph makes it (`fused_verify`); each timing one CUDA graph of 36
launches (a step's layers) over 36 pools.

Checked under the interpreter against chapter 09's `paged_attention_reference`:
    TRITON_INTERPRET=1 PYTHONPATH=. python3 kernels_lab/verify_attention_rows.py check
On a GPU: PYTHONPATH=. python3 kernels_lab/verify_attention_rows.py [time]. In the hardware's counters (`profile`:
at 512 keys, the fused verify call of 1, 4 and 5 rows and this file's kernel of 5 rows, each launched once inside an
NVTX range `profile`): ncu --clock-control none --nvtx --nvtx-include "profile/" --section SpeedOfLight \\
    --section WarpStateStats --section LaunchStats python3 kernels_lab/verify_attention_rows.py profile
On one H100 so (caches flushed): the decode kernel of 1 row 10.6 µs (72 programs of 8 warps); the fused verify call
of 4 rows 14.6 µs and of 5 rows 14.4 (288 and 360 programs of 4 warps, most of them returning at once), its SMs busy
a fifth to two fifths of the launch: its time is one program's chain of dependent loads, not its work.
On an H100, µs a layer (rows / per row / the package's fused verify call as it is now):
    context 512:  1 row 6.5 / 8.6 / 8.6;  2 rows 7.3 / 9.4 / 12.2;  4 rows 7.4 / 9.5 / 13.0;  5 rows 8.1 / 10.3 / 13.1
    context 4096: 1 row 15.7 / 17.0 / 15.3; 2 rows 15.8 / 17.9 / 19.9; 4 rows 16.0 / 21.8 / 21.8; 5 rows 17.8 / 23.3 / 22.4
One program for a sequence's rows reads its keys once: 1.23-1.36x faster than a program per row at 4-5 rows. Taken:
chapter 09's `_verify_kernel` (with the store, norm and rotation inside, in chunks of a 16-row tile)."""

import math
import sys

import torch

from common import launches_us, profiled_launch
from forge_engine.kernels.backend import INTERPRETED, tl, triton
from forge_engine.kernels.elementwise import NormRope
from forge_engine.kernels.paged_attention import (
    paged_attention_reference,
    paged_decode_attention,
    random_paged_kv,
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16  # Qwen3-4B's attention


@triton.jit
def _rows_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    ctx_ptr,
    part_acc_ptr,
    part_ml_ptr,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_tb,
    split_len,
    num_splits,
    qk_scale,
    R: tl.constexpr,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Sequence program_id(0)'s R rows (q rows seq * R .. seq * R + R - 1, its last R positions) for KV head
    program_id(1)'s GROUP query heads, keys of split program_id(2): q tile row i = (position i // GROUP, head
    i % GROUP). Partials: acc [rows, HEADS, splits, D] and (m, l) [rows, HEADS, splits, 2], in log2 units."""
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(ctx_ptr + seq)
    i = tl.arange(0, BLOCK_Q)
    r, head = i // GROUP, kv_head * GROUP + i % GROUP
    valid = r < R
    pos = ctx - R + r  # each row's position: it sees the keys up to it
    d = tl.arange(0, HEAD_DIM)
    row = seq * R + r
    q = tl.load(
        q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=valid[:, None],
    )
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)
    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM], tl.float32)
    k_head, v_head = k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_kh
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        block = tl.load(tables_ptr + seq * stride_tb + offs_n // BLOCK_SIZE, mask=n_ok, other=0)
        token = block.to(tl.int64) * stride_kb + (offs_n % BLOCK_SIZE) * stride_kt
        k = tl.load(k_head + token[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
        v = tl.load(v_head + token[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
        if UPCAST:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        visible = n_ok[None, :] & (offs_n[None, :] <= pos[:, None])
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees no key here yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if UPCAST:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    part = (row * HEADS + head) * num_splits + split
    tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=valid[:, None])
    tl.store(part_ml_ptr + part * 2, m_i, mask=valid)
    tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=valid)


@triton.jit
def _merge_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, num_splits, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr
):
    "One (row, head): its splits' partials into out [rows * HEADS, D] (the rows' dtype)."
    at = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    m = tl.load(part_ml_ptr + (at * num_splits + s) * 2, mask=s_ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + (at * num_splits + s) * 2 + 1, mask=s_ok, other=0.0)
    m_all = tl.max(m, axis=0)
    w = tl.where(s_ok & (m > float("-inf")), tl.exp2(m - m_all), 0.0)
    d = tl.arange(0, HEAD_DIM)
    acc = tl.load(
        part_acc_ptr + (at * num_splits + s)[:, None] * HEAD_DIM + d[None, :],
        mask=s_ok[:, None],
        other=0.0,
    )
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(out_ptr + at * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty))


def rows_attention(
    q, k_cache, v_cache, tables, context_lens, scale, rows: int, splits: int | None = None
):
    """q [S * rows, Hq, D]: each of S sequences' last `rows` positions (rows in order), K/V already in the pool ->
    [S * rows, Hq, D]. `splits`: along the keys (default: about 256 programs, at most 16 splits)."""
    seqs, width = tables.shape[0], tables.shape[1] * k_cache.shape[1]
    heads, kv_heads, dim = q.shape[1], k_cache.shape[2], q.shape[2]
    group = heads // kv_heads
    splits = splits or max(1, min(16, -(-256 // (seqs * kv_heads))))
    split_len = -(-max(64, -(-width // splits)) // 64) * 64
    splits = -(-width // split_len)
    part_acc = torch.empty(seqs * rows * heads * splits, dim, device=q.device, dtype=torch.float32)
    part_ml = torch.empty(seqs * rows * heads * splits, 2, device=q.device, dtype=torch.float32)
    _rows_kernel[(seqs, kv_heads, splits)](
        q, k_cache, v_cache, tables, context_lens, part_acc, part_ml, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0), split_len, splits,
        scale * math.log2(math.e),
        R=rows, GROUP=group, HEADS=heads, BLOCK_Q=max(16, triton.next_power_of_2(rows * group)), HEAD_DIM=dim,
        BLOCK_N=64, BLOCK_SIZE=k_cache.shape[1], UPCAST=INTERPRETED, num_warps=4,
    )  # fmt: skip
    out = torch.empty_like(q)
    _merge_kernel[(seqs * rows * heads,)](
        part_acc, part_ml, out, splits, HEAD_DIM=dim, BLOCK_S=max(2, triton.next_power_of_2(splits))
    )
    return out


def per_row_inputs(tables, context_lens, rows: int):
    "Each sequence's rows as sequences of their own (chapter 09's decode kernel): their tables and context lengths."
    tables_rows = tables.repeat_interleave(rows, dim=0)
    back = torch.arange(rows - 1, -1, -1, device=tables.device, dtype=context_lens.dtype)
    return tables_rows, (context_lens[:, None] - back[None, :]).reshape(-1)


def fused_verify(pool, rows: int, scale: float):
    """The package's verify attention on one sequence's rows, as the verify graph calls it: q and the rows' new K as the
    QKV projection leaves them, normalised, rotated and stored inside the launch (`verify`, with `new_kv` and
    `rope`) -> a function of no arguments that runs it (random norm weights and angles, the pool's dtype)."""
    q, k_cache, v_cache, tables, ctx = pool
    tables_rows, ctx_rows = per_row_inputs(tables, ctx, rows)
    pos = (ctx_rows - 1).long()
    slots = (
        tables_rows[torch.arange(len(pos)), pos // BLOCK_SIZE].long() * BLOCK_SIZE
        + pos % BLOCK_SIZE
    )
    gen = torch.Generator(device=q.device).manual_seed(3)
    dtype, device = q.dtype, q.device
    new_k, new_v = (
        torch.randn(len(pos), KV_HEADS, HEAD_DIM, generator=gen, device=device).to(dtype)
        for _ in range(2)
    )
    angles = pos[:, None].float() * torch.rand(HEAD_DIM // 2, generator=gen, device=device)[None, :]
    weights = [
        (torch.rand(HEAD_DIM, generator=gen, device=device) + 0.5).to(dtype) for _ in range(2)
    ]
    rope = NormRope(*weights, 1e-6, angles.cos().to(dtype), angles.sin().to(dtype))
    # the merge counters kept between calls, as the verify graph keeps them (each call leaves them at zero)
    counters = torch.zeros(len(pos) * KV_HEADS, dtype=torch.int32, device=device)
    return lambda: paged_decode_attention(
        q,
        k_cache,
        v_cache,
        tables_rows,
        ctx_rows,
        scale,
        new_kv=(new_k, new_v, slots),
        rope=rope,
        counters=counters,
        verify=True,
    )


def inputs(context_lens: list[int], rows: int, dtype, device, seed=0):
    k_cache, v_cache, tables = random_paged_kv(
        context_lens, KV_HEADS, HEAD_DIM, BLOCK_SIZE, dtype=dtype, device=device, seed=seed
    )
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    q = torch.randn(len(context_lens) * rows, HEADS, HEAD_DIM, generator=gen, device=device).to(
        dtype
    )
    return q, k_cache, v_cache, tables, torch.tensor(context_lens, dtype=torch.int32, device=device)


def check():
    scale = HEAD_DIM**-0.5
    for context_lens, rows, splits in (
        ([37], 5, 3),
        ([100, 64], 4, 2),
        ([9, 130], 1, None),
        ([70], 2, 4),
    ):
        q, k_cache, v_cache, tables, ctx = inputs(context_lens, rows, torch.float32, "cpu")
        starts = torch.arange(0, q.shape[0] + 1, rows)
        want = paged_attention_reference(q, k_cache, v_cache, tables, starts, ctx, scale)
        got = rows_attention(q, k_cache, v_cache, tables, ctx, scale, rows, splits)
        err = (got - want).abs().max().item()
        per_row = paged_decode_attention(
            q, k_cache, v_cache, *per_row_inputs(tables, ctx, rows), scale
        )
        print(f"contexts {context_lens}, {rows} rows, splits {splits}: {err:.1e} from the reference; per row "
              f"{(per_row - want).abs().max().item():.1e}")  # fmt: skip
        assert err < 1e-4
        if (
            len(context_lens) == 1
        ):  # the package's fused verify call runs on these inputs (its own checks: chapter 09)
            fused = fused_verify((q, k_cache.clone(), v_cache.clone(), tables, ctx), rows, scale)()
            assert fused.shape == q.shape and fused.isfinite().all()


def time_rows():
    print(torch.cuda.get_device_name(), flush=True)
    scale, layers = HEAD_DIM**-0.5, 36
    for context in (512, 1024, 4096):
        for rows in (1, 2, 4, 5):
            pools = [inputs([context], rows, torch.bfloat16, "cuda", seed=s) for s in range(layers)]
            per_row_args = [per_row_inputs(p[3], p[4], rows) for p in pools]
            mine = launches_us(lambda i: rows_attention(*pools[i], scale, rows), layers)
            theirs = launches_us(
                lambda i: paged_decode_attention(*pools[i][:3], *per_row_args[i], scale), layers
            )
            fused_calls = [fused_verify(p, rows, scale) for p in pools]
            fused = launches_us(lambda i: fused_calls[i](), layers)
            q, k_cache, v_cache, tables, ctx = pools[0]
            err = (
                (rows_attention(q, k_cache, v_cache, tables, ctx, scale, rows).float()
                 - paged_decode_attention(q, k_cache, v_cache, *per_row_args[0], scale).float()).abs().max().item()
            )  # fmt: skip
            print(
                f"context {context}, {rows} rows: rows {mine:5.1f} µs a layer, per row {theirs:5.1f} "
                f"({theirs / mine:.2f}x), the package's fused verify (store, norm and rotation inside) {fused:5.1f}; "
                f"max difference rows / per row {err:.1e}",
                flush=True,
            )
            pools = per_row_args = fused_calls = None  # (freed before the next shape)
            torch.cuda.empty_cache()


def profile():
    "One launch each inside an NVTX range `profile` (ncu's --nvtx-include), after warm-up launches on another pool."
    scale = HEAD_DIM**-0.5
    for rows, kind in ((1, "fused"), (4, "fused"), (5, "fused"), (5, "rows")):
        pools = [inputs([512], rows, torch.bfloat16, "cuda", seed=s) for s in range(2)]
        calls = [
            fused_verify(p, rows, scale)
            if kind == "fused"
            else lambda p=p: rows_attention(*p, scale, rows)
            for p in pools
        ]
        profiled_launch(*calls, f"{kind} {rows} rows, 512 keys")


if __name__ == "__main__":
    {"check": check, "time": time_rows, "profile": profile}[
        sys.argv[1] if len(sys.argv) > 1 else "time"
    ]()
