"""int4 GEMV with several weight rows a thread: x converted and summed once for all of them.

Napkin math (gemv_sass.py, session 13): the exported int4 GEMV (chapter 10) spends 5.5 instructions a weight in its
loop, while an H200 streaming int4 weights at 4.19 TB/s leaves about 4.2 (132 SMs x 4 warp-instructions a cycle at
1.98 GHz, 8.4 G weights a ms); its 96 registers leave 20 warps an SM, 20 KB in flight. Per weight it pays: two
byte permutes + an AND to place a nibble in a float (2.1), the multiply-add (1), and for the x it multiplies:
a bf16 -> fp32 conversion and a running sum (for the groups' minimums) (2): each thread holds one row's chunk, so
every row converts and sums the same x again.

This variant (v1):
  * a program owns BLOCK_N rows; each thread the same 8-byte chunk (16 weights) of every one of them, so x's 16
    values are loaded, converted and summed once a step for BLOCK_N rows;
  * a warp covers 256 contiguous bytes of a row per step (32 lanes x 8 bytes), the program's warps interleaved
    slabs of K (summed across warps once, at the end): K = 2560 is 5 slabs, 9728 is 19;
  * nibbles to floats in 1.4 instructions a weight: a byte in bits 16-23 gives its low nibble as 128 + q
    (mask 0x000F0000 | 0x43000000), a byte in bits 8-15 its high nibble as 128 + q / 16 (mask 0x0000F000): the
    word itself, shifted left and right by 8 and rotated by 16 put each byte once in each place (3 + 8 per 4 bytes).
    The high nibbles land 2^11 below their float's 128 (the exported kernel: 2^4): fp32 keeps ~13 of their bits.

Run from the repository root: PYTHONPATH=. python3 kernels_lab/int4_rows.py   (on a CPU: validation under the
interpreter; on a GPU: validation and the chain of gemv_chain_sweep.py, exported kernel against this one);
TRITON_INTERPRET=0 PYTHONPATH=. python3 kernels_lab/int4_rows.py sass   (no GPU: instructions a weight, registers)."""
import itertools
import os
import sys

if sys.argv[1:2] != ["sass"]:
    from common import DEVICE, HBM_BYTES_PER_S, ON_GPU, finish, graphed_ms, validate  # first: may switch on the interpreter
import torch
import triton
import triton.language as tl
import torch.nn.functional as F
from forge_engine.kernels import INTERPRETED, _start_gemv
from forge_engine.quant import dequantize_int4, int4_gemv, quant_gemv_config, quantize_int4


@triton.jit
def _nibbles_to_f32_v1(b, BYTE_ASM: tl.constexpr):
    "A uint8 tile -> (128 + low nibble, 128 + high nibble / 16) in fp32, exactly."
    if BYTE_ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 l, r, t;
            shl.b32 l, $8, 8;
            shr.b32 r, $8, 8;
            prmt.b32 t, $8, 0, 0x1032;
            lop3.b32 $0, t, 0x000F0000, 0x43000000, 0xEA;
            lop3.b32 $1, l, 0x000F0000, 0x43000000, 0xEA;
            lop3.b32 $2, $8, 0x000F0000, 0x43000000, 0xEA;
            lop3.b32 $3, r, 0x000F0000, 0x43000000, 0xEA;
            lop3.b32 $4, l, 0x0000F000, 0x43000000, 0xEA;
            lop3.b32 $5, $8, 0x0000F000, 0x43000000, 0xEA;
            lop3.b32 $6, r, 0x0000F000, 0x43000000, 0xEA;
            lop3.b32 $7, t, 0x0000F000, 0x43000000, 0xEA;
            }""", constraints="=r,=r,=r,=r,=r,=r,=r,=r,r", args=[b], dtype=(tl.float32, tl.float32), is_pure=True,
            pack=4)
    b = b.to(tl.int32)
    low = ((b & 0x0F) << 16) | 0x43000000
    high = ((b >> 4) << 12) | 0x43000000
    return low.to(tl.float32, bitcast=True), high.to(tl.float32, bitcast=True)


@triton.jit
def _load_step(x_ptr, q_ptr, scale_ptr, min_ptr, b0, lane, first_row, M, N, K, stride_qn, ROWS: tl.constexpr,
               BLOCK_N: tl.constexpr, GROUP: tl.constexpr, CHUNK: tl.constexpr, EVEN: tl.constexpr):
    "One step's loads, issued together: x's chunk (each row of x), then each weight row's chunk, scale and minimum."
    HALF: tl.constexpr = GROUP // 2  # bytes per group and row: byte j holds inputs j (low) and j + HALF (high)
    offs_j = tl.arange(0, CHUNK)[None, None, :]
    start = tl.multiple_of(b0 + lane * CHUNK, [CHUNK, CHUNK])  # [SLABS, 32] a thread's first byte in the row
    c_ok = (start < K // 2) | EVEN  # EVEN: whole steps and whole programs, no masks
    g = start // HALF
    x_at = x_ptr + (g * GROUP + start % HALF)[:, :, None] + offs_j  # inputs of the chunk's low nibbles
    xs = ()
    for m in tl.static_range(ROWS):
        x_ok = c_ok[:, :, None] & ((m < M) | EVEN)
        xs = xs + ((tl.load(x_at + m * K, mask=x_ok, other=0.0), tl.load(x_at + m * K + HALF, mask=x_ok, other=0.0)),)
    ws = ()
    for r in tl.static_range(BLOCK_N):
        row = first_row + r
        ok = c_ok & ((row < N) | EVEN)
        at = row * (K // GROUP) + g
        ws = ws + ((tl.load(q_ptr + row * stride_qn + start[:, :, None] + offs_j, mask=ok[:, :, None], other=0),
                    tl.load(scale_ptr + at, mask=ok, other=0.0), tl.load(min_ptr + at, mask=ok, other=0.0)),)
    return xs, ws


@triton.jit
def _add_step(accs, xs, ws, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BYTE_ASM: tl.constexpr):
    "accs[r * ROWS + m] + one step's sum of x[m] w[r] (dequantized) in each thread's chunk."
    sums = ()
    for m in tl.static_range(ROWS):  # x converted and summed once for all BLOCK_N rows
        x_lo, x_hi = xs[m][0].to(tl.float32), xs[m][1].to(tl.float32)
        s_lo, s_hi = tl.sum(x_lo, axis=2), tl.sum(x_hi, axis=2)
        sums = sums + ((x_lo, x_hi, 128.0 * s_lo + 2048.0 * s_hi, s_lo + s_hi),)
    new = ()
    for r in tl.static_range(BLOCK_N):
        b, s, mn = ws[r]
        f_lo, f_hi = _nibbles_to_f32_v1(b, BYTE_ASM)  # 128 + q_lo, 128 + q_hi / 16
        s, mn = s.to(tl.float32), mn.to(tl.float32)
        for m in tl.static_range(ROWS):
            x_lo, x_hi, offset, x_sum = sums[m]
            p = tl.sum(x_lo * f_lo, axis=2) + 16.0 * tl.sum(x_hi * f_hi, axis=2) - offset  # sum of x q
            new = new + (accs[r * ROWS + m] + p * s + x_sum * mn,)
    return new


@triton.jit
def _int4_rows_kernel(x_ptr, q_ptr, scale_ptr, min_ptr, out_ptr, M, N, K, stride_qn,
                      ROWS: tl.constexpr, BLOCK_N: tl.constexpr, SLABS: tl.constexpr, GROUP: tl.constexpr,
                      CHUNK: tl.constexpr, EVEN: tl.constexpr, AHEAD: tl.constexpr,
                      BYTE_ASM: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, LOOP_STAGES: tl.constexpr):
    _start_gemv(q_ptr, N, stride_qn, BLOCK_N, PDL, PREFETCH)
    STEP: tl.constexpr = SLABS * 32 * CHUNK  # bytes of a row per step: a slab of 32 x CHUNK per warp
    lane = tl.arange(0, SLABS)[:, None] * 32 + tl.arange(0, 32)[None, :]  # [SLABS, 32]: a thread's place in a step
    first_row = tl.program_id(0) * BLOCK_N
    accs = (tl.zeros((SLABS, 32), dtype=tl.float32),) * (ROWS * BLOCK_N)
    if AHEAD:  # the next step's loads issued before this step's arithmetic (registers double-buffered)
        xs, ws = _load_step(x_ptr, q_ptr, scale_ptr, min_ptr, 0, lane, first_row, M, N, K, stride_qn, ROWS, BLOCK_N,
                            GROUP, CHUNK, EVEN)
        for b0 in tl.range(STEP, K // 2, STEP, num_stages=1):
            xs_next, ws_next = _load_step(x_ptr, q_ptr, scale_ptr, min_ptr, b0, lane, first_row, M, N, K, stride_qn,
                                          ROWS, BLOCK_N, GROUP, CHUNK, EVEN)
            accs = _add_step(accs, xs, ws, ROWS, BLOCK_N, BYTE_ASM)
            xs, ws = xs_next, ws_next
        accs = _add_step(accs, xs, ws, ROWS, BLOCK_N, BYTE_ASM)
    else:
        for b0 in tl.range(0, K // 2, STEP, num_stages=LOOP_STAGES):
            xs, ws = _load_step(x_ptr, q_ptr, scale_ptr, min_ptr, b0, lane, first_row, M, N, K, stride_qn, ROWS, BLOCK_N,
                                GROUP, CHUNK, EVEN)
            accs = _add_step(accs, xs, ws, ROWS, BLOCK_N, BYTE_ASM)
    for m in tl.static_range(ROWS):
        for r in tl.static_range(BLOCK_N):
            row = first_row + r
            total = tl.sum(tl.sum(accs[r * ROWS + m], axis=1), axis=0)
            tl.store(out_ptr + m * N + row, total.to(out_ptr.dtype.element_ty), mask=(row < N) & (m < M))


def int4_rows_gemv(x, packed, scale, minimum, block_n=8, num_warps=2, chunk=8, ahead=False, byte_asm=None, pdl=None,
                   maxnreg=None):
    from forge_engine.kernels import pdl_supported
    x = x.contiguous()
    (m, k), n = x.shape, packed.shape[0]
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    pdl = pdl_supported(x.device) if pdl is None else pdl
    _int4_rows_kernel[(triton.cdiv(n, block_n),)](
        x, packed, scale, minimum, out, m, n, k, packed.stride(0), ROWS=1 << max(0, m - 1).bit_length(),
        BLOCK_N=block_n, SLABS=num_warps, GROUP=k // scale.shape[1],
        CHUNK=chunk, AHEAD=ahead, EVEN=n % block_n == 0 and k // 2 % (32 * chunk * num_warps) == 0 and m & (m - 1) == 0,
        BYTE_ASM=not INTERPRETED if byte_asm is None else byte_asm, PDL=pdl, launch_pdl=pdl, PREFETCH=0, LOOP_STAGES=1,
        num_warps=num_warps, **({"maxnreg": maxnreg} if maxnreg else {}))
    return out


SHAPES = {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}
LAYERS = 36
VALIDATE = ((8, 2, 8, False), (4, 4, 8, False), (2, 1, 8, False), (4, 2, 16, False), (4, 1, 8, True), (2, 2, 16, True))


def grid(k):
    "(rows, warps, chunk, ahead) to time for a shape: long rows (o, down) split over more warps."
    warps = (2, 4) if k >= 4096 else (1, 2)
    return [(bn, w, chunk, ahead) for chunk, ahead, w in itertools.product((8, 16), (False, True), warps)
            for bn in ((2, 4, 8) if chunk == 8 else (2, 4))]


def sass():
    sys.path.insert(0, os.path.dirname(__file__))
    from gemv_sass import INT4_SIGNATURE, int4_loop, loop_sass, resident_warps
    sig = {k: v for k, v in INT4_SIGNATURE.items() if k != "GROUPS"}
    sig = dict(list(sig.items())[:11] + [(k, "constexpr") for k in ("SLABS", "GROUP", "CHUNK", "EVEN", "AHEAD")]
               + [kv for kv in list(sig.items())[11:] if kv[0] != "GROUP"])
    print("variant        rows warps  instr/weight  regs  warps/SM  KB/SM")
    body, per_thread, regs = int4_loop(8, 512, 2, True)
    print(f"exported 8x512    -    2  {len(body) / per_thread:6.2f} ({len(body)})  {regs:4d}  {resident_warps(regs, 2):8d}")
    for bn, w, chunk, ahead in ((4, 1, 8, False), (4, 2, 8, False), (8, 2, 8, False), (2, 2, 16, False),
                                (4, 2, 16, False), (4, 1, 8, True), (2, 2, 16, True), (4, 2, 16, True)):
        body, regs = loop_sass(_int4_rows_kernel, sig, dict(ROWS=1, BLOCK_N=bn, SLABS=w, GROUP=128, CHUNK=chunk, EVEN=True,
                                                            AHEAD=ahead, BYTE_ASM=True, PDL=True, PREFETCH=0,
                                                            LOOP_STAGES=1), w)
        weights = bn * chunk * 2  # per thread per step
        warps = resident_warps(regs, w)
        print(f"v1 chunk={chunk:2d} ahead={ahead!s:5s} {bn:5d} {w:5d}  {len(body) / weights:6.2f} ({len(body)})  {regs:4d}  "
              f"{warps:8d}  {warps * 32 * bn * chunk * (2 if ahead else 1) / 1024:5.1f}")


def main():
    ok = True
    cases = ((1, 96, 512), (2, 40, 1024), (1, 2560, 4096), (3, 72, 2560), (1, 24, 576)) if ON_GPU else \
        ((1, 8, 256), (2, 5, 512), (1, 4, 576))
    for m, n, k in cases:
        w = quantize_int4((torch.randn(n, k, device=DEVICE) / k ** 0.5).bfloat16())
        x = torch.randn(m, k, device=DEVICE).bfloat16()
        ref = F.linear(x.float(), dequantize_int4(*w))
        for asm in ((True, False) if ON_GPU else (None,)):
            for bn, warps, chunk, ahead in VALIDATE:
                got = int4_rows_gemv(x, *w, block_n=bn, num_warps=warps, chunk=chunk, ahead=ahead, byte_asm=asm)
                ok &= validate(f"v1 M={m} N={n} K={k} rows={bn} warps={warps} chunk={chunk} ahead={ahead} asm={asm}",
                               got.float(), ref, 1e-2)
    if not ON_GPU:
        finish(ok)
    print(f"\n== {LAYERS} int4 GEMVs of one shape, distinct weights, one CUDA-graph replay; ceiling {HBM_BYTES_PER_S / 1e12:.2f} TB/s")
    total_export, total_best = 0.0, 0.0
    for label, (n, k) in SHAPES.items():
        layers = [quantize_int4((torch.randn(n, k, device=DEVICE) / k ** 0.5).bfloat16()) for _ in range(LAYERS)]
        x = torch.randn(1, k, device=DEVICE).bfloat16()
        nbytes = sum(t.numel() * t.element_size() for t in layers[0]) * LAYERS

        def chain(fn):
            ms = graphed_ms(lambda: [fn(x, *w) for w in layers])
            return ms, ms * 1e3 / LAYERS, nbytes / ms / 1e9
        ms, us, tbs = chain(int4_gemv)
        print(f"{label:8s} exported {quant_gemv_config(n, k)}: {us:6.2f} us a matrix, {tbs:5.2f} TB/s")
        total_export += us
        results = []
        for bn, w, chunk, ahead in grid(k):
            try:
                ms, us_v, tbs_v = chain(lambda x, *ws: int4_rows_gemv(x, *ws, block_n=bn, num_warps=w, chunk=chunk,
                                                                      ahead=ahead))
            except Exception as e:  # a configuration the compiler refuses (registers, shared memory)
                print(f"  v1 rows={bn} warps={w} chunk={chunk} ahead={ahead}: failed: {type(e).__name__}: {str(e)[:120]}")
                continue
            results.append((us_v, bn, w, chunk, ahead, tbs_v))
        for us_v, bn, w, chunk, ahead, tbs_v in sorted(results)[:8]:
            print(f"  v1 rows={bn:2d} warps={w} chunk={chunk:2d} ahead={ahead!s:5s}: {us_v:6.2f} us, {tbs_v:5.2f} TB/s")
        total_best += min(results)[0]
    print(f"a layer's four matrices: exported {total_export:.1f} us, v1 (best of each) {total_best:.1f} us")
    finish(ok)


if __name__ == "__main__":
    sass() if sys.argv[1:2] == ["sass"] else main()
