"""Instructions per weight in the GEMV loops (chapter 09's bf16/int8, chapter 10's int4), without a GPU: each compiled
for an H200 (sm_90) by Triton's own compiler and ptxas, the loop's machine code (SASS) read back with cuobjdump, its
instructions counted.

Napkin math: at one row a GEMV does one multiply-add per weight. An H200 SM issues 4 warp instructions a cycle
(128 lanes) and receives about 16 bytes a cycle at 4.19 TB/s (132 SMs at 1.98 GHz): int8 weights leave about
8 instructions per weight for everything, bf16 about 16. Counting what the loop spends shows which of its parts
(the conversion to float, layout shuffles through shared memory) is worth removing.

Run anywhere from the repository root (no GPU needed; the interpreter must be off):
    TRITON_INTERPRET=0 PYTHONPATH=. python3 kernels_lab/gemv_sass.py"""

import collections
import os
import re
import subprocess

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from forge_engine.kernels.gemv import _gemv_kernel, _gemv_rows_kernel
from forge_engine.quant.gemv import INT4_INT_DOT, _int4_gemv_kernel

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
FLAGS = (
    "EVEN_K",
    "HAS_SCALE",
    "HAS_BIAS",
    "PDL",
    "BYTE_ASM",
    "SWIGLU",
    "EARLY_W",
    "NORM",
    "RESIDUAL",
    "NORM_SUMS",
    "HAND_OFF",
)
GEMV_SIGNATURE = {
    "x_ptr": "*bf16",
    "w_ptr": "*bf16",
    "scale_ptr": "*fp32",
    "b_ptr": "*bf16",
    "g_ptr": "*bf16",
    "res_ptr": "*bf16",
    "out_ptr": "*bf16",
    "sums_ptr": "*fp32",
    "next_g_ptr": "*bf16",
    "normed_ptr": "*bf16",
    "M": "i32",
    "N": "i32",
    "K": "i32",
    "stride_xm": "i32",
    "stride_wn": "i32",
    "stride_rm": "i32",
    "stride_om": "i32",
    "eps": "fp32",
    **{name: "constexpr" for name in ("ROWS", "BLOCK_N", "BLOCK_K") + FLAGS},
}
INT4_SIGNATURE = {
    "x_ptr": "*bf16",
    "q_ptr": "*u8",
    "scale_ptr": "*fp16",
    "min_ptr": "*fp16",
    "out_ptr": "*bf16",
    "res_ptr": "*bf16",
    "sums_ptr": "*fp32",
    "next_g_ptr": "*bf16",
    "normed_ptr": "*bf16",
    "M": "i32",
    "N": "i32",
    "K": "i32",
    "stride_qn": "i32",
    "stride_rm": "i32",
    "eps": "fp32",
    **{
        name: "constexpr"
        for name in (
            "ROWS",
            "BLOCK_N",
            "GROUP",
            "CHUNK",
            "SLABS",
            "EVEN",
            "BYTE_ASM",
            "PDL",
            "SWIGLU",
            "EARLY_W",
            "RESIDUAL",
            "NORM_SUMS",
            "HAND_OFF",
            "EARLY_EPI",
            "INT_DOT",
            "PAIRED",
        )
    },
}
# what the launchers tell the compiler about real launches: pointers and row lengths divisible by 16
ALIGNED = (
    "x_ptr",
    "w_ptr",
    "q_ptr",
    "scale_ptr",
    "min_ptr",
    "b_ptr",
    "g_ptr",
    "res_ptr",
    "out_ptr",
    "N",
    "K",
    "stride_xm",
    "stride_wn",
    "stride_qn",
    "stride_om",
)


def kernel_sass(
    kernel,
    signature: dict,
    constexprs: dict,
    num_warps: int,
    aligned=ALIGNED,
    maxnreg: int | None = None,
    num_stages: int | None = None,
) -> tuple[list[tuple[int, str]], int]:
    """The kernel compiled for an H200 (sm_90) by Triton and ptxas: its machine code as (address, instruction), and its
    registers per thread. `aligned`: the arguments the launchers promise divisible by 16 (as real launches tell the
    compiler); `maxnreg`: a register cap for ptxas (what it cannot keep in registers spills to local memory: STL/LDL)."""
    names = list(signature)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned if a in signature}
    options = {"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    if num_stages is not None:
        options["num_stages"] = num_stages
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs, attrs),
        target=GPUTarget("cuda", 90, 32),
        options=options,
    )
    path = f"/tmp/kernel_sass_{os.getpid()}.cubin"
    with open(path, "wb") as f:
        f.write(compiled.asm["cubin"])
    sass = subprocess.run(
        [CUOBJDUMP, "-sass", path], capture_output=True, text=True, check=True
    ).stdout
    usage = subprocess.run(
        [CUOBJDUMP, "-res-usage", path], capture_output=True, text=True, check=True
    ).stdout
    os.remove(path)
    code = [
        (int(a, 16), text.strip())
        for a, text in re.findall(r"/\*([0-9a-f]{4})\*/\s+([^;]+);", sass)
    ]
    return code, int(re.search(r"REG:(\d+)", usage).group(1))


def loop_sass(
    kernel,
    signature: dict,
    constexprs: dict,
    num_warps: int,
    maxnreg: int | None = None,
    num_stages: int | None = None,
    aligned=ALIGNED,
) -> tuple[list[str], int]:
    "The instructions of the kernel's innermost loop (between the loop's backward branch and its target), and registers."
    code, registers = kernel_sass(
        kernel, signature, constexprs, num_warps, aligned, maxnreg=maxnreg, num_stages=num_stages
    )
    for address, text in code:  # the first backward branch closes the loop
        target = re.search(r"BRA (0x[0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address:
            return [t for a, t in code if int(target.group(1), 16) <= a <= address], registers
    raise RuntimeError("no loop found in the compiled kernel")


def resident_warps(registers: int, num_warps: int) -> int:
    """Warps an H200 SM keeps resident for a kernel of `registers` a thread: 64K registers handed out per warp in units
    of 256, at most 64 warps and 32 programs an SM (shared memory is not the limit for these kernels)."""
    per_warp = -(-registers * 32 // 256) * 256
    programs = min(65536 // (per_warp * num_warps), 64 // num_warps, 32)
    return programs * num_warps


def gemv_loop(
    weight: str,
    block_n: int,
    block_k: int,
    num_warps: int,
    byte_asm: bool,
    swiglu: bool = False,
    maxnreg: int | None = None,
    early: bool = False,
    norm: bool = False,
    hand_off: bool = False,
) -> tuple[list[str], float, int]:
    """chapter 09's GEMV (bf16 or int8 weights) at one row: its loop, the weights each thread handles per step, and
    registers a thread. `swiglu`: the gate-up GEMV with SiLU-mul in its epilogue (its loop should be the plain one's);
    `norm`: an RMSNorm folded in (x times the norm weight, its squares summed, in the loop); `hand_off`: the residual
    added and the next norm handed off in the epilogue (chapter 03's o / down GEMVs at batch 1, int8)."""
    flags = dict(
        EVEN_K=True,
        HAS_SCALE=weight == "*i8",
        HAS_BIAS=False,
        PDL=True,
        BYTE_ASM=byte_asm,
        SWIGLU=swiglu,
        EARLY_W=early,
        NORM=norm,
        RESIDUAL=hand_off,
        NORM_SUMS=False,
        HAND_OFF=hand_off,
    )
    body, registers = loop_sass(
        _gemv_kernel,
        dict(GEMV_SIGNATURE, w_ptr=weight),
        dict(ROWS=1, BLOCK_N=block_n, BLOCK_K=block_k, **flags),
        num_warps,
        maxnreg,
    )
    return body, block_n * block_k / (32 * num_warps), registers


ROWS_SIGNATURE = {
    **{
        name: t
        for name, t in GEMV_SIGNATURE.items()
        if name not in ("M", "ROWS", "BLOCK_K", "EVEN_K")
    },
    **{name: "constexpr" for name in ("ROWS", "CHUNK", "SLABS", "EVEN")},
}


def rows_loop(
    rows: int, block_n: int, num_warps: int, chunk: int, norm: bool = False, norm_sums: bool = False
) -> tuple[list[str], float, int]:
    """chapter 09's rows-layout GEMV (bf16 weights) at `rows` rows of x, whole steps, early weights: its loop, the
    weights each thread handles per step, registers a thread. `norm`: an RMSNorm folded into the loop; `norm_sums`:
    one handed in (nothing in the loop)."""
    flags = dict(
        EVEN=True,
        HAS_SCALE=False,
        HAS_BIAS=False,
        PDL=True,
        BYTE_ASM=True,
        SWIGLU=False,
        EARLY_W=True,
        NORM=norm,
        RESIDUAL=False,
        NORM_SUMS=norm_sums,
        HAND_OFF=False,
    )
    body, registers = loop_sass(
        _gemv_rows_kernel,
        ROWS_SIGNATURE,
        dict(ROWS=rows, BLOCK_N=block_n, CHUNK=chunk, SLABS=num_warps, **flags),
        num_warps,
    )
    return body, block_n * chunk, registers


def int4_loop(
    block_n: int,
    num_warps: int,
    chunk: int,
    byte_asm: bool,
    group: int = 128,
    maxnreg: int | None = None,
    early: bool = False,
    int_dot: bool | None = None,
) -> tuple[list[str], float, int]:
    """chapter 10's int4 GEMV at one row, whole steps (no masks): BLOCK_N rows a program, each thread `chunk` bytes of
    each; `int_dot`: its arithmetic in integers or FP32 (default: the export's INT4_INT_DOT)."""
    body, registers = loop_sass(
        _int4_gemv_kernel,
        INT4_SIGNATURE,
        dict(
            ROWS=1,
            BLOCK_N=block_n,
            GROUP=group,
            CHUNK=chunk,
            SLABS=num_warps,
            EVEN=True,
            BYTE_ASM=byte_asm,
            PDL=True,
            SWIGLU=False,
            EARLY_W=early,
            RESIDUAL=False,
            NORM_SUMS=False,
            HAND_OFF=False,
            EARLY_EPI=True,
            INT_DOT=INT4_INT_DOT if int_dot is None else int_dot,
            PAIRED=True,
        ),
        num_warps,
        maxnreg,
    )
    return body, block_n * chunk * 2, registers


def main():
    print(
        f"{'weights':11s} {'tile':>12s} warps byte_asm maxnreg  instr/weight  regs  warps/SM  KB/SM  "
        f"(most frequent in the loop)"
    )
    bf16, int8 = dict(weight="*bf16", byte_asm=False), dict(weight="*i8", byte_asm=True)
    cases = [
        ("bf16", dict(bf16, block_n=8, block_k=512, num_warps=4)),
        ("bf16", dict(bf16, block_n=4, block_k=512, num_warps=4)),
        ("int8", dict(int8, block_n=8, block_k=512, num_warps=2, byte_asm=False)),
        ("int8", dict(int8, block_n=8, block_k=512, num_warps=2)),
        ("int8", dict(int8, block_n=4, block_k=1024, num_warps=4)),
        ("int8", dict(int8, block_n=4, block_k=2048, num_warps=4)),
        ("int4", dict(block_n=4, num_warps=2, chunk=8, byte_asm=False)),
        ("int4", dict(block_n=4, num_warps=2, chunk=8, byte_asm=True)),
        ("int4", dict(block_n=4, num_warps=1, chunk=8, byte_asm=True)),
        ("int4", dict(block_n=4, num_warps=4, chunk=16, byte_asm=True)),
        ("int4", dict(block_n=8, num_warps=2, chunk=8, byte_asm=True)),
        ("int4", dict(block_n=4, num_warps=2, chunk=8, byte_asm=True, early=True)),
        ("int4", dict(block_n=4, num_warps=4, chunk=16, byte_asm=True, early=True)),
        # gate-up with SiLU-mul in the epilogue (`swiglu`): rows of the gate and the up half in one tile
        ("bf16 swiglu", dict(bf16, block_n=4, block_k=512, num_warps=4, swiglu=True)),
        ("int8 swiglu", dict(int8, block_n=8, block_k=512, num_warps=2, swiglu=True)),
        # the first step's weights asked for before the wait (`early_weights`): the loop should be unchanged
        ("bf16 early", dict(bf16, block_n=2, block_k=1024, num_warps=4, early=True)),
        ("int8 early", dict(int8, block_n=4, block_k=2048, num_warps=4, early=True)),
        # an RMSNorm folded in (`norm`): qkv's tile, early, with and without
        ("bf16 early", dict(bf16, block_n=8, block_k=512, num_warps=4, early=True)),
        ("bf16 norm", dict(bf16, block_n=8, block_k=512, num_warps=4, early=True, norm=True)),
        ("int8 norm", dict(int8, block_n=4, block_k=1024, num_warps=4, early=True, norm=True)),
        # int4's exported tiles with a register cap: more warps resident, and what spills (STL/LDL in the loop)
        *[
            ("int4", dict(block_n=bn, num_warps=w, chunk=c, byte_asm=True, maxnreg=cap))
            for bn, w, c in ((4, 2, 8), (4, 4, 16))
            for cap in (56, 48)
        ],
    ]
    cases += [  # the rows layout at several rows of x (a verify step's), the norm folded in or handed in
        (f"rows x{rows}", dict(rows=rows, block_n=bn, num_warps=1, chunk=8, norm=norm))
        for rows, bn, norm in (
            (1, 4, False),
            (1, 4, True),
            (2, 4, False),
            (5, 4, False),
            (5, 4, True),
            (5, 8, False),
        )
    ]
    for label, case in cases:
        loop = (
            int4_loop if label == "int4" else rows_loop if label.startswith("rows") else gemv_loop
        )
        body, per_thread, registers = loop(**case)
        warps = resident_warps(registers, case["num_warps"])
        # every resident warp with one step's weights requested: the bytes an SM can have on their way from memory
        in_flight = (
            warps
            * 32
            * per_thread
            * {"*bf16": 2, "*i8": 1}.get(case.get("weight", label[:4] == "rows" and "*bf16"), 0.5)
            / 1024
        )
        ops = collections.Counter(
            t.split()[1 if t.startswith("@") else 0].split(".")[0] for t in body
        )
        top = ", ".join(f"{op} {n}" for op, n in ops.most_common(6))
        tile = f"{case['block_n']:4d} x {case.get('block_k', str(case.get('chunk')) + 'B'):>5}"
        print(
            f"{label:11s} {tile} {case['num_warps']:5d} {case.get('byte_asm', True)!s:8s} "
            f"{case.get('maxnreg') or '-':>7}  {len(body) / per_thread:6.2f} ({len(body):3d})"
            f"  {registers:4d}  {warps:8d}  {in_flight:5.1f}  {top}"
        )


if __name__ == "__main__":
    main()
