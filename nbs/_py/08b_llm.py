# %% [markdown]
# # Offline generation
#
# > `LLM`: prompts in, finished texts out. The engine of chapter 08, stepped in the caller's thread, over a model in this process or split over several.

# %% [markdown]
# `LLM` is the engine behind two calls, `generate(prompts)` and `chat(messages)`, for scripts
# and notebooks: no thread, no server. It loads a model by name, builds an `LLMEngine`
# (chapter 08) over it and steps it until every request is done.
#
# Loading holds the one choice made here: the model in this process (`load_model`, chapter
# 04a), or split over `tensor_parallel_size` processes (`load_model_parallel`, chapter 09c).
# Tensor parallelism builds on the loader and on the engine, so the choice sits above both, in
# `load_model_over`; the server (chapter 11) and the bench command (chapter 13e) load through it too.

# %%
#| default_exp llm

# %%
#| export
from __future__ import annotations

from collections import deque
from typing import Callable, Sequence

import torch

from forge_engine.config import EngineConfig
from forge_engine.engine import LLMEngine, RequestOutput
from forge_engine.generate import SamplingParams
from forge_engine.loader import LoadedModel, load_model

# %%
#| hide
import pytest


# %% [markdown]
# ## One process or several
#
# `tensor_parallel_size=1` is `load_model` itself. More processes run unquantized weights, and
# chapter 09c is imported only then (it brings Triton and `torch.distributed` with it).

# %%
#| export
def load_model_over(
    name: str,
    device: str | None = None,
    dtype: str | torch.dtype | None = None,
    seed: int = 0,
    progress: bool = True,
    quantization: str = "none",
    tensor_parallel_size: int = 1,
    memory_budget: int | None = None,
    gpu_layers: int | str | None = None,
    offload: str = "auto",
) -> LoadedModel:
    """`load_model` (chapter 04a) in this process, or `load_model_parallel` (chapter 09c) over `tensor_parallel_size`.
    `gpu_layers`: the first N layers on the GPU, the others computed on the CPU or (`offload` "stream") streamed to
    the GPU (chapter 10h; in this process only)."""
    if tensor_parallel_size == 1:
        return load_model(
            name,
            device,
            dtype,
            seed=seed,
            progress=progress,
            quantization=quantization,
            memory_budget=memory_budget,
            gpu_layers=gpu_layers,
            offload=offload,
        )
    if gpu_layers is not None:
        raise ValueError(
            "--gpu-layers splits a model between a GPU and the CPU, not with tensor parallelism"
        )
    if quantization not in ("none", "auto"):  # (auto: none on a GPU, where tensor parallelism runs)
        raise ValueError(
            "tensor parallelism runs unquantized weights: use --quantization none with it"
        )
    from forge_engine.tensor_parallel.ranks import load_model_parallel

    return load_model_parallel(name, device, dtype, seed, world=tensor_parallel_size)


# %%
one = load_model_over("random:qwen3-tiny", "cpu", seed=3, progress=False)
alone = load_model("random:qwen3-tiny", "cpu", seed=3, progress=False)
assert one.parallel is None and all(
    torch.equal(a, b) for a, b in zip(one.model.parameters(), alone.model.parameters())
)
with pytest.raises(ValueError, match="tensor parallelism runs unquantized weights"):
    load_model_over("random:qwen3-tiny", "cpu", quantization="int8", tensor_parallel_size=2)


# %% [markdown]
# ## `LLM`
#
# `generate` queues all prompts (as many as the waiting queue takes, the rest as it drains)
# and steps the engine until every one is done. Continuous batching does the rest.

# %%
#| export
class LLM:
    "Offline generation: `LLM(model=...)`, then `generate(prompts, sampling_params)` or `chat(messages, ...)`."

    def __init__(
        self,
        model: str = "smollm2-135m-instruct",
        device: str | None = None,
        dtype: str | None = None,
        seed: int = 0,
        progress: bool = True,
        gpu_layers: int | str | None = None,
        offload: str = "auto",
        **engine_options,
    ):
        """`gpu_layers`: only the first N layers on the GPU, the others on the CPU or streamed (`offload`, chapter 10h);
        `engine_options`: EngineConfig's fields."""
        self.loaded = load_model_over(
            model,
            device,
            dtype,
            seed=seed,
            progress=progress,
            memory_budget=engine_options.get("gpu_memory_budget"),
            quantization=engine_options.get("quantization", "none"),
            tensor_parallel_size=engine_options.get("tensor_parallel_size", 1),
            gpu_layers=gpu_layers,
            offload=offload,
        )
        self.tokenizer = self.loaded.tokenizer
        self.engine = LLMEngine(
            self.loaded, EngineConfig(device=device, dtype=dtype, seed=seed, **engine_options)
        )

    def _prompt_ids(self, prompt: str | None, ids: Sequence[int] | None) -> list[int]:
        if ids is not None:
            return list(ids)
        if self.tokenizer is None:
            raise ValueError(
                f"model {self.loaded.name!r} has no tokenizer: pass prompt_token_ids instead of text"
            )
        return self.tokenizer.encode(prompt)

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        on_text: Callable[[int, str], None] | None = None,
    ) -> list[RequestOutput]:
        "Generate for each prompt (text, or token ids), batched. `on_text(index, delta)` streams text as it comes."
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass either prompts or prompt_token_ids")
        if isinstance(prompts, str):
            prompts = [prompts]
        texts = list(prompts) if prompts is not None else [None] * len(prompt_token_ids)
        ids = [
            self._prompt_ids(t, prompt_token_ids[i] if prompt_token_ids is not None else None)
            for i, t in enumerate(texts)
        ]
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(ids)
        if len(params) != len(ids):
            raise ValueError(f"got {len(params)} sampling_params for {len(ids)} prompts")
        for i, p in enumerate(ids):  # refuse bad prompts before queueing any
            try:
                self.engine.check_prompt(p)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        pending = deque(range(len(ids)))
        index_of, results = {}, [None] * len(ids)
        while pending or self.engine.has_unfinished():
            while pending and len(self.engine.scheduler.waiting) < self.engine.config.max_waiting:
                i = pending.popleft()
                index_of[self.engine.add_request(ids[i], params[i], prompt=texts[i])] = i
            for out in self.engine.step():
                i = index_of[out.request_id]
                if on_text is not None and out.delta_text:
                    on_text(i, out.delta_text)
                if out.finished:
                    results[i] = out
        return results

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        on_text: Callable[[int, str], None] | None = None,
    ) -> list[RequestOutput]:
        "Apply the model's chat template to one conversation (or a list of them) and generate."
        if self.tokenizer is None:
            raise ValueError(f"model {self.loaded.name!r} has no tokenizer, so no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        ids = [self.tokenizer.encode_chat(c) for c in conversations]
        return self.generate(prompt_token_ids=ids, sampling_params=sampling_params, on_text=on_text)


# %% [markdown]
# ## SmolLM2 on the CPU, eight at a time

# %%
llm = LLM("smollm2-135m-instruct", device="cpu", progress=False)
questions = [
    "What is the capital of France? Answer in one sentence.",
    "Name a primary color.",
    "What is 2 + 2?",
    "Say hello in Spanish.",
]
streamed = {}
outs = llm.chat(
    [[{"role": "user", "content": q}] for q in questions],
    SamplingParams(temperature=0, max_tokens=24),
    on_text=lambda i, d: streamed.__setitem__(i, streamed.get(i, "") + d),
)
for q, o in zip(questions, outs):
    print(f"{q} -> {o.text!r} ({o.finish_reason})")
assert "Paris" in outs[0].text and all(streamed.get(i, "") == o.text for i, o in enumerate(outs))
llm.engine.allocator.check_idle()

# %% [markdown]
# The engine at work: tokens per step, split into prefill and decode, and the block map.

# %%
import matplotlib.pyplot as plt

steps = llm.engine.stats().recent_steps
fig, ax = plt.subplots(figsize=(9, 2))
ax.bar(
    [s.index for s in steps],
    [s.prefill_tokens for s in steps],
    color="tab:orange",
    label="prefill tokens",
)
ax.bar(
    [s.index for s in steps],
    [s.decode_seqs for s in steps],
    bottom=[s.prefill_tokens for s in steps],
    color="tab:blue",
    label="decode tokens",
)
ax.set(xlabel="engine step", ylabel="tokens", yscale="log")
ax.legend()
plt.show()
print(llm.engine.stats().block_map[:120])
