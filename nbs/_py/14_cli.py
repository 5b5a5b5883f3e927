# %% [markdown]
# # The command line
#
# > `forge-engine doctor | generate | chat | models`: the engine from a terminal.

# %% [markdown]
# Every command is a thin layer over the Python API of the earlier chapters. Flags shared by
# the commands that run a model: `--model` (default `auto`: Qwen3-4B on a CUDA GPU with enough
# free memory, else SmolLM2-135M on the CPU; it says which and why), `--device`, `--dtype`,
# `--max-tokens`, `--temperature`, `--top-p`, `--top-k`, `--seed`.
#
# Streamed text goes to stdout; progress, choices and timings go to stderr, so
# `forge-engine generate ... > answer.txt` captures only the answer.

# %%
#| default_exp cli

# %%
#| export
from __future__ import annotations

import argparse
import sys
from typing import Callable

import torch

from forge_engine import load_client
from forge_engine.chat import LocalChat, add_chat_url_arguments, chat_loop, run_remote_chat
from forge_engine.generate import SamplingParams

# %%
#| hide
import os
import subprocess
import pytest


# %% [markdown]
# ## doctor: what this machine can run

# %%
#| export
def doctor_report() -> list[tuple[str, str]]:
    "Facts about this machine that decide how the engine runs, as (label, value) rows."
    from forge_engine.registry import forge_home
    rows = [("python", sys.version.split()[0]), ("torch", torch.__version__)]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            free, total = torch.cuda.mem_get_info(i)
            rows.append((f"cuda:{i}", f"{props.name}, compute capability {props.major}.{props.minor}, "
                                      f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free"))
        rows.append(("cuda runtime", str(torch.version.cuda)))
    else:
        rows.append(("cuda", "no CUDA GPU visible to torch: the engine runs on the CPU"))
    from forge_engine.kernels import kernels_report  # first: it decides how Triton is imported on a CPU
    rows.append(("kernels", kernels_report()))
    rows.append(("decode", "CUDA graphs per batch bucket" if torch.cuda.is_available() else "eager (CPU)"))
    rows.append(("cpu threads", str(torch.get_num_threads())))
    rows.append(("model cache", str(forge_home())))
    from forge_engine.loader import choose_auto_model
    name, device, why = choose_auto_model()
    rows.append(("--model auto", f"{name} on {device}: {why}"))
    return rows


# %%
rows = dict(doctor_report())
assert rows["torch"] == torch.__version__ and "model cache" in rows and "--model auto" in rows


# %% [markdown]
# ## Choosing the model

# %%
#| export
def pick_model(model: str, device: str | None, log: Callable[[str], None]) -> tuple[str, str | None]:
    "Resolve `--model auto` (saying what was chosen and why); other names pass through."
    if model != "auto":
        return model, device
    from forge_engine.loader import AUTO_CPU_MODEL, choose_auto_model
    if device == "cpu":
        log(f"model auto -> {AUTO_CPU_MODEL} (--device cpu)")
        return AUTO_CPU_MODEL, device
    name, auto_device, why = choose_auto_model()
    log(f"model auto -> {name} on {auto_device}: {why}")
    return name, device or auto_device


# %%
picked, dev = pick_model("auto", "cpu", log=print)
assert (picked, dev) == ("smollm2-135m-instruct", "cpu")
assert pick_model("random:qwen3-tiny", None, log=print) == ("random:qwen3-tiny", None)


# %% [markdown]
# ## The terminal chat
#
# The loop itself lives in chapter 12 (`forge_engine.chat.chat_loop`): it reads a line, streams
# the reply, keeps the conversation, and stops a reply on Ctrl+C. Here it is given either the
# model loaded in this process (`LocalChat`) or a server (`--url`, `RemoteChat`). Ctrl+D, or
# a closed stdin, leaves.

# %% [markdown]
# ## The commands

# %%
#| export
def _add_model_flags(p: argparse.ArgumentParser):
    p.add_argument("--model", default="auto", help="registry name, local path, random:<preset>, or auto")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    _add_quantization_flag(p)


def _add_quantization_flag(p: argparse.ArgumentParser):
    p.add_argument("--quantization", default="none", choices=["none", "int8", "int4", "gguf"],
                   help="layer weights: int8 / int4 quantized at load, gguf: a GGUF file's blocks kept (default none)")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    "The parser; `serve`'s flags are added only when `serve` is the command (it imports the web stack)."
    parser = argparse.ArgumentParser(prog="forge-engine", description="A small, readable inference engine for Qwen3.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="what this machine can run")
    gen = sub.add_parser("generate", help="answer one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    _add_model_flags(gen)
    chat = sub.add_parser("chat", help="chat in the terminal (in this process, or with a server: --url)")
    chat.add_argument("--system", default=None, help="a system prompt")
    _add_model_flags(chat)
    add_chat_url_arguments(chat)
    serve = sub.add_parser("serve", help="the OpenAI-compatible HTTP server, with a browser chat at /")
    if argv and argv[0] == "serve":
        from forge_engine import server
        server.add_arguments(serve)
    bench = sub.add_parser("bench", help="benchmark workloads: w1, w2, w4 through the engine; serve (W3) against a server")
    workloads = bench.add_subparsers(dest="workload", required=True)
    for name, what in [("w1", "single stream"), ("w2", "offline throughput"), ("w4", "CPU classroom: 1 and 8 requests")]:
        w = workloads.add_parser(name, help=what)
        w.add_argument("--model", default="auto")
        w.add_argument("--device", default=None)
        w.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
        w.add_argument("--batch-invariant", action="store_true", help="fixed-shape execution (slower, batch-invariant)")
        w.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly on a GPU")
        w.add_argument("--max-num-seqs", type=int, default=None, help="sequences per step at most (EngineConfig)")
        w.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per step at most (EngineConfig)")
        w.add_argument("--num-prompts", type=int, default=None, help="w2: how many requests (default 256)")
        w.add_argument("--output-len", type=int, default=None, help="new tokens per request")
        w.add_argument("--peers", action="store_true", help="w1: also run transformers generate on the same weights")
        w.add_argument("--json", default=None, help="also write the result to this file")
        _add_quantization_flag(w)
    load_client.add_arguments(workloads.add_parser("serve", help="W3: Poisson load against an OpenAI-compatible server"))
    models = sub.add_parser("models", help="the model registry")
    models_sub = models.add_subparsers(dest="action", required=True)
    models_sub.add_parser("list", help="known models and whether they are in the cache")
    for action in ("pull", "verify"):
        models_sub.add_parser(action, help=f"{action} a model").add_argument("name")
    return parser


def sampling_from_args(args) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, seed=args.seed)


def _load_llm(args):
    from forge_engine.engine import LLM
    log = lambda msg: print(msg, file=sys.stderr)
    model, device = pick_model(args.model, args.device, log)
    llm = LLM(model, device=device, dtype=args.dtype, quantization=args.quantization)
    param = next(llm.loaded.model.parameters())
    log(f"{llm.loaded.name} on {param.device} in {str(param.dtype).removeprefix('torch.')}: {llm.loaded.stats}")
    return llm


def run_models(args) -> int:
    from forge_engine import registry
    if args.action == "list":
        for row in registry.list_models():
            print("  ".join(str(v) for v in row))
    elif args.action == "pull":
        print(registry.pull(args.name))
    elif args.action == "verify":
        ok = registry.verify(args.name)
        print(f"{args.name}: {'ok' if ok else 'FAILED'}")
        return 0 if ok else 1
    return 0


def run_bench(args) -> int:
    import json
    from forge_engine.bench import WORKLOADS, environment, hf_generate_w1, read_bandwidth
    from forge_engine.config import EngineConfig
    from forge_engine.loader import load_model
    model, device = pick_model(args.model, args.device, lambda msg: print(msg, file=sys.stderr))
    loaded = load_model(model, device, args.dtype, quantization=args.quantization)
    limits = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
    config = EngineConfig(batch_invariant=args.batch_invariant, cuda_graphs=False if args.no_cuda_graphs else None,
                          **{k: v for k, v in limits.items() if v is not None})
    sizes = {"count": args.num_prompts, "new_tokens": args.output_len}
    result = {**WORKLOADS[args.workload](loaded, config, **{k: v for k, v in sizes.items() if v is not None}), "model": model, "batch_invariant": args.batch_invariant,
              "quantization": args.quantization,
              "dtype": str(next(loaded.model.parameters()).dtype).removeprefix("torch."), "environment": environment()}
    device = next(loaded.model.parameters()).device
    if device.type == "cuda":
        result["peak_gpu_memory_bytes"] = torch.cuda.max_memory_allocated(device)
        ceiling = read_bandwidth(device)
        result["read_bandwidth_ceiling_bytes_per_s"] = ceiling
        if "achieved_bytes_per_s" in result:
            result["ratio_to_read_ceiling"] = result["achieved_bytes_per_s"] / ceiling
    if args.workload == "w1" and args.peers:
        peer = hf_generate_w1(loaded, new_tokens=args.output_len or 256)
        result["peers"] = [{**peer, "ratio": result["decode_tok_s"] / peer["decode_tok_s"]}]
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f: f.write(text + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    try:
        if args.command == "doctor":
            for label, value in doctor_report():
                print(f"{label:>14}: {value}")
        elif args.command == "models":
            return run_models(args)
        elif args.command == "bench":
            return load_client.run(args) if args.workload == "serve" else run_bench(args)
        elif args.command == "serve":
            from forge_engine import server
            return server.run(args)
        elif args.command == "chat" and args.url:
            return run_remote_chat(args, sampling_from_args(args))
        else:
            params = sampling_from_args(args)
            llm = _load_llm(args)
            if args.command == "chat":
                chat_loop(LocalChat(llm), params, system=args.system)
            else:
                write = lambda _, delta: (sys.stdout.write(delta), sys.stdout.flush())
                if args.raw or llm.tokenizer is None:
                    [out] = llm.generate(args.prompt, params, on_text=write)
                else:
                    [out] = llm.chat([{"role": "user", "content": args.prompt}], params, on_text=write)
                print()
                print(f"[{len(out.prompt_token_ids)} prompt tokens, {len(out.token_ids)} new, "
                      f"{out.metrics['decode_tok_s']:.1f} tok/s decode, first token {out.metrics['ttft_s'] * 1000:.0f} ms, "
                      f"finish: {out.finish_reason}]", file=sys.stderr)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"forge-engine: error: {e}", file=sys.stderr)
        return 2
    return 0


# %%
assert build_parser().parse_args(["generate", "--quantization", "int8", "hi"]).quantization == "int8"
assert build_parser().parse_args(["bench", "w4", "--quantization", "gguf"]).quantization == "gguf"
assert build_parser().parse_args(["chat"]).quantization == "none"


# %% [markdown]
# ## Running the real commands
#
# These start the installed command in a fresh process, as a user would.

# %%
def forge(*args, stdin=subprocess.DEVNULL, timeout=600):
    return subprocess.run([sys.executable, "-m", "forge_engine", *args], stdin=stdin, capture_output=True,
                          text=True, timeout=timeout)

r = forge("generate", "--model", "smollm2-135m-instruct", "--device", "cpu", "--temperature", "0",
          "--max-tokens", "24", "What is the capital of France?")
print(r.stdout, r.stderr[-400:])
assert r.returncode == 0 and "Paris" in r.stdout

# %%
p = subprocess.run([sys.executable, "-m", "forge_engine", "chat", "--model", "smollm2-135m-instruct", "--device", "cpu",
                    "--temperature", "0", "--max-tokens", "16"], input="What is the capital of France?\n",
                   capture_output=True, text=True, timeout=600)
assert p.returncode == 0 and "Paris" in p.stdout, p.stderr[-500:]
r = forge("chat", "--model", "smollm2-135m-instruct", "--device", "cpu")  # stdin is /dev/null: leaves at once
assert r.returncode == 0, r.stderr[-500:]
r = forge("generate", "--model", "no-such-model", "hi")
assert r.returncode == 2 and "no-such-model" in r.stderr and "smollm2-135m-instruct" in r.stderr
