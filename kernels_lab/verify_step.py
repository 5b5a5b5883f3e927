"""Verify steps on a GPU (chapter 08c, with chapter 09b's verify graphs): what scoring k drafts costs against one
decode step, and what speculation gives at most.

Napkin math: at batch 1 a decode step of random Qwen3-4B reads about 8.05 GB of BF16 weights (2.39 ms at 419
tok/s). A verify step of 1 + k rows reads the same weights. Its extra work is small:
- k more rows of each matmul (cuBLAS instead of the one-row GEMV);
- k more rows of attention over a short context;
- K/V stored by a launch of its own before attention (the decode graph stores them inside the attention kernel).
So it should cost close to one decode step. The target is at most 1.15x at k = 4.

1. Step cost: the decode graph of 1 row against the verify graphs of 1 + k rows (k = 0..DRAFTS; an engine with
   DRAFTS drafts records graphs of 1, 2, 4 and 1 + DRAFTS rows, so 1 + 2 rows replay the 4-row one). One sequence with
   CONTEXT tokens of context; the median of 7 timings of REPLAYS steps each, inputs written as the engine writes them.
2. End to end: one request, greedy, NEW_TOKENS new tokens, without speculation, then with k = 4 and a proposer that
   is always right: it replays the tokens of a run with speculation, replayed until they are what the run gives
   (the first time, those of the run without; the verify rows' matmuls round otherwise than the one-row GEMV, so
   near ties of random weights flip tokens). That is the upper bound of the speed-up.

3. Where the time goes (LAB_PROFILE=1): the kernels of a decode graph of 1 row and of a verify graph of 1 + DRAFTS
   rows, by name, microseconds a step, under torch.profiler.

Run on a GPU from the repository root: PYTHONPATH=. python3 kernels_lab/verify_step.py [bf16,int8,int4]
(LAB_STEPS_ONLY=1: part 1 only; LAB_PROFILE=1: parts 1 and 3; LAB_ROWS_CONFIGS=FILE: the rows GEMV's configurations
per (N, K, rows) from few_rows_matmul.py's LAB_BEST_OUT in place of gemv_config's; LAB_SWAP="BN,BK,W,ST[;...]": part 1
also times verify graphs with their 2-16 BF16 rows through sixteen_rows_swap.py's bf16_swap in each tile, with the
step's kernels launched as dependents up to LAB_DEPENDENT_ROWS rows if set: chapter 09_kernels_gemv's
DEPENDENT_LAUNCH_MAX_ROWS); LAB_FOLDED="BN,BK,W,ST[;...]" and / or LAB_FOLDED_TILES=FILE: part 1 also times
verify graphs with their BF16 rows through folded_rows_matmul.py's kernel (`route_rows`: the norms handed off, SwiGLU
and the residual adds folded in); LAB_CONSTANTS="NAME=V,NAME=V;...": part 1 also times the verify graphs with the
kernels' tuning constants set as each group says (e.g. DECODE_TARGET_PROGRAMS=512: the attention's splits);
LAB_PROGRAMS="3,6": part 1 also times the verify graphs with chapter 09's rows_matmul launches split along K to that
many programs an SM; LAB_ROWS_TILES="BN,BK,W,ST[;...]": with rows_matmul in each tile (ROWS_MATMUL_TILE);
LAB_DECODE_ROWS="2,4,8,16": part 1 also times decode graphs of that many sequences (a row each) as exported and
through each route (the engines then hold that many sequences). Parts 1-3 run BF16 steps of up to LAB_GEMV_ROWS
rows (default 1 + DRAFTS) through chapter 09's rows GEMV (chapter 09a's GEMV_ROWS_BF16), and part 1 also times the
verify graphs as exported.

On one H100 (LAB_GEMV_ROWS=1 LAB_STEPS_ONLY=1 LAB_SWAP="64,64,4,3"): 1 + 4 rows 4.063 ms = 1.289x a decode step,
against 4.145 ms = 1.315x as exported (cuBLAS); the tile 128,128,4,4: 1.457x; with LAB_DEPENDENT_ROWS=8 as well:
1.291x. On one H200 (LAB_GEMV_ROWS=1 LAB_PROFILE=1): a decode step 2.508 ms, 1 + 1 rows 1.286x, 1 + 4 rows 3.475 ms =
1.386x, whose cuBLAS matmuls take 2,466 us and split-K reductions 129, decode attention 403, the norms, rotation, K/V
store and SiLU-mul 270. Those figures stored every verify row's K/V first; with the attention storing them itself
(chapter 09's `verify`), on one H100 (LAB_GEMV_ROWS=1 LAB_PROFILE=1): 1 + 4 rows 1.310-1.313x, the attention 520 us a
step against 405 + 54 (norm + RoPE) + 52 (K/V store). With the rows through chapter 09's `rows_matmul` as exported,
on one H100: 1 + 4 rows 1.167x (LAB_GEMV_ROWS=5 LAB_FOLDED=32,128,2,3 LAB_FOLDED_PDL=late: the lab kernel 1.162x);
with LAB_DECODE_ROWS=2,16 (engines of 16 sequences) and LAB_GEMV_ROWS=1: verify 1 + 4 rows 1.204x against 1.345x on
cuBLAS, decode graphs of 2 sequences 3.704 ms against 4.200, of 16 sequences 4.035 against 4.450. With chapter 09's
`_verify_kernel` (one program for a chunk of a sequence's rows), on one H100 (LAB_GEMV_ROWS=5 LAB_STEPS_ONLY=1, the
launcher before it run from a copy of the package on PYTHONPATH in the same call): 1 + 1 rows 1.133x against 1.175x,
1 + 2 1.132x against 1.194x, 1 + 3 1.134x against 1.201x, 1 + 4 (two chunks) 1.177x against 1.165x. With the step's
K/V taken first by the one split that holds them and idle programs returning at once (verify_attention_checks.sh,
another H100, the kernel before from a patched copy in the same call): 1 + 1 to 1 + 3 rows 1.121x, 1.125x, 1.128x and
1 + 4 rows 1.143x, against 1.145x, 1.144x, 1.146x and 1.190x; as committed (three runs on a third H100): 1 + 1 to
1 + 3 rows 1.126-1.133x, 1 + 4 rows 1.144-1.148x; launched as a dependent at every row count and waiting for the
projection after its scans (two runs on a fourth H100, the kernel before from a patched copy in the same
call): 1 + 1 to 1 + 3 rows 1.117x, 1.122x, 1.126x and 1 + 4 rows 1.132-1.133x, against 1.127-1.132x and 1.145x.
LAB_PROFILE=1's table (serialised under the profiler, so not the graph's overlap): the verify step of 1 + 4 rows
3,600 us of rows_matmul and 457 of _verify_kernel; the decode step 2,943 us of _gemv_kernel, 1,511 of
_gemv_rows_kernel and 424 of _decode_kernel."""

import functools
import json
import os
import statistics
import sys
import time

import torch

import forge_engine.fused_layers as fused_layers
import forge_engine.kernels.backend as backend
import forge_engine.kernels.gemv as kernels_gemv
import forge_engine.kernels.paged_attention as paged_attention
from forge_engine.bench import free_memory
from forge_engine.config import EngineConfig
from forge_engine.engine import LLMEngine
from forge_engine.generate import SamplingParams
from forge_engine.loader import load_model
from forge_engine.speculative import SpeculationCounts

CONTEXT, REPLAYS, NEW_TOKENS, DRAFTS, ROUNDS, FIXED_POINT_RUNS = 512, 50, 256, 4, 3, 8


class Replay:
    "A proposer that proposes the continuation of `tokens` while the output so far agrees with them."

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def propose(self, seq, k: int) -> list[int]:
        n = len(seq.output_ids)
        return self.tokens[n : n + k] if seq.output_ids == self.tokens[:n] else []

    def forget(self, request_id: str) -> None:
        pass


def step_ms(decode, rows: int, verify: bool, block_size: int) -> float:
    "Milliseconds a step of `rows` rows of one sequence (positions CONTEXT - 1 ...), graph replays back to back."
    return graph_ms(decode, step_args(rows, block_size), verify)


def graph_ms(decode, args: tuple, verify: bool) -> float:
    "Milliseconds a step with inputs `args` (`step_args`, `decode_args`): the median of 7 timings of REPLAYS replays."
    times = []
    for _ in range(7):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(REPLAYS):
            decode.run(*args, verify=verify)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / REPLAYS * 1e3)
    return statistics.median(times)


def step_args(rows: int, block_size: int) -> tuple:
    "A step's inputs for `rows` rows of one sequence at positions CONTEXT - 1 ..., as the engine writes them."
    table = list(range(-(-(CONTEXT + rows) // block_size)))
    positions = [CONTEXT - 1 + j for j in range(rows)]
    return (
        [100 + j for j in range(rows)],
        positions,
        [table[p // block_size] * block_size + p % block_size for p in positions],
        [table] * rows,
        [p + 1 for p in positions],
    )


def decode_args(rows: int, block_size: int) -> tuple:
    "A decode step's inputs for `rows` sequences, a row each at position CONTEXT - 1, each with a table of its own."
    blocks, position = -(-(CONTEXT + 1) // block_size), CONTEXT - 1
    tables = [list(range(j * blocks, (j + 1) * blocks)) for j in range(rows)]
    return (
        [100 + j for j in range(rows)],
        [position] * rows,
        [t[position // block_size] * block_size + position % block_size for t in tables],
        tables,
        [position + 1] * rows,
    )


def kernel_profile(decode, rows: int, verify: bool, block_size: int, top: int = 14) -> None:
    "Print the step's kernels by name: microseconds a step, most first (the mean over REPLAYS replays)."
    from torch.profiler import ProfilerActivity, profile

    args = step_args(rows, block_size)
    decode.run(*args, verify=verify)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            decode.run(*args, verify=verify)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in kernels) / REPLAYS
    kind = f"verify, 1 + {rows - 1} rows" if verify else "decode, 1 row"
    print(f"  kernels of a step ({kind}): {total:.0f} us in all")
    for e in kernels[:top]:
        print(
            f"    {e.self_device_time_total / REPLAYS:8.1f} us  {e.count / REPLAYS:5.1f}x  {e.key[:90]}"
        )


def use_rows_configs(configs_file: str) -> None:
    'The rows GEMV in the configurations of `configs_file` ({"N,K,rows": [BLOCK_N, warps, chunk]}) where it names one.'
    with open(configs_file) as f:
        configs = {tuple(map(int, key.split(","))): cfg for key, cfg in json.load(f).items()}
    exported = kernels_gemv.gemv_config

    def gemv_config(n, k, weight_bytes=2, layout=None, rows=1):
        if (n, k, rows) in configs and weight_bytes == 2 and layout == "rows":
            block_n, warps, chunk = configs[n, k, rows]
            return block_n, 32 * warps * chunk, warps
        return exported(n, k, weight_bytes, layout, rows)

    kernels_gemv.gemv_config = gemv_config


def use_swap(tile: tuple[int, ...]):
    "2-16 BF16 rows through sixteen_rows_swap.py's bf16_swap in `tile`; returns the function that undoes it."
    from sixteen_rows_swap import bf16_swap

    exported = fused_layers.linear

    def linear(x, weight, bias=None, out=None):
        if x.is_cuda and 2 <= x.shape[0] <= 16 and weight.dtype == torch.bfloat16 and bias is None:
            y = bf16_swap(x, weight, *tile)
            return y if out is None else out.copy_(y)
        return exported(x, weight, bias, out)

    fused_layers.linear = linear
    return lambda: setattr(fused_layers, "linear", exported)


def captured(build):
    """build()'s engine's decode runner, its graphs captured with the small kernels launched as dependents up to
    LAB_DEPENDENT_ROWS rows where set (chapter 09_kernels_gemv's DEPENDENT_LAUNCH_MAX_ROWS), then restored."""
    from decode_step_timeline import set_constant

    rows = os.environ.get("LAB_DEPENDENT_ROWS")
    exported = backend.DEPENDENT_LAUNCH_MAX_ROWS
    if rows:
        set_constant("DEPENDENT_LAUNCH_MAX_ROWS", int(rows))
    try:
        return build().runner.decode
    finally:
        set_constant("DEPENDENT_LAUNCH_MAX_ROWS", exported)


def lab_tiles(name: str) -> list[tuple[int, ...]]:
    "The tiles an environment variable names: 'BN,BK,W,ST;...'."
    return [tuple(map(int, t.split(","))) for t in os.environ.get(name, "").split(";") if t]


def folded_tiles() -> list[tuple[tuple[int, ...], dict | None]]:
    """LAB_FOLDED's tiles, each with LAB_FOLDED_TILES's best tile per matrix (folded_rows_matmul.py's LAB_BEST_OUT)
    where given, which then also runs alone (its other matrices in 64,128,4,3)."""
    tiles, per_shape = lab_tiles("LAB_FOLDED"), None
    if os.environ.get("LAB_FOLDED_TILES"):
        with open(os.environ["LAB_FOLDED_TILES"]) as f:
            per_shape = {
                tuple(map(int, key.split(","))): tuple(t) for key, t in json.load(f).items()
            }
        tiles = tiles or [(64, 128, 4, 3)]
    return [(tile, per_shape) for tile in tiles]


def use_folded(tile: tuple[int, ...], per_shape: dict | None):
    """Steps of 2-16 BF16 rows (verify steps, and LAB_DECODE_ROWS's decode steps) through folded_rows_matmul.py's
    kernel (`route_rows`), the layers handing their norms off up to 16 rows (chapter 09a's GEMV_ROWS_BF16); returns
    the function that undoes both."""
    from folded_rows_matmul import ROWS, route_rows

    undo, rows_limit = route_rows(tile, per_shape), fused_layers.GEMV_ROWS_BF16
    fused_layers.GEMV_ROWS_BF16 = ROWS

    def undo_both():
        undo()
        fused_layers.GEMV_ROWS_BF16 = rows_limit

    return undo_both


def use_programs(per_sm: int):
    """chapter 09's `rows_matmul` launches split along K to `per_sm` programs an SM (every kind; the export: BF16 and
    int4 four, int8 eight); returns the function that restores the export's rule."""
    import forge_engine.kernels.rows_matmul as rows_matmul

    exported = rows_matmul.split_k_programs
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows_matmul.split_k_programs = lambda device, _per_sm=4: per_sm * sms
    return lambda: setattr(rows_matmul, "split_k_programs", exported)


def use_rows_tile(tile: tuple[int, ...]):
    """chapter 09's `rows_matmul` in `tile` (BLOCK_N, BLOCK_K, warps, stages) for BF16 and int8 weights
    (ROWS_MATMUL_TILE); returns the function that restores the export's."""
    import forge_engine.kernels.rows_matmul as rows_matmul

    exported = rows_matmul.ROWS_MATMUL_TILE
    rows_matmul.ROWS_MATMUL_TILE = tile
    return lambda: setattr(rows_matmul, "ROWS_MATMUL_TILE", exported)


def use_constants(assignments: str):
    """The kernels' tuning constants set as `assignments` says ("NAME=V,NAME=V": decode_step_timeline.py's
    `set_constant`, e.g. DECODE_TARGET_PROGRAMS=512 for the attention's splits); returns the function that restores
    them."""
    from decode_step_timeline import set_constant

    saved = {}
    for assignment in assignments.split(","):
        name, value = assignment.split("=")
        module = next(m for m in (backend, kernels_gemv, paged_attention) if hasattr(m, name))
        saved[name] = getattr(module, name)
        set_constant(name, int(value))

    def restore():
        for name, value in saved.items():
            set_constant(name, value)

    return restore


def decode_rate(engine: LLMEngine, prompt: list[int]) -> tuple[float, list[int]]:
    "Decode tok/s after the first token, and the tokens."
    engine.add_request(
        prompt, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    )
    first = final = None
    while engine.has_unfinished():
        for out in engine.step():
            first = first or (time.perf_counter() if out.token_ids else None)
            final = out
    return (len(final.token_ids) - 1) / (time.perf_counter() - first), list(final.token_ids)


def main(quantization: str) -> None:
    loaded = load_model(
        "random:qwen3-4b",
        "cuda",
        progress=False,
        quantization="none" if quantization == "bf16" else quantization,
    )
    decode_rows = [int(r) for r in os.environ.get("LAB_DECODE_ROWS", "").split(",") if r]
    config = EngineConfig(
        max_num_seqs=max(decode_rows, default=1), max_model_len=4096, kv_cache_bytes=2 * 2**30
    )
    if os.environ.get("LAB_ROWS_CONFIGS"):
        use_rows_configs(os.environ["LAB_ROWS_CONFIGS"])
    plain = LLMEngine(loaded, config)
    exported = LLMEngine(loaded, config.replace(speculative_tokens=DRAFTS)).runner.decode
    fused_layers.GEMV_ROWS_BF16 = int(os.environ.get("LAB_GEMV_ROWS", 1 + DRAFTS))
    spec = LLMEngine(loaded, config.replace(speculative_tokens=DRAFTS))
    decode, size = spec.runner.decode, config.block_size
    one = step_ms(decode, 1, False, size)
    print(f"{quantization}: decode graph, 1 row: {one:.3f} ms")
    for k in range(DRAFTS + 1):
        ms, base = step_ms(decode, 1 + k, True, size), step_ms(exported, 1 + k, True, size)
        print(
            f"  verify graph, 1 + {k} rows: {ms:.3f} ms = {ms / one:.3f}x a decode step with BF16 rows "
            f"through the kernels up to {fused_layers.GEMV_ROWS_BF16} rows (else cuBLAS); as exported: {base:.3f} ms = "
            f"{base / one:.3f}x"
        )
    for n in decode_rows:
        print(
            f"  decode graph, {n} sequences: {graph_ms(exported, decode_args(n, size), False):.3f} ms as exported; "
            f"{graph_ms(decode, decode_args(n, size), False):.3f} ms with BF16 rows through the kernels up to "
            f"{fused_layers.GEMV_ROWS_BF16} rows (else cuBLAS)"
        )

    routes = [(f"bf16_swap {t}", functools.partial(use_swap, t)) for t in lab_tiles("LAB_SWAP")]
    routes += [
        (f"folded_rows_matmul {per_shape or t}", functools.partial(use_folded, t, per_shape))
        for t, per_shape in folded_tiles()
    ]
    # LAB_CONSTANTS="NAME=V,NAME=V;...": the exported verify step with the kernels' constants set so, each group in turn
    routes += [
        (group, functools.partial(use_constants, group))
        for group in os.environ.get("LAB_CONSTANTS", "").split(";")
        if group
    ]
    # LAB_ROWS_TILES="BN,BK,W,ST;...": the exported verify step with rows_matmul in each tile, in turn
    routes += [
        (f"rows_matmul {t}", functools.partial(use_rows_tile, t))
        for t in lab_tiles("LAB_ROWS_TILES")
    ]
    # LAB_PROGRAMS="3,6": the exported verify step with rows_matmul's launches at that many programs an SM, in turn
    routes += [
        (f"programs={n}", functools.partial(use_programs, int(n)))
        for n in os.environ.get("LAB_PROGRAMS", "").split(",")
        if n
    ]
    for label, route in routes:
        undo = route()
        try:
            routed = captured(lambda: LLMEngine(loaded, config.replace(speculative_tokens=DRAFTS)))
        finally:
            undo()
        ms, own_one = step_ms(routed, 1 + DRAFTS, True, size), step_ms(routed, 1, False, size)
        print(
            f"  verify graph, 1 + {DRAFTS} rows through {label}: {ms:.3f} ms = {ms / one:.3f}x a decode step "
            f"(its own decode step {own_one:.3f} ms: {ms / own_one:.3f}x)"
        )
        for n in decode_rows:
            print(
                f"  decode graph, {n} sequences through {label}: "
                f"{graph_ms(routed, decode_args(n, size), False):.3f} ms"
            )
        if os.environ.get("LAB_PROFILE"):
            kernel_profile(routed, 1 + DRAFTS, True, size)
        del routed
        free_memory()

    if os.environ.get("LAB_PROFILE"):
        kernel_profile(decode, 1, False, size)
        kernel_profile(decode, 1 + DRAFTS, True, size)
        return
    if os.environ.get("LAB_STEPS_ONLY"):
        return
    spec = LLMEngine(loaded, config.replace(speculative_tokens=DRAFTS))
    prompt = list(range(1000, 1000 + 128))
    _, tokens = decode_rate(plain, prompt)
    for _ in range(
        FIXED_POINT_RUNS
    ):  # replay until the run with speculation gives the tokens it was proposed
        spec.proposer = Replay(tokens)
        _, got = decode_rate(spec, prompt)
        if got == tokens:
            break
        tokens = got
    else:
        print(f"  (no fixed point in {FIXED_POINT_RUNS} runs: the proposer is not always right)")
    rates = {"off": [], "on": []}
    for _ in range(ROUNDS):
        rate, _ = decode_rate(plain, prompt)
        rates["off"].append(rate)
        spec.speculation = SpeculationCounts()  # this round's counts only
        rate, _ = decode_rate(spec, prompt)
        rates["on"].append(rate)
    off, on, c = statistics.median(rates["off"]), statistics.median(rates["on"]), spec.speculation
    print(
        f"  W1-like, {NEW_TOKENS} new tokens: {off:.1f} tok/s without, {on:.1f} with k = {DRAFTS} ({on / off:.2f}x); "
        f"drafts {c.proposed}, accepted {c.accepted} ({c.acceptance_rate:.0%}), "
        f"{c.mean_accepted_length:.2f} tokens a verify step"
    )


if __name__ == "__main__":
    for quantization in (sys.argv[1] if len(sys.argv) > 1 else "bf16").split(","):
        main(quantization)
        free_memory()
