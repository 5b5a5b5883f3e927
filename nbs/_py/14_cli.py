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
import os
import sys
import traceback

import torch

from forge_engine import load_client
from forge_engine.chat import (
    LocalChat,
    add_chat_url_arguments,
    chat_loop,
    chat_tool_options,
    run_remote_chat,
)
from forge_engine.config import ModelConfig
from forge_engine.generate import SamplingParams
from forge_engine.loader import add_memory_budget_flag, add_quantization_flag, pick_model

# %%
#| hide
import os
import subprocess
import pytest


# %% [markdown]
# ## doctor: what this machine can run

# %%
#| export
def doctor_report(
    model: str = "auto", quantization: str = "none", memory_budget: int | None = None
) -> list[tuple[str, str]]:
    """Facts about this machine that decide how the engine runs, and about `model` (auto: what `--model auto` picks);
    with a GPU `memory_budget`, where its layers would go (chapter 10h)."""
    from forge_engine.registry import forge_home

    rows = [("python", sys.version.split()[0]), ("torch", torch.__version__)]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            free, total = torch.cuda.mem_get_info(i)
            rows.append(
                (
                    f"cuda:{i}",
                    f"{props.name}, compute capability {props.major}.{props.minor}, "
                    f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free",
                )
            )
        rows.append(("cuda runtime", str(torch.version.cuda)))
    else:
        rows.append(("cuda", "no CUDA GPU visible to torch: the engine runs on the CPU"))
    from forge_engine.kernels.backend import (
        kernels_report,
    )  # first: it decides how Triton is imported on a CPU

    rows.append(("kernels", kernels_report()))
    rows.append(
        ("decode", "CUDA graphs per batch bucket" if torch.cuda.is_available() else "eager (CPU)")
    )
    rows.append(("cpu threads", str(torch.get_num_threads())))
    from forge_engine.kernels.cpu import cpu_kernels_status

    rows.append(("cpu kernels", cpu_kernels_status()))
    rows.append(("model cache", str(forge_home())))
    from forge_engine.loader import choose_auto_model

    name, device, why = choose_auto_model()
    rows.append(("--model auto", f"{name} on {device}: {why}"))
    rows.append(("model", _model_summary(name if model == "auto" else model)))
    if memory_budget is not None:
        rows.extend(_placement(name if model == "auto" else model, quantization, memory_budget))
    return rows


def _placement(name: str, quantization: str, budget: int) -> list[tuple[str, str]]:
    """Where `name`'s layers go under `budget` (`--gpu-layers auto`), and the floor of a decode step's CPU part on this
    machine: its layers read by this CPU, or copied over this machine's PCIe."""
    from forge_engine.bench import read_bandwidth
    from forge_engine.loader import RANDOM_PRESETS, model_config_of
    from forge_engine.offload import offload_step_seconds, pcie_bandwidth, plan_gpu_layers
    from forge_engine.registry import resolve

    try:
        config = model_config_of(resolve(name, fetch=False, presets=RANDOM_PRESETS))
        if not isinstance(config, ModelConfig):
            raise ValueError(
                "a Qwen3.5 model's layers are not split (chapter 10h splits chapter 03's Transformer)"
            )
        # as the loader plans it: on a GPU the CPU's layers keep a slot there for a prompt's matmuls (chapter 10h)
        plan = plan_gpu_layers(config, budget, quantization, prompt_slot=torch.cuda.is_available())
    except (ValueError, FileNotFoundError) as e:
        return [("placement", f"{name} in {quantization}: {e}")]
    rows = [("placement", plan.describe())]
    if (
        plan.gpu_layers < plan.num_layers
    ):  # and with --offload stream, which gives two layers' room to its slots
        try:
            streamed = plan_gpu_layers(config, budget, quantization, streamed=True).describe()
        except ValueError as e:
            streamed = str(e)
        rows.append(("placement, streamed", streamed))
        cpu = read_bandwidth("cpu", gib=0.25, repeats=3, dtype=torch.float32)
        pcie = pcie_bandwidth(2**28)[0] if torch.cuda.is_available() else float("nan")
        floors = offload_step_seconds(plan.cpu_weights, cpu, pcie)
        copied = (
            f"copied over PCIe at {pcie / 1e9:.1f} GB/s: {floors['streaming'] * 1e3:.1f} ms"
            if torch.cuda.is_available()
            else "no GPU here to copy them to"
        )
        rows.append(
            (
                "offload floor",
                f"the CPU's layers read by this CPU at {cpu / 1e9:.1f} GB/s: {floors['cpu_compute'] * 1e3:.1f} ms a "
                f"step; {copied}",
            )
        )
    return rows


def _model_summary(name: str) -> str:
    "What `name` is, from the cache or its files, without downloading; or why that is not known."
    from forge_engine.registry import describe_model, resolve, summarize

    try:
        return f"{name}: {summarize(describe_model(resolve(name, fetch=False)))}"
    except (ValueError, FileNotFoundError) as e:
        return f"{name}: {e}"


# %%
rows = dict(doctor_report())
assert rows["torch"] == torch.__version__ and "model cache" in rows and "--model auto" in rows
assert rows["model"].startswith(rows["--model auto"].split()[0] + ": ")
if not torch.cuda.is_available():
    assert rows["model"].startswith(
        "smollm2-135m-instruct: llama, 134.5M parameters, Q4_1, context 8,192"
    )
assert dict(doctor_report("random:qwen3-tiny"))["model"].startswith("random:qwen3-tiny: qwen3, ")
assert "unknown model 'gpt-5'" in dict(doctor_report("gpt-5"))["model"]
# a model too big for the budget: which layers go where, and the floor of the CPU's part on this machine
placed = dict(doctor_report("random:qwen3-14b", "int4", 8 * 2**30))
print(placed["placement"], placed["offload floor"], sep="\n")
assert (
    placed["placement"].startswith("offload plan for 8.00 GiB: layers 0-")
    and " ms a step" in placed["offload floor"]
)
assert "streamed from host memory" in placed["placement, streamed"]
assert "holds no layer" in dict(doctor_report("random:qwen3-14b", "int4", 2**30))["placement"]
assert "not split" in dict(doctor_report("random:qwen3.5-tiny", "none", 2**30))["placement"]


# %% [markdown]
# ## The terminal chat
#
# The loop itself lives in chapter 12 (`forge_engine.chat.chat_loop`): it reads a line, streams
# the reply, keeps the conversation, and stops a reply on Ctrl+C. Here it is given either the
# model loaded in this process (`LocalChat`) or a server (`--url`, `RemoteChat`). Ctrl+D, or
# a closed stdin, leaves. `--tools FILE` offers the tools of a JSON file either way: each call
# the model makes shows as `→ get_weather({"city": "Paris"})` and the loop asks for its result.

# %% [markdown]
# ## The commands

# %%
#| export
def _add_model_flags(p: argparse.ArgumentParser):
    p.add_argument(
        "--model", default="auto", help="registry name, local path, random:<preset>, or auto"
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="split the model over this many GPUs (processes)",
    )
    add_quantization_flag(
        p, "auto"
    )  # (these two and `pick_model`: chapter 04a, shared with serve and bench)
    add_memory_budget_flag(p)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    "The parser; `serve`'s and `bench`'s flags are added only when they are the command (they import much)."
    parser = argparse.ArgumentParser(
        prog="forge-engine", description="A small, readable inference engine for Qwen3."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="what this machine can run")
    doctor.add_argument(
        "--model",
        default="auto",
        help="also describe this model (default: what --model auto picks)",
    )
    add_quantization_flag(doctor, "none")
    add_memory_budget_flag(doctor)  # with a budget: where the model's layers go (chapter 10h)
    gen = sub.add_parser("generate", help="answer one prompt")
    gen.add_argument("prompt")
    gen.add_argument(
        "--raw", action="store_true", help="send the prompt as is, without the chat template"
    )
    _add_model_flags(gen)
    chat = sub.add_parser(
        "chat", help="chat in the terminal (in this process, or with a server: --url)"
    )
    chat.add_argument("--system", default=None, help="a system prompt")
    _add_model_flags(chat)
    add_chat_url_arguments(chat)
    serve = sub.add_parser(
        "serve", help="the OpenAI-compatible HTTP server, with a browser chat at /"
    )
    if argv and argv[0] == "serve":
        from forge_engine.server import serve as server

        server.add_arguments(serve)
    bench = sub.add_parser(
        "bench", help="benchmark workloads W1-W4 (see chapter 13), and their plots"
    )
    if argv and argv[0] == "bench":
        from forge_engine import bench_command

        bench_command.add_arguments(bench.add_subparsers(dest="workload", required=True))
    models = sub.add_parser("models", help="the model registry")
    models_sub = models.add_subparsers(dest="action", required=True)
    models_sub.add_parser("list", help="known models and whether they are in the cache")
    for action, what in [
        ("info", "what the catalog and the cache say about a model"),
        ("pull", "download a model (resuming a partial download) and check its sha256"),
        ("verify", "re-hash a pulled model's files"),
        ("rm", "remove a pulled model from the cache"),
    ]:
        models_sub.add_parser(action, help=what).add_argument("name")
    search = models_sub.add_parser(
        "search", help="search the model hub (needs network access to it)"
    )
    search.add_argument("query")
    search.add_argument("--limit", type=int, default=20)
    return parser


def sampling_from_args(args) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
    )


def _load_llm(args):
    from forge_engine.llm import LLM

    log = lambda msg: print(msg, file=sys.stderr)
    model, device = pick_model(args.model, args.device, log)
    llm = LLM(
        model,
        device=device,
        dtype=args.dtype,
        quantization=args.quantization,
        tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_budget=args.gpu_memory_budget,
        gpu_layers=args.gpu_layers,
        offload=args.offload,
    )
    param = next(llm.loaded.model.parameters())
    log(
        f"{llm.loaded.name} on {param.device} in {str(param.dtype).removeprefix('torch.')}: {llm.loaded.stats}"
    )
    return llm


def run_models(args) -> int:
    "`forge-engine models list | info | pull | verify | rm | search`: results on stdout, progress on stderr."
    from forge_engine import registry

    if args.action == "list":
        rows = registry.list_models()
        width = max(len(r.name) for r in rows)
        print(f"{'NAME':<{width}}  {'FORMAT':<11}  {'SIZE':>10}  {'PULLED':<6}  SOURCE")
        for r in rows:
            print(
                f"{r.name:<{width}}  {r.format:<11}  {registry.format_bytes(r.size):>10}  "
                f"{'yes' if r.pulled else 'no':<6}  {r.source}"
            )
    elif args.action == "info":
        for key, value in registry.model_info(args.name).items():
            if isinstance(value, dict):
                print(f"{key}:")
                for k, v in value.items():
                    print(f"  {k}  {v}")
            else:
                print(f"{key}: {registry.format_bytes(value) if key == 'size_bytes' else value}")
    elif args.action == "pull":
        path = registry.pull(args.name)
        print(path)
        print(registry.summarize(registry.model_info(args.name)), file=sys.stderr)
    elif args.action == "verify":
        report = registry.verify(args.name)
        print(f"{args.name}: {'ok' if report else 'FAILED'}")
        for problem in report.problems:
            print(f"  {problem}")
        return 0 if report else 1
    elif args.action == "rm":
        for path in registry.remove(args.name):
            print(f"removed {path}")
    elif args.action == "search":
        print(registry.format_hits(registry.search_hub(args.query, limit=args.limit)))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    try:
        if args.command == "doctor":
            for label, value in doctor_report(
                args.model, args.quantization, args.gpu_memory_budget
            ):
                print(f"{label:>14}: {value}")
        elif args.command == "models":
            return run_models(args)
        elif args.command == "bench":
            from forge_engine import bench_command

            return (
                load_client.run(args)
                if args.workload == "serve"
                else bench_command.run_from_args(args)
            )
        elif args.command == "serve":
            from forge_engine.server import serve as server

            return server.run(args)
        elif args.command == "chat" and args.url:
            return run_remote_chat(args, sampling_from_args(args))
        else:
            params = sampling_from_args(args)
            offered = chat_tool_options(args) if args.command == "chat" else {}
            llm = _load_llm(args)
            if args.command == "chat":
                llm.engine.warm_up()  # kernels compiled now, not during the first reply
                chat_loop(LocalChat(llm), params, system=args.system, **offered)
            else:
                write = lambda _, delta: (sys.stdout.write(delta), sys.stdout.flush())
                if args.raw or llm.tokenizer is None:
                    [out] = llm.generate(args.prompt, params, on_text=write)
                else:
                    [out] = llm.chat(
                        [{"role": "user", "content": args.prompt}], params, on_text=write
                    )
                print()
                print(
                    f"[{len(out.prompt_token_ids)} prompt tokens, {len(out.token_ids)} new, "
                    f"{out.metrics['decode_tok_s']:.1f} tok/s decode, first token {out.metrics['ttft_s'] * 1000:.0f} ms, "
                    f"finish: {out.finish_reason}]",
                    file=sys.stderr,
                )
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        if os.environ.get("FORGE_TRACEBACK"):
            traceback.print_exc()  # where it came from, for a bug report
        print(f"forge-engine: error: {e}", file=sys.stderr)
        return 2
    return 0


# %%
assert (
    build_parser().parse_args(["generate", "--quantization", "int8", "hi"]).quantization == "int8"
)
assert (
    build_parser().parse_args(["generate", "--gpu-memory-budget", "8GiB", "hi"]).gpu_memory_budget
    == 8 * 2**30
)
argv = [
    "bench",
    "w4",
    "--quantization",
    "gguf",
]  # (bench adds its flags only when it is the command)
assert build_parser(argv).parse_args(argv).quantization == "gguf"
assert (
    build_parser().parse_args(["chat"]).quantization == "auto"
)  # (a GGUF file on a CPU: its blocks kept)
assert (
    build_parser(["bench", "w4"]).parse_args(["bench", "w4"]).quantization == "none"
)  # (figures as asked)

# %% [markdown]
# `models` in this process (stdout and stderr captured): the catalog table, one entry's
# metadata, `rm` of something not pulled, and `search` with the hub out of reach.

# %%
import contextlib, io, tempfile
from pathlib import Path


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


code, out, _ = run_cli("models", "list")
assert code == 0 and out.splitlines()[0].split() == ["NAME", "FORMAT", "SIZE", "PULLED", "SOURCE"]
assert [l.split()[:5] for l in out.splitlines() if l.startswith("smollm2")] == [
    ["smollm2-135m-instruct", "gguf", "93.8", "MiB", "yes"]
]
code, out, _ = run_cli("models", "info", "smollm2-135m-instruct")
assert (
    code == 0
    and "quantization: Q4_1" in out
    and "license: apache-2.0" in out
    and "context_length: 8192" in out
)
with tempfile.TemporaryDirectory() as d, pytest.MonkeyPatch.context() as mp:
    mp.setenv("FORGE_HOME", d)
    code, _, err = run_cli("models", "rm", "smollm2-135m-instruct")
    assert code == 2 and "smollm2-135m-instruct is not pulled: nothing to remove" in err
    import huggingface_hub

    class NoHub:
        def __init__(self, endpoint=None):
            pass

        def list_models(self, **kwargs):
            raise ConnectionError("[Errno 111] Connection refused")

    mp.setattr(huggingface_hub, "HfApi", NoHub)
    code, out, err = run_cli("models", "search", "qwen3")
    assert (
        code == 2
        and out == ""
        and "the model hub (the default endpoint) is not reachable: ConnectionError" in err
    )
print(err)


# %% [markdown]
# ## Running the real commands
#
# These start the installed command in a fresh process, as a user would.

# %%
def forge(*args, stdin=subprocess.DEVNULL, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "forge_engine", *args],
        stdin=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# (a question whose answer's first token is not a near-tie: chapter 04a)
r = forge(
    "generate",
    "--model",
    "smollm2-135m-instruct",
    "--device",
    "cpu",
    "--temperature",
    "0",
    "--max-tokens",
    "24",
    "What is the capital of France? Answer in one sentence.",
)
print(r.stdout, r.stderr[-400:])
assert r.returncode == 0 and "Paris" in r.stdout

# %%
p = subprocess.run(
    [
        sys.executable,
        "-m",
        "forge_engine",
        "chat",
        "--model",
        "smollm2-135m-instruct",
        "--device",
        "cpu",
        "--temperature",
        "0",
        "--max-tokens",
        "16",
    ],
    input="What is the capital of France? Answer in one sentence.\n",
    capture_output=True,
    text=True,
    timeout=600,
)
assert p.returncode == 0 and "Paris" in p.stdout, p.stderr[-500:]
r = forge(
    "chat", "--model", "smollm2-135m-instruct", "--device", "cpu"
)  # stdin is /dev/null: leaves at once
assert r.returncode == 0, r.stderr[-500:]

# %% [markdown]
# With `--tools`: the random model is made to call `get_weather` (`--tool-choice` names it, so
# the grammar leaves it nothing else), the call shows on its line, and the result is read from
# stdin; a choice that is not one of the tools is refused before the model loads.

# %%
import json

with tempfile.TemporaryDirectory() as d:
    tools = Path(d) / "tools.json"
    city = {
        "type": "object",
        "additionalProperties": False,
        "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 12}},
    }
    tools.write_text(
        json.dumps([{"type": "function", "function": {"name": "get_weather", "parameters": city}}])
    )
    chat_args = ["chat", "--model", "random:qwen3-tiny", "--device", "cpu", "--tools", str(tools)]
    p = subprocess.run(
        [sys.executable, "-m", "forge_engine", *chat_args, "--tool-choice", "get_weather"]
        + ["--temperature", "1", "--seed", "1", "--max-tokens", "80"],
        input="Weather in Paris?\n18 C\n",
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0 and "→ get_weather({" in p.stdout, p.stderr[-500:]
    assert "result of get_weather: " in p.stdout and "<tool_call>" not in p.stdout
    r = forge(*chat_args, "--tool-choice", "get_time")
    assert r.returncode == 2 and "none of auto, required, none or a tool: get_weather" in r.stderr
r = forge("generate", "--model", "no-such-model", "hi")
assert r.returncode == 2 and "no-such-model" in r.stderr and "smollm2-135m-instruct" in r.stderr
