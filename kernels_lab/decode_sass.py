"""The paged decode attention kernel (chapter 09's `_decode_kernel`) compiled for an H200 without a GPU: instructions
and register spills (local-memory loads and stores, LDL / STL) for each setting worth comparing, Qwen3-4B's heads
(4 query heads a KV head, head_dim 128, 16-token blocks), q/k-norm + RoPE and the K/V store inside, splits merged by
the last program.

Why: a variant that spills pays a local-memory round trip per spilled value, which a latency-bound kernel (batch 1:
8-24 programs) cannot hide. The plain kernel: 2,272 instructions at 4 warps and 128-key tiles, none spilled;
the early tile (the first K and V tile held in registers across the wait for q) 4,096 with 76 spilling loads and
stores at 4 warps, none at 8, so the engine launches that variant with 8 warps. (A merge reading 8 splits at once,
commit 942e6c9, compiled here without spills but measured slower; the merge's loop unrolled instead, UNROLL_MERGE,
108 registers, as the loop.)

The verify kernel (`_verify_kernel`: a chunk of a sequence's verify rows a program): with 4 rows (a 16-row tile)
at 4 warps 142 registers with 32-key tiles, 158 with 64, 168 with 128, none spilled. With the step's K/V attended to
after the pool's keys (held in registers across the loop) it took 156 / 168 / 244. 8 rows (a 32-row tile) now compile
at 4 warps to 183-222 registers without spills, but the verify graph of 1 + 4 rows in one such tile was slower on an
H100 (1.277x a decode step against 1.143x in chunks of 4), hence chunks of 4.

Run anywhere from the repository root (no GPU needed; the interpreter must be off):
    TRITON_INTERPRET=0 PYTHONPATH=. python3 kernels_lab/decode_sass.py"""

import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from gemv_sass import kernel_sass  # noqa: E402

from forge_engine.kernels.paged_attention import (  # noqa: E402
    DECODE_SEQUENCE_ROWS,
    _decode_kernel,
    _verify_kernel,
)

POINTERS = dict(
    q_ptr="*bf16",
    k_ptr="*bf16",
    v_ptr="*bf16",
    tables_ptr="*i32",
    context_lens_ptr="*i32",
    out_ptr="*bf16",
    part_acc_ptr="*fp32",
    part_m_ptr="*fp32",
    part_l_ptr="*fp32",
    count_ptr="*i32",
    new_k_ptr="*bf16",
    new_v_ptr="*bf16",
    slots_ptr="*i64",
    q_norm_ptr="*bf16",
    k_norm_ptr="*bf16",
    cos_ptr="*bf16",
    sin_ptr="*bf16",
)
INTS = (
    "stride_qb stride_qh stride_ob stride_oh stride_tb stride_kb stride_kt stride_kh stride_nkb stride_nkh "
    "stride_nvb stride_nvh stride_cos"
).split()
SCALARS = dict(eps="fp32", qk_scale="fp32", num_q_heads="i32", split_len="i32", num_splits="i32")
ALIGNED = (
    *POINTERS,
    "stride_qb",
    "stride_qh",
    "stride_ob",
    "stride_oh",
    "stride_kb",
    "stride_kt",
    "stride_kh",
)


# what both kernels take at Qwen3-4B's attention on an H200 (dependent launch available)
QWEN3_4B = dict(
    GROUP=4,
    HEAD_DIM=128,
    BLOCK_D=128,
    BLOCK_SIZE=16,
    SPLIT=True,
    UPCAST=False,
    PRECISION="tf32",
    PDL=True,
    WAIT=False,
    ROPE=True,
    QK_NORM=True,
    FENCE=True,
)


def compiled(kernel, constexprs: dict, num_warps: int) -> tuple[list[str], int]:
    "`kernel` compiled for sm_90 with `constexprs`, the rest of its arguments as the launchers pass them."
    types = {**POINTERS, **{name: "i32" for name in INTS}, **SCALARS, "num_rows": "i32"}
    signature = {
        name: "constexpr" if name in constexprs else types[name] for name in kernel.arg_names
    }
    code, registers = kernel_sass(kernel, signature, constexprs, num_warps, ALIGNED)
    return [text for _, text in code], registers


def decode_sass(
    early: bool, num_warps: int, block_n: int, unroll: int = 0
) -> tuple[list[str], int]:
    """The kernel as the engine launches it at batch 1, but for the settings; `unroll`: the merge's loop unrolled over
    that many splits (UNROLL_MERGE; 0: a loop)."""
    constexprs = dict(
        QWEN3_4B,
        BLOCK_G=16,
        BLOCK_N=block_n,
        STORE=True,
        MERGE=True,
        EARLY_TILE=early,
        WAIT_LATE=early,
        UNROLL_MERGE=unroll,
    )
    return compiled(_decode_kernel, constexprs, num_warps)


def verify_sass(num_warps: int, block_n: int, chunk: int = 4) -> tuple[list[str], int]:
    """The verify kernel (`_verify_kernel`) as the engine launches it for a verify step of more than 4 rows: a chunk of
    `chunk` rows of a sequence (Qwen3-4B: 4 of 4 query heads fill the 16-row tile), launched as a dependent (PDL)
    that waits for the projection before it only after its scans of the step's rows."""
    constexprs = dict(
        QWEN3_4B,
        SEQUENCE_ROWS=DECODE_SEQUENCE_ROWS,
        CHUNK=chunk,
        STEP_KEYS=max(16, DECODE_SEQUENCE_ROWS),
        BLOCK_G=max(16, 4 * chunk),
        BLOCK_N=block_n,
        UNROLL_MERGE=16,
    )
    return compiled(_verify_kernel, constexprs, num_warps)


def spills(code: list[str]) -> int:
    "Local-memory loads and stores (LDL / STL) in `code`."
    return sum(
        text.split()[1 if text.startswith("@") else 0].split(".")[0] in ("LDL", "STL")
        for text in code
    )


def main():
    print(
        "early tile  warps  tile  merge unrolled  instructions  registers  spilling loads/stores (LDL/STL)"
    )
    settings = [(*s, 0) for s in itertools.product((False, True), (4, 8), (64, 128))]
    for early, num_warps, block_n, unroll in settings + [
        (True, 8, 64, 8),
        (True, 8, 64, 16),
    ]:  # (W1's: 8 splits)
        code, registers = decode_sass(early, num_warps, block_n, unroll)
        print(
            f"{early!s:10s}  {num_warps:5d}  {block_n:4d}  {unroll:14d}  {len(code):12d}  {registers:9d}  "
            f"{spills(code):6d}"
        )
    print(
        "\nverify kernel: rows a program  warps  tile  instructions  registers  spilling loads/stores"
    )
    for chunk, num_warps, block_n in ((4, 4, 16), (4, 4, 64), (4, 4, 128), (8, 4, 64), (8, 8, 64)):
        code, registers = verify_sass(num_warps, block_n, chunk)
        print(
            f"{chunk:30d}  {num_warps:5d}  {block_n:4d}  {len(code):12d}  {registers:9d}  {spills(code):6d}"
        )


if __name__ == "__main__":
    main()
