# %% [markdown]
# # The model's layers, fused
#
# > Chapter 03's layers through chapter 09's kernels: a subclass for each, swapped in by class on a GPU.

# %% [markdown]
# Chapter 03's layers are plain PyTorch, and stay so: that is the model a student reads next to
# the reference. On a GPU chapter 09's kernels replace their small operations, and each
# replacement is a subclass of the layer it replaces, with one `forward` that says which kernel
# runs and why. `install_fused_layers` swaps them in by class, in place, on a model whose
# weights are on a CUDA GPU where the kernels run compiled. A fused layer adds no state: the
# parameters stay where they are, and loading (chapter 03), quantizing (chapter 10) and saving
# see the same model. The model is swapped where it is built for a GPU: `load_model` (chapter
# 04a) and the model runner's `build_runner` (chapter 07a, which also takes models built by hand).
#
# | fused layer | runs | instead of |
# |---|---|---|
# | `FusedRMSNorm` | `rmsnorm`, `add_rmsnorm`: one launch, each row read once | ~8 small kernels |
# | `FusedLinear` | a decode step's row by `gemv` (5-13% faster than cuBLAS at one row) | `F.linear` |
# | `FusedAttention` | q/k-norm and RoPE of q and k in one `norm_rope`; none at all with a backend whose `rope_inside` takes them (the decode kernel) | a copy, the norms, ~7 small kernels of RoPE for q and again for k |
# | `FusedMLP` | a decode row's gate-up GEMV with SiLU-mul in its epilogue (`swiglu`); else `silu_mul` | silu, the product, the strided halves: 3 kernels |
# | `FusedDecoderLayer` | BF16, one row: each add + RMSNorm folded into the GEMVs around it (`folds_norms`) | 6 launches a layer: 4 |
# | `FusedTransformer` | int8 / int4, one row, and BF16, int4 or a GGUF file's int8 / int4 planes, 2-16 rows: each norm handed from matmul to matmul (`hands_off_norms`); the tied LM head by `gemv` | 73 norm launches a step: 2 |
#
# Chapter 09 measured each of these; this chapter only wires them in. Chapter 10's quantized
# layers are not `nn.Linear`s and stay: the fused layers call their GEMVs (`gemv_operands`, or a
# `decode_gemv` of their own, which `takes_own_gemv` asks). Chapter 09c's tensor-parallel
# layers stay too: its row-parallel o and down go through `linear` themselves, its norms, which
# finish the all-reduce, are `FusedRMSNorm`s already, and its layers never fold.

# %%
#| default_exp fused_layers

# %%
#| export
from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from forge_engine.kernels.backend import kernels_available
from forge_engine.kernels.cpu import cpu_add_rms_norm, cpu_layer_ops_run, cpu_rope, cpu_silu_mul
from forge_engine.kernels.elementwise import NormRope, add_rmsnorm, norm_rope, rmsnorm, silu_mul
from forge_engine.kernels.gemv import gemv, gemv_folds_norms, gemv_hands_off_norms
from forge_engine.kernels.rows_matmul import ROWS_MATMUL_MAX_ROWS, rows_matmul, rows_matmul_tiles
from forge_engine.model import (
    MLP,
    Attention,
    AttentionBackend,
    DecoderLayer,
    RMSNorm,
    Transformer,
    apply_rope,
)

# %%
#| hide
import copy
import pytest
from forge_engine.config import preset
from forge_engine.kernels.prefill_attention import KernelPagedAttention
from forge_engine.kv_cache import PagedAttention, PagedKVCache, build_step_layout
from forge_engine.model import empty_model, init_random_weights

# %% [markdown]
# ## Linear layers and norms
#
# A decode step's row goes through `gemv`, which reads the weight at closer to the memory
# bandwidth than the general matmul does (chapter 09, "Matrix-vector products for small
# batches"); a step of 2-16 rows with 2-byte weights goes through `rows_matmul` (chapter 09, "A
# few rows on the tensor cores"), which folds in what the GEMV folds in. The arithmetic is the
# same: fp32 sums of the same products, in another order.

# %%
#| export
# steps of up to GEMV_ROWS tokens use `gemv` on a GPU (int8's GEMV: one row only pays); with 2-byte weights up to
# GEMV_ROWS_BF16, the rows past the first through `rows_matmul` (`decode_matmul`)
GEMV_ROWS, GEMV_ROWS_BF16 = 1, ROWS_MATMUL_MAX_ROWS


@functools.cache
def _kernels_compiled() -> bool:
    return kernels_available("cuda")  # (asked once: every linear layer asks, every step)


def _on_kernels(x: torch.Tensor) -> bool:
    "Whether x is a step's rows [rows, features] on a GPU where the kernels run compiled."
    return x.is_cuda and x.dim() == 2 and _kernels_compiled()


def takes_gemv(x: torch.Tensor, weight: torch.Tensor | None = None) -> bool:
    """Whether x is a decode step's few rows on a GPU where the kernels run compiled (`decode_matmul`): up to
    GEMV_ROWS, or up to GEMV_ROWS_BF16 times a 2-byte `weight`."""
    rows = GEMV_ROWS_BF16 if weight is not None and weight.element_size() == 2 else GEMV_ROWS
    return _on_kernels(x) and x.shape[0] <= rows


def takes_own_gemv(layer: nn.Module, x: torch.Tensor) -> bool:
    """Whether `layer` multiplies step x by a decode kernel of its own that takes the GEMV's folds (`decode_gemv`:
    chapter 10's int4 GEMV, or for 2-16 rows of int4 and of chapter 10g's int8 groups `rows_matmul`): x on a GPU where
    the kernels run compiled, a step the layer's kernel takes (its `takes_decode_step`)."""
    return hasattr(layer, "decode_gemv") and _on_kernels(x) and layer.takes_decode_step(x)


def takes_rows_matmul(x: torch.Tensor, weight: torch.Tensor, scale=None, norm=None) -> bool:
    """Whether `decode_matmul` multiplies x by `weight` with `rows_matmul`: several rows of 2-byte weights, with no
    scale and no norm to apply (those steps hand their norms off)."""
    return x.shape[0] > 1 and weight.element_size() == 2 and scale is None and norm is None


def decode_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    *,
    norm: torch.Tensor | None = None,
    tickets: torch.Tensor | None = None,
    **folds,
):
    """x @ weight.T for a decode step's rows (`takes_gemv`) with `gemv`'s arguments and folds: 2-16 rows of 2-byte
    weights by `rows_matmul` on the tensor cores (`takes_rows_matmul`), counting its split-K programs on `tickets`
    (int32 zeros, this launch's alone; None: new ones); anything else by `gemv`."""
    if takes_rows_matmul(x, weight, scale, norm):
        return rows_matmul(x, weight, bias, tickets=tickets, **folds)
    return gemv(x, weight, bias, scale, norm=norm, **folds)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear; a decode step's rows on a GPU (`takes_gemv`) through `decode_matmul`. `out`: a contiguous [rows,
    out_features] tensor to write the result into (chapter 09c's all-reduce buffer), else a new one."""
    if takes_gemv(x, weight):
        return decode_matmul(x, weight, bias, out=out)
    if out is None:
        return F.linear(x, weight, bias)
    return (
        torch.mm(x, weight.t(), out=out)
        if bias is None
        else torch.addmm(bias, x, weight.t(), out=out)
    )


class FusedLinear(nn.Linear):
    "nn.Linear through `linear`: a decode step's row by the GEMV kernel."

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def gemv_operands(self) -> tuple:
        "(weight, bias, scale) as `gemv` takes them: what a folded GEMV reads (chapter 10's int8 layer has them too)."
        return self.weight, self.bias, None


class FusedRMSNorm(RMSNorm):
    "RMSNorm by one kernel instead of eight, and the residual add with it (`add_rmsnorm`: each row read once)."

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rmsnorm(x, self.weight, self.eps)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rmsnorm(x, residual, self.weight, self.eps)


# %% [markdown]
# ## Folds
#
# The folds of a one-row decode step (chapter 09: the add + RMSNorm folded in, the norm handed
# off): `folded_gemv` runs a linear layer as one `gemv` launch with a norm applied to its
# input, a residual added to its output, a norm handed in or on. A layer with a GEMV of its own
# (chapter 10's int4) gets the folds as keywords; the norm itself it cannot apply, and says so
# rather than dropping it.

# %%
#| export
class HandedNorm(NamedTuple):
    "An RMSNorm handed from a decode GEMV to the next (`gemv`'s `hand_off`, `norm_sums`): the norm, and its sums."

    norm: RMSNorm
    sums: (
        torch.Tensor
    )  # [rows] float32: the squares of the norm's input, added up by the GEMV that makes it; from 0


def folded_gemv(
    layer: nn.Module,
    x: torch.Tensor,
    norm: RMSNorm | None = None,
    residual: torch.Tensor | None = None,
    swiglu: bool = False,
    handed_in: HandedNorm | None = None,
    hand_off: HandedNorm | None = None,
    tickets: torch.Tensor | None = None,
):
    """`layer`(norm(x)) (+ residual) for a decode step's rows, by one launch of `decode_matmul` (the layer has
    `gemv_operands`): the norm applied to x as the GEMV reads it, the residual added in its epilogue.
    `handed_in`: x is that norm applied but for its 1 / rms, which the GEMV takes from the sums. `hand_off` (with
    `residual`): -> (h, h x the norm's weight) for h the result, h's squares added to its sums. `tickets`: this
    launch's split-K tickets, for `rows_matmul`.
    A layer with a GEMV of its own (`decode_gemv`: chapter 10's int4) takes the same folds but `norm`."""
    eps = norm.eps if norm is not None else handed_in.norm.eps if handed_in is not None else 1e-6
    folds = dict(
        swiglu=swiglu,
        residual=residual,
        eps=eps,
        norm_sums=None if handed_in is None else handed_in.sums,
        hand_off=None if hand_off is None else (hand_off.norm.weight, hand_off.sums),
    )
    if hasattr(layer, "decode_gemv"):
        if norm is not None:
            raise ValueError(
                f"{type(layer).__name__}'s own GEMV takes no norm to apply: hand it off (handed_in)"
            )
        return layer.decode_gemv(x, tickets=tickets, **folds)
    norm_weight = None if norm is None else norm.weight
    return decode_matmul(x, *layer.gemv_operands(), norm=norm_weight, tickets=tickets, **folds)


# %%
class OwnGemv(nn.Module):
    def decode_gemv(self, x, **folds):
        return folds


norm, sums = RMSNorm(4, 1e-5), torch.zeros(1)
folds = folded_gemv(
    OwnGemv(), torch.zeros(1, 4), residual=torch.ones(1, 4), handed_in=HandedNorm(norm, sums)
)
assert (
    folds["norm_sums"] is sums
    and folds["eps"] == 1e-5
    and folds["hand_off"] is None
    and not folds["swiglu"]
)
with pytest.raises(ValueError, match="OwnGemv's own GEMV takes no norm to apply"):
    folded_gemv(OwnGemv(), torch.zeros(1, 4), norm=norm)
# a layer `gemv` reads: the fold is the GEMV's, norm and residual as `gemv` applies them (here its PyTorch path)
layer = FusedLinear(4, 3)
gen = torch.Generator().manual_seed(0)
x, r = torch.randn(1, 4, generator=gen), torch.randn(1, 3, generator=gen)
assert torch.equal(
    folded_gemv(layer, x, norm, residual=r),
    gemv(x, layer.weight, layer.bias, norm=norm.weight, eps=1e-5, residual=r),
)
# which rows go to the tensor-core matmul: several of 2-byte weights, with no scale (int8) and no norm to fold
w16, rows5 = torch.zeros(3, 4, dtype=torch.bfloat16), torch.zeros(5, 4, dtype=torch.bfloat16)
assert takes_rows_matmul(rows5, w16) and not takes_rows_matmul(rows5[:1], w16)
assert not takes_rows_matmul(rows5, w16.to(torch.int8), scale=torch.ones(3))
assert not takes_rows_matmul(rows5, w16, norm=torch.ones(4))


# %% [markdown]
# ## Attention, the MLP, the decoder layer, the model
#
# Each takes its folds as keywords. The decoder layer decides per step: a decode step of one
# row with BF16 weights folds its norms (`folds_norms`), one with int8 / int4 weights or of 2-16
# rows of BF16 or int4 weights or of a GGUF file's int8 / int4 planes hands them on (`hands_off_norms`, asked of
# every layer by the model, which then runs every layer that way); anything else runs chapter
# 03's order with the fused norms.

# %%
#| export
class FusedAttention(Attention):
    "Attention with q/k-norm and RoPE in one launch (`norm_rope`), or inside the attention kernel (`rope_inside`)."

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionBackend,
        norm: RMSNorm | None = None,
        residual: torch.Tensor | None = None,
        handed_in: HandedNorm | None = None,
        hand_off: HandedNorm | None = None,
        tickets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`norm`, `residual`: a decode step's folds (see FusedDecoderLayer): x normalised by the qkv GEMV, residual
        added by o's. `handed_in`, `hand_off`: the norms handed between GEMVs instead (`folded_gemv`). `tickets`:
        [2, T] int32 zeros, qkv's and o's split-K tickets (`folded_gemv`)."""
        c = self.config
        qkv_tickets, o_tickets = (None, None) if tickets is None else tickets
        qkv = (
            self.qkv(x)
            if norm is None and handed_in is None
            else folded_gemv(self.qkv, x, norm, handed_in=handed_in, tickets=qkv_tickets)
        )
        q, k, v = self.heads(qkv)
        q_weight, k_weight = (
            (None, None) if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight)
        )
        if getattr(
            attention, "rope_inside", False
        ):  # the attention kernel normalises and rotates them itself
            out = attention(
                self.layer, q, k, v, rope=NormRope(q_weight, k_weight, c.rms_norm_eps, cos, sin)
            )
        else:  # q and k in one kernel
            qk = norm_rope(
                self.qk_heads(qkv),
                q_weight,
                c.rms_norm_eps,
                cos,
                sin,
                k_weight=k_weight,
                num_q_heads=c.num_heads,
            )
            out = attention(self.layer, qk[:, : c.num_heads], qk[:, c.num_heads :], v)
        out = out.reshape(x.shape[0], c.q_size)
        return (
            self.o(out)
            if residual is None
            else folded_gemv(self.o, out, residual=residual, hand_off=hand_off, tickets=o_tickets)
        )


class FusedMLP(MLP):
    "SwiGLU with SiLU-mul in one launch (`silu_mul`), or in the gate-up GEMV's epilogue for a decode row."

    def forward(
        self,
        x: torch.Tensor,
        norm: RMSNorm | None = None,
        residual: torch.Tensor | None = None,
        handed_in: HandedNorm | None = None,
        hand_off: HandedNorm | None = None,
        tickets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`norm`, `residual`: a decode step's folds (see FusedDecoderLayer): residual + down(silu_mul(gate_up(norm(x)))).
        `handed_in`, `hand_off`: the norms handed between GEMVs instead (`folded_gemv`). `tickets`: [2, T] int32
        zeros, gate-up's and down's split-K tickets (`folded_gemv`)."""
        if (
            norm is not None or handed_in is not None
        ):  # two GEMVs: the norm and SiLU-mul in the first, the add in the second
            gate_up_tickets, down_tickets = (None, None) if tickets is None else tickets
            return folded_gemv(
                self.down,
                folded_gemv(
                    self.gate_up, x, norm, swiglu=True, handed_in=handed_in, tickets=gate_up_tickets
                ),
                residual=residual,
                hand_off=hand_off,
                tickets=down_tickets,
            )
        if hasattr(self.gate_up, "gemv_operands"):
            operands = self.gate_up.gemv_operands()
            if takes_gemv(x, operands[0]):
                return self.down(
                    decode_matmul(x, *operands, swiglu=True)
                )  # SiLU-mul in its epilogue
        elif takes_own_gemv(self.gate_up, x):  # a layer with a decode kernel of its own
            return self.down(self.gate_up.decode_gemv(x, swiglu=True))
        return self.down(
            silu_mul(self.gate_up(x))
        )  # one kernel for silu, the halves and the product


class FusedDecoderLayer(DecoderLayer):
    """A decoder layer whose one-row decode steps fold each add + RMSNorm into the GEMVs around it (`folds_norms`: four
    launches, not six) or hand the norms from GEMV to GEMV (`forward_handing_off`)."""

    def forward(self, x, residual, cos, sin, attention):
        if residual is None and self.folds_norms(x):
            h = self.attn(
                x, cos, sin, attention, norm=self.attn_norm, residual=x
            )  # x + attn(norm(x))
            return self.mlp(
                h, norm=self.mlp_norm, residual=h
            ), None  # the whole residual stream, nothing left to add
        return super().forward(x, residual, cos, sin, attention)

    def forward_handing_off(
        self,
        h,
        x,
        handed_in: HandedNorm | None,
        cos,
        sin,
        attention,
        sums: torch.Tensor,
        hand_off: HandedNorm | None,
        tickets: torch.Tensor | None = None,
    ):
        """`forward` for a decode step whose norms travel between the GEMVs (`hands_off_norms`): h is the residual
        stream, x its attn_norm as `handed_in` says (None: normalised already). Returns (h after the layer,
        `hand_off`'s norm of it but for 1 / rms, or None without one). `sums`: zeroed floats [rows] for mlp_norm's.
        `tickets`: [4, T] int32 zeros, the split-K tickets of qkv, o, gate-up and down (`rows_matmul`'s), or None."""
        mlp = HandedNorm(self.mlp_norm, sums)
        attn_tickets, mlp_tickets = (None, None) if tickets is None else (tickets[:2], tickets[2:])
        h, x = self.attn(
            x,
            cos,
            sin,
            attention,
            residual=h,
            handed_in=handed_in,
            hand_off=mlp,
            tickets=attn_tickets,
        )
        out = self.mlp(x, residual=h, handed_in=mlp, hand_off=hand_off, tickets=mlp_tickets)
        return out if hand_off is not None else (out, None)

    def folds_norms(self, x: torch.Tensor) -> bool:
        """Whether this step folds the norms and residual adds into the GEMVs (`gemv` with `norm` and `residual`,
        `gemv_folds_norms`): x is few enough rows for the GEMV, and each of the four layers is one it reads."""
        return self._gemv_reads_all(x) and gemv_folds_norms(
            self.attn.qkv.gemv_operands()[0], x.shape[0]
        )

    def hands_off_norms(self, x: torch.Tensor) -> bool:
        """Whether this step hands each norm from the GEMV that adds the residual to the GEMV after it (`gemv` with
        `hand_off` and `norm_sums`, `gemv_hands_off_norms`): as `folds_norms`, for the formats that take it; or each
        layer has a decode kernel of its own that takes this step (`takes_own_gemv`: chapter 10's int4, 10g's int8
        groups)."""
        if self._gemv_reads_all(x):
            return gemv_hands_off_norms(self.attn.qkv.gemv_operands()[0], x.shape[0])
        return all(takes_own_gemv(layer, x) for layer in self._projections())

    def rows_matmul_tiles(self, x: torch.Tensor) -> int:
        """The most tiles of this layer's four matmuls for step x where they run as `rows_matmul`
        (`takes_rows_matmul`, or a decode kernel of the layer's own that is one: its `rows_matmul_tiles`), else 0:
        how many split-K tickets each launch needs."""
        projections = self._projections()
        if all(takes_own_gemv(layer, x) for layer in projections):
            own = [
                layer.rows_matmul_tiles()
                for layer in projections
                if hasattr(layer, "rows_matmul_tiles")
            ]
            return max(own, default=0)
        if not self._gemv_reads_all(x):
            return 0
        operands = [layer.gemv_operands() for layer in self._projections()]
        weight, _, scale = operands[0]
        if not takes_rows_matmul(x, weight, scale):
            return 0
        return max(rows_matmul_tiles(w.shape[0]) for w, _, _ in operands)

    def _gemv_reads_all(self, x: torch.Tensor) -> bool:
        "x is few enough rows for the GEMV, and each of the four layers is one it reads."
        return all(hasattr(layer, "gemv_operands") for layer in self._projections()) and takes_gemv(
            x, self.attn.qkv.gemv_operands()[0]
        )

    def _projections(self) -> tuple[nn.Module, ...]:
        return self.attn.qkv, self.attn.o, self.mlp.gate_up, self.mlp.down


class FusedTransformer(Transformer):
    "The model whose one-row decode steps hand their norms between the GEMVs, and whose tied LM head is a GEMV too."

    def run_layers(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionBackend
    ) -> torch.Tensor:
        # every layer asked: a GGUF file's layers may differ in their matrices' types
        if all(layer.hands_off_norms(x) for layer in self.layers):
            return self._run_layers_handing_off(x, cos, sin, attention)
        return super().run_layers(x, cos, sin, attention)

    def _run_layers_handing_off(self, h, cos, sin, attention) -> torch.Tensor:
        """`run_layers` for a decode step whose norms travel between the GEMVs (FusedDecoderLayer's `hands_off_norms`):
        the first layer's norm and the final one are kernels of their own, the 71 between are not."""
        sums = torch.zeros(
            2 * len(self.layers), h.shape[0], device=h.device
        )  # per norm and row; one memset a step
        tiles = max(layer.rows_matmul_tiles(h) for layer in self.layers)
        tickets = (  # each launch's own split-K tickets (a launch may still finish as the next starts); one memset
            torch.zeros(len(self.layers), 4, tiles, dtype=torch.int32, device=h.device)
            if tiles
            else None
        )
        x, handed = self.layers[0].attn_norm(h), None
        for i, layer in enumerate(self.layers):
            last = i + 1 == len(self.layers)
            hand_off = None if last else HandedNorm(self.layers[i + 1].attn_norm, sums[2 * i + 1])
            h, x = layer.forward_handing_off(
                h,
                x,
                handed,
                cos,
                sin,
                attention,
                sums[2 * i],
                hand_off,
                None if tickets is None else tickets[i],
            )
            handed = hand_off
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return linear(
                hidden, self.embed.weight
            ).float()  # tied: the embedding matrix is the head
        return super().compute_logits(hidden)


# %% [markdown]
# ## Installing them
#
# The swap goes by exact class: a subclass of chapter 03's layers (chapter 09c's, say) is not
# the layer its fused class was written for, and stays as it is.

# %%
#| export
FUSED_LAYERS = {
    nn.Linear: FusedLinear,
    RMSNorm: FusedRMSNorm,
    Attention: FusedAttention,
    MLP: FusedMLP,
    DecoderLayer: FusedDecoderLayer,
    Transformer: FusedTransformer,
}


def install_fused_layers(model: Transformer, force: bool = False) -> Transformer:
    """Swap each module of `model` whose class is one of FUSED_LAYERS' for its fused subclass, in place, where the
    kernels run compiled (the module's weights on a CUDA GPU: a model split with the CPU, chapter 10h, keeps its CPU
    layers), or anywhere with `force` (tests: on a CPU the kernels' PyTorch paths run, and an attention backend's
    interpreted kernels). Only the class changes. Returns `model`."""
    for module in model.modules():
        fused = FUSED_LAYERS.get(type(module))
        if fused is not None and (force or kernels_available(device_of(module))):
            module.__class__ = fused
    return model


def device_of(module: nn.Module) -> torch.device:
    "Where a module's weights are (its first parameter's or buffer's device; the CPU for one without)."
    first = next(itertools.chain(module.parameters(), module.buffers()), None)
    return torch.device("cpu") if first is None else first.device


# %% [markdown]
# On a CPU nothing is swapped. Forced, the tiny Qwen3 gives the same logits through the fused
# layers and chapter 09's kernel backend (interpreted here) as the plain model through chapter
# 05's reference backend, over a chunked prompt, a mixed step and decodes; its decode step hands
# q and k to the decode kernel unrotated (`rope`).

# %%
model = init_random_weights(empty_model(preset("qwen3-tiny")), seed=0, std=0.1)
steps = [
    ([([7, 2, 9, 4], 0, 6)], [3, 14, 15, 92, 65, 35]),
    ([([7, 2, 9, 4], 6, 4), ([1, 5], 0, 3)], [89, 79, 32, 38, 7, 8, 9]),
    ([([7, 2, 9, 4], 10, 1), ([1, 5], 3, 1)], [46, 26]),
]
assert install_fused_layers(model) is model and type(model) is Transformer  # (a CPU: unchanged)
fused = install_fused_layers(copy.deepcopy(model), force=True)
assert type(fused) is FusedTransformer and type(fused.layers[1].attn) is FusedAttention
assert (
    type(fused.layers[0].attn.qkv) is FusedLinear
    and type(fused.layers[0].attn.k_norm) is FusedRMSNorm
)
assert [(n, p.shape) for n, p in fused.named_parameters()] == [
    (n, p.shape) for n, p in model.named_parameters()
]
assert (
    install_fused_layers(fused, force=True) is fused and type(fused.layers[0].mlp) is FusedMLP
)  # (twice: the same)


class RopeSpy(KernelPagedAttention):
    "The kernel backend, noting whether the model handed it q and k unrotated (`rope`)."

    def __call__(self, layer, q, k, v, rope=None):
        handed_rope.append(rope is not None)
        return super().__call__(layer, q, k, v, rope)


caches = {
    name: PagedKVCache(model.config, num_blocks=12, block_size=4) for name in ("reference", "fused")
}
with torch.no_grad():
    for seqs, ids in steps:
        handed_rope, layout = [], build_step_layout(seqs, 4)
        want = model.compute_logits(
            model(torch.tensor(ids), layout.positions, PagedAttention(caches["reference"], layout))
        )
        got = fused.compute_logits(
            fused(
                torch.tensor(ids), layout.positions, RopeSpy(caches["fused"], layout, impl="triton")
            )
        )
        # fp32: attention's sums in another order (~1e-7 relative) through 2 layers, logits of O(4): as in chapter 09
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        decodes_only = all(new == 1 for _, _, new in seqs)
        assert handed_rope == [decodes_only] * model.config.num_layers, handed_rope


# %% [markdown]
# ## On a CPU: the small steps in C
#
# A CPU has no Triton to run, but the same idea pays there: chapter 09_kernels_cpu's C functions
# do the residual add with its RMSNorm, SwiGLU's SiLU-mul and RoPE in one call each, where
# PyTorch takes eight, three and eight small operations, in float32 or bf16. `install_cpu_layers`
# swaps those classes in on the modules of a model that sit on a CPU (a whole CPU model, or the
# CPU's layers of one split with a GPU, chapter 10h) where the C kernels are built (`build_runner`
# calls it for the engine); each falls back to chapter 03's code for any other input.

# %%
#| export
class CPURMSNorm(RMSNorm):
    "RMSNorm, and the residual add before it, by one C call for float32 or bf16 rows on a CPU; else chapter 03's."

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # q's and k's heads [T, heads, D] as rows (copied out of the QKV projection's rows)
        rows = x.reshape(-1, x.shape[-1])
        done = cpu_add_rms_norm(rows, None, self.weight, self.eps)
        return super().forward(x) if done is None else done[0].view(x.shape)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        done = cpu_add_rms_norm(x, residual, self.weight, self.eps)
        return super().add_and_norm(x, residual) if done is None else done


class CPUMLP(MLP):
    "SwiGLU with its SiLU-mul by one C call for float32 or bf16 rows on a CPU; else chapter 03's."

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        h = cpu_silu_mul(gate_up)
        if h is None:
            gate, up = gate_up.chunk(2, dim=-1)
            h = F.silu(gate) * up
        return self.down(h)


class CPUAttention(Attention):
    "Attention with RoPE by one C call for float32 or bf16 rows on a CPU; else chapter 03's `apply_rope`."

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        out = cpu_rope(x, cos, sin)
        return apply_rope(x, cos, sin) if out is None else out


CPU_LAYERS = {RMSNorm: CPURMSNorm, MLP: CPUMLP, Attention: CPUAttention}


def install_cpu_layers(model: Transformer) -> Transformer:
    """Swap each module of `model` on a CPU whose class is one of CPU_LAYERS' for its C-backed subclass, in place,
    where the C kernels are built here (a model split with a GPU, chapter 10h: its CPU layers). Only the class
    changes; each falls back to chapter 03's code for what the kernels do not read. Returns `model`."""
    if not cpu_layer_ops_run():
        return model
    for module in model.modules():
        swap = CPU_LAYERS.get(type(module))
        if swap is not None and device_of(module).type == "cpu":
            module.__class__ = swap
    return model


# %% [markdown]
# The tiny Qwen3 through the swapped layers gives the plain model's logits to float32's rounding,
# and in bf16 the plain bf16 model's.

# %%
if cpu_layer_ops_run():
    on_cpu = install_cpu_layers(copy.deepcopy(model))
    assert type(on_cpu.layers[0].mlp) is CPUMLP and type(on_cpu.norm) is CPURMSNorm
    assert type(on_cpu.layers[1].attn) is CPUAttention
    ids, positions = torch.tensor([3, 14, 15, 92, 65]), torch.arange(5)
    with torch.no_grad():
        torch.testing.assert_close(
            on_cpu.compute_logits(on_cpu(ids, positions)),
            model.compute_logits(model(ids, positions)),
            rtol=1e-5,
            atol=1e-5,
        )
        # in bf16 the C calls round as PyTorch's bf16 operations do: the same logits but for a rare last bit
        plain = copy.deepcopy(model).to(torch.bfloat16)
        on_cpu = install_cpu_layers(copy.deepcopy(plain))
        got, want = (m.compute_logits(m(ids, positions)) for m in (on_cpu, plain))
        assert type(on_cpu.layers[0].mlp) is CPUMLP
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
        assert (got != want).float().mean() < 0.01
