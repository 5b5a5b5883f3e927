# %% [markdown]
# # Benchmark plots
#
# > Throughput against concurrency, TTFT and ITL distributions, KV cache and batch over time, and decode steps on the roofline: drawn from result files.

# %%
#| default_exp bench_plots

# %% [markdown]
# matplotlib is imported only here, when a plot is drawn, and through its object interface
# (`Figure`), so drawing needs no display and leaves no global state. Every function takes
# result dictionaries (as saved in the JSON files) and returns a `Figure`, or None when the
# results hold nothing it can draw. `forge-engine bench plot RESULT.json...` draws them
# again from saved files.

# %%
#| export
from __future__ import annotations

import json
import os

from forge_engine.bench import rate_label, result_stem

# %%
#| hide
import tempfile

from forge_engine.bench import ceilings, w2_offline_throughput, w4_cpu_classroom
from forge_engine.config import EngineConfig, preset
from forge_engine.loader import LoadedModel
from forge_engine.model import empty_model, init_random_weights


# %%
#| export
def _figure(rows: int = 1, cols: int = 1, size=(7, 3.5)):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(size[0] * cols, size[1] * rows), layout="constrained")
    return fig, fig.subplots(rows, cols, squeeze=False)


def plot_timeline(result: dict):
    "KV-cache usage and batch size over time: the engine's step records (offline) or /metrics samples (W3)."
    fig, axes = _figure(2, 1, size=(8, 2.6))
    kv_ax, batch_ax = axes[0][0], axes[1][0]
    if result["workload"] == "W3":
        for run in result["runs"]:
            g = run["gauges"]
            kv_ax.plot(g["t_s"], [100 * u for u in g["kv_usage"]], label=rate_label(run["rate"]))
            batch_ax.plot(g["t_s"], g["running"], label=f"running, {rate_label(run['rate'])}")
        batch_ax.set(ylabel="requests running")
    elif "timeline" in result:
        t = result["timeline"]
        kv_ax.plot(
            t["t_s"],
            [100 * b / t["kv_total_blocks"] for b in t["kv_used_blocks"]],
            label="KV blocks held",
        )
        batch_ax.plot(t["t_s"], t["decode_seqs"], label="decoding sequences")
        prefill_ax = batch_ax.twinx()
        prefill_ax.plot(
            t["t_s"], t["prefill_tokens"], color="tab:orange", alpha=0.5, label="prompt tokens"
        )
        prefill_ax.set(ylabel="prompt tokens in the step")
        batch_ax.set(ylabel="decoding sequences")
    else:
        return None
    kv_ax.set(
        ylabel="KV cache used (%)",
        title=f"{result['workload']}, {result['model']}: KV cache and batch over time",
    )
    batch_ax.set(xlabel="seconds")
    kv_ax.legend(fontsize="small")
    return fig


def plot_latencies(result: dict):
    "TTFT and ITL distributions at each W3 rate (empirical CDFs)."
    if result["workload"] != "W3":
        return None
    fig, axes = _figure(1, 2, size=(5, 3.5))
    for run in result["runs"]:
        ok = [r for r in run["requests"] if r["ok"]]
        for ax, values in (
            (axes[0][0], [r["ttft_s"] for r in ok]),
            (axes[0][1], [g for r in ok for g in r["itl_s"]]),
        ):
            ms = sorted(v * 1000 for v in values)
            ax.plot(ms, [(i + 1) / len(ms) for i in range(len(ms))], label=rate_label(run["rate"]))
    axes[0][0].set(xlabel="time to first token (ms)", ylabel="fraction of requests", title="TTFT")
    axes[0][1].set(
        xlabel="inter-token latency (ms)", ylabel="fraction of gaps", title="ITL", xscale="log"
    )
    axes[0][0].legend(fontsize="small")
    return fig


def plot_throughput(result: dict):
    "Output tok/s against the number of requests in flight (W3: mean concurrency per rate; W4: 1 and 8)."
    peers = {}  # W4's peers, a line each: label -> (requests, output tok/s)
    if result["workload"] == "W3":
        points = [
            (r["mean_concurrency"], r["output_throughput"], rate_label(r["rate"]))
            for r in result["runs"]
        ]
    elif result["workload"] == "W4":
        points = [
            (int(k.split("_")[1]), v["output_tok_s"], None)
            for k, v in result.items()
            if k.startswith("concurrency_")
        ]
        for peer in result.get("peers", []):
            label = "llama.cpp" if peer["peer"] == "llama.cpp" else "transformers generate"
            peers.setdefault(label, []).append((peer["batch"], peer["output_tok_s"]))
    else:
        return None
    fig, axes = _figure()
    ax = axes[0][0]
    ax.plot(*zip(*[(x, y) for x, y, _ in points]), "o-", label="forge-engine")
    for (label, xy), style in zip(peers.items(), ("s--", "^:")):
        ax.plot(*zip(*xy), style, label=label)
    for x, y, label in points:
        if label:
            ax.annotate(label, (x, y), fontsize="small")
    ax.set(
        xlabel="requests in flight",
        ylabel="output tok/s",
        title=f"{result['workload']}, {result['model']}: throughput",
    )
    ax.legend(fontsize="small")
    return fig


def plot_roofline(results: list[dict]):
    "Decode steps of every result on the roofline of the ceilings measured in the same run."
    points = [p for r in results for p in r.get("decode_points", []) if p]
    ceiling = next((r["ceilings"] for r in results if r.get("ceilings")), None)
    if not points or not ceiling:
        return None
    bw, peak = ceiling["read_bytes_per_s"], ceiling["matmul_flops_per_s"]
    fig, axes = _figure(size=(7, 4.5))
    ax = axes[0][0]
    intensities = [p["flops"] / (p["weight_bytes"] + p["kv_bytes"]) for p in points]
    xs = [min(intensities + [1]) / 4, max(intensities + [peak / bw]) * 4]
    ridge = peak / bw
    ax.plot([xs[0], ridge, xs[1]], [bw * xs[0], peak, peak], "k-", lw=1)
    ax.annotate(f"read {bw / 1e12:.2f} TB/s", (xs[0], bw * xs[0]), fontsize="small", va="bottom")
    ax.annotate(f"matmul {peak / 1e12:.0f} TFLOP/s", (ridge, peak), fontsize="small", va="bottom")
    for p, x in zip(points, intensities):
        ax.plot(x, p["flops_per_s"], "o")
        roof = min(peak, bw * x)
        ax.annotate(
            f"{p['label']}: {p['bytes_per_s'] / 1e9:.0f} GB/s, {p['flops_per_s'] / roof:.0%} of roof",
            (x, p["flops_per_s"]),
            fontsize="small",
            xytext=(4, -10),
            textcoords="offset points",
        )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="FLOPs per byte read (weights + KV)",
        ylabel="FLOP/s achieved",
        title=f"decode steps on the roofline ({ceiling['dtype']})",
    )
    return fig


def load_result(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


PLOTS = {"timeline": plot_timeline, "latency": plot_latencies, "throughput": plot_throughput}


def save_plots(paths: list[str]) -> list[str]:
    "Draw every plot the result files at `paths` allow, as PNGs next to them; the PNG paths."
    results = [load_result(p) for p in paths]
    written = []
    for path, result in zip(paths, results):
        for kind, plot in PLOTS.items():
            if (fig := plot(result)) is not None:
                written.append(path.removesuffix(".json") + f"-{kind}.png")
                fig.savefig(written[-1], dpi=110)
    if (fig := plot_roofline(results)) is not None:
        written.append(
            os.path.join(os.path.dirname(paths[0]), f"roofline-{result_stem(results[0])}.png")
        )
        fig.savefig(written[-1], dpi=110)
    return written


# %% [markdown]
# ## Drawing real results
#
# W2 and W4 on a tiny random model (its figures mean nothing; the shapes of the plots do),
# and a W3 result shaped as `bench_server.w3_online_serving` writes it, with two requests.

# %%
tiny = LoadedModel(
    "random:qwen3-tiny", init_random_weights(empty_model(preset("qwen3-tiny")), seed=0), None, None
)
config = EngineConfig(kv_cache_bytes=8 * 2**20, max_num_seqs=8, max_num_batched_tokens=256)
env = {"forge_engine": "0.1.0", "commit": "abc1234", "cpu": "a CPU", "cpu_count": 2}
w2 = {
    **w2_offline_throughput(tiny, config, count=8, min_len=4, max_len=32, new_tokens=8),
    "model": tiny.name,
    "environment": env,
    "ceilings": ceilings("cpu"),
}
w4 = {**w4_cpu_classroom(tiny, config, new_tokens=8), "model": tiny.name, "environment": env}
request = lambda ttft, gaps: {"ok": True, "ttft_s": ttft, "itl_s": gaps}
w3 = {
    "workload": "W3",
    "model": "m",
    "environment": env,
    "runs": [
        {
            "rate": rate,
            "output_throughput": tps,
            "mean_concurrency": conc,
            "requests": [request(0.1, [0.02, 0.03]), request(0.2, [0.05])],
            "gauges": {"t_s": [0.0, 0.1, 0.2], "running": [1, 2, 0], "kv_usage": [0.1, 0.2, 0.0]},
        }
        for rate, tps, conc in ((4.0, 50.0, 1.5), ("inf", 80.0, 2.0))
    ],
}

# %%
timeline = plot_timeline(w2)
kv_axis = timeline.axes[0]
assert len(kv_axis.lines) == 1 and list(kv_axis.lines[0].get_xdata()) == w2["timeline"]["t_s"]
assert max(kv_axis.lines[0].get_ydata()) > 0  # the KV cache was used, in percent of the pool
assert len(plot_timeline(w3).axes[0].lines) == 2  # one line per rate
latency = plot_latencies(w3)
assert [len(ax.lines) for ax in latency.axes] == [2, 2] and list(
    latency.axes[0].lines[0].get_xdata()
) == [100.0, 200.0]
throughput = plot_throughput(w3)
assert list(throughput.axes[0].lines[0].get_ydata()) == [50.0, 80.0]
assert plot_latencies(w2) is None and plot_throughput(w2) is None
w4_peers = [
    {"peer": "transformers generate (dynamic cache)", "batch": n, "output_tok_s": 10.0 * n}
    for n in (1, 8)
] + [{"peer": "llama.cpp", "batch": 1, "output_tok_s": 90.0}]
lines = plot_throughput({**w4, "peers": w4_peers}).axes[0].lines  # forge-engine, then each peer
assert [line.get_label() for line in lines] == [
    "forge-engine",
    "transformers generate",
    "llama.cpp",
]
assert list(lines[2].get_ydata()) == [90.0]
roofline = plot_roofline([w2, w4])
assert len(roofline.axes[0].lines) == 1 + len(w2["decode_points"]) + len(
    w4["decode_points"]
)  # the roof, then points
assert plot_roofline([w4]) is None  # no ceilings measured: nothing to draw against

# %%
with tempfile.TemporaryDirectory() as out:
    paths = []
    for result in (w2, w4, w3):
        paths.append(os.path.join(out, f"{result['workload'].lower()}.json"))
        with open(paths[-1], "w") as f:
            json.dump(result, f)
    written = save_plots(paths)
    names = sorted(os.path.basename(p) for p in written)
    print(names)
    assert names == [
        "roofline-random-qwen3-tiny-0.1.0-abc1234.png",
        "w2-timeline.png",
        "w3-latency.png",
        "w3-throughput.png",
        "w3-timeline.png",
        "w4-throughput.png",
        "w4-timeline.png",
    ]
    assert all(os.path.getsize(p) > 1000 for p in written)
