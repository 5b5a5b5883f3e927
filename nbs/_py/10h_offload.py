# %% [markdown]
# # Layers split between the GPU and the CPU
#
# > A model too big for the GPU runs with its first layers there and the rest on the CPU, each layer's KV cache where the layer runs: `--gpu-layers N`, or `auto` from the memory budget.

# %% [markdown]
# An 8 GB card holds Qwen3-4B in int8 but not Qwen3-14B in int4 (7.7 GB of layer weights, the
# embedding and head besides). Chapter 10a's plan refuses what does not fit. The way people run
# such a model anyway, on the hardware they own, is to put *some* layers on the GPU: llama.cpp's
# `-ngl`. Here `gpu_layers = N` keeps the embedding, the first `N` decoder layers, the final norm
# and the LM head on the GPU, and layers `N..L-1` on the CPU. A step's residual stream crosses
# twice, a few KB a token: to the CPU after layer `N-1`, back before the final norm.
#
# **Where the other layers compute** is a question of two bandwidths. A decode step must read
# every weight once. The CPU's layers can be read by the CPU from its memory (bandwidth `B_cpu`),
# or copied to the GPU over PCIe (`B_pcie`) and computed there. At a batch of a few rows the
# work is the reading, so per step
#
# ```
# CPU compute: W_cpu / B_cpu          streaming: W_cpu / B_pcie       (W_cpu: the CPU layers' bytes)
# ```
#
# and the faster is the larger bandwidth. A desktop's two DDR5 channels read ~60-80 GB/s and a
# server's many more; PCIe 4.0 x16 moves ~25 GB/s and 5.0 x16 ~50. So for decoding, the CPU
# computes its layers (llama.cpp's choice too). A long prompt is the other case: its matmuls are
# compute-bound, `2 · P_cpu · T` FLOP on a CPU of a few TFLOP/s against one copy of `W_cpu` to a
# GPU of hundreds; streaming wins from a few dozen tokens a step. This chapter builds both: the
# CPU computes its layers (`--offload cpu`), or they stream to the GPU (`--offload stream`);
# `--offload auto`, the default, measures one layer both ways at load and takes the faster (the
# last section). `offload_step_seconds` does the arithmetic of both for a plan, and
# `kernels_lab/offload_bandwidth.py` measures the two bandwidths of a machine.
#
# Measured there on an H100 machine (16 CPU threads read 152 GB/s; pinned PCIe copies 55.1
# GB/s): Qwen3-14B in int4 under an 8 GiB budget, 23 layers on the GPU (a peak of 7.58 GiB),
# decodes **24.8 tok/s, 40.4 ms a step, against the CPU-compute floor of 19.6 ms**; streamed
# (22 layers on the GPU), 17.3 tok/s, 57.8 ms a step against its floor of 57.2 ms
# (`kernels_lab/offload_streaming.py`). `auto` takes the CPU's there: one layer 2.04 ms on the
# CPU against a 3.21 ms copy. The CPU mode's step is twice its floor, which counts the CPU
# layers' matrices only: one layer's products take 1.65 ms on 16 threads against the floor's
# 1.15, and a step also runs those layers' norms, rotations and attention, the GPU's layers and
# the residual stream's two crossings. A decode step's GPU part replays as two CUDA graphs, the
# GPU's layers and then the head, around the CPU's layers (chapter 09b's `SplitDecodeRunner`);
# prompts stay eager. The CPU's layers take chapter 09_kernels_cpu's C calls for their small
# steps in bf16 (`install_cpu_layers`, `cpu_decode_attention`): at Qwen3-14B's shapes 214 µs a
# layer against PyTorch's 649 at 160 keys on 2 threads (`kernels_lab/cpu_layer_ops.py`), and
# their int4 products at one row go to chapter 10da's C kernel (chapter 10e), which asks for its
# weights ahead of the block it reads: on 2 cores a decode step of two Qwen3-14B int4 layers
# takes 27.0 ms, its products 23.4 (`kernels_lab/offload_bandwidth.py --no-model`).
#
# What each part needs:
#
# - **weights**: loaded on the CPU; int8 and int4 (chapter 10) quantize the GPU's layers onto
#   the GPU a slice of rows at a time (`quantize_model(..., device_layers=N)`: 24 of Qwen3-14B's
#   layers are 14 GB in BF16, so they never go there whole) and the CPU's where they are, each in
#   its device's format (the GPU's kernels' layout, or PyTorch's CPU weight-only GEMMs); then
#   `place_layers` moves the rest; a GGUF file's blocks are repacked for the GPU's layers only
#   (chapter 10g), the CPU's keep the blocks its C kernels read;
# - **KV cache**: two pools with the same block tables (one allocator, chapter 05): the GPU pool
#   holds layers `0..N-1`, a pool in host memory layers `N..L-1`, and `SplitAttention` sends each
#   layer to its pool;
# - **the plan**: `plan_gpu_layers` counts, for a budget, the largest `N` whose layers, with the
#   embedding, the head, the activations, the overhead and the runner's minimal KV cache fit
#   (chapter 10a's rules, per layer).

# %%
#| default_exp offload

# %%
#| export
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass

import torch

from forge_engine.config import ModelConfig
from forge_engine.kv_cache import PagedKVCache
from forge_engine.memory_plan import (
    MIN_KV_BYTES,
    OVERHEAD_BYTES,
    MemoryPlanError,
    activation_bytes,
    format_gib,
    layer_matrices,
    matrix_bytes,
    weight_bytes,
)
from forge_engine.model import AttentionBackend, Transformer

# %%
#| hide
import pytest

from forge_engine.config import preset


# %% [markdown]
# ## The model across two devices
#
# `OffloadedTransformer` is chapter 03's `Transformer` whose `run_layers` moves the residual
# stream (and the rotary tables) to the CPU at layer `gpu_layers` and back after the last layer.
# `place_layers` makes one out of a loaded model, in place, as the fused and quantized layers are
# swapped in elsewhere: only the class and the devices change.

# %%
#| export
class OffloadedTransformer(Transformer):
    "A Transformer whose layers from `gpu_layers` on run on `offload_device` (the CPU); the rest on the GPU."

    gpu_layers: int
    offload_device: torch.device
    prompt_matmuls: PromptMatmuls | None = None  # a prompt's matmuls on the GPU (below)

    def run_layers(self, x, cos, sin, attention: AttentionBackend) -> torch.Tensor:
        home = x.device
        x, residual = self.run_gpu_layers(x, cos, sin, attention)
        x, residual = self.run_cpu_layers(
            *_to(self.offload_device, x, residual, cos, sin), attention
        )  # the residual stream crosses to the CPU's layers, and back after them
        return self.final_norm(*_to(home, x, residual))

    def run_gpu_layers(self, x, cos, sin, attention: AttentionBackend):
        "The embedded tokens through layers 0..gpu_layers-1: (output, residual stream), on the GPU."
        residual = None
        for layer in self.layers[: self.gpu_layers]:
            x, residual = layer(x, residual, cos, sin, attention)
        return x, residual

    def run_cpu_layers(self, x, residual, cos, sin, attention: AttentionBackend):
        "The GPU's layers' (output, residual stream), moved to the CPU, through the CPU's layers."
        on_gpu = self.prompt_matmuls is not None and self.prompt_matmuls.takes(x)
        for i, layer in enumerate(self.layers[self.gpu_layers :]):
            if on_gpu:  # this CPU layer's matrices in their GPU slot
                self.prompt_matmuls.stream.before(i)
            x, residual = layer(x, residual, cos, sin, attention)
            if on_gpu:
                self.prompt_matmuls.stream.after(i)
        return x, residual


def _to(device, *tensors):
    return tuple(None if t is None else t.to(device) for t in tensors)


def check_split(model: Transformer, gpu_layers: int, doer: str) -> None:
    "What a split takes: chapter 03's Transformer (`doer` says who refuses another), 0 < gpu_layers < its layers."
    layers = len(model.layers)
    if not 0 < gpu_layers < layers:
        raise ValueError(
            f"gpu_layers must be between 1 and {layers - 1} for a model of {layers} layers (all of them: no offload), "
            f"got {gpu_layers}"
        )
    if type(model) is not Transformer:
        raise ValueError(f"{doer} chapter 03's Transformer, not a {type(model).__name__}")


def place_layers(
    model: Transformer, gpu_layers: int, device, offload_device="cpu"
) -> OffloadedTransformer:
    """`model` (loaded on the CPU) with its embedding, first `gpu_layers` layers, final norm and head on `device` and the
    other layers on `offload_device`, in place. 0 < gpu_layers < its number of layers."""
    check_split(model, gpu_layers, "place_layers splits")
    for name, child in model.named_children():
        if name != "layers":
            child.to(device)
    for i, layer in enumerate(model.layers):
        layer.to(device if i < gpu_layers else offload_device)
    model.__class__ = OffloadedTransformer
    model.gpu_layers, model.offload_device = gpu_layers, torch.device(offload_device)
    return model


# %% [markdown]
# ## The KV cache where each layer runs
#
# Each device's pool holds its layers only (`kv_layers`), with the same number of blocks; the
# allocator hands out block ids valid in both. A step's layout goes to both devices, and
# `SplitAttention` gives each layer its device's attention, numbered from the pool's first layer.

# %%
#| export
@dataclass
class SplitAttention:
    "The attention backend of a step of an `OffloadedTransformer`: layers below `split` on `first`, the rest on `rest`."

    first: AttentionBackend
    rest: AttentionBackend
    split: int

    def __call__(self, layer: int, q, k, v, **kw) -> torch.Tensor:
        if layer < self.split:
            return self.first(layer, q, k, v, **kw)
        return self.rest(layer - self.split, q, k, v, **kw)


def offload_pool(
    model: OffloadedTransformer, num_blocks: int, block_size: int, dtype: torch.dtype
) -> PagedKVCache:
    "The pool of the layers on the offload device: as many blocks as the GPU's."
    config = model.config.replace(num_layers=len(model.layers) - model.gpu_layers)
    return PagedKVCache(config, num_blocks, block_size, model.offload_device, dtype)


def gpu_part(model: OffloadedTransformer) -> Transformer:
    """A Transformer of `model`'s GPU modules only (shared, not copied): what the runner measures the GPU's activation
    peak with (chapter 07a), without running the CPU's layers on a whole batch."""
    part = Transformer.__new__(Transformer)
    torch.nn.Module.__init__(part)
    part.config, part.embed, part.norm, part.lm_head = (
        model.config,
        model.embed,
        model.norm,
        model.lm_head,
    )
    part.layers = torch.nn.ModuleList(model.layers[: model.gpu_layers])
    return part


# %% [markdown]
# Both devices are the CPU in this test, which checks the bookkeeping rather than the transfers:
# a tiny model split after its first layer, its two pools and the split attention, gives the
# same greedy tokens as the model whole, through the engine.

# %%
import copy

from forge_engine.config import EngineConfig
from forge_engine.engine import LLMEngine
from forge_engine.generate import SamplingParams
from forge_engine.loader import LoadedModel
from forge_engine.model import empty_model, init_random_weights

from forge_engine import (
    offload,
)  # (the runner checks for the module's class, not this notebook's copy)

tiny = preset("qwen3-tiny").replace(num_layers=3)
whole = init_random_weights(empty_model(tiny), seed=2, std=0.1)
split = offload.place_layers(copy.deepcopy(whole), 1, "cpu")
assert isinstance(split, offload.OffloadedTransformer) and split.gpu_layers == 1
params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
prompts = [list(range(3, 3 + n)) for n in (5, 30, 1)]
config = EngineConfig(kv_cache_bytes=2**20, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)


def greedy(model, config=config, prompts=prompts, params=params):
    engine = LLMEngine(LoadedModel("tiny", model, None, None), config)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, str(i))
    outs = {}
    while engine.has_unfinished():
        outs |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
    engine.allocator.check_idle()
    return outs, engine


want, _ = greedy(whole)
got, engine = greedy(split)
assert got == want
assert (
    engine.runner.offload.k_cache.shape[0] == 2 and engine.runner.cache.k_cache.shape[0] == 1
)  # layers per pool
# the decode steps through chapter 09b's runner of static buffers (on a GPU: two CUDA graphs around the CPU's layers;
# here it runs the same parts eagerly)
graphed, engine = greedy(split, config.replace(cuda_graphs=True))
assert graphed == want and type(engine.runner.decode).__name__ == "SplitDecodeRunner"
part = offload.gpu_part(split)
assert (
    len(part.layers) == 1 and part.layers[0] is split.layers[0] and len(split.layers) == 3
)  # shared, not copied
with pytest.raises(ValueError, match="gpu_layers must be between 1 and 2"):
    place_layers(init_random_weights(empty_model(tiny)), 3, "cpu")

# %% [markdown]
# The loader does the placing (`load_model(..., gpu_layers=N)`, the commands' `--gpu-layers`):
# it loads on the CPU, places, then quantizes each matrix where it sits. Here too both devices
# are the CPU; int8 then gives each layer PyTorch's CPU format, and the engine's tokens are those
# of the same int8 model whole.

# %%
from forge_engine.loader import load_model
from forge_engine.quant.layers import Int8Linear

loaded = load_model(
    "random:qwen3-tiny", "cpu", seed=1, progress=False, quantization="int8", gpu_layers=1
)
assert isinstance(loaded.model, offload.OffloadedTransformer) and loaded.model.gpu_layers == 1
assert isinstance(loaded.model.layers[1].mlp.down, Int8Linear)
whole8 = load_model("random:qwen3-tiny", "cpu", seed=1, progress=False, quantization="int8")
assert greedy(loaded.model)[0] == greedy(whole8.model)[0]
assert (
    type(load_model("random:qwen3-tiny", "cpu", progress=False, gpu_layers=2).model)
    is not offload.OffloadedTransformer
)  # all


# %% [markdown]
# ## How many layers fit
#
# Chapter 10a's rules per layer: a layer's matrices in the weight format and its norms in the
# compute dtype; the embedding and the head (int8 when quantized) stay on the GPU whatever `N`.
# The GPU's KV cache must hold at least the tokens that chapter 10a's minimum holds for the whole
# model, for its `N` layers.

# %%
#| export
@dataclass(frozen=True)
class OffloadPlan:
    "Where a model's layers go under a GPU budget, and the bytes of each part."

    budget: int
    gpu_layers: int
    num_layers: int
    gpu_weights: int  # the GPU layers, the embedding, the head
    cpu_weights: int  # the other layers
    kv_per_token: int  # of the layers whose KV cache is on the GPU, bytes
    kv_cache: int  # what the budget leaves the GPU's KV cache
    # the other layers streamed to the GPU (two slots of it), not computed on the CPU
    streamed: bool = False
    # computed on the CPU, but a prompt's matmuls on the GPU (one slot of it)
    prompt_slot: bool = False

    def describe(self) -> str:
        if self.gpu_layers == self.num_layers:
            return f"offload plan for {format_gib(self.budget)}: all {self.num_layers} layers on the GPU"
        split = describe_split(
            self.gpu_layers, self.num_layers, self.gpu_weights, self.cpu_weights, self.streamed
        )
        prompts = "; a prompt's matmuls on the GPU through one slot" if self.prompt_slot else ""
        return (
            f"offload plan for {format_gib(self.budget)}: {split}{prompts}; GPU KV cache "
            f"{format_gib(self.kv_cache)} ({self.kv_cache // self.kv_per_token:,} tokens)"
        )


def describe_split(
    gpu_layers: int,
    num_layers: int,
    gpu_weights: int | None = None,
    cpu_weights: int | None = None,
    streamed: bool = False,
) -> str:
    "Which layers go where, and their bytes when known."
    gpu = f"{format_gib(gpu_weights)} " if gpu_weights is not None else ""
    cpu = f" ({format_gib(cpu_weights)})" if cpu_weights is not None else ""
    rest = "streamed from host memory through two GPU slots" if streamed else "on the CPU"
    return (
        f"layers 0-{gpu_layers - 1} of {num_layers} on the GPU ({gpu}with the embedding and head), layers "
        f"{gpu_layers}-{num_layers - 1} {rest}{cpu}"
    )


def split_bytes(
    c: ModelConfig, gpu_layers: int, quantization: str = "none", dtype_bytes: int = 2
) -> tuple[int, int]:
    "The weight bytes on the GPU (its layers, the embedding, the head) and on the CPU (the other layers)."
    one = layer_bytes(c, quantization, dtype_bytes)
    rest = weight_bytes(c, quantization, dtype_bytes) - c.num_layers * one
    return rest + gpu_layers * one, (c.num_layers - gpu_layers) * one


def layer_bytes(c: ModelConfig, quantization: str = "none", dtype_bytes: int = 2) -> int:
    "One decoder layer's weights: its matrices in `quantization`, its norms (and biases) in the compute dtype."
    matrices = sum(matrix_bytes(n, k, quantization, dtype_bytes) for n, k in layer_matrices(c))
    norms = 2 * c.hidden_size + (2 * c.head_dim if c.qk_norm else 0)
    biases = c.q_size + 2 * c.kv_size if c.attention_bias else 0
    return matrices + (norms + biases) * dtype_bytes


def plan_gpu_layers(
    c: ModelConfig,
    budget: int,
    quantization: str = "none",
    dtype_bytes: int = 2,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 64,
    streamed: bool = False,
    prompt_slot: bool = False,
) -> OffloadPlan:
    """The most layers `budget` holds on the GPU beside the embedding, the head, the activations (eager steps: no
    graphs), the overhead and the minimal KV cache the runner asks of the GPU's pool (MIN_KV_BYTES, whatever its
    layers); MemoryPlanError when not even one layer does. `streamed`: the other layers stream to the GPU
    (`stream_layers`), whose two slots take two layers' room, and every layer's KV cache is on the GPU. `prompt_slot`:
    the other layers computed on the CPU but a prompt's matmuls on the GPU (`PromptMatmuls`), whose slot takes one."""
    one = layer_bytes(c, quantization, dtype_bytes)
    rest = split_bytes(c, 0, quantization, dtype_bytes)[0]
    acts = activation_bytes(c, max_num_batched_tokens, max_num_seqs, dtype_bytes, quantization)
    kv_layer_token = 2 * c.kv_size * dtype_bytes
    free = budget - rest - acts - OVERHEAD_BYTES
    n = min(c.num_layers, max(0, (free - MIN_KV_BYTES) // one))
    # (all of them fit: nothing streams)
    slots = (2 * one if streamed else one if prompt_slot else 0) if n < c.num_layers else 0
    n = max(0, n - slots // one)
    if n == 0:
        raise MemoryPlanError(
            f"{format_gib(budget)} holds no layer of this model on the GPU: the embedding and head "
            f"({format_gib(rest)}), activations ({format_gib(acts)}), overhead ({format_gib(OVERHEAD_BYTES)}) and "
            f"the minimal KV cache ({format_gib(MIN_KV_BYTES)}) leave {format_gib(free - MIN_KV_BYTES)}, a layer "
            f"needs {format_gib(one)}"
        )
    gpu, other = split_bytes(c, n, quantization, dtype_bytes)
    return OffloadPlan(
        budget,
        n,
        c.num_layers,
        gpu + slots,
        other,
        (c.num_layers if streamed and slots else n) * kv_layer_token,
        free - n * one - slots,
        streamed and bool(slots),
        prompt_slot and bool(slots) and not streamed,
    )


def offload_step_seconds(
    cpu_weights: int, cpu_bytes_per_s: float, pcie_bytes_per_s: float
) -> dict[str, float]:
    "A decode step's floor for the layers past the GPU's: read by the CPU (`--offload cpu`), or copied to the GPU (`stream`)."
    return {
        "cpu_compute": cpu_weights / cpu_bytes_per_s,
        "streaming": cpu_weights / pcie_bytes_per_s,
    }


def pcie_bandwidth(nbytes: int = 2**30, repeats: int = 5) -> tuple[float, float]:
    "Bytes per second of a copy from pinned host memory to the GPU, and back (the streaming mode's bandwidth)."
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    rates = []
    for dst, src in ((device, host), (host, device)):
        dst.copy_(src)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        rates.append(nbytes * repeats / (time.perf_counter() - start))
    return rates[0], rates[1]


# %% [markdown]
# Qwen3-14B in int4 under an 8 GiB budget (the consumer card), and Qwen3-8B in int4,
# which fits whole at that budget with room to spare:

# %%
GIB = 2**30
q14 = plan_gpu_layers(preset("qwen3-14b"), 8 * GIB, "int4")
print(q14.describe())
assert 0 < q14.gpu_layers < 40 and q14.kv_cache >= MIN_KV_BYTES
assert plan_gpu_layers(preset("qwen3-14b"), 12 * GIB, "int4").gpu_layers > q14.gpu_layers
assert plan_gpu_layers(preset("qwen3-8b"), 8 * GIB, "int4").gpu_layers == 36  # all of them
with pytest.raises(MemoryPlanError, match="holds no layer"):
    plan_gpu_layers(preset("qwen3-14b"), 2 * GIB, "int4")
# streamed: two layers' room for the slots, and every layer's KV cache on the GPU
s14 = plan_gpu_layers(preset("qwen3-14b"), 8 * GIB, "int4", streamed=True)
print(s14.describe())
assert s14.streamed and s14.gpu_layers == q14.gpu_layers - 2 and s14.kv_cache >= MIN_KV_BYTES
assert s14.kv_per_token == 40 * q14.kv_per_token // q14.gpu_layers
assert not plan_gpu_layers(preset("qwen3-8b"), 8 * GIB, "int4", streamed=True).streamed
# the floors of a step's CPU part at two bandwidths, e.g. 60 GB/s of DDR5 against 25 GB/s of PCIe 4.0
floors = offload_step_seconds(q14.cpu_weights, 60e9, 25e9)
assert floors["cpu_compute"] < floors["streaming"]
print({k: f"{v * 1e3:.1f} ms" for k, v in floors.items()})

# %% [markdown]
# ## The other mode: streaming the layers to the GPU
#
# The measured CPU mode above runs at a quarter of its floor: the CPU's int4 products do not read
# its memory at its bandwidth, while a GPU's copy engine moves pinned host memory at PCIe's rate
# and the GPU computes a layer in well under a millisecond. So the other mode: `stream_layers`
# keeps the four matrices of each layer from `gpu_layers` on in pinned host memory and runs those
# layers on the GPU from **two slots**, buffers the size of one layer's matrices. Layers
# `gpu_layers`, `gpu_layers + 2`, ... run from slot 0, the others from slot 1: their matrices'
# tensors *are* the slot's (`t.data` points there), so every kernel, fused or not, reads them as
# it reads any GPU weight. `LayerStream` fills a slot on a copy stream as soon as the layer before
# in that slot has run (the compute stream records an event after it), and the compute stream
# waits for the fill before the layer runs: while layer `i` computes, layer `i + 1`'s copy is in
# flight. Past the last layer, the fills wrap to the next step's first streamed layers.
#
# Everything else of those layers (norms, biases: a few KB) stays on the GPU, and so does every
# layer's KV cache: to the runner the model is one on the GPU, whose steps run eager (the copies
# and their events are outside any graph). A GGUF file's blocks are not streamed: the GPU reads
# them repacked (chapter 10g) and its CPU layers keep the file's format.
#
# `kernels_lab/offload_streaming.py` measures this mode against its floor (streamed bytes over
# PCIe): on an H100 machine, 58.0 ms a step against 57.3 (above). The choice between the two
# modes is `--offload cpu`, `--offload stream`, or `--offload auto` (the default), which measures
# them (the last section).

# %%
#| export
# where the layers past the GPU's compute: on the CPU, streamed to the GPU, or whichever of the two a layer of the
# model's shape runs faster on this machine (`--offload auto`, measured at load: the last section)
OFFLOAD_MODES = ("cpu", "stream", "auto")


class LayerStream:
    """Layers `first`.. of `layers`: their matrices' tensors kept in host memory (pinned when `device` is a GPU) and
    run from `slots` slots on `device` (two: one fills while the other runs), each filled on a copy stream once the
    layer before in that slot has run. `on_host(j, tensors)`: called with streamed layer j's host copies as soon as
    they are made (`PromptMatmuls` hands them to the CPU's modules: one layer's copy at a time, never all twice)."""

    def __init__(self, layers, first: int, device, slots: int = 2, on_host=None):
        self.first, self.count, device = first, len(layers) - first, torch.device(device)
        self.cuda = device.type == "cuda"
        tensors = [matrix_tensors(layer) for layer in layers[first:]]
        # a slot: bytes for the largest layer (a GGUF file's layers may differ in types); each layer's tensors are
        # views of its slot, at offsets of its own
        size = max(_slot_bytes(ts) for ts in tensors)
        self.slots = [
            torch.empty(size, dtype=torch.uint8, device=device)
            for _ in range(min(slots, self.count))
        ]
        self.host, self.views = [], []
        for j, ts in enumerate(
            tensors
        ):  # a layer at a time: its host copy, then its tensors in its slot
            host = [t.detach().cpu().pin_memory() if self.cuda else t.detach().clone() for t in ts]
            self.host.append(host)
            if on_host is not None:
                on_host(j, host)
            self.views.append(_slot_views(self.slots[j % len(self.slots)], ts))
            for t, view in zip(ts, self.views[j]):
                t.data = view
        # the layer each slot holds (or is being filled with)
        self.filled = [None] * len(self.slots)
        if self.cuda:
            self.copier = torch.cuda.Stream(device)
            self.copied = [torch.cuda.Event() for _ in self.slots]
            self.used = [torch.cuda.Event() for _ in self.slots]
        for j in range(len(self.slots)):
            self.fill(j)

    def host_bytes(self) -> int:
        "The bytes each step copies (every streamed layer's matrices)."
        return sum(t.numel() * t.element_size() for ts in self.host for t in ts)

    def fill(self, j: int) -> None:
        "Copy streamed layer j (layer first + j) into its slot, after the slot's last layer has run."
        s = j % len(self.slots)
        if self.filled[s] == j:
            return
        if not self.cuda:  # (a CPU "device": the bookkeeping, copied at once)
            for dst, src in zip(self.views[j], self.host[j]):
                dst.copy_(src)
        else:
            with torch.cuda.stream(self.copier):
                self.copier.wait_event(self.used[s])
                for dst, src in zip(self.views[j], self.host[j]):
                    dst.copy_(src, non_blocking=True)
                self.copied[s].record(self.copier)
        self.filled[s] = j

    def before(self, layer: int) -> None:
        "Layer `layer`'s matrices in place before its kernels run (filled ahead, or now)."
        j = layer - self.first
        self.fill(j)
        if self.cuda:
            torch.cuda.current_stream().wait_event(self.copied[j % len(self.slots)])

    def after(self, layer: int) -> None:
        "Layer `layer` has run (its kernels queued): its slot takes the next layer of that slot."
        j = layer - self.first
        s, following = j % len(self.slots), j + len(self.slots)
        if self.cuda:
            self.used[s].record(torch.cuda.current_stream())
        self.fill(following if following < self.count else s)  # past the last: the next step's


SLOT_ALIGN = 256  # bytes: where each tensor starts in a slot (any dtype's alignment; the kernels' wide loads)


def _slot_bytes(tensors) -> int:
    return sum(-(-t.numel() * t.element_size() // SLOT_ALIGN) * SLOT_ALIGN for t in tensors)


def _slot_views(slot: torch.Tensor, tensors) -> list[torch.Tensor]:
    "Views of `slot` (bytes) shaped and typed as `tensors`, one after another, each at a multiple of SLOT_ALIGN."
    views, at = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        views.append(slot[at : at + nbytes].view(t.dtype).view(t.shape))
        at += -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN
    return views


def matrix_tensors(layer) -> list[torch.Tensor]:
    "A decoder layer's four matrices' parameters and buffers, in one order for every layer."
    from forge_engine.quant.layers import QUANTIZED_LINEARS

    modules = [layer.get_submodule(name) for name in QUANTIZED_LINEARS]
    return [t for m in modules for t in (*m.parameters(), *m.buffers())]


class StreamedTransformer(Transformer):
    "A Transformer whose layers from `gpu_layers` on run on the GPU from `stream`'s two slots (`stream_layers`)."

    gpu_layers: int
    stream: LayerStream

    def run_layers(self, x, cos, sin, attention: AttentionBackend) -> torch.Tensor:
        residual = None
        for i, layer in enumerate(self.layers):
            if i >= self.gpu_layers:
                self.stream.before(i)
            x, residual = layer(x, residual, cos, sin, attention)
            if i >= self.gpu_layers:
                self.stream.after(i)
        return self.final_norm(x, residual)


def stream_layers(model: Transformer, gpu_layers: int, device) -> StreamedTransformer:
    """`model` (loaded, and quantized, on the CPU) with everything on `device` but the matrices of layers `gpu_layers`..,
    which stream there each step (`LayerStream`), in place. 0 < gpu_layers < its number of layers."""
    check_split(model, gpu_layers, "stream_layers streams")
    stream = LayerStream(
        model.layers, gpu_layers, device
    )  # the streamed matrices first: never whole on the GPU
    model.to(device)  # the rest (the streamed matrices are there already)
    model.__class__ = StreamedTransformer
    model.gpu_layers, model.stream = gpu_layers, stream
    return model


# %% [markdown]
# Both devices the CPU again: a tiny model of five layers with layers 1.. streamed through the two
# slots (four layers, so each slot is filled twice a step) gives the model whole's greedy tokens
# through the engine; the slots hold one layer's matrices each.

# %%
tiny5 = preset("qwen3-tiny").replace(num_layers=5)
whole5 = init_random_weights(empty_model(tiny5), seed=3, std=0.1)
streamed = offload.stream_layers(copy.deepcopy(whole5), 1, "cpu")
assert isinstance(streamed, offload.StreamedTransformer) and len(streamed.stream.slots) == 2
assert (
    streamed.layers[1].mlp.down.weight.data_ptr() == streamed.layers[3].mlp.down.weight.data_ptr()
)
assert (
    streamed.layers[1].mlp.down.weight.data_ptr() != streamed.layers[2].mlp.down.weight.data_ptr()
)
assert greedy(streamed)[0] == greedy(whole5)[0]
with pytest.raises(ValueError, match="gpu_layers must be between 1 and 4"):
    stream_layers(copy.deepcopy(whole5), 5, "cpu")

# the loader's way (`--offload stream`): int8 layers quantized on the CPU, the last one streamed; a GGUF file refused
loaded = load_model(
    "random:qwen3-tiny", "cpu", seed=1, progress=False, quantization="int8", gpu_layers=1,
    offload="stream",
)  # fmt: skip
assert isinstance(loaded.model, offload.StreamedTransformer)
assert isinstance(loaded.model.layers[1].mlp.down, Int8Linear)
assert greedy(loaded.model)[0] == greedy(whole8.model)[0]
with pytest.raises(ValueError, match="unknown offload 'gpu'"):
    load_model("random:qwen3-tiny", "cpu", progress=False, gpu_layers=1, offload="gpu")


# %% [markdown]
# ## A prompt's matmuls on the GPU
#
# The CPU computes its layers at a decode step's one row because reading their weights is all
# that step does. A prompt's step is the other case: its rows multiply every weight, and the CPU's
# time grows with them (a Qwen3-14B layer in int4 takes 0.5-0.8 s at 512 rows on two cores, with
# chapter 10e's tiles), while a copy of the layer to the GPU takes the same milliseconds whatever
# the rows. So `PromptMatmuls` gives each CPU layer's matrices a GPU twin, streamed as above, and
# a step of `rows` rows or more sends each CPU layer's qkv, o and MLP to the GPU: x there, the
# product back. Attention stays on the CPU with its KV cache, and so do the norms and rotations
# (a few KB a row). This is what llama.cpp does with a partly offloaded model's large batches.
#
# The twins stream through one slot: a prompt's products take a fraction of a layer's copy, so a
# second slot to overlap them would save little and cost a layer's room. The CPU computes from the
# same pinned host copies the slot is filled from, so the host holds each matrix once.
#
# `rows` is where the two cost the same: one row's products on the CPU times the rows against the
# layer's copy, both measured by the loader on one of the model's CPU layers (`layer_seconds`,
# `prompt_rows`); the CPU mode then chooses per step. The slot takes one layer's room on the GPU,
# which the memory plan gives it (`plan_gpu_layers(..., prompt_slot=True)`): Qwen3-14B in int4
# under 8 GiB keeps 23 layers on the GPU instead of 24, a decode step's CPU part one layer (1/16)
# longer, for prompts whose CPU layers take a layer's copy each instead of seconds. On the H100
# machine above a 512-token prompt's first token came in **168 ms with the twins against 361 ms**
# without (from 2 rows on; `kernels_lab/offload_bandwidth.py`).

# %%
#| export
class PromptMatmuls:
    """The CPU layers of `model` (an OffloadedTransformer) also run on `device` for steps of `rows` rows or more: each
    layer's qkv, o and MLP wrapped in `RowsOnGPU`, their GPU twins' matrices streamed through one slot (`LayerStream`),
    the CPU's matrices the stream's host copies. Attaches itself as `model.prompt_matmuls`."""

    def __init__(self, model: OffloadedTransformer, device, rows: int):
        if rows < 1:
            raise ValueError(f"PromptMatmuls' rows must be at least 1, got {rows}")
        cpu_layers = list(model.layers)[model.gpu_layers :]
        twins = [_gpu_twin_layer(layer) for layer in cpu_layers]

        def to_host_copy(
            j, host
        ):  # one copy of each matrix in host memory: the CPU's, and the slot's source
            for t, pinned in zip(matrix_tensors(cpu_layers[j]), host):
                t.data = pinned

        self.stream = LayerStream(twins, 0, device, slots=1, on_host=to_host_copy)
        self.rows, self.device = rows, torch.device(device)
        for layer, twin in zip(cpu_layers, twins):
            layer.attn.qkv = RowsOnGPU(layer.attn.qkv, twin.attn.qkv, self)
            layer.attn.o = RowsOnGPU(layer.attn.o, twin.attn.o, self)
            layer.mlp = RowsOnGPU(layer.mlp, twin.mlp, self)
        model.prompt_matmuls = self

    def takes(self, x: torch.Tensor) -> bool:
        "Whether this step (x: its rows) runs the CPU layers' matmuls on the GPU."
        return x.shape[0] >= self.rows


class RowsOnGPU(torch.nn.Module):
    "`on_cpu` (a CPU layer's matrix, or its MLP) for a step's few rows; its GPU twin for many (`PromptMatmuls.takes`)."

    def __init__(self, on_cpu: torch.nn.Module, on_gpu: torch.nn.Module, matmuls: PromptMatmuls):
        super().__init__()
        self.on_cpu = on_cpu
        # (not submodules: the twin's tensors are the stream's slots, counted once, by the stream)
        self.__dict__["on_gpu"], self.__dict__["matmuls"] = on_gpu, matmuls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.matmuls.takes(x):
            return self.on_cpu(x)
        return self.on_gpu(x.to(self.matmuls.device)).to(x.device)


def _gpu_twin(module: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of a matrix module whose tensors are its own objects (the same storage, until a LayerStream
    points them at its slots), without the CPU's packed copies of its weights."""
    twin = copy.copy(module)
    twin._parameters = {
        k: None if v is None else torch.nn.Parameter(v.detach(), requires_grad=False)
        for k, v in module._parameters.items()
    }
    twin._buffers = {k: None if v is None else v.detach() for k, v in module._buffers.items()}
    for packed in ("_cpu_pack", "_cpu_packs"):
        twin.__dict__.pop(packed, None)
    return twin


def _gpu_twin_layer(layer) -> torch.nn.Module:
    "Twins of a decoder layer's four matrices, as `matrix_tensors` finds them (attn.qkv ...), and of its MLP."
    twin = torch.nn.Module()
    twin.attn = torch.nn.Module()
    twin.attn.qkv, twin.attn.o = _gpu_twin(layer.attn.qkv), _gpu_twin(layer.attn.o)
    twin.mlp = copy.copy(layer.mlp)
    twin.mlp._modules = {
        "gate_up": _gpu_twin(layer.mlp.gate_up),
        "down": _gpu_twin(layer.mlp.down),
    }
    return twin


# %% [markdown]
# Both devices the CPU: a four-layer model split after its first layer, its three CPU layers'
# matmuls run by their twins for steps of 8 rows or more (prompts here; decode steps stay on the
# "CPU" modules), gives the greedy tokens of the model whole; the twins' tensors are the stream's
# slot, the CPU modules' its host copies:

# %%
tiny4 = preset("qwen3-tiny").replace(num_layers=4)
whole4 = init_random_weights(empty_model(tiny4), seed=5, std=0.1)
both = offload.place_layers(copy.deepcopy(whole4), 1, "cpu")
matmuls = offload.PromptMatmuls(both, "cpu", rows=8)
assert both.prompt_matmuls is matmuls
assert isinstance(both.layers[2].mlp, offload.RowsOnGPU) and len(matmuls.stream.slots) == 1
assert both.layers[2].mlp.on_gpu.down.weight.data_ptr() == matmuls.stream.views[1][-1].data_ptr()
assert (
    matmuls.stream.views[1][0].data_ptr() == matmuls.stream.slots[0].data_ptr()
)  # (one slot: every layer's)
assert both.layers[1].attn.qkv.on_cpu.weight.data_ptr() == matmuls.stream.host[0][0].data_ptr()
taken, takes = (
    [],
    matmuls.takes,
)  # (which steps went to the twins: prompts' chunks yes, decode steps no)
matmuls.takes = lambda x: taken.append(takes(x)) or taken[-1]
assert greedy(both)[0] == greedy(whole4)[0]
assert True in taken and False in taken
# the twins are no parameters of the model: its bytes are the model whole's
assert sum(p.numel() for p in both.parameters()) == sum(p.numel() for p in whole4.parameters())
# the plan gives the slot one layer's room: one layer fewer on the GPU, the KV cache of the ones there
p14 = plan_gpu_layers(preset("qwen3-14b"), 8 * GIB, "int4", prompt_slot=True)
print(p14.describe())
assert p14.prompt_slot and not p14.streamed and p14.gpu_layers == q14.gpu_layers - 1
assert p14.kv_per_token == p14.gpu_layers * q14.kv_per_token // q14.gpu_layers
assert "a prompt's matmuls on the GPU through one slot" in p14.describe()
with pytest.raises(ValueError, match="rows must be at least 1"):
    offload.PromptMatmuls(offload.place_layers(copy.deepcopy(whole4), 1, "cpu"), "cpu", rows=0)

# %% [markdown]
# A GGUF file's layers keep their blocks on both sides (the GPU twins run chapter 10d's kernels on
# them), and its layers need not hold one type: a slot is bytes for the largest layer, each layer
# a view of its own. SmolLM2's file split after its first layer, its prompts through the twins:

# %%
from forge_engine.quant.layers import Int4Linear, swap_layer_matrices

smol = load_model("smollm2-135m-instruct", "cpu", progress=False, quantization="gguf")
smol_whole = copy.deepcopy(smol.model)
offload.PromptMatmuls(offload.place_layers(smol.model, 1, "cpu"), "cpu", rows=8)
assert type(smol.model.layers[5].attn.qkv.on_cpu).__name__ == "GGUFLinear"
smol_prompts = [list(range(5, 45)), list(range(50, 62))]
smol_params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
smol_config = EngineConfig(kv_cache_bytes=2**24, max_num_seqs=2, max_num_batched_tokens=32)

smol_run = dict(config=smol_config, prompts=smol_prompts, params=smol_params)
assert greedy(smol.model, **smol_run)[0] == greedy(smol_whole, **smol_run)[0]
# layers of different formats through one slot: int8, int8, int4 after the first
mixed = copy.deepcopy(whole4)
swap_layer_matrices(mixed, lambda m, where: Int8Linear(m), range(1, 3))
swap_layer_matrices(mixed, lambda m, where: Int4Linear(m, group=32), range(3, 4))
mixed_whole = copy.deepcopy(mixed)
offload.PromptMatmuls(offload.place_layers(mixed, 1, "cpu"), "cpu", rows=8)
assert greedy(mixed)[0] == greedy(mixed_whole)[0]


# %% [markdown]
# ## Which mode, on this machine
#
# The napkin math above compares bandwidths; what a step pays is what the CPU's kernels make of
# its bandwidth (a quarter of it on the machine measured above) against what the copy engine
# makes of PCIe's. Both are cheap to measure on the layer itself: `offload_layer_seconds` builds
# one decoder layer of the model's shape (random weights: the time does not depend on their
# values), in its weight format, and times its four matrices' products with one row on the CPU,
# and a copy of those matrices from pinned host memory to the GPU. A decode step's offloaded part
# is then about `(L - N) ·` that time in each mode, each mode with its own `N` (streaming gives
# two layers' room to its slots), and `--offload auto` takes the smaller (`choose_offload`).
# The GPU's work on a streamed layer runs while the next layer's copy is in flight, so the copy
# is the streamed layer's cost; the CPU's layers wait for nothing but themselves.
#
# A GGUF file's layers are not streamed (their blocks stay on the CPU, above): `auto` computes
# them on the CPU, as it does where nothing is split or there is no GPU. On the H100 machine
# above, `auto` measured a Qwen3-14B int4 layer at 1.55 ms on the CPU against 3.21 ms to copy,
# 26.3 ms a step against 57.7 streamed, and took the CPU; the two modes then ran 56.9 and 58.0
# ms a step. The CPU's estimate leaves out the rest of its layers' work (above), so where the
# two estimates are close streaming may be the faster; the loader prints both, and `--offload
# stream` or `cpu` overrides.

# %%
#| export
def offload_layer_seconds(
    config: ModelConfig,
    quantization: str = "none",
    dtype: torch.dtype = torch.bfloat16,
    device="cuda",
    repeats: int = 5,
) -> dict[str, float]:
    """What one decoder layer of `config`'s shape, in `quantization` ("none", "int8" or "int4") and `dtype`, costs a
    decode step on this machine (`layer_seconds` on a layer of random weights, before any is loaded)."""
    from forge_engine.model import empty_model, init_random_weights
    from forge_engine.quant.layers import quantize_model

    one = init_random_weights(  # (a vocabulary of 16: the embedding and head are not timed)
        empty_model(config.replace(num_layers=1, vocab_size=16), "cpu", dtype)
    )
    if quantization != "none":
        quantize_model(one, quantization)
    return layer_seconds(one.layers[0], device, repeats)


def layer_seconds(layer, device="cuda", repeats: int = 5) -> dict[str, float]:
    """A decoder layer on the CPU: its four matrices' products with one row there ("cpu"), and a copy of those
    matrices from pinned host memory to `device` ("stream"), median of `repeats`."""
    from forge_engine.quant.layers import QUANTIZED_LINEARS

    device, dtype = torch.device(device), layer.attn_norm.weight.dtype
    matrices = [layer.get_submodule(name) for name in QUANTIZED_LINEARS]
    rows = [torch.randn(1, m.in_features, dtype=dtype) for m in matrices]
    host = [
        t.detach().pin_memory() if device.type == "cuda" else t.detach().clone()
        for t in matrix_tensors(layer)
    ]
    slots = [torch.empty_like(t, device=device) for t in host]

    def products():
        for matrix, x in zip(matrices, rows):
            matrix(x)

    def copies():
        for slot, t in zip(slots, host):
            slot.copy_(t, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return {"cpu": _median_seconds(products, repeats), "stream": _median_seconds(copies, repeats)}


def prompt_rows(seconds: dict[str, float]) -> int:
    "The rows from which a step's CPU layers are faster on the GPU (`PromptMatmuls`): one row's products against a copy."
    return max(2, math.ceil(seconds["stream"] / seconds["cpu"]))


def _median_seconds(run, repeats: int) -> float:
    run()  # (the first call packs, allocates and warms)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def choose_offload(
    num_layers: int, gpu_layers: dict[str, int], seconds: dict[str, float]
) -> tuple[str, dict[str, float]]:
    """The mode ("cpu" or "stream") whose offloaded layers cost a decode step less: each mode's `gpu_layers` (its own
    plan) and one layer's `seconds` in it (`offload_layer_seconds`); with each mode's estimate of that part of a step."""
    step = {mode: (num_layers - gpu_layers[mode]) * seconds[mode] for mode in gpu_layers}
    return min(step, key=step.get), step


# %% [markdown]
# The choice is arithmetic over the two measurements: Qwen3-14B int4 under 8 GiB computes 16
# layers on the CPU or streams 18, so streaming wins as soon as a layer's copy takes less than
# 16/18 of the CPU's time on it:

# %%
plans = {"cpu": q14.gpu_layers, "stream": s14.gpu_layers}
assert choose_offload(40, plans, {"cpu": 9e-3, "stream": 3e-3})[0] == "stream"
assert choose_offload(40, plans, {"cpu": 3e-3, "stream": 9e-3})[0] == "cpu"
mode, step = choose_offload(40, plans, {"cpu": 1.0, "stream": 1.0})
assert mode == "cpu" and step == {"cpu": 40 - q14.gpu_layers, "stream": 40 - s14.gpu_layers}

# %% [markdown]
# Measured on a tiny layer (both devices the CPU here, so "stream" is a copy in host memory); the
# loader's `offload="auto"` measures, chooses and says so where there is a GPU to stream to, and
# keeps the CPU mode here:

# %%
seconds = offload_layer_seconds(preset("qwen3-tiny"), "int8", torch.float32, "cpu")
assert set(seconds) == {"cpu", "stream"} and all(0 < s < 1 for s in seconds.values())
assert (
    prompt_rows({"cpu": 2e-3, "stream": 3e-3}) == 2
    and prompt_rows({"cpu": 1e-4, "stream": 3e-3}) == 30
)
loaded = load_model(
    "random:qwen3-tiny", "cpu", seed=1, progress=False, quantization="int8", gpu_layers=1,
    offload="auto",
)  # fmt: skip
assert type(loaded.model) is offload.OffloadedTransformer
assert greedy(loaded.model)[0] == greedy(whole8.model)[0]
