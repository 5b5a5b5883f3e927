# %% [markdown]
# # GGUF blocks on a CPU, in C
#
# > A GGUF matrix times a few rows on a CPU as llama.cpp computes it: each block of 32 inputs quantized to int8, integer dot products with the file's blocks as they are, in a few dozen lines of C compiled on first use.

# %%
#| default_exp quant.cpu_gguf

# %% [markdown]
# On a CPU, chapter 10e runs a GGUF layer through PyTorch's weight-only GEMMs: Q4_0 / Q4_1 as
# PyTorch's int4 GEMM (the nibbles repacked, the inputs in bf16), Q8_0 as one int8 GEMM per block of 32
# inputs. For a decode (one row) that leaves time on the table. The int4 GEMM turns every weight into
# a float before it multiplies, and the Q8_0 head of SmolLM2 (49,152 × 576) is 18 GEMMs and 18
# multiply-adds over the whole output, 2.4 ms of a 20 ms step at one row and 15 ms at eight.
#
# llama.cpp multiplies in integers instead. Each block of 32 inputs is quantized like a Q8_0 block:
# a scale `dx = max|x| / 127` and 32 int8 quants `qx`. A weight block's 32 quants `qw` (nibbles
# 0..15, or int8) then meet the input's in one integer dot product, and the block adds
#
# | type | weight | block's share of y |
# |---|---|---|
# | Q8_0 | `d · qw` | `d · dx · Σ qw qx` |
# | Q4_0 | `d · (qw − 8)` | `d · dx · Σ qw qx − 8 d · dx Σ qx` |
# | Q4_1 | `d · qw + m` | `d · dx · Σ qw qx + m · dx Σ qx` |
#
# so the input's `dx Σ qx` is computed once per block and row, not per weight. On x86 with AVX2,
# 32 unsigned × signed byte products summed in pairs are one instruction (`vpmaddubsw`; with
# AVX-512 VNNI, `vpdpbusd` sums in fours); a Q8_0 weight is made unsigned by moving its sign onto the
# input (`vpsignb`). Without AVX2 the same loops run in plain C. The file's bytes are read where
# they lie: no repacked copy of the weights.
#
# The price is the inputs' rounding to 8 bits: about 5e-3 relative error on a layer's outputs
# against 3e-3 for the bf16 inputs of PyTorch's int4 GEMM (`kernels_lab/cpu_gguf_kernel.py`);
# the perplexity bound of chapter 10e holds it (its test runs through this kernel where it is built).

# %%
#| export
from __future__ import annotations

import ctypes
import functools

import torch

from forge_engine.kernels.cpu import c_function, load_cpu_kernel

# %% [markdown]
# ## The kernel
#
# One C function, `gguf_matmul`: the inputs' blocks are quantized first, then `gguf_rows` has
# OpenMP split the output rows between the threads. Each weight row meets up to four input rows at
# a time, so a decoded weight block serves all four (the `R` accumulators stay in registers).
# (`gguf_rows` takes inputs already quantized: chapter 10f's decode step quantizes a layer's input
# once for the several runs of rows a GGUF layer may have.)

# %%
#| export
GGUF_CPU_SOURCE = r"""
// y [M, N] = x [M, K] @ GGUF rows [N, K/32 blocks] .T, in fp32: each block of 32 inputs quantized to int8 (its
// scale dx, dx times the sum of its quants sx), then integer dot products with the weight blocks, as they are.
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };
enum { MAX_ROWS = 16 };
static int block_bytes(int qtype) { return qtype == Q4_0 ? 18 : qtype == Q4_1 ? 20 : 34; }  // of 32 weights

static float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else { exp = 113; while (!(man & 0x400)) { man <<= 1; exp--; } bits = sign | (exp << 23) | ((man & 0x3ff) << 13); }
    } else if (exp == 31) bits = sign | 0x7f800000 | (man << 13);
    else bits = sign | ((exp + 112) << 23) | (man << 13);
    union { uint32_t u; float f; } v = { bits };
    return v.f;
#endif
}

typedef struct { float d, s; int8_t q[32]; } xblock;  // scale, scale x sum of the quants, quants

static void quantize_blocks(const float *x, int nb, xblock *out) {
    for (int b = 0; b < nb; b++, x += 32) {
        float amax = 0.f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[i]));
        float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        int32_t sum = 0;
        for (int i = 0; i < 32; i++) { int8_t q = (int8_t)lrintf(x[i] * id); out[b].q[i] = q; sum += q; }
        out[b].d = d; out[b].s = d * (float)sum;
    }
}

// sum of the 32 products of a weight block's quants with an input block's
static inline int32_t dot_u4(const uint8_t *qs, const int8_t *xq) {  // unsigned nibbles 0..15
    int32_t s = 0;
    for (int j = 0; j < 16; j++) s += (qs[j] & 0x0f) * xq[j] + (qs[j] >> 4) * xq[j + 16];
    return s;
}
static inline int32_t dot_i8(const int8_t *w, const int8_t *xq) {
    int32_t s = 0;
    for (int j = 0; j < 32; j++) s += w[j] * xq[j];
    return s;
}

#ifdef __AVX2__
static inline __m256i nibbles(const uint8_t *qs) {  // 16 bytes -> 32 quants: low nibbles first, then high
    __m128i b = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}
static inline __m256 dot_ps(__m256i w_unsigned, __m256i xq) {  // 8 partial sums, as floats
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w_unsigned, xq);
#elif defined(__AVXVNNI__)
    __m256i p = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w_unsigned, xq);
#else
    __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w_unsigned, xq), _mm256_set1_epi16(1));
#endif
    return _mm256_cvtepi32_ps(p);
}
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

// one weight row . R input rows (R = 1..4, a constant after inlining: the accumulators stay in registers), each
// the sum over blocks of dw dx (quant dot), plus the row's offsets: mw dx sx (Q4_1) or -8 dw dx sx (Q4_0)
static inline __attribute__((always_inline)) void row_dot(
    const uint8_t *row, int qtype, int nb, const xblock *x, int R, float *y, size_t ystride) {
    int size = block_bytes(qtype);
    float sum[4] = {0.f, 0.f, 0.f, 0.f};
    int b = 0;
#ifdef __AVX2__
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (; b < nb; b++) {
        const uint8_t *p = row + size * b;
        float dw = half_to_float(*(const uint16_t *)p);
        float mw = qtype == Q4_1 ? half_to_float(*(const uint16_t *)(p + 2)) : -8.f * dw;
        __m256i w = qtype == Q8_0 ? _mm256_loadu_si256((const __m256i *)(p + 2)) : nibbles(p + size - 16);
        __m256i aw = qtype == Q8_0 ? _mm256_sign_epi8(w, w) : w;
        for (int r = 0; r < R; r++) {
            const xblock *xr = x + (size_t)r * nb + b;
            __m256i xq = _mm256_loadu_si256((const __m256i *)xr->q);
            if (qtype == Q8_0) xq = _mm256_sign_epi8(xq, w);
            else sum[r] += mw * xr->s;
            acc[r] = _mm256_fmadd_ps(dot_ps(aw, xq), _mm256_set1_ps(dw * xr->d), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) sum[r] += hsum(acc[r]);
#endif
    for (; b < nb; b++) {  // without AVX2: all of it
        const uint8_t *p = row + size * b;
        float dw = half_to_float(*(const uint16_t *)p);
        for (int r = 0; r < R; r++) {
            const xblock *xr = x + (size_t)r * nb + b;
            if (qtype == Q8_0) {
                sum[r] += dw * xr->d * (float)dot_i8((const int8_t *)(p + 2), xr->q);
            } else {
                sum[r] += dw * xr->d * (float)dot_u4(p + size - 16, xr->q);
                sum[r] += (qtype == Q4_1 ? half_to_float(*(const uint16_t *)(p + 2)) : -8.f * dw) * xr->s;
            }
        }
    }
    for (int r = 0; r < R; r++) y[r * ystride] = sum[r];
}

// y [M, N] (rows ystride floats apart) = the M rows of input blocks xb @ GGUF rows w [N, nb blocks] .T, the
// weight rows split between the threads: a step that quantizes its inputs once calls it for each run of rows
static void gguf_rows(const xblock *xb, int M, int nb, const uint8_t *w, int N, int qtype, float *y,
                      size_t ystride, int threads) {
    size_t row_bytes = (size_t)nb * block_bytes(qtype);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int n = 0; n < N; n++) {
        const uint8_t *row = w + (size_t)n * row_bytes;
        int m = 0;
        for (; m + 4 <= M; m += 4) row_dot(row, qtype, nb, xb + (size_t)m * nb, 4, y + m * ystride + n, ystride);
        for (; m + 2 <= M; m += 2) row_dot(row, qtype, nb, xb + (size_t)m * nb, 2, y + m * ystride + n, ystride);
        for (; m < M; m++) row_dot(row, qtype, nb, xb + (size_t)m * nb, 1, y + m * ystride + n, ystride);
    }
}

// returns 0, or -1 for a type it does not know or more than MAX_ROWS rows
int gguf_matmul(const float *x, int M, int K, const uint8_t *w, int N, int qtype, float *y, int threads) {
    if (M > MAX_ROWS || M < 1 || K % 32 || (qtype != Q4_0 && qtype != Q4_1 && qtype != Q8_0)) return -1;
    int nb = K / 32;
    xblock *xb = malloc(sizeof(xblock) * (size_t)M * nb);
    if (!xb) return -2;
    for (int m = 0; m < M; m++) quantize_blocks(x + (size_t)m * K, nb, xb + (size_t)m * nb);
    gguf_rows(xb, M, nb, w, N, qtype, y, N, threads);
    free(xb);
    return 0;
}
"""


# %% [markdown]
# It is built and loaded as chapter 09_kernels_cpu builds its kernels: on first use, by the
# machine's C compiler, into the cache; without one, the layers keep PyTorch's GEMMs.

# %%
#| export
@functools.cache
def _gguf_kernel():
    "The compiled `gguf_matmul`, or why there is none (declared once a process: it is called every product)."
    library = load_cpu_kernel("gguf_matmul", GGUF_CPU_SOURCE)
    if isinstance(library, str):
        return library
    p, i = ctypes.c_void_p, ctypes.c_int
    return c_function(library, "gguf_matmul", p, i, i, p, i, i, p, i)


# %% [markdown]
# ## When it runs
#
# Measured on a 2-core AMD EPYC (AVX-512 VNNI) against chapter 10e's PyTorch path, SmolLM2-135M's
# layers (µs, `kernels_lab/cpu_gguf_kernel.py`): at one row the kernel is as fast as PyTorch's
# int4 GEMM or faster on the Q4_1 matrices (qkv 31 against 37, o 23 / 33, gate_up 71 / 78, down
# 44 / 50 in one run; within 10% either way in another, with the machine busy); at two rows and
# more PyTorch's GEMM, which reuses each weight over the rows in its own tiles, is faster (down
# at 4 rows: 115 against 85).
# The Q8_0 head is 3-5x faster at every count (one row 0.8 against 3.9 ms, eight rows 4.3 against
# 14.6 ms). So: Q4_0 / Q4_1 at one row, Q8_0 up to 16 rows.

# %%
#| export
NATIVE_MAX_ROWS = {2: 1, 3: 1, 8: 16}  # GGUF type (Q4_0, Q4_1, Q8_0) -> the most rows it runs here


def native_gguf_runs(x: torch.Tensor, qtype: int) -> bool:
    "Whether `native_gguf_matmul` takes x [M, K] against `qtype` rows: a CPU tensor, few rows, a kernel built here."
    return (
        x.device.type == "cpu"
        and x.shape[0] <= NATIVE_MAX_ROWS.get(qtype, 0)
        and x.shape[-1] % 32 == 0
        and not isinstance(_gguf_kernel(), str)
    )


def native_gguf_matmul(x: torch.Tensor, raw: torch.Tensor, qtype: int) -> torch.Tensor | None:
    """x [M, K] @ GGUF rows `raw` [N, bytes a row] .T -> [M, N] in x's dtype through the C kernel; None where it does
    not run (`native_gguf_runs`)."""
    if not native_gguf_runs(x, qtype):
        return None
    kernel = _gguf_kernel()
    inputs = x.to(torch.float32).contiguous()
    raw = raw.contiguous()
    out = torch.empty(x.shape[0], raw.shape[0], dtype=torch.float32)
    code = kernel(
        inputs.data_ptr(), x.shape[0], x.shape[1], raw.data_ptr(), raw.shape[0], qtype,
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if code != 0:
        raise RuntimeError(f"gguf_matmul refused {tuple(x.shape)} @ qtype {qtype} ({code})")
    return out.to(x.dtype)


# %% [markdown]
# ## Tests
#
# Against chapter 10d's reference, where the inputs' rounding is exact: each block of x is a scale
# times integers of at most 127, with 127 itself in it, so `dx` is that scale and `qx` those
# integers. What remains is float32 summation: the results agree to 1e-5.

# %%
from forge_engine.quant.gguf_blocks import gguf_bytes, gguf_matmul_reference


def exact_inputs(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    "x [rows, k] whose every block of 32 is a scale times int8 values, 127 among them (so its int8 rounding is exact)."
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (rows, k // 32, 32), generator=g).float()
    q[:, :, 0] = 127
    scale = torch.rand(rows, k // 32, 1, generator=g) + 0.01
    return (q * scale).reshape(rows, k)


if not isinstance(_gguf_kernel(), str):
    for qtype in (2, 3, 8):
        raw = gguf_bytes(qtype, 37, 32 * 7, seed=qtype)  # odd counts: no row or block left out
        for rows in range(1, NATIVE_MAX_ROWS[qtype] + 1):
            x = exact_inputs(rows, 32 * 7, seed=rows)
            want, got = gguf_matmul_reference(x, raw, qtype), native_gguf_matmul(x, raw, qtype)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max()), (qtype, rows)
        x = torch.randn(1, 32 * 7)
        want = gguf_matmul_reference(x, raw, qtype)
        rel = (native_gguf_matmul(x, raw, qtype) - want).norm() / want.norm()
        assert rel < 2e-2, (qtype, rel)  # ordinary inputs: their int8 rounding, no more
    assert (
        native_gguf_matmul(torch.randn(NATIVE_MAX_ROWS[2] + 1, 64), gguf_bytes(2, 4, 64), 2) is None
    )
