# %% [markdown]
# # Configuration
#
# > `ModelConfig` says what a model *is*; `EngineConfig` says how we *run* it.
#
# Every later chapter takes these two objects as input. They are plain frozen dataclasses:
# building one never touches the disk or the network. Reading `config.json` or a GGUF header
# happens elsewhere (chapter 01); here we only turn an already-parsed dictionary into a
# `ModelConfig`, so a student can build any model shape by hand in one line.

# %%
#| default_exp config

# %%
#| export
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# %% [markdown]
# ## One decoder, three families
#
# Qwen3, Qwen2/2.5 and Llama (e.g. SmolLM2) are the same decoder with small switches:
#
# | family | q/k RMSNorm | q/k/v bias | rotary layout in checkpoints |
# |---|---|---|---|
# | Qwen3 | yes | no | half-split ("neox") |
# | Qwen2 / 2.5 | no | yes | half-split |
# | Llama | no | no | half-split in HF files; GGUF stores q/k permuted for interleaved rotary |
#
# `head_dim` is its own field: Qwen3 decouples it from `hidden_size / num_heads`
# (Qwen3-4B: 2560 / 32 = 80, but `head_dim` = 128).

# %%
#| export
ARCHITECTURES = ("qwen3", "qwen2", "llama")


@dataclass(frozen=True)
class ModelConfig:
    "The shape of a decoder-only transformer of the Qwen3 / Qwen2 / Llama family."

    architecture: str  # one of ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qk_norm: bool = False  # RMSNorm on each head of q and k (Qwen3)
    attention_bias: bool = False  # bias on q, k and v projections (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(ARCHITECTURES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_parameters(self) -> int:
        "Parameter count, counting a tied embedding once."
        h, i = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        layer = attn + 3 * h * i + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embed + h

    @property
    def kv_layers(self) -> int:
        "Layers with a KV cache: all of them (chapter 03b's hybrid model has fewer)."
        return self.num_layers

    @property
    def linear_layers(self) -> int:
        "Layers with a recurrent state instead of a KV cache: none (chapter 03b's hybrid model has some)."
        return 0

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        "Bytes of K and V cache one token takes over all layers."
        return 2 * self.kv_layers * self.kv_size * dtype_bytes

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


# %% [markdown]
# ## From a Hugging Face `config.json`
#
# The dictionary comes from `json.load`; we keep only what the forward pass needs and refuse
# what we would silently get wrong (an unknown `model_type`, a rope scaling we don't implement).

# %%
#| export
_HF_MODEL_TYPES = {"qwen3": "qwen3", "qwen2": "qwen2", "llama": "llama", "mistral": "llama"}


def _as_tuple(x) -> tuple[int, ...]:
    if x is None:
        return ()
    return tuple(x) if isinstance(x, (list, tuple)) else (int(x),)


def model_config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    "Build a `ModelConfig` from a parsed Hugging Face `config.json`."
    model_type = cfg.get("model_type")
    if model_type not in _HF_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r} in config.json; supported: {', '.join(_HF_MODEL_TYPES)}"
        )
    arch = _HF_MODEL_TYPES[model_type]
    rope_scaling = cfg.get("rope_scaling") or (cfg.get("rope_parameters") or {})
    kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if kind not in ("default", None):
        raise ValueError(f"rope scaling {kind!r} is not implemented; only plain RoPE is supported")
    theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    heads = cfg["num_attention_heads"]
    return ModelConfig(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rope_theta=float(theta),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        qk_norm=arch == "qwen3",
        attention_bias=cfg.get("attention_bias", arch == "qwen2"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_as_tuple(cfg.get("eos_token_id")),
    )


# %% [markdown]
# ## From GGUF metadata
#
# A GGUF file carries the same facts under keys prefixed by the architecture name
# (`llama.block_count`, `qwen3.attention.head_count_kv`, ...). Whether the embedding is tied is
# not a key: it is tied when the file has no `output.weight` tensor, so the caller passes the
# tensor names too.

# %%
#| export
def model_config_from_gguf(metadata: dict[str, Any], tensor_names=()) -> ModelConfig:
    "Build a `ModelConfig` from decoded GGUF metadata (key -> python value)."
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}"
        )

    def key(name, default=None):
        value = metadata.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{name}")
        return value

    hidden, heads = key("embedding_length"), key("attention.head_count")
    vocab = metadata.get(f"{arch}.vocab_size") or len(metadata.get("tokenizer.ggml.tokens", ()))
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=int(heads),
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(key("attention.key_length", hidden // heads)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in set(tensor_names),
        qk_norm=arch == "qwen3",
        attention_bias=arch == "qwen2",
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


# %% [markdown]
# ## Presets
#
# Named shapes for `random:<preset>` models: the real Qwen3-4B-Instruct-2507 shape (for GPU
# timing with random weights) and tiny shapes for tests, including the odd corners a
# parity test should cover: `head_dim` unrelated to `hidden/heads`, untied embeddings and a
# single KV head. Tiny presets keep the real Qwen3 vocabulary so they work with the real
# tokenizer.

# %%
#| export
QWEN3_EOS = (151645, 151643)  # <|im_end|>, <|endoftext|>

PRESETS: dict[str, ModelConfig] = {
    "qwen3-4b": ModelConfig(
        architecture="qwen3",
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=5_000_000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=262144,
        tie_word_embeddings=True,
        qk_norm=True,
        bos_token_id=None,
        eos_token_ids=QWEN3_EOS,
    ),
    # the larger Qwen3 shapes (their config.json), for tensor parallelism's benchmarks with random weights
    "qwen3-8b": ModelConfig(
        architecture="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        qk_norm=True,
        bos_token_id=None,
        eos_token_ids=QWEN3_EOS,
    ),
    "qwen3-14b": ModelConfig(
        architecture="qwen3",
        vocab_size=151936,
        hidden_size=5120,
        intermediate_size=17408,
        num_layers=40,
        num_heads=40,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        qk_norm=True,
        bos_token_id=None,
        eos_token_ids=QWEN3_EOS,
    ),
    "qwen3-tiny": ModelConfig(
        architecture="qwen3",
        vocab_size=151936,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rope_theta=1_000_000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        qk_norm=True,
        eos_token_ids=QWEN3_EOS,
    ),
    "qwen2-tiny": ModelConfig(
        architecture="qwen2",
        vocab_size=151936,
        hidden_size=64,
        intermediate_size=160,
        num_layers=2,
        num_heads=4,
        num_kv_heads=1,
        head_dim=16,
        rope_theta=1_000_000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        attention_bias=True,
        eos_token_ids=QWEN3_EOS,
    ),
    "llama-tiny": ModelConfig(
        architecture="llama",
        vocab_size=151936,
        hidden_size=48,
        intermediate_size=96,
        num_layers=3,
        num_heads=6,
        num_kv_heads=2,
        head_dim=8,
        rope_theta=100_000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_ids=QWEN3_EOS,
    ),
}


def preset(name: str) -> ModelConfig:
    "The `ModelConfig` of a named preset; the error lists the known names."
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    return PRESETS[name]


# %% [markdown]
# The Qwen3-4B preset must have exactly the parameter count of the real checkpoint
# (4,022,468,096, i.e. 8,044,936,192 bytes in BF16):

# %%
q4b = preset("qwen3-4b")
assert q4b.num_parameters == 4_022_468_096, q4b.num_parameters
assert q4b.num_parameters * 2 == 8_044_936_192
assert q4b.kv_bytes_per_token() == 147_456  # 36 layers x (K,V) x 8 heads x 128 x 2 bytes
assert q4b.head_dim * q4b.num_heads != q4b.hidden_size  # Qwen3 decouples head_dim
# the 8B and 14B shapes: 8.19 and 14.77 billion parameters (untied heads), as their model cards round them
assert (
    preset("qwen3-8b").num_parameters == 8_190_735_360
    and preset("qwen3-14b").num_parameters == 14_768_307_200
)

# %% [markdown]
# Reading a real-looking `config.json` dictionary (the fields of Qwen3-4B-Instruct-2507):

# %%
hf_cfg = {
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rope_theta": 5000000,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "rope_scaling": None,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
c = model_config_from_hf(hf_cfg)
assert c.replace(bos_token_id=None, eos_token_ids=QWEN3_EOS) == q4b
assert c.eos_token_ids == (151645,)

# %% [markdown]
# Bad input names the problem:

# %%
import pytest

with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
    model_config_from_hf({**hf_cfg, "model_type": "gpt2"})
with pytest.raises(ValueError, match="rope scaling 'yarn'"):
    model_config_from_hf({**hf_cfg, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
with pytest.raises(ValueError, match="multiple of num_kv_heads"):
    q4b.replace(num_kv_heads=7)
with pytest.raises(ValueError, match="known presets: qwen3-4b"):
    preset("qwen9")

# %% [markdown]
# GGUF metadata as SmolLM2-135M-Instruct's file carries it (tied: no `output.weight`):

# %%
smol_meta = {
    "general.architecture": "llama",
    "llama.block_count": 30,
    "llama.context_length": 8192,
    "llama.embedding_length": 576,
    "llama.feed_forward_length": 1536,
    "llama.attention.head_count": 9,
    "llama.attention.head_count_kv": 3,
    "llama.rope.freq_base": 100000.0,
    "llama.attention.layer_norm_rms_epsilon": 1e-5,
    "llama.vocab_size": 49152,
    "tokenizer.ggml.eos_token_id": 2,
    "tokenizer.ggml.bos_token_id": 1,
}
smol = model_config_from_gguf(smol_meta, ["token_embd.weight", "blk.0.attn_q.weight"])
assert (smol.head_dim, smol.num_kv_heads, smol.tie_word_embeddings, smol.qk_norm) == (
    64,
    3,
    True,
    False,
)
assert smol.num_parameters == 134_515_008
with pytest.raises(ValueError, match="unsupported GGUF architecture 'gemma'"):
    model_config_from_gguf({**smol_meta, "general.architecture": "gemma"})

# %% [markdown]
# ## Engine configuration
#
# How we run the model: where, in which dtype, and the limits the serving core (chapters 05-08)
# works within. `device=None` and `dtype=None` mean "choose": CUDA when there is a GPU
# (BF16), else CPU (FP32, the dtype CPUs compute fastest and most exactly in).

# %%
#| export
QUANTIZATIONS = (
    "none",
    "int8",
    "int4",
    "gguf",
    "auto",  # a GGUF file's blocks kept on a CPU (chapter 10f's C step), else none
)  # weight formats of the layer matrices (chapter 10)


MAX_SPECULATIVE_TOKENS = (
    7  # a verify step of one sequence fits the CPU's 8-row decode step (chapter 10f)
)


@dataclass(frozen=True)
class EngineConfig:
    "How to run a model: device, dtype, and the limits of the serving core."

    device: str | None = None
    dtype: str | None = None  # "float32", "bfloat16", "float16"
    max_model_len: int | None = None  # default: the model's context, capped by the KV pool
    block_size: int = 16  # tokens per KV-cache block
    max_num_seqs: int = 64  # sequences decoded together at most
    max_num_batched_tokens: int = 2048  # tokens one engine step may process
    max_waiting: int = 1024  # requests queued before new ones are refused
    kv_cache_bytes: int | None = (
        None  # KV pool size; None: from gpu_memory_utilization or a CPU default
    )
    gpu_memory_utilization: float = 0.90
    enable_prefix_caching: bool = True
    batch_invariant: bool = (
        False  # fixed-shape execution: greedy tokens never depend on the rest of the batch
    )
    cuda_graphs: bool | None = (
        None  # decode through static buffers, replayed from CUDA graphs on a GPU; None: on CUDA
    )
    async_scheduling: bool | None = (
        None  # build step N+1 while the GPU runs step N (chapter 08); None: on GPUs
    )
    seed: int = 0
    tensor_parallel_size: int = 1  # processes (GPUs) one model is split over (chapter 09c)
    quantization: str = (
        "none"  # "int8" / "int4": quantized at load; "gguf": a GGUF file's blocks kept as they are
    )
    gpu_memory_budget: int | None = (
        None  # bytes this engine may use on the GPU (chapter 10a); None: gpu_memory_utilization
    )
    speculative_tokens: int = (
        0  # tokens proposed ahead by prompt lookup and checked in one step (chapter 08c); 0: off
    )

    def __post_init__(self):
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_waiting",
            "tensor_parallel_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.gpu_memory_budget is not None and self.gpu_memory_budget <= 0:
            raise ValueError(
                f"gpu_memory_budget must be a positive number of bytes, got {self.gpu_memory_budget}"
            )
        if not 0 <= self.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], got {self.speculative_tokens}"
            )
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


# %%
assert EngineConfig().block_size == 16
with pytest.raises(ValueError, match="dtype must be"):
    EngineConfig(dtype="int3")
with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
    EngineConfig(max_num_seqs=0)
with pytest.raises(
    ValueError, match="quantization must be one of none, int8, int4, gguf, auto, got 'int3'"
):
    EngineConfig(quantization="int3")
