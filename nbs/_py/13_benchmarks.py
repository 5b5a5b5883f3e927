# %% [markdown]
# # Benchmarks
#
# > The workloads of `performance.md`, run through the real engine: W1 single stream, W2 offline throughput, W4 CPU classroom.

# %% [markdown]
# A benchmark here is a function that builds an engine, warms it up, runs a named workload and
# returns a dictionary of figures together with the environment it ran in. Nothing here
# asserts a speed: figures are reported, never tested. From a terminal:
#
# ```
# forge-engine bench w4 --model smollm2-135m-instruct --device cpu
# forge-engine bench w1 --model random:qwen3-4b          # on a GPU
# forge-engine bench w2 --model random:qwen3-4b --json w2.json
# ```

# %%
#| default_exp bench

# %%
#| export
from __future__ import annotations

import os
import platform
import random
import subprocess
import time

import torch

import forge_engine
from forge_engine.config import EngineConfig
from forge_engine.engine import LLMEngine
from forge_engine.generate import SamplingParams
from forge_engine.loader import LoadedModel, model_bytes


# %% [markdown]
# ## The environment a figure belongs to

# %%
#| export
def environment() -> dict:
    "What a benchmark figure depends on: hardware, versions, commit."
    env = {"python": platform.python_version(), "torch": torch.__version__, "cpu_threads": torch.get_num_threads(),
           "machine": platform.machine(), "cpu_count": os.cpu_count()}
    if torch.cuda.is_available():
        env.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda)
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        package_dir = os.path.dirname(os.path.abspath(forge_engine.__file__))
        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=package_dir, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["commit"] = None
    return env


# %% [markdown]
# ## Running a batch of requests offline
#
# All requests are queued at once and the engine steps until every one is done; the clock
# runs from the first step to the last output, prompts included.

# %%
#| export
def random_prompts(count: int, min_len: int, max_len: int, vocab_limit: int = 10000, seed: int = 0) -> list[list[int]]:
    "Prompts of random token ids (the nano-vllm workload): lengths uniform in [min_len, max_len]."
    rng = random.Random(seed)
    return [[rng.randrange(vocab_limit) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


def _sync(engine: LLMEngine):
    if engine.device.type == "cuda": torch.cuda.synchronize(engine.device)


def run_batch(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict:
    "Run every prompt to the end; wall time, tokens and per-request first-token latency."
    ids = [engine.add_request(p, params) for p in prompts]
    _sync(engine)
    start, first, finals = time.perf_counter(), {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter() - start)
            if out.finished: finals[out.request_id] = out
    _sync(engine)
    wall = time.perf_counter() - start
    output_tokens = sum(len(finals[i].token_ids) for i in ids)
    ttfts = sorted(first[i] for i in ids)
    return {"requests": len(ids), "prompt_tokens": sum(map(len, prompts)), "output_tokens": output_tokens,
            "wall_s": wall, "output_tok_s": output_tokens / wall, "ttft_median_s": ttfts[len(ttfts) // 2]}


# %% [markdown]
# ## The workloads

# %%
#| export
def weight_bytes(loaded: LoadedModel) -> int:
    return model_bytes(loaded.model)


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
        runs.append({"ttft_s": r["ttft_median_s"], "decode_tok_s": (new_tokens - 1) / decode_s})
    best = sorted(runs, key=lambda x: x["decode_tok_s"])[len(runs) // 2]  # the median run
    step_bytes = weight_bytes(loaded)  # every decode step reads all weights (plus a little KV cache)
    return {"workload": "W1", **best, "runs": runs, "weight_bytes": step_bytes,
            "achieved_bytes_per_s": step_bytes * best["decode_tok_s"]}


def w2_offline_throughput(loaded: LoadedModel, config: EngineConfig, count: int = 256, min_len: int = 100,
                          max_len: int = 1024, new_tokens: int = 512) -> dict:
    "W2: 256 requests, prompts of 100-1024 random ids (seed 0), 512 tokens each ignoring EOS."
    engine = LLMEngine(loaded, config)
    run_batch(engine, random_prompts(2, 16, 16), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    result = run_batch(engine, random_prompts(count, min_len, max_len, seed=0),
                       SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    return {"workload": "W2", **result}


def w4_cpu_classroom(loaded: LoadedModel, config: EngineConfig, concurrency=(1, 8), new_tokens: int = 128) -> dict:
    "W4: a short chat prompt; output tok/s with 1 and with 8 concurrent requests."
    engine = LLMEngine(loaded, config)
    prompt = (loaded.tokenizer.encode_chat([{"role": "user", "content": "Tell me a story about a lighthouse."}])
              if loaded.tokenizer else random_prompts(1, 24, 24)[0])
    run_batch(engine, [prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    results = {}
    for n in concurrency:
        r = run_batch(engine, [prompt] * n, params)
        results[f"concurrency_{n}"] = {"output_tok_s": r["output_tok_s"], "wall_s": r["wall_s"],
                                       "ttft_median_s": r["ttft_median_s"], "output_tokens": r["output_tokens"]}
    return {"workload": "W4", "new_tokens": new_tokens, **results}


WORKLOADS = {"w1": w1_single_stream, "w2": w2_offline_throughput, "w4": w4_cpu_classroom}


# %% [markdown]
# ## Ceilings and peers, in the same run
#
# A figure means little without the ceiling it is measured against and a peer measured on the
# same machine. `read_bandwidth` times a sum over a large buffer (what a decode step must do
# with the weights); `hf_generate_w1` runs Hugging Face `transformers` `generate` on the very
# same weights (copied through `hf_state_dict`) for the W1 request.

# %%
#| export
def read_bandwidth(device, gib: float = 4.0, repeats: int = 10) -> float:
    "Bytes per second a reduction over a large buffer reads on `device` (the decode ceiling)."
    x = torch.ones(int(gib * 2**30) // 2, dtype=torch.bfloat16, device=device)
    x.sum()
    _sync_device(device)
    start = time.perf_counter()
    for _ in range(repeats): x.sum()
    _sync_device(device)
    return x.nbytes * repeats / (time.perf_counter() - start)


def _sync_device(device):
    if torch.device(device).type == "cuda": torch.cuda.synchronize(device)


def hf_generate_w1(loaded: LoadedModel, prompt_len: int = 128, new_tokens: int = 256) -> dict:
    "The W1 request through `transformers` `generate` (dynamic cache, eager) on the same weights: the peer."
    import transformers
    from forge_engine.model import hf_config_dict, hf_state_dict
    config, model = loaded.config, loaded.model
    param = next(model.parameters())
    cls = {"qwen3": "Qwen3", "qwen2": "Qwen2", "llama": "Llama"}[config.architecture]
    hf_config = getattr(transformers, f"{cls}Config")(**hf_config_dict(config))
    with torch.device(param.device):
        hf = getattr(transformers, f"{cls}ForCausalLM")(hf_config).to(param.dtype).eval()
    hf.load_state_dict(hf_state_dict(model), strict=False)  # lm_head is absent when tied
    ids = torch.tensor([random_prompts(1, prompt_len, prompt_len, seed=1)[0]], device=param.device)
    def timed(n):
        _sync_device(param.device)
        start = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        _sync_device(param.device)
        assert out.shape[1] == prompt_len + n
        return time.perf_counter() - start
    timed(4)  # warm-up
    first, total = timed(1), timed(new_tokens)
    del hf
    return {"peer": "transformers generate (dynamic cache, eager)", "transformers": transformers.__version__,
            "ttft_s": first, "decode_tok_s": (new_tokens - 1) / (total - first)}


# %% [markdown]
# ## A small run
#
# The notebook runs scaled-down versions on a tiny random model, to show the shape of the
# results (the figures of a tiny model say nothing about a real one).

# %%
from forge_engine.config import preset
from forge_engine.model import empty_model, init_random_weights
tiny = LoadedModel("random:qwen3-tiny", init_random_weights(empty_model(preset("qwen3-tiny")), seed=0), None, None)
config = EngineConfig(kv_cache_bytes=8 * 2**20, max_num_seqs=8, max_num_batched_tokens=256)
w1 = w1_single_stream(tiny, config, prompt_len=16, new_tokens=16, repeats=1)
peer = hf_generate_w1(tiny, prompt_len=16, new_tokens=8)
assert peer["decode_tok_s"] > 0 and read_bandwidth("cpu", gib=0.125, repeats=2) > 0
w2 = w2_offline_throughput(tiny, config, count=8, min_len=4, max_len=32, new_tokens=8)
w4 = w4_cpu_classroom(tiny, config, new_tokens=8)
print(w1, peer, w2, w4, sep="\n")
assert w2["output_tokens"] == 8 * 8 and w4["concurrency_8"]["output_tokens"] == 8 * 8
assert set(environment()) >= {"torch", "python", "commit"}
