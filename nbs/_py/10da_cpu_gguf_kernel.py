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
# | Q5_0, Q5_1 | Q4_0's (`− 16 d`) and Q4_1's, with a fifth bit a weight | the same |
# | Q4_K | `d · s_j · qw − dmin · m_j` | `d s_j · dx · Σ qw qx − dmin m_j · dx Σ qx` |
# | Q6_K | `d · s_i · (qw − 32)` | `d · dx · (s_lo Σ_lo + s_hi Σ_hi)`, `qw − 32` signed as Q8_0's |
#
# so the input's `dx Σ qx` is computed once per block and row, not per weight. The K types (a Q4_K_M
# file's) group 8 blocks into a super-block of 256 weights with one `d` (and `dmin`) and a 6-bit
# scale `s_j` and minimum `m_j` per block (Q4_K; Q5_K the same with a fifth bit a weight), or an
# int8 scale per 16 weights (Q6_K, whose 6-bit quants are split into 4 low and 2 high bits). A block of 32 inputs still meets one block of 32
# weights: a super-block's scales are decoded once and its 8 blocks go through the same dot. On x86 with AVX2,
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
#
# Each row asks for its weights `PREFETCH_BYTES` (4 KiB) ahead of the block it reads. Left to the
# hardware, a core streaming a matrix larger than the caches keeps too few misses in flight. On a
# 2-core Xeon, one row times Qwen3-14B's gate_up as Q4_1 took 14.2 ms without it and 5.2 ms with it,
# and Q4_K 9.4 against 4.3 ms. A split model's two Qwen3-14B int4 layers on that CPU (chapter 10h)
# went from 56.3 to 22.9 ms a decode step. Commands: `PYTHONPATH=. python3
# kernels_lab/cpu_gguf_prefetch.py` (every type, 0 to 8 KiB ahead) and `PYTHONPATH=. python3
# kernels_lab/offload_bandwidth.py --no-model`.

# %%
#| export
GGUF_CPU_SOURCE = r"""
// y [M, N] = x [M, K] @ GGUF rows [N, K/32 blocks] .T, in fp32: each block of 32 inputs quantized to int8 (its
// scale dx, dx times the sum of its quants sx), then integer dot products with the weight blocks, as they are.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
enum { MAX_ROWS = 16 };
// weights asked for this many bytes ahead of the block being read (their rows lie back to back, so past a row's end
// is the next row's start): without it a core streams a large matrix at a third of the rate (the chapter's figure)
enum { PREFETCH_BYTES = 4096 };
static int k_type(int qtype) { return qtype == Q4_K || qtype == Q5_K || qtype == Q6_K; }  // super-blocks of 256
static int known_type(int qtype) {
    return qtype == Q4_0 || qtype == Q4_1 || qtype == Q5_0 || qtype == Q5_1 || qtype == Q8_0 || k_type(qtype);
}
static size_t row_bytes(int qtype, int nb) {  // of a row of nb blocks of 32 weights
    switch (qtype) {
        case Q4_0: return (size_t)nb * 18;
        case Q4_1: return (size_t)nb * 20;
        case Q5_0: return (size_t)nb * 22;
        case Q5_1: return (size_t)nb * 24;
        case Q8_0: return (size_t)nb * 34;
        case Q4_K: return (size_t)nb / 8 * 144;
        case Q5_K: return (size_t)nb / 8 * 176;
        default: return (size_t)nb / 8 * 210;  // Q6_K
    }
}
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

static int quants_at(int qtype) {  // where a 32-weight block's quants start
    return qtype == Q4_1 ? 4 : qtype == Q5_0 ? 6 : qtype == Q5_1 ? 8 : 2;
}
static uint32_t fifth_bits(const uint8_t *p, int qtype) {  // Q5_0 / Q5_1: bit i the fifth bit of weight i
    uint32_t bits;
    memcpy(&bits, p + (qtype == Q5_0 ? 2 : 4), 4);
    return bits;
}
static float block_offset(const uint8_t *p, int qtype, float d) {  // a 32-weight block's m: weight = d q + m
    return qtype == Q4_1 || qtype == Q5_1 ? half_to_float(*(const uint16_t *)(p + 2))
           : qtype == Q4_0 ? -8.f * d : qtype == Q5_0 ? -16.f * d : 0.f;
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

// Q4_K: all 8 scales and minima of a super-block at once, from its 12 packed bytes taken as words a, b, c. Bytes
// 0-3 (a) hold scales 0-3 in their low 6 bits and the top 2 bits of scales 4-7; bytes 4-7 (b) the same for the
// minima; bytes 8-11 (c) the low 4 bits of scales 4-7 (low nibbles) and of minima 4-7 (high nibbles).
static inline void k4_scales_mins(const uint8_t *s, uint8_t scales[8], uint8_t mins[8]) {
    uint32_t a, b, c, out[4];
    memcpy(&a, s, 4), memcpy(&b, s + 4, 4), memcpy(&c, s + 8, 4);
    out[0] = a & 0x3f3f3f3f;
    out[1] = (c & 0x0f0f0f0f) | (((a >> 6) & 0x03030303) << 4);
    out[2] = b & 0x3f3f3f3f;
    out[3] = ((c >> 4) & 0x0f0f0f0f) | (((b >> 6) & 0x03030303) << 4);
    memcpy(scales, out, 8), memcpy(mins, out + 2, 8);
}

// Block b (32 weights) of a GGUF row: weight i = dw[i / 16] * q[i] + m, q the block's integers (signed for Q8_0
// and Q6_K, else 0..63). In plain C: the fallback without AVX2, and the statement of what the SIMD code reads.
static inline void unpack_block(const uint8_t *row, int qtype, int b, int8_t q[32], float dw[2], float *m) {
    if (qtype == Q4_K || qtype == Q5_K) {  // [d, dmin, 12 bytes of scales and mins, (Q5_K: 32 bytes of fifth
        // bits,) 128 bytes of nibbles] a super-block
        int five = qtype == Q5_K;
        const uint8_t *p = row + (size_t)(b / 8) * (five ? 176 : 144), *qs = p + (five ? 48 : 16) + 32 * (b % 8 / 2);
        uint8_t scales[8], mins[8];
        int shift = b % 2 ? 4 : 0;
        k4_scales_mins(p + 4, scales, mins);
        dw[0] = dw[1] = half_to_float(*(const uint16_t *)p) * scales[b % 8];
        *m = -half_to_float(*(const uint16_t *)(p + 2)) * mins[b % 8];
        for (int i = 0; i < 32; i++) q[i] = ((qs[i] >> shift) & 0xf) | (five ? ((p[16 + i] >> (b % 8)) & 1) << 4 : 0);
    } else if (qtype == Q6_K) {  // [128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, d] a super-block
        const uint8_t *p = row + (size_t)(b / 8) * 210;
        int half = b % 8 / 4, k = b % 4;
        const uint8_t *ql = p + 64 * half + 32 * (k % 2), *qh = p + 128 + 32 * half;
        const int8_t *scales = (const int8_t *)(p + 192) + 8 * half + 2 * k;
        float d = half_to_float(*(const uint16_t *)(p + 208));
        dw[0] = d * scales[0], dw[1] = d * scales[1], *m = 0.f;
        for (int i = 0; i < 32; i++) q[i] = (((ql[i] >> (k < 2 ? 0 : 4)) & 0xf) | (((qh[i] >> 2 * k) & 3) << 4)) - 32;
    } else {  // [d, (m,) quants] a block of 32
        const uint8_t *p = row + row_bytes(qtype, b), *qs = p + quants_at(qtype);
        float d = half_to_float(*(const uint16_t *)p);
        dw[0] = dw[1] = d, *m = block_offset(p, qtype, d);
        uint32_t fifth = qtype == Q5_0 || qtype == Q5_1 ? fifth_bits(p, qtype) : 0;
        for (int i = 0; i < 32; i++)
            q[i] = qtype == Q8_0 ? (int8_t)qs[i] : (i < 16 ? qs[i] & 0xf : qs[i - 16] >> 4) | ((fifth >> i) & 1) << 4;
    }
}

#ifdef __AVX2__
static inline __m256i nibbles(const uint8_t *qs) {  // 16 bytes -> 32 quants: low nibbles first, then high
    __m128i b = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

static inline __m256i bit_bytes(uint32_t bits) {  // byte i = 0xff where bit i is set, else 0
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),  // byte i / 8 of the word in byte i
                                    _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                     2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    __m256i bit = _mm256_set1_epi64x(0x8040201008040201);  // bit i % 8 in byte i
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

// unpack_block's q in a vector, its scale dw and offset m: the block at p of a 32-weight type
static inline __m256i block_quants(const uint8_t *p, int qtype, float *dw, float *m) {
    float d = half_to_float(*(const uint16_t *)p);
    *dw = d, *m = block_offset(p, qtype, d);
    if (qtype == Q8_0) return _mm256_loadu_si256((const __m256i *)(p + 2));
    __m256i q = nibbles(p + quants_at(qtype));
    if (qtype == Q5_0 || qtype == Q5_1)
        q = _mm256_or_si256(q, _mm256_and_si256(bit_bytes(fifth_bits(p, qtype)), _mm256_set1_epi8(16)));
    return q;
}

// the same for the 8 blocks of super-block `sb` of a K type at once (scales for each half of 16: dw, dw_high),
// its scales decoded once, each load used twice
static inline void super_block_quants(const uint8_t *row, int qtype, int sb, __m256i w[8], float dw[8],
                                      float dw_high[8], float m[8]) {
    __m256i low4 = _mm256_set1_epi8(0x0f);
    if (qtype == Q4_K || qtype == Q5_K) {
        int five = qtype == Q5_K;
        const uint8_t *p = row + (size_t)sb * (five ? 176 : 144);
        float d = half_to_float(*(const uint16_t *)p), dmin = half_to_float(*(const uint16_t *)(p + 2));
        uint8_t scales[8], mins[8];
        k4_scales_mins(p + 4, scales, mins);
        __m256 s8 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)scales)));
        __m256 m8 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)mins)));
        _mm256_storeu_ps(dw, _mm256_mul_ps(_mm256_set1_ps(d), s8));
        _mm256_storeu_ps(dw_high, _mm256_mul_ps(_mm256_set1_ps(d), s8));
        _mm256_storeu_ps(m, _mm256_mul_ps(_mm256_set1_ps(-dmin), m8));
        for (int c = 0; c < 4; c++) {  // 32 bytes: block 2c in the low nibbles, 2c + 1 in the high
            __m256i v = _mm256_loadu_si256((const __m256i *)(p + (five ? 48 : 16) + 32 * c));
            w[2 * c] = _mm256_and_si256(v, low4), w[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        }
        if (five) {  // Q5_K: bit j of byte i of the 32 bytes at 16 is the fifth bit of weight i of block j
            __m256i fifth = _mm256_loadu_si256((const __m256i *)(p + 16)), one = _mm256_set1_epi8(1);
            for (int j = 0; j < 8; j++) {
                __m256i bit = _mm256_and_si256(_mm256_srl_epi16(fifth, _mm_cvtsi32_si128(j)), one);
                w[j] = _mm256_or_si256(w[j], _mm256_slli_epi16(bit, 4));
            }
        }
    } else {  // Q6_K
        const uint8_t *p = row + (size_t)sb * 210;
        __m256 d = _mm256_set1_ps(half_to_float(*(const uint16_t *)(p + 208)));
        __m128i scales = _mm_shuffle_epi8(  // the 16 int8 scales: block j's first half's 8, then its second half's
            _mm_loadu_si128((const __m128i *)(p + 192)),
            _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
        __m256 first = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(scales));
        __m256 second = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(scales, 8)));
        _mm256_storeu_ps(dw, _mm256_mul_ps(d, first)), _mm256_storeu_ps(dw_high, _mm256_mul_ps(d, second));
        _mm256_storeu_ps(m, _mm256_setzero_ps());
        __m256i two = _mm256_set1_epi8(3), offset = _mm256_set1_epi8(32);
        for (int half = 0; half < 2; half++) {
            __m256i ql0 = _mm256_loadu_si256((const __m256i *)(p + 64 * half));
            __m256i ql1 = _mm256_loadu_si256((const __m256i *)(p + 64 * half + 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * half));
            __m256i low[4] = {_mm256_and_si256(ql0, low4), _mm256_and_si256(ql1, low4),
                              _mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                              _mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4)};
            __m256i high[4] = {_mm256_and_si256(qh, two), _mm256_and_si256(_mm256_srli_epi16(qh, 2), two),
                               _mm256_and_si256(_mm256_srli_epi16(qh, 4), two),
                               _mm256_and_si256(_mm256_srli_epi16(qh, 6), two)};
            for (int k = 0; k < 4; k++) {
                w[4 * half + k] = _mm256_sub_epi8(_mm256_or_si256(low[k], _mm256_slli_epi16(high[k], 4)), offset);
            }
        }
    }
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

// one weight block (its integers w, scale dw, or dw and dw_high for each half of 16 when `halves`, offset m) . the
// same block of R input rows, nb blocks apart, into the rows' accumulators (acc: the integer dots times the
// scales, a dot's lanes 0-3 the first half; sum: the offsets m dx sx)
static inline __attribute__((always_inline)) void block_dot(__m256i w, float dw, float dw_high, int halves, float m,
                                                             int is_signed, const xblock *x, int nb, int R,
                                                             __m256 acc[4], float sum[4]) {
    __m256i aw = is_signed ? _mm256_sign_epi8(w, w) : w;
    __m256 scales = _mm256_setr_ps(dw, dw, dw, dw, dw_high, dw_high, dw_high, dw_high);
    for (int r = 0; r < R; r++) {
        const xblock *xr = x + (size_t)r * nb;
        __m256i xq = _mm256_loadu_si256((const __m256i *)xr->q);
        if (is_signed) xq = _mm256_sign_epi8(xq, w);
        else sum[r] += m * xr->s;
        __m256 scale = halves ? _mm256_mul_ps(scales, _mm256_set1_ps(xr->d)) : _mm256_set1_ps(dw * xr->d);
        acc[r] = _mm256_fmadd_ps(dot_ps(aw, xq), scale, acc[r]);
    }
}
#endif

// one weight row . R input rows (R = 1..4, a constant after inlining: the accumulators stay in registers), each
// the sum over blocks of dw dx (integer dot), plus the offsets m dx sx
static inline __attribute__((always_inline)) void row_dot(
    const uint8_t *row, int qtype, int nb, const xblock *x, int R, float *y, size_t ystride) {
    float sum[4] = {0.f, 0.f, 0.f, 0.f};
    int b = 0;
#ifdef __AVX2__
    int is_signed = qtype == Q8_0 || qtype == Q6_K;  // made unsigned by moving the sign onto the input
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    if (k_type(qtype)) {
        for (size_t size = row_bytes(qtype, 8); b < nb; b += 8) {
            for (size_t line = 0; line < size; line += 64)
                __builtin_prefetch(row + size * (b / 8) + PREFETCH_BYTES + line);
            __m256i w[8];
            float dw[8], dw_high[8], m[8];
            super_block_quants(row, qtype, b / 8, w, dw, dw_high, m);
            for (int j = 0; j < 8; j++)
                block_dot(w[j], dw[j], dw_high[j], qtype == Q6_K, m[j], is_signed, x + b + j, nb, R, acc, sum);
        }
    }
    for (size_t size = row_bytes(qtype, 1); b < nb; b++) {
        __builtin_prefetch(row + size * b + PREFETCH_BYTES);
        float dw, m;
        __m256i w = block_quants(row + size * b, qtype, &dw, &m);
        block_dot(w, dw, dw, 0, m, is_signed, x + b, nb, R, acc, sum);
    }
    for (int r = 0; r < R; r++) sum[r] += hsum(acc[r]);
#endif
    for (; b < nb; b++) {  // without AVX2: all of it
        __builtin_prefetch(row + row_bytes(qtype, b) + PREFETCH_BYTES);
        int8_t q[32];
        float dw[2], m;
        unpack_block(row, qtype, b, q, dw, &m);
        for (int r = 0; r < R; r++) {
            const xblock *xr = x + (size_t)r * nb + b;
            int32_t low = 0, high = 0;
            for (int i = 0; i < 16; i++) low += q[i] * xr->q[i], high += q[i + 16] * xr->q[i + 16];
            sum[r] += xr->d * (dw[0] * (float)low + dw[1] * (float)high) + m * xr->s;
        }
    }
    for (int r = 0; r < R; r++) y[r * ystride] = sum[r];
}

// y [M, N] (rows ystride floats apart) = the M rows of input blocks xb @ GGUF rows w [N, nb blocks] .T, the
// weight rows split between the threads: a step that quantizes its inputs once calls it for each run of rows
// one weight row . all M input rows, four, two, then one at a time
static inline __attribute__((always_inline)) void rows_dot(const uint8_t *row, int qtype, int nb, const xblock *xb,
                                                            int M, float *y, size_t ystride) {
    int m = 0;
    for (; m + 4 <= M; m += 4) row_dot(row, qtype, nb, xb + (size_t)m * nb, 4, y + m * ystride, ystride);
    for (; m + 2 <= M; m += 2) row_dot(row, qtype, nb, xb + (size_t)m * nb, 2, y + m * ystride, ystride);
    for (; m < M; m++) row_dot(row, qtype, nb, xb + (size_t)m * nb, 1, y + m * ystride, ystride);
}

static void gguf_rows(const xblock *xb, int M, int nb, const uint8_t *w, int N, int qtype, float *y,
                      size_t ystride, int threads) {
    size_t stride = row_bytes(qtype, nb);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int n = 0; n < N; n++) {
        const uint8_t *row = w + (size_t)n * stride;
        switch (qtype) {  // a copy of the loops for each type, its type's branches decided when compiled
            case Q4_0: rows_dot(row, Q4_0, nb, xb, M, y + n, ystride); break;
            case Q4_1: rows_dot(row, Q4_1, nb, xb, M, y + n, ystride); break;
            case Q5_0: rows_dot(row, Q5_0, nb, xb, M, y + n, ystride); break;
            case Q5_1: rows_dot(row, Q5_1, nb, xb, M, y + n, ystride); break;
            case Q8_0: rows_dot(row, Q8_0, nb, xb, M, y + n, ystride); break;
            case Q4_K: rows_dot(row, Q4_K, nb, xb, M, y + n, ystride); break;
            case Q5_K: rows_dot(row, Q5_K, nb, xb, M, y + n, ystride); break;
            default: rows_dot(row, Q6_K, nb, xb, M, y + n, ystride);
        }
    }
}

// returns 0, or -1 for a type it does not know or more than MAX_ROWS rows
int gguf_matmul(const float *x, int M, int K, const uint8_t *w, int N, int qtype, float *y, int threads) {
    if (M > MAX_ROWS || M < 1 || K % (k_type(qtype) ? 256 : 32) || !known_type(qtype)) return -1;
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
# 14.6 ms). So: Q4_0 / Q4_1 at one row, Q8_0 up to 16 rows. The Q5 and K types (Q4_K_M and Q5_K_M
# files' types) have no PyTorch GEMM to lose to (chapter 10e dequantizes them, a tile at a time):
# the kernel takes them at every count it can.

# %%
#| export
NATIVE_MAX_ROWS = {
    2: 1,
    3: 1,
    6: 16,
    7: 16,
    8: 16,
    12: 16,
    13: 16,
    14: 16,
}  # GGUF type -> most rows here
NATIVE_BLOCK = {
    12: 256,
    13: 256,
    14: 256,
}  # the K types' rows: super-blocks of 256 weights; the others 32


def native_gguf_runs(x: torch.Tensor, qtype: int) -> bool:
    "Whether `native_gguf_matmul` takes x [M, K] against `qtype` rows: a CPU tensor, few rows, a kernel built here."
    return (
        x.device.type == "cpu"
        and x.shape[0] <= NATIVE_MAX_ROWS.get(qtype, 0)
        and x.shape[-1] % NATIVE_BLOCK.get(qtype, 32) == 0
        and not isinstance(_gguf_kernel(), str)
    )


def native_gguf_matmul(x: torch.Tensor, raw: torch.Tensor, qtype: int) -> torch.Tensor | None:
    """x [M, K] @ GGUF rows `raw` [N, bytes a row] .T -> [M, N] in x's dtype through the C kernel; None where it does
    not run (`native_gguf_runs`)."""
    if not native_gguf_runs(x, qtype):
        return None
    return _run_gguf_kernel(_gguf_kernel(), x, raw, qtype)


def _run_gguf_kernel(kernel, x: torch.Tensor, raw: torch.Tensor, qtype: int) -> torch.Tensor:
    "x @ raw.T through a build of `gguf_matmul`."
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


def check_gguf_kernel(kernel) -> None:
    "A build of `gguf_matmul` against the reference, every type, 1 to NATIVE_MAX_ROWS rows."
    for qtype in NATIVE_MAX_ROWS:
        k = NATIVE_BLOCK.get(qtype, 32) * (2 if qtype in NATIVE_BLOCK else 7)
        raw = gguf_bytes(qtype, 37, k, seed=qtype)  # odd counts: no row or block left out
        for rows in range(1, NATIVE_MAX_ROWS[qtype] + 1):
            x = exact_inputs(rows, k, seed=rows)
            want, got = (
                gguf_matmul_reference(x, raw, qtype),
                _run_gguf_kernel(kernel, x, raw, qtype),
            )
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max()), (qtype, rows)
        x = torch.randn(1, k)
        want = gguf_matmul_reference(x, raw, qtype)
        rel = (_run_gguf_kernel(kernel, x, raw, qtype) - want).norm() / want.norm()
        assert rel < 2e-2, (qtype, rel)  # ordinary inputs: their int8 rounding, no more


if not isinstance(_gguf_kernel(), str):
    check_gguf_kernel(_gguf_kernel())
    assert (
        native_gguf_matmul(torch.randn(NATIVE_MAX_ROWS[2] + 1, 64), gguf_bytes(2, 4, 64), 2) is None
    )
    assert native_gguf_matmul(torch.randn(1, 96), gguf_bytes(12, 4, 256), 12) is None  # K % 256

# %% [markdown]
# Without AVX2 (an ARM laptop, an older x86) the plain C loops do all of it and `half_to_float`
# converts in software. The same source built as if this machine had neither passes the same checks.

# %%
plain = load_cpu_kernel("gguf_matmul_plain", "#undef __AVX2__\n#undef __F16C__\n" + GGUF_CPU_SOURCE)
if not isinstance(plain, str):
    p, i = ctypes.c_void_p, ctypes.c_int
    check_gguf_kernel(c_function(plain, "gguf_matmul", p, i, i, p, i, i, p, i))
