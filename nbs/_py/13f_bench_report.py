# %% [markdown]
# # Benchmark report
#
# > The tables of `docs/benchmarks.md` and the README, written from the committed result files: a figure in the docs is always what a result file says.

# %%
#| default_exp bench_report

# %% [markdown]
# A benchmark writes a JSON result that records what ran (workload, model, weights, engine
# settings), what it measured, the ceilings and peers measured in the same run, and the
# environment (hardware, versions, commit, command line). The docs never copy a figure by hand:
# a document holds blocks
#
# ```
# <!-- bench report: benchmarks/nvidia-h200/*-abc1234.json -->
# ...the table...
# <!-- end bench report -->
# ```
#
# and `forge-engine bench report DOC...` rewrites each block's table from the files its glob
# names (relative to the document), each row linking to its file. `--check` only says whether a
# block is stale; the test suite runs it on the README and `docs/benchmarks.md`.

# %%
#| export
from __future__ import annotations

import glob
import json
import os
import re

from forge_engine.bench import rate_label

# %%
#| hide
import tempfile

import pytest


# %%
#| export
def weights_label(result: dict) -> str:
    "BF16, FP32, or the quantization that ran (int8, int4, gguf)."
    quantization = result.get("quantization", "none")
    return (
        {"bfloat16": "BF16", "float32": "FP32", "float16": "FP16"}.get(
            result["dtype"], result["dtype"]
        )
        if quantization == "none"
        else quantization
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def _peers(result: dict, batch: int | None = None) -> tuple[str, str]:
    """The peers measured in the same run (those of one batch size, if given): what they did, and our ratio, in the
    figure the ratio compares (decode tok/s at W1, output tok/s at W2 and W4)."""
    peers = [p for p in result.get("peers", []) if batch is None or p.get("batch") == batch]
    if not peers:
        return "—", "—"

    def what(p):
        if "forge_engine_output_tok_s_same_prompts" in p:
            return (
                f"{p['peer']}: {p['output_tok_s']:,.0f} tok/s on the first {p['requests']} prompts "
                f"(forge-engine {p['forge_engine_output_tok_s_same_prompts']:,.0f} on the same)"
            )
        if batch is not None:
            return f"{p['peer']}: {p['output_tok_s']:.1f} output tok/s"
        return f"{p['peer']}: {p['decode_tok_s']:.1f} tok/s"

    return "; ".join(map(what, peers)), "; ".join(f"**{p['ratio']:.2f}×**" for p in peers)


def report_rows(result: dict) -> list[list[str]]:
    "Rows of (what, forge-engine, against the ceiling, peer in the same run, ratio to the peer) for one result."
    w, weights = result["workload"], None if result["workload"] == "W3" else weights_label(result)
    if w == "W1":
        share = result.get("ratio_to_read_ceiling")
        ceiling = (
            "—"
            if share is None
            else (
                f"{result['achieved_bytes_per_s'] / 1e12:.2f} TB/s, {share:.0%} of the "
                f"read ceiling ({result['ceilings']['read_bytes_per_s'] / 1e12:.2f} TB/s)"
            )
        )
        return [
            [
                f"W1 decode, batch 1, {weights}",
                f"{result['decode_tok_s']:.1f} tok/s, TTFT {_ms(result['ttft_s'])}",
                ceiling,
                *_peers(result),
            ]
        ]
    if w == "W2":
        point = (result.get("decode_points") or [None])[0]
        ceiling = (
            "—"
            if point is None
            else (
                f"decode at batch {point['batch']}: {point['bytes_per_s'] / 1e12:.2f} TB/s "
                f"(weights + KV held)"
            )
        )
        return [
            [
                f"W2 offline, {result['requests']} requests, {weights}",
                f"{result['output_tok_s']:,.0f} output tok/s ({result['output_tokens']:,} tokens in "
                f"{result['wall_s']:.1f} s)",
                ceiling,
                *_peers(result),
            ]
        ]
    if w == "W4":

        def peers(n, run):
            "The peers at n requests, and at n > 1 llama.cpp's one stream too (what batching is measured against)."
            what, ratio = _peers(result, n)
            whats, ratios = ([], []) if what == "—" else ([what], [ratio])
            for p in result.get("peers", []):
                if n > 1 and p["peer"] == "llama.cpp" and p.get("batch") == 1:
                    whats.append(f"llama.cpp, 1 request: {p['output_tok_s']:.1f} output tok/s")
                    ratios.append(f"**{run['output_tok_s'] / p['output_tok_s']:.2f}×**")
            return "; ".join(whats) or "—", "; ".join(ratios) or "—"

        return [
            [
                f"W4 {n} request{'s' if n > 1 else ''} at once, {weights}",
                f"{run['output_tok_s']:.1f} output tok/s, TTFT {_ms(run['ttft_median_s'])}",
                "—",
                *peers(n, run),
            ]
            for n, run in (
                (int(k.split("_")[1]), v) for k, v in result.items() if k.startswith("concurrency_")
            )
        ]
    if w == "W3":

        def figures(r):
            if not r.get("ttft_ms"):
                return f"{r['failed']} of {r['failed'] + r['completed']} requests failed"
            return (
                f"{r['output_throughput']:,.0f} output tok/s; TTFT p50 {r['ttft_ms']['p50']:.0f} / p99 "
                f"{r['ttft_ms']['p99']:.0f} ms; TPOT p50 {r['tpot_ms']['p50']:.1f} ms; ITL p99 "
                f"{r['itl_ms']['p99']:.1f} ms"
            )

        return [
            [
                f"W3 serving, {rate_label(r['rate'])}, {result['num_prompts']} × {result['max_tokens']} tokens",
                figures(r),
                "—",
                "—",
                "—",
            ]
            for r in result["runs"]
        ]
    if w == "W5":
        return [
            [
                f"W5 speculative decoding, prompt lookup, {result['speculative_tokens']} drafts, batch 1, "
                f"rewriting a given text, {weights}",
                f"{result['on_decode_tok_s']:.1f} tok/s; acceptance {result['acceptance_rate']:.0%}, "
                f"{result['mean_accepted_length']:.2f} tokens a verify step; the same tokens",
                "—",
                f"speculation off: {result['off_decode_tok_s']:.1f} tok/s",
                f"**{result['speedup']:.2f}×**",
            ]
        ]
    raise ValueError(f"no report rows for workload {w!r}")


def environment_line(env: dict) -> str:
    "The hardware and versions a set of results ran on, in one line."
    hardware = f"{env['gpu']}" if env.get("gpu") else f"{env['cpu']}, {env['cpu_count']} cores"
    versions = [f"torch {env['torch']}"] + [
        f"{name} {env[key]}"
        for name, key in (("CUDA", "cuda"), ("Triton", "triton"), ("transformers", "transformers"))
        if env.get(key)
    ]
    return f"{hardware} ({', '.join(versions)})"


WEIGHTS_ORDER = [
    "FP32",
    "FP16",
    "BF16",
    "int8",
    "int4",
    "gguf",
]  # within a workload, rows by bytes per weight


def report_order(result: dict) -> tuple[str, int]:
    "Where a result's rows go in a table: by workload, then by bytes per weight (W3 has no weights of its own)."
    label = weights_label(result) if "dtype" in result else "BF16"
    return result["workload"], WEIGHTS_ORDER.index(label) if label in WEIGHTS_ORDER else len(
        WEIGHTS_ORDER
    )


HEADER = ["result", "forge-engine", "against the ceiling", "peer, same run", "ratio", "file"]


def report_table(paths: list[str], link_from: str = ".") -> str:
    """A markdown table of the results in `paths` (in W1, W2, W3, W4 order, BF16 before int8 before int4), each row
    linking to its file."""
    results = sorted(
        ((p, json.load(open(p))) for p in paths), key=lambda pr: (*report_order(pr[1]), pr[0])
    )
    if not results:
        raise ValueError("no result files to report")
    environments = {environment_line(r["environment"]) for _, r in results}
    commits = {
        r["environment"].get("commit", "?") + ("-dirty" if r["environment"].get("dirty") else "")
        for _, r in results
    }
    lines = [
        f"{' / '.join(sorted(environments))}; commit {', '.join(sorted(commits))}; model "
        f"`{'`, `'.join(sorted({r['model'] for _, r in results}))}`",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    for path, result in results:
        link = f"[{os.path.basename(path)}]({os.path.relpath(path, link_from)})"
        lines += ["| " + " | ".join(row + [link]) + " |" for row in report_rows(result)]
    return "\n".join(lines)


# %% [markdown]
# A document's blocks are found by their markers; everything between them is replaced, and a
# glob that names no file is an error rather than an empty table.

# %%
#| export
BLOCK = re.compile(
    r"(<!-- bench report: (?P<glob>[^>]+?) -->\n)(?P<body>.*?)(<!-- end bench report -->)", re.S
)


def update_report_blocks(doc: str, check: bool = False) -> bool:
    "Rewrite every report block of the markdown file `doc` from its result files; True if any was stale."
    with open(doc) as f:
        text = f.read()
    folder = os.path.dirname(os.path.abspath(doc))

    def table(match):
        paths = sorted(glob.glob(os.path.join(folder, match["glob"])))
        if not paths:
            raise ValueError(f"{doc}: no result file matches {match['glob']!r}")
        return match[1] + report_table(paths, folder) + "\n" + match[4]

    new, count = BLOCK.subn(table, text)
    if count == 0:
        raise ValueError(f"{doc}: no '<!-- bench report: GLOB -->' block")
    if new != text and not check:
        with open(doc + ".tmp", "w") as f:
            f.write(new)
        os.replace(doc + ".tmp", doc)  # never a half-written document
    return new != text


# %% [markdown]
# ## Tests
#
# A report of made-up results: each figure appears as the result file says, rows come in
# workload order, and a stale block is found, rewritten, and then reads as current.

# %%
env = {
    "gpu": "NVIDIA H200",
    "torch": "2.11.0",
    "cuda": "13.0",
    "triton": "3.6.0",
    "commit": "abc1234",
    "dirty": False,
}
w1 = {
    "workload": "W1",
    "model": "random:qwen3-4b",
    "dtype": "bfloat16",
    "quantization": "int4",
    "decode_tok_s": 841.84,
    "ttft_s": 0.0213,
    "achieved_bytes_per_s": 2.5e12,
    "ratio_to_read_ceiling": 0.6,
    "environment": env,
    "ceilings": {"read_bytes_per_s": 4.19e12},
    "peers": [],
}
w2 = {
    "workload": "W2",
    "model": "random:qwen3-4b",
    "dtype": "bfloat16",
    "requests": 256,
    "output_tok_s": 15309.2,
    "output_tokens": 131072,
    "wall_s": 8.56,
    "environment": env,
    "decode_points": [],
    "peers": [
        {
            "peer": "transformers generate_batch",
            "requests": 64,
            "output_tok_s": 494.0,
            "forge_engine_output_tok_s_same_prompts": 10400.0,
            "ratio": 21.05,
        }
    ],
}
w3 = {
    "workload": "W3",
    "model": "random:qwen3-4b",
    "num_prompts": 64,
    "max_tokens": 128,
    "environment": env,
    "runs": [
        {
            "rate": "inf",
            "completed": 64,
            "failed": 0,
            "output_throughput": 9175.0,
            "ttft_ms": {"p50": 182, "p99": 300},
            "tpot_ms": {"p50": 5.4},
            "itl_ms": {"p99": 12.5},
        },
        {"rate": 1.0, "completed": 0, "failed": 64, "ttft_ms": {}},
    ],
}
with tempfile.TemporaryDirectory() as tmp:
    paths = []
    w1_int8 = {**w1, "quantization": "int8", "decode_tok_s": 637.9}
    for name, result in [
        ("w3.json", w3),
        ("w1.json", w1),
        ("w2.json", w2),
        ("w1-int8.json", w1_int8),
    ]:
        paths.append(os.path.join(tmp, "gpu", name))
        os.makedirs(os.path.dirname(paths[-1]), exist_ok=True)
        with open(paths[-1], "w") as f:
            json.dump(result, f)
    table = report_table(paths, tmp)
    print(table)
    rows = table.splitlines()[4:]
    assert [r.split(" | ")[0] for r in rows] == [
        "| W1 decode, batch 1, int8",
        "| W1 decode, batch 1, int4",
        "| W2 offline, 256 requests, BF16",
        "| W3 serving, all at once, 64 × 128 tokens",
        "| W3 serving, 1 req/s, 64 × 128 tokens",
    ]
    assert "637.9 tok/s" in rows[0] and "841.8 tok/s, TTFT 21 ms" in rows[1]
    assert "60% of the read ceiling (4.19 TB/s)" in rows[1] and rows[1].endswith(
        "[w1.json](gpu/w1.json) |"
    )
    assert (
        "15,309 output tok/s" in rows[2]
        and "**21.05×**" in rows[2]
        and "10,400 on the same" in rows[2]
    )
    assert "TTFT p50 182 / p99 300 ms" in rows[3] and "64 of 64 requests failed" in rows[4]
    assert "NVIDIA H200 (torch 2.11.0, CUDA 13.0" in table
    doc = os.path.join(tmp, "doc.md")
    with open(doc, "w") as f:
        f.write(
            "# Figures\n<!-- bench report: gpu/w[12].json -->\nold\n<!-- end bench report -->\n"
        )
    assert (
        update_report_blocks(doc, check=True) and "old" in open(doc).read()
    )  # --check writes nothing
    assert update_report_blocks(doc) and not update_report_blocks(doc, check=True)
    assert "W3" not in open(doc).read() and "| W2 offline" in open(doc).read()
    with open(doc, "w") as f:
        f.write("<!-- bench report: gpu/w9*.json -->\n<!-- end bench report -->\n")
    with pytest.raises(ValueError, match="no result file matches 'gpu/w9\\*.json'"):
        update_report_blocks(doc)
    with pytest.raises(ValueError, match="no report rows for workload 'W9'"):
        report_rows({**w2, "workload": "W9"})

# %% [markdown]
# W4's row at 8 requests also sets the aggregate beside llama.cpp's one stream: what batching on
# the CPU is measured against (one weight read serves eight rows).

# %%
w4 = {
    "workload": "W4",
    "model": "smollm2-135m-instruct",
    "quantization": "gguf",
    "environment": env,
    "concurrency_1": {"output_tok_s": 41.0, "ttft_median_s": 0.042},
    "concurrency_8": {"output_tok_s": 138.0, "ttft_median_s": 0.196},
    "peers": [
        {"peer": "transformers generate", "batch": 8, "output_tok_s": 88.0, "ratio": 1.57},
        {"peer": "llama.cpp", "batch": 1, "output_tok_s": 100.0, "ratio": 0.41},
    ],
}
one, eight = report_rows(w4)
assert one[3] == "llama.cpp: 100.0 output tok/s" and one[4] == "**0.41×**"
assert eight[3] == (
    "transformers generate: 88.0 output tok/s; llama.cpp, 1 request: 100.0 output tok/s"
)
assert eight[4] == "**1.57×**; **1.38×**"
w4_alone = {**w4, "peers": [w4["peers"][1]]}  # no peer at 8 requests: llama.cpp's one stream alone
assert report_rows(w4_alone)[1][3:] == ["llama.cpp, 1 request: 100.0 output tok/s", "**1.38×**"]
