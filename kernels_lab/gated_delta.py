"""The Gated DeltaNet on a pool of states (chapter 03c): the decode update, the one-token convolution, the prompts'
convolution, the prefill by chunks of 64.

Napkin math, per layer, at Qwen3.5-4B's linear layers (16 key heads and 32 value heads of 128 dims, a convolution of 4
over 8,192 channels; 24 of its 32 layers), against the H200's 4.19 TB/s read ceiling (common.py):

  decode update   a sequence's state is 32 x 128 x 128 x 4 B = 2 MiB, read once and written once: 4.19 MB; q, k, v
                  (bf16), the fp32 output and g, beta add 33 KB
                  batch 1:  4.23 MB -> 1.01 us (less than a launch: being one launch is what counts there)
                  batch 16: 67.6 MB -> 16.1 us (x 24 layers: 387 us a decode step)
  conv decode     the window 3 x 8,192 x 2 B read and written, x and y, the weight once: batch 1 0.20 MB (0.05 us),
                  batch 16 2.2 MB (0.5 us): a launch, whatever the kernel does
  conv prefill    x read and y written, T x 8,192 x 2 B each way in bf16 (each sequence's window read and written
                  adds 98 KB, the weight 66 KB): 512 tokens 16.8 MB -> 4.0 us; 4,096 tokens 134 MB -> 32 us;
                  two launches (the convolution, then the new windows)
  prefill         q, k, v in bf16, g and beta, the fp32 output: 33,024 B a token, + the 2 MiB final state
                  512 tokens:  19.0 MB -> 4.5 us;   4,096 tokens: 137.4 MB -> 32.8 us
                  the scratch of the two-kernel split (W and U in fp32, written then read): 64 KiB a token,
                  512: +33.6 MB (+8.0 us);  4,096: +268 MB (+64 us)
                  FLOPs a chunk of 64 and a value head: the solve 2.4 M (A, W, U: 16 x 16 tiles), the state pass
                  8.4 M (W S, Q S, K^T delta: 2.1 M each; QK^T, scores delta: 1.05 M each, QK^T once a slice):
                  168 kFLOP a token a head, 5.4 MFLOP a token a layer
                  512 tokens:  2.75 GFLOP -> 7.0 us at ~395 TFLOP/s (TF32: half of the 790 bf16 figure)
                  4,096 tokens: 22.0 GFLOP -> 56 us

So the decode is bytes, the prefill at 4,096 tokens is about as much bytes (with the scratch, ~97 us) as TF32 products
(56 us); at 512 tokens its 8 chunks in order are latency. The state pass carries a 128 x BLOCK_V slice of the state
through the chunks: 32 heads x 128 / BLOCK_V programs for one prompt.

Variants
  decode   v0 PyTorch (chapter 03b's rule: gather the slots, the rule, scatter), v1 the export, v2 block_v x warps
  conv     v0 PyTorch (causal_conv1d_step mapped over the batch), v1 the export, v2 block_c x warps
  conv prefill  v0 PyTorch (chapter 03b's causal_conv1d a sequence at a time), v1 the export, v2 block_t x
           block_c x warps; one prompt, and 32 prompts of 16 or 128 rows with short and empty ones among them
  prefill  v0 PyTorch (chapter 03b's chunked rule a sequence at a time), v1 the export, v2 block_v x warps x solve
           warps, v3 the products' precision (tf32 / tf32x3 on bf16 inputs); one prompt of 512 and of 4,096
           tokens, and the steps of a server's prefill: 8 prompts of 1,024, 80 of 100 (PREFILL_STEPS)

  PYTHONPATH=. python3 kernels_lab/gated_delta.py              on a GPU: validation at the 4B shape, then timings
  PYTHONPATH=. python3 kernels_lab/gated_delta.py --cpu-check  validation only, small shapes, Triton's interpreter
  LAB_PREFILL_ONLY=1 ...                                          the prefill's validation and timings only
  TRITON_INTERPRET=0 PYTHONPATH=. python3 kernels_lab/gated_delta.py --sass
                                                               registers, spills and shared memory of each tile,
                                                               compiled for an H200 on any machine (~1 min)
LAB_VARIANTS=v1,v2 picks variants by prefix (common.selected)."""

import os
import subprocess
import sys

import torch
import torch.nn.functional as F

from common import DEVICE, ON_GPU, Results, finish, selected, time_variant, validate
from forge_engine import gated_delta as gd

HK, HV, DK, DV, CONV_K = 16, 32, 128, 128, 4
CHANNELS = 2 * HK * DK + HV * DV  # 8,192: q, k and v go through the convolution
LIMITS = {
    torch.float32: 1e-4,
    torch.bfloat16: 1e-2,
}  # relative norm: tf32x3 ~1e-6; TF32 and bf16 inputs ~1e-3


def rule_inputs(T, hk, hv, dk, dv, dtype, seed=0):
    "q, k [T, hk, dk] as the convolution gives them, v [T, hv, dv] in `dtype`; g (log decay), beta [T, hv] fp32."
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(T, hk, dk, generator=gen) for _ in range(2))
    v = torch.randn(T, hv, dv, generator=gen)
    g = F.logsigmoid(2 * torch.randn(T, hv, generator=gen))
    beta = torch.sigmoid(torch.randn(T, hv, generator=gen))
    return [x.to(DEVICE, dtype) for x in (q, k, v)] + [x.to(DEVICE) for x in (g, beta)]


def pool_of(rows, hv, dk, dv, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (0.5 * torch.randn(rows, hv, dk, dv, generator=gen)).to(DEVICE)


# -- the variants: each takes the inputs and returns the output, updating its pool in place


def decode_v0(q, k, v, g, beta, state, slots):
    return gd.gated_delta_decode(q, k, v, g, beta, state, slots, impl="torch")


def decode_export(**tiles):
    return lambda *args: gd.gated_delta_decode(*args, impl="triton", **tiles)


def conv_v0(x, conv_state, weight, slots):
    return gd.causal_conv1d_decode(x, conv_state, weight, slots, impl="torch")


def conv_export(**tiles):
    return lambda *args: gd.causal_conv1d_decode(*args, impl="triton", **tiles)


def conv_prefill_v0(*args):
    return gd.causal_conv1d_prefill(*args, impl="torch")


def conv_prefill_export(**tiles):
    return lambda *args: gd.causal_conv1d_prefill(*args, impl="triton", **tiles)


def prefill_v0(*args, **kw):
    return gd.gated_delta_prefill(*args, impl="torch", **kw)


def prefill_export(**tiles):
    return lambda *args, **kw: gd.gated_delta_prefill(*args, impl="triton", **tiles, **kw)


DECODE = {"v0 torch": decode_v0, "v1 export": decode_export()}
DECODE_SWEEP = {
    f"v2 block_v={bv} warps={w}": decode_export(block_v=bv, num_warps=w)
    for bv in (16, 32, 64, 128)
    for w in (2, 4, 8)
}
CONV = {"v0 torch": conv_v0, "v1 export": conv_export()}
CONV_SWEEP = {
    f"v2 block_c={bc} warps={w}": conv_export(block_c=bc, num_warps=w)
    for bc in (128, 256, 512, 1024)
    for w in (1, 2, 4)
}
CONV_PREFILL = {"v0 torch": conv_prefill_v0, "v1 export": conv_prefill_export()}
CONV_PREFILL_SWEEP = {
    f"v2 block_t={bt} block_c={bc} warps={w}": conv_prefill_export(
        block_t=bt, block_c=bc, num_warps=w
    )
    for bt in (4, 8, 16, 32)
    for bc in (128, 256, 512)
    for w in (4, 8)
}
PREFILL = {"v0 torch": prefill_v0, "v1 export": prefill_export()}
PREFILL_SWEEP = {
    f"v2 block_v={bv} warps={w} solve_warps={sw}": prefill_export(
        block_v=bv, num_warps=w, solve_warps=sw
    )
    for bv in (16, 32, 64)
    for w in (4, 8)
    for sw in (4, 8)
}
PREFILL_ONLY = bool(os.environ.get("LAB_PREFILL_ONLY"))  # the prefill's validation and timings only
PREFILL_STEPS = (
    [512],
    [4096],
    [1024] * 8,
    [100] * 80,
)  # a prompt; a step of 8 long ones, of 80 short ones
PREFILL_PRECISION = {f"v3 {p}": prefill_export(precision=p) for p in ("tf32", "tf32x3")}


# -- validation


def check_decode(shape, dtype, variants, batch, pool_rows):
    hk, hv, dk, dv = shape
    q, k, v, g, beta = rule_inputs(batch, hk, hv, dk, dv, dtype, seed=batch)
    slots = torch.randperm(pool_rows, generator=torch.Generator().manual_seed(2))[:batch].to(DEVICE)
    start = pool_of(pool_rows, hv, dk, dv)
    want_pool = start.clone()
    want = decode_v0(q, k, v, g, beta, want_pool, slots)
    others = torch.ones(pool_rows, dtype=torch.bool, device=DEVICE)
    others[slots] = False
    ok = True
    for name, fn in variants.items():
        pool = start.clone()
        got = fn(q, k, v, g, beta, pool, slots.int())
        ok &= validate(f"decode {name} B={batch} {dtype}", got, want, LIMITS[dtype])
        ok &= validate(f"  its state", pool, want_pool, LIMITS[dtype])
        ok &= bool(torch.equal(pool[others], start[others]))  # rows of no sequence: untouched
    return ok


def check_conv(channels, dtype, variants, batch, pool_rows):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(batch, channels, generator=gen).to(DEVICE, dtype)
    weight = torch.randn(channels, CONV_K, generator=gen).to(DEVICE, dtype)
    start = torch.randn(pool_rows, CONV_K - 1, channels, generator=gen).to(DEVICE, dtype)
    slots = torch.randperm(pool_rows, generator=gen)[:batch].to(DEVICE)
    want_pool = start.clone()
    want = conv_v0(x, want_pool, weight, slots)
    ok = True
    for name, fn in variants.items():
        pool = start.clone()
        got = fn(x, pool, weight, slots)
        ok &= validate(f"conv {name} B={batch} C={channels} {dtype}", got, want, LIMITS[dtype])
        ok &= bool(torch.equal(pool, want_pool))
    return ok


def conv_prefill_inputs(channels, dtype, lengths, seed=5):
    """x [sum(lengths), channels], weight, a pool of len(lengths) + 3 rows, cu_seqlens, slots out of order, fresh for
    every other sequence."""
    gen = torch.Generator().manual_seed(seed)
    n, rows = len(lengths), len(lengths) + 3
    x = torch.randn(sum(lengths), channels, generator=gen).to(DEVICE, dtype)
    weight = torch.randn(channels, CONV_K, generator=gen).to(DEVICE, dtype)
    pool = torch.randn(rows, CONV_K - 1, channels, generator=gen).to(DEVICE, dtype)
    cu = torch.tensor([0] + lengths).cumsum(0).to(DEVICE)
    slots = torch.randperm(rows, generator=gen)[:n].to(DEVICE)
    fresh = (torch.arange(n) % 2 == 0).to(DEVICE)
    return x, pool, weight, cu, slots, fresh


def check_conv_prefill(channels, dtype, variants, lengths):
    x, start, weight, cu, slots, fresh = conv_prefill_inputs(channels, dtype, lengths)
    want_pool = start.clone()
    want = conv_prefill_v0(x, want_pool, weight, cu, slots, fresh)
    ok = True
    for name, fn in variants.items():
        pool = start.clone()
        got = fn(x, pool, weight, cu, slots, fresh)
        label = f"conv prefill {name} {len(lengths)} seqs C={channels} {dtype}"
        ok &= validate(label, got, want, LIMITS[dtype])
        ok &= bool(
            torch.equal(pool, want_pool)
        )  # windows are copies: bit-equal, other rows untouched
    return ok


def check_prefill(shape, dtype, variants, lengths):
    hk, hv, dk, dv = shape
    cu = torch.tensor([0] + lengths).cumsum(0).to(DEVICE)
    q, k, v, g, beta = rule_inputs(sum(lengths), hk, hv, dk, dv, dtype, seed=len(lengths))
    n, rows = len(lengths), len(lengths) + 2
    slots = torch.randperm(rows, generator=torch.Generator().manual_seed(4))[:n].to(DEVICE)
    fresh = (torch.arange(n) % 2 == 0).to(DEVICE)  # every other sequence starts here
    start = pool_of(rows, hv, dk, dv)
    want_pool = start.clone()
    args = (q, k, v, g, beta, cu)
    want = prefill_v0(*args, want_pool, slots, fresh)
    ok = True
    for name, fn in variants.items():
        pool = start.clone()
        got = fn(*args, pool, slots, fresh)
        ok &= validate(f"prefill {name} lengths={lengths} {dtype}", got, want, LIMITS[dtype])
        ok &= validate(f"  its states", pool, want_pool, LIMITS[dtype])
    return ok


def prefill_variants(dtype) -> dict:
    "The prefill's variants for inputs of `dtype`: the products' precisions for bf16; fp32 leaves out 16 columns."
    sweep = {**PREFILL_SWEEP, **(PREFILL_PRECISION if dtype == torch.bfloat16 else {})}
    if (
        dtype == torch.float32
    ):  # fp32-accurate products at 16 columns fault on an H100 (the export takes 32 and up)
        sweep = {name: fn for name, fn in sweep.items() if "block_v=16 " not in name}
    return {**PREFILL, **sweep}


def cpu_check() -> bool:
    "The exports and a few tiles under the interpreter, fp32 (bf16 tl.dot is not right under the interpreter)."
    small = (2, 4, 16, 24)
    ok = check_decode(
        small, torch.float32, {**DECODE, "v2 block_v=16": decode_export(block_v=16)}, 3, 6
    )
    ok &= check_conv(40, torch.float32, {**CONV, "v2 block_c=16": conv_export(block_c=16)}, 3, 5)
    ok &= check_conv_prefill(
        40,
        torch.float32,
        {**CONV_PREFILL, "v2 block_t=4 block_c=16": conv_prefill_export(block_t=4, block_c=16)},
        [1, 0, 6, 2, 9, 0, 3],
    )
    ok &= check_prefill(
        small,
        torch.float32,
        {**PREFILL, "v2 block_v=32": prefill_export(block_v=32)},
        [1, 40, 64, 150],
    )
    return ok


def gpu_check() -> bool:
    shape, ok = (HK, HV, DK, DV), True
    for dtype in (torch.float32, torch.bfloat16):
        for batch in () if PREFILL_ONLY else (1, 16):
            ok &= check_decode(shape, dtype, {**DECODE, **DECODE_SWEEP}, batch, 24)
            ok &= check_conv(CHANNELS, dtype, {**CONV, **CONV_SWEEP}, batch, 24)
        for lengths in () if PREFILL_ONLY else ([512], [2, 0, 700, 1, 64]):
            ok &= check_conv_prefill(
                CHANNELS, dtype, {**CONV_PREFILL, **CONV_PREFILL_SWEEP}, lengths
            )
        for lengths in ([512], [1, 100, 1000, 64]):
            ok &= check_prefill(shape, dtype, prefill_variants(dtype), lengths)
    return ok


# -- timings


def bench_conv_prefill(results, dtype):
    "The prompts' convolution: one prompt of 512 and of 4,096 rows, then a step of 32 short ones."
    size = torch.finfo(dtype).bits // 8
    # 32 sequences of 16 or 128 rows, every eighth only 1 or none
    many = [0 if i % 8 == 7 else 1 if i % 8 == 3 else 16 if i % 2 else 128 for i in range(32)]
    for lengths in ([512], [4096], many):
        args = conv_prefill_inputs(CHANNELS, dtype, lengths)
        tokens = sum(lengths)
        moved = (2 * tokens + 2 * len(lengths) * (CONV_K - 1) + CONV_K) * CHANNELS * size
        for name, fn in selected({**CONV_PREFILL, **CONV_PREFILL_SWEEP}).items():
            # the reference reads the lengths back to the host: eager; the kernels: one graph of both launches
            run = lambda: fn(*args)  # noqa: E731
            ms, how = time_variant(run, graph=name != "v0 torch")
            results.add(
                f"conv prefill {len(lengths)} seqs T={tokens} {dtype}", f"{name} [{how}]", ms, moved
            )


def bench():
    results = Results("gated_delta")
    state_bytes = HV * DK * DV * 4
    for dtype in (torch.bfloat16, torch.float32):
        size = torch.finfo(dtype).bits // 8
        for batch in () if PREFILL_ONLY else (1, 16):
            q, k, v, g, beta = rule_inputs(batch, HK, HV, DK, DV, dtype)
            pool, slots = pool_of(64, HV, DK, DV), torch.arange(batch, device=DEVICE) * 3
            moved = batch * (
                2 * state_bytes + (2 * HK * DK + HV * DV) * size + HV * DV * 4 + 2 * HV * 4
            )
            for name, fn in selected({**DECODE, **DECODE_SWEEP}).items():
                ms, how = time_variant(lambda: fn(q, k, v, g, beta, pool, slots), graph=True)
                results.add(f"decode B={batch} {dtype}", f"{name} [{how}]", ms, moved)
            x = torch.randn(batch, CHANNELS, device=DEVICE, dtype=dtype)
            weight = torch.randn(CHANNELS, CONV_K, device=DEVICE, dtype=dtype)
            conv_pool = torch.randn(64, CONV_K - 1, CHANNELS, device=DEVICE, dtype=dtype)
            moved = (batch * (2 * (CONV_K - 1) + 2) + CONV_K) * CHANNELS * size
            for name, fn in selected({**CONV, **CONV_SWEEP}).items():
                ms, how = time_variant(lambda: fn(x, conv_pool, weight, slots), graph=True)
                results.add(f"conv B={batch} {dtype}", f"{name} [{how}]", ms, moved)
        if not PREFILL_ONLY:
            bench_conv_prefill(results, dtype)
        for lengths in PREFILL_STEPS:
            tokens, n = sum(lengths), len(lengths)
            q, k, v, g, beta = rule_inputs(tokens, HK, HV, DK, DV, dtype)
            cu = torch.tensor([0, *lengths], device=DEVICE).cumsum(0)
            pool, slots = pool_of(n + 1, HV, DK, DV), torch.arange(1, n + 1, device=DEVICE)
            fresh = torch.ones(n, dtype=torch.bool, device=DEVICE)
            moved = (
                tokens * ((2 * HK * DK + HV * DV) * size + 2 * HV * 4 + HV * DV * 4)
                + n * state_bytes
            )
            flops = (
                sum(-(-t // gd.CHUNK) for t in lengths) * HV * 10.75e6
            )  # 2.36 M the solve, 8.39 M the state pass (docstring)
            for name, fn in selected(prefill_variants(dtype)).items():
                # the reference copies lengths to the host: eager; the kernels: one graph of both launches
                run = lambda: fn(q, k, v, g, beta, cu, pool, slots, fresh, max_seqlen=max(lengths))  # noqa: E731
                ms, how = time_variant(run, graph=name != "v0 torch")
                results.add(
                    f"prefill {n} seqs T={tokens} {dtype}", f"{name} [{how}]", ms, moved, flops
                )
    results.print()
    print(
        "  (%bw: the bytes the step must move, not counting the prefill's W and U scratch; %flop against bf16)"
    )


# -- registers, compiled for an H200 without one


def sass():
    "Registers a thread, spilled bytes (STACK) and shared memory of each kernel's tiles, compiled for sm_90."
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cuobjdump = os.path.join(
        os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"
    )
    half = {
        "q_ptr": "*bf16",
        "k_ptr": "*bf16",
        "v_ptr": "*bf16",
        "x_ptr": "*bf16",
        "conv_ptr": "*bf16",
    }
    half |= {"w_ptr": "*bf16", "y_ptr": "*bf16"}
    ints = {"slots_ptr": "*i64", "cu_ptr": "*i64", "fresh_ptr": "*i1"}

    def compile_case(label, kernel, constexprs, num_warps, num_stages=None, pointers=()):
        pointers = {**ints, **dict(pointers)}
        sig = {
            name: "constexpr"
            if name in constexprs
            else pointers.get(name, "*fp32")
            if name.endswith("_ptr")
            else "fp32"
            if name in ("eps", "scale")
            else "i32"
            for name in kernel.arg_names
        }
        attrs = {
            (i,): [["tt.divisibility", 16]] for i, name in enumerate(sig) if name.endswith("_ptr")
        }
        options = {"num_warps": num_warps} | ({"num_stages": num_stages} if num_stages else {})
        compiled = triton.compile(
            ASTSource(kernel, sig, constexprs, attrs),
            target=GPUTarget("cuda", 90, 32),
            options=options,
        )
        path = f"/tmp/gated_delta_{os.getpid()}.cubin"
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run(
            [cuobjdump, "-res-usage", path], capture_output=True, text=True
        ).stdout
        os.remove(path)
        fields = dict(f.split(":") for f in usage.strip().splitlines()[-1].split() if ":" in f)
        print(
            f"  {label:58s} registers {fields['REG']:>4s}  spilled {fields['STACK']:>6s} B"
            f"  shared {compiled.metadata.shared:>7d} B"
        )

    heads = dict(GROUP=HV // HK, DK=DK, DV=DV, BLOCK_K=DK)
    for bv in (16, 32, 64):
        for w in (4, 8):
            compile_case(
                f"decode block_v={bv} warps={w} (bf16 q, k, v)",
                gd._gated_delta_decode_kernel,
                dict(HV=HV, **heads, BLOCK_V=bv),
                w,
                pointers=half,
            )
    compile_case(
        "conv block_c=256 warps=2 (bf16)",
        gd._causal_conv1d_decode_kernel,
        dict(K=CONV_K, BLOCK_C=256, SILU=True),
        2,
        pointers=half,
    )
    for bt, bc in ((4, 256), (8, 128), (8, 256), (16, 128), (16, 256), (32, 128)):
        for w in (2, 4, 8):
            compile_case(
                f"conv prefill block_t={bt} block_c={bc} warps={w} (bf16)",
                gd._causal_conv1d_prefill_kernel,
                dict(K=CONV_K, BLOCK_T=bt, BLOCK_C=bc, SILU=True),
                w,
                pointers=half,
            )
    compile_case(
        "conv prefill windows block_c=128 warps=2 (bf16)",
        gd._conv_state_prefill_kernel,
        dict(K=CONV_K, BLOCK_C=128),
        2,
        pointers=half,
    )
    for precision, pointers in (("tf32", half), ("tf32x3", {})):
        for w in (4, 8):
            compile_case(
                f"prefill solve warps={w} {precision}",
                gd._prefill_solve_kernel,
                dict(
                    **heads,
                    BLOCK_V=DV,
                    SUB=gd.SUB,
                    LEVELS=gd.SUB.bit_length() - 1,
                    PRECISION=precision,
                ),
                w,
                pointers=pointers,
            )
        for bv in (16, 32, 64):
            for w in (4, 8):
                compile_case(
                    f"prefill state pass block_v={bv} warps={w} {precision}",
                    gd._prefill_state_kernel,
                    dict(**heads, BLOCK_V=bv, CHUNK=gd.CHUNK, PRECISION=precision),
                    w,
                    num_stages=1,
                    pointers=pointers,
                )


def main():
    if "--sass" in sys.argv:
        sass()
        return
    if "--cpu-check" in sys.argv or not ON_GPU:
        print("validation under Triton's interpreter, small shapes, fp32")
        finish(cpu_check())
    print("validation against the references at Qwen3.5-4B's shape")
    ok = gpu_check()
    if not ok:
        finish(ok)
    bench()
    finish(ok)


if __name__ == "__main__":
    main()
