# %% [markdown]
# # The model
#
# > One decoder for Qwen3, Qwen2 and Llama: RMSNorm, RoPE, grouped-query attention, SwiGLU.
#
# In: token ids and their positions, flattened into one vector of `T` tokens. Out: a hidden
# state per token, and from it the logits over the vocabulary. The model holds no cache: each
# attention layer hands its `q`, `k`, `v` to an *attention backend* passed in by the caller.
# Here that backend is plain causal attention over one sequence; chapter 04 passes a
# contiguous KV cache, chapter 05 a paged one. The model never changes.
#
# We check ourselves against Hugging Face `transformers` (the reference implementation) built
# at random init from tiny configs: same logits to fp32 rounding, same greedy tokens.

# %%
#| default_exp model

# %%
#| export
from __future__ import annotations

import functools
import re
from typing import Iterable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from forge_engine.config import ModelConfig

# %%
#| hide
import pytest
from forge_engine.config import preset


# %% [markdown]
# ## RMSNorm
#
# Scale each vector to unit root-mean-square, then by a learned weight. Computed in fp32 even
# when the model runs in bf16: the mean of squares is where low precision hurts.
#
# A pre-norm layer always adds a block's output to the residual stream and then normalises
# the sum: `add_and_norm` does both. (On a GPU, chapter 09a swaps in a subclass that does the
# same arithmetic as one Triton kernel, reading each row once, instead of eight small ones.)

# %%
#| export
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        "(norm(x + residual), x + residual): the residual add and the next norm."
        residual = x + residual
        return self(residual), residual


# %%
norm = RMSNorm(8, 1e-6)
y = norm(torch.randn(3, 8) * 5)
# fp32: eps / mean square (< 1e-6 here) and some 20 roundings of 2^-24: under 2e-6
assert torch.allclose(y.pow(2).mean(-1), torch.ones(3), rtol=1e-5, atol=0)
a, b = torch.randn(3, 8), torch.randn(3, 8)
normed, residual = norm.add_and_norm(a, b)
assert torch.equal(residual, a + b) and torch.equal(normed, norm(a + b))


# %% [markdown]
# ## Rotary position embeddings (RoPE)
#
# Each head vector is split into two halves, `(x1, x2)`; pair `i` is rotated by the angle
# `position * theta^(-2i/d)`. Low `i` spin fast (fine position), high `i` spin slowly (coarse
# position). Attention scores then depend only on the *distance* between query and key.
# We compute the angles from the positions on the fly: no table of 262,144 positions to keep.

# %%
#| export
@functools.lru_cache(maxsize=64)
def rope_inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """The rotation speed of each of the head_dim/2 pairs, in fp32. Computed once per (head_dim, theta, device) and
    shared (read-only): a GPU decode step would otherwise spend five small kernel launches on it, every step."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (theta**exponents)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, pair) angle: two [T, head_dim/2] tensors, computed in fp32 and rounded to `dtype`.
    (Integer positions times the fp32 speeds make fp32 angles in one kernel; cos and sin round as they store: a decode
    step's three launches, not six.)"""
    angles = positions[:, None] * rope_inv_freq(head_dim, theta, positions.device)[None, :]
    cos, sin = (torch.empty(angles.shape, dtype=dtype, device=angles.device) for _ in range(2))
    return torch.cos(angles, out=cos), torch.sin(angles, out=sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    "Rotate each (first half, second half) pair of x [T, heads, head_dim] by its angle."
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


# %% [markdown]
# A rotation keeps lengths, and the dot product of a rotated query and key depends only on how
# far apart they are:

# %%
g = torch.Generator().manual_seed(0)
q, k = (torch.randn(1, 1, 16, dtype=torch.float64, generator=g) for _ in range(2))


def rotated(x, pos):
    cos, sin = rope_cos_sin(torch.tensor([pos]), 16, 10000.0)
    return apply_rope(x, cos.double(), sin.double())


assert torch.allclose(
    rotated(q, 7).norm(), q.norm(), rtol=2e-7, atol=0
)  # fp32 cos and sin within an ulp (2^-23) each
# in bf16: the fp32 values rounded once (what `.to(torch.bfloat16)` after them gives)
assert all(
    torch.equal(a.to(torch.bfloat16), b)
    for a, b in zip(
        rope_cos_sin(torch.arange(300), 128, 1e6),
        rope_cos_sin(torch.arange(300), 128, 1e6, torch.bfloat16),
    )
)
# (to fp32 precision: 107 and 100 times the same fp32 speed round to fp32 angles within half an ulp, 2^-18 = 4e-6 rad,
# so the two angles' difference is off by at most 8e-6 rad per pair, and the dot product by 8e-6 * |q| |k| at most)
same_gap = (rotated(q, 10) * rotated(k, 3)).sum() - (rotated(q, 107) * rotated(k, 100)).sum()
assert same_gap.abs() <= 1e-5 * q.norm() * k.norm(), same_gap

# %%
import matplotlib.pyplot as plt

cos, _ = rope_cos_sin(torch.arange(256), 128, 5_000_000.0)
fig, ax = plt.subplots(figsize=(8, 2.5))
ax.imshow(cos.T, aspect="auto", cmap="RdBu", interpolation="nearest")
ax.set(
    xlabel="position",
    ylabel="pair i (fast -> slow)",
    title="RoPE: cos(angle) for Qwen3-4B's 64 pairs",
)
plt.show()


# %% [markdown]
# ## Attention, and the backend that owns the cache
#
# Grouped-query attention: 32 query heads share 8 key/value heads in Qwen3-4B, so each K/V
# head serves a *group* of 4 query heads. `causal_attention` is the reference every faster
# path is tested against. Query `i` sits at absolute position `q_offset + i` and may look at
# keys `0 .. q_offset + i`: with `q_offset = 0` it is plain causal attention over a prompt;
# with a cached prefix, `q_offset` is the prefix length.

# %%
#| export
def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int = 0
) -> torch.Tensor:
    "q [Tq, Hq, D], k/v [Tk, Hkv, D] -> [Tq, Hq, D]; query i attends to keys 0..q_offset+i."
    tq, tk = q.shape[0], k.shape[0]
    mask, causal = None, False
    if q_offset == 0 and tq == tk:
        causal = True  # a whole prompt: the plain causal pattern, which has a fast kernel
    elif not (
        tq == 1 and q_offset == tk - 1
    ):  # (one query at the end sees every key: no mask at all)
        query_pos = torch.arange(tq, device=q.device)[:, None] + q_offset
        mask = torch.arange(tk, device=q.device)[None, :] <= query_pos
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        is_causal=causal,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.transpose(0, 1)


class AttentionBackend(Protocol):
    "Whatever stores K/V and runs attention for a layer: no cache, a contiguous cache, a paged cache."

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


def no_cache_attention(layer: int, q, k, v) -> torch.Tensor:
    "The backend for one sequence without a cache: all its tokens are in this forward."
    return causal_attention(q, k, v)


# %% [markdown]
# The mask in a picture: with 4 cached tokens and 3 new ones, each new query sees the whole
# prefix and the new tokens up to itself.

# %%
q, k = torch.zeros(3, 1, 4), torch.zeros(7, 1, 4)
mask = torch.arange(7)[None, :] <= (torch.arange(3)[:, None] + 4)
assert mask.sum().item() == 5 + 6 + 7
v = torch.eye(7)[:, None, :4].repeat(1, 1, 1)  # value j is a one-hot of j (first 4 dims)
out = causal_attention(q, k, torch.arange(7.0)[:, None, None].expand(7, 1, 4), q_offset=4)
# mean of visible positions; fp32: weights 1/n rounded and <= 7 products summed, 8 roundings of 2^-24 at most
assert torch.allclose(out[:, 0, 0], torch.tensor([2.0, 2.5, 3.0]), rtol=1e-6, atol=0)
fig, ax = plt.subplots(figsize=(3, 1.6))
ax.imshow(mask, cmap="Greens")
ax.set(xlabel="key position", ylabel="new query", title="who may attend to whom")
plt.show()


# %% [markdown]
# ## The layers
#
# Q, K and V come from one merged matrix (`qkv`), gate and up from another (`gate_up`): one
# big matmul reads the input once instead of three times. The loader below fills the slices
# of these merged weights from the separate tensors of a checkpoint.
#
# The layers read exactly as the formulas. On a GPU, chapter 09a swaps each of them for a
# subclass that runs the same arithmetic through chapter 09's Triton kernels, with fewer
# launches (`install_fused_layers`); nothing here knows about it.

# %%
#| export
class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.config = layer, config
        c = config
        self.qkv = nn.Linear(c.hidden_size, c.q_size + 2 * c.kv_size, bias=c.attention_bias)
        self.o = nn.Linear(c.q_size, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionBackend
    ) -> torch.Tensor:
        qkv = self.qkv(x)
        q, k, v = self.heads(qkv)
        if self.q_norm is not None:
            q, k = self.rope(self.q_norm(q), cos, sin), self.rope(self.k_norm(k), cos, sin)
        else:  # no q/k norm: one rotation for both (half the small ops of a CPU decode step's RoPE)
            qk = self.rope(self.qk_heads(qkv), cos, sin)
            q, k = qk[:, : self.config.num_heads], qk[:, self.config.num_heads :]
        return self.o(attention(self.layer, q, k, v).reshape(x.shape[0], self.config.q_size))

    rope = staticmethod(apply_rope)  # (a method: chapter 09a's CPU layers rotate in C)

    def heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        "qkv's output [T, q_size + 2 kv_size] as views: q [T, heads, head_dim], k and v [T, kv_heads, head_dim]."
        c, t = self.config, qkv.shape[0]
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        kv_shape = (t, c.num_kv_heads, c.head_dim)
        return q.view(t, c.num_heads, c.head_dim), k.view(kv_shape), v.view(kv_shape)

    def qk_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        "q's heads, then k's, as one view [T, heads + kv_heads, head_dim] of the QKV projection's output."
        c = self.config
        return qkv[:, : c.q_size + c.kv_size].view(
            qkv.shape[0], c.num_heads + c.num_kv_heads, c.head_dim
        )


class MLP(nn.Module):
    "SwiGLU: down(silu(gate(x)) * up(x))."

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm block: r = x + attn(norm(x)), then r + mlp(norm(r)). The last add is left to the next
    layer (or the final norm), which fuses it with its norm: a layer takes and returns (its block's
    output, the residual stream before that output is added)."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, layer)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, residual, cos, sin, attention):
        h, residual = (
            (self.attn_norm(x), x) if residual is None else self.attn_norm.add_and_norm(x, residual)
        )
        h, residual = self.mlp_norm.add_and_norm(self.attn(h, cos, sin, attention), residual)
        return self.mlp(h), residual


# %% [markdown]
# ## The decoder
#
# Tokens are flattened: `input_ids` and `positions` are 1-D of length `T`. A batch of several
# sequences is just their tokens one after the other; the attention backend knows where each
# sequence starts. Logits come out in fp32 for the sampler.

# %%
#| export
class Transformer(nn.Module):
    "A decoder-only transformer of the Qwen3 / Qwen2 / Llama family."

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionBackend = no_cache_attention,
    ) -> torch.Tensor:
        "input_ids, positions [T] -> final hidden states [T, hidden]."
        return self.run_layers(*self.embed_tokens(input_ids, positions), attention)

    def embed_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor):
        "input_ids, positions [T] -> (the embedded tokens x [T, hidden], and the rotary tables cos, sin)."
        x = self.embed(input_ids)
        return x, *rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)

    def run_layers(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionBackend
    ) -> torch.Tensor:
        "The embedded tokens x [T, hidden] through every layer and the final norm."
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, attention)
        return self.final_norm(x, residual)

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        "The last layer's output added to the residual stream (when there is one), normed."
        return self.norm(x) if residual is None else self.norm.add_and_norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        "hidden [N, hidden] -> logits [N, vocab] in fp32."
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        return F.linear(hidden, self.embed.weight).float()  # tied: the embedding matrix is the head


# %% [markdown]
# ## Weights: from checkpoint names to our parameters
#
# Checkpoints (safetensors from the hub, or GGUF after chapter 01a renames its tensors) use
# Hugging Face names. Each maps to one of our parameters, or to a row slice of a merged one.
# Loading is staged: the caller yields one tensor at a time, we copy it into place (converting
# dtype and device in that one copy) and let it go.

# %%
#| export
_LAYER_NAMES = {  # HF name inside model.layers.{i} -> (our name inside layers.{i}, slice)
    "self_attn.q_proj": ("attn.qkv", "q"),
    "self_attn.k_proj": ("attn.qkv", "k"),
    "self_attn.v_proj": ("attn.qkv", "v"),
    "self_attn.o_proj": ("attn.o", None),
    "self_attn.q_norm": ("attn.q_norm", None),
    "self_attn.k_norm": ("attn.k_norm", None),
    "mlp.gate_proj": ("mlp.gate_up", "gate"),
    "mlp.up_proj": ("mlp.gate_up", "up"),
    "mlp.down_proj": ("mlp.down", None),
    "input_layernorm": ("attn_norm", None),
    "post_attention_layernorm": ("mlp_norm", None),
}
_TOP_NAMES = {"model.embed_tokens": "embed", "model.norm": "norm", "lm_head": "lm_head"}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def _row_slice(config: ModelConfig, part: str | None) -> slice:
    "Rows of a merged weight that one checkpoint tensor fills."
    q, kv, i = config.q_size, config.kv_size, config.intermediate_size
    return {
        None: slice(None),
        "q": slice(0, q),
        "k": slice(q, q + kv),
        "v": slice(q + kv, q + 2 * kv),
        "gate": slice(0, i),
        "up": slice(i, 2 * i),
    }[part]


def checkpoint_target(config: ModelConfig, hf_name: str) -> tuple[str, slice] | None:
    "Our parameter name and row slice for a checkpoint tensor; None for tensors we don't use."
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None  # recomputed, never loaded
    if hf_name == "lm_head.weight" and config.tie_word_embeddings:
        return None  # same as embed
    if m := _LAYER_RE.match(hf_name):
        layer, inner, kind = m.groups()
        if inner in _LAYER_NAMES:
            ours, part = _LAYER_NAMES[inner]
            return f"layers.{layer}.{ours}.{kind}", _row_slice(config, part)
    base, _, kind = hf_name.rpartition(".")
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{kind}", slice(None)
    raise ValueError(f"checkpoint tensor {hf_name!r} has no place in a {config.architecture} model")


@torch.no_grad()
def load_weights(model: Transformer, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    "Copy each (hf_name, tensor) into its place in `model`; fail if anything is missing or misshapen."
    params = dict(model.named_parameters())
    filled: dict[str, int] = {name: 0 for name in params}
    for hf_name, tensor in named_tensors:
        target = checkpoint_target(model.config, hf_name)
        if target is None:
            continue
        name, rows = target
        if name not in params:
            raise ValueError(
                f"checkpoint tensor {hf_name!r} maps to {name!r}, which this model does not have"
            )
        dest = params[name].data[rows]
        if dest.shape != tensor.shape:
            raise ValueError(
                f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)  # converts dtype and moves device in one step
        filled[name] += dest.numel()
    missing = [n for n, p in params.items() if filled[n] != p.numel()]
    if missing:
        raise ValueError(
            f"checkpoint is missing weights for {len(missing)} parameters, e.g. {missing[:5]}"
        )


# %% [markdown]
# The inverse, from the same table: the checkpoint tensors our weights split back into. It
# is how we save a model in Hugging Face layout, and how tests build real checkpoint files.

# %%
#| export
def hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    "The Hugging Face-named checkpoint tensors of `model` (views of its weights): the inverse of `load_weights`."
    c, params = model.config, dict(model.named_parameters())
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    names += [
        f"model.layers.{i}.{inner}.{kind}"
        for i in range(c.num_layers)
        for inner in _LAYER_NAMES
        for kind in ("weight", "bias")
    ]
    out = {}
    for hf_name in names:
        target = checkpoint_target(c, hf_name)
        if target is not None and target[0] in params:
            out[hf_name] = params[target[0]].detach()[target[1]]
    return out


# %% [markdown]
# ## Building a model without paying for initialisation
#
# A 4B-parameter model is built on the `meta` device (shapes only, no memory), given its real
# storage on the target device in the target dtype, then filled by `load_weights` or with
# seeded random values for `random:<preset>` models.

# %%
#| export
def empty_model(config: ModelConfig, device="cpu", dtype=torch.float32) -> Transformer:
    "A model with allocated but uninitialised weights on `device` in `dtype`."
    with torch.device("meta"):
        model = Transformer(config)
    return model.to(dtype=dtype).to_empty(device=device).eval()


@torch.no_grad()
def fill_random_(name: str, p: torch.Tensor, gen: torch.Generator, std: float = 0.02) -> None:
    "Fill parameter `name` in place from `gen`: N(0, std) for matrices and biases, near 1 for norms."
    if name.endswith("norm.weight"):
        p.copy_(
            1.0 + 0.1 * torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
        )
    else:
        p.normal_(0.0, std, generator=gen)


@torch.no_grad()
def init_random_weights(model: Transformer, seed: int = 0, std: float = 0.02) -> Transformer:
    "Seeded random weights, parameter by parameter in order from one generator. Same seed, same model."
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        fill_random_(name, p, gen, std)
    return model


# %%
tiny = init_random_weights(empty_model(preset("qwen3-tiny")), seed=1)
ids = torch.tensor([1, 2, 3, 4, 5])
h = tiny(ids, torch.arange(5))
assert h.shape == (5, 64) and torch.isfinite(h).all()
assert tiny.compute_logits(h).shape == (5, 151936)
assert torch.equal(
    init_random_weights(empty_model(preset("qwen3-tiny")), seed=1).embed.weight, tiny.embed.weight
)
with pytest.raises(ValueError, match="has shape"):
    load_weights(tiny, [("model.layers.0.self_attn.k_proj.weight", torch.zeros(3, 3))])
with pytest.raises(ValueError, match="no place"):
    load_weights(tiny, [("model.layers.0.self_attn.rotary_pos.weight", torch.zeros(3))])
with pytest.raises(ValueError, match="missing weights"):
    load_weights(tiny, [("model.norm.weight", torch.ones(64))])
for name in [
    "qwen3-tiny",
    "qwen2-tiny",
    "llama-tiny",
]:  # hf_state_dict is load_weights' exact inverse
    original = init_random_weights(empty_model(preset(name)), seed=4)
    copy = empty_model(preset(name))
    load_weights(copy, hf_state_dict(original).items())
    assert all(torch.equal(a, b) for a, b in zip(copy.parameters(), original.parameters()))
assert (
    len(hf_state_dict(tiny)) == 2 + 11 * 2
)  # embed, norm (tied), and per layer q,k,v,o,q_norm,k_norm,gate,up,down, 2 norms


# %% [markdown]
# ## Parity with the reference
#
# We build `Qwen3ForCausalLM`, `Qwen2ForCausalLM` and `LlamaForCausalLM` at random init from
# tiny configs, including odd corners (head_dim unrelated to hidden/heads, untied embeddings,
# a single KV head), hand their state dict to `load_weights`, and compare fp32 logits and
# greedy continuations. `transformers` is only needed here, in the test.

# %%
#| export
def hf_config_dict(config: ModelConfig) -> dict:
    "The `config.json` fields a Hugging Face model of this shape has (used for tests and for saving)."
    return {
        "model_type": config.architecture,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids) or None,
    }


# %%
def hf_reference(config: ModelConfig, seed=0):
    "A transformers model of this shape at random init, and ours with its weights."
    import transformers

    cls = {"qwen3": "Qwen3", "qwen2": "Qwen2", "llama": "Llama"}[config.architecture]
    hf_cfg = getattr(transformers, f"{cls}Config")(**hf_config_dict(config))
    torch.manual_seed(seed)
    hf = getattr(transformers, f"{cls}ForCausalLM")(hf_cfg).eval()
    with torch.no_grad():  # HF's init (std 0.02) makes tied models just repeat the last token
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    ours = empty_model(config)
    load_weights(ours, hf.state_dict().items())
    return hf, ours


def greedy_tokens(step, prompt, n):
    "Greedy continuation by re-running the full sequence each step (no cache: the plainest reference)."
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(step(torch.tensor(ids)).argmax()))
    return ids[len(prompt) :]


odd_configs = {
    "qwen3": preset("qwen3-tiny").replace(vocab_size=512),
    "qwen3 head_dim!=hidden/heads, untied, 1 kv head": preset("qwen3-tiny").replace(
        vocab_size=512, head_dim=24, num_kv_heads=1, tie_word_embeddings=False
    ),
    "qwen2 (qkv bias, 1 kv head)": preset("qwen2-tiny").replace(vocab_size=512),
    "llama (tied)": preset("llama-tiny").replace(vocab_size=512, tie_word_embeddings=True),
    "llama": preset("llama-tiny").replace(vocab_size=512),
}
prompt = [5, 17, 300, 42, 7, 99, 100, 1]
with torch.no_grad():
    for label, cfg in odd_configs.items():
        hf, ours = hf_reference(cfg)
        hf_logits = hf(torch.tensor([prompt])).logits[0]
        our_logits = ours.compute_logits(ours(torch.tensor(prompt), torch.arange(len(prompt))))
        # fp32: the same arithmetic as transformers' but for the order of the sums (~1e-7 relative): ~1e-6 on the logits
        torch.testing.assert_close(
            our_logits, hf_logits, rtol=1e-5, atol=1e-5, msg=lambda m: f"{label}: {m}"
        )
        hf_greedy = greedy_tokens(lambda x: hf(x[None]).logits[0, -1], prompt, 12)
        our_greedy = greedy_tokens(
            lambda x: ours.compute_logits(ours(x, torch.arange(len(x)))[-1:])[0], prompt, 12
        )
        assert hf_greedy == our_greedy, (label, hf_greedy, our_greedy)
        print(
            f"{label:50s} max |logit diff| {(our_logits - hf_logits).abs().max():.2e}  greedy {our_greedy[:6]}..."
        )
