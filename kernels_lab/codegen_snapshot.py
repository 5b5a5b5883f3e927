"""The machine code of the kernels' default launches, compiled for an H200 (sm_90) without a GPU: a snapshot to compare
before and after a change that should not change what runs (a module split, a dead switch removed).

Each case is a kernel with the constexprs its launcher passes on the default path at Qwen3-4B's shapes (W1: one
sequence, BF16, int8 and int4 weights; a batch of 8 and of 64 for decode attention). A case's record is its SASS
(instructions without addresses or line information), its registers a thread and its shared memory. Constexprs a
kernel does not take are left out, so one snapshot script serves both sides of a change that removes one.

    TRITON_INTERPRET=0 PYTHONPATH=. python3 kernels_lab/codegen_snapshot.py /tmp/before.json   (at the old commit)
    TRITON_INTERPRET=0 PYTHONPATH=. python3 kernels_lab/codegen_snapshot.py /tmp/after.json
    python3 kernels_lab/codegen_snapshot.py --compare /tmp/before.json /tmp/after.json"""

import importlib
import json
import os
import re
import subprocess
import sys

MODULES = (
    "forge_engine.kernels.gemv",
    "forge_engine.kernels.paged_attention",
    "forge_engine.kernels.prefill_attention",
    "forge_engine.kernels.elementwise",
    "forge_engine.kernels.backend",
    "forge_engine.kernels",
    "forge_engine.quant.gemv",
)


def find(name: str):
    "A kernel or constant by name, wherever this version of the package keeps it."
    for module in MODULES:
        try:
            found = importlib.import_module(module)
        except ImportError:
            continue
        if hasattr(found, name):
            return getattr(found, name)
    raise LookupError(name)


FLOATS = ("eps", "qk_scale")


def signature(kernel, constexprs: dict, pointers: dict) -> dict:
    "Every argument of `kernel`: a pointer (`pointers`' type, else *bf16), fp32 for FLOATS, i32 else; constexprs as given."
    out = {}
    for name in kernel.arg_names:
        if name in constexprs:
            out[name] = "constexpr"
        elif name.endswith("_ptr"):
            out[name] = pointers.get(name, "*bf16")
        elif name in FLOATS:
            out[name] = "fp32"
        else:
            out[name] = "i32"
    return out


UNALIGNED = ("stride_tb",)  # a block table's width: any number of blocks


def aligned(name: str) -> bool:
    """What the launchers tell the compiler at Qwen3-4B's shapes: pointers, strides and row lengths divisible by 16
    (as real launches specialise them), but for the block table's width."""
    return (
        name.endswith("_ptr")
        or (name.startswith("stride_") and name not in UNALIGNED)
        or name in ("N", "K")
    )


def compile_case(
    kernel, constexprs: dict, pointers: dict, num_warps: int, maxnreg: int | None = None
) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = {
        k: v for k, v in constexprs.items() if k in kernel.arg_names
    }  # (a constexpr this version dropped)
    missing = [
        n for i, n in enumerate(kernel.arg_names) if i in kernel.constexprs and n not in constexprs
    ]
    if missing:
        raise ValueError(f"{kernel.__name__}: no value for {missing}")
    sig = signature(kernel, constexprs, pointers)
    names = list(sig)
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, a in enumerate(names)
        if aligned(a) and sig[a] != "constexpr"
    }
    options = {"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    compiled = triton.compile(
        ASTSource(kernel, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32), options=options
    )
    cuobjdump = os.path.join(
        os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"
    )
    path = f"/tmp/codegen_snapshot_{os.getpid()}.cubin"
    with open(path, "wb") as f:
        f.write(compiled.asm["cubin"])
    sass = subprocess.run(
        [cuobjdump, "-sass", path], capture_output=True, text=True, check=True
    ).stdout
    usage = subprocess.run(
        [cuobjdump, "-res-usage", path], capture_output=True, text=True, check=True
    ).stdout
    os.remove(path)
    code = [text.strip() for text in re.findall(r"/\*[0-9a-f]{4}\*/\s+([^;]+);", sass)]
    return dict(
        sass=code,
        registers=int(re.search(r"REG:(\d+)", usage).group(1)),
        shared=compiled.metadata.shared,
    )


GEMV = dict(
    ROWS=1,
    HAS_BIAS=False,
    PDL=True,
    BYTE_ASM=True,
    PREFETCH=0,
    LOOP_STAGES=1,
    EARLY_W=True,
    SWIGLU=False,
    NORM=False,
    RESIDUAL=False,
    NORM_SUMS=False,
    HAND_OFF=False,
)
ROWS = {
    k: v for k, v in GEMV.items() if k not in ("PREFETCH", "LOOP_STAGES")
}  # (one row of x, no hand-off)
DECODE = dict(
    HEAD_DIM=128,
    BLOCK_D=128,
    BLOCK_SIZE=16,
    GROUP=4,
    BLOCK_G=16,
    UPCAST=False,
    PRECISION="tf32",
    PDL=True,
    STORE=True,
    ONE_LOOP=True,
    ROPE=True,
    QK_NORM=True,
    MERGE=True,
    FENCE=True,
)
DECODE_POINTERS = dict(
    tables_ptr="*i32",
    context_lens_ptr="*i32",
    part_acc_ptr="*fp32",
    part_m_ptr="*fp32",
    part_l_ptr="*fp32",
    count_ptr="*i32",
    slots_ptr="*i64",
    cos_ptr="*fp32",
    sin_ptr="*fp32",
)


def cases() -> dict:
    "name -> (kernel name, constexprs, pointer types, num_warps, maxnreg): the default launches."
    i8 = dict(w_ptr="*i8", scale_ptr="*fp32", sums_ptr="*fp32")
    bf = dict(scale_ptr="*bf16", sums_ptr="*fp32")
    out = {
        # BF16 W1 (Qwen3-4B): qkv with the norm folded in, o / down adding the residual, gate-up in the rows layout
        # with the norm and SiLU-mul, the LM head
        "gemv bf16 qkv": (
            "_gemv_kernel",
            dict(GEMV, BLOCK_N=8, BLOCK_K=512, EVEN_K=True, HAS_SCALE=False, NORM=True),
            bf,
            4,
            None,
        ),
        "gemv bf16 o": (
            "_gemv_kernel",
            dict(GEMV, BLOCK_N=2, BLOCK_K=1024, EVEN_K=True, HAS_SCALE=False, RESIDUAL=True),
            bf,
            4,
            None,
        ),
        "gemv bf16 down": (
            "_gemv_kernel",
            dict(GEMV, BLOCK_N=2, BLOCK_K=1024, EVEN_K=False, HAS_SCALE=False, RESIDUAL=True),
            bf,
            4,
            None,
        ),
        "gemv bf16 head": (
            "_gemv_kernel",
            dict(GEMV, BLOCK_N=4, BLOCK_K=512, EVEN_K=True, HAS_SCALE=False),
            bf,
            2,
            None,
        ),
        "gemv bf16 gate-up rows": (
            "_gemv_rows_kernel",
            dict(
                ROWS,
                BLOCK_N=4,
                CHUNK=8,
                SLABS=2,
                EVEN=True,
                HAS_SCALE=False,
                SWIGLU=True,
                NORM=True,
            ),
            bf,
            2,
            None,
        ),
        "gemv bf16 2 rows": (
            "_gemv_kernel",
            dict(GEMV, ROWS=2, BLOCK_N=8, BLOCK_K=512, EVEN_K=True, HAS_SCALE=False),
            bf,
            4,
            None,
        ),
        # int8: the norms handed off (qkv, gate-up take the sums; o, down hand them on)
        "gemv int8 qkv": (
            "_gemv_kernel",
            dict(GEMV, BLOCK_N=4, BLOCK_K=1024, EVEN_K=False, HAS_SCALE=True, NORM_SUMS=True),
            i8,
            4,
            None,
        ),
        "gemv int8 o": (
            "_gemv_kernel",
            dict(
                GEMV,
                BLOCK_N=4,
                BLOCK_K=2048,
                EVEN_K=True,
                HAS_SCALE=True,
                RESIDUAL=True,
                HAND_OFF=True,
            ),
            i8,
            4,
            None,
        ),
        "gemv int8 gate-up rows": (
            "_gemv_rows_kernel",
            dict(
                ROWS,
                BLOCK_N=8,
                CHUNK=8,
                SLABS=2,
                EVEN=True,
                HAS_SCALE=True,
                SWIGLU=True,
                NORM_SUMS=True,
            ),
            i8,
            2,
            None,
        ),
        # decode attention: one sequence (early tile, q/k-norm and RoPE, K/V stored, the last split merges); 8
        # sequences (splits, no early tile); 64 sequences (no split)
        "decode batch 1": (
            "_decode_kernel",
            dict(
                DECODE,
                BLOCK_N=64,
                SPLIT=True,
                WAIT=False,
                EARLY_TILE=True,
                WAIT_LATE=True,
                UNROLL_MERGE=8,
            ),
            DECODE_POINTERS,
            8,
            None,
        ),
        "decode batch 8": (
            "_decode_kernel",
            dict(
                DECODE,
                BLOCK_N=128,
                SPLIT=True,
                WAIT=False,
                EARLY_TILE=False,
                WAIT_LATE=False,
                UNROLL_MERGE=4,
            ),
            DECODE_POINTERS,
            4,
            None,
        ),
        "decode batch 64": (
            "_decode_kernel",
            dict(
                DECODE,
                BLOCK_N=128,
                SPLIT=False,
                WAIT=False,
                EARLY_TILE=False,
                WAIT_LATE=False,
                UNROLL_MERGE=0,
            ),
            DECODE_POINTERS,
            4,
            None,
        ),
        "prefill": (
            "_prefill_kernel",
            dict(
                GROUP=4,
                GROUP_PAD=4,
                BLOCK_M=16,
                HEAD_DIM=128,
                BLOCK_D=128,
                BLOCK_N=64,
                BLOCK_SIZE=16,
                UPCAST=False,
                PRECISION="tf32",
            ),
            dict(
                tables_ptr="*i32",
                query_start_ptr="*i32",
                context_lens_ptr="*i32",
                tile_seq_ptr="*i32",
                tile_first_ptr="*i32",
            ),
            4,
            None,
        ),
        # the small kernels, as dependents (a one-row step)
        "add_rmsnorm": (
            "_add_rmsnorm_kernel",
            dict(HAS_RESIDUAL=True, ZERO_CENTRED=False, BLOCK_H=4096, PDL=True, WAIT=True),
            {},
            8,
            None,
        ),
        "norm_rope": (
            "_norm_rope_kernel",
            dict(HALF=64, BLOCK=64, HAS_NORM=True, PDL=True, WAIT=True),
            {},
            1,
            None,
        ),
        "silu_mul": ("_silu_mul_kernel", dict(BLOCK=1024, PDL=True, WAIT=True), {}, 4, None),
        "write_kv": (
            "_write_kv_kernel",
            dict(HEAD_DIM=128, BLOCK_D=128, PDL=True, WAIT=True),
            dict(slots_ptr="*i64"),
            1,
            None,
        ),
        "argmax chunks": (
            "_argmax_chunks_kernel",
            dict(BLOCK=2048),
            dict(max_ptr="*fp32", at_ptr="*i32"),
            4,
            None,
        ),
        "argmax merge": (
            "_argmax_merge_kernel",
            dict(BLOCK_C=128),
            dict(max_ptr="*fp32", at_ptr="*i32", out_ptr="*i64"),
            4,
            None,
        ),
    }
    # chapter 10's int4 GEMV, at the tiles and steps `int4_gemv` takes for Qwen3-4B's shapes at one row
    config, early_steps = find("quant_gemv_config"), find("INT4_TILE_EARLY_STEPS")
    maxnregs, int_dot = find("INT4_TILE_MAXNREG"), find("INT4_INT_DOT")
    for name, (n, k), folds in (
        ("qkv", (6144, 2560), dict(NORM_SUMS=True)),
        ("o", (2560, 4096), dict(RESIDUAL=True, HAND_OFF=True)),
        ("gate-up", (19456, 2560), dict(NORM_SUMS=True, SWIGLU=True)),
        ("down", (2560, 9728), dict(RESIDUAL=True, HAND_OFF=True)),
    ):
        block_n, warps, chunk = config(n, k)
        tile = (block_n, warps, chunk, bool(int_dot))
        early = early_steps.get(tile, find("INT4_EARLY_WEIGHTS"))
        early = min(int(early), -(-(k // 2) // (32 * chunk * warps)))
        constexprs = dict(
            ROWS=1,
            BLOCK_N=block_n,
            GROUP=128,
            CHUNK=chunk,
            SLABS=warps,
            EVEN=n % block_n == 0 and (k // 2) % (32 * chunk * warps) == 0,
            BYTE_ASM=True,
            PDL=True,
            PREFETCH=0,
            LOOP_STAGES=1,
            SWIGLU=False,
            EARLY_W=early,
            RESIDUAL=False,
            NORM_SUMS=False,
            HAND_OFF=False,
            EARLY_EPI=find("INT4_EARLY_EPILOGUE"),
            INT_DOT=bool(int_dot),
            PAIRED=True,
        )
        constexprs.update(folds)
        out[f"int4 {name}"] = (
            "_int4_gemv_kernel",
            constexprs,
            dict(q_ptr="*u8", scale_ptr="*fp16", min_ptr="*fp16", sums_ptr="*fp32"),
            warps,
            maxnregs.get(tile),
        )
    return out


def snapshot(path: str):
    records = {}
    for name, (kernel, constexprs, pointers, warps, maxnreg) in cases().items():
        try:
            records[name] = compile_case(find(kernel), constexprs, pointers, warps, maxnreg)
        except Exception as e:  # (a case this tree does not compile: recorded, compared as such)
            records[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[-1][:200]}"}
            print(f"{name:24s} does not compile: {records[name]['error']}", file=sys.stderr)
            continue
        print(
            f"{name:24s} {len(records[name]['sass']):5d} instructions {records[name]['registers']:4d} registers",
            file=sys.stderr,
        )
    with open(path, "w") as f:
        json.dump(records, f)


def compare(before_path: str, after_path: str) -> int:
    "Print each case as identical or how it differs; the number that differ."
    before, after = (json.load(open(p)) for p in (before_path, after_path))
    differ = 0
    for name in sorted(set(before) | set(after)):
        a, b = before.get(name), after.get(name)
        if a == b:
            print(
                f"{name:24s} identical ({len(a.get('sass', ()))} instructions, {a.get('error', '')})"
            )
            continue
        differ += 1
        if a is None or b is None or "error" in a or "error" in b:
            print(
                f"{name:24s} before {a and a.get('error', 'compiled')}, after {b and b.get('error', 'compiled')}"
            )
            continue
        changed = sum(x != y for x, y in zip(a["sass"], b["sass"])) + abs(
            len(a["sass"]) - len(b["sass"])
        )
        print(
            f"{name:24s} DIFFERS: {len(a['sass'])} -> {len(b['sass'])} instructions ({changed} changed), registers "
            f"{a['registers']} -> {b['registers']}, shared {a['shared']} -> {b['shared']}"
        )
    return differ


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        sys.exit(1 if compare(sys.argv[2], sys.argv[3]) else 0)
    snapshot(sys.argv[1])
