"""The int8 and BF16 GEMVs in chapter 10's int4 layout: several weight rows a thread (int8: bytes made floats without
a subtraction).

Napkin math: the exported int8 GEMV (chapter 09's `gemv` with int8 weights) spends 4.1-4.5 instructions a weight
(`gemv_sass.py`), of which 2.25 make a float of a byte: an XOR per four bytes (signed -> 128 + q), a byte permute
placing the byte under 2^23's exponent (2^23 + 128 + q) and a subtraction of 2^23 + 128 (FSUB), exact. Its long-row
tiles hold 96 registers (114 with the first weights early when the peeled step has a layout of its own), and the
chain lab reads int8 at 2.0-3.3 TB/s (o 5.08 µs, down 9.13 µs a matrix), against int4's o at 3.75 µs.

This variant (v1) (BF16 weights take the same layout, their conversion a shift; the export's BF16 qkv and o read at
3.3 TB/s in the chain lab, gate-up at 3.9):
  * int4's layout (chapter 10): a program owns BLOCK_N rows, each thread the same CHUNK bytes of every one of them,
    the program's warps interleaved slabs of K; x's CHUNK values loaded, converted and summed once a step for all
    rows; the first step's weights asked for before the input wait (EARLY_W);
  * a byte made a float in one permute, no subtraction: placed in bits 8-15 under the exponent of 2^15
    (0x47000000), it reads 2^15 + 128 + q. The offset comes out per chunk with x's sum, which int4 computes anyway:
    Σ x q = Σ x (2^15 + 128 + q) − (2^15 + 128) Σ x. The products sit 2^8 below their float's 2^15: fp32 keeps ~16 bits
    of each, against int8's 8: 1.25 instructions a weight instead of 2.25.

Measured (one H200, chain below): v1 beat the tile kernel for BF16 gate-up (25.69 -> 23.91 us a matrix) and int8 qkv
and gate-up (7.06 -> 6.31, 15.13 -> 14.71), lost elsewhere; its layout is chapter 09's `_gemv_rows_kernel`
(`layout="rows"`, int8 converted exactly as the tile kernel does). The chain sweeps that export's rows layout
per shape, with v1's best kept for int8 (its byte conversion against the export's).

Run from the repository root: PYTHONPATH=. python3 kernels_lab/gemv_rows.py [int8,bf16]   (on a CPU: validation
under the interpreter; on a GPU: validation and the chain of gemv_chain_sweep.py, the exported GEMV against v1);
TRITON_INTERPRET=0 PYTHONPATH=. python3 kernels_lab/gemv_rows.py sass   (no GPU: instructions a weight, registers);
PYTHONPATH=. python3 kernels_lab/gemv_rows.py head   (on a GPU: the LM head, tile against rows);
PYTHONPATH=. python3 kernels_lab/gemv_rows.py precision   (on a CPU: v1's int8 conversion against the exact one:
fp32 outputs 4-7e-5 against 1e-7, bf16 outputs 3.5-5.1e-3 either way: its error is ~100x below bf16's rounding)."""

import itertools
import os
import sys

if sys.argv[1:2] != ["sass"]:
    from common import (
        DEVICE,
        HBM_BYTES_PER_S,
        ON_GPU,
        finish,
        graphed_ms,
        validate,
    )  # first: may switch on the interpreter
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from forge_engine.kernels.backend import INTERPRETED, _wait_for_previous, pdl_supported
from forge_engine.kernels.gemv import _start_gemv, gemv, gemv_config, gemv_layout
from forge_engine.quant.formats import quantize_int8


@triton.jit
def _weights_to_f32(w, BYTE_ASM: tl.constexpr):
    """A weight tile in fp32: int8 as 2^15 + 128 + w, exactly (the byte + 128 in bits 8-15 under 2^15's exponent, one
    permute); other types converted."""
    if w.dtype != tl.int8:
        f = w.to(tl.float32)
    elif BYTE_ASM:
        f = tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 u;
            xor.b32 u, $4, 0x80808080;
            prmt.b32 $0, u, 0x47000000, 0x7504;
            prmt.b32 $1, u, 0x47000000, 0x7514;
            prmt.b32 $2, u, 0x47000000, 0x7524;
            prmt.b32 $3, u, 0x47000000, 0x7534;
            }""",
            constraints="=r,=r,=r,=r,r",
            args=[w],
            dtype=tl.float32,
            is_pure=True,
            pack=4,
        )
    else:
        bits = ((w.to(tl.uint8, bitcast=True).to(tl.uint32) ^ 0x80) << 8) | 0x47000000
        f = bits.to(tl.float32, bitcast=True)
    return f


@triton.jit
def _rows_weights(
    q_ptr,
    b0,
    lane,
    first_row,
    N,
    K,
    stride_qn,
    BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr,
    EVEN: tl.constexpr,
):
    "A step's weights of the program's rows: per row, this thread's CHUNK bytes."
    start = tl.multiple_of(
        b0 + lane * CHUNK, [CHUNK, CHUNK]
    )  # [SLABS, 32] a thread's first input in the row
    c_ok = (start < K) | EVEN
    ws = ()
    for r in tl.static_range(BLOCK_N):
        row = first_row + r
        ws = ws + (
            tl.load(
                q_ptr + row * stride_qn + start[:, :, None] + tl.arange(0, CHUNK)[None, None, :],
                mask=(c_ok & ((row < N) | EVEN))[:, :, None],
                other=0,
            ),
        )
    return ws


@triton.jit
def _rows_step(
    accs,
    ws,
    x_ptr,
    b0,
    lane,
    M,
    K,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr,
    EVEN: tl.constexpr,
    BYTE_ASM: tl.constexpr,
):
    "accs + one step: x's chunk (converted and summed once for all rows) times each row's bytes."
    start = tl.multiple_of(b0 + lane * CHUNK, [CHUNK, CHUNK])
    c_ok = (start < K) | EVEN
    xs = ()
    for m in tl.static_range(ROWS):
        x = tl.load(
            x_ptr + m * K + start[:, :, None] + tl.arange(0, CHUNK)[None, None, :],
            mask=c_ok[:, :, None] & ((m < M) | EVEN),
            other=0.0,
        ).to(tl.float32)
        if (
            ws[0].dtype == tl.int8
        ):  # its floats carry 2^15 + 128: (2^15 + 128) Σ x comes off each row's sum
            xs = xs + ((x, 32896.0 * tl.sum(x, axis=2)),)
        else:
            xs = xs + ((x, 0.0),)
    new = ()
    for r in tl.static_range(BLOCK_N):
        f = _weights_to_f32(ws[r], BYTE_ASM)
        for m in tl.static_range(ROWS):
            x, offset = xs[m]
            new = new + (accs[r * ROWS + m] + (tl.sum(x * f, axis=2) - offset),)
    return new


@triton.jit
def _rows_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_qn,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr,
    SLABS: tl.constexpr,
    EVEN: tl.constexpr,
    BYTE_ASM: tl.constexpr,
    PDL: tl.constexpr,
    EARLY_W: tl.constexpr,
    HAS_SCALE: tl.constexpr,
):
    _start_gemv(PDL, not EARLY_W)
    STEP: tl.constexpr = SLABS * 32 * CHUNK
    lane = tl.arange(0, SLABS)[:, None] * 32 + tl.arange(0, 32)[None, :]
    first_row = tl.program_id(0) * BLOCK_N
    accs = (tl.zeros((SLABS, 32), dtype=tl.float32),) * (BLOCK_N * ROWS)
    first = 0
    if EARLY_W:
        ws = _rows_weights(q_ptr, 0, lane, first_row, N, K, stride_qn, BLOCK_N, CHUNK, EVEN)
        _wait_for_previous(PDL)
        accs = _rows_step(accs, ws, x_ptr, 0, lane, M, K, ROWS, BLOCK_N, CHUNK, EVEN, BYTE_ASM)
        first = STEP
    for b0 in tl.range(first, K, STEP):
        ws = _rows_weights(q_ptr, b0, lane, first_row, N, K, stride_qn, BLOCK_N, CHUNK, EVEN)
        accs = _rows_step(accs, ws, x_ptr, b0, lane, M, K, ROWS, BLOCK_N, CHUNK, EVEN, BYTE_ASM)
    for r in tl.static_range(BLOCK_N):
        row = first_row + r
        scale = (
            tl.load(scale_ptr + row, mask=row < N, other=0.0).to(tl.float32) if HAS_SCALE else 1.0
        )
        for m in tl.static_range(ROWS):
            total = tl.sum(tl.sum(accs[r * ROWS + m], axis=1), axis=0) * scale
            tl.store(
                out_ptr + m * N + row, total.to(out_ptr.dtype.element_ty), mask=(row < N) & (m < M)
            )


def rows_gemv(x, q, scale=None, block_n=4, num_warps=2, chunk=8, early=None, byte_asm=None):
    "x [M, K] @ q [N, K].T (int8: times scale [N]) through `_rows_kernel`; `chunk`: weights a thread takes of a row a step."
    x = x.contiguous()
    (m, k), n = x.shape, q.shape[0]
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    pdl = pdl_supported(x.device)
    rows = 1 << max(0, m - 1).bit_length()
    _rows_kernel[(triton.cdiv(n, block_n),)](
        x,
        q,
        scale if scale is not None else q,
        out,
        m,
        n,
        k,
        q.stride(0),
        ROWS=rows,
        BLOCK_N=block_n,
        CHUNK=chunk,
        SLABS=num_warps,
        EVEN=n % block_n == 0 and k % (32 * chunk * num_warps) == 0 and m == rows,
        BYTE_ASM=not INTERPRETED if byte_asm is None else byte_asm,
        PDL=pdl,
        launch_pdl=pdl,
        EARLY_W=pdl and (True if early is None else early),
        HAS_SCALE=scale is not None,
        num_warps=num_warps,
    )
    return out


SHAPES = {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}
LAYERS = 36
GRID = {
    "int8": [(bn, w, c) for bn, w, c in itertools.product((2, 4), (1, 2, 4), (8, 16))],
    "bf16": [(bn, w, c) for bn, w, c in itertools.product((2, 4), (1, 2, 4), (4, 8))],
}  # c: weights, 8-16 bytes
V1_GRID = {
    "int8": [(4, 4, 8), (4, 2, 16), (2, 4, 16)],
    "bf16": [],
}  # v1's best (int8: its byte conversion)


def matrix(fmt: str, n: int, k: int):
    "(weight, scale) for `rows_gemv` and `gemv`: int8 with its per-row scale, or bf16 and None."
    w = torch.randn(n, k, device=DEVICE) / k**0.5
    return quantize_int8(w) if fmt == "int8" else (w.bfloat16(), None)


def head():
    "The LM head alone (151,936 x 2,560 BF16, 778 MB: no L2 reuse), one row: the tile kernel against the rows layout."
    q, _ = matrix("bf16", 151936, 2560)
    x = torch.randn(1, 2560, device=DEVICE).bfloat16()
    want = F.linear(x.float(), q.float())
    configs = [
        ("tile", 4, 512, 2),
        ("tile", 4, 512, 4),
        ("rows", 4, 512, 2),
        ("rows", 2, 512, 2),
        ("rows", 4, 256, 1),
        ("rows", 8, 512, 2),
        ("rows", 4, 1024, 4),
    ]
    ok = True
    for layout, bn, bk, w in configs:
        fn = lambda: gemv(x, q, layout=layout, block_n=bn, block_k=bk, num_warps=w)
        ok &= validate(f"head {layout} ({bn}, {bk}, {w})", fn().float(), want, 1e-2)
        ms = graphed_ms(fn)
        print(
            f"head {layout} ({bn}, {bk}, {w}): {ms * 1e3:7.2f} us, {q.nbytes / ms / 1e9:5.2f} TB/s",
            flush=True,
        )
    finish(ok)


def precision():
    """v1's int8 byte conversion (a byte under 2^15; 2^15 + 128 times x's sum taken off afterwards) against the exact
    one (the export's), on the CPU: the largest error relative to the largest output, in bf16 and in fp32 outputs, for
    plain activations and for activations with 1% outlier features 5x larger."""
    torch.manual_seed(0)
    for k in (2560, 9728):
        q, scale = quantize_int8(torch.randn(32, k) / k**0.5)
        for outliers in (False, True):
            x = (
                (torch.randn(1, k) * (1 + 4 * outliers * (torch.rand(1, k) > 0.99)))
                .bfloat16()
                .float()
            )  # bf16 values
            ref = (x.double() @ q.double().T) * scale.double()
            rel = lambda got: ((got.double() - ref).abs().max() / ref.abs().max()).item()
            errors = []
            for dtype in (torch.bfloat16, torch.float32):
                xd = x.to(dtype)
                errors += [
                    rel(gemv(xd, q, None, scale, impl="triton")),
                    rel(rows_gemv(xd, q, scale, block_n=4, num_warps=2, chunk=16, byte_asm=False)),
                ]
            print(
                f"K={k} outliers={outliers!s:5s}: bf16 out exact {errors[0]:.2e}, v1 {errors[1]:.2e}; "
                f"fp32 out exact {errors[2]:.2e}, v1 {errors[3]:.2e}"
            )


def sass():
    sys.path.insert(0, os.path.dirname(__file__))
    from gemv_sass import gemv_loop, loop_sass, resident_warps

    print("variant                 rows warps chunk  instr/weight  regs  warps/SM  KB/SM")
    for fmt, weight, size in (("int8", "*i8", 1), ("bf16", "*bf16", 2)):
        sig = {
            "x_ptr": "*bf16",
            "q_ptr": weight,
            "scale_ptr": "*fp32",
            "out_ptr": "*bf16",
            "M": "i32",
            "N": "i32",
            "K": "i32",
            "stride_qn": "i32",
            **{
                c: "constexpr"
                for c in (
                    "ROWS",
                    "BLOCK_N",
                    "CHUNK",
                    "SLABS",
                    "EVEN",
                    "BYTE_ASM",
                    "PDL",
                    "EARLY_W",
                    "HAS_SCALE",
                )
            },
        }
        exports = (
            ((4, 1024, 4), (8, 512, 2), (4, 2048, 4))
            if fmt == "int8"
            else ((8, 512, 4), (4, 512, 4), (2, 1024, 4))
        )
        for bn, bk, w in exports:
            body, per_thread, regs = gemv_loop(weight, bn, bk, w, fmt == "int8")
            print(
                f"{fmt} export {bn} x {bk:4d}     -  {w:4d}     -  {len(body) / per_thread:6.2f} ({len(body)})  "
                f"{regs:4d}  {resident_warps(regs, w):8d}"
            )
        chunks = (8, 16) if fmt == "int8" else (4, 8)
        for bn, w, c, early in (
            (4, 2, chunks[0], False),
            (4, 2, chunks[0], True),
            (4, 4, chunks[1], True),
            (8, 2, chunks[0], True),
            (4, 1, chunks[1], True),
        ):
            body, regs = loop_sass(
                _rows_kernel,
                sig,
                dict(
                    ROWS=1,
                    BLOCK_N=bn,
                    CHUNK=c,
                    SLABS=w,
                    EVEN=True,
                    BYTE_ASM=True,
                    PDL=True,
                    EARLY_W=early,
                    HAS_SCALE=fmt == "int8",
                ),
                w,
            )
            warps = resident_warps(regs, w)
            print(
                f"{fmt} v1 early={early!s:5s}    {bn:4d} {w:5d} {c:5d}  {len(body) / (bn * c):6.2f} ({len(body)})  "
                f"{regs:4d}  {warps:8d}  {warps * 32 * bn * c * size / 1024:5.1f}"
            )


def main():
    formats = (sys.argv[1] if len(sys.argv) > 1 else "int8,bf16").split(",")
    ok = True
    cases = (
        ((1, 96, 512), (2, 40, 1024), (1, 2560, 4096), (3, 72, 2560), (1, 24, 576))
        if ON_GPU
        else ((1, 8, 256), (2, 5, 512), (1, 4, 576))
    )
    for fmt, (m, n, k) in itertools.product(formats, cases):
        q, scale = matrix(fmt, n, k)
        x = torch.randn(m, k, device=DEVICE).bfloat16()
        ref = F.linear(x.float(), q.float()) * (scale if scale is not None else 1)
        for asm in (True, False) if ON_GPU and fmt == "int8" else (None,):
            for bn, warps, chunk in ((4, 2, 8), (2, 1, 16 if fmt == "int8" else 4), (8, 4, 8)):
                for early in (True, False) if ON_GPU else (None,):
                    got = rows_gemv(
                        x,
                        q,
                        scale,
                        block_n=bn,
                        num_warps=warps,
                        chunk=chunk,
                        early=early,
                        byte_asm=asm,
                    )
                    ok &= validate(
                        f"{fmt} v1 M={m} N={n} K={k} rows={bn} warps={warps} chunk={chunk} asm={asm} "
                        f"early={early}",
                        got.float(),
                        ref,
                        1e-2,
                    )
    if not ON_GPU:
        finish(ok)
    print(
        f"\n== {LAYERS} GEMVs of one shape, distinct weights, one CUDA-graph replay; ceiling {HBM_BYTES_PER_S / 1e12:.2f} TB/s"
    )
    for fmt, (label, (n, k)) in itertools.product(formats, SHAPES.items()):
        layers = [matrix(fmt, n, k) for _ in range(LAYERS)]
        x = torch.randn(1, k, device=DEVICE).bfloat16()
        nbytes = n * k * LAYERS * (1 if fmt == "int8" else 2)

        def chain(fn):
            ms = graphed_ms(lambda: [fn(x, q, s) for q, s in layers])
            return ms * 1e3 / LAYERS, nbytes / ms / 1e9

        us, tbs = chain(lambda x, q, s: gemv(x, q, None, s))
        print(
            f"{fmt} {label:8s} exported {gemv_layout(n, k, 1 if fmt == 'int8' else 2)} "
            f"{gemv_config(n, k, 1 if fmt == 'int8' else 2)}: {us:6.2f} us a matrix, "
            f"{tbs:5.2f} TB/s"
        )
        results = []
        for variant, grid in (("export rows", GRID[fmt]), ("v1", V1_GRID[fmt])):
            for bn, w, c in grid:
                if variant == "v1":
                    fn = lambda x, q, s: rows_gemv(x, q, s, block_n=bn, num_warps=w, chunk=c)
                else:  # chapter 09's `_gemv_rows_kernel` (its int8 conversion exact, as the tile kernel's)
                    fn = lambda x, q, s: gemv(
                        x, q, None, s, layout="rows", block_n=bn, block_k=32 * w * c, num_warps=w
                    )
                try:
                    us_v, tbs_v = chain(fn)
                except Exception as e:  # a configuration the compiler refuses
                    print(
                        f"  {variant} rows={bn} warps={w} chunk={c}: failed: {type(e).__name__}: {str(e)[:120]}"
                    )
                    continue
                results.append((us_v, variant, bn, w, c, tbs_v))
        for us_v, variant, bn, w, c, tbs_v in sorted(results)[:6]:
            print(
                f"  {variant:11s} rows={bn:2d} warps={w} chunk={c:2d}: {us_v:6.2f} us, {tbs_v:5.2f} TB/s"
            )
    finish(ok)


if __name__ == "__main__":
    {"sass": sass, "head": head, "precision": precision}.get(
        sys.argv[1] if len(sys.argv) > 1 else "", main
    )()
