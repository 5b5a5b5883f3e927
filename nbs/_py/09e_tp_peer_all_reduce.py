# %% [markdown]
# # All-reduces through peer memory
#
# > Small all-reduces without NCCL: each rank writes its partial sums where the others can read them, and one kernel adds them with the residual and the norm.
#
# Part of tensor parallelism: chapter 09c says how the model is split and what crosses the wire.

# %%
#| default_exp tensor_parallel.peer_all_reduce

# %%
#| export
from __future__ import annotations

import math
import os
import threading
import time

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from forge_engine.kernels.backend import INTERPRETED, _let_next_start, _pdl_args, _pow2
from forge_engine.tensor_parallel.shards import ShardedTransformer, _agree_min

# %%
#| hide
import tempfile
from pathlib import Path
import pytest
from forge_engine.config import preset
from forge_engine.generate import SamplingParams
from forge_engine.model import (
    causal_attention,
    empty_model,
    hf_state_dict,
    init_random_weights,
    rope_cos_sin,
)


# ## Small all-reduces through peer memory
#
# At batch 1 a decode step's 73 all-reduces move 5 KiB each, and their time (the report's
# `batch_1.all_reduce_s`, next to `w1_all_reduce_share`) is latency, not bandwidth: divided by
# 73 it is microseconds per all-reduce, for bytes that NVLink moves in nanoseconds. NCCL's
# all-reduce is built for every size, topology and rank count: a ring (or tree) of steps, each
# a protocol exchange between neighbours.
#
# Between GPUs that can read each other's memory (NVLink, or PCIe peer access), a **one-shot
# all-reduce** does less. PyTorch's *symmetric memory* (`torch.distributed._symmetric_memory`)
# allocates one buffer per rank and, once (`rendezvous`, a collective), maps every peer's
# buffer into each rank's address space. Then one all-reduce is: copy this rank's partial sum
# into its buffer; one kernel raises a flag in every peer's *signal pad* and waits for theirs
# (everyone has written), reads all N buffers straight over NVLink and adds them, and
# handshakes again (everyone has read, so the buffers may be written again). One exchange
# instead of a ring's 2(N - 1). The **two-shot** variant (`two_shot_all_reduce_out`) has each
# rank add only its 1/N of the elements and then gathers the sums: it reads N times fewer
# bytes, for one more handshake, and wins as messages grow. (Both leave NVLink *multicast*
# alone: the `multimem_*` operations, which need it, are not used.)
#
# The buffer is allocated once, at startup, twice as large as the largest message the fast path
# takes (two halves, see the fused kernel below), so its address never moves: a CUDA graph that
# recorded the copy and the kernel replays them as they are. The largest message
# (`symm_mem_buffer_bytes`) is the larger of `SYMM_MEM_MAX_BYTES`
# and a decode step of `SYMM_MEM_ROWS` sequences of the model: 256 sequences of Qwen3-4B are
# 256 x 2560 x 2 bytes = 1.25 MiB, of Qwen3-14B (5,120 wide) 2.5 MiB. With a fixed 2 MiB the
# 14B's decode steps at 256 sequences went through NCCL: measured on two H200s
# (`forge-engine bench all --model random:qwen3-14b --workloads w1,w2 --tensor-parallel-size 2`),
# 3.70 ms of all-reduces a step at 256 rows against 0.61 ms at one; with the buffer sized by the model,
# 1.71 ms, and W2 10,563 → 10,841 output tok/s. The row-parallel layers (output and down projections)
# write their partial sums straight into the buffer (`AllReduce.staging`: the GEMV kernel or the GEMM
# takes it as its output), so no copy into it precedes the kernel. Larger messages (prefills) and anything
# the kernels do not handle (fp16, an odd size, a rank count other than 2, 4 or 8) go
# through NCCL; every rank decides from the message's shape and dtype alone, so all ranks
# always take the same path.
#
# **The all-reduce, the residual add and the norm in one kernel.** Each row-parallel
# layer's sum goes straight into the residual add and the next RMSNorm, so the three are one
# kernel here: `_all_reduce_add_rmsnorm_kernel`, called by the norm that takes the layer's
# partial output (`ReducingRMSNorm`). One program a row (up to as many programs as a signal pad
# has slots): a handshake with its namesake program on every peer (everyone's partial sums are
# written), then the row of every rank's buffer read over NVLink and added in rank order (so
# every rank gets the same bits), the residual added, the row normalised, both stored. No second
# handshake ("everyone has read, the buffer may be written again"): the buffer has two halves,
# the output projections stage in one and the down projections in the other, so consecutive
# calls alternate, and the next write into a half comes after the next call's handshake, which a
# peer reaches only once it has finished everything before, its reads of that half included
# (`SymmMemAllReduce.add_rmsnorm`). The handshakes are PyTorch's protocol, slot for slot, so the
# release below frees this kernel too. Against PyTorch's kernel followed by the norm it saves a
# launch and a handshake, and keeps more programs in flight (PyTorch's one- and two-shot kernels
# launch at most 24 blocks). Measured on two H200s (`kernels_lab/tp_allreduce.py`, a
# decode step's worth in one CUDA graph): at 256 rows 12.1 µs a call against 18.6 for the
# all-reduce and the norm kernel (15.7 with a second handshake), at one row 7.1 against 9.0.
# In the engine (`kernels_lab/tp_step_profile.py --tp=2`, 256 sequences) rank 0's decode step
# went from 7.49 to 6.88 ms, its all-reduces from 1.30 to 0.98 ms plus 0.18 ms of norms gone;
# W1 at TP=2 from 419 to 460 tok/s; W2 1.50-1.52× TP=1, unchanged (what
# limits it: `docs/benchmarks.md`).
#
# **When a rank dies.** An NCCL collective waiting for a dead rank returns once rank 0 aborts
# the communicator. The symmetric-memory kernels have no abort: they would wait for the dead
# peer's flag for ever, and so would the engine's wait for the step's tokens. So after a
# failure rank 0 keeps writing the dead peers' half of every handshake into the signal pads
# (`release_waiters`, a background thread, until the group is closed): each waiting kernel
# finishes, on garbage that the failed step never delivers (see *a step's GPU work* below).
# A worker whose rank 0 died exits at once (`_exit_when_orphaned`): ending its process ends
# its kernels.
#
# Releasing from the host needs a launch every round, and a host thread's launches can wait
# behind another thread's blocking call: with the host's fills alone the symmetric-memory variant of the
# killed-worker test hung in all four runs on two H200s (the NCCL variant passed), with rank 0's
# release thread waiting for its own fills, the abort thread inside NCCL's abort, and the engine
# waiting for the step, while a kernel of the step waited for the dead rank. So the release
# starts on the GPU: `_release_kernel`, one program, plays the dead rank's side of every slot
# over and over for `RELEASE_ON_GPU_S` seconds of the GPU's clock (`%globaltimer`, a microsecond's
# `nanosleep` between rounds), needing no host call while NCCL's abort runs; it is compiled when
# the fast path is set up, and the abort waits until it is queued. The host's fills take over
# afterwards. Checked here under the interpreter (its indexing); on two H200s the killed-worker
# test (`tests/test_tp_gpu.py`) passes with it under both paths.
#
# **On by default.** Measured on two H200s (`kernels_lab/tp_allreduce.py`, 73
# all-reduces of one decode step in one CUDA graph): 535 µs through symmetric memory against
# 1,375 µs through NCCL at one sequence, 1,187 against 2,155 µs at 256. Without the
# release above the killed-worker test (`tests/test_tp_gpu.py`) hangs with it; with the
# release it fails cleanly under both paths (both variants of the test on
# two H200s), and the engine's W1 with TP=2 went from 382.7-383.1 tok/s (NCCL) to 393.0-393.4
# (the all-reduces 0.54 ms of a 2.54 ms step, 21%, against NCCL's 1.86 ms of 2.61, 71%). So the
# small all-reduces take the fast path wherever every rank can; `FORGE_TP_ALL_REDUCE=nccl` in
# the environment sends all of them through NCCL. `kernels_lab/tp_allreduce.py` checks the fast
# path against NCCL and times both, eager and inside a CUDA graph, at 1 to 256 rows of 2560.

# %%
#| export
SYMM_MEM_MAX_BYTES = 2 * 2**20  # the fast path's buffer at least: above its size (prefills), NCCL
SYMM_MEM_ROWS = 512  # ... and as large as a decode step of this many sequences of the model
ONE_SHOT_MAX_BYTES = 256 * 2**10  # one-shot up to here, two-shot above
ALL_REDUCE_ENV = "FORGE_TP_ALL_REDUCE"  # "nccl": every all-reduce through NCCL (default: small ones through peer memory)
ALL_REDUCE_CHOICES = (
    "symmetric-memory",
    "nccl",
)  # (unset or empty: symmetric memory where every rank can)


def all_reduce_choice() -> str:
    "The all-reduce path asked for in the environment: 'symmetric-memory' (the default) or 'nccl'."
    choice = os.environ.get(ALL_REDUCE_ENV, "").strip().lower() or "symmetric-memory"
    if choice not in ALL_REDUCE_CHOICES:
        raise ValueError(
            f"{ALL_REDUCE_ENV}={os.environ[ALL_REDUCE_ENV]!r}: expected one of {', '.join(ALL_REDUCE_CHOICES)}"
        )
    return choice


def symm_mem_buffer_bytes(hidden_size: int, dtype: torch.dtype) -> int:
    "The fast path's largest message: SYMM_MEM_MAX_BYTES, or a decode step's all-reduce of SYMM_MEM_ROWS rows if larger."
    return max(SYMM_MEM_MAX_BYTES, SYMM_MEM_ROWS * hidden_size * dtype.itemsize)


def symm_mem_takes(x: torch.Tensor, max_bytes: int = SYMM_MEM_MAX_BYTES) -> bool:
    "Whether the symmetric-memory kernels take `x`: bf16 or fp32, contiguous, a multiple of 4 bytes, at most `max_bytes`."
    return x.is_contiguous() and symm_mem_takes_shape(x.shape, x.dtype, max_bytes)


def symm_mem_takes_shape(
    shape: tuple[int, ...], dtype: torch.dtype, max_bytes: int = SYMM_MEM_MAX_BYTES
) -> bool:
    "Whether the symmetric-memory kernels take a contiguous message of this shape and dtype (see `symm_mem_takes`)."
    nbytes = math.prod(shape) * dtype.itemsize
    return dtype in (torch.bfloat16, torch.float32) and 0 < nbytes <= max_bytes and nbytes % 4 == 0


RELEASE_ON_GPU_S = 2.0  # how long the release kernel plays a dead rank's side: the steps in flight, an abort's wait
RELEASE_LAUNCH_WAIT_S = (
    2.0  # after a failure, how long at most the abort waits for that kernel to be queued
)


@triton.jit
def _clock_ns(tick, ON_GPU: tl.constexpr):
    "On the GPU: wait about a microsecond, then read the GPU's global clock (ns). Interpreted: 0 (no clock there)."
    if ON_GPU:
        return tl.inline_asm_elementwise(
            "{ nanosleep.u32 1000; mov.u64 $0, %globaltimer; }",
            "=l,r",
            [tick],
            dtype=tl.int64,
            is_pure=False,
            pack=1,
        )
    return tick.to(tl.int64) * 0


# (no integer argument specialised: the launch at setup, with nothing to do, compiles the one a failure launches)
@triton.jit(do_not_specialize=["slots", "world", "peer", "rank", "duration_us", "rounds"])
def _release_kernel(
    mine_ptr,
    theirs_ptr,
    slots,
    world,
    peer,
    rank,
    duration_us,
    rounds,
    BLOCK: tl.constexpr,
    ON_GPU: tl.constexpr,
):
    """Play dead rank `peer`'s side of every handshake slot (see `release_waiters`) over and over, for `duration_us`
    of the GPU's clock and at most `rounds` times: "peer has arrived" in our pad, "peer took our signal" in theirs."""
    i = 0
    start = _clock_ns(i, ON_GPU)
    now = start
    while (i < rounds) & (now - start < duration_us.to(tl.int64) * 1000):
        for first in range(0, slots, BLOCK):
            offs = first + tl.arange(0, BLOCK)
            ok = offs < slots
            tl.atomic_xchg(mine_ptr + offs * world + peer, 1, mask=ok, sem="relaxed", scope="sys")
            tl.atomic_xchg(theirs_ptr + offs * world + rank, 0, mask=ok, sem="relaxed", scope="sys")
        i += 1
        now = _clock_ns(i, ON_GPU)


def release_on_device(
    mine: torch.Tensor,
    theirs: torch.Tensor,
    world: int,
    peer: int,
    rank: int,
    seconds: float = RELEASE_ON_GPU_S,
    rounds: int = 2**31 - 1,
) -> None:
    "Launch `_release_kernel` (one program) on the current stream over signal pads `mine` (this rank's) and `theirs`."
    _release_kernel[(1,)](
        mine,
        theirs,
        mine.numel() // world,
        world,
        peer,
        rank,
        int(seconds * 1e6),
        rounds,
        BLOCK=128,
        ON_GPU=not INTERPRETED,
    )


@triton.jit
def _put_signal(pad_ptr, slot):
    "Raise flag `slot` of a rank's signal pad (0 -> 1), once the last raise was taken: our writes before it go first."
    while tl.atomic_cas(pad_ptr + slot, 0, 1, sem="release", scope="sys") != 0:
        pass


@triton.jit
def _take_signal(pad_ptr, slot):
    "Wait for flag `slot` of our own pad, and take it (1 -> 0): the raiser's writes before it are visible after."
    while tl.atomic_cas(pad_ptr + slot, 1, 0, sem="acquire", scope="sys") != 1:
        pass


@triton.jit
def _handshake(pads_ptr, rank, channel, WORLD: tl.constexpr):
    """Program `channel` of every rank meets its namesakes: signal each peer p (slot channel * WORLD + rank of p's
    pad), then wait for each peer's signal (slot channel * WORLD + p of ours), PyTorch's kernels' protocol, which
    `release_waiters` plays for a dead rank."""
    for p in tl.static_range(WORLD):
        if p != rank:
            _put_signal(tl.load(pads_ptr + p).to(tl.pointer_type(tl.int32)), channel * WORLD + rank)
    mine = tl.load(pads_ptr + rank).to(tl.pointer_type(tl.int32))
    for p in tl.static_range(WORLD):
        if p != rank:
            _take_signal(mine, channel * WORLD + p)


@triton.jit
def _all_reduce_add_rmsnorm_kernel(
    buffers_ptr,
    pads_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    offset,
    rows,
    H,
    eps,
    rank,
    WORLD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
    WAIT: tl.constexpr,
):
    """Rows of [rows, H] partial sums, one at element `offset` of each rank's symmetric buffer (`buffers_ptr`: their
    addresses): res_out = sum over ranks + res, out = rmsnorm(res_out) * w. A program a row at a time, after a
    handshake (no second one: see `SymmMemAllReduce.add_rmsnorm`)."""
    _let_next_start(PDL, WAIT)
    channel = tl.program_id(0)
    _handshake(pads_ptr, rank, channel, WORLD)  # every rank's partial sums are written
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    dtype = res_ptr.dtype.element_ty
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for row in range(channel, rows, tl.num_programs(0)):
        total = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for r in tl.static_range(WORLD):  # rank order on every rank: the same bits everywhere
            part = tl.load(buffers_ptr + r).to(tl.pointer_type(dtype))
            total += tl.load(part + offset + row * H + offs, mask=mask, other=0.0).to(tl.float32)
        # rounded as the unfused path rounds: the all-reduce's output, the new residual, the normalised row
        h = total.to(dtype).to(tl.float32) + tl.load(
            res_ptr + row * H + offs, mask=mask, other=0.0
        ).to(tl.float32)
        h = h.to(dtype)
        tl.store(res_out_ptr + row * H + offs, h, mask=mask)
        h = h.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / H + eps)
        tl.store(
            out_ptr + row * H + offs, (w * (h * rstd).to(dtype).to(tl.float32)).to(dtype), mask=mask
        )


def all_reduce_add_rmsnorm(
    buffer_ptrs: torch.Tensor,
    pad_ptrs: torch.Tensor,
    rank: int,
    offset: int,
    rows: int,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    max_programs: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(s + residual) * weight, s + residual), s the sum over the ranks of the [rows, H] messages at element
    `offset` of their symmetric buffers (addresses `buffer_ptrs`, signal pads `pad_ptrs`: int64, one a rank). Every
    rank calls it together; at most `max_programs` programs (a pad's slots for each peer)."""
    hidden = residual.shape[-1]
    if (
        residual.shape != (rows, hidden)
        or not residual.is_contiguous()
        or weight.shape != (hidden,)
    ):
        raise ValueError(
            f"all_reduce_add_rmsnorm needs a contiguous residual [{rows}, H] and a weight [H], "
            f"got {tuple(residual.shape)} and {tuple(weight.shape)}"
        )
    out, res_out = torch.empty_like(residual), torch.empty_like(residual)
    block = _pow2(hidden)
    _all_reduce_add_rmsnorm_kernel[(max(1, min(rows, max_programs)),)](
        buffer_ptrs,
        pad_ptrs,
        residual,
        weight,
        out,
        res_out,
        offset,
        rows,
        hidden,
        eps,
        rank,
        WORLD=buffer_ptrs.numel(),
        BLOCK_H=block,
        **_pdl_args(residual.device, rows=rows),
        num_warps=min(8, max(1, block // 512)),
    )
    return out, res_out


class SymmMemAllReduce:
    "Sum over the ranks of small CUDA tensors through peer memory (PyTorch symmetric memory). Every rank builds one, together."

    def __init__(
        self,
        group_name: str,
        device: torch.device,
        rank: int,
        world: int,
        max_bytes: int = SYMM_MEM_MAX_BYTES,
    ):
        from torch.distributed import _symmetric_memory as symm_mem

        self.group_name, self.device, self.rank, self.world, self.max_bytes = (
            group_name,
            device,
            rank,
            world,
            max_bytes,
        )
        self.buffer = symm_mem.empty(
            2 * max_bytes, dtype=torch.uint8, device=device
        )  # two halves (`add_rmsnorm`)
        self.handle = symm_mem.rendezvous(
            self.buffer, group_name
        )  # a collective: maps every peer's buffer here
        self.two_shot = hasattr(torch.ops.symm_mem, "two_shot_all_reduce_out")
        # every rank's buffer and signal pad, as this rank addresses them: what the fused kernel reads and signals
        if self.handle.buffer_ptrs[rank] != self.buffer.data_ptr():
            raise RuntimeError(
                "the symmetric buffer does not start where the rendezvous says this rank's buffer starts"
            )
        self.buffer_ptrs = torch.tensor(self.handle.buffer_ptrs, dtype=torch.int64, device=device)
        self.pad_ptrs = torch.tensor(self.handle.signal_pad_ptrs, dtype=torch.int64, device=device)
        mine = self.handle.get_signal_pad(rank, dtype=torch.int32)
        self.channels = (
            mine.numel() // world
        )  # slots a peer has in a pad: the programs of one kernel, at most
        # the release kernel compiled and loaded now, with nothing to do: after a failure its launch must not wait for
        # a compiler. Where it cannot run, only the release from the host is left (the fast path itself is unaffected)
        try:
            release_on_device(mine, mine, world, rank, rank, seconds=0.0, rounds=0)
            self.release_kernel_error = None
        except Exception as e:
            self.release_kernel_error = f"{type(e).__name__}: {e}"

    def staging(
        self, shape: tuple[int, ...], dtype: torch.dtype, half: int = 0
    ) -> torch.Tensor | None:
        "The start of half `half` of the buffer as a tensor of this shape, where this path takes such a message (else None)."
        if not symm_mem_takes_shape(shape, dtype, self.max_bytes):
            return None
        start = half * self.max_bytes
        return (
            self.buffer[start : start + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
        )

    def _reduce(self, staged: torch.Tensor, out: torch.Tensor) -> None:
        # each kernel ends with a handshake (every rank has read every buffer): the next message may be staged at once
        if staged.numel() * staged.element_size() <= ONE_SHOT_MAX_BYTES or not self.two_shot:
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, out)
        else:
            torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", self.group_name, out)

    def add_rmsnorm(
        self, staged: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rmsnorm(s + residual) * weight, s + residual), s the sum over the ranks of what each wrote into its
        `staging` view, in one kernel; None (nothing done) where `staged` is not such a view.
        The kernel handshakes once, before it reads: a rank may leave it while its peers still read its buffer. That
        is safe as long as consecutive calls alternate between the buffer's halves, as the output (half 0) and down
        (half 1) projections do: the next write into a half comes after the next call's handshake, and a peer that
        has reached that handshake has finished every kernel before it, its reads of the half included. (The
        embedding's all-reduce, PyTorch's kernel, stages in half 0 and handshakes again at its end.)"""
        start = staged.data_ptr() - self.buffer.data_ptr()
        if start not in (0, self.max_bytes):
            return None
        if staged.dim() != 2 or staged.shape != residual.shape or staged.dtype != residual.dtype:
            raise ValueError(
                f"a staged message {staged.dtype} {tuple(staged.shape)} cannot be added to a residual "
                f"{residual.dtype} {tuple(residual.shape)}"
            )
        return all_reduce_add_rmsnorm(
            self.buffer_ptrs,
            self.pad_ptrs,
            self.rank,
            start // staged.element_size(),
            staged.shape[0],
            residual.contiguous(),
            weight,
            eps,
            self.channels,
        )

    def all_reduce_(self, x: torch.Tensor) -> bool:
        "Sum `x` over the ranks, in place; False (and nothing done) when `x` is not for this path."
        if not symm_mem_takes(x, self.max_bytes):
            return False
        self._reduce(self.staging(x.shape, x.dtype).copy_(x), x)
        return True

    def release_waiters(self, stop, launched: threading.Event | None = None) -> None:
        """After a rank died: until `stop()`, play every peer's side of the kernels' handshakes, so that none waits
        for ever. A kernel's block b signals peer p by setting slot b * world + rank of p's pad (0 -> 1), and
        waits until p has set slot b * world + p of its own pad (1 -> 0). First on the GPU (`_release_kernel`, for
        RELEASE_ON_GPU_S; `launched` is set once it is queued), then from here with small fills."""
        mine = self.handle.get_signal_pad(self.rank, dtype=torch.int32)
        peers = [p for p in range(self.world) if p != self.rank]
        theirs = [self.handle.get_signal_pad(p, dtype=torch.int32) for p in peers]
        if self.release_kernel_error is None:
            with torch.cuda.stream(
                torch.cuda.Stream(self.device)
            ):  # a stream of its own: it runs for seconds
                for p, pad in zip(peers, theirs):
                    release_on_device(mine, pad, self.world, p, self.rank)
        if launched is not None:
            launched.set()
        mine, theirs = mine.view(-1, self.world), [pad.view(-1, self.world) for pad in theirs]
        stream = torch.cuda.Stream(self.device)  # beside the stream whose kernels wait
        with torch.cuda.stream(stream):
            while not stop():
                for p, pad in zip(peers, theirs):
                    mine[:, p].fill_(1)  # "p has arrived", in every block's slot
                    pad[:, self.rank].fill_(0)  # "p took our signal"
                stream.synchronize()
                time.sleep(0.001)


# PyTorch keeps its symmetric-memory registry per group *name* for the life of the process, and a
# destroyed group's name ("0" for the default group) comes back with the next group: a second
# rendezvous under it waits on the first group's store for ever (measured: a second engine in one
# process hung there). So a process sets the fast path up once; this set is that fact, not a cache.
_SYMM_MEM_GROUP_NAMES: set[str] = set()


def _symm_mem_unavailable(device: torch.device, world: int) -> str | None:
    "Why this rank cannot take the fast path (None: it can)."
    if all_reduce_choice() == "nccl":
        return f"{ALL_REDUCE_ENV}=nccl"
    if dist.group.WORLD.group_name in _SYMM_MEM_GROUP_NAMES:
        return (
            f"symmetric memory was set up for a group named {dist.group.WORLD.group_name!r} earlier in this process, "
            f"and PyTorch cannot set it up again under that name"
        )
    if world not in (2, 4, 8):
        return f"the symmetric-memory kernels are built for 2, 4 or 8 ranks, not {world}"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401

        torch.ops.symm_mem.one_shot_all_reduce_out
    except (ImportError, AttributeError, RuntimeError) as e:
        return f"this PyTorch has no symmetric-memory all-reduce ({type(e).__name__})"
    if not all(
        torch.cuda.can_device_access_peer(device.index, g)
        for g in range(world)
        if g != device.index
    ):
        return "the GPUs cannot read each other's memory (no NVLink or PCIe peer access)"
    return None


def setup_all_reduce(model: ShardedTransformer) -> str:
    "Every rank together: the fast path for small all-reduces when every rank can take it. Says which path runs."
    reduce, world = model.all_reduce, model.plan.world
    device = next(model.parameters()).device
    if device.type != "cuda":
        reduce.path = f"torch.distributed ({dist.get_backend()}) for every all-reduce"
        return reduce.path
    # these all-reduces never use NVLink multicast: the allocator need not set it up
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    why = _symm_mem_unavailable(device, world)
    if _agree_min(int(why is None)):  # every rank can: build it together
        try:
            _SYMM_MEM_GROUP_NAMES.add(
                dist.group.WORLD.group_name
            )  # (tried: a failed rendezvous spoils the name too)
            reduce.fast = SymmMemAllReduce(
                dist.group.WORLD.group_name,
                device,
                model.plan.rank,
                world,
                symm_mem_buffer_bytes(model.plan.config.hidden_size, model.embed.weight.dtype),
            )
        except (
            Exception
        ) as e:  # (a rank that fails here may leave the others to the store's timeout)
            why = f"symmetric memory failed to set up: {type(e).__name__}: {e}"
        if not _agree_min(int(reduce.fast is not None)):
            reduce.fast, why = None, why or "symmetric memory failed to set up on another rank"
    else:
        why = why or "another rank cannot use symmetric memory"
    reduce.path = (
        f"symmetric memory up to {reduce.fast.max_bytes // 1024} KiB (one-shot up to "
        f"{ONE_SHOT_MAX_BYTES // 1024} KiB, then {'two' if reduce.fast.two_shot else 'one'}-shot), NCCL above"
        if reduce.fast is not None
        else f"NCCL for every all-reduce ({why})"
    )
    if reduce.fast is not None and reduce.fast.release_kernel_error is not None:
        reduce.path += (
            f"; after a failure released from the host only ({reduce.fast.release_kernel_error})"
        )
    return reduce.path


# %% [markdown]
# Which messages the fast path takes (the CPU run at the end of the chapter says which path it took):

# %%
assert symm_mem_takes(torch.zeros(1, 2560, dtype=torch.bfloat16)) and symm_mem_takes(
    torch.zeros(256, 2560, dtype=torch.bfloat16)
)
assert not symm_mem_takes(
    torch.zeros(512, 2560, dtype=torch.bfloat16)
)  # 2.5 MiB: NCCL, with the smallest buffer
assert (
    symm_mem_buffer_bytes(2560, torch.bfloat16) == 2.5 * 2**20
    and symm_mem_buffer_bytes(5120, torch.bfloat16) == 5 * 2**20
)
assert symm_mem_buffer_bytes(64, torch.float32) == SYMM_MEM_MAX_BYTES  # (a tiny model: the floor)
assert symm_mem_takes(
    torch.zeros(512, 5120, dtype=torch.bfloat16), symm_mem_buffer_bytes(5120, torch.bfloat16)
)
assert not symm_mem_takes(torch.zeros(4, 8, dtype=torch.float16))  # no fp16 kernel
assert not symm_mem_takes(torch.zeros(3, dtype=torch.bfloat16))  # 6 bytes
assert not symm_mem_takes(torch.zeros(8, 8, dtype=torch.bfloat16).t())  # not contiguous
if INTERPRETED:  # the release kernel's slots (on a GPU it loops on the clock; here a few rounds): rank 0 of 2, peer 1
    # (the exported kernel: Triton's interpreter copies its own globals, `__file__` among them, into the kernel's, and
    # in this notebook's namespace that `__file__` would send the ranks spawned further down to run the interpreter)
    from forge_engine.tensor_parallel import peer_all_reduce as exported

    mine, theirs = torch.zeros(10, 2, dtype=torch.int32), torch.ones(10, 2, dtype=torch.int32)
    exported.release_on_device(mine.view(-1), theirs.view(-1), 2, 1, 0, rounds=2)
    assert (mine[:, 1] == 1).all() and (
        mine[:, 0] == 0
    ).all()  # "1 has arrived" in every block's slot, ours untouched
    assert (theirs[:, 0] == 0).all() and (
        theirs[:, 1] == 1
    ).all()  # "1 took our signal"; its own slots untouched

# the path asked for in the environment: symmetric memory unless FORGE_TP_ALL_REDUCE=nccl; anything else is an error
for value, want in (
    ("", "symmetric-memory"),
    ("NCCL", "nccl"),
    ("symmetric-memory", "symmetric-memory"),
):
    os.environ[ALL_REDUCE_ENV] = value
    assert all_reduce_choice() == want
os.environ[ALL_REDUCE_ENV] = "gloo"
try:
    all_reduce_choice()
    raise AssertionError("an unknown FORGE_TP_ALL_REDUCE was taken")
except ValueError as e:
    assert "FORGE_TP_ALL_REDUCE='gloo': expected one of symmetric-memory, nccl" in str(e), e
finally:
    del os.environ[ALL_REDUCE_ENV]

# %% [markdown]
# The fused kernel, run by two ranks: two processes forked from this one, over buffers and
# signal pads in shared CPU memory, under the interpreter (whose atomics are the machine's). Every
# rank gets the same bits, the sum and the norm are right, and every signal raised was taken
# (the pads are clean for the next kernel). Then rank 0 alone, its peer dead, released by
# `_release_kernel` playing the peer's side: it finishes.

# %%
if INTERPRETED:
    import multiprocessing
    from forge_engine.kernels.elementwise import add_rmsnorm_reference

    world, rows, hidden, eps, channels = (
        2,
        5,
        40,
        1e-6,
        3,
    )  # 3 programs for 5 rows: programs take rows in turn
    g = torch.Generator().manual_seed(0)
    buffers = [
        torch.randn(2 * rows, hidden, generator=g).share_memory_() for _ in range(world)
    ]  # two halves of 5 rows
    pads = [torch.zeros(channels * world, dtype=torch.int32).share_memory_() for _ in range(world)]
    residual, weight = torch.randn(rows, hidden, generator=g), torch.randn(hidden, generator=g)
    results = torch.zeros(world, 2, rows, hidden).share_memory_()
    buffer_ptrs = torch.tensor(
        [b.data_ptr() for b in buffers]
    )  # (forked: the same addresses in every process)
    pad_ptrs = torch.tensor([p.data_ptr() for p in pads])

    def fused_rank(rank, halves=(1, 0)):  # (the last call's result kept)
        for half in halves:
            out, res_out = exported.all_reduce_add_rmsnorm(
                buffer_ptrs,
                pad_ptrs,
                rank,
                half * rows * hidden,
                rows,
                residual,
                weight,
                eps,
                channels,
            )
        results[rank, 0], results[rank, 1] = out, res_out

    def run_processes(targets, timeout=120):
        procs = [multiprocessing.get_context("fork").Process(target=t, args=a) for t, a in targets]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout)
        hung = [proc.pid for proc in procs if proc.is_alive()]
        for proc in procs:
            proc.kill()
        assert not hung and all(proc.exitcode == 0 for proc in procs), (
            hung,
            [proc.exitcode for proc in procs],
        )

    run_processes([(fused_rank, (r,)) for r in range(world)])
    want_residual = buffers[0][:rows] + buffers[1][:rows] + residual
    assert torch.equal(results[0], results[1])  # the same bits on both ranks
    torch.testing.assert_close(
        results[0, 1], want_residual, rtol=0, atol=0
    )  # (0 + b0 + b1) + residual: the same adds
    # (the default fp32 tolerance, rtol 1.3e-6: 40 squares summed in another order)
    torch.testing.assert_close(
        results[0, 0], add_rmsnorm_reference(want_residual, None, weight, eps)[0]
    )
    assert all((pad == 0).all() for pad in pads)  # every raise taken
    results.zero_()

    def release_until_done():  # rank 1 dead: the release kernel plays its side, ten rounds a launch
        while results[0, 1].abs().sum() == 0:
            exported.release_on_device(pads[0], pads[1], world, 1, 0, rounds=10)

    run_processes([(fused_rank, (0, (0,))), (release_until_done, ())])
    torch.testing.assert_close(
        results[0, 1], want_residual, rtol=0, atol=0
    )  # (rank 1's buffer still holds its message)

# %% [markdown]
#
