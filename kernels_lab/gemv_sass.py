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

from forge_engine.kernels import _gemv_kernel
from forge_engine.quant import _int4_gemv_kernel

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
FLAGS = ("EVEN_K", "HAS_SCALE", "HAS_BIAS", "PDL", "BYTE_ASM", "PREFETCH", "LOOP_STAGES", "SWIGLU")
GEMV_SIGNATURE = {"x_ptr": "*bf16", "w_ptr": "*bf16", "scale_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16",
                  "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_om": "i32",
                  **{name: "constexpr" for name in ("ROWS", "BLOCK_N", "BLOCK_K") + FLAGS}}
INT4_SIGNATURE = {"x_ptr": "*bf16", "q_ptr": "*u8", "scale_ptr": "*fp16", "min_ptr": "*fp16", "out_ptr": "*bf16",
                  "M": "i32", "N": "i32", "K": "i32", "stride_qn": "i32",
                  **{name: "constexpr" for name in ("ROWS", "BLOCK_N", "GROUPS", "GROUP", "BYTE_ASM", "PDL", "PREFETCH", "LOOP_STAGES")}}
# what the launchers tell the compiler about real launches: pointers and row lengths divisible by 16
ALIGNED = ("x_ptr", "w_ptr", "q_ptr", "scale_ptr", "min_ptr", "b_ptr", "out_ptr", "N", "K", "stride_xm", "stride_wn",
           "stride_qn", "stride_om")


def kernel_sass(kernel, signature: dict, constexprs: dict, num_warps: int, aligned=ALIGNED) -> list[tuple[int, str]]:
    """The kernel compiled for an H200 (sm_90) by Triton and ptxas: its machine code as (address, instruction).
    `aligned`: the arguments the launchers promise divisible by 16 (as real launches tell the compiler)."""
    names = list(signature)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned if a in signature}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps})
    path = f"/tmp/kernel_sass_{os.getpid()}.cubin"
    with open(path, "wb") as f: f.write(compiled.asm["cubin"])
    sass = subprocess.run([CUOBJDUMP, "-sass", path], capture_output=True, text=True, check=True).stdout
    os.remove(path)
    return [(int(a, 16), text.strip()) for a, text in re.findall(r"/\*([0-9a-f]{4})\*/\s+([^;]+);", sass)]


def loop_sass(kernel, signature: dict, constexprs: dict, num_warps: int) -> list[str]:
    "The instructions of the kernel's innermost loop (between the loop's backward branch and its target)."
    code = kernel_sass(kernel, signature, constexprs, num_warps)
    for address, text in code:  # the first backward branch closes the loop
        target = re.search(r"BRA (0x[0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address:
            return [t for a, t in code if int(target.group(1), 16) <= a <= address]
    raise RuntimeError("no loop found in the compiled kernel")


def gemv_loop(weight: str, block_n: int, block_k: int, num_warps: int, byte_asm: bool,
              stages: int = 1, swiglu: bool = False) -> tuple[list[str], float]:
    """chapter 09's GEMV (bf16 or int8 weights) at one row: its loop, and the weights each thread handles per step.
    `swiglu`: the gate-up GEMV with SiLU-mul in its epilogue (its loop should be the plain one's)."""
    flags = dict(EVEN_K=True, HAS_SCALE=weight == "*i8", HAS_BIAS=False, PDL=True, BYTE_ASM=byte_asm, PREFETCH=0,
                 LOOP_STAGES=stages, SWIGLU=swiglu)
    body = loop_sass(_gemv_kernel, dict(GEMV_SIGNATURE, w_ptr=weight),
                     dict(ROWS=1, BLOCK_N=block_n, BLOCK_K=block_k, **flags), num_warps)
    return body, block_n * block_k / (32 * num_warps)


def int4_loop(block_n: int, block_k: int, num_warps: int, byte_asm: bool, stages: int = 1,
              group: int = 128) -> tuple[list[str], float]:
    "chapter 10's int4 GEMV at one row (BLOCK_K in inputs: GROUPS = BLOCK_K / GROUP)."
    body = loop_sass(_int4_gemv_kernel, INT4_SIGNATURE,
                     dict(ROWS=1, BLOCK_N=block_n, GROUPS=block_k // group, GROUP=group, BYTE_ASM=byte_asm, PDL=True,
                          PREFETCH=0, LOOP_STAGES=stages), num_warps)
    return body, block_n * block_k / (32 * num_warps)


def main():
    print(f"{'weights':11s} {'tile':>14s} warps byte_asm stages  instructions/weight  (most frequent in the loop)")
    cases = [("bf16", gemv_loop, ("*bf16", 8, 512, 4, False)), ("bf16", gemv_loop, ("*bf16", 4, 512, 4, False)),
             ("int8", gemv_loop, ("*i8", 8, 512, 2, False)), ("int8", gemv_loop, ("*i8", 8, 512, 2, True)),
             ("int8", gemv_loop, ("*i8", 4, 1024, 4, True)), ("int8", gemv_loop, ("*i8", 4, 2048, 4, True)),
             ("int4", int4_loop, (8, 1024, 2, False)), ("int4", int4_loop, (8, 1024, 2, True)),
             ("int4", int4_loop, (8, 512, 2, True)), ("int4", int4_loop, (4, 2048, 4, True)),
             # the loop software-pipelined (loop_stages): loads of later steps go through shared memory (LDGSTS)
             ("bf16", gemv_loop, ("*bf16", 8, 512, 4, False, 3)), ("int8", gemv_loop, ("*i8", 4, 1024, 4, True, 3)),
             ("int4", int4_loop, (8, 1024, 2, True, 3)),
             # gate-up with SiLU-mul in the epilogue (FUSED_SWIGLU): rows of the gate and the up half in one tile
             ("bf16", gemv_loop, ("*bf16", 4, 512, 4, False, 1, True)), ("int8", gemv_loop, ("*i8", 8, 512, 2, True, 1, True))]
    for label, loop, args in cases:
        body, per_thread = loop(*args)
        block_n, block_k, num_warps, byte_asm = args[1:5] if label != "int4" else args[:4]
        stages = (args[5] if label != "int4" else args[4]) if len(args) > (5 if label != "int4" else 4) else 1
        label += " swiglu" if label != "int4" and len(args) > 6 and args[6] else ""
        ops = collections.Counter(t.split()[1 if t.startswith("@") else 0].split(".")[0] for t in body)
        top = ", ".join(f"{op} {n}" for op, n in ops.most_common(7))
        print(f"{label:11s} {block_n:4d} x {block_k:5d} {num_warps:5d} {byte_asm!s:8s} {stages:6d}  "
              f"{len(body) / per_thread:6.2f} ({len(body)} for {per_thread:.0f})  {top}")


if __name__ == "__main__":
    main()
