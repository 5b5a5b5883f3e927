"""rows_matmul's tiles per Qwen3-4B matrix (16 rows, or LAB_ROWS): does each matrix want its own tile and split?

Why: at 16 sequences the int8 tile reads gate-up's weights at 2.16 TB/s but qkv's at 1.34, down's at 1.55 and o's at
0.94 (H100, `rows_matmul_imma.py time`): one tile and one rule for the programs serve the long matrix and leave the
short ones to their fixed costs. With the int8 tile (32 rows of weights, 128 inputs a step) at eight programs an SM,
o (2,560 x 4,096) is 80 tiles split 13 ways: each program takes two or three steps of 4 KB, then its partials, its
ticket and, for the last, the sum. Were qkv, o and down read as fast as gate-up, a layer's four matmuls would take
49 µs instead of 66, and the 16-sequence step of Q8_0 planes about 2.2 ms instead of 2.86 (3x llama.cpp's S_TG on
that H100 needs 2.29).

Here each matrix (gate-up with its SwiGLU fold, as the step runs it) through `rows_matmul` with each tile of a grid
(BLOCK_N, BLOCK_K, warps, stages: narrower tiles give a short matrix more tiles and fewer splits, longer steps fewer
steps a split) and each number of programs an SM (the split follows: programs // tiles), on random Q8_0 planes (int8,
a scale a group of 32) and random Q4_K planes (int4 pairs, a scale and a minimum a group of 32); each timing one CUDA
graph of 50 launches over enough copies of the weights to miss L2 (`common.launches_us`). Printed: µs and weights read
a second per setting, each matrix's best against the export, and a layer's four matmuls both ways.

Checked under the interpreter (every tile of the grid against `dequantized_groups`' product, small shapes):
    TRITON_INTERPRET=1 PYTHONPATH=. python3 kernels_lab/rows_matmul_shapes.py check
Compiled for sm_90 offline (registers and spills of each tile, then the export's tile with each matrix's folds; none
spill): plain, with the norm (qkv), the residual and hand-off (o, down), the norm and SwiGLU pair (gate-up): BF16 80,
96, 80, 124 registers; int8 122, 126, 126, 168; int4 79, 79, 95, 128:
    TRITON_INTERPRET=0 PYTHONPATH=. python3 kernels_lab/rows_matmul_shapes.py sass
On a GPU (LAB_KINDS=int8,int4 by default, LAB_TILES="BN/BK/W/ST,..." and LAB_PER_SM="4,6" in place of the grid; SPLIT
is a constexpr, so each split compiles a kernel of its own: one kind a device call): LAB_KINDS=int8 PYTHONPATH=.
python3 kernels_lab/rows_matmul_shapes.py [time]
LAB_KINDS=bf16 LAB_ROWS=5: the verify step's matmuls (1 + 4 rows of BF16 weights, chapter 08c) in the same grid, each
matrix also through the one-row GEMV of a decode step on the same weights: where a verify step's excess over a decode
step lies, matrix by matrix, and at what share of the card's bandwidth each reads (on an H200 the decode step is
shorter and a latency-bound tile's excess a larger share of it). On one H100, each matrix alone (µs, weights read a
second), as exported at 5 rows against the one-row GEMV: qkv 16.1 (1.96 TB/s) against 11.6 (2.72), o 13.3 (1.57)
against 7.9 (2.65), gate-up 35.7 (2.79) against 33.1 (3.01), down 23.0 (2.16) against 18.2 (2.74): a layer's four
88.2 µs against 70.8, the short matrices 14.7 of the 17.4 more. The best of 16/128/2/3, 32/64/2/4, 32/128/4/3 and
16/128/1/3 at four or eight an SM: qkv 14.2 (16/128/2/3, four), o 12.9 (32/64/2/4, four), gate-up the export, down
22.6 (32/128/4/3, four): 85.5 µs, no tile near the GEMV on a short matrix.
In the hardware's counters (each matrix's exported launch once, under Nsight Compute, as ncu_gemv.py does):
    ncu --clock-control none --nvtx --nvtx-include "profile/" --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats \\
        python3 kernels_lab/rows_matmul_shapes.py profile
On one H100 so (int8, one launch each, caches flushed): qkv 13.4 µs at 38% of DRAM's bandwidth, o 12.1 at 28%,
gate-up 33.9 at 49%, down 16.8 at 49%; 118-122 registers (gate-up with its SwiGLU pair 168), so 8 programs fit an SM
(gate-up 6: its 912 programs are 1.15 waves); 2.7-3.7 warps active a scheduler, 0.5 eligible, each issuing every
8-10 cycles, about half of that waiting on global loads: latency-bound, not short of issue slots or bandwidth.

On one H100, int8 (each matrix alone, its weights past L2): as exported qkv 12.6 µs (1.33 TB/s), o 11.9 (0.93),
gate-up 33.2 (1.59), down 17.3 (1.53); the best of the grid qkv 12.6 (the export), o 11.7 (32/128/2/3 at four an SM),
gate-up 30.1 (the same), down 17.2 (the export): a layer's four matmuls 75.1 µs against 71.6, 0.13 ms a 36-layer
step. No tile or split of its own pays for a short matrix: what it loses is the launch's ramp and tail, not the tile.
Kept: one int8 tile for every matrix, and gate-up's SwiGLU launch aimed at six programs an SM so that it fits one wave
(chapter 09_kernels_rows_matmul's ROWS_MATMUL_INT8_SWIGLU_PROGRAMS). Four warps to a tile (76 registers against 122,
each weight converted twice: two warps share a row of A) lost on another H100 (LAB_KINDS=int8
LAB_TILES=32/128/2/3,32/128/4/3,32/128/4/4,64/128/8/3 LAB_PER_SM=4,6,8): qkv 13.6-15.1 µs against 12.1-13.6 for the
exported tile at the same programs, o 11.3-12.5 against 11.1-11.8, gate-up 33.5-38.1 against 29.6-32.4, down
18.1-20.4 against 17.0-18.1; 64/128/8/3 0.7-1.1 TB/s."""

import os
import sys

import torch

from common import launches_us, profiled_launch
from rows_matmul_imma import GROUP, ROWS, SHAPES
from rows_matmul_imma import planes as q8_0_planes
import forge_engine.kernels.rows_matmul as rows_module
from forge_engine.kernels.gemv import gemv
from forge_engine.kernels.rows_matmul import dequantized_groups, rows_matmul

TILES = {  # (BLOCK_N, BLOCK_K, warps, stages); the export's first
    "bf16": ((32, 128, 2, 3), (32, 128, 1, 3), (32, 128, 4, 3), (16, 128, 2, 3), (64, 128, 2, 3), (32, 64, 2, 4)),
    "int8": ((32, 128, 2, 3), (16, 128, 1, 3), (16, 256, 1, 3), (32, 256, 2, 3), (32, 128, 2, 4), (64, 128, 4, 3)),
    "int4": ((64, 128, 4, 3), (32, 128, 2, 3), (32, 256, 2, 3), (64, 256, 4, 3), (16, 256, 1, 3), (128, 128, 4, 3)),
}  # fmt: skip
PER_SM = (4, 8, 12)
if os.environ.get(
    "LAB_TILES"
):  # "BN/BK/W/ST,...": these tiles of the kinds in LAB_KINDS in place of the grid
    TILES = {
        kind: tuple(tuple(map(int, t.split("/"))) for t in os.environ["LAB_TILES"].split(","))
        for kind in TILES
    }
if os.environ.get("LAB_PER_SM"):  # "4,6": these programs an SM in place of PER_SM
    PER_SM = tuple(map(int, os.environ["LAB_PER_SM"].split(",")))
TIMED_ROWS = int(
    os.environ.get("LAB_ROWS", ROWS)
)  # rows of x timed (5: a verify step of 1 + 4 rows)


def planes(kind: str, n: int, k: int, device, gen=None):
    """Random weights as chapter 10g repacks them: int8 [n, k] or int4 pairs uint8 [n, k / 2]; or BF16 [n, k]
    (weight, scale, minimum)."""
    if kind == "bf16":
        return (torch.randn(n, k, generator=gen) / k**0.5).bfloat16().to(device), None, None
    if kind == "int8":
        return (*q8_0_planes(n, k, device, gen), None)
    s = ((torch.rand(n, k // GROUP, generator=gen) + 0.5) / (127 * k**0.5)).half()
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    return w.to(device), (s * 17).to(device), (-8.0 * s * 17).half().to(device)


def run(x, weight, scale, minimum, tile, split=None, swiglu=False):
    "rows_matmul with its tile set to `tile` for this launch (the module's constant, restored after)."
    name = "ROWS_MATMUL_INT4_TILE" if minimum is not None else "ROWS_MATMUL_TILE"
    exported = getattr(rows_module, name)
    setattr(rows_module, name, tile)
    try:
        return rows_matmul(x, weight, scale=scale, minimum=minimum, split=split, swiglu=swiglu)
    finally:
        setattr(rows_module, name, exported)


def reference(x, weight, scale, minimum, swiglu=False):
    dense = (
        weight.float()
        if scale is None
        else dequantized_groups(weight, scale, torch.float32, minimum)
    )
    y = x.float() @ dense.T
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
    return y


def check():
    gen = torch.Generator().manual_seed(3)
    for kind, tiles in TILES.items():
        for tile in tiles:
            for m, n, k, split, swiglu in ((16, 96, 512, 2, False), (5, 64, 256, None, True)):
                x = torch.randn(m, k, generator=gen).bfloat16()
                w = planes(kind, n, k, "cpu", gen)
                got = run(x, *w, tile, split, swiglu).float()
                want = reference(x, *w, swiglu)
                err = ((got - want).abs().max() / want.abs().max()).item()
                print(f"{kind} {tile} {m}x{k} @ {n} split {split} swiglu {swiglu}: {err:.1e}")
                assert err < 4e-2, (kind, tile, err)


def sass():
    sys.path.insert(0, os.path.dirname(__file__))
    from gemv_sass import kernel_sass

    pointers = ["x_ptr", "w_ptr", "scale_ptr", "min_ptr", "b_ptr", "partials_ptr", "tickets_ptr", "out_ptr",
                "res_ptr", "in_sums_ptr", "out_sums_ptr", "next_g_ptr", "normed_ptr"]  # fmt: skip
    scalars = [
        "M",
        "OUT_N",
        "K",
        "k_per_split",
        "stride_xm",
        "stride_wn",
        "stride_sn",
        "stride_sg",
        "stride_rm",
    ]
    for kind, tiles in TILES.items():
        signature = {**{p: "*bf16" for p in pointers}, **{s: "i32" for s in scalars}, "eps": "fp32",
                     "w_ptr": {"int8": "*i8", "int4": "*u8", "bf16": "*bf16"}[kind], "scale_ptr": "*fp16",
                     "min_ptr": "*fp16", "partials_ptr": "*fp32", "tickets_ptr": "*i32", "in_sums_ptr": "*fp32",
                     "out_sums_ptr": "*fp32"}  # fmt: skip
        # each tile without folds, then the export's (the first) with each matrix's folds as a layer runs them
        folds = {"qkv (norm)": dict(NORM_SUMS=True),
                 "o / down (residual, hand-off)": dict(RESIDUAL=True, HAND_OFF=True),
                 "gate-up (norm, SwiGLU)": dict(NORM_SUMS=True, SWIGLU=True)}  # fmt: skip
        settings = [(tile, "", {}) for tile in tiles] + [
            (tiles[0], f", {n}", f) for n, f in folds.items()
        ]
        for (block_n, block_k, warps, stages), label, fold in settings:
            flags = dict(BLOCK_N=block_n, BLOCK_K=block_k, ROWS=ROWS, SPLIT=4, EVEN_K=True, HAS_BIAS=False,
                         SWIGLU=False, RESIDUAL=False, NORM_SUMS=False, HAND_OFF=False,
                         GROUP=0 if kind == "bf16" else GROUP,
                         INT4=kind == "int4", BYTE_ASM=True, UPCAST=False, PDL=True)  # fmt: skip
            code, registers = kernel_sass(
                rows_module._rows_matmul_kernel, signature, {**flags, **fold}, warps, num_stages=stages,
                aligned=("x_ptr", "w_ptr", "partials_ptr", "out_ptr", "stride_xm", "stride_wn", "K", "k_per_split"),
            )  # fmt: skip
            spills = sum(("STL" in text) or ("LDL" in text) for _, text in code)
            print(f"{kind} {block_n}/{block_k}/{warps}/{stages}{label}: {len(code)} instructions, {registers} "
                  f"registers, {spills} spilled loads / stores")  # fmt: skip


def time_shapes():
    device = "cuda"
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    print(torch.cuda.get_device_name(), flush=True)
    for kind in os.environ.get("LAB_KINDS", "int8,int4").split(","):
        best_sum = export_sum = 0.0
        for name, (n, k) in SHAPES.items():
            swiglu = name == "gate_up"
            bytes_read = (
                n * k * {"int8": 1, "int4": 0.5, "bf16": 2}[kind]
                + n
                * k
                // GROUP
                * {
                    "int8": 2,
                    "int4": 4,
                    "bf16": 0,
                }[kind]
            )
            copies = max(2, int(400e6 // bytes_read))  # 400 MB of weights: past L2
            weights = [planes(kind, n, k, device) for _ in range(copies)]
            x = torch.randn(TIMED_ROWS, k, device=device).bfloat16()
            export = launches_us(
                lambda i: rows_matmul(x, weights[i % copies][0], scale=weights[i % copies][1],
                                      minimum=weights[i % copies][2], swiglu=swiglu), 50)  # fmt: skip
            line, best = (
                f"{kind} {name} {n}x{k}, {TIMED_ROWS} rows: export {export:6.1f} µs "
                f"({bytes_read / export / 1e6:.2f} TB/s)",
                (export, "export"),
            )
            if kind == "bf16":  # the one-row GEMV of a decode step, on the same weights
                one = launches_us(lambda i: gemv(x[:1], weights[i % copies][0], swiglu=swiglu), 50)
                line += (
                    f"; 1 row through the GEMV {one:6.1f} µs ({bytes_read / one / 1e6:.2f} TB/s)"
                )
            for tile in TILES[kind]:
                steps, tiles = -(-k // tile[1]), -(-(n // 2 if swiglu else n) // tile[0])
                line += f"\n  {'/'.join(map(str, tile))}"
                for per_sm in PER_SM:
                    split = max(1, min(steps, per_sm * sms // tiles))
                    try:
                        us = launches_us(
                            lambda i: run(x, *weights[i % copies], tile, split, swiglu), 50
                        )
                    except Exception as e:  # a tile that does not compile is reported, not fatal
                        line += f"; {per_sm} an SM failed: {type(e).__name__}"
                        continue
                    line += f"; {per_sm} an SM (split {split}) {us:6.1f} µs ({bytes_read / us / 1e6:.2f} TB/s)"
                    best = min(best, (us, f"{'/'.join(map(str, tile))} at {per_sm} an SM"))
            print(line + f"\n  best: {best[1]} {best[0]:.1f} µs", flush=True)
            best_sum, export_sum = best_sum + best[0], export_sum + export
            weights = None  # (freed before the next shape)
            torch.cuda.empty_cache()
        print(f"{kind}: a layer's four matmuls {export_sum:.1f} µs as exported, {best_sum:.1f} each in its best "
              f"(x 36 layers: {36 * (export_sum - best_sum) / 1e3:.2f} ms a step)", flush=True)  # fmt: skip


def profile():
    """Each matrix's exported launch at TIMED_ROWS rows, once inside an NVTX range `profile` (what ncu's --nvtx-include
    takes); BF16 weights also through the one-row GEMV of a decode step."""
    for kind in os.environ.get("LAB_KINDS", "int8,int4").split(","):
        for name, (n, k) in SHAPES.items():
            swiglu = name == "gate_up"
            weights = [
                planes(kind, n, k, "cuda") for _ in range(2)
            ]  # warmed on one, profiled on the other
            x = torch.randn(TIMED_ROWS, k, device="cuda").bfloat16()
            launch = [
                lambda w=w: rows_matmul(x, w[0], scale=w[1], minimum=w[2], swiglu=swiglu)
                for w in weights
            ]
            profiled_launch(*launch, f"{kind} {name} {n}x{k}, {TIMED_ROWS} rows")
            if kind == "bf16":
                one = [lambda w=w: gemv(x[:1], w[0], swiglu=swiglu) for w in weights]
                profiled_launch(*one, f"{kind} {name} {n}x{k}, 1 row through the GEMV")


if __name__ == "__main__":
    {"check": check, "sass": sass, "time": time_shapes, "profile": profile}[
        sys.argv[1] if len(sys.argv) > 1 else "time"
    ]()
