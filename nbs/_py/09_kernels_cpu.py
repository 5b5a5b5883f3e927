# %% [markdown]
# # Kernels in C for the CPU
#
# > On a laptop a decode step is thousands of small PyTorch operations: C functions compiled on first use do a step's hot loops in one call each, starting with decode attention over the paged cache.

# %%
#| default_exp kernels.cpu

# %% [markdown]
# On a CPU a decode step of a small model is not arithmetic-bound: SmolLM2-135M's step spends
# most of its 20 ms in ~2,800 PyTorch operations of a few microseconds each (chapter 10e). A C
# function does a loop's work in one call. This chapter builds such functions (the machine's C
# compiler, on first use, into the cache) and writes the first: **decode attention** over the
# paged pool of chapter 05, one new token a sequence. Chapter 10da adds the GGUF matmul the same way.
#
# A library is compiled by `$CC` (else `cc`) for the machine's own instruction set
# (`-march=native`), with OpenMP, into `$FORGE_HOME/kernels`, under a name that hashes the source,
# the compiler, the flags and the CPU's feature list: a cache shared between machines never loads
# another CPU's build. That takes about half a second, once. It is written under a temporary name
# and renamed, so a half-written library is never loaded. Without a compiler (or if it fails) the
# callers keep their PyTorch path, and `cpu_kernels_status()` says why. The library links OpenMP by
# its usual name, `libgomp.so.1`, which PyTorch's CPU build has already loaded: the kernels'
# threads are PyTorch's.

# %%
#| export
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

from forge_engine.registry import forge_home

# %%
#| export
# (-fno-trapping-math: no code here reads floating-point exception flags, so a loop with a comparison in it may
# vectorize)
CPU_KERNEL_FLAGS = ("-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC")


def _cpu_features() -> str:
    "The CPU's feature flags as Linux lists them (empty elsewhere): part of a build's name."
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def build_cpu_kernel(cache_dir: Path, name: str, source: str, compiler: str | None = None) -> Path:
    "The library of C `source` under `cache_dir` (built now if it is not there), or a RuntimeError naming why not."
    compiler = compiler or os.environ.get("CC") or "cc"
    key = "\0".join([source, compiler, *CPU_KERNEL_FLAGS, platform.machine(), _cpu_features()])
    path = cache_dir / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    if path.exists():
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        src, out = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
        src.write_text(source)
        try:
            done = subprocess.run(
                [compiler, *CPU_KERNEL_FLAGS, "-o", str(out), str(src)],
                capture_output=True,
                text=True,
                timeout=120,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RuntimeError(f"the C compiler {compiler!r} did not run: {e}") from None
        if done.returncode != 0:
            raise RuntimeError(
                f"{compiler} failed ({done.returncode}): {done.stderr.strip()[-500:]}"
            )
        os.replace(out, path)  # whole or not at all
    return path


@functools.cache
def load_cpu_kernel(name: str, source: str) -> ctypes.CDLL | str:
    "The library of `source`, loaded (built first if need be, once a process), or why there is none."
    try:
        return ctypes.CDLL(str(build_cpu_kernel(forge_home() / "kernels", name, source)))
    except (RuntimeError, OSError) as e:
        return str(e)


def c_function(library: ctypes.CDLL, name: str, *argtypes) -> ctypes._CFuncPtr:
    "`library.name`, declared as taking `argtypes` and returning an int (0: done)."
    function = getattr(library, name)
    function.restype, function.argtypes = ctypes.c_int, list(argtypes)
    return function


CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # what the C kernels read


def _same_cpu_dtype(*tensors) -> bool:
    "Whether the tensors are all on the CPU and all of one of CPU_KERNEL_DTYPES."
    dtype = tensors[0].dtype
    return dtype in CPU_KERNEL_DTYPES and all(
        t.device.type == "cpu" and t.dtype == dtype for t in tensors
    )


# %% [markdown]
# A compiler that fails leaves nothing behind and says why:

# %%
with tempfile.TemporaryDirectory() as tmp:
    try:
        build_cpu_kernel(Path(tmp), "broken", "this is not C")
        raise AssertionError("a broken source was built")
    except RuntimeError as e:
        assert "failed" in str(e) or "did not run" in str(e), e
    assert list(Path(tmp).iterdir()) == []  # no library, no temporary files

# %% [markdown]
# ## Decode attention
#
# One new token a sequence: its query heads against the keys and values of its context, read
# through its block table from the pool `[num_blocks, block_size, kv heads, head_dim]` (float32,
# as a CPU model runs). In PyTorch that is a gather of the context (or a padded, masked gather for
# several sequences), two matmuls, a softmax and the casts around them: about a dozen operations a
# layer. Here it is one call: OpenMP hands each (sequence, KV head) to a thread, whose query heads
# (the group sharing that KV head) read each key and value row once. Scores, softmax and the
# weighted sum are float32 in a fixed order, and every row is computed alone: its result does not
# depend on the other sequences of the step, as the batch-invariant mode of chapter 08 requires.
# The dot products keep eight partial sums so that the compiler can vectorize them without
# reordering a sum it was not told it may reorder.
#
# Each key and value row is asked for `ROWS_AHEAD` (4) positions before it is read. A head's rows
# lie `kv heads × head_dim` apart inside a block, and the blocks lie anywhere in the pool, a pattern
# a core's own prefetchers do not follow. On a 2-core Xeon, Qwen3-4B's heads over 4,096 bf16
# positions took 3,156 µs without it and 1,945 µs with it. Once the rows arrive in time, a
# position costs a KV head a few hundred instructions, and the loops' own overhead is a share of
# them: `attend_head` compiles the common head sizes (128, 64) as constants, so that the loops
# over a row unroll, which took the same attention from 2,167 to 1,811 µs (`PYTHONPATH=. python3
# kernels_lab/cpu_attention_builds.py` times each choice undone).

# %% [markdown]
# The kernels read float32 or bf16 tensors (a model split with a GPU keeps its CPU layers in
# bf16, chapter 10h). bf16 is float32's top half, so a value becomes a float by a shift, and a
# float becomes bf16 by rounding its low half to nearest even. Each kernel takes a flag `bf16`
# and rounds where PyTorch's bf16 operations round (after every operation), so the C call gives
# the PyTorch path's numbers, not a more precise version of them.

# %%
#| export
BF16_C_SOURCE = r"""
#ifndef FORGE_BF16_C  // once in a source that joins several kernels' (chapter 10f's decode step)
#define FORGE_BF16_C
#include <stdint.h>
#include <string.h>
#include <math.h>

// Each kernel's body is an always-inlined function of a constant `bf16`, called as bf16 = 0 and 1 (`BY_DTYPE`):
// the compiler makes two plain loops of it, each vectorized, with no test of the dtype inside.
#define INLINE static inline __attribute__((always_inline))
#define BY_DTYPE(bf16, body, ...) ((bf16) ? body(__VA_ARGS__, 1) : body(__VA_ARGS__, 0))

INLINE float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

INLINE uint16_t float_to_bf16(float f) {  // to nearest even; a NaN stays a NaN
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t nearest = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40) : nearest;
}

// element i of a float32 (or, where bf16, bf16) array, as a float; stored back the same way
INLINE float load_at(const void *p, size_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

INLINE void store_at(void *p, size_t i, float v, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = float_to_bf16(v);
    else ((float *)p)[i] = v;
}

// v as an operation on bf16 tensors leaves it: rounded to bf16 (where bf16), else as it is
INLINE float rounded(float v, int bf16) { return bf16 ? bf16_to_float(float_to_bf16(v)) : v; }

// n values from element i of p as float32: p's own where float32, else converted into `to`
INLINE const float *floats_at(const void *p, size_t i, size_t n, int bf16, float *to) {
    if (!bf16) return (const float *)p + i;
    for (size_t j = 0; j < n; j++) to[j] = bf16_to_float(((const uint16_t *)p)[i + j]);
    return to;
}

// e^x within a few float32 steps, in arithmetic a compiler vectorizes (libm's expf is a call a value): x = n ln2 + r,
// |r| <= ln2 / 2, e^r by its Taylor series to r^7 / 7! (under 2e-7 relative), times 2^n put in the exponent bits
INLINE float exp_fast(float x) {
    x = x < -87.3f ? -87.3f : x;  // (two selects, not fminf / fmaxf: those keep a loop from vectorizing)
    x = x > 88.3f ? 88.3f : x;
    float n = rintf(x * 1.44269504f);
    float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-6f;
    float p = 1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720 + r * (1.f / 5040)))))));
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

// the sum of n values from element i of v squared, in 8 partial sums (the compiler vectorizes them without
// reordering a sum of its own)
INLINE float sum_of_squares(const void *v, size_t i, int n, int bf16) {
    float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int k = 0;
    for (; k + 8 <= n; k += 8)
        for (int j = 0; j < 8; j++) {
            float e = load_at(v, i + k + j, bf16);
            part[j] += e * e;
        }
    float sum = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    for (; k < n; k++) sum += load_at(v, i + k, bf16) * load_at(v, i + k, bf16);
    return sum;
}
#endif
"""

# %%
#| export
ATTENTION_CPU_SOURCE = (
    BF16_C_SOURCE
    + r"""
#include <stdint.h>
#include <stdlib.h>
#include <math.h>

// rows of keys or values asked for this many positions before they are read: a head's rows lie Hkv * D apart
// inside a block and the blocks anywhere in the pool, a pattern a core's own prefetchers do not follow
enum { ROWS_AHEAD = 4 };

// where KV head kv's row for position t of a sequence (its block table `table`) starts in a pool, in elements
INLINE size_t row_at(const int64_t *table, int t, int block_size, int Hkv, int kv, int D) {
    return (((size_t)table[t / block_size] * block_size + t % block_size) * Hkv + kv) * D;
}

INLINE void prefetch_row(const void *pool, size_t at, int D, int bf16) {
    size_t bytes = bf16 ? 2 : 4;
    const char *row = (const char *)pool + at * bytes;
    for (size_t line = 0; line < D * bytes; line += 64) __builtin_prefetch(row + line);
}

// decode attention for sequence b, KV head kv (below): scratch holds the group's scores and, where bf16, its queries,
// a key or value row and its outputs as floats. Returns 0, or 2 if the table names a block outside the pool.
INLINE int attend(const void *q, int b, int kv, int Hq, int Hkv, int D, const void *k_pool, const void *v_pool,
                  int num_blocks, int block_size, const int64_t *tables, int W, int L, float scale, void *out,
                  float *scratch, int bf16) {
    int group = Hq / Hkv;
    float *scores = scratch, *q_f = scores + (size_t)group * (L > 0 ? L : 1), *row_f = q_f + (size_t)group * D;
    size_t first = ((size_t)b * Hq + (size_t)kv * group) * D;  // the group's first query and output
    const float *qh = floats_at(q, first, (size_t)group * D, bf16, q_f);
    float *acc = bf16 ? row_f + D : (float *)out + first;
    const int64_t *table = tables + (size_t)b * W;
    if (L > W * block_size) return 2;
    for (int t = 0; t < L; t++) {
        int64_t block = table[t / block_size];
        if (block < 0 || block >= num_blocks) return 2;
    }
    for (int t = 0; t < L; t++) {
        if (t + ROWS_AHEAD < L) prefetch_row(k_pool, row_at(table, t + ROWS_AHEAD, block_size, Hkv, kv, D), D, bf16);
        const float *k = floats_at(k_pool, row_at(table, t, block_size, Hkv, kv, D), D, bf16, row_f);
        for (int g = 0; g < group; g++) {
            float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            int d = 0;
            for (; d + 8 <= D; d += 8)
                for (int j = 0; j < 8; j++) part[j] += qh[(size_t)g * D + d + j] * k[d + j];
            float s = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
            for (; d < D; d++) s += qh[(size_t)g * D + d] * k[d];
            scores[(size_t)g * L + t] = s * scale;
        }
    }
    for (int g = 0; g < group; g++) {  // each query's scores to probabilities
        float *s = scores + (size_t)g * L, top = -INFINITY, total = 0.f;
        for (int t = 0; t < L; t++) top = s[t] > top ? s[t] : top;
        for (int t = 0; t < L; t++) s[t] = exp_fast(s[t] - top);
        for (int t = 0; t < L; t++) total += s[t];
        for (int t = 0; t < L; t++) s[t] /= total;
    }
    for (size_t d = 0; d < (size_t)group * D; d++) acc[d] = 0.f;
    for (int t = 0; t < L; t++) {  // each value row read (and converted) once for the group
        if (t + ROWS_AHEAD < L) prefetch_row(v_pool, row_at(table, t + ROWS_AHEAD, block_size, Hkv, kv, D), D, bf16);
        const float *v = floats_at(v_pool, row_at(table, t, block_size, Hkv, kv, D), D, bf16, row_f);
        for (int g = 0; g < group; g++) {
            float p = scores[(size_t)g * L + t], *o = acc + (size_t)g * D;
            for (int d = 0; d < D; d++) o[d] += p * v[d];
        }
    }
    if (bf16)
        for (size_t d = 0; d < (size_t)group * D; d++) store_at(out, first + d, acc[d], 1);
    return 0;
}

// `attend` with the common head sizes (Qwen3's 128, SmolLM2's 64) as constants, so that its loops over a row unroll
INLINE int attend_head(const void *q, int b, int kv, int Hq, int Hkv, int D, const void *k_pool, const void *v_pool,
                       int num_blocks, int block_size, const int64_t *tables, int W, int L, float scale, void *out,
                       float *scratch, int bf16) {
    if (D == 128)
        return attend(q, b, kv, Hq, Hkv, 128, k_pool, v_pool, num_blocks, block_size, tables, W, L, scale, out,
                      scratch, bf16);
    if (D == 64)
        return attend(q, b, kv, Hq, Hkv, 64, k_pool, v_pool, num_blocks, block_size, tables, W, L, scale, out,
                      scratch, bf16);
    return attend(q, b, kv, Hq, Hkv, D, k_pool, v_pool, num_blocks, block_size, tables, W, L, scale, out, scratch,
                  bf16);
}

// out [B, Hq, D] = softmax(q k^T * scale) v for one query a sequence, over the context_lens[b] positions of
// sequence b, found through tables [B, W] in the pools [num_blocks, block_size, Hkv, D]; q, the pools and out
// float32, or bf16 where bf16 (the sums float32 either way, out rounded once). Returns 0; -1 if the scores of a
// sequence do not fit in memory, -2 if a table names a block outside the pool (nothing read there).
int decode_attention(const void *q, int B, int Hq, int Hkv, int D, const void *k_pool,
                     const void *v_pool, int num_blocks, int block_size, const int64_t *tables, int W,
                     const int64_t *context_lens, float scale, void *out, int threads, int bf16) {
    int group = Hq / Hkv, failed = 0;
    #pragma omp parallel for collapse(2) num_threads(threads) schedule(static)
    for (int b = 0; b < B; b++) {
        for (int kv = 0; kv < Hkv; kv++) {
            int L = (int)context_lens[b];
            size_t floats = (size_t)group * (L > 0 ? L : 1) + (bf16 ? (size_t)(2 * group + 1) * D : 0);
            float *scratch = malloc(sizeof(float) * floats);
            if (!scratch) { failed = 1; continue; }
            int code = BY_DTYPE(bf16, attend_head, q, b, kv, Hq, Hkv, D, k_pool, v_pool, num_blocks, block_size,
                                tables, W, L, scale, out, scratch);
            if (code) failed = code;
            free(scratch);
        }
    }
    return failed == 2 ? -2 : failed ? -1 : 0;
}
"""
)


@functools.cache
def _attention_kernel():
    "The compiled `decode_attention`, or why there is none (declared once a process: it is called every layer)."
    library = load_cpu_kernel("decode_attention", ATTENTION_CPU_SOURCE)
    if isinstance(library, str):
        return library
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    return c_function(library, "decode_attention", p, i, i, i, i, p, p, i, i, p, i, p, f, p, i, i)


def cpu_decode_attention(
    q: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor | None:
    """`paged_decode_attention_torch`'s contract (q [B, Hq, D], pools [blocks, block_size, Hkv, D], tables [B, W],
    lengths [B] -> [B, Hq, D]) in one C call; None where it does not run: off the CPU, q and the pools not all
    float32 or all bf16, or no compiler."""
    if not cpu_decode_attention_runs(q.device, q.dtype) or not _same_cpu_dtype(q, k_layer, v_layer):
        return None
    kernel = _attention_kernel()  # (built: `cpu_decode_attention_runs`)
    num_blocks, block_size, kv_heads, dim = k_layer.shape
    tables = block_tables.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    q, out = q.contiguous(), torch.empty_like(q)
    code = kernel(
        q.data_ptr(), q.shape[0], q.shape[1], kv_heads, dim, k_layer.data_ptr(),
        v_layer.data_ptr(), num_blocks, block_size, tables.data_ptr(), tables.shape[1], lens.data_ptr(),
        dim**-0.5, out.data_ptr(), torch.get_num_threads(), q.dtype == torch.bfloat16,
    )  # fmt: skip
    if code == -2:
        raise ValueError(f"block tables name blocks outside the pool of {num_blocks} (or too few)")
    if code != 0:
        raise MemoryError("decode attention: no memory for the scores")
    return out


def cpu_decode_attention_runs(device, dtype: torch.dtype) -> bool:
    "Whether `cpu_decode_attention` runs for a pool on `device` in `dtype` (built here, once a process)."
    return (
        torch.device(device).type == "cpu"
        and dtype in CPU_KERNEL_DTYPES
        and not isinstance(_attention_kernel(), str)
    )


# %% [markdown]
# ## The small steps of a layer
#
# Around the products, a decoder layer on a CPU spends its time in operations on one row of a few
# hundred numbers: the residual add with the RMSNorm after it (eight PyTorch operations, twice a
# layer) and SwiGLU's SiLU-mul (three). Each costs a few microseconds of dispatch for almost no
# arithmetic; in C each is one call. The norm's sum of squares keeps eight partial sums (the
# compiler vectorizes them), then `w · (r / sqrt(mean + eps))` as chapter 03 computes it. SiLU's
# exponential is `exp_fast`, a polynomial the compiler vectorizes, where libm's `expf` is a call
# a value: it was 4x slower than PyTorch's vectorized SiLU-mul before.
#
# With the decode attention above, the small steps of a Qwen3-14B layer at one decode token in
# bf16 take **214 µs against PyTorch's 649** at 160 keys (2 threads; `PYTHONPATH=. python3
# kernels_lab/cpu_layer_ops.py`): what the CPU's layers of a model split with a GPU (chapter
# 10h) spend besides their products.

# %%
#| export
LAYER_OPS_CPU_SOURCE = (
    BF16_C_SOURCE
    + r"""
#include <math.h>
#include <stddef.h>

// one row of add_rms_norm (below): r first into out (exact: r is already of out's dtype), then normed in place
INLINE void add_rms_norm_row(const void *x, const void *residual, void *residual_out, const void *w, size_t row,
                             int H, float eps, void *out, int bf16) {
    for (int i = 0; i < H; i++) {
        float r = residual ? rounded(load_at(x, row + i, bf16) + load_at(residual, row + i, bf16), bf16)
                           : load_at(x, row + i, bf16);
        store_at(out, row + i, r, bf16);
    }
    if (residual_out)
        for (int i = 0; i < H; i++) store_at(residual_out, row + i, load_at(out, row + i, bf16), bf16);
    float inv = 1.f / sqrtf(sum_of_squares(out, row, H, bf16) / H + eps);
    for (int i = 0; i < H; i++)
        store_at(out, row + i, load_at(w, i, bf16) * rounded(load_at(out, row + i, bf16) * inv, bf16), bf16);
}

// r = x + residual (residual NULL: r = x), written to residual_out (if not NULL); out = w * (r / rms(r)), [T, H];
// every array float32, or bf16 where bf16 (rounded as chapter 03's RMSNorm rounds: r, r / rms, then w times it).
// out may be x, and residual_out residual.
int add_rms_norm(const void *x, const void *residual, void *residual_out, const void *w, int T, int H,
                 float eps, void *out, int bf16) {
    for (int t = 0; t < T; t++)
        BY_DTYPE(bf16, add_rms_norm_row, x, residual, residual_out, w, (size_t)t * H, H, eps, out);
    return 0;
}

INLINE void rope_token(const void *x, int t, int heads, int D, long row_stride, const float *cos, const float *sin,
                       void *out, int bf16) {
    int half = D / 2;
    const float *c = cos + (size_t)t * half, *s = sin + (size_t)t * half;
    for (int h = 0; h < heads; h++) {
        size_t in = (size_t)t * row_stride + (size_t)h * D, o = ((size_t)t * heads + h) * D;
        for (int j = 0; j < half; j++) {
            float x1 = load_at(x, in + j, bf16), x2 = load_at(x, in + j + half, bf16);
            float cj = rounded(c[j], bf16), sj = rounded(s[j], bf16);
            store_at(out, o + j, rounded(x1 * cj, bf16) - rounded(x2 * sj, bf16), bf16);
            store_at(out, o + j + half, rounded(x2 * cj, bf16) + rounded(x1 * sj, bf16), bf16);
        }
    }
}

// out [T, heads, D] = x rotated: the pair (j, j + D/2) of head h of token t by the angle of (t, j), cos and sin
// [T, D/2] float32; x's tokens `row_stride` elements apart, its heads D apart (a view of the QKV projection's
// output); x and out float32, or bf16 where bf16 (cos and sin rounded to it first, as chapter 03's `apply_rope`)
int rope(const void *x, int T, int heads, int D, long row_stride, const float *cos, const float *sin,
         void *out, int bf16) {
    for (int t = 0; t < T; t++) BY_DTYPE(bf16, rope_token, x, t, heads, D, row_stride, cos, sin, out);
    return 0;
}

INLINE void silu_mul_piece(const void *gate_up, int I, void *out, int t, int start, int end, int bf16) {
    size_t g = (size_t)t * 2 * I, o = (size_t)t * I;
    for (int i = start; i < end; i++) {
        float gi = load_at(gate_up, g + i, bf16);
        float product = rounded(gi / (1.f + exp_fast(-gi)), bf16) * load_at(gate_up, g + I + i, bf16);
        store_at(out, o + i, product, bf16);
    }
}

// out [T, I] = silu(gate) * up for gate_up [T, 2I] (gate the first I columns); float32, or bf16 where bf16
// (silu rounded, then the product). Its exponentials are the layer's most arithmetic outside the products:
// spread over `threads`, 1024 values of a row each.
int silu_mul(const void *gate_up, int T, int I, void *out, int bf16, int threads) {
    int pieces = (I + 1023) / 1024;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int piece = 0; piece < T * pieces; piece++) {
        int t = piece / pieces, start = piece % pieces * 1024, end = start + 1024 < I ? start + 1024 : I;
        BY_DTYPE(bf16, silu_mul_piece, gate_up, I, out, t, start, end);
    }
    return 0;
}
"""
)


@functools.cache
def _layer_ops():
    "The compiled (add_rms_norm, silu_mul, rope), or why there are none."
    library = load_cpu_kernel("layer_ops", LAYER_OPS_CPU_SOURCE)
    if isinstance(library, str):
        return library
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    return (
        c_function(library, "add_rms_norm", p, p, p, p, i, i, f, p, i),
        c_function(library, "silu_mul", p, i, i, p, i, i),
        c_function(library, "rope", p, i, i, i, ctypes.c_long, p, p, p, i),
    )


def cpu_layer_ops_run() -> bool:
    "Whether `cpu_add_rms_norm` and `cpu_silu_mul` are built here (once a process)."
    return not isinstance(_layer_ops(), str)


def _plain_rows(*tensors) -> bool:
    "Whether the tensors are contiguous, on the CPU and all float32 or all bf16: what the C kernels read."
    return _same_cpu_dtype(*tensors) and all(t.is_contiguous() for t in tensors)


def cpu_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(RMSNorm(x + residual) · weight, x + residual) for x [T, H] (residual None: x alone) in one C call; None where
    it does not run (not contiguous CPU tensors all float32 or all bf16, or no kernel here)."""
    plain = _plain_rows(x, weight) if residual is None else _plain_rows(x, residual, weight)
    if not plain or x.dim() != 2 or isinstance(ops := _layer_ops(), str):
        return None
    out = torch.empty_like(x)
    summed = x if residual is None else torch.empty_like(x)
    ops[0](
        x.data_ptr(), None if residual is None else residual.data_ptr(),
        None if residual is None else summed.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1],
        eps, out.data_ptr(), x.dtype == torch.bfloat16,
    )  # fmt: skip
    return out, summed


def cpu_silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    "silu(gate) · up for gate_up [T, 2I] in one C call; None where it does not run."
    if not _plain_rows(gate_up) or gate_up.dim() != 2 or isinstance(ops := _layer_ops(), str):
        return None
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    ops[1](
        gate_up.data_ptr(), gate_up.shape[0], gate_up.shape[1] // 2, out.data_ptr(),
        gate_up.dtype == torch.bfloat16, torch.get_num_threads(),
    )  # fmt: skip
    return out


def cpu_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """Chapter 03's `apply_rope` (x [T, heads, D], each head's elements contiguous, float32 or bf16; cos and sin
    [T, D/2] float32) in one C call, into a new contiguous tensor; None where it does not run."""
    if (
        not _plain_rows(cos, sin)
        or cos.dtype != torch.float32
        or not _same_cpu_dtype(x)
        or x.dim() != 3
        or x.stride(2) != 1
        or x.stride(1) != x.shape[2]
        or isinstance(ops := _layer_ops(), str)
    ):
        return None
    out = x.new_empty(x.shape)
    ops[2](
        x.data_ptr(), x.shape[0], x.shape[1], x.shape[2], x.stride(0), cos.data_ptr(),
        sin.data_ptr(), out.data_ptr(), x.dtype == torch.bfloat16,
    )  # fmt: skip
    return out


# %% [markdown]
# Against chapter 03's PyTorch: the same numbers to float32's rounding.

# %%
from forge_engine.model import RMSNorm, apply_rope, rope_cos_sin

if not isinstance(_layer_ops(), str):
    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(37, 1e-6)
    norm.weight.data = torch.randn(37, generator=g)
    x, residual = torch.randn(2, 3, 37, generator=g)
    got, summed = cpu_add_rms_norm(x, residual, norm.weight.data, norm.eps)
    want, want_summed = norm.add_and_norm(x, residual)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(summed, want_summed)
    torch.testing.assert_close(cpu_add_rms_norm(x, None, norm.weight.data, norm.eps)[0], norm(x))
    gate_up = torch.randn(3, 2 * 19, generator=g) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_silu_mul(gate_up), torch.nn.functional.silu(gate) * up)
    qkv = torch.randn(3, 5 * 8 + 2, generator=g)  # 5 heads of 8 and 2 more columns: strided rows
    heads = qkv[:, :40].view(3, 5, 8)
    cos, sin = rope_cos_sin(torch.tensor([0, 7, 300]), 8, 10000.0)
    torch.testing.assert_close(cpu_rope(heads, cos, sin), apply_rope(heads, cos, sin))
    assert cpu_rope(heads.transpose(0, 1), cos, sin) is None  # heads not laid out as it reads them
    assert (
        cpu_silu_mul(gate_up.double()) is None
        and cpu_add_rms_norm(x.t(), None, norm.weight, 1e-6) is None
    )


# %% [markdown]
# In bf16 they give the numbers of chapter 03's PyTorch in bf16: the add and the rotation bit for
# bit; the norm (its sum in another order) and SiLU (another `exp`) at most a bf16 step or two
# apart, and seldom.

# %%
def assert_bf16_near(got: torch.Tensor, want: torch.Tensor) -> None:
    "got is want but for a few values (under 1%) a bf16 step or two apart."
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)  # bf16's tolerance: about two steps
    assert (got != want).float().mean() < 0.01, (got != want).float().mean()


if not isinstance(_layer_ops(), str):
    g, bf16 = torch.Generator().manual_seed(2), torch.bfloat16
    norm = RMSNorm(1000, 1e-6).to(bf16)
    norm.weight.data = torch.randn(1000, generator=g).to(bf16)
    x, residual = (torch.randn(2, 4, 1000, generator=g) * 3).to(bf16)
    got, summed = cpu_add_rms_norm(x, residual, norm.weight.data, norm.eps)
    want, want_summed = norm.add_and_norm(x, residual)
    assert torch.equal(summed, want_summed)
    assert_bf16_near(got, want)
    assert_bf16_near(cpu_add_rms_norm(x, None, norm.weight.data, norm.eps)[0], norm(x))
    gate_up = (torch.randn(4, 2 * 500, generator=g) * 4).to(bf16)
    gate, up = gate_up.chunk(2, dim=-1)
    assert_bf16_near(cpu_silu_mul(gate_up), torch.nn.functional.silu(gate) * up)
    qkv = torch.randn(3, 5 * 64 + 2, generator=g).to(bf16)
    heads = qkv[:, :320].view(3, 5, 64)
    cos, sin = rope_cos_sin(torch.tensor([0, 7, 3000]), 64, 10000.0)
    assert torch.equal(cpu_rope(heads, cos, sin), apply_rope(heads, cos, sin))
    assert cpu_add_rms_norm(x, residual.float(), norm.weight.data, 1e-6) is None  # mixed dtypes


# %%
#| export
def cpu_kernels_status() -> str:
    "One line for `forge-engine doctor`: whether the C kernels run here, or why not."
    kernel = _attention_kernel()
    if isinstance(kernel, str):
        return kernel
    return "built (decode attention, add + RMSNorm, SiLU-mul, RoPE, GGUF matmul)"


# %% [markdown]
# Against chapter 05's `paged_decode_attention_torch` on a pool in random order: grouped heads,
# contexts of 1 to a few blocks and a ragged tail, tables padded past each context.

# %%
from forge_engine.kv_cache import paged_decode_attention_torch

if not isinstance(_attention_kernel(), str):
    g = torch.Generator().manual_seed(0)
    k_pool, v_pool = torch.randn(2, 40, 16, 2, 64, generator=g)  # 40 blocks of 16, 2 KV heads
    for heads, lens in ((2, [1]), (6, [16, 17, 90]), (6, [5, 130, 33, 64])):
        tables = torch.randperm(40, generator=g)[: len(lens) * 9].reshape(len(lens), 9)
        lens = torch.tensor(lens)
        q = torch.randn(len(lens), heads, 64, generator=g)
        want = paged_decode_attention_torch(q, k_pool, v_pool, tables, lens)
        got = cpu_decode_attention(q, k_pool, v_pool, tables, lens)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        alone = [
            cpu_decode_attention(q[b : b + 1], k_pool, v_pool, tables[b : b + 1], lens[b : b + 1])
            for b in range(len(lens))
        ]
        assert torch.equal(torch.cat(alone), got)  # a row's result does not depend on the others
        # bf16 q and pools: the float32 kernel's numbers on the same values, rounded once
        as_bf16 = [t.to(torch.bfloat16) for t in (q, k_pool, v_pool)]
        got_bf16 = cpu_decode_attention(*as_bf16, tables, lens)
        same_values = cpu_decode_attention(*[t.float() for t in as_bf16], tables, lens)
        assert torch.equal(got_bf16, same_values.to(torch.bfloat16))
        reference = paged_decode_attention_torch(*[t.float() for t in as_bf16], tables, lens)
        assert_bf16_near(got_bf16, reference.to(torch.bfloat16))
    try:
        cpu_decode_attention(q, k_pool, v_pool, tables + 40, lens)
        raise AssertionError("a table past the pool was read")
    except ValueError as e:
        assert "outside the pool of 40" in str(e)
print(cpu_kernels_status())
