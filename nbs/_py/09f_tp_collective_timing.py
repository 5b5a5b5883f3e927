# %% [markdown]
# # Timing the collectives
#
# > What the all-reduces and the all-gather of a decode step cost, for the benchmarks' tensor-parallel report.
#
# Part of tensor parallelism: chapter 09c says how the model is split and what crosses the wire.

# %%
#| default_exp tensor_parallel.collective_timing

# %%
#| export
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from forge_engine.config import EngineConfig, ModelConfig
from forge_engine.loader import LoadedModel
from forge_engine.tensor_parallel.shards import AllReduce, ReducingRMSNorm, all_gather_columns

# %%
#| hide
import tempfile
from pathlib import Path
import pytest
from forge_engine.config import preset
from forge_engine.generate import SamplingParams
from forge_engine.model import (
    causal_attention,
    empty_model,
    hf_state_dict,
    init_random_weights,
    rope_cos_sin,
)


# ## Measuring the collectives
#
# A step of `b` decoding sequences runs `2 x layers + 1` all-reduces of `[b, hidden]` and one
# all-gather of logits. `time_collectives` runs exactly those on every rank, through the
# model's own `AllReduce` and `ReducingRMSNorm` (the path the decode step takes: where the
# all-reduce, the residual add and the norm are one kernel, the add and the norm are counted
# with it), recorded in a CUDA graph on a GPU as the decode step is, and returns the seconds per
# step of each kind.

# %%
#| export
def _seconds_per_call(fn, device: torch.device, repeats: int, group=None) -> float:
    "Wall seconds of one `fn()`: replayed from a CUDA graph on a GPU, called as it is on a CPU."
    fn()  # warm up (the communicator's first use)
    run = fn
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
        run()
        torch.cuda.synchronize(device)
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / repeats


def time_collectives(
    config: ModelConfig,
    world: int,
    batch: int,
    device,
    dtype: torch.dtype,
    repeats: int = 20,
    all_reduce: AllReduce | None = None,
    group=None,
) -> dict[str, float]:
    "Seconds per decode step of its all-reduces and of its logits all-gather at `batch` sequences (every rank together)."
    all_reduce, device = all_reduce or AllReduce(group), torch.device(device)
    x = torch.zeros(batch, config.hidden_size, device=device, dtype=dtype)
    logits = torch.zeros(batch, config.vocab_size // world, device=device, dtype=dtype)
    norm = ReducingRMSNorm(config.hidden_size, config.rms_norm_eps, all_reduce).to(device, dtype)
    staged = [all_reduce.staging(x.shape, x.dtype, half) for half in (0, 1)]

    def all_reduces():  # the embedding's, then each row-parallel layer's as its norm finishes it (add and norm included)
        all_reduce(x)
        for i in range(2 * config.num_layers):
            norm.add_and_norm(x if staged[i % 2] is None else staged[i % 2], x)

    return {
        "all_reduce_s": _seconds_per_call(all_reduces, device, repeats, group),
        "all_gather_s": _seconds_per_call(
            lambda: all_gather_columns(logits, world, group, torch.float32), device, repeats, group
        ),
    }


# %% [markdown]
# For the benchmarks (`forge-engine bench w1|w2 --tensor-parallel-size N`): the all-reduce
# time per decode step (and the all-gather's) next to the step time the workload measured,
# and its share of that step. W1 decodes one sequence, so its step is `1 / decode tok/s`.
# W2's decode steps run up to `max_num_seqs` sequences; `max_num_seqs / output tok/s`
# over-estimates such a step (the wall time includes the prefills), so the W2 shares are lower
# bounds.

# %%
#| export
def tensor_parallel_report(loaded: LoadedModel, config: EngineConfig, result: dict) -> dict:
    "All-reduce (and all-gather) time per decode step at batch 1 and at `max_num_seqs`, and its share of the step."
    parallel = loaded.parallel
    full, p = parallel.model.plan.config, next(parallel.model.parameters())
    report = {
        "size": parallel.world,
        "backend": parallel.backend,
        "all_reduce_path": parallel.all_reduce_path,
        "per_step": {"all_reduce": 2 * full.num_layers + 1, "all_gather": 1},
    }
    for batch in sorted({1, config.max_num_seqs}):
        times = parallel.time_collectives(batch)
        report[f"batch_{batch}"] = {
            **times,
            "collectives_s": times["all_reduce_s"] + times["all_gather_s"],
            "all_reduce_bytes": batch * full.hidden_size * p.element_size(),
            "all_gather_bytes_per_rank": batch
            * full.vocab_size
            // parallel.world
            * p.element_size(),
        }
    steps = {}
    if "decode_tok_s" in result:
        steps["w1", 1, ""] = 1 / result["decode_tok_s"]
    if "output_tok_s" in result:
        steps["w2", config.max_num_seqs, "_lower_bound"] = (
            config.max_num_seqs / result["output_tok_s"]
        )
    for (workload, batch, bound), step in steps.items():
        times = report[f"batch_{batch}"]
        report[f"{workload}_step_s" if not bound else f"{workload}_decode_step_upper_bound_s"] = (
            step
        )
        report[f"{workload}_all_reduce_share{bound}"] = times["all_reduce_s"] / step
        report[f"{workload}_collective_share{bound}"] = times["collectives_s"] / step
    return report

# %% [markdown]
#
