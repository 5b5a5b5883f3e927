# %% [markdown]
# # Planning GPU memory
#
# > Before loading: do the weights, the activations, the CUDA graphs and a useful KV cache fit a memory budget? Say so with the numbers, or refuse with them.

# %% [markdown]
# An 8 GB consumer GPU cannot hold Qwen3-4B in BF16 (8.04 GB of weights alone). What it can
# hold depends on four things, each of which we can count *before* loading anything:
#
# | what | how it is counted |
# |---|---|
# | weights | from the model's shape and the weight format of chapter 10: BF16 2 bytes a weight; int8 1 byte + a 4-byte scale per output row; int4 half a byte + a 2-byte scale and a 2-byte minimum per 128 inputs; embedding, norms and biases stay in the compute dtype |
# | activations | the largest step, `max_num_batched_tokens` tokens: the QKV, attention, gate-up and SwiGLU outputs and the residual stream, plus the logits of `max_num_seqs` rows (model dtype, an fp32 copy, the sampler's adjusted copy) |
# | CUDA graphs | the decode graphs share one memory pool: the activations of a `max_num_seqs`-row step |
# | overhead | 256 MiB for what the caching allocator and the libraries keep (cuBLAS workspaces, Triton, fragmentation) |
#
# What is left is the KV cache; a plan is refused when that is under `MIN_KV_BYTES` (1 GiB:
# 7,281 tokens of Qwen3-4B context, e.g. seven 1,000-token conversations). The estimate is
# made before loading; after loading the runner *measures* the activation peak (chapter 07a)
# and sizes the pool from the budget and that measurement, and caps the process's allocator
# at the budget (`torch.cuda.set_per_process_memory_fraction`), so the plan can never be
# exceeded silently: an allocation past it fails with an out-of-memory error.

# %%
#| default_exp memory_plan

# %%
#| export
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from forge_engine.config import ModelConfig

# %%
#| hide
import pytest
from forge_engine.config import preset

# %% [markdown]
# Budgets are written the way people say them: `8GiB`, `7.5GB`, `512MiB`, or a byte count.

# %%
#| export
GiB = 2**30
MIN_KV_BYTES = GiB  # a plan that leaves less KV cache than this is refused
OVERHEAD_BYTES = (
    256 * 2**20
)  # allocator slack, cuBLAS workspaces, Triton: not in any tensor we count
INT4_GROUP = 128
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str | int) -> int:
    "'8GiB', '7.5GB', '512MiB', '1000000' -> bytes; a clear error for anything else."
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"not a memory size: {text!r} (write e.g. 8GiB, 7.5GB, 512MiB or a number of bytes)"
        )
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"a memory size must be positive, got {text!r}")
    return value


def format_gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


# %%
assert (
    parse_bytes("8GiB") == 8 * 2**30
    and parse_bytes("7.5GB") == 7_500_000_000
    and parse_bytes(4096) == 4096
)
for bad in ("eight", "8 GiBs", "-1GiB", "0"):
    with pytest.raises(ValueError, match="memory size"):
        parse_bytes(bad)


# %% [markdown]
# ## Counting
#
# The four matrices of a layer, as (outputs, inputs): QKV, the output projection, gate-up and
# down. Their bytes depend on the format. A quantized model also keeps its LM head in int8
# (chapter 10), and a tied embedding reads its rows from that head; everything else (norms,
# biases, an untied embedding) is in the compute dtype. On the dense path (more than 16 rows) a
# quantized matrix is dequantized a tile at a time: one tile's temporaries count as activations.

# %%
#| export
def layer_matrices(c: ModelConfig) -> list[tuple[int, int]]:
    "(out_features, in_features) of one layer's qkv, o, gate_up and down."
    return [
        (c.q_size + 2 * c.kv_size, c.hidden_size),
        (c.hidden_size, c.q_size),
        (2 * c.intermediate_size, c.hidden_size),
        (c.hidden_size, c.intermediate_size),
    ]


def matrix_bytes(n: int, k: int, quantization: str, dtype_bytes: int) -> int:
    "Bytes of an [n, k] weight stored as `quantization` (chapter 10's layouts)."
    if quantization == "none":
        return n * k * dtype_bytes
    if quantization == "int8":
        return n * k + 4 * n  # int8 weights, an fp32 scale per row
    if quantization == "int4":
        return n * k // 2 + 4 * n * math.ceil(k / INT4_GROUP)  # nibbles, fp16 scale + minimum
    raise ValueError(
        f"no size rule for quantization {quantization!r} (a GGUF file's blocks: plan from the file size)"
    )


def weight_bytes(c: ModelConfig, quantization: str = "none", dtype_bytes: int = 2) -> int:
    "All weights: the layer matrices in `quantization` and the LM head in int8 when quantized, the rest in the compute dtype."
    matrices = (
        sum(matrix_bytes(n, k, quantization, dtype_bytes) for n, k in layer_matrices(c))
        * c.num_layers
    )
    rest = (
        c.num_parameters - sum(n * k for n, k in layer_matrices(c)) * c.num_layers
    )  # embedding, head, norms, biases
    if quantization == "none":
        return matrices + rest * dtype_bytes
    head = c.vocab_size * c.hidden_size  # in `rest` once when tied: then it is the embedding too
    return (
        matrices
        + matrix_bytes(c.vocab_size, c.hidden_size, "int8", dtype_bytes)
        + (rest - head) * dtype_bytes
    )


DEQUANTIZE_TILE_BYTES = (
    12 * 2**24
)  # chapter 10's DENSE_TILE_WEIGHTS, each under 12 bytes of temporaries


def activation_bytes(
    c: ModelConfig, tokens: int, rows: int, dtype_bytes: int = 2, quantization: str = "none"
) -> int:
    "An upper estimate of one forward's live tensors: `tokens` tokens, logits for `rows` of them."
    per_token = (
        (c.q_size + 2 * c.kv_size) + 2 * c.q_size + 3 * c.intermediate_size + 4 * c.hidden_size
    )
    tile = 0 if quantization == "none" else DEQUANTIZE_TILE_BYTES
    return tokens * per_token * dtype_bytes + rows * c.vocab_size * (dtype_bytes + 4 + 4) + tile


# %% [markdown]
# **While loading.** An int8 / int4 model under a budget is staged on the CPU in full precision and
# quantized on the GPU a slice of rows at a time (chapters 04a and 10): the GPU holds the matrices
# quantized so far, the current one's result, filled slice by slice, and one slice's temporaries
# (chapter 10's `quantize_rows`: 2^24 weights, each its input in the compute dtype and FP32 copies,
# under 24 bytes). The LM head is quantized last, and only then do the norms (and an untied embedding)
# arrive. So the loading peak is at most the weights plus one slice's temporaries (384 MiB). Unquantized
# models load straight onto the GPU: the peak is the weights. A plan that leaves `MIN_KV_BYTES` of KV
# cache always has room for the loading peak.

# %%
#| export
QUANTIZE_SLICE_BYTES = (
    24 * 2**24
)  # chapter 10's QUANTIZE_CHUNK weights, each under 24 bytes of temporaries


def load_peak_bytes(c: ModelConfig, quantization: str = "none", dtype_bytes: int = 2) -> int:
    "An upper bound of the GPU memory the weights take while they load (chapter 04a's staging and chapter 10's slices)."
    weights = weight_bytes(c, quantization, dtype_bytes)
    return weights if quantization == "none" else weights + QUANTIZE_SLICE_BYTES


# %% [markdown]
# The weight count agrees with the guide's figure for Qwen3-4B (8,044,936,192 bytes in BF16):

# %%
q4b = preset("qwen3-4b")
assert weight_bytes(q4b) == 8_044_936_192
print({q: format_gib(weight_bytes(q4b, q)) for q in ("none", "int8", "int4")})
# int8: a byte a weight for two, a 4-byte scale a row of 2,560 or more, the norms in bf16: 0.5006
assert (
    0.49 < weight_bytes(q4b, "int8") / weight_bytes(q4b) < 0.51
)  # tied: one int8 table is embedding and head
# int4: half a byte a weight and 4 bytes of scale and minimum a group of 128 (0.53 bytes for 2), the head (10% of the
# weights) in int8: 0.288
assert 0.28 < weight_bytes(q4b, "int4") / weight_bytes(q4b) < 0.29
q8b = preset(
    "qwen3-8b"
)  # untied: the embedding stays in BF16 (read a row a token), the head becomes int8
head = q8b.vocab_size * q8b.hidden_size
assert weight_bytes(q8b, "int8") - weight_bytes(q8b.replace(vocab_size=1), "int8") == (
    head - q8b.hidden_size
) * 3 + 4 * (q8b.vocab_size - 1)
assert (
    load_peak_bytes(q4b) == weight_bytes(q4b)
    and load_peak_bytes(q4b, "int8") < weight_bytes(q4b, "int8") + 2**29
)

# %% [markdown]
# The counts are what chapter 10 builds: small models of both kinds, tied and untied (with
# biases), quantized in BF16, hold exactly the bytes counted here.

# %%
import torch
from forge_engine.loader import model_bytes
from forge_engine.model import empty_model, init_random_weights
from forge_engine.quant.layers import quantize_model

for name in ("qwen3-tiny", "qwen2-tiny"):
    small = preset(name).replace(
        vocab_size=1000, hidden_size=128, intermediate_size=256
    )  # inputs: multiples of 128
    for mode in ("none", "int8", "int4"):
        model = init_random_weights(empty_model(small, dtype=torch.bfloat16), seed=0)
        if mode != "none":
            quantize_model(model, mode)
        assert model_bytes(model) == weight_bytes(small, mode), (
            name,
            mode,
            model_bytes(model),
            weight_bytes(small, mode),
        )


# %% [markdown]
# ## The plan

# %%
#| export
class MemoryPlanError(ValueError):
    "The model does not fit the budget in the asked format; the message has the numbers."


@dataclass(frozen=True)
class MemoryPlan:
    budget: int
    quantization: str
    weights: int
    activations: int
    graphs: int
    overhead: int
    kv_cache: int
    kv_tokens: int
    load_peak: int  # the weights' peak while loading (load_peak_bytes)

    def describe(self) -> str:
        return (
            f"memory plan for {format_gib(self.budget)}: weights ({self.quantization}) {format_gib(self.weights)}, "
            f"activations {format_gib(self.activations)}, CUDA graphs {format_gib(self.graphs)}, "
            f"overhead {format_gib(self.overhead)} -> KV cache {format_gib(self.kv_cache)} "
            f"({self.kv_tokens:,} tokens); loading peak {format_gib(self.load_peak)}"
        )


def plan_memory(
    c: ModelConfig,
    budget: int,
    quantization: str = "none",
    dtype_bytes: int = 2,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 64,
    cuda_graphs: bool = True,
    weights: tuple[int, int] | None = None,
) -> MemoryPlan:
    """What `budget` bytes hold for model `c` in `quantization`; MemoryPlanError (with what would fit) when too little.
    `weights`: (bytes, loading peak) of the weights in `quantization` where the caller knows them better than the
    size rules above (a GGUF file's blocks: chapter 10g's `gguf_gpu_bytes`, from the file's types)."""

    def plan(mode: str) -> MemoryPlan:
        given = weights if weights is not None and mode == quantization else None
        weights_bytes = given[0] if given else weight_bytes(c, mode, dtype_bytes)
        acts = activation_bytes(c, max_num_batched_tokens, max_num_seqs, dtype_bytes, mode)
        graphs = (
            activation_bytes(c, max_num_seqs, max_num_seqs, dtype_bytes, mode) if cuda_graphs else 0
        )
        kv = budget - weights_bytes - acts - graphs - OVERHEAD_BYTES
        return MemoryPlan(
            budget,
            mode,
            weights_bytes,
            acts,
            graphs,
            OVERHEAD_BYTES,
            kv,
            max(0, kv) // c.kv_bytes_per_token(dtype_bytes),
            given[1] if given else load_peak_bytes(c, mode, dtype_bytes),
        )

    chosen = plan(quantization)
    if chosen.kv_cache >= MIN_KV_BYTES:
        return chosen
    others = [
        p
        for p in map(plan, ("none", "int8", "int4"))
        if p.quantization != quantization and p.kv_cache >= MIN_KV_BYTES
    ]
    hint = (
        f"; it would fit as {others[0].quantization} with {format_gib(others[0].kv_cache)} of KV cache"
        if others
        else "; it does not fit in any weight format: lower max_num_batched_tokens / max_num_seqs or use a smaller model"
    )
    raise MemoryPlanError(
        f"{chosen.describe()}, under the {format_gib(MIN_KV_BYTES)} minimum{hint}"
    )


# %% [markdown]
# Qwen3-4B under an 8 GiB budget: BF16 is refused (the weights alone are 7.5 GiB) and the
# error says int8 would fit; int8 leaves about 3.4 GiB for the KV cache.

# %%
with pytest.raises(MemoryPlanError, match=r"under the 1.00 GiB minimum; it would fit as int8"):
    plan_memory(q4b, parse_bytes("8GiB"))
p8 = plan_memory(q4b, parse_bytes("8GiB"), "int8")
assert (
    p8.kv_cache >= MIN_KV_BYTES
    and p8.weights + p8.activations + p8.graphs + p8.overhead + p8.kv_cache == p8.budget
)
print(p8.describe())
assert p8.load_peak == p8.weights + QUANTIZE_SLICE_BYTES and p8.load_peak + p8.overhead < p8.budget
assert plan_memory(q4b, parse_bytes("80GiB")).kv_tokens > 400_000
with pytest.raises(MemoryPlanError, match="does not fit in any weight format"):
    plan_memory(q4b, parse_bytes("2GiB"), "int4")
with pytest.raises(ValueError, match="plan from the file size"):
    plan_memory(q4b, parse_bytes("8GiB"), "gguf")
# a GGUF file's blocks: the caller gives the bytes it computed from the file's types (chapter 10g)
pg = plan_memory(q4b, parse_bytes("8GiB"), "gguf", weights=(3 * GiB, 3 * GiB + 2**28))
assert pg.weights == 3 * GiB and pg.load_peak == 3 * GiB + 2**28 and pg.quantization == "gguf"
assert (
    pg.kv_cache == p8.kv_cache + p8.weights - 3 * GiB
)  # the same activations and graphs as int8's
