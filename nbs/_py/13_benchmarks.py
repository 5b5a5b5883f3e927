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
# This chapter holds the workloads, the ceilings and the result files, and ends with the final
# run of the course: a real server under load, plotted. It leans on five short chapters filed
# after it, each one module: **13a** the load client (W3 from outside), **13b** the peers
# (`transformers` on the same weights), **13c** the server process W3 runs against, **13d**
# the plots, and **13e** the `forge-engine bench` command that runs them all. Read them when
# this chapter calls them; run this one last.
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
from forge_engine.state_pool import StatePool

# %%
#| hide
import math


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
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def package_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(
            package
        )  # without importing it (triton on a CPU, transformers: slow)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    "What a benchmark figure depends on: hardware, driver, versions, commit, command line."
    env = {
        "forge_engine": forge_engine.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": package_version("triton"),
        "transformers": package_version("transformers"),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "cpu_threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }
    if torch.cuda.is_available():
        driver = _command_output(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        )
        env.update(
            gpu=torch.cuda.get_device_name(0),
            gpu_count=torch.cuda.device_count(),
            cuda=torch.version.cuda,
            driver=driver.splitlines()[0] if driver else None,
        )
    package_dir = os.path.dirname(os.path.abspath(forge_engine.__file__))
    if stated := os.environ.get(
        "FORGE_COMMIT"
    ):  # a tree copied without (or with stale) git metadata says it here
        env["commit"], env["dirty"] = stated.removesuffix("-dirty"), stated.endswith("-dirty")
    else:
        env["commit"] = _command_output(["git", "rev-parse", "--short", "HEAD"], cwd=package_dir)
        if env[
            "commit"
        ]:  # uncommitted changes to tracked files: the commit alone does not say what ran
            env["dirty"] = bool(
                _command_output(
                    ["git", "status", "--porcelain", "--untracked-files=no"], cwd=package_dir
                )
            )
    env["command"] = " ".join(
        [
            "forge-engine" if i == 0 and a.endswith(("forge-engine", "__main__.py")) else a
            for i, a in enumerate(sys.argv)
        ]
    )
    return env


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", re.sub(r"\((r|tm)\)", "", text.lower())).strip("-")


def hardware_slug(env: dict) -> str:
    "The folder of a result: the GPU's name, or the CPU's with its core count."
    return (
        _slug(env["gpu"]) if env.get("gpu") else _slug(f"cpu {env['cpu']} {env['cpu_count']} cores")
    )


def result_stem(result: dict) -> str:
    "`<model>[-<quantization>]-<version>-<commit>`: what a result's file name says after its workload."
    env = result["environment"]
    commit = (env.get("commit") or "nocommit") + ("-dirty" if env.get("dirty") else "")
    weights = "" if result.get("quantization", "none") == "none" else f"-{result['quantization']}"
    return f"{_slug(result['model'])}{weights}-{env['forge_engine']}-{commit}"


def result_path(result: dict, root: str = "docs/benchmarks") -> str:
    "`<root>/<hardware>/<workload>-<model>-<version>-<commit>.json`."
    return os.path.join(
        root,
        hardware_slug(result["environment"]),
        f"{result['workload'].lower()}-{result_stem(result)}.json",
    )


def save_result(result: dict, root: str = "docs/benchmarks") -> str:
    "Write `result` as JSON where `result_path` says; the path."
    path = result_path(result, root)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)  # never a half-written result
    return path


# %%
env = environment()
assert {"torch", "python", "commit", "cpu", "command", "forge_engine"} <= set(env)
assert hardware_slug({"gpu": "NVIDIA H200"}) == "nvidia-h200"
assert (
    hardware_slug({"cpu": "Intel(R) Xeon(R) Processor", "cpu_count": 2})
    == "cpu-intel-xeon-processor-2-cores"
)
fake = {
    "workload": "W1",
    "model": "random:qwen3-4b",
    "environment": {
        "gpu": "NVIDIA H200",
        "forge_engine": "0.1.0",
        "commit": "abc1234",
        "dirty": True,
    },
}
assert result_path(fake, "out") == os.path.join(
    "out", "nvidia-h200", "w1-random-qwen3-4b-0.1.0-abc1234-dirty.json"
)
assert result_path({**fake, "quantization": "int4"}, "out").endswith(
    "w1-random-qwen3-4b-int4-0.1.0-abc1234-dirty.json"
)
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
def random_prompts(
    count: int, min_len: int, max_len: int, vocab_limit: int = 10000, seed: int = 0
) -> list[list[int]]:
    "Prompts of random token ids (the nano-vllm workload): lengths uniform in [min_len, max_len]."
    rng = random.Random(seed)
    return [
        [rng.randrange(vocab_limit) for _ in range(rng.randint(min_len, max_len))]
        for _ in range(count)
    ]


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def run_batch(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict:
    "Run every prompt to the end: wall time, tokens, per-request first-token latency and the engine's step records."
    ids = [engine.add_request(p, params) for p in prompts]
    sync(engine.device)
    start, first, finals, records = time.perf_counter(), {}, {}, []
    while engine.has_unfinished():
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter() - start)
            if out.finished:
                finals[out.request_id] = out
        if engine.recent and (not records or engine.recent[-1].index != records[-1].index):
            records.append(engine.recent[-1])
    sync(engine.device)
    wall = time.perf_counter() - start
    engine.allocator.check_idle()  # every run ends with the KV pool free (cached prefixes count as free), or fails here
    output_tokens = sum(len(finals[i].token_ids) for i in ids)
    ttfts = sorted(first[i] for i in ids)
    return {
        "requests": len(ids),
        "prompt_tokens": sum(map(len, prompts)),
        "output_tokens": output_tokens,
        "wall_s": wall,
        "output_tok_s": output_tokens / wall,
        "ttft_median_s": ttfts[len(ttfts) // 2],
        "kv_used_blocks_after": engine.allocator.stats().used_blocks,
        "token_ids": [finals[i].token_ids for i in ids],
        "records": records,
        "start": start,
    }


def free_memory():
    "Give back what freed engines and models held (a GPU's KV pool is most of its memory)."
    gc.unfreeze()  # (an engine froze what was alive when it was built: chapter 08)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def step_timeline(records: list[StepRecord], start: float, engine: LLMEngine) -> dict:
    "The step records as columns (seconds since `start`), with what is needed to read KV usage as bytes."
    cache = engine.cache
    return {
        "t_s": [r.ended_at - start for r in records],
        "step_s": [r.seconds for r in records],
        "prefill_tokens": [r.prefill_tokens for r in records],
        "decode_seqs": [r.decode_seqs for r in records],
        "kv_used_blocks": [r.kv_used_blocks for r in records],
        "kv_total_blocks": engine.allocator.num_blocks,
        "kv_bytes_per_block": PagedKVCache.bytes_per_block(
            engine.loaded.config, engine.config.block_size, cache.k_cache.dtype
        ),
    }


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
    from forge_engine.quant.layers import QuantLinear  # (its weights are buffers, not parameters)

    params = sum(p.numel() for p in loaded.model.parameters())
    params += sum(
        m.in_features * m.out_features for m in loaded.model.modules() if isinstance(m, QuantLinear)
    )
    return params, model_bytes(loaded.model)


def weight_bytes(loaded: LoadedModel) -> int:
    return model_size(loaded)[1]


def decode_point(
    label: str, timeline: dict, loaded: LoadedModel, batch: int | None = None
) -> dict | None:
    "The median pure-decode step with `batch` sequences (default: the largest batch seen): time, bytes read, FLOPs."
    decode = [
        i
        for i, (p, d) in enumerate(zip(timeline["prefill_tokens"], timeline["decode_seqs"]))
        if p == 0 and d > 0
    ]
    if not decode:
        return None
    batch = batch or max(timeline["decode_seqs"][i] for i in decode)
    steps = sorted(
        (timeline["step_s"][i], timeline["kv_used_blocks"][i])
        for i in decode
        if timeline["decode_seqs"][i] == batch
    )
    if not steps:
        return None
    step_s, kv_blocks = steps[len(steps) // 2]
    params, weights = model_size(loaded)
    kv = (
        kv_blocks * timeline["kv_bytes_per_block"]
    )  # every held block is read (a slight overcount: last blocks are partial)
    return {
        "label": label,
        "batch": batch,
        "steps": len(steps),
        "step_s": step_s,
        "weight_bytes": weights,
        "kv_bytes": kv,
        "flops": 2 * params * batch,
        "bytes_per_s": (weights + kv) / step_s,
        "flops_per_s": 2 * params * batch / step_s,
    }


# %% [markdown]
# ## The workloads

# %%
#| export
def w1_single_stream(
    loaded: LoadedModel,
    config: EngineConfig,
    prompt_len: int = 128,
    new_tokens: int = 256,
    repeats: int = 3,
) -> dict:
    "W1: one request, 128-token prompt, 256 greedy tokens. Decode tok/s, TTFT and bytes read per second."
    engine = LLMEngine(loaded, config)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    prompt = random_prompts(1, prompt_len, prompt_len, seed=1)[0]
    run_batch(
        engine, [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )  # warm-up
    runs = []
    for _ in range(repeats):
        r = run_batch(engine, [prompt], params)
        decode_s = r["wall_s"] - r["ttft_median_s"]
        runs.append(
            {
                "ttft_s": r["ttft_median_s"],
                "decode_tok_s": (new_tokens - 1) / decode_s,
                "kv_used_blocks_after": r["kv_used_blocks_after"],
                "timeline": step_timeline(r["records"], r["start"], engine),
            }
        )
    best = sorted(runs, key=lambda x: x["decode_tok_s"])[len(runs) // 2]  # the median run
    # every decode step reads all weights (plus a little KV cache); with recurrent layers (chapter 03b) it also reads
    # and writes the sequence's state (chapter 05a)
    weights, state = weight_bytes(loaded), 0
    if loaded.config.linear_layers:
        state = 2 * StatePool.bytes_per_slot(loaded.config, next(loaded.model.parameters()).dtype)
    return {
        "workload": "W1",
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "ttft_s": best["ttft_s"],
        "decode_tok_s": best["decode_tok_s"],
        "runs": [
            {k: r[k] for k in ("ttft_s", "decode_tok_s", "kv_used_blocks_after")} for r in runs
        ],
        "weight_bytes": weights,
        **({"state_bytes_per_step": state} if state else {}),
        "achieved_bytes_per_s": (weights + state) * best["decode_tok_s"],
        "timeline": best["timeline"],
        "decode_points": [decode_point("W1 batch 1", best["timeline"], loaded, 1)],
    }


def w2_offline_throughput(
    loaded: LoadedModel,
    config: EngineConfig,
    count: int = 256,
    min_len: int = 100,
    max_len: int = 1024,
    new_tokens: int = 512,
) -> dict:
    "W2: 256 requests, prompts of 100-1024 random ids (seed 0), 512 tokens each ignoring EOS."
    engine = LLMEngine(loaded, config)
    run_batch(
        engine,
        random_prompts(2, 16, 16),
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
    )
    r = run_batch(
        engine,
        random_prompts(count, min_len, max_len, seed=0),
        SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True),
    )
    timeline = step_timeline(r.pop("records"), r.pop("start"), engine)
    del r["token_ids"]
    point = decode_point("W2 largest decode batch", timeline, loaded)
    return {
        "workload": "W2",
        "new_tokens": new_tokens,
        "prompt_lens": [min_len, max_len],
        **r,
        "timeline": timeline,
        "decode_points": [point] if point else [],
    }


def w4_cpu_classroom(
    loaded: LoadedModel,
    config: EngineConfig,
    concurrency=(1, 8),
    new_tokens: int = 128,
    repeats: int = 3,
) -> dict:
    """W4: a short chat prompt; output tok/s with 1 and with 8 concurrent requests, each the fastest of `repeats`
    runs, as llama.cpp's is timed: on a shared CPU one stall of the machine does not decide a figure."""
    engine = LLMEngine(loaded, config)
    prompt = w4_prompt(loaded)
    run_batch(
        engine, [prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    )  # warm-up
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    result = {
        "workload": "W4",
        "new_tokens": new_tokens,
        "prompt_len": len(prompt),
        "repeats": repeats,
        "decode_points": [],
    }
    for n in concurrency:
        runs = [run_batch(engine, [prompt] * n, params) for _ in range(repeats)]
        r = max(runs, key=lambda run: run["output_tok_s"])
        timeline = step_timeline(r["records"], r["start"], engine)
        result[f"concurrency_{n}"] = {
            k: r[k]
            for k in (
                "output_tok_s",
                "wall_s",
                "ttft_median_s",
                "output_tokens",
                "kv_used_blocks_after",
            )
        } | {"output_tok_s_runs": [run["output_tok_s"] for run in runs]}
        if n == 1:  # what a peer's greedy tokens are compared with
            result["token_ids"] = r["token_ids"][0]
        result["timeline"] = timeline  # the last (largest) run's
        if point := decode_point(f"W4 {n} at once", timeline, loaded, n):
            result["decode_points"].append(point)
    return result


def w4_prompt(loaded: LoadedModel) -> list[int]:
    chat = [{"role": "user", "content": "Tell me a story about a lighthouse."}]
    return loaded.tokenizer.encode_chat(chat) if loaded.tokenizer else random_prompts(1, 24, 24)[0]


W5_DRAFTS = 3  # draft tokens when the run does not say (`--speculative-tokens`)


def w5_speculative(
    loaded: LoadedModel, config: EngineConfig, new_tokens: int = 160, repeats: int = 3
) -> dict:
    """W5: speculative decoding by prompt lookup (chapter 08c) against none, in one run: one request to rewrite a
    given text, greedy, batch 1. Decode tok/s of each, in interleaved rounds, the median; the acceptance counts; and
    the check that speculation left every token as it was (a RuntimeError otherwise)."""
    drafts = config.speculative_tokens or W5_DRAFTS
    prompt = w5_prompt(loaded)
    engines = {
        k: LLMEngine(loaded, config.replace(speculative_tokens=k, max_num_seqs=1))
        for k in (0, drafts)
    }
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for engine in engines.values():
        run_batch(engine, [prompt], warm)
    params = SamplingParams(temperature=0, max_tokens=new_tokens)
    rates, tokens = {k: [] for k in engines}, {}
    for _ in range(repeats):
        for k, engine in engines.items():
            r = run_batch(engine, [prompt], params)
            rates[k].append((r["output_tokens"] - 1) / (r["wall_s"] - r["ttft_median_s"]))
            if (
                tokens.setdefault(k, r["token_ids"][0]) != r["token_ids"][0]
                or r["token_ids"][0] != tokens[0]
            ):
                raise RuntimeError(f"W5: speculation with {k} drafts changed the greedy tokens")
    counts = engines[drafts].stats().speculation
    median = {k: sorted(v)[len(v) // 2] for k, v in rates.items()}
    return {
        "workload": "W5",
        "speculative_tokens": drafts,
        "prompt_len": len(prompt),
        "new_tokens": new_tokens,
        "output_tokens": len(tokens[0]),
        "repeats": repeats,
        "off_decode_tok_s": median[0],
        "on_decode_tok_s": median[drafts],
        "speedup": median[drafts] / median[0],
        "off_runs": rates[0],
        "on_runs": rates[drafts],
        "acceptance_rate": counts.acceptance_rate,
        "mean_accepted_length": counts.mean_accepted_length,
        "proposed": counts.proposed,
        "accepted": counts.accepted,
        "verify_steps": counts.verified,
        "same_tokens": True,
        "token_ids": tokens[0],
    }


def w5_prompt(loaded: LoadedModel) -> list[int]:
    "A request to rewrite a given text (chapter 10e's fixed text): the output copies much of its input."
    from forge_engine.quant.layers import FIXED_TEXT

    text = FIXED_TEXT[:900]
    if loaded.tokenizer is None:  # a random model: a random passage, given twice
        passage = random_prompts(1, 100, 100, seed=5)[0]
        return passage + passage
    return loaded.tokenizer.encode_chat(
        [{"role": "user", "content": f"Rewrite this text:\n\n{text}"}]
    )


WORKLOADS = {
    "w1": w1_single_stream,
    "w2": w2_offline_throughput,
    "w4": w4_cpu_classroom,
    "w5": w5_speculative,
}


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
    for _ in range(repeats):
        x.sum()
    sync(device)
    return x.nbytes * repeats / (time.perf_counter() - start)


def matmul_flops(device, n: int = 8192, repeats: int = 10, dtype=torch.bfloat16) -> float:
    "FLOP/s of an n × n × n matmul on `device` (the compute ceiling)."
    a = torch.randn(n, n, device=device, dtype=dtype)
    a @ a
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ a
    sync(device)
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def ceilings(device) -> dict:
    "Both ceilings, sized to the device: a GPU in BF16, a CPU in fp32 (its weights' dtype here) and smaller."
    if torch.device(device).type == "cuda":
        return {
            "read_bytes_per_s": read_bandwidth(device),
            "matmul_flops_per_s": matmul_flops(device),
            "dtype": "bfloat16",
        }
    return {
        "read_bytes_per_s": read_bandwidth(device, gib=0.5, repeats=5, dtype=torch.float32),
        "matmul_flops_per_s": matmul_flops(device, n=1024, repeats=5, dtype=torch.float32),
        "dtype": "float32",
    }


# %%
c = ceilings("cpu")
assert (
    c["read_bytes_per_s"] > 1e8 and c["matmul_flops_per_s"] > 1e8
)  # any CPU: GB/s and GFLOP/s; 0.1 catches a broken timer
print(
    f"this CPU: {c['read_bytes_per_s'] / 1e9:.1f} GB/s read, {c['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s fp32 matmul"
)

# %% [markdown]
# ## A small run
#
# Scaled-down versions on a tiny random model, to show the shape of the results (the figures
# of a tiny model say nothing about a real one).

# %%
from forge_engine.config import preset
from forge_engine.model import empty_model, init_random_weights

tiny = LoadedModel(
    "random:qwen3-tiny", init_random_weights(empty_model(preset("qwen3-tiny")), seed=0), None, None
)
config = EngineConfig(kv_cache_bytes=8 * 2**20, max_num_seqs=8, max_num_batched_tokens=256)
w1 = w1_single_stream(tiny, config, prompt_len=16, new_tokens=16, repeats=1)
w2 = w2_offline_throughput(tiny, config, count=8, min_len=4, max_len=32, new_tokens=8)
w4 = w4_cpu_classroom(tiny, config, new_tokens=8)
print(
    {k: v for k, v in w1.items() if k != "timeline"},
    {k: v for k, v in w4.items() if k != "timeline"},
    sep="\n",
)
assert w2["output_tokens"] == 8 * 8 and w4["concurrency_8"]["output_tokens"] == 8 * 8
assert len(w4["token_ids"]) == 8 and "token_ids" not in w2  # (W4's one request: what peers match)
runs_1 = w4["concurrency_1"]["output_tok_s_runs"]  # W4 keeps the fastest of its 3 runs
assert len(runs_1) == 3 and w4["concurrency_1"]["output_tok_s"] == max(runs_1)
# every run ended with the KV pool free (`run_batch` checks the allocator idle, and says how many blocks are held)
assert (
    w2["kv_used_blocks_after"]
    == w1["runs"][0]["kv_used_blocks_after"]
    == w4["concurrency_8"]["kv_used_blocks_after"]
    == 0
)

# %% [markdown]
# W1 on a tiny Qwen3.5 (chapter 03b): each decode step also reads and writes the sequence's
# recurrent state (chapter 05a), which the bytes per step count beside the weights.

# %%
from forge_engine.qwen3_5 import QWEN35_PRESETS, Qwen35Model, init_random_qwen35

hybrid = LoadedModel(  # (the real vocabulary: the workload's prompts are ids of a real tokenizer's range)
    "random:qwen3.5-tiny",
    init_random_qwen35(Qwen35Model(QWEN35_PRESETS["qwen3.5-tiny"]), seed=0),
    None,
    None,
)
w1_hybrid = w1_single_stream(hybrid, config, prompt_len=16, new_tokens=8, repeats=1)
state = (
    2 * 3 * (3 * 128 + 4 * 16 * 16) * 4
)  # read and written: 3 linear layers' conv and memory, fp32
assert w1_hybrid["state_bytes_per_step"] == state and w1_hybrid["weight_bytes"] == model_bytes(
    hybrid.model
)
assert (
    w1_hybrid["achieved_bytes_per_s"]
    == (model_bytes(hybrid.model) + state) * w1_hybrid["decode_tok_s"]
)

# %% [markdown]
# W5 on the tiny model (no tokenizer: a random passage given twice): speculation and none side by
# side, the same tokens (the workload raises otherwise), and what the drafts did.

# %%
w5 = w5_speculative(tiny, config, new_tokens=24, repeats=1)
assert w5["same_tokens"] and w5["output_tokens"] == 24 and w5["speculative_tokens"] == W5_DRAFTS
assert w5["speedup"] == w5["on_decode_tok_s"] / w5["off_decode_tok_s"] > 0
assert 0 <= w5["accepted"] <= w5["proposed"] and w5["verify_steps"] > 0
print({k: v for k, v in w5.items() if k != "token_ids"})

# %% [markdown]
# The timeline is the engine's own record: in W2 the first steps are prompt chunks, then 8
# sequences decode together; the blocks held rise and go back to zero when the last request
# ends.

# %%
t = w2["timeline"]
assert len(t["t_s"]) == len(t["decode_seqs"]) and t["t_s"] == sorted(t["t_s"])
assert t["prefill_tokens"][0] > 0 and max(t["decode_seqs"]) == 8 and t["kv_used_blocks"][-1] == 0
[point] = w2["decode_points"]
assert (
    point["batch"] == 8
    and point["flops"] == 2 * model_size(tiny)[0] * 8
    and point["bytes_per_s"] > 0
)
assert w1["decode_points"][0]["batch"] == 1 and [p["batch"] for p in w4["decode_points"]] == [1, 8]


# %% [markdown]
# ## A result in one line
#
# What a person reads first: the headline figure of each workload, then each peer's ratio.
# (The command that runs the workloads from a terminal, with their peers, is chapter 13e.)

# %%
#| export
def rate_label(rate) -> str:
    return "all at once" if rate == "inf" else f"{rate:g} req/s"


def summary_line(result: dict) -> str:
    "One line a person reads first."
    w, peers = result["workload"], result.get("peers", [])
    if w == "W1":
        line = (
            f"W1 {result['decode_tok_s']:.1f} tok/s decode, TTFT {result['ttft_s'] * 1000:.0f} ms"
        )
        if "ratio_to_read_ceiling" in result:
            line += f", {result['ratio_to_read_ceiling']:.0%} of the read ceiling"
    elif w == "W2":
        line = f"W2 {result['output_tok_s']:.0f} output tok/s ({result['output_tokens']} tokens in {result['wall_s']:.1f} s)"
    elif w == "W4":
        line = "W4 " + ", ".join(
            f"{k.split('_')[1]} at once: {v['output_tok_s']:.1f} tok/s"
            for k, v in result.items()
            if k.startswith("concurrency_")
        )
    elif w == "W5":
        line = (
            f"W5 {result['on_decode_tok_s']:.1f} tok/s with {result['speculative_tokens']} drafts, "
            f"{result['off_decode_tok_s']:.1f} without ({result['speedup']:.2f}x); acceptance "
            f"{result['acceptance_rate']:.0%}, {result['mean_accepted_length']:.2f} tokens a verify step"
        )
    else:
        line = "W3 " + "; ".join(
            f"{rate_label(r['rate'])}: {r['output_throughput']:.0f} tok/s, "
            f"TTFT p50 {r['ttft_ms']['p50']:.0f} ms"
            if r["ttft_ms"]
            else f"{rate_label(r['rate'])}: failed"
            for r in result["runs"]
        )
    return (
        line
        + "".join(
            f"\n    {p['ratio']:.2f}x {p['peer']}"
            + (f" batch {p['batch']}" if "batch" in p else "")
            for p in peers
        )
        + "".join(f"\n    skipped {p['peer']}: {p['why']}" for p in result.get("peers_skipped", []))
    )


# %%
print(summary_line(w1), summary_line(w4), sep="\n")
assert summary_line(w1).startswith("W1 ") and summary_line(w4).startswith("W4 1 at once: ")
assert summary_line({**w2, "peers": [{"peer": "p", "ratio": 2.0}]}).endswith("\n    2.00x p")
assert summary_line({**w4, "peers_skipped": [{"peer": "q", "why": "not here"}]}).endswith(
    "\n    skipped q: not here"
)

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
w3 = await w3_online_serving(
    url, rates=(4.0, math.inf), num_prompts=4, prompt_words=12, max_tokens=64
)  # (long enough that the gauges, read every 0.25 s, see the requests running)
w3.update(model=model, environment=environment())
print(summary_line(w3))
idle = server.wait_idle()
exit_code = server.stop()
assert exit_code == 0 and server.process.poll() == 0, server.log_tail()
assert idle["forge_kv_cache_used_blocks"] == 0 and idle["forge_requests_running"] == 0
for run in w3["runs"]:
    assert run["completed"] == 4 and run["failed"] == 0 and run["total_output_tokens"] == 4 * 64
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
for r in (w1, w4):
    r["ceilings"] = c
show(plot_roofline([w1, w4]))
