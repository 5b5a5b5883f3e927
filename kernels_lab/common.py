"""What every kernels_lab file shares: the ceilings, a timer, validation and a results table.

Run a lab file from the repository root: `PYTHONPATH=. python3 kernels_lab/<file>.py`.
On a CPU it validates every variant against the reference under Triton's interpreter at
small sizes; on a CUDA GPU it also validates at real sizes and benchmarks."""

import functools
import json
import os
import sys
import time

import torch

import forge_engine.kernels.backend  # noqa: F401  on a CPU it sets TRITON_INTERPRET=1, which must precede `import triton`

# H200 ceilings, as chapter 13's `ceilings` measures them
HBM_BYTES_PER_S = 4.19e12  # read bandwidth, x.sum() over 4 GiB
BF16_FLOP_PER_S = 790e12  # dense bf16 matmul
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def host_timer(seconds: dict):
    "timed(name, fn): fn wrapped to add its host seconds to seconds[name] (a Counter), however it returns."

    def timed(name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - start

        return wrapper

    return timed


def best_host_s(fn, reps: int = 30, rounds: int = 5) -> float:
    "Host seconds of one fn() call: the best mean over `rounds` of `reps` calls (on a shared CPU, the least disturbed)."
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def median_ms(fn) -> float:
    "Median GPU time of fn() in ms; do_bench flushes the L2 cache before every run, so nothing is cached."
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=40, return_mode="median")


def graphed_ms(fn) -> float:
    """Median GPU time of a CUDA-graph replay of fn() (L2 flushed before each replay): what the engine pays
    under CUDA graphs, without Python's launch overhead, which dominates small kernels timed eagerly."""
    fn()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay)


def launches_us(fn, launches: int) -> float:
    """fn(0) .. fn(launches - 1) replayed as one CUDA graph (`graphed_ms`): µs a call. Over as many copies of the
    weights (or pools) as a step's layers, what a kernel costs inside the step's graph, each launch after the last."""
    return graphed_ms(lambda: [fn(i) for i in range(launches)]) * 1000 / launches


def profiled_launch(warm, call, label: str):
    """warm() three times, then call() once inside an NVTX range `profile`: the launch ncu's `--nvtx-include
    "profile/"` takes (warm and call on different copies of the data, so the profiled one reads cold memory)."""
    for _ in range(3):
        warm()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("profile")
    call()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    print(f"profiled: {label}", flush=True)


def time_variant(fn, graph: bool) -> tuple[float, str]:
    "(ms, how): graphed when `graph` (the variant reads nothing back to the host), else eager."
    if graph:
        try:
            return graphed_ms(fn), "graph"
        except RuntimeError as e:  # not capturable after all: say so and time it eagerly
            print(f"  (no CUDA graph: {str(e).splitlines()[0][:100]})")
            torch.cuda.synchronize()
    return median_ms(fn), "eager"


def selected(variants: dict) -> dict:
    "The variants whose names start with one of the comma-separated prefixes in $LAB_VARIANTS (default: all)."
    prefixes = [p for p in os.environ.get("LAB_VARIANTS", "").split(",") if p]
    return {
        k: v for k, v in variants.items() if not prefixes or any(k.startswith(p) for p in prefixes)
    }


def c_build_with(name: str, source: str, exported: str, value: str, function: str, *argtypes):
    """`function` of a C kernel's `source` built with its line `exported` as `value` instead (a tuning constant's
    other setting), under its own name in the build cache."""
    from forge_engine.kernels.cpu import c_function, load_cpu_kernel

    assert exported in source, f"the source no longer says {exported!r}"
    library = load_cpu_kernel(name, source.replace(exported, value))
    if isinstance(library, str):
        raise RuntimeError(f"{name}: {library}")
    return c_function(library, function, *argtypes)


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    "||got - want|| / ||want|| in fp64; NaN never passes."
    got, want = got.double(), want.double()
    err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    return float("inf") if err != err else err


def validate(label: str, got: torch.Tensor, want: torch.Tensor, limit: float) -> bool:
    err = rel_error(got, want)
    ok = err <= limit
    print(f"  {'ok  ' if ok else 'FAIL'} {label:60s} rel err {err:.2e} (limit {limit:.0e})")
    return ok


class Results:
    "Rows of a benchmark: printed as a table at the end, and appended as JSON lines to $LAB_RESULTS if set."

    def __init__(self, kernel: str):
        self.kernel, self.rows = kernel, []

    def add(self, case: str, variant: str, ms: float, bytes_moved: float = 0.0, flops: float = 0.0):
        row = dict(
            kernel=self.kernel,
            case=case,
            variant=variant,
            us=ms * 1e3,
            gb_s=bytes_moved / ms / 1e6 if bytes_moved else None,
            bw_ratio=bytes_moved / (ms / 1e3) / HBM_BYTES_PER_S if bytes_moved else None,
            tflop_s=flops / ms / 1e9 if flops else None,
            flop_ratio=flops / (ms / 1e3) / BF16_FLOP_PER_S if flops else None,
        )
        self.rows.append(row)
        print(
            f"  {case:34s} {variant:44s} {ms * 1e3:9.1f} us", flush=True
        )  # as it comes: a timeout keeps it
        if os.environ.get("LAB_RESULTS"):
            with open(os.environ["LAB_RESULTS"], "a") as f:
                f.write(json.dumps(row) + "\n")

    def print(self):
        print(
            f"\n== {self.kernel}: median of do_bench (L2 flushed), [graph] = one CUDA-graph replay, [eager] = "
            f"launched from Python; ratios vs 4.19 TB/s read, 790 TFLOP/s bf16"
        )
        print(
            f"{'case':34s} {'variant':44s} {'us':>9s} {'GB/s':>8s} {'%bw':>6s} {'TFLOP/s':>8s} {'%flop':>6s}"
        )
        for r in self.rows:
            gb = f"{r['gb_s']:8.0f}" if r["gb_s"] else " " * 8
            bw = f"{100 * r['bw_ratio']:5.1f}%" if r["bw_ratio"] else " " * 6
            tf = f"{r['tflop_s']:8.1f}" if r["tflop_s"] else " " * 8
            fr = f"{100 * r['flop_ratio']:5.1f}%" if r["flop_ratio"] else " " * 6
            print(f"{r['case']:34s} {r['variant']:44s} {r['us']:9.1f} {gb} {bw} {tf} {fr}")


def finish(all_ok: bool):
    print("\nALL VARIANTS VALID" if all_ok else "\nSOME VARIANT FAILED VALIDATION")
    sys.exit(0 if all_ok else 1)
