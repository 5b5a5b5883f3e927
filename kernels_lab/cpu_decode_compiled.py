"""A decode step of one request on a CPU with each decoder layer compiled by torch.compile (inductor's C++), against
the same step eager: SmolLM2-135M-Instruct's Q4_1 GGUF file (blocks kept), the 30 layers and the final norm.

The step is written as one function of a layer (norm, QKV, RoPE, the KV write, attention, o, norm, MLP) so that
torch.compile sees it whole: the paged attention reads a fixed number of blocks (`WIDTH`, padding masked, as the
CUDA-graph path of chapter 09b does), so one compile serves every context up to WIDTH blocks and every layer (the
layer's weights and its cache are arguments, not constants). Eager, the same function is already leaner than the
engine's general path (no per-sequence Python, no dtype branches).
What it shows: the compile time of a layer on this machine, and how much of the step's ~2,800 small operations a
compiled layer saves. The LM head and the engine's own work are not timed here.
Run anywhere from the repository root (the model must be in the cache: `forge-engine models pull
smollm2-135m-instruct`): PYTHONPATH=. python3 kernels_lab/cpu_decode_compiled.py [WIDTH blocks, default 12]"""

import sys
import time

import torch
import torch.nn.functional as F

from forge_engine.loader import load_model
from forge_engine.config import EngineConfig
from forge_engine.engine import LLMEngine
from forge_engine.model import apply_rope, rope_cos_sin

WIDTH = int(sys.argv[1]) if len(sys.argv) > 1 else 12
loaded = load_model("smollm2-135m-instruct", "cpu", progress=False, quantization="gguf")
engine = LLMEngine(loaded, EngineConfig())
model, cache = engine.runner.model, engine.runner.cache
c, bs = model.config, cache.block_size
if c.qk_norm:
    raise SystemExit("this sketch is SmolLM2's layer (no q/k norm)")


def layer_step(layer, x, residual, cos, sin, slots, tables, lens, k_pool, v_pool):
    "One decoder layer for one new token a sequence, its attention over `tables` [B, WIDTH] blocks."
    h, residual = layer.attn_norm.add_and_norm(x, residual)
    attn, t = layer.attn, x.shape[0]
    qkv = attn.qkv(h)
    qk = apply_rope(attn.qk_heads(qkv), cos, sin)
    q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
    v = qkv[:, c.q_size + c.kv_size :].reshape(t, c.num_kv_heads, c.head_dim)
    k_pool.view(-1, c.num_kv_heads, c.head_dim).index_copy_(0, slots, k)
    v_pool.view(-1, c.num_kv_heads, c.head_dim).index_copy_(0, slots, v)
    k_ctx = k_pool[tables].flatten(1, 2).transpose(1, 2)  # [B, kv heads, WIDTH x block, D]
    v_ctx = v_pool[tables].flatten(1, 2).transpose(1, 2)
    seen = torch.arange(k_ctx.shape[2])[None, :] < lens[:, None]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k_ctx, v_ctx, attn_mask=seen[:, None, None, :], enable_gqa=True
    )[:, :, 0, :]
    h, residual = layer.mlp_norm.add_and_norm(attn.o(out.reshape(t, c.q_size)), residual)
    return layer.mlp(h), residual


def step_inputs(pos):
    "One sequence at position `pos`, its blocks 1..WIDTH (block 0 left alone)."
    tables = torch.arange(WIDTH)[None, :] + 1
    slots = tables[:, pos // bs] * bs + pos % bs
    return torch.tensor([1000]), torch.tensor([pos]), slots, tables, torch.tensor([pos + 1])


def forward(layer_fn, ids, positions, slots, tables, lens):
    x = model.embed(ids)
    residual = torch.zeros_like(x)
    cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, x.dtype)
    for i, layer in enumerate(model.layers):
        x, residual = layer_fn(
            layer, x, residual, cos, sin, slots, tables, lens, cache.k_cache[i], cache.v_cache[i]
        )
    return model.norm.add_and_norm(x, residual)[0]


def ms_a_step(layer_fn, first, steps=96):
    start = time.perf_counter()
    for pos in range(first, first + steps):
        forward(layer_fn, *step_inputs(pos))
    return (time.perf_counter() - start) / steps * 1e3


first = WIDTH * bs - 100
with torch.inference_mode():
    want = forward(layer_step, *step_inputs(first - 1))
    compiled = torch.compile(layer_step, dynamic=False)
    start = time.perf_counter()
    got = forward(compiled, *step_inputs(first - 1))
    print(
        f"compile: {time.perf_counter() - start:.1f} s; max |diff| to eager {(got - want).abs().max():.1e}"
    )
    for name, fn in (("eager", layer_step), ("compiled", compiled)) * 2:
        print(f"{name:9s} {ms_a_step(fn, first):6.2f} ms a step ({WIDTH} blocks read a layer)")
