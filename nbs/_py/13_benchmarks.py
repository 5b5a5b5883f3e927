# %% [markdown]
# # Benchmarks
#
# > The workloads of `performance.md` through the real engine and the real server, with the ceilings, the peers, and plots: the final chapter, where everything runs at once.

# %% [markdown]
# A benchmark here is a function that builds an engine, warms it up, runs a named workload and
# returns a dictionary of figures together with the environment it ran in. Nothing here
# asserts a speed: figures are reported, never tested. The workloads:
#
# - **W1 single stream**: a 128-token prompt, 256 greedy tokens, batch 1: decode tok/s, TTFT,
#   bandwidth achieved.
# - **W2 offline throughput**: 256 requests of 100-1024 random token ids, 512 tokens each.
# - **W3 online serving**: the streaming OpenAI endpoint of a real `forge-engine serve`
#   process under Poisson arrivals, measured from outside by chapter 13a's load client.
# - **W4 CPU classroom**: SmolLM2-135M on a CPU, 1 and 8 requests at once.
#
# This chapter holds the workloads, the ceilings, the result files and the command, and ends
# with the final run of the course: a real server under load, plotted. It leans on four
# short chapters filed after it, each one module: **13a** the load client (W3 from outside),
# **13b** the peers (`transformers` on the same weights), **13c** the server process W3 runs
# against, **13d** the plots. Read them when this chapter calls them; run this one last.
#
# From a terminal (results are JSON files named by hardware and version, plots next to them):
#
# ```
# forge-engine bench all --model random:qwen3-4b --peers           # on a GPU: W1, W2, W3 -> docs/benchmarks/
# forge-engine bench all --model smollm2-135m-instruct --device cpu --peers   # W4, W3
# forge-engine bench w1 --model random:qwen3-4b --peers             # one workload, JSON on stdout
# forge-engine bench plot docs/benchmarks/nvidia-h200/*.json         # draw the plots again
# ```

# %%
#| default_exp bench

# %%
#| export
from __future__ import annotations

import gc
import importlib.metadata
import json
import os
import platform
import random
import re
import subprocess
import sys
import time

import torch

import forge_engine
from forge_engine.config import EngineConfig
from forge_engine.engine import LLMEngine, StepRecord
from forge_engine.generate import SamplingParams
from forge_engine.kv_cache import PagedKVCache
from forge_engine.loader import LoadedModel, model_bytes

# %%
#| hide
import argparse
import math
import tempfile

import pytest


# %% [markdown]
# ## The environment a figure belongs to
#
# A figure without its hardware and versions cannot be compared with anything. Every result
# carries this record, and its file is named after it:
# `docs/benchmarks/<hardware>/<workload>-<model>-<version>-<commit>.json`.

# %%
#| export
def _command_output(cmd: list[str], cwd: str | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def cpu_name() -> str:
    "The CPU's model name (from /proc/cpuinfo on Linux)."
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"): return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)  # without importing it (triton on a CPU, transformers: slow)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    "What a benchmark figure depends on: hardware, driver, versions, commit, command line."
    env = {"forge_engine": forge_engine.__version__, "python": platform.python_version(), "torch": torch.__version__,
           "triton": _version("triton"), "transformers": _version("transformers"), "cpu": cpu_name(),
           "cpu_count": os.cpu_count(), "cpu_threads": torch.get_num_threads(), "machine": platform.machine()}
    if torch.cuda.is_available():
        driver = _command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        env.update(gpu=torch.cuda.get_device_name(0), gpu_count=torch.cuda.device_count(), cuda=torch.version.cuda,
                   driver=driver.splitlines()[0] if driver else None)
    package_dir = os.path.dirname(os.path.abspath(forge_engine.__file__))
    if stated := os.environ.get("FORGE_COMMIT"):  # a tree copied without (or with stale) git metadata says it here
        env["commit"], env["dirty"] = stated.removesuffix("-dirty"), stated.endswith("-dirty")
    else:
        env["commit"] = _command_output(["git", "rev-parse", "--short", "HEAD"], cwd=package_dir)
        if env["commit"]:  # uncommitted changes to tracked files: the commit alone does not say what ran
            env["dirty"] = bool(_command_output(["git", "status", "--porcelain", "--untracked-files=no"], cwd=package_dir))
    env["command"] = " ".join(["forge-engine" if i == 0 and a.endswith(("forge-engine", "__main__.py")) else a
                               for i, a in enumerate(sys.argv)])
    return env


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", re.sub(r"\((r|tm)\)", "", text.lower())).strip("-")


def hardware_slug(env: dict) -> str:
    "The folder of a result: the GPU's name, or the CPU's with its core count."
    return _slug(env["gpu"]) if env.get("gpu") else _slug(f"cpu {env['cpu']} {env['cpu_count']} cores")


def result_stem(result: dict) -> str:
    "`<model>[-<quantization>]-<version>-<commit>`: what a result's file name says after its workload."
    env = result["environment"]
    commit = (env.get("commit") or "nocommit") + ("-dirty" if env.get("dirty") else "")
    weights = "" if result.get("quantization", "none") == "none" else f"-{result['quantization']}"
    return f"{_slug(result['model'])}{weights}-{env['forge_engine']}-{commit}"


def result_path(result: dict, root: str = "docs/benchmarks") -> str:
    "`<root>/<hardware>/<workload>-<model>-<version>-<commit>.json`."
    return os.path.join(root, hardware_slug(result["environment"]), f"{result['workload'].lower()}-{result_stem(result)}.json")


def save_result(result: dict, root: str = "docs/benchmarks") -> str:
    "Write `result` as JSON where `result_path` says; the path."
    path = result_path(result, root)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f: json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)  # never a half-written result
    return path


# %%
env = environment()
assert {"torch", "python", "commit", "cpu", "command", "forge_engine"} <= set(env)
assert hardware_slug({"gpu": "NVIDIA H200"}) == "nvidia-h200"
assert hardware_slug({"cpu": "Intel(R) Xeon(R) Processor", "cpu_count": 2}) == "cpu-intel-xeon-processor-2-cores"
fake = {"workload": "W1", "model": "random:qwen3-4b", "environment": {"gpu": "NVIDIA H200", "forge_engine": "0.1.0",
                                                                       "commit": "abc1234", "dirty": True}}
assert result_path(fake, "out") == os.path.join("out", "nvidia-h200", "w1-random-qwen3-4b-0.1.0-abc1234-dirty.json")
assert result_path({**fake, "quantization": "int4"}, "out").endswith("w1-random-qwen3-4b-int4-0.1.0-abc1234-dirty.json")
# a tree copied to another machine without its git history states its commit (FORGE_COMMIT, `-dirty` optional)
os.environ["FORGE_COMMIT"] = "abc1234-dirty"
try:
    assert (environment()["commit"], environment()["dirty"]) == ("abc1234", True)
finally:
    del os.environ["FORGE_COMMIT"]
assert environment()["commit"] != "abc1234"


# %% [markdown]
# ## Running a batch of requests offline
#
# All requests are queued at once and the engine steps until every one is done; the clock
# runs from the first step to the last output, prompts included. The engine's own
# `StepRecord`s (chapter 08) are kept for every step of the run: how many prompt tokens and
# decoding sequences it carried, how long it took, how many KV blocks were held after it.
# That is the time series of the plots below.

# %%
#| export
def random_prompts(count: int, min_len: int, max_len: int, vocab_limit: int = 10000, seed: int = 0) -> list[list[int]]:
    "Prompts of random token ids (the nano-vllm workload): lengths uniform in [min_len, max_len]."
    rng = random.Random(seed)
    return [[rng.randrange(vocab_limit) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


def sync(device):
    if torch.device(device).type == "cuda": torch.cuda.synchronize(device)


def run_batch(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict:
    "Run every prompt to the end: wall time, tokens, per-request first-token latency and the engine's step records."
    ids = [engine.add_request(p, params) for p in prompts]
    sync(engine.device)
    start, first, finals, records = time.perf_counter(), {}, {}, []
    while engine.has_unfinished():
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter() - start)
            if out.finished: finals[out.request_id] = out
        if engine.recent and (not records or engine.recent[-1].index != records[-1].index):
            records.append(engine.recent[-1])
    sync(engine.device)
    wall = time.perf_counter() - start
    engine.allocator.check_idle()  # every run ends with the KV pool free (cached prefixes count as free), or fails here
    output_tokens = sum(len(finals[i].token_ids) for i in ids)
    ttfts = sorted(first[i] for i in ids)
    return {"requests": len(ids), "prompt_tokens": sum(map(len, prompts)), "output_tokens": output_tokens,
            "wall_s": wall, "output_tok_s": output_tokens / wall, "ttft_median_s": ttfts[len(ttfts) // 2],
            "kv_used_blocks_after": engine.allocator.stats().used_blocks, "records": records, "start": start}


def step_timeline(records: list[StepRecord], start: float, engine: LLMEngine) -> dict:
    "The step records as columns (seconds since `start`), with what is needed to read KV usage as bytes."
    cache = engine.cache
    return {"t_s": [r.ended_at - start for r in records], "step_s": [r.seconds for r in records],
            "prefill_tokens": [r.prefill_tokens for r in records], "decode_seqs": [r.decode_seqs for r in records],
            "kv_used_blocks": [r.kv_used_blocks for r in records], "kv_total_blocks": engine.allocator.num_blocks,
            "kv_bytes_per_block": PagedKVCache.bytes_per_block(engine.loaded.config, engine.config.block_size,
                                                               cache.k_cache.dtype)}


# %% [markdown]
# ## Where the bytes go: a decode step on the roofline
#
# A decode step of `B` sequences reads every weight once and each sequence's K/V, and does
# about `2 × parameters × B` FLOPs of matmuls. Its arithmetic intensity (FLOPs per byte) grows
# with `B`: at batch 1 it is ~1 FLOP per BF16 byte, far left of where the GPU's compute roof
# starts (~190 FLOP/byte on an H200), so the step can only be as fast as memory allows. A
# *decode point* is the median pure-decode step at one batch size, placed on that chart.

# %%
#| export
def model_size(loaded: LoadedModel) -> tuple[int, int]:
    "(parameters, bytes) of the weights; a quantized layer counts its logical weights and its stored bytes."
    from forge_engine.quant import QuantLinear  # (its weights are buffers, not parameters)
    params = sum(p.numel() for p in loaded.model.parameters())
    params += sum(m.in_features * m.out_features for m in loaded.model.modules() if isinstance(m, QuantLinear))
    return params, model_bytes(loaded.model)


def weight_bytes(loaded: LoadedModel) -> int: return model_size(loaded)[1]


def decode_point(label: str, timeline: dict, loaded: LoadedModel, batch: int | None = None) -> dict | None:
    "The median pure-decode step with `batch` sequences (default: the largest batch seen): time, bytes read, FLOPs."
    decode = [i for i, (p, d) in enumerate(zip(timeline["prefill_tokens"], timeline["decode_seqs"])) if p == 0 and d > 0]
    if not decode: return None
    batch = batch or max(timeline["decode_seqs"][i] for i in decode)
    steps = sorted((timeline["step_s"][i], timeline["kv_used_blocks"][i]) for i in decode
                   if timeline["decode_seqs"][i] == batch)
    if not steps: return None
    step_s, kv_blocks = steps[len(steps) // 2]
    params, weights = model_size(loaded)
    kv = kv_blocks * timeline["kv_bytes_per_block"]  # every held block is read (a slight overcount: last blocks are partial)
    return {"label": label, "batch": batch, "steps": len(steps), "step_s": step_s, "weight_bytes": weights,
            "kv_bytes": kv, "flops": 2 * params * batch, "bytes_per_s": (weights + kv) / step_s,
            "flops_per_s": 2 * params * batch / step_s}


# %% [markdown]
# ## The workloads

# %%
#| export
def w1_single_stream(loaded: LoadedModel, config: EngineConfig, prompt_len: int = 128, new_tokens: int = 256,
                     repeats: int = 3) -> dict:
    "W1: one request, 128-token prompt, 256 greedy tokens. Decode tok/s, TTFT and bytes read per second."
    engine = LLMEngine(loaded, config)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    prompt = random_prompts(1, prompt_len, prompt_len, seed=1)[0]
    run_batch(engine, [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
    runs = []
    for _ in range(repeats):
        r = run_batch(engine, [prompt], params)
        decode_s = r["wall_s"] - r["ttft_median_s"]
        runs.append({"ttft_s": r["ttft_median_s"], "decode_tok_s": (new_tokens - 1) / decode_s,
                     "kv_used_blocks_after": r["kv_used_blocks_after"],
                     "timeline": step_timeline(r["records"], r["start"], engine)})
    best = sorted(runs, key=lambda x: x["decode_tok_s"])[len(runs) // 2]  # the median run
    step_bytes = weight_bytes(loaded)  # every decode step reads all weights (plus a little KV cache)
    return {"workload": "W1", "prompt_len": prompt_len, "new_tokens": new_tokens, "ttft_s": best["ttft_s"],
            "decode_tok_s": best["decode_tok_s"], "runs": [{k: r[k] for k in ("ttft_s", "decode_tok_s", "kv_used_blocks_after")} for r in runs],
            "weight_bytes": step_bytes, "achieved_bytes_per_s": step_bytes * best["decode_tok_s"],
            "timeline": best["timeline"], "decode_points": [decode_point("W1 batch 1", best["timeline"], loaded, 1)]}


def w2_offline_throughput(loaded: LoadedModel, config: EngineConfig, count: int = 256, min_len: int = 100,
                          max_len: int = 1024, new_tokens: int = 512) -> dict:
    "W2: 256 requests, prompts of 100-1024 random ids (seed 0), 512 tokens each ignoring EOS."
    engine = LLMEngine(loaded, config)
    run_batch(engine, random_prompts(2, 16, 16), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    r = run_batch(engine, random_prompts(count, min_len, max_len, seed=0),
                  SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    timeline = step_timeline(r.pop("records"), r.pop("start"), engine)
    point = decode_point("W2 largest decode batch", timeline, loaded)
    return {"workload": "W2", "new_tokens": new_tokens, "prompt_lens": [min_len, max_len], **r, "timeline": timeline,
            "decode_points": [point] if point else []}


def w4_cpu_classroom(loaded: LoadedModel, config: EngineConfig, concurrency=(1, 8), new_tokens: int = 128) -> dict:
    "W4: a short chat prompt; output tok/s with 1 and with 8 concurrent requests."
    engine = LLMEngine(loaded, config)
    prompt = w4_prompt(loaded)
    run_batch(engine, [prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    result = {"workload": "W4", "new_tokens": new_tokens, "prompt_len": len(prompt), "decode_points": []}
    for n in concurrency:
        r = run_batch(engine, [prompt] * n, params)
        timeline = step_timeline(r["records"], r["start"], engine)
        result[f"concurrency_{n}"] = {k: r[k] for k in ("output_tok_s", "wall_s", "ttft_median_s", "output_tokens",
                                                        "kv_used_blocks_after")}
        result["timeline"] = timeline  # the last (largest) run's
        if point := decode_point(f"W4 {n} at once", timeline, loaded, n): result["decode_points"].append(point)
    return result


def w4_prompt(loaded: LoadedModel) -> list[int]:
    chat = [{"role": "user", "content": "Tell me a story about a lighthouse."}]
    return loaded.tokenizer.encode_chat(chat) if loaded.tokenizer else random_prompts(1, 24, 24)[0]


WORKLOADS = {"w1": w1_single_stream, "w2": w2_offline_throughput, "w4": w4_cpu_classroom}


# %% [markdown]
# ## Ceilings
#
# A figure means little without the ceiling it is measured against, measured on the same
# machine in the same run: `read_bandwidth` times a sum over a large buffer (what a decode
# step must do with the weights), `matmul_flops` a large square matmul in the model's dtype.

# %%
#| export
def read_bandwidth(device, gib: float = 4.0, repeats: int = 10, dtype=torch.bfloat16) -> float:
    "Bytes per second a reduction over a large buffer reads on `device` (the decode ceiling)."
    x = torch.ones(int(gib * 2**30) // torch.finfo(dtype).bits * 8, dtype=dtype, device=device)
    x.sum()
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats): x.sum()
    sync(device)
    return x.nbytes * repeats / (time.perf_counter() - start)


def matmul_flops(device, n: int = 8192, repeats: int = 10, dtype=torch.bfloat16) -> float:
    "FLOP/s of an n × n × n matmul on `device` (the compute ceiling)."
    a = torch.randn(n, n, device=device, dtype=dtype)
    a @ a
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats): a @ a
    sync(device)
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def ceilings(device) -> dict:
    "Both ceilings, sized to the device: a GPU in BF16, a CPU in fp32 (its weights' dtype here) and smaller."
    if torch.device(device).type == "cuda":
        return {"read_bytes_per_s": read_bandwidth(device), "matmul_flops_per_s": matmul_flops(device),
                "dtype": "bfloat16"}
    return {"read_bytes_per_s": read_bandwidth(device, gib=0.5, repeats=5, dtype=torch.float32),
            "matmul_flops_per_s": matmul_flops(device, n=1024, repeats=5, dtype=torch.float32), "dtype": "float32"}


# %%
c = ceilings("cpu")
assert c["read_bytes_per_s"] > 1e8 and c["matmul_flops_per_s"] > 1e8  # any CPU: GB/s and GFLOP/s; 0.1 catches a broken timer
print(f"this CPU: {c['read_bytes_per_s'] / 1e9:.1f} GB/s read, {c['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s fp32 matmul")

# %% [markdown]
# ## A small run
#
# Scaled-down versions on a tiny random model, to show the shape of the results (the figures
# of a tiny model say nothing about a real one).

# %%
from forge_engine.config import preset
from forge_engine.model import empty_model, init_random_weights
tiny = LoadedModel("random:qwen3-tiny", init_random_weights(empty_model(preset("qwen3-tiny")), seed=0), None, None)
config = EngineConfig(kv_cache_bytes=8 * 2**20, max_num_seqs=8, max_num_batched_tokens=256)
w1 = w1_single_stream(tiny, config, prompt_len=16, new_tokens=16, repeats=1)
w2 = w2_offline_throughput(tiny, config, count=8, min_len=4, max_len=32, new_tokens=8)
w4 = w4_cpu_classroom(tiny, config, new_tokens=8)
print({k: v for k, v in w1.items() if k != "timeline"}, {k: v for k, v in w4.items() if k != "timeline"}, sep="\n")
assert w2["output_tokens"] == 8 * 8 and w4["concurrency_8"]["output_tokens"] == 8 * 8
# every run ended with the KV pool free (`run_batch` checks the allocator idle, and says how many blocks are held)
assert w2["kv_used_blocks_after"] == w1["runs"][0]["kv_used_blocks_after"] == w4["concurrency_8"]["kv_used_blocks_after"] == 0

# %% [markdown]
# The timeline is the engine's own record: in W2 the first steps are prompt chunks, then 8
# sequences decode together; the blocks held rise and go back to zero when the last request
# ends.

# %%
t = w2["timeline"]
assert len(t["t_s"]) == len(t["decode_seqs"]) and t["t_s"] == sorted(t["t_s"])
assert t["prefill_tokens"][0] > 0 and max(t["decode_seqs"]) == 8 and t["kv_used_blocks"][-1] == 0
[point] = w2["decode_points"]
assert point["batch"] == 8 and point["flops"] == 2 * model_size(tiny)[0] * 8 and point["bytes_per_s"] > 0
assert w1["decode_points"][0]["batch"] == 1 and [p["batch"] for p in w4["decode_points"]] == [1, 8]

# %% [markdown]
# ## Running a workload from the command line, with its peers
#
# `run_offline` is what `forge-engine bench w1|w2|w4` runs: the workload, then its peers on
# the same weights, then the ratios. The W2 peer can run on the first N prompts only
# (`--peer-num-prompts`; `generate_batch` takes ~4.5 minutes for all of W2 on an H200): then
# forge-engine runs those same N prompts too, and the ratio compares the two on them.

# %%
#| export
W2_ENGINE_DEFAULTS = {"max_num_seqs": 256, "max_num_batched_tokens": 8192}  # W2 wants its 256 requests at once


def engine_config(args, workload: str) -> EngineConfig:
    limits = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
    defaults = W2_ENGINE_DEFAULTS if workload == "w2" else {}
    return EngineConfig(batch_invariant=args.batch_invariant, cuda_graphs=False if args.no_cuda_graphs else None,
                        async_scheduling=args.async_scheduling,
                        tensor_parallel_size=args.tensor_parallel_size, gpu_memory_budget=args.gpu_memory_budget,
                        **{k: v if v is not None else defaults.get(k) for k, v in limits.items()
                           if v is not None or k in defaults})


def free_memory():
    "Give back what freed engines and models held (a GPU's KV pool is most of its memory)."
    gc.unfreeze()  # (an engine froze what was alive when it was built: chapter 08)
    gc.collect()
    if torch.cuda.is_available(): torch.cuda.empty_cache()


def run_offline(workload: str, loaded: LoadedModel, args, ceiling: dict | None) -> dict:
    "One offline workload (w1, w2, w4) with its peers (`args.peers`) and ratios."
    config = engine_config(args, workload)
    sizes = {"count": args.num_prompts if workload == "w2" else None, "new_tokens": args.output_len}
    result = WORKLOADS[workload](loaded, config, **{k: v for k, v in sizes.items() if v is not None})
    param = next(loaded.model.parameters())
    result.update(model=loaded.name, dtype=str(param.dtype).removeprefix("torch."), batch_invariant=args.batch_invariant,
                  quantization=args.quantization,
                  engine_config={k: getattr(config, k) for k in ("max_num_seqs", "max_num_batched_tokens", "block_size",
                                                                 "cuda_graphs", "async_scheduling", "kv_cache_bytes")})
    if param.device.type == "cuda": result["peak_gpu_memory_bytes"] = torch.cuda.max_memory_allocated(param.device)
    if ceiling:
        result["ceilings"] = ceiling
        if "achieved_bytes_per_s" in result:
            result["ratio_to_read_ceiling"] = result["achieved_bytes_per_s"] / ceiling["read_bytes_per_s"]
    if loaded.parallel is not None:  # what the collectives cost per decode step, and their share of it
        from forge_engine.tensor_parallel import tensor_parallel_report
        result["tensor_parallel"] = tensor_parallel_report(loaded, config, result)
    free_memory()  # the engine's KV pool goes before a peer needs the memory
    if args.peers and loaded.parallel is None:  # (the peers run on one GPU)
        from forge_engine.bench_peers import run_peers
        result["peers"] = run_peers(workload, loaded, config, args, result)
    return result


# %% [markdown]
# ## `forge-engine bench`
#
# `bench w1|w2|w3|w4` runs one workload, `bench all` several in one process (W3 first: its
# server process needs the GPU memory the others would hold), `bench plot` draws saved
# results again. With `--out DIR` each result is written as
# `DIR/<hardware>/<workload>-<model>-<version>-<commit>.json` with its plots next to it;
# the JSON also goes to stdout (one workload) and a short summary to stderr.

# %%
#| export
def rate_label(rate) -> str: return "all at once" if rate == "inf" else f"{rate:g} req/s"


def add_arguments(workloads) -> None:
    "The `forge-engine bench` subcommands, on the subparsers `workloads`."
    from forge_engine.cli import add_memory_budget_flag, add_quantization_flag
    from forge_engine import load_client
    runs = [("w1", "single stream"), ("w2", "offline throughput"), ("w3", "online serving against a server started here"),
            ("w4", "CPU classroom: 1 and 8 requests"), ("all", "several workloads in one run (--workloads)")]
    for name, what in runs:
        w = workloads.add_parser(name, help=what)
        w.add_argument("--model", default="auto")
        w.add_argument("--device", default=None)
        w.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
        w.add_argument("--batch-invariant", action="store_true", help="fixed-shape execution (slower, batch-invariant)")
        w.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly on a GPU")
        w.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_const", const=False, default=None,
                       help="read each step's tokens before building the next (chapter 08's overlap off)")
        w.add_argument("--async-scheduling", dest="async_scheduling", action="store_const", const=True,
                       help="overlap steps where it is not the default (the CPU)")
        w.add_argument("--max-num-seqs", type=int, default=None, help="sequences per step at most (EngineConfig)")
        w.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per step at most (EngineConfig)")
        w.add_argument("--num-prompts", type=int, default=None, help="w2: how many requests (default 256)")
        w.add_argument("--output-len", type=int, default=None, help="new tokens per request")
        w.add_argument("--peers", action="store_true", help="also run the transformers peers on the same weights")
        w.add_argument("--peer-output-len", type=int, default=None, help="w1 peers: new tokens (default: --output-len)")
        w.add_argument("--peer-num-prompts", type=int, default=None, help="w2 peer: the first N prompts only")
        w.add_argument("--rates", default="1,4,16,inf", help="w3: request rates, comma-separated (inf: all at once)")
        w.add_argument("--w3-num-prompts", type=int, default=64, help="w3: requests per rate")
        w.add_argument("--w3-max-tokens", type=int, default=128, help="w3: tokens per reply")
        w.add_argument("--prompt-words", type=int, default=64, help="w3: words per prompt")
        w.add_argument("--json", default=None, help="also write the result to this file (one workload)")
        w.add_argument("--tensor-parallel-size", type=int, default=1, help="w1/w2: split the model over this many GPUs")
        add_quantization_flag(w)
        add_memory_budget_flag(w)
        w.add_argument("--out", default="docs/benchmarks" if name == "all" else None,
                       help="save results (and plots) under DIR/<hardware>/" + (" (default docs/benchmarks)" if name == "all" else ""))
        if name == "all":
            w.add_argument("--workloads", default=None, help="comma-separated (default: w1,w2,w3 on a GPU, w3,w4 on a CPU)")
    plot = workloads.add_parser("plot", help="draw the plots of saved results (PNG next to each JSON)")
    plot.add_argument("results", nargs="+", help="result JSON files")
    report = workloads.add_parser("report", help="rewrite the result tables of markdown files from their result files")
    report.add_argument("docs", nargs="+", help="markdown files with '<!-- bench report: GLOB -->' blocks")
    report.add_argument("--check", action="store_true", help="write nothing; exit 1 if a table is stale")
    load_client.add_arguments(workloads.add_parser("serve", help="W3: Poisson load against a running server (--url)"))


def summary_line(result: dict) -> str:
    "One line a person reads first."
    w, peers = result["workload"], result.get("peers", [])
    if w == "W1":
        line = f"W1 {result['decode_tok_s']:.1f} tok/s decode, TTFT {result['ttft_s'] * 1000:.0f} ms"
        if "ratio_to_read_ceiling" in result: line += f", {result['ratio_to_read_ceiling']:.0%} of the read ceiling"
    elif w == "W2":
        line = f"W2 {result['output_tok_s']:.0f} output tok/s ({result['output_tokens']} tokens in {result['wall_s']:.1f} s)"
    elif w == "W4":
        line = "W4 " + ", ".join(f"{k.split('_')[1]} at once: {v['output_tok_s']:.1f} tok/s"
                                 for k, v in result.items() if k.startswith("concurrency_"))
    else:
        line = "W3 " + "; ".join(f"{rate_label(r['rate'])}: {r['output_throughput']:.0f} tok/s, "
                                 f"TTFT p50 {r['ttft_ms']['p50']:.0f} ms" if r["ttft_ms"] else f"{rate_label(r['rate'])}: failed"
                                 for r in result["runs"])
    return line + "".join(f"\n    {p['ratio']:.2f}x {p['peer']}" + (f" batch {p['batch']}" if "batch" in p else "")
                          for p in peers)


def run_from_args(args) -> int:
    "`forge-engine bench w1|w2|w3|w4|all|plot`."
    log = lambda msg: print(msg, file=sys.stderr)
    if args.workload == "plot":
        from forge_engine.bench_plots import save_plots
        for path in save_plots(args.results): print(path)
        return 0
    if args.workload == "report":
        from forge_engine.bench_report import update_report_blocks
        stale = [doc for doc in args.docs if update_report_blocks(doc, check=args.check)]
        for doc in stale: log(f"{doc}: " + ("stale (run without --check)" if args.check else "rewritten"))
        return 1 if args.check and stale else 0
    from forge_engine.cli import pick_model
    from forge_engine.loader import load_model
    args.model, args.device = pick_model(args.model, args.device, log)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.workload == "all":
        default = "w1,w2,w3" if device.type == "cuda" else "w3,w4"
        names = [n.strip() for n in (args.workloads or default).split(",")]
        if bad := [n for n in names if n not in ("w1", "w2", "w3", "w4")]: raise ValueError(f"unknown workload(s) {bad}")
        names.sort(key=lambda n: n != "w3")  # W3 first: its server needs the memory the others would hold
    else:
        names = [args.workload]
    if args.peers and _version("transformers") is None: raise ValueError("--peers needs transformers installed")
    env, results, loaded, ceiling = environment(), [], None, None
    for name in names:
        if name == "w3":
            from forge_engine.bench_server import run_w3
            result = run_w3(args)
        else:
            if loaded is None:
                # the ceilings before the model, their buffers (a 4 GiB read) given back before a memory budget is
                # planned: measured beside the model, the capped W1 run refused with 4.19 GiB held by the allocator
                ceiling = ceilings(device)
                free_memory()
                loaded = load_model(args.model, args.device, args.dtype, progress=False, quantization=args.quantization,
                                    tensor_parallel_size=args.tensor_parallel_size, memory_budget=args.gpu_memory_budget)
            result = run_offline(name, loaded, args, ceiling)
        result["environment"] = env
        results.append(result)
        log(summary_line(result))
    if loaded is not None and loaded.parallel is not None: loaded.parallel.close()
    if len(results) == 1:
        text = json.dumps(results[0], indent=1)
        print(text)
        if args.json:
            with open(args.json, "w") as f: f.write(text + "\n")
    if args.out:
        from forge_engine.bench_plots import save_plots
        paths = [save_result(r, args.out) for r in results]
        for path in paths + save_plots(paths): log(f"wrote {path}")
    return 0


# %% [markdown]
# A run of the command in this process on the tiny model, and its plots drawn from the saved
# files:

# %%
parser = argparse.ArgumentParser()
add_arguments(parser.add_subparsers(dest="workload"))
with tempfile.TemporaryDirectory() as out:
    args = parser.parse_args(["all", "--model", "random:qwen3-tiny", "--device", "cpu", "--workloads", "w4",
                              "--output-len", "8", "--peers", "--out", out])
    assert run_from_args(args) == 0
    [folder] = os.listdir(out)
    files = sorted(os.listdir(os.path.join(out, folder)))
    print(files)
    w4_file = next(os.path.join(out, folder, f) for f in files if f.startswith("w4-") and f.endswith(".json"))
    with open(w4_file) as f: saved = json.load(f)
    assert saved["environment"]["cpu"] == cpu_name() and len(saved["peers"]) == 2 and saved["peers"][0]["ratio"] > 0
    assert [f.split("-")[0] for f in files if f.endswith(".json")] == ["w4"]
    assert any(f.endswith("-timeline.png") for f in files) and any(f.startswith("roofline-") for f in files)
    assert any(f.startswith("w4-") and f.endswith("-throughput.png") for f in files)
    assert all(os.path.getsize(os.path.join(out, folder, f)) > 1000 for f in files)
    with pytest.raises(ValueError, match="unknown workload"):
        run_from_args(parser.parse_args(["all", "--model", "random:qwen3-tiny", "--workloads", "w9"]))

# %% [markdown]
# ## The final run: a real server, a small load, the plots
#
# Everything of the earlier chapters at once. A real `forge-engine serve` process (SmolLM2
# on the CPU; Qwen3-4B where a big enough GPU is) on a free loopback port, a small W3 load
# from the load client at two rates, then the plots, drawn inline. Before the server is
# stopped, its `/metrics` must say it is idle: nothing running or waiting, no KV block held.
# Then it must exit on Ctrl+C, with code 0.

# %%
from forge_engine.bench_plots import plot_latencies, plot_roofline, plot_throughput, plot_timeline
from forge_engine.bench_server import ServerProcess, w3_online_serving
from forge_engine.loader import choose_auto_model
model, device, why = choose_auto_model()
print(f"{model} on {device}: {why}")
server = ServerProcess(model, device)
url = server.start()
print("serving at", url)

# %%
w3 = await w3_online_serving(url, rates=(4.0, math.inf), num_prompts=4, prompt_words=12, max_tokens=8)
w3.update(model=model, environment=environment())
print(summary_line(w3))
idle = server.wait_idle()
exit_code = server.stop()
assert exit_code == 0 and server.process.poll() == 0, server.log_tail()
assert idle["forge_kv_cache_used_blocks"] == 0 and idle["forge_requests_running"] == 0
for run in w3["runs"]:
    assert run["completed"] == 4 and run["failed"] == 0 and run["total_output_tokens"] == 4 * 8
    assert len(run["gauges"]["t_s"]) > 0 and max(run["gauges"]["running"]) >= 1

# %% [markdown]
# What the server did, seen from outside. All at once, every request waits behind the
# prefills queued before it, so TTFT grows, while the server's output tokens per second go
# up with the number of requests in flight; the KV cache fills as the batch grows and is
# empty again at the end.

# %%
import io
from IPython.display import Image, display

def show(fig):
    "A Figure inline, as a PNG (needs no matplotlib backend set up in the notebook)."
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=90)
    display(Image(png.getvalue()))

for fig in (plot_timeline(w3), plot_latencies(w3), plot_throughput(w3)):
    show(fig)

# %% [markdown]
# And the decode steps of the tiny model's W1 and W4 runs above on this CPU's roofline: at
# batch 1 a step is far below the bandwidth roof (a tiny model is all overhead); 8 sequences
# at once move it right, towards more FLOPs per byte.

# %%
for r in (w1, w4): r["ceilings"] = c
show(plot_roofline([w1, w4]))
