"""The GEMV loops and the attention kernels as compiled for an H200 (Triton and ptxas for sm_90; no GPU needed): what
the notebooks, run under the interpreter, cannot see. An int8 loop with early weights whose peeled first step has a layout of its own moves
every step's weight tile through shared memory; these keep such trips out of the loop.

The kernels are compiled in a fresh process with the interpreter off (CI sets TRITON_INTERPRET=1 for the rest)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def compiled_offline(script: str):
    "Run `script` in a fresh process with the interpreter off (it compiles for sm_90) -> the JSON of its last line."
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    run = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


CONFIGS = (
    ("*i8", 4, 1024, 4),
    ("*i8", 8, 512, 2),
    ("*i8", 4, 2048, 4),
    ("*bf16", 2, 1024, 4),
)  # int8 qkv, gate-up,
# o / down; bf16 o / down (gemv_config's tiles)
SCRIPT = f"""
import json, sys
sys.path.insert(0, "kernels_lab")
from gemv_sass import gemv_loop
loops = {{}}
for weight, block_n, block_k, warps in {CONFIGS!r}:
    for early in (False, True):
        body, _, registers = gemv_loop(weight, block_n, block_k, warps, True, early=early)
        shared = sum(any(op in text for op in ("BAR.", "STS", "LDS")) for text in body)
        loops[f"{{weight}} {{block_n}}x{{block_k}} early={{early}}"] = dict(shared=shared, instructions=len(body),
                                                                         registers=registers)
print(json.dumps(loops))
"""


def test_early_weights_leave_the_gemv_loop_as_it_was():
    loops = compiled_offline(SCRIPT)
    assert len(loops) == 2 * len(CONFIGS)
    for name, loop in loops.items():
        assert loop["shared"] == 0, f"{name}: the loop goes through shared memory ({loop})"
        if name.endswith(
            "early=True"
        ):  # the same loop as without: a few instructions of address setup at most
            plain = loops[name.replace("early=True", "early=False")]
            assert loop["registers"] <= plain["registers"] + 8, (name, loop, plain)
            assert loop["instructions"] <= plain["instructions"] + 16, (name, loop, plain)


HAND_OFF_SCRIPT = """
import json, sys
sys.path.insert(0, "kernels_lab")
from gemv_sass import gemv_loop
registers = {hand_off: gemv_loop("*i8", 4, 2048, 4, True, early=True, hand_off=hand_off)[2] for hand_off in (False, True)}
print(json.dumps(registers))
"""


def test_the_hand_off_epilogue_costs_the_int8_gemv_no_registers():
    """int8's o / down GEMV (gemv_config's (4, 2048, 4)) adding the residual and handing the next norm off: no more
    registers than without. Asked for before the loop, the epilogue's operands took 96 -> 113 registers
    a thread, fewer programs an SM, the decode step 1.579 -> 1.746 ms."""
    registers = compiled_offline(HAND_OFF_SCRIPT)
    assert registers["true"] <= registers["false"], registers


INT4_SCRIPT = """
import collections, json, sys
sys.path.insert(0, "kernels_lab")
from gemv_sass import int4_loop
from forge_engine.quant.gemv import quant_gemv_config
loads = {}
for n, k in ((6144, 2560), (19456, 2560), (2560, 4096), (2560, 9728)):  # Qwen3-4B's qkv, gate-up, o, down
    block_n, warps, chunk = quant_gemv_config(n, k)
    for int_dot in (True, False):
        body, _, _ = int4_loop(block_n=block_n, num_warps=warps, chunk=chunk, byte_asm=True, early=True, int_dot=int_dot)
        ops = collections.Counter(text.split()[1 if text.startswith("@") else 0] for text in body)
        loads[f"{block_n}x{warps}x{chunk} int_dot={int_dot}"] = dict(
            block_n=block_n, chunk=chunk, int_dot=int_dot, **{op: count for op, count in ops.items() if op.startswith("LDG")})
print(json.dumps(loads))
"""


def test_the_int4_gemv_loads_x_in_vectors():
    """Chapter 10's int4 GEMV at its exported tiles, in integers and in FP32: per step a thread loads x's two chunks
    (the low and the high nibbles' inputs) as 16-byte vectors; its only 4-byte loads are each row's group scale and
    minimum, side by side (`pair_scales`; stored apart they take two 2-byte loads). Without offsets known to be
    multiples of the chunk the one-warp tiles (the gate-up's) load x two bytes at a time: 16 loads a step instead of
    2. A row's chunk of weights comes in one vector (FP32) or in 8-byte words (integers: a 16-byte tile of words would
    be laid out over two threads and moved through shared memory every step)."""
    found = compiled_offline(INT4_SCRIPT)
    assert {loop["int_dot"] for loop in found.values()} == {True, False}, found
    for tile, loop in found.items():
        assert loop.get("LDG.E", 0) == loop["block_n"] and "LDG.E.U16" not in loop, (
            tile,
            loop,
        )  # a scale and its
        # minimum a row, side by side (`pair_scales`): one 4-byte load
        x_vectors = 2 * loop["chunk"] * 2 // 16  # x's two chunks of bf16 inputs, 16 bytes a load
        wide = loop["chunk"] == 16 and not loop["int_dot"]
        assert loop.get("LDG.E.128", 0) == x_vectors + (loop["block_n"] if wide else 0), (
            tile,
            loop,
        )
        assert loop.get("LDG.E.64", 0) == (0 if wide else loop["block_n"] * loop["chunk"] // 8), (
            tile,
            loop,
        )


CAPS_SCRIPT = """
import itertools, json, sys
sys.path.insert(0, "kernels_lab")
from gemv_sass import INT4_SIGNATURE, kernel_sass
from forge_engine.quant.gemv import INT4_TILE_EARLY_STEPS, INT4_TILE_MAXNREG, _int4_gemv_kernel
# what Qwen3-4B's batch-1 step asks of each tile besides the plain product: qkv the norm handed to it, o and down the
# residual added and the next norm handed off, the gate-up SiLU-mul and the norm handed to it (chapter 03)
STEP_FOLDS = {(4, 2, 8): dict(NORM_SUMS=True), (4, 4, 16): dict(RESIDUAL=True, HAND_OFF=True),
              (4, 2, 16): dict(RESIDUAL=True, HAND_OFF=True),
              (8, 1, 8): dict(SWIGLU=True, NORM_SUMS=True)}
found = {}
for tile in {key[:3] for key in [*INT4_TILE_MAXNREG, *INT4_TILE_EARLY_STEPS]}:
    block_n, warps, chunk = tile
    for int_dot, folds in itertools.product((True, False), ({}, {"SWIGLU": True}, STEP_FOLDS.get(tile, {}))):
        cap, early = INT4_TILE_MAXNREG.get((*tile, int_dot)), INT4_TILE_EARLY_STEPS.get((*tile, int_dot), 1)
        flags = dict(dict(ROWS=1, BLOCK_N=block_n, GROUP=128, CHUNK=chunk, SLABS=warps, EVEN=True, BYTE_ASM=True,
                          PDL=True, SWIGLU=False, EARLY_W=early, RESIDUAL=False,
                          NORM_SUMS=False, HAND_OFF=False, EARLY_EPI=True, INT_DOT=int_dot, PAIRED=True), **folds)
        code, registers = kernel_sass(_int4_gemv_kernel, INT4_SIGNATURE, flags, warps, maxnreg=cap)
        found[f"{block_n}x{warps}x{chunk} early={early} int_dot={int_dot} {sorted(folds)}"] = dict(
            cap=cap or 255, registers=registers, spills=sum(("STL" in text) or ("LDL" in text) for _, text in code))
print(json.dumps(found))
"""


def test_the_int4_tile_settings_spill_nothing():
    """Chapter 10's `INT4_TILE_MAXNREG` and `INT4_TILE_EARLY_STEPS`: each tile compiles (sm_90) with its early steps,
    in integers and in FP32, to at most its cap of registers with no spills to local memory (a cap that spilled would trade the extra resident
    warps for local loads and stores; early steps that spilled would hold their weights in local memory)."""
    found = compiled_offline(CAPS_SCRIPT)
    assert any("early=1" in tile for tile in found) and any(
        "early=1" not in tile for tile in found
    ), found
    for tile, compiled in found.items():
        assert compiled["registers"] <= compiled["cap"] and compiled["spills"] == 0, (
            tile,
            compiled,
        )


ROWS_SCRIPT = """
import json, sys
sys.path.insert(0, "kernels_lab")
from gemv_sass import rows_loop
loops = {}
for rows in (2, 5):
    body, weights, registers = rows_loop(rows, 4, 1, 8, norm_sums=True)
    ops = [text.split()[0].split(".")[0] for text in body]
    loops[rows] = dict(ffma=ops.count("FFMA"), fmul=ops.count("FMUL"), fadd=ops.count("FADD"),
                       converts=ops.count("SHF") + ops.count("LOP3") + ops.count("PRMT"), instructions=len(body),
                       shared=sum(any(op in text for op in ("BAR.", "STS", "LDS")) for text in body), weights=weights)
print(json.dumps(loops))
"""


def test_the_rows_gemv_loop_is_a_multiply_add_a_product():
    """Chapter 09's rows-layout GEMV (bf16, 4 weight rows a program, 8 inputs a thread) at 2 and 5 rows of x: one FFMA
    per weight and row (each thread's chunk a chain of multiply-adds, no separate multiply and add), each bf16 value
    of the weights and of x made a float by one instruction at most (`_bf16x2_to_f32`), nothing through shared
    memory, little else. Before the chains and the conversion, 5 rows took 10.0 instructions a weight; now 8.2. (One
    row keeps the loop the chain lab measured.)"""
    loops = compiled_offline(ROWS_SCRIPT)
    for rows, loop in loops.items():
        values = loop["weights"] + int(rows) * 8  # the weights' and each x row's chunk
        assert loop["shared"] == 0 and loop["fmul"] == loop["fadd"] == 0, (rows, loop)
        assert loop["ffma"] == int(rows) * loop["weights"], (rows, loop)
        assert loop["converts"] <= values, (rows, loop)
        assert loop["instructions"] - loop["ffma"] - loop["converts"] <= 40, (rows, loop)


ROWS_MATMUL_SCRIPT = """
import json, sys
sys.path.insert(0, "kernels_lab")
from gemv_sass import kernel_sass
from forge_engine.kernels.rows_matmul import ROWS_MATMUL_INT4_TILE, ROWS_MATMUL_TILE, _rows_matmul_kernel
pointers = ["x_ptr", "w_ptr", "scale_ptr", "min_ptr", "b_ptr", "partials_ptr", "tickets_ptr", "out_ptr", "res_ptr",
            "in_sums_ptr", "out_sums_ptr", "next_g_ptr", "normed_ptr"]
scalars = ["M", "OUT_N", "K", "k_per_split", "stride_xm", "stride_wn", "stride_sn", "stride_sg", "stride_rm"]
found = {}
for kind, weight, group in (("int8", "*i8", 32), ("int4", "*u8", 32), ("int4", "*u8", 128)):
    block_n, block_k, warps, stages = ROWS_MATMUL_INT4_TILE if kind == "int4" else ROWS_MATMUL_TILE
    signature = {**{p: "*bf16" for p in pointers}, **{s: "i32" for s in scalars}, "eps": "fp32",
                 "w_ptr": weight, "scale_ptr": "*fp16", "min_ptr": "*fp16", "partials_ptr": "*fp32",
                 "tickets_ptr": "*i32", "in_sums_ptr": "*fp32", "out_sums_ptr": "*fp32"}
    for swiglu in (False, True):
        flags = dict(BLOCK_N=block_n, BLOCK_K=block_k, ROWS=16, SPLIT=4, EVEN_K=True, HAS_BIAS=False, SWIGLU=swiglu,
                     RESIDUAL=not swiglu, NORM_SUMS=True, HAND_OFF=not swiglu, GROUP=group, INT4=kind == "int4",
                     BYTE_ASM=True, UPCAST=False, PDL=True)
        code, registers = kernel_sass(_rows_matmul_kernel, signature, flags, warps, num_stages=stages,
                                      aligned=("x_ptr", "w_ptr", "partials_ptr", "out_ptr", "stride_xm", "stride_wn",
                                               "K", "k_per_split"))
        found[f"{kind} group={group} swiglu={swiglu}"] = dict(
            registers=registers, spills=sum(("STL" in text) or ("LDL" in text) for _, text in code))
print(json.dumps(found))
"""


def test_the_rows_matmul_tiles_spill_nothing():
    """Chapter 09's `rows_matmul` on int8 groups (its BF16 tile) and on int4 pairs (`ROWS_MATMUL_INT4_TILE`, groups of
    32 as Q4_K repacks and 128 as `--quantization int4`), with SwiGLU (two accumulators) and with the residual and the
    hand-off, compiles for sm_90 with no spills to local memory: a tile that spilled would stream its weights through
    local loads and stores."""
    found = compiled_offline(ROWS_MATMUL_SCRIPT)
    assert len(found) == 6, found
    for case, compiled in found.items():
        assert compiled["spills"] == 0 and compiled["registers"] <= 255, (case, compiled)


ATTENTION_SCRIPT = """
import json, sys
sys.path.insert(0, "kernels_lab")
from decode_sass import decode_sass, spills, verify_sass
found = {"decode, early tile, 8 warps, 64-key tiles": spills(decode_sass(True, 8, 64, 8)[0])}
for block_n in (16, 64, 128):
    found[f"verify, 4 rows, 4 warps, {block_n}-key tiles"] = spills(verify_sass(4, block_n, 4)[0])
print(json.dumps(found))
"""


def test_the_attention_kernels_spill_nothing_as_launched():
    """Chapter 09's decode attention as batch 1 launches it (the early tile held across the wait for q, 8 warps) and
    its verify kernel as a verify step launches it for Qwen3-4B (a chunk of 4 rows, 16 query rows a tile, 4 warps) at
    each key tile the split rule picks, compile for sm_90 with no spills to local memory: a latency-bound kernel
    cannot hide a local round trip per spilled value (a verify tile of 8 rows with the step's K/V held across the
    pool's loop spilled at 4 warps)."""
    found = compiled_offline(ATTENTION_SCRIPT)
    assert len(found) == 4, found
    assert all(count == 0 for count in found.values()), found
