# %% [markdown]
# # A CPU decode step in one C call
#
# > On a laptop the layers of a GGUF model's decode step are one C function over the kernels of chapters 09_kernels_cpu and 10da; the Python of a step is the embedding, that call and the LM head.

# %%
#| default_exp cpu_decode

# %% [markdown]
# Chapter 10da's kernel multiplies a GGUF layer as fast as llama.cpp does, yet the engine's PyTorch
# step (chapter 07a, with chapter 09a's CPU layers) takes 10.7 ms to decode one token of
# SmolLM2-135M-Instruct (Q4_1, 30 layers) on 2 cores, where llama.cpp takes ~9 for all of it. The
# profiler says where the time goes: ~1,400 PyTorch operations around the C calls (views, slices,
# `index_copy_` into the pool, the paged-attention bookkeeping), a few microseconds each. llama.cpp
# has none of them: its graph is planned once and run by one loop.
#
# So the step's layers become one C function, `decode_layers`, that calls the kernels already
# written: chapter 10da's `gguf_rows` for the four matrices of a layer, chapter 09_kernels_cpu's
# `add_rms_norm`, `rope`, `silu_mul` and `decode_attention`, in chapter 03's order
# (`DecoderLayer.forward`): the residual add fused with the next norm, Qwen3's per-head norms
# before the rotation, K and V written into the paged pool at each row's slot. Python keeps what is
# not a loop over layers: the token embedding, the angles of the rotation and the LM head (chapter
# 10da's kernel again, for a Q8_0 head).
#
# The C function reads the model from a table of plain structs: for each layer its norms, its four
# GGUF matrices (each one or more runs of rows of one quant type, with the bias if any) and its
# slice of the K/V pool. The table is built once, from the module's own tensors (no copy of a
# weight), when the engine builds its runner.

# %%
#| export
from __future__ import annotations

import ctypes
import functools
from typing import Callable, Sequence

import numpy as np
import torch

from forge_engine.cuda_graphs import fill_tables
from forge_engine.kernels.cpu import ATTENTION_CPU_SOURCE, LAYER_OPS_CPU_SOURCE, load_cpu_kernel
from forge_engine.kv_cache import PagedKVCache
from forge_engine.model import Transformer, rope_cos_sin
from forge_engine.quant.cpu_gguf import GGUF_CPU_SOURCE, NATIVE_BLOCK, NATIVE_MAX_ROWS
from forge_engine.quant.layers import QUANTIZED_LINEARS, GGUFLinear

# %% [markdown]
# ## The step in C
#
# One translation unit: the GGUF kernel, the layer operations, decode attention, then the step.
# Every row's slot and block table is checked before anything is computed or written, so a bad
# step changes nothing. The work buffer (`scratch`, sized by `decode_scratch_floats`) is the
# caller's: no allocation in the step but attention's scores.

# %%
#| export
DECODE_STEP_CPU_SOURCE = r"""
#include <string.h>

// one run of rows of one GGUF type; a layer [out, in]: up to 4 runs in output order, and its bias (or NULL)
typedef struct { const uint8_t *blocks; int64_t qtype, rows; } gguf_run;
typedef struct { gguf_run runs[4]; int64_t num_runs, in, out; const float *bias; } gguf_linear;
typedef struct {
    const float *attn_norm, *mlp_norm, *q_norm, *k_norm;  // q_norm, k_norm: NULL without per-head norms
    gguf_linear qkv, o, gate_up, down;
    float *k_pool, *v_pool;  // this layer's [num_blocks, block_size, kv_heads, head_dim]
} decoder_layer;
typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, num_blocks, block_size, table_width,
        threads;
    float eps, scale;
} decode_shape;

static int64_t widest_input(const decode_shape *s) {
    int64_t q = s->heads * s->head_dim, w = s->hidden > q ? s->hidden : q;
    return w > s->intermediate ? w : s->intermediate;
}

// floats of work buffer a step of `rows` rows needs: residual, h, qkv, q, attention out, gate_up, act, input blocks
int64_t decode_scratch_floats(const decode_shape *s, int64_t rows) {
    int64_t q = s->heads * s->head_dim, kv = s->kv_heads * s->head_dim;
    int64_t blocks = widest_input(s) / 32 * (int64_t)(sizeof(xblock) / sizeof(float));
    return rows * (2 * s->hidden + (q + 2 * kv) + 2 * q + 3 * s->intermediate + blocks);
}

// y [M, out] = x [M, in] @ W.T (+ bias): x's blocks quantized once, then each run of rows into its columns
static void gguf_linear_rows(const gguf_linear *l, const float *x, int M, xblock *xb, float *y, int threads) {
    int nb = (int)(l->in / 32);
    for (int m = 0; m < M; m++) quantize_blocks(x + (size_t)m * l->in, nb, xb + (size_t)m * nb);
    float *columns = y;
    for (int r = 0; r < l->num_runs; r++) {
        gguf_rows(xb, M, nb, l->runs[r].blocks, (int)l->runs[r].rows, (int)l->runs[r].qtype, columns,
                  (size_t)l->out, threads);
        columns += l->runs[r].rows;
    }
    if (l->bias)
        for (int m = 0; m < M; m++)
            for (int64_t n = 0; n < l->out; n++) y[(size_t)m * l->out + n] += l->bias[n];
}

// 0, or -3 for a slot outside the pool, -2 for a context longer than its table or a block outside the pool
static int check_step(const decode_shape *s, int M, const int64_t *slots, const int64_t *tables,
                      const int64_t *context_lens) {
    for (int m = 0; m < M; m++) {
        if (slots[m] < 0 || slots[m] >= s->num_blocks * s->block_size) return -3;
        int64_t L = context_lens[m];
        if (L < 1 || L > s->table_width * s->block_size) return -2;
        for (int64_t t = 0; t < L; t += s->block_size) {
            int64_t block = tables[(size_t)m * s->table_width + t / s->block_size];
            if (block < 0 || block >= s->num_blocks) return -2;
        }
    }
    return 0;
}

// x [M, hidden]: the embedded tokens in, the final norm's output out. cos, sin [M, head_dim/2]; slots [M] where
// each row's K and V go; tables [M, table_width], context_lens [M] (this token included). Returns 0; -1 for a
// row count it does not take or no memory for attention's scores; -2, -3 as check_step (then nothing written).
int decode_layers(const decoder_layer *layers, const decode_shape *s, int M, float *x, const float *cos,
                  const float *sin, const int64_t *slots, const int64_t *tables, const int64_t *context_lens,
                  const float *final_norm, float *scratch) {
    if (M < 1 || M > MAX_ROWS) return -1;
    int code = check_step(s, M, slots, tables, context_lens);
    if (code) return code;
    int H = (int)s->hidden, D = (int)s->head_dim, heads = (int)s->heads, kv_heads = (int)s->kv_heads;
    int I = (int)s->intermediate, threads = (int)s->threads, half = D / 2;
    int nq = heads * D, nkv = kv_heads * D, width = nq + 2 * nkv;
    float *residual = scratch, *h = residual + (size_t)M * H, *qkv = h + (size_t)M * H;
    float *q = qkv + (size_t)M * width, *att = q + (size_t)M * nq, *gate_up = att + (size_t)M * nq;
    float *act = gate_up + (size_t)M * 2 * I;
    xblock *xb = (xblock *)(act + (size_t)M * I);
    for (int l = 0; l < s->num_layers; l++) {  // (the kernels' `bf16` argument 0: this step is float32)
        const decoder_layer *layer = layers + l;
        if (l == 0) {  // the residual stream starts as the embedding
            memcpy(residual, x, sizeof(float) * (size_t)M * H);
            add_rms_norm(x, NULL, NULL, layer->attn_norm, M, H, s->eps, h, 0);
        } else {  // the previous layer's MLP output joins the stream
            add_rms_norm(x, residual, residual, layer->attn_norm, M, H, s->eps, h, 0);
        }
        gguf_linear_rows(&layer->qkv, h, M, xb, qkv, threads);
        for (int m = 0; m < M; m++) {  // q rotated into q; k rotated and v copied into the pool at the slot
            const float *row = qkv + (size_t)m * width, *c = cos + (size_t)m * half, *sn = sin + (size_t)m * half;
            float *qm = q + (size_t)m * nq;
            float *k_at = layer->k_pool + slots[m] * nkv, *v_at = layer->v_pool + slots[m] * nkv;
            if (layer->q_norm) {  // Qwen3: each head normed, then rotated in place
                add_rms_norm(row, NULL, NULL, layer->q_norm, heads, D, s->eps, qm, 0);
                add_rms_norm(row + nq, NULL, NULL, layer->k_norm, kv_heads, D, s->eps, k_at, 0);
                rope(qm, 1, heads, D, nq, c, sn, qm, 0);
                rope(k_at, 1, kv_heads, D, nkv, c, sn, k_at, 0);
            } else {
                rope(row, 1, heads, D, width, c, sn, qm, 0);
                rope(row + nq, 1, kv_heads, D, width, c, sn, k_at, 0);
            }
            memcpy(v_at, row + nq + nkv, sizeof(float) * nkv);
        }
        code = decode_attention(q, M, heads, kv_heads, D, layer->k_pool, layer->v_pool, (int)s->num_blocks,
                                (int)s->block_size, tables, (int)s->table_width, context_lens, s->scale, att,
                                threads, 0);
        if (code) return code;
        gguf_linear_rows(&layer->o, att, M, xb, x, threads);
        add_rms_norm(x, residual, residual, layer->mlp_norm, M, H, s->eps, h, 0);
        gguf_linear_rows(&layer->gate_up, h, M, xb, gate_up, threads);
        silu_mul(gate_up, M, I, act, 0, threads);
        gguf_linear_rows(&layer->down, act, M, xb, x, threads);
    }
    add_rms_norm(x, residual, NULL, final_norm, M, H, s->eps, x, 0);
    return 0;
}
"""

# %% [markdown]
# The structs as ctypes sees them, field for field (int64 and pointers: no padding to disagree on).

# %%
#| export
MAX_RUNS = 4  # runs of rows of one quant type a layer may have (the C struct's room)
DECODE_TYPES = tuple(NATIVE_MAX_ROWS)  # the GGUF types chapter 10da's kernel multiplies
DECODE_MAX_ROWS = 16  # the C side's MAX_ROWS: rows a step may have
ENGINE_DECODE_ROWS = (
    8  # steps of up to this many rows go to the C step in the engine (measured below)
)
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _Run(ctypes.Structure):
    _fields_ = [("blocks", _P), ("qtype", _I64), ("rows", _I64)]


class _Linear(ctypes.Structure):
    _fields_ = [("runs", _Run * MAX_RUNS), ("num_runs", _I64), ("in_features", _I64)]
    _fields_ += [("out_features", _I64), ("bias", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("attn_norm", "mlp_norm", "q_norm", "k_norm")]
    _fields_ += [(name, _Linear) for name in ("qkv", "o", "gate_up", "down")]
    _fields_ += [("k_pool", _P), ("v_pool", _P)]


_SHAPE_INTS = ("num_layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate")
_SHAPE_INTS += ("num_blocks", "block_size", "table_width", "threads")


class _Shape(ctypes.Structure):
    _fields_ = [(name, _I64) for name in _SHAPE_INTS] + [("eps", ctypes.c_float)]
    _fields_ += [("scale", ctypes.c_float)]


@functools.cache
def _step_kernel():
    "(decode_layers, decode_scratch_floats), compiled once a process, or why there are none."
    source = GGUF_CPU_SOURCE + LAYER_OPS_CPU_SOURCE + ATTENTION_CPU_SOURCE + DECODE_STEP_CPU_SOURCE
    library = load_cpu_kernel("decode_layers", source)
    if isinstance(library, str):
        return library
    step, floats = library.decode_layers, library.decode_scratch_floats
    step.restype, step.argtypes = ctypes.c_int, [_P, _P, ctypes.c_int] + [_P] * 8
    floats.restype, floats.argtypes = _I64, [_P, _I64]
    return step, floats


# %% [markdown]
# ## When it runs
#
# `cpu_decode_refusal` says why a model's decode steps cannot go through the C step, or None: it
# takes float32 models on a CPU whose every layer matrix is a `GGUFLinear` (chapter 10e) of the
# types chapter 10da's kernel multiplies (all that chapter 10e keeps: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
# Q4_K, Q5_K, Q6_K), with inputs in whole blocks (of 256 for the K types). Anything else (dense
# weights, int8 / int4, a GPU) keeps the engine's PyTorch step.

# %%
#| export
def _matrices(layer) -> dict[str, torch.nn.Module]:
    "A layer's four matrices by name, in the C struct's order (qkv, o, gate_up, down)."
    return {name: layer.get_submodule(name) for name in QUANTIZED_LINEARS}


def cpu_decode_refusal(model: Transformer, cache: PagedKVCache) -> str | None:
    "Why `model`'s decode steps over `cache` cannot run as one C call here, or None if they can."
    if not isinstance(
        model, Transformer
    ):  # (the engine runs any module with the model's interface)
        return f"a {type(model).__name__}, not chapter 03's Transformer"
    param = next(model.parameters())
    if param.device.type != "cpu" or cache.k_cache.device.type != "cpu":
        return "not on the CPU"
    if cache.k_cache.dtype != torch.float32 or param.dtype != torch.float32:
        return f"a {param.dtype} model, not float32"
    if model.config.head_dim % 2:
        return f"odd head_dim {model.config.head_dim}"
    for i, layer in enumerate(model.layers):
        for name, matrix in _matrices(layer).items():
            if not isinstance(matrix, GGUFLinear):
                return f"layer {i}'s {name} is a {type(matrix).__name__}, not GGUF blocks"
            if not set(matrix.qtypes) <= set(DECODE_TYPES) or len(matrix.qtypes) > MAX_RUNS:
                return (
                    f"layer {i}'s {name} has GGUF types {matrix.qtypes}, not all of {DECODE_TYPES}"
                )
            block = max(NATIVE_BLOCK.get(qtype, 32) for qtype in matrix.qtypes)
            if matrix.in_features % block:
                return f"layer {i}'s {name} has {matrix.in_features} inputs, not whole blocks of {block}"
    kernel = _step_kernel()
    return kernel if isinstance(kernel, str) else None


# %% [markdown]
# ## The runner
#
# `CPUDecodeRunner` has the contract of chapter 09b's `DecodeRunner`, so the model runner of
# chapter 07a sends it the pure decode steps as it sends a GPU's to the CUDA graphs: `run` takes
# each row's token, position, slot, block table and context length and returns the logits.

# %%
#| export
def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _linear_struct(matrix: GGUFLinear) -> _Linear:
    runs = [_Run(raw.data_ptr(), qtype, raw.shape[0]) for qtype, raw in matrix.runs()]
    return _Linear(
        (_Run * MAX_RUNS)(*runs),
        len(runs),
        matrix.in_features,
        matrix.out_features,
        _pointer(matrix.bias),
    )


class CPUDecodeRunner:
    """Decode steps of up to `max_rows` sequences of a GGUF model on a CPU: the embedding and the LM head in
    PyTorch, every layer in one C call. The model's tensors and the cache's pools are read in place."""

    def __init__(self, model: Transformer, cache: PagedKVCache, max_rows: int = DECODE_MAX_ROWS):
        if (why := cpu_decode_refusal(model, cache)) is not None:
            raise ValueError(f"the C decode step cannot run this model: {why}")
        if not 1 <= max_rows <= DECODE_MAX_ROWS:
            raise ValueError(f"max_rows must be 1 to {DECODE_MAX_ROWS}, got {max_rows}")
        self.model, self.cache = model, cache
        self.buckets = [max_rows]  # (chapter 07a sends steps of up to buckets[-1] rows)
        c = model.config
        self.layers = (_Layer * c.num_layers)()
        for i, layer in enumerate(model.layers):
            attn = layer.attn
            self.layers[i] = _Layer(
                layer.attn_norm.weight.data_ptr(),
                layer.mlp_norm.weight.data_ptr(),
                _pointer(attn.q_norm.weight if attn.q_norm is not None else None),
                _pointer(attn.k_norm.weight if attn.k_norm is not None else None),
                *(_linear_struct(m) for m in _matrices(layer).values()),
                cache.k_cache[i].data_ptr(),
                cache.v_cache[i].data_ptr(),
            )
        self.shape = _Shape(
            c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
            c.intermediate_size, cache.num_blocks, cache.block_size, 0, 1, c.rms_norm_eps,
            c.head_dim**-0.5,
        )  # fmt: skip
        step, floats = _step_kernel()
        self.step = step
        self.scratch = torch.empty(floats(ctypes.byref(self.shape), max_rows))

    def row_limit(self, drafts: bool) -> int:
        """The most rows a step takes, with or without `drafts`: the same, since rows may be positions of one
        sequence (a verify step, chapter 08c) as each layer writes every row's K/V before any row attends."""
        return self.buckets[-1]

    @torch.no_grad()
    def run(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        context_lens: Sequence[int],
        fill_ids: Callable[[torch.Tensor], None] | None = None,
        verify: bool = False,
        state_slots: Sequence[int] = (),
    ) -> torch.Tensor:
        """Logits [n, vocab] for n rows (decoding sequences, or with `verify` rows of one sequence too), their K and
        V written to the pool. `fill_ids(ids)` may write input tokens the caller did not know when it called (the
        engine's overlapped steps, chapter 08). (`state_slots`: chapter 09b's contract; a model this step runs keeps
        no recurrent state.)"""
        n = len(token_ids)
        if not 1 <= n <= self.buckets[-1]:
            raise ValueError(f"a C decode step takes 1 to {self.buckets[-1]} rows, got {n}")
        ids = torch.tensor(token_ids, dtype=torch.long)
        if fill_ids is not None:
            fill_ids(ids)
        tables = np.zeros((n, max(map(len, block_tables))), dtype=np.int64)
        fill_tables(tables, block_tables)
        slots, lens = (np.asarray(v, dtype=np.int64) for v in (slots, context_lens))
        c = self.model.config
        cos, sin = rope_cos_sin(torch.tensor(positions), c.head_dim, c.rope_theta)
        x = self.model.embed(ids).to(torch.float32).contiguous()
        self.shape.table_width, self.shape.threads = tables.shape[1], torch.get_num_threads()
        code = self.step(
            self.layers, ctypes.byref(self.shape), n, x.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            slots.ctypes.data, tables.ctypes.data, lens.ctypes.data, self.model.norm.weight.data_ptr(),
            self.scratch.data_ptr(),
        )  # fmt: skip
        if code == -3:
            raise ValueError(
                f"a slot outside the pool of {self.cache.num_blocks} blocks: {slots.tolist()}"
            )
        if code == -2:
            raise ValueError(
                f"block tables name blocks outside the pool of {self.cache.num_blocks} (or too few for"
                f" their context lengths {lens.tolist()})"
            )
        if code != 0:
            raise MemoryError("the C decode step: no memory for attention's scores")
        return self.model.compute_logits(x)

    def greedy_tokens(self, logits: torch.Tensor) -> None:
        "None: the argmax is the sampler's (a GPU's graphs take it in the same replay, chapter 09b)."
        return None


def cpu_decode_runner(
    model: Transformer, cache: PagedKVCache, max_rows: int = ENGINE_DECODE_ROWS
) -> CPUDecodeRunner | None:
    "A `CPUDecodeRunner` for steps of up to `max_rows` rows where it runs (`cpu_decode_refusal`), else None."
    if cpu_decode_refusal(model, cache) is not None:
        return None
    return CPUDecodeRunner(model, cache, min(max_rows, ENGINE_DECODE_ROWS))


# %% [markdown]
# ## How fast
#
# SmolLM2-135M-Instruct's Q4_1 file on a 2-core AMD EPYC (AVX-512 VNNI), 64 tokens of context a
# sequence (`PYTHONPATH=. python3 kernels_lab/cpu_decode_c_step.py`, milliseconds a step):
#
# | rows | PyTorch step | C step | of which the LM head |
# |---|---|---|---|
# | 1 | 10.74 | 5.08 (2.11×) | 0.73 |
# | 2 | 13.50 | 7.45 (1.81×) | 0.98 |
# | 4 | 16.84 | 12.24 (1.38×) | 1.54 |
# | 8 | 28.06 | 22.94 (1.22×) | 3.52 |
# | 16 | 47.15 | 43.85 (1.08×) | 7.55 |
#
# At one row the step reads the 96.6 MB of weights at ~19 GB/s; what PyTorch added there was
# dispatch. With more rows the weights are read once for all of them, and the integer dot products
# themselves take the time: PyTorch's int4 GEMM, which reuses a weight over the rows from its own
# tiles, nearly catches up at 16. The engine sends the C step its decode steps of up to
# `ENGINE_DECODE_ROWS` = 8 sequences; larger steps, and every step with prefill tokens, keep the
# PyTorch step. End to end, one request at a time: 172.2 output tok/s against llama.cpp's 114.6
# on the same file, prompt ids and threads, 1.50×; eight at once 332.9 tok/s together
# (`forge-engine bench w4 --model smollm2-135m-instruct --device cpu --quantization gguf --peers`,
# docs/benchmarks.md).

# %% [markdown]
# ## Tests
#
# Each model is decoded greedily three ways over paged caches of its own: by chapter 07a's PyTorch
# step (with chapter 09a's CPU layers, as the engine runs it) one sequence at a time, by the C step
# one sequence at a time, and by the C step all sequences at once. For a model without per-head
# norms, the C step is the PyTorch step's own kernels in the same order: its logits and its pool are
# *equal*, bit for bit. With Qwen3's per-head norms (computed by PyTorch in the eager step) they
# agree to float32 rounding. And rows never depend on each other: the batched C step equals the C
# step of each row alone, bit for bit.

# %%
import tempfile
from pathlib import Path

from forge_engine.config import preset
from forge_engine.fused_layers import install_cpu_layers
from forge_engine.gguf_file import GGUFFile, QType, write_gguf
from forge_engine.kv_cache import PagedAttention, build_step_layout
from forge_engine.model import empty_model, hf_state_dict, init_random_weights
from forge_engine.quant.layers import load_gguf_quantized


def eager_step(model, cache, seqs) -> torch.Tensor:
    """Chapter 07a's step without a runner: (block table, tokens computed, new token ids) a sequence -> the logits
    of each one's last token."""
    layout = build_step_layout([(t, done, len(new)) for t, done, new in seqs], cache.block_size)
    ids = torch.tensor([i for *_, new in seqs for i in new])
    with torch.no_grad():
        hidden = model(ids, layout.positions, PagedAttention(cache, layout))
    return model.compute_logits(hidden[layout.last_token_index])


def decode_three_ways(model, prompt_lens, steps, exact, seed=0) -> list[list[int]]:
    "Greedy decode of random prompts as described above; returns each sequence's tokens."
    c, size = model.config, 16
    g = torch.Generator().manual_seed(seed)
    need = [-(-(n + steps) // size) for n in prompt_lens]
    num_blocks = sum(need) + 2
    order = torch.randperm(num_blocks, generator=g).tolist()  # blocks in no particular order
    tables = [order[sum(need[:i]) : sum(need[: i + 1])] for i in range(len(need))]
    tokens = [torch.randint(0, c.vocab_size, (n,), generator=g).tolist() for n in prompt_lens]
    eager, alone, batched = (PagedKVCache(c, num_blocks, size) for _ in range(3))
    for cache in (eager, alone, batched):
        eager_step(model, cache, [(t, 0, ids) for t, ids in zip(tables, tokens)])
    c_alone, c_batched = CPUDecodeRunner(model, alone), CPUDecodeRunner(model, batched)
    for _ in range(steps):
        args = [
            (ids[-1], len(ids) - 1, t[(len(ids) - 1) // size] * size + (len(ids) - 1) % size, t)
            for ids, t in zip(tokens, tables)
        ]  # (token, position, slot, table) a row
        want = torch.cat(
            [
                eager_step(model, eager, [(t, len(ids) - 1, ids[-1:])])
                for ids, t in zip(tokens, tables)
            ]
        )
        got = torch.cat([c_alone.run([a], [p], [s], [t], [p + 1]) for a, p, s, t in args])
        rows = c_batched.run(*map(list, zip(*args)), [p + 1 for _, p, _, _ in args])
        assert torch.equal(rows, got)  # rows do not depend on each other
        if exact:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
        for ids, row in zip(tokens, want.argmax(-1).tolist()):
            ids.append(row)
    assert torch.equal(alone.k_cache, batched.k_cache) and torch.equal(
        alone.v_cache, batched.v_cache
    )
    close = torch.equal if exact else functools.partial(torch.allclose, rtol=1e-4, atol=1e-5)
    assert close(eager.k_cache, alone.k_cache) and close(eager.v_cache, alone.v_cache)
    return tokens


# %% [markdown]
# Tiny random models written as GGUF files by chapter 01a's writer: Qwen3 (per-head norms, a tied
# Q8_0 head) and Qwen2 (biases), their matrices in mixed Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 so that
# a layer's QKV projection has three runs of rows. Prompts cross block boundaries.

# %%
tmp_dir = tempfile.TemporaryDirectory()


def tiny_gguf_model(name: str, seed: int, config=None) -> Transformer:
    "A random model of preset `name` (or `config`), written as a GGUF file and loaded with its blocks kept."
    config = (config or preset(name)).replace(vocab_size=256)
    state = hf_state_dict(init_random_weights(empty_model(config), seed, std=0.05))
    state = {k: v.contiguous() for k, v in state.items()}
    types = [QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1]
    qtypes = {k: types[i % 3] for i, k in enumerate(state) if "proj" in k}
    qtypes["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"] = (
        QType.Q8_0
    )
    path = write_gguf(Path(tmp_dir.name) / f"{name}.gguf", config, state, qtypes)
    return install_cpu_layers(load_gguf_quantized(GGUFFile(path)))


qwen3 = tiny_gguf_model("qwen3-tiny", 1)
assert len(qwen3.layers[0].attn.qkv.qtypes) == 3 and qwen3.layers[0].attn.q_norm is not None
decode_three_ways(qwen3, [3, 17, 40], steps=5, exact=False)
qwen2 = tiny_gguf_model("qwen2-tiny", 2)
assert qwen2.layers[0].attn.qkv.bias is not None
decode_three_ways(qwen2, [16, 1, 29], steps=5, exact=True)

# %% [markdown]
# The K types of Q4_K_M and Q5_K_M files: the same Qwen2 shape widened to whole super-blocks of
# 256, its matrices swapped for random Q4_K, Q5_K and Q6_K blocks (the `gguf` package cannot write
# K types), QKV as three runs. Chapter 10da's kernel computes the PyTorch step's products too, so this is exact as well.

# %%
from forge_engine.quant.gguf_blocks import gguf_bytes


K_TYPES = {  # each matrix's runs: QKV as three
    "attn.qkv": [QType.Q4_K, QType.Q6_K, QType.Q5_K],
    "attn.o": [QType.Q5_K],
    "mlp.gate_up": [QType.Q4_K],
    "mlp.down": [QType.Q6_K],
}


def with_k_quants(model: Transformer) -> Transformer:
    "`model` with each layer matrix replaced by random rows of K_TYPES of its shape (biases kept)."
    c = model.config
    for i, layer in enumerate(model.layers):
        for name, matrix in _matrices(layer).items():
            sizes = (
                [c.q_size, c.kv_size, c.kv_size] if name == "attn.qkv" else [matrix.out_features]
            )
            parts = [
                (
                    f"{i}.{name}.{k}",
                    t,
                    (n, matrix.in_features),
                    gguf_bytes(t, n, matrix.in_features, seed=10 * i + k),
                )
                for k, (t, n) in enumerate(zip(K_TYPES[name], sizes))
            ]
            parent, _, attr = name.rpartition(".")
            setattr(layer.get_submodule(parent), attr, GGUFLinear(parts, matrix.bias))
    return model


wide = preset("qwen2-tiny").replace(
    hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64
)
k_quants = with_k_quants(tiny_gguf_model("qwen2-tiny", 3, wide))
assert k_quants.layers[1].attn.qkv.qtypes == (12, 14, 13)
assert cpu_decode_refusal(k_quants, PagedKVCache(wide, 4, 16)) is None
decode_three_ways(k_quants, [20, 3], steps=4, exact=True)

# %% [markdown]
# SmolLM2-135M-Instruct's own GGUF file (Q4_1 layers, the tied Q8_0 head), fetched by the registry.

# %%
from forge_engine.loader import load_model

smol = install_cpu_layers(
    load_model("smollm2-135m-instruct", "cpu", progress=False, quantization="gguf").model
)
decode_three_ways(smol, [5, 31, 12], steps=6, exact=True)

# %% [markdown]
# The engine of chapter 08 runs a GGUF model's decode steps on a CPU through it: one request, greedy,
# gives the tokens of the PyTorch step alone, and every decode step went to the C call.

# %%
from forge_engine.config import EngineConfig
from forge_engine.engine import LLMEngine
from forge_engine.generate import SamplingParams

loaded = load_model("smollm2-135m-instruct", "cpu", progress=False, quantization="gguf")
engine = LLMEngine(loaded, EngineConfig(max_num_seqs=4))
assert (
    type(engine.runner.decode).__name__ == "CPUDecodeRunner"
)  # (the package's: the cells define a twin)
c_steps = []
engine.runner.decode.run = lambda *args, run=engine.runner.decode.run, **kw: (
    c_steps.append(1) or run(*args, **kw)
)
prompt = loaded.tokenizer.encode("The capital of France is")
engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
while engine.has_unfinished():
    outputs = engine.step()
cache, table, tokens = PagedKVCache(loaded.model.config, 2, 16), [0, 1], list(prompt)
logits = eager_step(loaded.model, cache, [(table, 0, prompt)])
while len(tokens) < len(prompt) + 12:
    tokens.append(int(logits.argmax()))
    logits = eager_step(loaded.model, cache, [(table, len(tokens) - 1, tokens[-1:])])
assert outputs[0].token_ids == tokens[len(prompt) :] and len(c_steps) == 11, (outputs, c_steps)

# %% [markdown]
# A bad step changes nothing: a slot outside the pool, a table naming a block outside it or too
# short for its context, too many rows. Each is refused before anything is written.

# %%
cache = PagedKVCache(qwen2.config, 4, 16)
runner = CPUDecodeRunner(qwen2, cache, max_rows=2)
before = cache.k_cache.clone(), cache.v_cache.clone()
good = dict(token_ids=[1], positions=[0], slots=[0], block_tables=[[0]], context_lens=[1])
for bad, message in [
    (dict(slots=[4 * 16]), "a slot outside the pool of 4 blocks"),
    (dict(block_tables=[[4]]), "blocks outside the pool of 4"),
    (dict(context_lens=[17]), "too few for their context lengths [17]"),
    (dict(token_ids=[1, 2, 3]), "takes 1 to 2 rows, got 3"),
]:
    try:
        runner.run(**(good | bad))
        raise AssertionError(f"{bad} was run")
    except ValueError as e:
        assert message in str(e), e
assert torch.equal(cache.k_cache, before[0]) and torch.equal(cache.v_cache, before[1])
runner.run(**good)
assert not torch.equal(cache.k_cache, before[0])  # (and a good step does write)

# %% [markdown]
# Where it does not run the engine keeps its PyTorch step: dense weights, for one.

# %%
dense = load_model("random:qwen3-tiny", "cpu", progress=False).model
assert "not GGUF blocks" in cpu_decode_refusal(dense, PagedKVCache(dense.config, 4, 16))
assert cpu_decode_runner(dense, PagedKVCache(dense.config, 4, 16)) is None
assert "not chapter 03's" in cpu_decode_refusal(
    torch.nn.Linear(2, 2), PagedKVCache(dense.config, 4, 16)
)
