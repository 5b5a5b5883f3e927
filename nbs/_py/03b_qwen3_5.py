# %% [markdown]
# # Qwen3.5: Gated DeltaNet and gated attention
#
# > A hybrid decoder: three layers of linear attention, whose memory has a fixed size, for every layer of full attention, whose KV cache grows.

# %% [markdown]
# Qwen3.5 keeps chapter 03's pre-norm block (norm, token mixer, add; norm, SwiGLU, add) and
# changes the token mixer. The config's `layer_types` names the mixer of each layer; the
# released models repeat `linear, linear, linear, full`:
#
# - **Gated DeltaNet** (`linear_attention`). No KV cache: each head keeps a matrix `S` of shape
#   `[key_dim, value_dim]`, an associative memory from keys to values, as big after ten tokens
#   as after a hundred thousand. Each token decays the memory, corrects what it recalls at the
#   token's key, and reads it with the token's query. A short causal convolution (the last 4
#   tokens) mixes the projections first.
# - **Gated attention** (`full_attention`). Chapter 03's grouped-query attention with q/k
#   RMSNorm, RoPE on only the first quarter of each head, and a sigmoid gate per channel on
#   its output.
#
# In: token ids and positions (`[T]`). Out: a hidden state per token (logits from it). As in
# chapter 03 the model keeps no memory of its own: the full-attention layers hand `q`, `k`, `v`
# to an attention backend, which keeps any KV cache, and the linear-attention layers hand the
# two steps that carry a sequence's past (the short convolution and the recurrence) to a
# *linear-attention backend*, which keeps the states. Here that backend holds one sequence's
# states in a dict; chapter 05a's serves many sequences from a pool of state slots.
#
# Two forms of the same recurrence do the work: token by token for decode, and by chunks of 64
# tokens, with matmuls, for prefill. We check them against each other, and the whole model
# against Hugging Face `transformers`' `Qwen3_5ForCausalLM` at random init.

# %%
#| default_exp qwen3_5

# %%
#| export
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from forge_engine.model import (
    AttentionBackend,
    RMSNorm,
    apply_rope,
    no_cache_attention,
    rope_cos_sin,
)

# %%
#| hide
import pytest
import transformers

from forge_engine.model import causal_attention

# %% [markdown]
# ## The configuration
#
# A multimodal checkpoint's `config.json` keeps the decoder's fields under `text_config`;
# `from_hf` reads either form. Newer files put `rope_theta` and `partial_rotary_factor` under
# `rope_parameters`, older ones at the top. We refuse what we would get wrong: another
# activation, scaled RoPE, an ungated attention. (The multi-token-prediction head of the
# checkpoints, `mtp.*`, is left out.)

# %%
#| export
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class Qwen35Config:
    "The shape of a Qwen3.5 hybrid decoder (the text model)."

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    layer_types: tuple[str, ...]  # one of LAYER_TYPES per layer
    num_heads: int  # gated attention
    num_kv_heads: int
    head_dim: int
    linear_num_key_heads: int  # Gated DeltaNet
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 0.25  # RoPE turns the first head_dim * this dims of a head
    rope_theta: float = 10_000_000.0
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 262_144
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - set(LAYER_TYPES):
            raise ValueError(
                f"layer_types must give one of {LAYER_TYPES} for each of {self.num_layers} layers"
            )
        if (
            self.num_heads % self.num_kv_heads
            or self.linear_num_value_heads % self.linear_num_key_heads
        ):
            raise ValueError("query heads must be a multiple of KV heads, value heads of key heads")
        if self.rotary_dim % 2 or self.linear_conv_kernel_dim < 2:
            raise ValueError("the rotary dims must be even and the conv kernel at least 2 wide")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def kv_layers(self) -> int:
        "Layers with a KV cache: the full-attention ones (chapter 05's pool has room for these only)."
        return self.layer_types.count("full_attention")

    @property
    def linear_layers(self) -> int:
        "Layers with a recurrent state instead."
        return self.layer_types.count("linear_attention")

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        "Bytes of K and V cache one token takes over the full-attention layers."
        return 2 * self.kv_layers * self.kv_size * dtype_bytes

    def replace(self, **changes) -> Qwen35Config:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> Qwen35Config:
        "From a parsed `config.json`: a text model's, or a multimodal one's `text_config`."
        text = cfg.get("text_config") or cfg
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"rope scaling {rope!r} is not implemented; only plain RoPE is")
        if text.get("hidden_act", "silu") != "silu" or not text.get("attn_output_gate", True):
            raise ValueError("only SiLU MLPs and gated attention are implemented")
        n, every = text["num_hidden_layers"], text.get("full_attention_interval", 4)
        default_types = [
            "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)
        ]
        heads = text["num_attention_heads"]
        return cls(
            vocab_size=text["vocab_size"],
            hidden_size=text["hidden_size"],
            intermediate_size=text["intermediate_size"],
            num_layers=n,
            layer_types=tuple(text.get("layer_types") or default_types),
            num_heads=heads,
            num_kv_heads=text.get("num_key_value_heads") or heads,
            head_dim=text.get("head_dim") or text["hidden_size"] // heads,
            linear_num_key_heads=text["linear_num_key_heads"],
            linear_num_value_heads=text["linear_num_value_heads"],
            linear_key_head_dim=text["linear_key_head_dim"],
            linear_value_head_dim=text["linear_value_head_dim"],
            linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4),
            partial_rotary_factor=float(
                rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
            ),
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            attention_bias=text.get("attention_bias", False),
            tie_word_embeddings=text.get(
                "tie_word_embeddings", cfg.get("tie_word_embeddings", False)
            ),
            max_position_embeddings=text.get("max_position_embeddings", 262_144),
            eos_token_ids=tuple(_ints(text.get("eos_token_id", cfg.get("eos_token_id")))),
        )


def _ints(value) -> list[int]:
    "A config.json id field: absent, one id or a list."
    return [] if value is None else [value] if isinstance(value, int) else list(value)


QWEN35_TINY = Qwen35Config(  # for tests: every feature at a size that runs in milliseconds
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=4,
    layer_types=("linear_attention",) * 3 + ("full_attention",),
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,  # rotary_dim 8
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # two value heads share each key head
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)

# %%
assert QWEN35_TINY.rotary_dim == 8
# a multimodal config.json without `layer_types`: every fourth layer is full attention
text = dict(
    vocab_size=1, hidden_size=16, intermediate_size=8, num_hidden_layers=8, num_attention_heads=2
)
text |= dict(
    linear_num_key_heads=1, linear_num_value_heads=1, linear_key_head_dim=4, linear_value_head_dim=4
)
from_file = Qwen35Config.from_hf(
    {"model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": True}
)
assert from_file.layer_types == (("linear_attention",) * 3 + ("full_attention",)) * 2
assert from_file.tie_word_embeddings and from_file.head_dim == 8 and from_file.num_kv_heads == 2
with pytest.raises(ValueError, match="layer_types"):
    QWEN35_TINY.replace(layer_types=("linear_attention",) * 3)


# %% [markdown]
# ## Two RMSNorms
#
# The block norms and the q/k norms store their weight **zero-centred**: the scale is
# `1 + weight`, zeros at init (the reference computes `1 + weight` in fp32, so the small offsets
# of a bf16 checkpoint keep their precision). A checkpoint of Qwen3.5 holds offsets around 0
# where Qwen3's holds scales around 1, so chapter 03's `RMSNorm` would be wrong by one.
#
# The norm on the DeltaNet's output is not zero-centred: chapter 03's `RMSNorm` (weight ones at
# init) per value head, times `silu(z)` for a gate `z` projected from the layer's input.

# %%
#| export
class ZeroCenteredRMSNorm(nn.Module):
    "RMSNorm whose weight is the offset from 1: x / rms(x) * (1 + weight), in fp32."

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(RMSNorm):
    "Chapter 03's RMSNorm of x, times silu(gate)."

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return (super().forward(x) * F.silu(gate.float())).to(x.dtype)


# %%
x = torch.randn(3, 16) * 4
plain, zero_centred = RMSNorm(16, 1e-6), ZeroCenteredRMSNorm(16, 1e-6)
assert torch.equal(
    zero_centred(x), plain(x)
)  # weight 0 scales by 1, as weight 1 does in chapter 03
gated = GatedRMSNorm(16, 1e-6)
assert torch.equal(gated(x, torch.full((3, 16), 40.0)), plain(x) * 40)  # silu(40) = 40 in fp32
assert torch.equal(gated(x, torch.zeros(3, 16)), torch.zeros(3, 16))  # a closed gate


# %% [markdown]
# ## The short convolution
#
# Before the recurrence, each channel of the q, k, v projections is convolved over the last
# `K = 4` tokens with its own kernel (depthwise, causal), then goes through SiLU. Over a whole
# sequence that is one `conv1d` with `K - 1` tokens of left context: zeros at the start of a
# sequence, the **conv state** (the last `K - 1` inputs) when it continues. One decode token is
# a dot product of its window of `K` inputs with the kernel.
#
# Shapes follow chapter 03: tokens first, `x [T, C]`; the state is `[K - 1, C]`.

# %%
#| export
def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of x [T, C] with weight [C, K]; `state` [K-1, C] holds the inputs before x (zeros
    when None). -> (y [T, C], the new state: the last K-1 inputs)."""
    k = weight.shape[1]
    if state is None:
        state = x.new_zeros(k - 1, x.shape[1])
    padded = torch.cat((state.to(x.dtype), x))  # [K-1+T, C]: output t sees inputs t-K+1 .. t
    y = F.conv1d(padded.T[None], weight[:, None, :], groups=x.shape[1])[0].T
    # the new state is a copy: a view would keep the whole prompt alive
    return y, padded[len(padded) - (k - 1) :].clone()


def causal_conv1d_step(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    "One token x [C]: its window of the last K inputs times the kernel. -> (y [C], the new state [K-1, C])."
    window = torch.cat((state.to(x.dtype), x[None]))  # [K, C], oldest first, like the kernel
    return (window * weight.T).sum(0), window[1:]


# %%
g = torch.Generator().manual_seed(0)
x, weight, state = (torch.randn(*s, generator=g) for s in ((9, 6), (6, 4), (3, 6)))
whole, whole_state = causal_conv1d(x, weight, state)
steps, s = [], state
for t in range(9):
    y, s = causal_conv1d_step(x[t], weight, s)
    steps.append(y)
# fp32: the same 4 products summed in another order, a few ulps of values around 1: 1e-6
torch.testing.assert_close(torch.stack(steps), whole, rtol=0, atol=1e-6)
assert torch.equal(s, whole_state) and torch.equal(s, x[-3:])
# at the start of a sequence (no state) output 0 sees only x[0]
torch.testing.assert_close(causal_conv1d(x, weight)[0][0], x[0] * weight[:, -1], rtol=0, atol=1e-6)


# %% [markdown]
# ## The gated delta rule, token by token
#
# Per head, with a memory `S [Dk, Dv]` that maps a key to a value (`Sᵀk`), each token `t` does:
#
# ```
# S   ←  exp(g_t) · S                       forget: decay every association (g_t ≤ 0)
# S   ←  S + k_t · (β_t (v_t − Sᵀk_t))ᵀ      delta rule: move what S recalls at k_t a fraction β_t towards v_t
# o_t =  Sᵀ q_t                             read with the query
# ```
#
# With a unit key and `β = 1` the second line replaces the value stored at `k_t` by `v_t`
# exactly; linear attention without the delta (`S ← S + k vᵀ`) would only pile values up.
# That is why the keys (and queries) are L2-normalised; queries are also scaled by
# `1/√Dk`, as attention's scores are. The decay `g` and the write strength `β ∈ (0, 1)` are
# computed per token and head from the layer's input.
#
# Everything is fp32: the state is summed into at every token, for the whole sequence.

# %%
#| export
def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    "x / |x| over the last dim (eps inside the root, as the reference)."
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one token at a time, in fp32. q, k [T, H, Dk]; v [T, H, Dv]; g (log decay) and beta [T, H];
    state S [H, Dk, Dv] (zeros when None). -> (outputs [T, H, Dv], the final state)."""
    S = k.new_zeros(k.shape[1], k.shape[2], v.shape[2]) if state is None else state
    out = []
    for t in range(k.shape[0]):
        S = S * g[t].exp()[:, None, None]
        recalled = torch.einsum("hkv,hk->hv", S, k[t])
        delta = beta[t][:, None] * (v[t] - recalled)
        S = S + k[t][:, :, None] * delta[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", S, q[t]))
    return torch.stack(out), S


# %% [markdown]
# ## The same rule by chunks, for prefill
#
# Token by token, a prompt of `T` tokens is `T` sequential steps of small matrix-vector
# products. Within a chunk of `C` tokens that starts from state `S₀`, the steps can be solved
# together. Let `γ_t = g_1 + … + g_t` (the log decay from the chunk's start through token `t`,
# so the decay from token `s` to token `t` is `exp(γ_t − γ_s)`) and call `δ_t = β_t (v_t − Sᵀk_t)`
# the correction token `t` writes. Unrolling the recurrence:
#
# ```
# S_t = exp(γ_t) S₀ + Σ_{s≤t} exp(γ_t − γ_s) k_s δ_sᵀ
# δ_t = β_t v_t − β_t exp(γ_t) S₀ᵀk_t − Σ_{s<t} β_t exp(γ_t − γ_s) (k_t·k_s) δ_s
# ```
#
# Each `δ_t` depends only on earlier ones: stacked as the rows of `Δ [C, Dv]`, they solve one
# unit lower-triangular system
#
# ```
# (I + A) Δ = βV − (β exp(γ) K) S₀        A[t, s] = β_t exp(γ_t − γ_s) (k_t·k_s)  for s < t
# ```
#
# Solving it once for each part of the right-hand side, `U = (I + A)⁻¹ βV` and
# `W = (I + A)⁻¹ β exp(γ) K` (the "UT transform" of DeltaNet's chunkwise form), needs no state,
# so it is done for all chunks at once. Then, chunk after chunk, with the state carried across:
#
# ```
# Δ   = U − W S₀
# O   = (exp(γ) Q) S₀ + (M ⊙ QKᵀ) Δ            M[t, s] = exp(γ_t − γ_s) for s ≤ t, else 0
# S_C = exp(γ_C) S₀ + (exp(γ_C − γ) K)ᵀ Δ       the state the next chunk starts from
# ```
#
# Only that loop over `T / C` chunks is sequential, and it is made of matmuls. Every decay is
# the exponential of a difference of cumulative sums, `≤ 1`, never a ratio of small numbers.
# The sequence is padded to whole chunks with `g = 0` and `β = 0`: padding tokens neither decay
# nor write, so the final state is exact. The reference uses chunks of 64.

# %%
#| export
def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    "The gated delta rule by chunks of `chunk_size` tokens: the arguments and results of `gated_delta_rule_recurrent`."
    T, H = k.shape[:2]
    pad = -T % chunk_size

    def by_chunk(x):  # [T, H, ...] -> [H, chunks, chunk_size, ...], zero-padded at the end
        x = x.transpose(0, 1)
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        return x.reshape(H, -1, chunk_size, *x.shape[2:])

    q, k, v, g, beta = map(by_chunk, (q, k, v, g, beta))
    gamma = g.cumsum(-1)  # [H, N, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    M = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    A = ((k_beta @ k.transpose(-1, -2)) * M).tril(-1)
    I_plus_A = A + torch.eye(chunk_size, dtype=A.dtype, device=A.device)

    def solve(rhs):  # (I + A)^-1 rhs, by forward substitution
        return torch.linalg.solve_triangular(I_plus_A, rhs, upper=False, unitriangular=True)

    U, W = solve(v * beta[..., None]), solve(k_beta * gamma.exp()[..., None])
    scores = (q @ k.transpose(-1, -2)) * M  # [H, N, C, C]
    q_from_start = q * gamma.exp()[..., None]
    k_to_end = k * (gamma[..., -1:] - gamma).exp()[..., None]
    S = q.new_zeros(H, k.shape[-1], v.shape[-1]) if state is None else state
    out = torch.empty_like(U)
    for n in range(q.shape[1]):
        delta = U[:, n] - W[:, n] @ S
        out[:, n] = q_from_start[:, n] @ S + scores[:, n] @ delta
        S = S * gamma[:, n, -1].exp()[:, None, None] + k_to_end[:, n].transpose(-1, -2) @ delta
    return out.reshape(H, -1, v.shape[-1])[:, :T].transpose(0, 1), S


# %% [markdown]
# The two forms agree, over lengths shorter than a chunk, a whole chunk and several chunks with
# a ragged end, from a zero state and from a given one:

# %%
def random_rule_inputs(T, H=3, Dk=8, Dv=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (l2norm(torch.randn(T, H, Dk, generator=g)) * s for s in (Dk**-0.5, 1.0))
    v = torch.randn(T, H, Dv, generator=g)
    decay = F.logsigmoid(2 * torch.randn(T, H, generator=g))  # from ~0 (remember) to ~-8 (forget)
    beta = torch.sigmoid(torch.randn(T, H, generator=g))
    return q, k, v, decay, beta, 0.5 * torch.randn(H, Dk, Dv, generator=g)


worst = 0.0
for T in (1, 5, 16, 64, 100, 200):
    *args, S0 = random_rule_inputs(T, seed=T)
    for state in (None, S0):
        want_out, want_S = gated_delta_rule_recurrent(*args, state=state)
        for chunk in (16, 64):
            out, S = gated_delta_rule_chunked(*args, state=state, chunk_size=chunk)
            # fp32, values and states of size ~1, sums in another order and a triangular solve: 2e-6 measured
            torch.testing.assert_close(out, want_out, rtol=0, atol=1e-5)
            torch.testing.assert_close(S, want_S, rtol=0, atol=1e-5)
            worst = max(worst, (out - want_out).abs().max().item(), (S - want_S).abs().max().item())
print(f"chunked vs recurrent: max |difference| {worst:.1e}")


# %% [markdown]
# ## The Gated DeltaNet layer
#
# From the layer's input `x [T, hidden]`, five projections (the checkpoint's names):
# `in_proj_qkv` (then the convolution and SiLU) gives q, k (`linear_num_key_heads` heads) and v
# (`linear_num_value_heads` heads; consecutive value heads share a key head, as query heads share
# a KV head in grouped-query attention); `in_proj_z` the output gate; `in_proj_b` gives
# `β = sigmoid(b)`; `in_proj_a` the decay `g = −exp(A_log) · softplus(a + dt_bias)`, Mamba's
# discretised step: a learned rate per head times a data-dependent step, so `g ≤ 0`.
#
# The state of a sequence is the conv state and the recurrent state. The layer computes
# everything that is per token itself and asks its linear-attention backend for the two steps
# that read and write a state: `conv` (the convolution and SiLU) and `delta_rule` (q and k come
# as the key heads the projection gives, before their L2 norm, so that a kernel can fuse both).
# `SequenceStates`, the backend of one sequence, takes the token-by-token forms for one token
# after a state and the whole-sequence ones otherwise (a prompt, or the next chunk of one),
# starting from the state when there is one.

# %%
#| export
class LinearAttentionState(NamedTuple):
    "What a Gated DeltaNet layer carries from one forward of a sequence to the next."

    conv: torch.Tensor  # [K-1, conv channels]: the last inputs of the short convolution
    recurrent: torch.Tensor  # [value heads, key_head_dim, value_head_dim], fp32: the memory S


class LinearAttentionBackend(Protocol):
    "Where the Gated DeltaNet layers' states live: the steps of a layer that read and write them."

    def conv(self, index: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        "silu(causal conv1d of x [T, C] with weight [C, K]), after each sequence's earlier inputs."
        ...

    def delta_rule(
        self,
        index: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
    ) -> torch.Tensor:
        """The gated delta rule after each sequence's state: q, k [T, key heads, Dk] not yet normalized, v [T, value
        heads, Dv] (the model's dtype or fp32), g, beta [T, value heads] fp32 -> [T, value heads, Dv] fp32."""
        ...


def normalized_heads(
    q: torch.Tensor, k: torch.Tensor, value_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    "q, k [T, key heads, Dk] -> fp32 [T, value heads, Dk]: each key head repeated for its value heads, L2-normalized, q / sqrt(Dk)."
    group = value_heads // k.shape[1]
    q, k = (y.float().repeat_interleave(group, dim=1) for y in (q, k))
    return l2norm(q) * q.shape[-1] ** -0.5, l2norm(k)


class SequenceStates:
    """One sequence's linear-attention states (`states[index]`), kept from one forward to the next: the backend of
    one sequence. A new one starts a sequence."""

    def __init__(self):
        self.conv_states: dict[int, torch.Tensor] = {}
        self.recurrent_states: dict[int, torch.Tensor] = {}

    def conv(self, index, x, weight):
        before = self.conv_states.get(index)
        if before is not None and len(x) == 1:
            y, self.conv_states[index] = causal_conv1d_step(x[0], weight, before)
            return F.silu(y[None])
        y, self.conv_states[index] = causal_conv1d(x, weight, before)
        return F.silu(y)

    def delta_rule(self, index, q, k, v, g, beta):
        q, k = normalized_heads(q, k, v.shape[1])
        before = self.recurrent_states.get(index)
        rule = (
            gated_delta_rule_recurrent
            if before is not None and len(q) == 1
            else gated_delta_rule_chunked
        )
        out, self.recurrent_states[index] = rule(q, k, v.float(), g, beta, before)
        return out

    def __getitem__(self, index: int) -> LinearAttentionState:
        return LinearAttentionState(self.conv_states[index], self.recurrent_states[index])


class GatedDeltaNet(nn.Module):
    def __init__(self, config: Qwen35Config, index: int):
        super().__init__()
        c, self.config, self.index = (
            config,
            config,
            index,
        )  # index: among the linear-attention layers
        self.key_dim = c.linear_num_key_heads * c.linear_key_head_dim
        self.value_dim = c.linear_num_value_heads * c.linear_value_head_dim
        conv_dim, heads = 2 * self.key_dim + self.value_dim, c.linear_num_value_heads
        self.in_proj_qkv = nn.Linear(c.hidden_size, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(c.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(c.hidden_size, heads, bias=False)
        self.in_proj_a = nn.Linear(c.hidden_size, heads, bias=False)
        self.conv1d = nn.Conv1d(
            conv_dim, conv_dim, c.linear_conv_kernel_dim, groups=conv_dim, bias=False
        )
        self.A_log = nn.Parameter(torch.zeros(heads))  # (checkpoints set these two)
        self.dt_bias = nn.Parameter(torch.ones(heads))
        self.norm = GatedRMSNorm(c.linear_value_head_dim, c.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, linear: LinearAttentionBackend) -> torch.Tensor:
        "x [T, hidden] -> [T, hidden]; `linear` keeps each sequence's states."
        c, t = self.config, x.shape[0]
        mixed = linear.conv(self.index, self.in_proj_qkv(x), self.conv1d.weight[:, 0])
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = (y.view(t, c.linear_num_key_heads, -1) for y in (q, k))
        v = v.reshape(t, c.linear_num_value_heads, -1).float()
        beta = torch.sigmoid(self.in_proj_b(x)).float()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        out = linear.delta_rule(self.index, q, k, v, g, beta)
        out = self.norm(out.to(x.dtype), self.in_proj_z(x).view(t, c.linear_num_value_heads, -1))
        return self.out_proj(out.reshape(t, self.value_dim))


# %% [markdown]
# The state must not change the answer: a prompt in one forward, in two pieces, or a piece
# followed by one token at a time, give the same outputs.

# %%
torch.manual_seed(0)
layer = GatedDeltaNet(QWEN35_TINY, index=0)
with torch.no_grad():
    layer.A_log.copy_(torch.empty(4).uniform_(0.01, 2).log())
x = torch.randn(20, 64)
with torch.no_grad():
    whole = layer(x, SequenceStates())
    in_two, stepped = SequenceStates(), SequenceStates()
    first = layer(x[:11], in_two)
    second = layer(x[11:], in_two)  # the rest of the prompt as a chunk from the state
    steps = [layer(x[:11], stepped)]
    for t in range(11, 20):  # or one token a forward
        steps.append(layer(x[t : t + 1], stepped))
# fp32: another order of sums in the conv and the rule; outputs of size ~0.5: under 1e-6
torch.testing.assert_close(torch.cat([first, second]), whole, rtol=0, atol=1e-6)
torch.testing.assert_close(torch.cat(steps), whole, rtol=0, atol=1e-6)
state = stepped[0]
assert state.conv.shape == (3, 2 * 32 + 64) and state.recurrent.shape == (4, 16, 16)


# %% [markdown]
# ## Gated attention
#
# Chapter 03's attention with three changes. `q_proj` is twice as wide: per head, the first
# `head_dim` outputs are the query and the next `head_dim` a **gate**; the attention output is
# multiplied by `sigmoid(gate)` before `o_proj`: a head can output nothing for a token, where
# softmax attention must put its weight somewhere (its authors find it removes the "attention
# sink" on the first token). q and k go through the zero-centred RMSNorm per
# head. And **partial RoPE**: only the first `rotary_dim = head_dim * partial_rotary_factor`
# dims are rotated, with the speeds of a `rotary_dim`-wide head and chapter 03's pairing of
# halves *within those dims* (dim `i` with `i + rotary_dim / 2`); the rest carry no position.
#
# The backend gets the index of the layer among the full-attention layers: a KV cache needs
# room for those only (a quarter of the layers).

# %%
#| export
def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    "Rotate the first 2 * cos.shape[-1] dims of each head of x [T, heads, head_dim] (chapter 03's RoPE); keep the rest."
    r = 2 * cos.shape[-1]
    return torch.cat((apply_rope(x[..., :r], cos, sin), x[..., r:]), dim=-1)


class GatedAttention(nn.Module):
    def __init__(self, config: Qwen35Config, index: int):
        super().__init__()
        c, self.config, self.index = config, config, index  # index: among the full-attention layers
        h, bias = c.hidden_size, c.attention_bias
        # per head: head_dim outputs of query, then head_dim of gate
        self.q_proj = nn.Linear(h, 2 * c.num_heads * c.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, c.num_kv_heads * c.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, c.num_kv_heads * c.head_dim, bias=bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, h, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionBackend
    ) -> torch.Tensor:
        c, t = self.config, x.shape[0]
        q, gate = self.q_proj(x).view(t, c.num_heads, 2 * c.head_dim).chunk(2, dim=-1)
        k = self.k_proj(x).view(t, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x).view(t, c.num_kv_heads, c.head_dim)
        q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        out = attention(self.index, q, k, v) * torch.sigmoid(gate)
        return self.o_proj(out.reshape(t, c.num_heads * c.head_dim))


# %%
cos, sin = rope_cos_sin(torch.tensor([5]), 8, 1e7)
x = torch.randn(1, 2, 32)
rotated = apply_partial_rope(x, cos, sin)
assert torch.equal(rotated[..., 8:], x[..., 8:])  # dims past rotary_dim carry no position
assert torch.equal(
    rotated[..., :8], apply_rope(x[..., :8], cos, sin)
)  # pairs (i, i + 4) within the first 8


# %% [markdown]
# ## The decoder
#
# Pre-norm blocks with the zero-centred norm and a SwiGLU MLP; the mixer of each layer as
# `layer_types` says. The two backends go together: a linear-attention backend that holds a
# sequence's states from earlier calls needs an attention backend that holds the K/V of those
# earlier tokens too. Without backends, a call is one whole sequence.
#
# We keep the checkpoint's names for every parameter (`gate_proj`, `up_proj`, not chapter 03's
# merged `gate_up`), so loading is renaming: drop the `model.` prefix (`model.language_model.` in
# a multimodal checkpoint), skip the vision tower, the multi-token-prediction head and a tied
# `lm_head`.

# %%
#| export
class SwiGLU(nn.Module):
    "down(silu(gate(x)) * up(x)), with the checkpoint's three matrices."

    def __init__(self, config: Qwen35Config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    "x + mixer(norm(x)), then that + mlp(norm(that)); the mixer is a GatedDeltaNet or a GatedAttention."

    def __init__(self, config: Qwen35Config, layer: int):
        super().__init__()
        self.layer_type = config.layer_types[layer]
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(
                config, config.layer_types[:layer].count("linear_attention")
            )
        else:
            self.self_attn = GatedAttention(
                config, config.layer_types[:layer].count("full_attention")
            )
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x, cos, sin, attention: AttentionBackend, linear: LinearAttentionBackend):
        x = x + self.mix(self.input_layernorm(x), cos, sin, attention, linear)
        return x + self.mlp(self.post_attention_layernorm(x))

    def mix(self, h, cos, sin, attention: AttentionBackend, linear: LinearAttentionBackend):
        "The layer's mixer of tokens: its Gated DeltaNet or its gated attention."
        if self.layer_type == "linear_attention":
            return self.linear_attn(h, linear)
        return self.self_attn(h, cos, sin, attention)


class Qwen35Model(nn.Module):
    "The Qwen3.5 text decoder: embedding, hybrid layers, final norm, head."

    def __init__(self, config: Qwen35Config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
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
        linear: LinearAttentionBackend | None = None,
    ) -> torch.Tensor:
        "input_ids, positions [T] -> final hidden states [T, hidden]. Without `linear`: one new sequence."
        x = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.config.rotary_dim, self.config.rope_theta, x.dtype)
        linear = SequenceStates() if linear is None else linear
        return self.run_layers(x, cos, sin, attention, linear)

    def run_layers(self, x, cos, sin, attention: AttentionBackend, linear: LinearAttentionBackend):
        "The decoder layers over the embedded tokens x, and the final norm."
        for layer in self.layers:
            x = layer(x, cos, sin, attention, linear)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        "hidden [N, hidden] -> logits [N, vocab] in fp32."
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        return F.linear(hidden, self.embed_tokens.weight).float()  # tied: the embedding is the head


def checkpoint_name(config: Qwen35Config, hf_name: str) -> str | None:
    "Our parameter's name for a checkpoint tensor; None for tensors the text decoder does not use."
    if hf_name.startswith(("mtp.", "model.visual.")):
        return None  # the multi-token-prediction head, the vision tower
    if hf_name == "lm_head.weight":
        return None if config.tie_word_embeddings else hf_name
    # a multimodal checkpoint's decoder is under model.language_model, a text model's under model
    return hf_name.removeprefix("model.language_model.").removeprefix("model.")


@torch.no_grad()
def load_hf_state_dict(
    model: Qwen35Model, named_tensors: Iterable[tuple[str, torch.Tensor]]
) -> None:
    "Copy each (checkpoint name, tensor) into `model`; fail on a stray, misshapen or missing weight."
    params, filled = dict(model.named_parameters()), set()
    for hf_name, tensor in named_tensors:
        name = checkpoint_name(model.config, hf_name)
        if name is None:
            continue
        if name not in params:
            raise ValueError(f"checkpoint tensor {hf_name!r} has no place in this model")
        if params[name].shape != tensor.shape:
            raise ValueError(
                f"{hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}"
            )
        params[name].copy_(tensor)  # converts dtype and device in the one copy
        filled.add(name)
    if missing := sorted(params.keys() - filled):
        raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:5]}")


# %%
model = Qwen35Model(QWEN35_TINY)
assert [layer.layer_type for layer in model.layers] == list(QWEN35_TINY.layer_types)
assert model.layers[3].self_attn.index == 0  # the first full-attention layer
name = "model.language_model.layers.3.self_attn.q_norm.weight"  # as in a multimodal checkpoint
assert checkpoint_name(QWEN35_TINY, name) == "layers.3.self_attn.q_norm.weight"
assert checkpoint_name(QWEN35_TINY, "mtp.fc.weight") is None
with pytest.raises(ValueError, match="has shape"):
    load_hf_state_dict(model, [("model.layers.0.linear_attn.A_log", torch.zeros(3))])
with pytest.raises(ValueError, match="no place"):
    load_hf_state_dict(model, [("model.layers.0.self_attn.q_proj.weight", torch.zeros(3))])
with pytest.raises(ValueError, match="missing"):
    load_hf_state_dict(model, [("model.norm.weight", torch.zeros(64))])

# %% [markdown]
# ## What the state costs
#
# For the reference's default shape (its docstring calls it Qwen3.5-9B style: 32 layers, 8 of them full
# attention with 4 KV heads of 256 dims; 24 DeltaNet layers with 32 value heads of 128 × 128
# memory), the K/V of a token take 32 KiB in bf16, while the DeltaNet state of a whole sequence
# is fixed: about 48 MiB in fp32, the K/V of some 1,500 tokens. Past that, a long context costs a
# quarter of what the same model with full attention everywhere would.

# %%
big = Qwen35Config.from_hf(transformers.Qwen3_5TextConfig().to_dict())
full, linear = big.layer_types.count("full_attention"), big.layer_types.count("linear_attention")
kv_per_token = 2 * full * big.num_kv_heads * big.head_dim * 2  # K and V, bf16
delta_state = (
    linear * big.linear_num_value_heads * big.linear_key_head_dim * big.linear_value_head_dim * 4
)
print(f"{full} full + {linear} linear layers: K/V {kv_per_token / 1024:.0f} KiB a token")
print(
    f"DeltaNet state {delta_state / 2**20:.0f} MiB a sequence: K/V of {delta_state // kv_per_token} tokens"
)
assert (full, linear, kv_per_token, delta_state) == (8, 24, 32 * 1024, 48 * 2**20)


# %% [markdown]
# ## Parity with the reference
#
# We build `Qwen3_5ForCausalLM` from tiny `Qwen3_5TextConfig`s at random init, copy its state
# dict into ours by name and compare fp32 logits, over a prompt of 20 tokens (within one chunk)
# and of 150 (three chunks, the last ragged). Then greedy decoding: ours with the state (the
# prompt in one forward, then one token a forward, with a small KV cache for the full-attention
# layers), the reference re-running the whole sequence at every step. The random weights are
# larger than the reference's init (std 0.02 makes every logit nearly equal), norms away from
# their neutral value, and decays `A` in `(0.01, 1)` so that the memory matters.

# %%
def hf_text_config(config: Qwen35Config) -> dict:
    "The `config.json` text fields of a model of this shape."
    return dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        layer_types=list(config.layer_types),
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        linear_num_key_heads=config.linear_num_key_heads,
        linear_num_value_heads=config.linear_num_value_heads,
        linear_key_head_dim=config.linear_key_head_dim,
        linear_value_head_dim=config.linear_value_head_dim,
        linear_conv_kernel_dim=config.linear_conv_kernel_dim,
        rope_parameters=dict(
            rope_type="default",
            rope_theta=config.rope_theta,
            partial_rotary_factor=config.partial_rotary_factor,
        ),
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
        max_position_embeddings=config.max_position_embeddings,
    )


def hf_reference(config: Qwen35Config, seed=0):
    "A transformers Qwen3_5ForCausalLM of this shape at random init, and ours with its weights."
    hf_cfg = transformers.Qwen3_5TextConfig(**hf_text_config(config))
    assert Qwen35Config.from_hf(hf_cfg.to_dict()) == config  # and our reading of its config.json
    torch.manual_seed(seed)
    hf = transformers.Qwen3_5ForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.01, 1).log())
            elif name.endswith("linear_attn.norm.weight") or name.endswith("dt_bias"):
                p.copy_(1 + 0.1 * torch.randn_like(p))  # scales around 1
            elif "norm" in name:
                p.copy_(0.1 * torch.randn_like(p))  # zero-centred: offsets around 0
            else:
                p.copy_(
                    0.1 * torch.randn_like(p) if "conv1d" not in name else 0.5 * torch.randn_like(p)
                )
    ours = Qwen35Model(config).eval()
    load_hf_state_dict(ours, hf.state_dict().items())
    return hf, ours


class KVCache:
    "The K/V of one sequence's full-attention layers: an attention backend for `Qwen35Model.forward`."

    def __init__(self):
        self.k, self.v = {}, {}

    def __call__(self, layer, q, k, v):
        if layer in self.k:
            k, v = torch.cat((self.k[layer], k)), torch.cat((self.v[layer], v))
        self.k[layer], self.v[layer] = k, v
        return causal_attention(q, k, v, q_offset=k.shape[0] - q.shape[0])


def greedy_with_state(model, prompt, n):
    "Greedy tokens and their logits: the prompt in one forward, then one token a forward."
    cache, states, ids, logits = KVCache(), SequenceStates(), list(prompt), []
    new = torch.tensor(prompt)
    for _ in range(n):
        positions = torch.arange(len(ids) - len(new), len(ids))
        hidden = model(new, positions, cache, states)
        logits.append(model.compute_logits(hidden[-1:])[0])
        ids.append(int(logits[-1].argmax()))
        new = torch.tensor(ids[-1:])
    return ids[len(prompt) :], torch.stack(logits)


def hf_greedy(hf, prompt, n):
    "The reference's greedy tokens, re-running the whole sequence at every step (no cache)."
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt) :]


configs = {
    "tiny (3 linear + 1 full, untied)": QWEN35_TINY,
    "tied, key heads = value heads, half-rotary, full first": QWEN35_TINY.replace(
        layer_types=("full_attention", "linear_attention", "linear_attention", "full_attention"),
        tie_word_embeddings=True,
        linear_num_key_heads=4,
        head_dim=16,
        partial_rotary_factor=0.5,
        rope_theta=10000.0,
    ),
}
g = torch.Generator().manual_seed(0)
with torch.no_grad():
    for label, cfg in configs.items():
        hf, ours = hf_reference(cfg)
        for length in (20, 150):
            prompt = torch.randint(0, cfg.vocab_size, (length,), generator=g)
            want = hf(prompt[None], use_cache=False).logits[0]
            got = ours.compute_logits(ours(prompt, torch.arange(length)))
            # fp32: the same arithmetic in another order (~1e-7 relative per op), logits of size ~4. But
            # each DeltaNet head's output is small here (rms ~0.01) and its norm scales it back to ~1, so
            # rounding grows ~100 times: transformers' own fp32 logits are 2e-5 from its fp64 ones. Ours
            # are up to 1.1e-5 from its fp32 ones.
            torch.testing.assert_close(
                got, want, rtol=1e-5, atol=5e-5, msg=lambda m: f"{label}: {m}"
            )
            print(
                f"{label:55s} {length:4d} tokens: max |logit diff| {(got - want).abs().max():.1e}"
            )
        prompt = prompt[:20].tolist()
        tokens, step_logits = greedy_with_state(ours, prompt, 12)
        assert tokens == hf_greedy(hf, prompt, 12), label
        assert len(set(tokens)) > 3, tokens  # a continuation that moves, not one token repeated
        # the logits of each step with the state are those of the whole sequence in one forward
        ids = torch.tensor(prompt + tokens)
        whole = ours.compute_logits(ours(ids, torch.arange(len(ids))))[len(prompt) - 1 : -1]
        torch.testing.assert_close(step_logits, whole, rtol=1e-5, atol=5e-5)  # (the same rounding)
        print(
            f"{'':55s} greedy {tokens}, stepped vs whole max |diff| {(step_logits - whole).abs().max():.1e}"
        )

# %% [markdown]
# ## Named shapes and random weights
#
# `random:qwen3.5-4b` is a Qwen3.5-4B with random weights: the real shape, so timing and memory
# are real, without downloading 9 GB. Chapter 00's `PRESETS` hold the shapes of chapter 03's
# decoder (`ModelConfig`); the Qwen3.5 shapes are `Qwen35Config`s, a class of this chapter, and
# chapter 00 and the registry (01b) sit *below* this chapter: they may not import it. So the
# Qwen3.5 shapes live here, as `QWEN35_PRESETS`, and the loader (04a), which sits above both,
# asks both tables: it hands the registry the names of both (the registry checks a
# `random:<preset>` name against the names it is given, chapter 00's when it is given none) and
# builds the model from whichever table has the name.
#
# The numbers are the `text_config` of the released checkpoints' `config.json`: 32 layers in the
# pattern `linear, linear, linear, full`; gated attention with 16 query heads and 4 KV heads of
# 256 dims, a quarter of each rotated (64 dims, theta 10,000,000); Gated DeltaNet with 16 key
# heads and 32 value heads of 128 dims; a 248,320-token (padded) vocabulary; 262,144 positions.
# The 4B model (hidden 2,560, MLP 9,216) ties its head to the embedding, the 9B (hidden 4,096,
# MLP 12,288) has a head of its own. `qwen3.5-tiny` has every feature at a size that runs in
# milliseconds, with the real vocabulary.

# %%
#| export
QWEN35_EOS = (248046, 248044)  # <|im_end|>, <|endoftext|>


def hybrid_layer_types(num_layers: int, full_attention_interval: int = 4) -> tuple[str, ...]:
    "Every `full_attention_interval`-th layer full attention, the others Gated DeltaNet (the released pattern)."
    return tuple(
        "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
        for i in range(num_layers)
    )


_QWEN35_SMALL = dict(  # what the 4B and 9B share
    vocab_size=248_320,
    num_layers=32,
    layer_types=hybrid_layer_types(32),
    num_heads=16,
    num_kv_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    eos_token_ids=QWEN35_EOS,
)
QWEN35_PRESETS: dict[str, Qwen35Config] = {
    "qwen3.5-4b": Qwen35Config(
        hidden_size=2560, intermediate_size=9216, tie_word_embeddings=True, **_QWEN35_SMALL
    ),
    "qwen3.5-9b": Qwen35Config(
        hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False, **_QWEN35_SMALL
    ),
    "qwen3.5-tiny": QWEN35_TINY.replace(
        vocab_size=248_320, tie_word_embeddings=True, eos_token_ids=QWEN35_EOS
    ),
}


def qwen35_config_json(config: Qwen35Config) -> dict[str, Any]:
    "The text `config.json` of a model of this shape (`model_type` qwen3_5_text): what `Qwen35Config.from_hf` reads."
    return dict(
        model_type="qwen3_5_text",
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        layer_types=list(config.layer_types),
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        linear_num_key_heads=config.linear_num_key_heads,
        linear_num_value_heads=config.linear_num_value_heads,
        linear_key_head_dim=config.linear_key_head_dim,
        linear_value_head_dim=config.linear_value_head_dim,
        linear_conv_kernel_dim=config.linear_conv_kernel_dim,
        rope_parameters=dict(
            rope_type="default",
            rope_theta=config.rope_theta,
            partial_rotary_factor=config.partial_rotary_factor,
        ),
        rms_norm_eps=config.rms_norm_eps,
        attention_bias=config.attention_bias,
        attn_output_gate=True,
        hidden_act="silu",
        tie_word_embeddings=config.tie_word_embeddings,
        max_position_embeddings=config.max_position_embeddings,
        eos_token_id=list(config.eos_token_ids),
    )


def empty_qwen35_model(config: Qwen35Config, device="cpu", dtype=torch.float32) -> Qwen35Model:
    "A model with allocated but uninitialised weights on `device` in `dtype` (chapter 03's `empty_model`, for Qwen3.5)."
    with torch.device("meta"):
        model = Qwen35Model(config)
    return model.to(dtype=dtype).to_empty(device=device).eval()


# %% [markdown]
# Random weights need the values each kind of parameter has in a trained model, or the model
# computes nothing worth timing. Matrices are `N(0, std)` as in chapter 03. The zero-centred
# norms hold offsets around 0 (chapter 03's norms hold scales around 1); the DeltaNet's output
# norm is a plain one, scales around 1. The decay of each value head is
# `exp(−exp(A_log) · softplus(a + dt_bias))`: with Mamba's initialisation, `A` uniform in
# `[1, 16]` and `softplus(dt_bias)` log-uniform in `[0.001, 0.1]`, a token keeps between 20% and
# 99.9% of the memory, so the recurrence neither forgets at once nor piles up (a decay ≤ 1 and
# unit keys keep the state bounded). The short convolution gets `N(0, 1/√K)`, so its 4 taps keep
# the scale of their inputs.

# %%
#| export
@torch.no_grad()
def fill_random_qwen35_(
    name: str, p: torch.Tensor, gen: torch.Generator, std: float = 0.02
) -> None:
    "Fill Qwen3.5 parameter `name` in place from `gen`, with the values of its kind (see above)."

    def draw(shape=p.shape):  # fp32 on the parameter's device, whatever its dtype
        return torch.empty(shape, device=p.device, dtype=torch.float32)

    if name.endswith("linear_attn.norm.weight"):
        p.copy_(1.0 + 0.1 * draw().normal_(generator=gen))
    elif name.endswith("norm.weight"):  # zero-centred
        p.copy_(0.1 * draw().normal_(generator=gen))
    elif name.endswith("A_log"):
        p.copy_(draw().uniform_(1.0, 16.0, generator=gen).log())
    elif name.endswith("dt_bias"):
        dt = draw().uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
        p.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
    elif name.endswith("conv1d.weight"):
        p.copy_(draw().normal_(0.0, p.shape[-1] ** -0.5, generator=gen))
    else:
        p.normal_(0.0, std, generator=gen)


@torch.no_grad()
def init_random_qwen35(model: Qwen35Model, seed: int = 0, std: float = 0.02) -> Qwen35Model:
    "Seeded random weights, parameter by parameter in order from one generator on the model's device."
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        fill_random_qwen35_(name, p, gen, std)
    return model


# %% [markdown]
# Each preset reads back from its `config.json`. The KV cache of a token is the same 32 KiB
# (bf16) for both released shapes: they differ in width, not in their full-attention layers.

# %%
for label, cfg in QWEN35_PRESETS.items():
    assert Qwen35Config.from_hf(qwen35_config_json(cfg)) == cfg, label
    with torch.device("meta"):
        n = sum(p.numel() for p in Qwen35Model(cfg).parameters())
    print(
        f"{label:13s} {n / 1e9:6.3f} B parameters, {cfg.kv_layers} KV layers, "
        f"K/V {cfg.kv_bytes_per_token() // 1024} KiB a token"
    )
four, nine = QWEN35_PRESETS["qwen3.5-4b"], QWEN35_PRESETS["qwen3.5-9b"]
assert (four.rotary_dim, four.kv_layers, four.linear_layers) == (64, 8, 24)
assert four.kv_bytes_per_token() == nine.kv_bytes_per_token() == 32 * 1024

# %% [markdown]
# A random model's recurrence does something: after a prompt of 100 tokens every DeltaNet
# layer's memory is finite and neither zero nor growing without bound, and the logits differ
# from token to token.

# %%
tiny = init_random_qwen35(empty_qwen35_model(QWEN35_PRESETS["qwen3.5-tiny"]), seed=1)
again = init_random_qwen35(empty_qwen35_model(QWEN35_PRESETS["qwen3.5-tiny"]), seed=1)
assert all(torch.equal(a, b) for a, b in zip(tiny.parameters(), again.parameters()))  # seeded
decays = torch.cat(
    [
        (-layer.linear_attn.A_log.exp() * F.softplus(layer.linear_attn.dt_bias)).exp()
        for layer in tiny.layers
        if layer.layer_type == "linear_attention"
    ]
)
assert 0.2 < decays.min() and decays.max() < 0.9995, decays  # per token, at a = 0
states = SequenceStates()
with torch.no_grad():
    ids = torch.randint(0, 1000, (100,), generator=torch.Generator().manual_seed(0))
    logits = tiny.compute_logits(tiny(ids, torch.arange(100), linear=states))
for index in range(QWEN35_PRESETS["qwen3.5-tiny"].linear_layers):
    size = states[index].recurrent.norm(dim=(1, 2))  # per value head
    assert torch.isfinite(size).all() and 0.05 < size.min() and size.max() < 50, size
assert torch.isfinite(logits).all() and logits.std(0).mean() > 0.01
