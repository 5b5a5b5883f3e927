"""All-reduce of a decode step's small messages on 2 GPUs: NCCL against PyTorch's symmetric memory.

A tensor-parallel decode step of b sequences runs 73 all-reduces of [b, 2560] bf16 (Qwen3-4B).
Variants, each an in-place sum over the 2 ranks:

v0 nccl      `dist.all_reduce` (the reference; chapter 09c's path for what the fast one does not take);
v1 one-shot  copy into the symmetric buffer, `symm_mem.one_shot_all_reduce_out` (every rank reads every buffer);
v2 two-shot  copy into the symmetric buffer, `symm_mem.two_shot_all_reduce_out` (each rank adds 1/N, then gathers);
v3 engine    chapter 09c's `AllReduce` with its `SymmMemAllReduce`: one-shot or two-shot by size (the embedding's);
v4 +norm     v3, then chapter 09's residual add + RMSNorm kernel (what v5 replaces);
v5 fused     as a decode step runs them: 72 of chapter 09c's all-reduce + residual add + RMSNorm kernel
             (`SymmMemAllReduce.add_rmsnorm`, staged in alternating halves of the buffer: it handshakes only before it
             reads), each with a copy into the buffer before and the new residual copied back into x after (the
             in-place contract here: two copies the engine does not make), then one v3 (the embedding's).

Validation, at every size, eager and replayed from a CUDA graph: each result within bf16 rounding of the
fp32 sum of both ranks' inputs (every rank draws every rank's input from its seed), and bit-identical on
both ranks (replicated activations must not drift apart). A mismatch exits nonzero.
Timing: eager (one call at a time, Python launch included) and inside a CUDA graph of 73 back-to-back
all-reduces (as the decode step records them), in microseconds per all-reduce.
NVLink multicast is never used (no `multimem_*`); TORCH_SYMM_MEM_DISABLE_MULTICAST=1 is set unless given.

Run on a machine with 2 GPUs, from the repository root:
    PYTHONPATH=. python3 kernels_lab/tp_allreduce.py --out /some/dir     (a table on stdout, tp_allreduce.json in the dir)"""

import argparse
import datetime
import itertools
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN, LAYERS, WORLD = 2560, 36, 2
ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
PER_STEP = 2 * LAYERS + 1  # all-reduces in one decode step
DEADLINE_S = 45  # (tp_gpu_check.sh gives it 50 s)


def inputs(rows: int, device) -> list[torch.Tensor]:
    "Every rank's input at this size (seeded by rank and size): any rank can compute the exact sum."
    return [
        torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(1000 * r + rows)).to(
            device, torch.bfloat16
        )
        for r in range(WORLD)
    ]


def variants(fast, group_name: str):
    "name -> in-place all-reduce of x."
    from forge_engine.tensor_parallel.shards import AllReduce

    def staged(x, half=0):
        return fast.staging(x.shape, x.dtype, half).copy_(x)

    from forge_engine.kernels.elementwise import add_rmsnorm

    engine = AllReduce()
    engine.fast = fast
    zeros, ones = (
        {},
        {},
    )  # the residual (zero: the new residual is the sum) and the norm weight, by shape

    def constants(x):
        if x.shape not in zeros:
            zeros[x.shape], ones[x.shape] = (
                torch.zeros_like(x),
                torch.ones(x.shape[-1], dtype=x.dtype, device=x.device),
            )
        return zeros[x.shape], ones[x.shape]

    def then_norm(x):
        engine(x)
        return add_rmsnorm(x, constants(x)[0], constants(x)[1], 1e-6)

    calls = itertools.count()

    def fused(
        x,
    ):  # position i of a step: fused in half i % 2 for i < 72 (alternating in any run of calls), then v3
        i = next(calls) % PER_STEP
        if i == PER_STEP - 1:
            return engine(x), None
        out = fast.add_rmsnorm(staged(x, i % 2), *constants(x), 1e-6)
        x.copy_(out[1])
        return out

    out = {
        "v0 nccl": lambda x: dist.all_reduce(x),
        "v1 one-shot": lambda x: torch.ops.symm_mem.one_shot_all_reduce_out(
            staged(x), "sum", group_name, x
        ),
    }
    if fast.two_shot:
        out["v2 two-shot"] = lambda x: torch.ops.symm_mem.two_shot_all_reduce_out(
            staged(x), "sum", group_name, x
        )
    out["v3 engine"] = engine
    out["v4 +norm"] = then_norm
    out["v5 fused"] = fused
    return out


def check(name: str, how: str, got: torch.Tensor, parts: list[torch.Tensor]) -> None:
    "Within bf16 rounding of the exact sum, and the same bits on every rank; raise otherwise."
    want = sum(p.float() for p in parts)
    err = (got.float() - want).abs().max().item()
    if not torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2):
        raise AssertionError(
            f"{name} ({how}) at {tuple(got.shape)}: max error {err:.3g} against the fp32 sum"
        )
    everyone = [torch.empty_like(got) for _ in range(WORLD)]
    dist.all_gather(everyone, got)
    if not all(torch.equal(everyone[0], e) for e in everyone[1:]):
        raise AssertionError(f"{name} ({how}) at {tuple(got.shape)}: the ranks got different bits")


def eager_us(fn, x: torch.Tensor, calls: int = 50) -> float:
    "Median over 5 rounds of the wall time per call, both ranks starting together."
    rounds = []
    for _ in range(5):
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn(x)
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(rounds)


def graph_us(fn, x: torch.Tensor, parts: list[torch.Tensor], name: str, rank: int) -> float:
    "Validate one captured all-reduce, then time a graph of PER_STEP of them: microseconds per all-reduce."
    one = torch.cuda.CUDAGraph()
    with torch.cuda.graph(one):
        fn(x)
    x.copy_(parts[rank])  # new contents after the capture: the replay must read them
    one.replay()
    torch.cuda.synchronize()
    check(name, "graph", x, parts)
    step = torch.cuda.CUDAGraph()
    with torch.cuda.graph(step):
        for _ in range(PER_STEP):
            fn(x)
    step.replay()
    rounds = []
    for _ in range(5):
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            step.replay()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - start) / (10 * PER_STEP) * 1e6)
    del one, step  # graphs that recorded NCCL calls go before the communicator does
    return statistics.median(rounds)


def rank_main(rank: int, port: int, out_dir: str) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=rank == 0)
    dist.init_process_group(
        "nccl",
        store=store,
        rank=rank,
        world_size=WORLD,
        device_id=device,
        timeout=datetime.timedelta(seconds=60),
    )
    from forge_engine.tensor_parallel.peer_all_reduce import (
        ALL_REDUCE_ENV,
        SymmMemAllReduce,
        _symm_mem_unavailable,
    )

    os.environ[ALL_REDUCE_ENV] = (
        "symmetric-memory"  # (the engine's default too) whatever the environment says
    )
    why = _symm_mem_unavailable(device, WORLD)
    if why is not None:
        raise RuntimeError(f"symmetric memory cannot run here: {why}")
    group_name = dist.group.WORLD.group_name
    fast = SymmMemAllReduce(group_name, device, rank, WORLD)
    table = []
    for rows in ROWS:
        parts = inputs(rows, device)
        row = {"rows": rows, "bytes": rows * HIDDEN * 2}
        for name, fn in variants(fast, group_name).items():
            x = parts[rank].clone()
            result = fn(x)
            torch.cuda.synchronize()
            check(name, "eager", x, parts)
            if (
                name == "v5 fused" and result[1] is not None
            ):  # its normalised rows: the unfused path's, within rounding
                from forge_engine.kernels.elementwise import add_rmsnorm_reference

                want = add_rmsnorm_reference(
                    x.float(), None, torch.ones(HIDDEN, device=device), 1e-6
                )[0]
                if not torch.allclose(result[0].float(), want, rtol=2e-2, atol=2e-2):
                    raise AssertionError(
                        f"v5 fused at {rows} rows: the normalised rows are off by "
                        f"{(result[0].float() - want).abs().max().item():.3g}"
                    )
            row[f"{name} eager_us"] = eager_us(fn, x)
            row[f"{name} graph_us"] = graph_us(fn, x, parts, name, rank)
        table.append(row)
    dist.barrier()
    if rank == 0:
        names = [k.removesuffix(" eager_us") for k in table[0] if k.endswith(" eager_us")]
        print(
            f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
            f"{torch.cuda.get_device_name(0)} x {WORLD}; microseconds per all-reduce of [rows, {HIDDEN}] bf16 "
            f"(graph: {PER_STEP} in one CUDA graph, as a decode step); all results validated"
        )
        print(f"{'rows':>5} {'bytes':>9} | " + " | ".join(f"{n:>12}" for n in names) + "   (eager)")
        for r in table:
            print(
                f"{r['rows']:>5} {r['bytes']:>9} | "
                + " | ".join(f"{r[n + ' eager_us']:>12.1f}" for n in names)
            )
        print(
            f"{'rows':>5} {'bytes':>9} | "
            + " | ".join(f"{n:>12}" for n in names)
            + "   (CUDA graph)"
        )
        for r in table:
            print(
                f"{r['rows']:>5} {r['bytes']:>9} | "
                + " | ".join(f"{r[n + ' graph_us']:>12.1f}" for n in names)
                + f"   decode step: nccl {r['v0 nccl graph_us'] * PER_STEP:.0f} us, "
                f"+norm {r['v4 +norm graph_us'] * PER_STEP:.0f} us, fused {r['v5 fused graph_us'] * PER_STEP:.0f} us"
            )
        result = {
            "torch": torch.__version__,
            "nccl": torch.cuda.nccl.version(),
            "gpu": torch.cuda.get_device_name(0),
            "world": WORLD,
            "hidden": HIDDEN,
            "dtype": "bfloat16",
            "per_step": PER_STEP,
            "table": table,
        }
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "tp_allreduce.json"), "w") as f:
            json.dump(result, f, indent=1)
    del fast
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default="/tmp/tp_allreduce", help="directory for tp_allreduce.json"
    )
    args = parser.parse_args()
    if torch.cuda.device_count() < WORLD:
        sys.exit(f"tp_allreduce: needs {WORLD} CUDA GPUs, torch sees {torch.cuda.device_count()}")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # (the children inherit it)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    start = time.monotonic()
    context = mp.start_processes(
        rank_main, args=(free_port(), args.out), nprocs=WORLD, join=False, start_method="spawn"
    )
    try:
        while not context.join(timeout=1):  # raises when a rank failed (and stops the other)
            if time.monotonic() - start > DEADLINE_S:
                for p in context.processes:
                    if p.is_alive():
                        p.kill()
                sys.exit(f"tp_allreduce: TIMED OUT after {DEADLINE_S} s")
    except Exception as e:
        sys.exit(f"tp_allreduce: FAILED: {e}")
    print(f"tp_allreduce: OK in {time.monotonic() - start:.0f} s")
