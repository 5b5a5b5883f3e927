# %% [markdown]
# # Peers
#
# > `transformers` on the same weights, llama.cpp on the same GGUF file: what chapter 13 divides by.

# %%
#| default_exp bench_peers

# %% [markdown]
# A figure of our engine means little alone: on the same GPU, with the same weights, how
# fast is the library everyone uses? Hugging Face `transformers` runs the very same weights (copied through `hf_state_dict`):
#
# - W1: `generate`, once with its dynamic cache (eager) and once with its static cache (which
#   it compiles on a GPU). Warmed up with the same request first, so compiling is not timed.
# - W2: `generate_batch`, its continuous-batching engine (paged KV cache, CUDA graphs), on the
#   same prompts, with EOS disabled as in W2. Its own warm-up happens inside each call.
# - W4: `generate` on the CPU with 1 and with 8 copies of the prompt (no padding needed).
#
# `generate` is timed from inside one call: a streamer (`TokenClock`) notes when each new token reaches
# the host, so TTFT and the decode rate come from the same run. (Subtracting a 1-token call from an
# n-token call, as an earlier version did, could come out negative on a busy machine.)
#
# On a GGUF file W4 has a second peer: llama.cpp itself, the engine such a file is made for
# (below, "llama.cpp on the same file").
#
# Each peer result carries the ratio forge-engine / peer. This module is imported only when
# peers run (it imports `transformers`); `forge-engine bench ... --peers` runs it (chapter 13).

# %%
#| export
from __future__ import annotations

import inspect
import json
import subprocess
import sys
import textwrap
import time

import torch

from forge_engine.bench import free_memory, random_prompts, run_batch, sync, w4_prompt
from forge_engine.config import EngineConfig
from forge_engine.engine import LLMEngine
from forge_engine.generate import SamplingParams
from forge_engine.loader import LoadedModel
from forge_engine.registry import resolve

# %%
#| hide
import argparse
import importlib.util
import os

import pytest

from forge_engine.config import preset
from forge_engine.model import empty_model, init_random_weights


# %%
#| export
def hf_twin(loaded: LoadedModel):
    "A `transformers` model of the same architecture holding the same weights, on the same device and dtype."
    import transformers
    from forge_engine.model import hf_config_dict, hf_state_dict

    config, model = loaded.config, loaded.model
    param = next(model.parameters())
    cls = {"qwen3": "Qwen3", "qwen2": "Qwen2", "llama": "Llama"}[config.architecture]
    hf_config = getattr(transformers, f"{cls}Config")(
        **hf_config_dict(config), attn_implementation="sdpa"
    )
    with torch.device(param.device):
        hf = getattr(transformers, f"{cls}ForCausalLM")(hf_config).to(param.dtype).eval()
    hf.load_state_dict(hf_state_dict(model), strict=False)  # lm_head is absent when tied
    return hf


class TokenClock:
    "A `generate` streamer that notes when each `put` arrives: the prompt first, then each new token once it is on the host."

    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def hf_generate(hf, prompts: list[list[int]], new_tokens: int, cache: str = "dynamic") -> dict:
    "`generate` on equal-length prompts, greedy, exactly `new_tokens` each: TTFT and decode tok/s of the batch."
    import transformers

    if len({len(p) for p in prompts}) != 1:
        raise ValueError("hf_generate takes prompts of one length (no padding)")
    if new_tokens < 2:
        raise ValueError(f"hf_generate needs new_tokens >= 2 to time decoding, got {new_tokens}")
    device = next(hf.parameters()).device
    ids = torch.tensor(prompts, device=device)
    extra = {"cache_implementation": "static"} if cache == "static" else {}

    def timed() -> tuple[float, float, float]:
        "One call: (TTFT, decode seconds after the first token, total), all from one clock inside the call."
        clock = TokenClock()
        sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                streamer=clock,
                **extra,
            )
        sync(device)
        total = time.perf_counter() - start
        assert out.shape == (len(prompts), len(prompts[0]) + new_tokens), out.shape
        if len(clock.times) != new_tokens + 1:
            raise RuntimeError(
                f"generate streamed {len(clock.times)} puts, expected the prompt + {new_tokens} tokens"
            )
        return clock.times[1] - start, clock.times[-1] - clock.times[1], total

    timed()  # warm-up with the same length (a static cache is compiled for it)
    runs = [
        timed()
    ]  # the fastest decode of up to 3 calls (while they are short): one stall does not decide it
    while len(runs) < 3 and runs[-1][2] < 1.0:
        runs.append(timed())
    ttft, decode, total = min(runs, key=lambda r: r[1])
    return {
        "peer": f"transformers generate ({cache} cache)",
        "transformers": transformers.__version__,
        "batch": len(prompts),
        "new_tokens": new_tokens,
        "ttft_s": ttft,
        "decode_tok_s": len(prompts) * (new_tokens - 1) / decode,
        "output_tok_s": len(prompts) * new_tokens / total,
    }


def hf_generate_batch(
    hf, prompts: list[list[int]], new_tokens: int, cache_sizes: dict | None = None
) -> dict:
    "`generate_batch` (transformers' continuous batching) on `prompts`, greedy, EOS off: output tok/s."
    import transformers
    from transformers import GenerationConfig

    device = next(hf.parameters()).device
    # its own sizing unless told (`ContinuousBatchingConfig` fields, e.g. num_blocks, max_batch_tokens)
    options = {}
    if cache_sizes:
        from transformers.generation import ContinuousBatchingConfig

        options["continuous_batching_config"] = ContinuousBatchingConfig(**cache_sizes)
    config = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1
    )  # -1: no EOS, as W2
    hf.generate_batch(
        prompts[:2],
        generation_config=GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1),
        progress_bar=False,
        **options,
    )  # warm-up: kernels loaded, allocator primed
    sync(device)
    start = time.perf_counter()
    outputs = hf.generate_batch(prompts, generation_config=config, progress_bar=False, **options)
    sync(device)
    wall = time.perf_counter() - start
    tokens = [
        len(o.generated_tokens) for o in outputs.values() if getattr(o, "error", None) is None
    ]
    if len(tokens) != len(prompts):
        raise RuntimeError(f"generate_batch finished {len(tokens)} of {len(prompts)} requests")
    return {
        "peer": "transformers generate_batch (continuous batching)",
        "transformers": transformers.__version__,
        "cache_sizes": cache_sizes,
        "requests": len(prompts),
        "output_tokens": sum(tokens),
        "wall_s": wall,
        "output_tok_s": sum(tokens) / wall,
    }


# %% [markdown]
# ## llama.cpp on the same file
#
# A GGUF file is llama.cpp's format, and llama.cpp is what a student would otherwise run on a
# laptop. Through its Python binding (`llama-cpp-python`) it runs the very file forge-engine
# loaded, on the same prompt ids, with as many threads as PyTorch uses here, greedy, batch 1,
# for the same number of new tokens, EOS ignored: a warm-up, then the fastest of three runs,
# each evaluating the prompt again (`reset`: no reuse of the previous run's cache).
#
# It runs in a process of its own (`in_own_process`): two engines in one process would share
# its memory and each leave its threads behind for the other. The child gets only the source
# of the function it runs, so it imports neither torch nor forge-engine, and `llama_cpp` is
# imported there and nowhere else. Without `llama_cpp` the peer is skipped, and the result
# says so and how to install it; it is not a dependency of forge-engine. Its greedy tokens are
# compared with forge-engine's: how many of the first ones agree (the two round differently,
# so a near tie can part them).

# %%
#| export
LLAMA_CPP_INSTALL = (
    "pip install llama-cpp-python==0.3.36 "
    "(it builds llama.cpp from source for this CPU's own instructions: a few minutes)"
)


def in_own_process(fn, timeout: float = 1200, **kwargs) -> dict:
    """`fn(**kwargs)` in a new process of this Python, from `fn`'s source alone: `fn` imports what
    it needs inside and returns what JSON holds. The child imports nothing of this process (no
    torch, no forge-engine)."""
    code = "\n".join(
        [
            "import json, sys",
            textwrap.dedent(inspect.getsource(fn)),
            f"print(json.dumps({fn.__name__}(**json.loads(sys.argv[1]))))",
        ]
    )
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(kwargs)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"{fn.__name__} failed in its own process (exit {done.returncode}): "
            + done.stderr[-2000:]
        )
    return json.loads(done.stdout.splitlines()[-1])


def llama_cpp_generate(path: str, prompt: list, new_tokens: int, threads: int) -> dict:
    """llama.cpp on the GGUF file `path`: greedy, exactly `new_tokens` after `prompt` (EOS
    ignored), batch 1, on `threads` threads; the fastest of 3 runs after a warm-up. For
    `in_own_process`: imports inside, JSON out; {"missing": why} when `llama_cpp` cannot be
    imported. With the 1-minute load average before and after: on a busy machine its threads
    wait for each other at every barrier, and its figure drops by several times."""
    import os
    import time

    try:
        import llama_cpp
    except ImportError as e:
        return {"missing": f"{type(e).__name__}: {e}"}
    llm = llama_cpp.Llama(
        model_path=path,
        n_ctx=len(prompt) + new_tokens,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )

    def run():
        "One request: its tokens, and the clock at its start and as each token arrived."
        llm.reset()  # the prompt is evaluated again, as forge-engine does for each request
        tokens, times = [], [time.perf_counter()]
        for token in llm.generate(prompt, temp=0.0, reset=True):
            tokens.append(token)
            times.append(time.perf_counter())
            if len(tokens) == new_tokens:
                break
        return tokens, times

    load_before = os.getloadavg()[0]
    run()  # warm-up
    tokens, times = min((run() for _ in range(3)), key=lambda r: r[1][-1] - r[1][0])
    return {
        "peer": "llama.cpp",
        "llama_cpp_python": llama_cpp.__version__,
        "cpu_features": llama_cpp.llama_print_system_info().decode().strip(),
        "threads": threads,
        "batch": 1,
        "new_tokens": new_tokens,
        "ttft_s": times[1] - times[0],
        "decode_tok_s": (new_tokens - 1) / (times[-1] - times[1]),
        "output_tok_s": new_tokens / (times[-1] - times[0]),
        "token_ids": tokens,
        "load_average_1m": [load_before, os.getloadavg()[0]],
    }


def llama_cpp_peer(path, prompt: list[int], result: dict, generate=llama_cpp_generate) -> dict:
    """W4's llama.cpp peer on the GGUF file `path`, in its own process, with the ratios
    forge-engine / llama.cpp at one request (output tok/s, the W4 figure; and decode tok/s), or
    {"peer", "why"} when it could not run."""
    ours = result["concurrency_1"]
    try:
        peer = in_own_process(
            generate,
            path=str(path),
            prompt=prompt,
            new_tokens=result["new_tokens"],
            threads=torch.get_num_threads(),
        )
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        return {"peer": "llama.cpp", "why": f"it failed: {e}"}
    if "missing" in peer:
        return {
            "peer": "llama.cpp",
            "why": f"llama_cpp cannot be imported ({peer['missing']}); to compare with llama.cpp: "
            + LLAMA_CPP_INSTALL,
        }
    theirs, mine = peer.pop("token_ids"), result.get("token_ids", [])
    agree = next(
        (i for i, (a, b) in enumerate(zip(theirs, mine)) if a != b), min(len(theirs), len(mine))
    )
    our_decode = (ours["output_tokens"] - 1) / (ours["wall_s"] - ours["ttft_median_s"])
    return {
        **peer,
        "same_greedy_tokens": agree,
        "forge_engine_decode_tok_s": our_decode,
        "decode_ratio": our_decode / peer["decode_tok_s"],
        "ratio": ours["output_tok_s"] / peer["output_tok_s"],
    }


# %% [markdown]
# The child is another process, runs only the function it was given, and imports no torch:

# %%
def whoami(tag: str) -> dict:
    import os
    import sys

    return {"pid": os.getpid(), "tag": tag, "torch_imported": "torch" in sys.modules}


child = in_own_process(whoami, tag="x")
assert child == {"pid": child["pid"], "tag": "x", "torch_imported": False}
assert child["pid"] != os.getpid()

# %% [markdown]
# The peer's result and its ratios, from a stand-in for llama.cpp run the same way: forge-engine
# made 40 output tok/s at one request (4 tokens in 0.1 s, the first after 25 ms, so 3 decode
# tokens in 75 ms), the stand-in 50 and 60 decode tok/s; it agrees on the first 2 tokens.

# %%
w4_like = {
    "new_tokens": 4,
    "token_ids": [5, 6, 7, 8],
    "concurrency_1": {
        "output_tok_s": 40.0,
        "output_tokens": 4,
        "wall_s": 0.1,
        "ttft_median_s": 0.025,
    },
}


def stand_in(path: str, prompt: list, new_tokens: int, threads: int) -> dict:
    return {
        "peer": "llama.cpp",
        "threads": threads,
        "batch": 1,
        "new_tokens": new_tokens,
        "ttft_s": 0.01,
        "decode_tok_s": 60.0,
        "output_tok_s": 50.0,
        "token_ids": [5, 6, 9, 9][:new_tokens],
    }


peer = llama_cpp_peer("model.gguf", [1, 2, 3], w4_like, generate=stand_in)
print(peer)
assert peer["ratio"] == 40.0 / 50.0 and peer["same_greedy_tokens"] == 2
assert peer["forge_engine_decode_tok_s"] == pytest.approx(3 / 0.075)
assert peer["decode_ratio"] == pytest.approx(3 / 0.075 / 60.0)
assert peer["threads"] == torch.get_num_threads() and "token_ids" not in peer
assert json.loads(json.dumps(peer)) == peer  # it goes into the result file as it is


# %% [markdown]
# Without `llama_cpp` (as in CI), the peer says how to install it instead of running, and a
# peer that fails in its process is reported, not raised:

# %%
def without_llama_cpp(path: str, prompt: list, new_tokens: int, threads: int) -> dict:
    return {"missing": "ModuleNotFoundError: No module named 'llama_cpp'"}


def crashing(path: str, prompt: list, new_tokens: int, threads: int) -> dict:
    raise SystemExit(3)


skipped = llama_cpp_peer("model.gguf", [1, 2, 3], w4_like, generate=without_llama_cpp)
print(skipped["why"])
assert skipped["peer"] == "llama.cpp" and "ratio" not in skipped
assert "pip install llama-cpp-python==0.3.36" in skipped["why"]
failed = llama_cpp_peer("model.gguf", [1, 2, 3], w4_like, generate=crashing)
assert failed["why"].startswith("it failed: crashing failed in its own process (exit 3)")
if (
    importlib.util.find_spec("llama_cpp") is None
):  # the real function, in this Python, says the same
    real = llama_cpp_peer("model.gguf", [1, 2, 3], w4_like)
    assert real["why"] == skipped["why"], real


# %%
#| export
def run_peers(
    workload: str, loaded: LoadedModel, config: EngineConfig, args, result: dict
) -> list[dict]:
    """The peers of one workload's `result` (w1, w2, w4), each with its ratio forge-engine /
    peer; a peer that could not run goes to `result["peers_skipped"]` with why."""
    hf, peers = hf_twin(loaded), []
    if workload == "w1":
        new_tokens = args.peer_output_len or result["new_tokens"]
        prompt = random_prompts(1, result["prompt_len"], result["prompt_len"], seed=1)[0]
        for cache in ("dynamic", "static"):
            peer = hf_generate(hf, [prompt], new_tokens, cache)
            peers.append({**peer, "ratio": result["decode_tok_s"] / peer["decode_tok_s"]})
    elif workload == "w2":
        count = args.peer_num_prompts or result["requests"]
        prompts = random_prompts(result["requests"], *result["prompt_lens"], seed=0)[:count]
        # On a GPU it sizes its cache itself. On a CPU its own sizing fills static tensors for the whole memory
        # (a minute for a tiny model): there it gets what the workload needs and our step budget.
        tokens = sum(len(p) + result["new_tokens"] for p in prompts)
        sizes = (
            None
            if next(hf.parameters()).is_cuda
            else {
                "num_blocks": tokens // 256 + len(prompts),
                "max_batch_tokens": config.max_num_batched_tokens,
            }
        )
        peer = hf_generate_batch(hf, prompts, result["new_tokens"], sizes)
        ours = result["output_tok_s"]
        if (
            count < result["requests"]
        ):  # the same subset through forge-engine, for a like-for-like ratio
            hf = None
            free_memory()
            engine = LLMEngine(loaded, config)
            ours = run_batch(
                engine,
                prompts,
                SamplingParams(temperature=0, max_tokens=result["new_tokens"], ignore_eos=True),
            )["output_tok_s"]
            peer["forge_engine_output_tok_s_same_prompts"] = ours
            del engine
        peers.append({**peer, "ratio": ours / peer["output_tok_s"]})
    elif workload == "w4":
        prompt = w4_prompt(loaded)
        for n in (1, 8):
            peer = hf_generate(hf, [prompt] * n, result["new_tokens"])
            peers.append(
                {**peer, "ratio": result[f"concurrency_{n}"]["output_tok_s"] / peer["output_tok_s"]}
            )
    del hf
    torch.compiler.reset()  # compiled code (the static cache's) holds the peer's model: let its memory go
    free_memory()
    if workload == "w4":  # llama.cpp, when the weights came from a GGUF file: after the rest, alone
        model = None if loaded.name.startswith("random:") else resolve(loaded.name, fetch=False)
        peer = (
            llama_cpp_peer(model.path, prompt, result)
            if model is not None and model.format == "gguf"
            else {"peer": "llama.cpp", "why": f"it runs GGUF files, and {loaded.name} is not one"}
        )
        if "ratio" in peer:
            peers.append(peer)
        else:
            result.setdefault("peers_skipped", []).append(peer)
    return peers


# %% [markdown]
# ## On a tiny model
#
# The peers on a tiny random Qwen3's weights. The twin must compute what our model computes:
# greedy tokens from `generate` equal forge-engine's for the same prompt. Then each peer made
# exactly as many tokens as asked, in both cache modes, and with a batch of equal prompts.

# %%
tiny = LoadedModel(
    "random:qwen3-tiny",
    init_random_weights(empty_model(preset("qwen3-tiny")), seed=0, std=0.1),
    None,
    None,
)
hf = hf_twin(tiny)
prompt = random_prompts(1, 16, 16, seed=1)[0]
engine = LLMEngine(tiny, EngineConfig(kv_cache_bytes=2**22))
with torch.no_grad():
    theirs = hf.generate(
        torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False
    )[0, 16:].tolist()
engine.add_request(
    prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), request_id="check"
)
finals = {}
while engine.has_unfinished():
    for out in engine.step():
        finals[out.request_id] = out
assert finals["check"].token_ids == theirs, (finals["check"].token_ids, theirs)

# %%
peers = [hf_generate(hf, [prompt], 32, cache) for cache in ("dynamic", "static")] + [
    hf_generate(hf, [prompt] * 4, 32)
]
for p in peers:
    print(p)
assert all(
    p["decode_tok_s"] > 0 and 0 < p["ttft_s"] < p["batch"] * p["new_tokens"] / p["output_tok_s"]
    for p in peers
)
assert peers[2]["batch"] == 4
with pytest.raises(ValueError, match="one length"):
    hf_generate(hf, [[1, 2], [3]], 4)
with pytest.raises(ValueError, match="new_tokens >= 2"):
    hf_generate(hf, [prompt], 1)

# %% [markdown]
# `generate_batch` on three prompts of different lengths, and `run_peers` as the command runs
# it: the W2 peer on the first 2 of 4 prompts, with forge-engine run on the same 2 for the
# ratio.

# %%
batch = hf_generate_batch(
    hf, random_prompts(3, 4, 20, seed=2), 6, {"num_blocks": 8, "max_batch_tokens": 64}
)
assert batch["requests"] == 3 and batch["output_tokens"] == 18 and batch["output_tok_s"] > 0
args = argparse.Namespace(peer_num_prompts=2, peer_output_len=None)
w2_like = {"requests": 4, "prompt_lens": [4, 20], "new_tokens": 6, "output_tok_s": 100.0}
[peer] = run_peers("w2", tiny, EngineConfig(kv_cache_bytes=2**22), args, w2_like)
print(peer)
assert (
    peer["requests"] == 2
    and peer["ratio"] == peer["forge_engine_output_tok_s_same_prompts"] / peer["output_tok_s"]
)
