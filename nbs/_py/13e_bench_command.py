# %% [markdown]
# # The `bench` command
#
# > `forge-engine bench w1|w2|w3|w4|all|plot`: chapter 13's workloads from a terminal, with their peers, W3 against a server of its own, the results saved and plotted.

# %% [markdown]
# Chapter 13 holds the workloads and their results; the short chapters after it each add one
# piece: the load client (13a), the peers (13b), the server process (13c), the plots (13d).
# The command is where they meet, so it sits above all of them, here. Each piece is imported
# when a run needs it (the peers bring `transformers`, the plots matplotlib).

# %%
#| default_exp bench_command

# %%
#| export
from __future__ import annotations

import json
import sys

import torch

from forge_engine.bench import (
    WORKLOADS,
    ceilings,
    environment,
    free_memory,
    package_version,
    save_result,
    summary_line,
)
from forge_engine.config import EngineConfig
from forge_engine.llm import load_model_over
from forge_engine.loader import (
    LoadedModel,
    add_memory_budget_flag,
    add_quantization_flag,
    pick_model,
)

# %%
#| hide
import argparse
import os
import tempfile

import pytest

from forge_engine.bench import cpu_name

# %% [markdown]
# ## Running a workload from the command line, with its peers
#
# `run_offline` is what `forge-engine bench w1|w2|w4` runs: the workload, then its peers on
# the same weights, then the ratios. The W2 peer can run on the first N prompts only
# (`--peer-num-prompts`; `generate_batch` takes ~4.5 minutes for all of W2 on an H200): then
# forge-engine runs those same N prompts too, and the ratio compares the two on them. W4 on a
# GGUF file also runs llama.cpp on it, when `llama_cpp` can be imported; when it cannot, the
# summary and the result's `peers_skipped` say so, with the command that installs it:
#
# ```
# forge-engine bench w4 --model smollm2-135m-instruct --device cpu --quantization gguf --peers
# ```

# %%
#| export
W2_ENGINE_DEFAULTS = {
    "max_num_seqs": 256,
    "max_num_batched_tokens": 8192,
}  # W2 wants its 256 requests at once


def engine_config(args, workload: str) -> EngineConfig:
    limits = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    defaults = W2_ENGINE_DEFAULTS if workload == "w2" else {}
    return EngineConfig(
        batch_invariant=args.batch_invariant,
        cuda_graphs=False if args.no_cuda_graphs else None,
        async_scheduling=args.async_scheduling,
        tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_budget=args.gpu_memory_budget,
        speculative_tokens=args.speculative_tokens or 0,
        **{
            k: v if v is not None else defaults.get(k)
            for k, v in limits.items()
            if v is not None or k in defaults
        },
    )


def run_offline(workload: str, loaded: LoadedModel, args, ceiling: dict | None) -> dict:
    "One offline workload (w1, w2, w4) with its peers (`args.peers`) and ratios."
    config = engine_config(args, workload)
    sizes = {"count": args.num_prompts if workload == "w2" else None, "new_tokens": args.output_len}
    result = WORKLOADS[workload](
        loaded, config, **{k: v for k, v in sizes.items() if v is not None}
    )
    param = next(loaded.model.parameters())
    result.update(
        model=loaded.name,
        dtype=str(param.dtype).removeprefix("torch."),
        batch_invariant=args.batch_invariant,
        quantization=args.quantization,
        engine_config={
            k: getattr(config, k)
            for k in (
                "max_num_seqs",
                "max_num_batched_tokens",
                "block_size",
                "cuda_graphs",
                "async_scheduling",
                "kv_cache_bytes",
            )
        },
    )
    if param.device.type == "cuda":
        result["peak_gpu_memory_bytes"] = torch.cuda.max_memory_allocated(param.device)
    if ceiling:
        result["ceilings"] = ceiling
        if "achieved_bytes_per_s" in result:
            result["ratio_to_read_ceiling"] = (
                result["achieved_bytes_per_s"] / ceiling["read_bytes_per_s"]
            )
    if (
        loaded.parallel is not None
    ):  # what the collectives cost per decode step, and their share of it
        from forge_engine.tensor_parallel.collective_timing import tensor_parallel_report

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
def add_arguments(workloads) -> None:
    "The `forge-engine bench` subcommands, on the subparsers `workloads`."
    from forge_engine import load_client

    runs = [
        ("w1", "single stream"),
        ("w2", "offline throughput"),
        ("w3", "online serving against a server started here"),
        ("w4", "CPU classroom: 1 and 8 requests"),
        ("w5", "speculative decoding against none: rewriting a given text, batch 1"),
        ("all", "several workloads in one run (--workloads)"),
    ]
    for name, what in runs:
        w = workloads.add_parser(name, help=what)
        w.add_argument("--model", default="auto")
        w.add_argument("--device", default=None)
        w.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
        w.add_argument(
            "--batch-invariant",
            action="store_true",
            help="fixed-shape execution (slower, batch-invariant)",
        )
        w.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly on a GPU")
        w.add_argument(
            "--no-async-scheduling",
            dest="async_scheduling",
            action="store_const",
            const=False,
            default=None,
            help="read each step's tokens before building the next (chapter 08's overlap off)",
        )
        w.add_argument(
            "--async-scheduling",
            dest="async_scheduling",
            action="store_const",
            const=True,
            help="overlap steps where it is not the default (the CPU)",
        )
        w.add_argument(
            "--max-num-seqs",
            type=int,
            default=None,
            help="sequences per step at most (EngineConfig)",
        )
        w.add_argument(
            "--max-num-batched-tokens",
            type=int,
            default=None,
            help="tokens per step at most (EngineConfig)",
        )
        w.add_argument(
            "--num-prompts", type=int, default=None, help="w2: how many requests (default 256)"
        )
        w.add_argument("--output-len", type=int, default=None, help="new tokens per request")
        w.add_argument(
            "--speculative-tokens",
            type=int,
            default=None,
            help="draft tokens by prompt lookup (chapter 08c); w5: the drafts it measures (default 3)",
        )
        w.add_argument(
            "--peers",
            action="store_true",
            help="also run the peers: transformers on the same weights; on a GGUF file at w4, "
            "llama.cpp too (llama-cpp-python, when installed)",
        )
        w.add_argument(
            "--peer-output-len",
            type=int,
            default=None,
            help="w1 peers: new tokens (default: --output-len)",
        )
        w.add_argument(
            "--peer-num-prompts", type=int, default=None, help="w2 peer: the first N prompts only"
        )
        w.add_argument(
            "--rates",
            default="1,4,16,inf",
            help="w3: request rates, comma-separated (inf: all at once)",
        )
        w.add_argument("--w3-num-prompts", type=int, default=64, help="w3: requests per rate")
        w.add_argument("--w3-max-tokens", type=int, default=128, help="w3: tokens per reply")
        w.add_argument("--prompt-words", type=int, default=64, help="w3: words per prompt")
        w.add_argument(
            "--json", default=None, help="also write the result to this file (one workload)"
        )
        w.add_argument(
            "--tensor-parallel-size",
            type=int,
            default=1,
            help="w1/w2: split the model over this many GPUs",
        )
        add_quantization_flag(w)
        add_memory_budget_flag(w)
        w.add_argument(
            "--out",
            default="docs/benchmarks" if name == "all" else None,
            help="save results (and plots) under DIR/<hardware>/"
            + (" (default docs/benchmarks)" if name == "all" else ""),
        )
        if name == "all":
            w.add_argument(
                "--workloads",
                default=None,
                help="comma-separated (default: w1,w2,w3 on a GPU, w3,w4 on a CPU)",
            )
    plot = workloads.add_parser(
        "plot", help="draw the plots of saved results (PNG next to each JSON)"
    )
    plot.add_argument("results", nargs="+", help="result JSON files")
    report = workloads.add_parser(
        "report", help="rewrite the result tables of markdown files from their result files"
    )
    report.add_argument(
        "docs", nargs="+", help="markdown files with '<!-- bench report: GLOB -->' blocks"
    )
    report.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if a table is stale"
    )
    load_client.add_arguments(
        workloads.add_parser("serve", help="W3: Poisson load against a running server (--url)")
    )


def run_from_args(args) -> int:
    "`forge-engine bench w1|w2|w3|w4|w5|all|plot|report`."
    log = lambda msg: print(msg, file=sys.stderr)
    if args.workload == "plot":
        from forge_engine.bench_plots import save_plots

        for path in save_plots(args.results):
            print(path)
        return 0
    if args.workload == "report":
        from forge_engine.bench_report import update_report_blocks

        stale = [doc for doc in args.docs if update_report_blocks(doc, check=args.check)]
        for doc in stale:
            log(f"{doc}: " + ("stale (run without --check)" if args.check else "rewritten"))
        return 1 if args.check and stale else 0
    args.model, args.device = pick_model(args.model, args.device, log)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.workload == "all":
        default = "w1,w2,w3" if device.type == "cuda" else "w3,w4"
        names = [n.strip() for n in (args.workloads or default).split(",")]
        if bad := [n for n in names if n not in ("w1", "w2", "w3", "w4", "w5")]:
            raise ValueError(f"unknown workload(s) {bad}")
        names.sort(
            key=lambda n: n != "w3"
        )  # W3 first: its server needs the memory the others would hold
    else:
        names = [args.workload]
    if args.peers and package_version("transformers") is None:
        raise ValueError("--peers needs transformers installed")
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
                loaded = load_model_over(
                    args.model,
                    args.device,
                    args.dtype,
                    progress=False,
                    quantization=args.quantization,
                    tensor_parallel_size=args.tensor_parallel_size,
                    memory_budget=args.gpu_memory_budget,
                    gpu_layers=args.gpu_layers,
                    offload=args.offload,
                )
            result = run_offline(name, loaded, args, ceiling)
        result["environment"] = env
        results.append(result)
        log(summary_line(result))
    if loaded is not None and loaded.parallel is not None:
        loaded.parallel.close()
    if len(results) == 1:
        text = json.dumps(results[0], indent=1)
        print(text)
        if args.json:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    if args.out:
        from forge_engine.bench_plots import save_plots

        paths = [save_result(r, args.out) for r in results]
        for path in paths + save_plots(paths):
            log(f"wrote {path}")
    return 0


# %% [markdown]
# A run of the command in this process on the tiny model, and its plots drawn from the saved
# files:

# %%
parser = argparse.ArgumentParser()
add_arguments(parser.add_subparsers(dest="workload"))
with tempfile.TemporaryDirectory() as out:
    args = parser.parse_args(
        [
            "all",
            "--model",
            "random:qwen3-tiny",
            "--device",
            "cpu",
            "--workloads",
            "w4",
            "--output-len",
            "8",
            "--peers",
            "--out",
            out,
        ]
    )
    assert run_from_args(args) == 0
    [folder] = os.listdir(out)
    files = sorted(os.listdir(os.path.join(out, folder)))
    print(files)
    w4_file = next(
        os.path.join(out, folder, f) for f in files if f.startswith("w4-") and f.endswith(".json")
    )
    with open(w4_file) as f:
        saved = json.load(f)
    assert (
        saved["environment"]["cpu"] == cpu_name()
        and len(saved["peers"]) == 2
        and saved["peers"][0]["ratio"] > 0
    )
    # llama.cpp runs GGUF files only: this run says it skipped it, and why
    assert saved["peers_skipped"] == [
        {"peer": "llama.cpp", "why": "it runs GGUF files, and random:qwen3-tiny is not one"}
    ]
    assert [f.split("-")[0] for f in files if f.endswith(".json")] == ["w4"]
    assert any(f.endswith("-timeline.png") for f in files) and any(
        f.startswith("roofline-") for f in files
    )
    assert any(f.startswith("w4-") and f.endswith("-throughput.png") for f in files)
    assert all(os.path.getsize(os.path.join(out, folder, f)) > 1000 for f in files)
    with pytest.raises(ValueError, match="unknown workload"):
        run_from_args(
            parser.parse_args(["all", "--model", "random:qwen3-tiny", "--workloads", "w9"])
        )
