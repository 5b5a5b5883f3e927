"""How much of the int4 decode step's time is the int4 GEMVs' unpacking, and how much their waits at the launch
boundaries? Bounds, not kernels: variants that compute wrong values with the same loads.

Why: the int4 GEMVs read their bytes at 1.1-2.0 TB/s in the decode step where int8's reach 3-4
(`decode_step_timeline.py int4 --positions`), and 2x BF16 needs the int4 step near 1.19 ms against 1.43. If the
unpacking is what holds them, packed half-precision arithmetic (two weights an instruction) or the tensor cores are
worth building into the Triton kernel; if the step barely moves without it, the time is in the loads and the launch
boundaries, and they are not.

Variants (each in its own process: a jitted function's globals are fixed once it compiles):
  export       chapter 10's unpacking
  no-unpack    the four bytes' 32-bit word taken as each of the eight floats: no instruction (wrong products; the
               loads and FFMAs the same)
  half-unpack  the low nibbles unpacked as chapter 10 does, the high ones the same floats (half the LOP3s, the same
               shifts)
  no-wait      the int4 GEMVs launched as dependents as ever but never waiting for the kernel before (their inputs
               read whenever they are; chapter 09's kernels still wait): what the int4 GEMVs' boundaries cost at most
  no-unpack+no-wait  both: the floor of what the int4 GEMV alone can be brought to without fewer bytes
  no-wait:SHAPE  only the GEMVs of one shape (qkv, o, gate_up, down) skip their wait: which boundary costs what
Each prints the chain of 36 GEMVs of each Qwen3-4B shape (µs a matrix, one CUDA-graph replay) and random:qwen3-4b's
batch-1 int4 decode step (graph replay, ms; twice).
Measured (one H200, the GEMV in FP32): step 1.429 ms; no-unpack 1.305,
half-unpack 1.490 (slower: more registers at 4 x 4 x 16), no-wait 1.276, both 1.060. Neither alone reaches 2x.
Run on a GPU from kernels_lab/: PYTHONPATH=..:. python3 int4_step_bounds.py [variant[,variant...]]  (default: VARIANTS;
each in its own process)"""

import os
import subprocess
import sys

import forge_engine.quant.gemv as quant  # first: on a CPU it switches on the interpreter, which must precede `import triton`
import triton
import triton.language as tl

EXPORTED_UNPACK = quant._nibbles_to_f32

VARIANTS = ("export", "no-unpack", "half-unpack", "no-wait", "no-unpack+no-wait", "export")


@triton.jit
def no_wait(WAIT: tl.constexpr):
    pass


@triton.jit
def wait_unless_marked(WAIT: tl.constexpr):
    if (
        WAIT == 1
    ):  # a launch marked PDL=2 (`patch`'s no-wait:SHAPE) skips its wait; True == 1 waits as ever
        tl.extra.cuda.gdc_wait()


@triton.jit
def no_unpack(b, BYTE_ASM: tl.constexpr):
    return tl.inline_asm_elementwise(
        asm="mov.b32 $0, $8; mov.b32 $1, $8; mov.b32 $2, $8; mov.b32 $3, $8; mov.b32 $4, $8; mov.b32 $5, $8; "
        "mov.b32 $6, $8; mov.b32 $7, $8;",
        constraints="=r,=r,=r,=r,=r,=r,=r,=r,r",
        args=[b],
        dtype=(tl.float32, tl.float32),
        is_pure=True,
        pack=4,
    )


@triton.jit
def half_unpack(b, BYTE_ASM: tl.constexpr):
    low, high = EXPORTED_UNPACK(
        b, BYTE_ASM
    )  # (ptxas drops the high nibbles' LOP3s: their results go unused)
    return low, low


def patch(variant: str):
    """Chapter 10's `_nibbles_to_f32` (and the int4 GEMV's `_wait_for_previous`) replaced for this process, before
    anything compiles. The GEMV's arithmetic in FP32, as measured (`INT4_INT_DOT` off: chapter 10's integer loop has no
    nibbles made floats)."""
    quant.INT4_INT_DOT = False
    if variant.startswith("no-wait:"):  # one shape's GEMVs only
        import gemv_chain_sweep
        from decode_overlap import (
            int4_gemv_for,
        )  # (its per-shape launch override: PDL=2 there, dependent without the wait)

        quant._wait_for_previous = wait_unless_marked
        shape = gemv_chain_sweep.SHAPES[variant.split(":")[1]]
        import forge_engine.quant.layers as quant_layers  # (Int4Linear.decode_gemv calls it from there)

        quant.int4_gemv = quant_layers.int4_gemv = gemv_chain_sweep.int4_gemv = int4_gemv_for(
            {shape: dict(pdl=2)}
        )
        return
    if "no-wait" in variant:
        quant._wait_for_previous = no_wait
    unpack = variant.replace("+no-wait", "").replace("no-wait", "export")
    if unpack != "export":
        quant._nibbles_to_f32 = {"no-unpack": no_unpack, "half-unpack": half_unpack}[unpack]


def run(variant: str):
    patch(variant)
    measure(variant)


def measure(label: str):
    "The chain of 36 int4 GEMVs of each Qwen3-4B shape (µs a matrix) and the int4 decode step (ms, twice), printed."
    import torch
    from common import DEVICE
    from decode_overlap import decode_step_ms
    from forge_engine.bench import free_memory
    from forge_engine.config import EngineConfig
    from forge_engine.engine import LLMEngine
    from forge_engine.loader import load_model
    from gemv_chain_sweep import LAYERS, SHAPES, product, weights
    from common import graphed_ms

    chain = {}
    for shape, (n, k) in SHAPES.items():
        layers = [weights("int4", n, k) for _ in range(LAYERS)]
        x = torch.randn(1, k, device=DEVICE).bfloat16()
        chain[shape] = graphed_ms(lambda: [product("int4", x, w) for w in layers]) * 1e3 / LAYERS
        layers = None  # (freed; not `del`: the lambdas above name it)
        torch.cuda.empty_cache()
    loaded = load_model("random:qwen3-4b", "cuda", progress=False, quantization="int4")
    steps = []
    for _ in range(2):
        engine = LLMEngine(loaded, EngineConfig(max_num_seqs=8))
        steps.append(decode_step_ms(engine))
        del engine
        free_memory()
    print(
        f"{label:12s} chain "
        + "  ".join(f"{k} {v:6.2f}" for k, v in chain.items())
        + "  | step graph "
        + " / ".join(f"{s:.3f}" for s in steps)
        + " ms",
        flush=True,
    )


def main(script: str, run, default: tuple, timeout: int):
    "`script [variant[,variant...]]`: one variant runs here (`run`), several each in a fresh process of `script`."
    variants = sys.argv[1].split(",") if len(sys.argv) > 1 else default
    if len(variants) == 1:
        run(variants[0])
    else:
        for v in variants:
            subprocess.run([sys.executable, script, v], env=os.environ, timeout=timeout)


if __name__ == "__main__":
    main(__file__, run, VARIANTS, 150)
