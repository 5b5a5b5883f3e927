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
CPU_KERNEL_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


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

# %%
#| export
ATTENTION_CPU_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <math.h>

// out [B, Hq, D] = softmax(q k^T * scale) v for one query a sequence, over the context_lens[b] positions of
// sequence b, found through tables [B, W] in the pools [num_blocks, block_size, Hkv, D]. Returns 0; -1 if the
// scores of a sequence do not fit in memory, -2 if a table names a block outside the pool (nothing read there).
int decode_attention(const float *q, int B, int Hq, int Hkv, int D, const float *k_pool,
                     const float *v_pool, int num_blocks, int block_size, const int64_t *tables, int W,
                     const int64_t *context_lens, float scale, float *out, int threads) {
    int group = Hq / Hkv, failed = 0;
    #pragma omp parallel for collapse(2) num_threads(threads) schedule(static)
    for (int b = 0; b < B; b++) {
        for (int kv = 0; kv < Hkv; kv++) {
            int L = (int)context_lens[b];
            float *scores = malloc(sizeof(float) * (size_t)group * (L > 0 ? L : 1));
            if (!scores) { failed = 1; continue; }
            const float *qh = q + ((size_t)b * Hq + (size_t)kv * group) * D;
            int bad = L > W * block_size;
            for (int t = 0; t < L && !bad; t++) {
                int64_t block = tables[(size_t)b * W + t / block_size];
                bad = block < 0 || block >= num_blocks;
            }
            if (bad) { failed = 2; free(scores); continue; }
            for (int t = 0; t < L; t++) {
                int64_t block = tables[(size_t)b * W + t / block_size];
                const float *k = k_pool + (((size_t)block * block_size + t % block_size) * Hkv + kv) * D;
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
            for (int g = 0; g < group; g++) {
                float *s = scores + (size_t)g * L, top = -INFINITY, total = 0.f;
                for (int t = 0; t < L; t++) top = s[t] > top ? s[t] : top;
                for (int t = 0; t < L; t++) { s[t] = expf(s[t] - top); total += s[t]; }
                float *o = out + ((size_t)b * Hq + (size_t)kv * group + g) * D;
                for (int d = 0; d < D; d++) o[d] = 0.f;
                for (int t = 0; t < L; t++) {
                    int64_t block = tables[(size_t)b * W + t / block_size];
                    const float *v = v_pool + (((size_t)block * block_size + t % block_size) * Hkv + kv) * D;
                    float p = s[t] / total;
                    for (int d = 0; d < D; d++) o[d] += p * v[d];
                }
            }
            free(scores);
        }
    }
    return failed == 2 ? -2 : failed ? -1 : 0;
}
"""


@functools.cache
def _attention_kernel():
    "The compiled `decode_attention`, or why there is none (declared once a process: it is called every layer)."
    library = load_cpu_kernel("decode_attention", ATTENTION_CPU_SOURCE)
    if isinstance(library, str):
        return library
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    return c_function(library, "decode_attention", p, i, i, i, i, p, p, i, i, p, i, p, f, p, i)


def cpu_decode_attention(
    q: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor | None:
    """`paged_decode_attention_torch`'s contract (q [B, Hq, D], pools [blocks, block_size, Hkv, D], tables [B, W],
    lengths [B] -> [B, Hq, D]) in one C call; None where it does not run: off the CPU, not float32, or no compiler."""
    if q.device.type != "cpu" or q.dtype != torch.float32 or k_layer.dtype != torch.float32:
        return None
    kernel = _attention_kernel()
    if isinstance(kernel, str):
        return None
    num_blocks, block_size, kv_heads, dim = k_layer.shape
    tables = block_tables.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    q, out = q.contiguous(), torch.empty_like(q)
    code = kernel(
        q.data_ptr(), q.shape[0], q.shape[1], kv_heads, dim, k_layer.data_ptr(),
        v_layer.data_ptr(), num_blocks, block_size, tables.data_ptr(), tables.shape[1], lens.data_ptr(),
        dim**-0.5, out.data_ptr(), torch.get_num_threads(),
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
        and dtype == torch.float32
        and not isinstance(_attention_kernel(), str)
    )


# %% [markdown]
# ## The small steps of a layer
#
# Around the products, a decoder layer on a CPU spends its time in operations on one row of a few
# hundred numbers: the residual add with the RMSNorm after it (eight PyTorch operations, twice a
# layer) and SwiGLU's SiLU-mul (three). Each costs a few microseconds of dispatch for almost no
# arithmetic; in C each is one call. The norm's sum of squares keeps eight partial sums (the
# compiler vectorizes them), then `w · (r / sqrt(mean + eps))` as chapter 03 computes it.

# %%
#| export
LAYER_OPS_CPU_SOURCE = r"""
#include <math.h>
#include <stddef.h>

// r = x + residual (residual NULL: r = x), written to residual_out (if not NULL); out = w * (r / rms(r)), [T, H]
int add_rms_norm(const float *x, const float *residual, float *residual_out, const float *w, int T, int H,
                 float eps, float *out) {
    for (int t = 0; t < T; t++) {
        const float *xt = x + (size_t)t * H;
        float *o = out + (size_t)t * H;
        if (residual) {
            const float *rt = residual + (size_t)t * H;
            for (int i = 0; i < H; i++) o[i] = xt[i] + rt[i];
        } else {
            for (int i = 0; i < H; i++) o[i] = xt[i];
        }
        if (residual_out)
            for (int i = 0; i < H; i++) residual_out[(size_t)t * H + i] = o[i];
        float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int i = 0;
        for (; i + 8 <= H; i += 8)
            for (int j = 0; j < 8; j++) part[j] += o[i + j] * o[i + j];
        float sum = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
        for (; i < H; i++) sum += o[i] * o[i];
        float inv = 1.f / sqrtf(sum / H + eps);
        for (i = 0; i < H; i++) o[i] = w[i] * (o[i] * inv);
    }
    return 0;
}

// out [T, heads, D] = x rotated: the pair (j, j + D/2) of head h of token t by the angle of (t, j), cos and sin
// [T, D/2]; x's tokens `row_stride` floats apart, its heads D apart (a view of the QKV projection's output)
int rope(const float *x, int T, int heads, int D, long row_stride, const float *cos, const float *sin,
         float *out) {
    int half = D / 2;
    for (int t = 0; t < T; t++) {
        const float *c = cos + (size_t)t * half, *s = sin + (size_t)t * half;
        for (int h = 0; h < heads; h++) {
            const float *xi = x + (size_t)t * row_stride + (size_t)h * D;
            float *o = out + ((size_t)t * heads + h) * D;
            for (int j = 0; j < half; j++) {
                float x1 = xi[j], x2 = xi[j + half];
                o[j] = x1 * c[j] - x2 * s[j];
                o[j + half] = x2 * c[j] + x1 * s[j];
            }
        }
    }
    return 0;
}

// out [T, I] = silu(gate) * up for gate_up [T, 2I] (gate the first I columns)
int silu_mul(const float *gate_up, int T, int I, float *out) {
    for (int t = 0; t < T; t++) {
        const float *g = gate_up + (size_t)t * 2 * I, *u = g + I;
        float *o = out + (size_t)t * I;
        for (int i = 0; i < I; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
    return 0;
}
"""


@functools.cache
def _layer_ops():
    "The compiled (add_rms_norm, silu_mul, rope), or why there are none."
    library = load_cpu_kernel("layer_ops", LAYER_OPS_CPU_SOURCE)
    if isinstance(library, str):
        return library
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    return (
        c_function(library, "add_rms_norm", p, p, p, p, i, i, f, p),
        c_function(library, "silu_mul", p, i, i, p),
        c_function(library, "rope", p, i, i, i, ctypes.c_long, p, p, p),
    )


def cpu_layer_ops_run() -> bool:
    "Whether `cpu_add_rms_norm` and `cpu_silu_mul` are built here (once a process)."
    return not isinstance(_layer_ops(), str)


def _plain_rows(*tensors) -> bool:
    "Whether every tensor is float32, contiguous and on the CPU: what the C kernels read."
    return all(
        t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors
    )


def cpu_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(RMSNorm(x + residual) · weight, x + residual) for x [T, H] (residual None: x alone) in one C call; None where
    it does not run (not float32 contiguous CPU tensors, or no kernel here)."""
    plain = _plain_rows(x, weight) and (residual is None or _plain_rows(residual))
    if not plain or x.dim() != 2 or isinstance(ops := _layer_ops(), str):
        return None
    out = torch.empty_like(x)
    summed = x if residual is None else torch.empty_like(x)
    ops[0](
        x.data_ptr(), None if residual is None else residual.data_ptr(),
        None if residual is None else summed.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1],
        eps, out.data_ptr(),
    )  # fmt: skip
    return out, summed


def cpu_silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    "silu(gate) · up for gate_up [T, 2I] in one C call; None where it does not run."
    if not _plain_rows(gate_up) or gate_up.dim() != 2 or isinstance(ops := _layer_ops(), str):
        return None
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2)
    ops[1](gate_up.data_ptr(), gate_up.shape[0], gate_up.shape[1] // 2, out.data_ptr())
    return out


def cpu_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """Chapter 03's `apply_rope` (x [T, heads, D], each head's elements contiguous; cos and sin [T, D/2]) in one C
    call, into a new contiguous tensor; None where it does not run."""
    if (
        not _plain_rows(cos, sin)
        or x.device.type != "cpu"
        or x.dtype != torch.float32
        or x.dim() != 3
        or x.stride(2) != 1
        or x.stride(1) != x.shape[2]
        or isinstance(ops := _layer_ops(), str)
    ):
        return None
    out = torch.empty(x.shape)
    ops[2](
        x.data_ptr(), x.shape[0], x.shape[1], x.shape[2], x.stride(0), cos.data_ptr(),
        sin.data_ptr(), out.data_ptr(),
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
    try:
        cpu_decode_attention(q, k_pool, v_pool, tables + 40, lens)
        raise AssertionError("a table past the pool was read")
    except ValueError as e:
        assert "outside the pool of 40" in str(e)
print(cpu_kernels_status())
