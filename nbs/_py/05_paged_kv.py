# %% [markdown]
# # The paged KV cache
#
# > Many sequences share one pool of fixed-size KV blocks: a block allocator with reference counts and prefix caching, block tables, the slot mapping, and a paged attention backend.

# %% [markdown]
# Chapter 04's cache gives one sequence one buffer of `max_len` tokens. Serving many requests
# that way wastes most of the memory: a buffer is reserved for the longest answer a request
# *might* give, and the memory between buffers can't be lent out. Operating systems solved
# the same problem with pages, and so do we (this is vLLM's *PagedAttention*):
#
# - the cache is a **pool of blocks**, each holding the K/V of `block_size` tokens;
# - each sequence has a **block table**: block `i` of its tokens lives in pool block
#   `block_table[i]`, wherever that is. A sequence takes one more block when it fills its last;
# - the model writes the K/V of each new token to a **slot** (`block_id * block_size + offset`)
#   and reads each sequence's K/V back through its block table.
#
# Blocks are reference-counted, so sequences that start with the same tokens (a system prompt,
# a chat history) can share the blocks of that prefix: **prefix caching**.
#
# This chapter has four parts, used by the scheduler (07) and the engine (08):
#
# | piece | what it knows | tensors? |
# |---|---|---|
# | `BlockAllocator` | which block is free, who holds it, which prefix it caches | no: plain Python |
# | `PagedKVCache` | the K/V pool itself, per layer | yes |
# | `StepLayout`, `build_step_layout` | where the tokens of one engine step go and what they read | yes (small) |
# | `PagedAttention` | the attention backend over the pool: the PyTorch reference | yes |

# %%
#| default_exp kv_cache

# %%
#| export
# Why one module of ~540 lines: it is one data structure seen from its three sides: the allocator
# that owns the blocks, the cache tensors that hold them, and the attention that reads them through
# the block tables and slot mapping a step lays out. The three change together.
from __future__ import annotations

import functools
import hashlib
import struct
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from forge_engine.config import ModelConfig
from forge_engine.kernels.cpu import cpu_decode_attention, cpu_decode_attention_runs
from forge_engine.model import causal_attention

# %%
#| hide
import pytest
from forge_engine.config import preset
from forge_engine.model import empty_model, init_random_weights


# %% [markdown]
# ## Prefix hashing
#
# A full block is named by a hash of its tokens *and of everything before it*: the K/V of a
# token depends on all the tokens before it, so two blocks with the same tokens after
# different prefixes hold different K/V. Chaining does this in one number: a block's hash
# covers its parent block's hash and its own token ids. We use `blake2b` over the packed
# integers, not Python's `hash`, so the same tokens give the same hash in every process and
# on every run.

# %%
#| export
def chain_hash(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    "64-bit hash of a full block: its parent's hash (None for the first block) and its token ids."
    parent = 0 if parent_hash is None else parent_hash
    data = struct.pack(f"<Q{len(token_ids)}q", parent, *token_ids)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


# %%
h1 = chain_hash(None, [1, 2, 3, 4])
assert h1 == chain_hash(None, (1, 2, 3, 4)) and h1 < 2**64
assert chain_hash(h1, [5, 6, 7, 8]) != chain_hash(None, [5, 6, 7, 8])  # same tokens, other prefix
assert chain_hash(None, [1, 2, 3, 4]) != chain_hash(None, [1, 2, 4, 3])


# %% [markdown]
# ## The block allocator
#
# Every block is in exactly one of three states:
#
# - **used**: reference count > 0, held by one or more sequences;
# - **cached**: count 0, but it holds the K/V of a registered prefix block. It is *free* (it can
#   be handed out), yet as long as nobody needs the space, a new sequence with that prefix can
#   pick it up again. Cached blocks are evicted least-recently-freed first;
# - **free**: count 0 and nothing worth keeping.
#
# The protocol the scheduler follows for one sequence:
#
# 1. `match_prefix(prompt)`: the blocks of the longest cached prefix, each with a reference
#    taken. It never covers the whole prompt: the last token must go through the model so
#    there are logits to sample from.
# 2. `can_allocate(n)` / `allocate(n)`: fresh blocks for the rest (free ones first, then
#    evicting cached ones).
# 3. `register_full_block(block, parent_hash, tokens)` once a block is full **and its K/V has
#    been written**: only then may another sequence match it.
# 4. `free(block_table)` when the sequence finishes, is aborted or preempted. The blocks enter
#    the LRU tail first, so eviction eats the end of a prefix chain before its start (a block
#    is useless without the blocks before it).
#
# When the engine is idle every block is free or cached: `check_idle()` says so.

# %%
#| export
@dataclass(frozen=True)
class KVCacheStats:
    "A snapshot of the block pool. free + cached + used == total; cached blocks can be handed out."

    total_blocks: int
    used_blocks: int
    free_blocks: int
    cached_blocks: int  # free, but holding a prefix that can still be matched (evictable)
    hit_tokens: int  # prompt tokens whose K/V came from the prefix cache
    query_tokens: int  # prompt tokens looked up in the prefix cache

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def usage(self) -> float:
        return self.used_blocks / self.total_blocks


class NoFreeBlocksError(RuntimeError):
    "Raised by `BlockAllocator.allocate` when the pool cannot give the blocks asked for."


_MAP_CHARS, _MAP_CACHED = b".123456789", ord("c")  # `BlockAllocator.block_map`'s characters


class BlockAllocator:
    "Reference-counted KV blocks with prefix caching. Bookkeeping only: the K/V lives in `PagedKVCache`."

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}"
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[int | None] = [
            None
        ] * num_blocks  # set only on the block that owns the hash
        self._hash_to_block: dict[int, int] = {}
        self._free: deque[int] = deque(range(num_blocks))  # count 0, no hash
        self._cached: OrderedDict[int, None] = (
            OrderedDict()
        )  # count 0 with a hash; first = least recently freed
        self.hit_tokens = self.query_tokens = 0
        # what `block_map` shows, kept up to date block by block: a server reads it every quarter second, and a
        # pass over tens of thousands of blocks in Python would stall the engine's thread for tens of ms each time
        self._map = bytearray(b"." * num_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        "How many blocks hold `num_tokens` tokens."
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        "Blocks `allocate` can hand out now: free plus cached (evictable)."
        return len(self._free) + len(self._cached)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[self._checked(block_id)]

    def block_map(self) -> str:
        "One character per block: '.' free, 'c' cached (free, a reusable prefix), '1'-'9' references (9: or more)."
        return self._map.decode()

    def _count(self, block: int, n: int) -> None:
        "Set a block's reference count, and its character in the map."
        self._ref_counts[block] = n
        self._map[block] = (
            _MAP_CHARS[min(n, 9)] if n or self._block_hash[block] is None else _MAP_CACHED
        )

    def hash_of(self, block_id: int) -> int | None:
        "The prefix hash a block is cached under (None if it holds no registered prefix)."
        return self._block_hash[self._checked(block_id)]

    def allocate(self, n: int) -> list[int]:
        "`n` fresh blocks with one reference each: free blocks first, then the least recently freed cached ones."
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if not self.can_allocate(n):
            raise NoFreeBlocksError(
                f"cannot allocate {n} blocks: only {self.num_free_blocks} of "
                f"{self.num_blocks} are free or evictable"
            )
        blocks = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:  # evict: the block's old prefix can no longer be matched
                block, _ = self._cached.popitem(last=False)
                del self._hash_to_block[self._block_hash[block]]
                self._block_hash[block] = None
            self._count(block, 1)
            blocks.append(block)
        return blocks

    def free(self, block_ids: Sequence[int]) -> None:
        "Drop one reference on each block (e.g. a finished sequence's block table). All or nothing."
        block_ids = list(block_ids)
        wanted = Counter(self._checked(b) for b in block_ids)
        for block, times in wanted.items():
            if times > self._ref_counts[block]:
                raise ValueError(
                    f"double free: block {block} has {self._ref_counts[block]} references, "
                    f"asked to drop {times}"
                )
        for block in reversed(block_ids):  # the tail of a chain becomes the first to evict
            self._count(block, self._ref_counts[block] - 1)
            if self._ref_counts[block] == 0:
                if self._block_hash[block] is None:
                    self._free.append(block)
                else:
                    self._cached[block] = None

    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        "Blocks caching the longest full-block prefix of `token_ids` (never all of it), one reference taken on each."
        if not self.enable_prefix_caching:
            return []
        matched, parent = [], None
        for i in range(
            (len(token_ids) - 1) // self.block_size
        ):  # full blocks before the last token
            parent = chain_hash(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            block = self._hash_to_block.get(parent)
            if block is None:
                break
            matched.append(block)
        for block in matched:
            if self._ref_counts[block] == 0:
                del self._cached[block]
            self._count(block, self._ref_counts[block] + 1)
        self.query_tokens += len(token_ids)
        self.hit_tokens += len(matched) * self.block_size
        return matched

    def cancel_match(self, block_ids: Sequence[int], num_query_tokens: int) -> None:
        "Undo a `match_prefix` whose sequence could not be admitted after all: references and hit counts."
        self.free(block_ids)
        if not self.enable_prefix_caching:
            return  # its match_prefix counted nothing
        self.query_tokens -= num_query_tokens
        self.hit_tokens -= len(block_ids) * self.block_size

    def register_full_block(
        self, block_id: int, parent_hash: int | None, token_ids: Sequence[int]
    ) -> int | None:
        "Offer a full block, whose K/V is written, to the prefix cache; returns its hash (None when caching is off)."
        block = self._checked(block_id)
        if self._ref_counts[block] == 0:
            raise ValueError(
                f"block {block} is not allocated; register only blocks a sequence holds"
            )
        if len(token_ids) != self.block_size:
            raise ValueError(f"a full block has {self.block_size} tokens, got {len(token_ids)}")
        if not self.enable_prefix_caching:
            return None
        h = chain_hash(parent_hash, token_ids)
        if self._block_hash[block] not in (None, h):
            raise ValueError(f"block {block} is already registered under another hash")
        if (
            h not in self._hash_to_block
        ):  # else another block holds the same K/V: keep that one only
            self._hash_to_block[h], self._block_hash[block] = block, h
        return h

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            self.num_blocks,
            self.num_blocks - self.num_free_blocks,
            len(self._free),
            len(self._cached),
            self.hit_tokens,
            self.query_tokens,
        )

    def check_invariants(self) -> None:
        "Raise if the bookkeeping is inconsistent (for tests and debug runs; O(num_blocks))."
        refs, free, cached = self._ref_counts, set(self._free), set(self._cached)
        problems = []
        if min(refs) < 0:
            problems.append("negative reference count")
        if len(free) != len(self._free) or free & cached:
            problems.append("a block is listed twice as free")
        if free | cached != {b for b in range(self.num_blocks) if refs[b] == 0}:
            problems.append("free + cached blocks are not exactly the unreferenced ones")
        if any(self._block_hash[b] is not None for b in free) or any(
            self._block_hash[b] is None for b in cached
        ):
            problems.append("a free block has a hash, or a cached one has none")
        if {b: h for b, h in enumerate(self._block_hash) if h is not None} != {
            b: h for h, b in self._hash_to_block.items()
        }:
            problems.append("block hashes and the hash index disagree")
        shown = bytes(
            _MAP_CHARS[min(r, 9)] if r or h is None else _MAP_CACHED
            for r, h in zip(refs, self._block_hash)
        )
        if shown != self._map:
            problems.append("the block map does not show the reference counts")
        if problems:
            raise RuntimeError("block allocator is inconsistent: " + "; ".join(problems))

    def check_idle(self) -> None:
        "The invariant of an idle engine: no block is referenced (cached blocks count as free)."
        self.check_invariants()
        held = [b for b, r in enumerate(self._ref_counts) if r]
        if held:
            raise RuntimeError(
                f"{len(held)} blocks are still referenced while idle, e.g. {held[:8]}"
            )

    def reset_prefix_cache(self) -> None:
        "Forget every cached prefix (an idle allocator only): cached blocks become plain free blocks, hit counts restart."
        self.check_idle()
        for block in self._cached:
            del self._hash_to_block[self._block_hash[block]]
            self._block_hash[block] = None
            self._map[block] = _MAP_CHARS[0]
            self._free.append(block)
        self._cached.clear()
        self.hit_tokens = self.query_tokens = 0

    def _checked(self, block_id: int) -> int:
        if not (isinstance(block_id, int) and 0 <= block_id < self.num_blocks):
            raise ValueError(f"unknown block id {block_id!r}; blocks are 0..{self.num_blocks - 1}")
        return block_id


# %% [markdown]
# Allocate, share, free:

# %%
alloc = BlockAllocator(num_blocks=6, block_size=4)
a = alloc.allocate(3)
assert (
    a == [0, 1, 2]
    and alloc.ref_count(0) == 1
    and alloc.can_allocate(3)
    and not alloc.can_allocate(4)
)
assert alloc.block_map() == "111..."  # one character a block, kept as the counts change
with pytest.raises(NoFreeBlocksError, match="cannot allocate 4 blocks: only 3 of 6"):
    alloc.allocate(4)
alloc.free(a)
alloc.check_idle()
s = alloc.stats()
assert (s.used_blocks, s.free_blocks, s.cached_blocks, s.total_blocks) == (0, 6, 0, 6)
with pytest.raises(ValueError, match="double free: block 1"):
    alloc.free([1])
with pytest.raises(ValueError, match="unknown block id 6"):
    alloc.free([6])
b = alloc.allocate(1)
with pytest.raises(ValueError, match="double free"):  # all or nothing: nothing was freed
    alloc.free([b[0], b[0]])
assert alloc.ref_count(b[0]) == 1
with pytest.raises(RuntimeError, match="1 blocks are still referenced"):
    alloc.check_idle()
alloc.free(b)

# %% [markdown]
# Prefix caching: sequence A computes a 10-token prompt in 3 blocks of 4 and registers the two
# full ones; B, starting with the same 8 tokens, gets them back with a second reference.
# A prompt of exactly 8 matching tokens gets only the first block: its last token must be computed.

# %%
alloc = BlockAllocator(num_blocks=8, block_size=4)
prompt_a = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
table_a = alloc.allocate(alloc.blocks_needed(len(prompt_a)))
assert (
    alloc.match_prefix(prompt_a) == []
)  # nothing registered yet: not computed means not matchable
h0 = alloc.register_full_block(table_a[0], None, prompt_a[0:4])
h1 = alloc.register_full_block(table_a[1], h0, prompt_a[4:8])
assert alloc.hash_of(table_a[1]) == h1 == chain_hash(chain_hash(None, prompt_a[:4]), prompt_a[4:8])
hit = alloc.match_prefix(prompt_a[:8] + [99, 98, 97])
assert hit == table_a[:2] and alloc.ref_count(table_a[0]) == 2
assert alloc.match_prefix(prompt_a[:8]) == table_a[:1]  # never the whole prompt
assert alloc.match_prefix([11, 12, 13, 99, 15, 16, 17, 18, 19]) == []
s = alloc.stats()
assert (s.hit_tokens, s.query_tokens) == (8 + 4, 10 + 11 + 8 + 9) and s.used_blocks == 3
assert alloc.block_map() == "321....." and alloc.check_invariants() is None
again = alloc.match_prefix(prompt_a[:8] + [5, 5])  # a sequence that then cannot be admitted...
alloc.cancel_match(again, 10)  # ...gives its references back and is not counted as a lookup
assert alloc.stats() == s and alloc.ref_count(table_a[0]) == 3
alloc.free(hit)
alloc.free(table_a[:1])
alloc.free(table_a)
s = alloc.stats()
assert (s.used_blocks, s.cached_blocks, s.free_blocks) == (0, 2, 6)
assert alloc.block_map() == "cc......"  # free, but holding a prefix someone may ask for again
alloc.check_idle()

# %% [markdown]
# Cached blocks are reused before they are evicted, and evicted least-recently-freed first,
# the tail of a chain before its head. A duplicate (two sequences computing the same block at
# once) is not cached twice.

# %%
assert alloc.match_prefix(prompt_a) == table_a[:2]  # found again after the owner left
alloc.free(table_a[:2])
fresh = alloc.allocate(6)  # the 6 free blocks: the cache is untouched
assert not set(fresh) & set(table_a[:2]) and alloc.stats().cached_blocks == 2
assert alloc.allocate(1) == [table_a[1]]  # eviction takes the tail of the chain first
assert (
    alloc.hash_of(table_a[1]) is None and alloc.match_prefix(prompt_a) == table_a[:1]
)  # the head is left
alloc.free(fresh + table_a[:2])

dup = alloc.allocate(2)
assert (
    alloc.register_full_block(dup[0], None, prompt_a[:4]) == h0
)  # block table_a[0] holds h0 already
assert alloc.hash_of(dup[0]) is None and alloc.hash_of(table_a[0]) == h0
with pytest.raises(ValueError, match="a full block has 4 tokens"):
    alloc.register_full_block(dup[1], None, [1, 2])
alloc.free(dup)
with pytest.raises(ValueError, match="not allocated"):
    alloc.register_full_block(dup[1], None, [1, 2, 3, 4])
alloc.check_idle()

# `reset_prefix_cache` forgets every cached prefix (the engine's warm-up uses it, chapter 08); only when idle
held = alloc.allocate(1)
with pytest.raises(RuntimeError, match="still referenced"):
    alloc.reset_prefix_cache()
alloc.free(held)
assert alloc.stats().cached_blocks == 1 and alloc.hash_of(table_a[0]) == h0
alloc.reset_prefix_cache()
s = alloc.stats()
assert (s.cached_blocks, s.free_blocks, s.hit_tokens, s.query_tokens) == (0, 8, 0, 0)
assert alloc.block_map() == "." * 8
assert alloc.hash_of(table_a[0]) is None and alloc.match_prefix(prompt_a) == []
alloc.check_idle()

off = BlockAllocator(4, 4, enable_prefix_caching=False)
blk = off.allocate(2)
assert (
    off.register_full_block(blk[0], None, [1, 2, 3, 4]) is None
    and off.match_prefix([1, 2, 3, 4, 5]) == []
)
off.free(blk)
assert off.stats().cached_blocks == 0 and off.stats().free_blocks == 4
off.cancel_match(
    off.match_prefix([1, 2, 3, 4, 5]), 5
)  # an admission that did not fit: nothing was counted
assert (off.stats().query_tokens, off.stats().hit_tokens) == (0, 0)


# %% [markdown]
# ## The pool: `PagedKVCache`
#
# K and V are one tensor each, `[kv_layers, num_blocks, block_size, num_kv_heads, head_dim]`:
# one allocation sized once from the budget, and `k_cache[layer]` is a contiguous view of the
# per-layer shape `[num_blocks, block_size, num_kv_heads, head_dim]` that attention kernels take.
# Seen flat, a layer is `num_blocks * block_size` slots of one token each: token `p` of a
# sequence lives in slot `block_table[p // block_size] * block_size + p % block_size`.
#
# How many blocks? On a GPU, what is left of the memory budget after the weights and the
# activation peak (the engine measures those); on a CPU, an explicit byte budget.
# `num_blocks_for` turns bytes into blocks.

# %%
#| export
@functools.cache
def triton_kernel(name: str):
    "A Triton kernel of chapter 09_kernels_elementwise (`write_kv`) when it runs natively here (a CUDA GPU), else None."
    try:
        from forge_engine.kernels import backend, elementwise
    except ImportError:
        return None
    return getattr(elementwise, name) if backend.kernels_available("cuda") else None


class PagedKVCache:
    "The K/V pool: `k_cache`, `v_cache` of shape [kv_layers, num_blocks, block_size, num_kv_heads, head_dim]."

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        device="cpu",
        dtype=torch.float32,
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}"
            )
        self.config, self.num_blocks, self.block_size = config, num_blocks, block_size
        shape = (config.kv_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.k_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.v_cache = torch.zeros(shape, device=device, dtype=dtype)

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        "Bytes one block takes: K and V of `block_size` tokens in every layer."
        return block_size * config.kv_bytes_per_token(dtype.itemsize)

    @staticmethod
    def num_blocks_for(
        config: ModelConfig, budget_bytes: int, block_size: int, dtype: torch.dtype
    ) -> int:
        "How many blocks fit in `budget_bytes`; an error if not even one does."
        per_block = PagedKVCache.bytes_per_block(config, block_size, dtype)
        if budget_bytes < per_block:
            raise ValueError(
                f"a KV budget of {budget_bytes:,} bytes holds no block ({per_block:,} bytes each)"
            )
        return budget_bytes // per_block

    @property
    def nbytes(self) -> int:
        return self.k_cache.nbytes + self.v_cache.nbytes

    def write(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        "Store the K/V of new tokens (k, v [T, kv_heads, head_dim]) in their slots."
        if (
            k.is_cuda and (fused := triton_kernel("write_kv")) is not None
        ):  # both in one kernel (chapter 09)
            return fused(self.k_cache[layer], self.v_cache[layer], slot_mapping, k, v)
        self.k_cache[layer].flatten(0, 1).index_copy_(0, slot_mapping, k)
        self.v_cache[layer].flatten(0, 1).index_copy_(0, slot_mapping, v)

    def gather(
        self, layer: int, block_table: torch.Tensor, length: int, first_block: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V of a sequence's first `length` tokens, read through its block table: two [length, kv_heads, head_dim].
        `first_block`: the caller knows the table's blocks are first_block, first_block + 1, ... (`consecutive_from`):
        then they are a view of the pool, not a copy."""
        n = -(-length // self.block_size)
        if first_block is not None:
            return (
                self.k_cache[layer][first_block : first_block + n].flatten(0, 1)[:length],
                self.v_cache[layer][first_block : first_block + n].flatten(0, 1)[:length],
            )
        blocks = block_table[:n]
        return (
            self.k_cache[layer][blocks].flatten(0, 1)[:length],
            self.v_cache[layer][blocks].flatten(0, 1)[:length],
        )


def consecutive_from(block_ids: list[int]) -> int | None:
    "The first of `block_ids` when they are consecutive (b, b + 1, ...), else None."
    if not block_ids or block_ids != list(range(block_ids[0], block_ids[0] + len(block_ids))):
        return None
    return block_ids[0]


# %%
q4b = preset("qwen3-4b")
assert PagedKVCache.bytes_per_block(q4b, 16, torch.bfloat16) == 16 * 147_456
assert (
    PagedKVCache.num_blocks_for(q4b, 10 * 2**30, 16, torch.bfloat16) == 4551
)  # ~72k tokens in 10 GiB
with pytest.raises(ValueError, match="holds no block"):
    PagedKVCache.num_blocks_for(q4b, 1000, 16, torch.bfloat16)
cfg = preset("qwen3-tiny")
pool = PagedKVCache(cfg, num_blocks=5, block_size=4)
assert (
    pool.k_cache[0].shape == (5, 4, cfg.num_kv_heads, cfg.head_dim)
    and pool.k_cache[1].is_contiguous()
)
assert pool.nbytes == 5 * PagedKVCache.bytes_per_block(cfg, 4, torch.float32)
k = torch.randn(6, cfg.num_kv_heads, cfg.head_dim)
pool.write(1, torch.tensor([12, 13, 14, 15, 4, 5]), k, -k)  # 6 tokens: block 3, then block 1
got_k, got_v = pool.gather(1, torch.tensor([3, 1, -1]), 6)
assert torch.equal(got_k, k) and torch.equal(got_v, -k) and pool.k_cache[0].abs().sum() == 0
# blocks 1, 2 in a row: the same K/V as a view of the pool (what a lone request's table usually is)
pool.write(1, torch.tensor([4, 5, 6, 7, 8]), k[:5], -k[:5])
view_k, view_v = pool.gather(1, torch.tensor([1, 2, -1]), 5, first_block=consecutive_from([1, 2]))
assert (
    torch.equal(view_k, k[:5])
    and torch.equal(view_v, -k[:5])
    and view_k.data_ptr() == pool.k_cache[1, 1].data_ptr()
)
assert torch.equal(pool.gather(1, torch.tensor([1, 2, -1]), 5)[0], view_k)
assert (
    consecutive_from([3, 4, 5]) == 3
    and consecutive_from([3, 5]) is None
    and consecutive_from([]) is None
)


# %% [markdown]
# ## One engine step, flattened
#
# An engine step runs the model once over a batch that mixes sequences in different phases: a
# chunk of one prompt (chunked prefill), the single new token of each decoding sequence. As in
# chapter 03 the tokens are simply concatenated (*varlen*); `StepLayout` says where each
# sequence's tokens are, where their K/V goes and what they read:
#
# | field | shape | meaning |
# |---|---|---|
# | `positions` | [T] | each token's position in its sequence (for RoPE) |
# | `slot_mapping` | [T] | each token's slot in the pool (where its K/V is written) |
# | `query_start` | [B+1] | sequence `i`'s tokens are `query_start[i]:query_start[i+1]` (cu_seqlens) |
# | `context_lens` | [B] | tokens of sequence `i` in the cache after this step (cached + new) |
# | `block_tables` | [B, max_blocks] | each block table, padded with -1 |
# | `last_token_index` | [B] | the row of each sequence's last token: where its logits come from |
#
# The per-sequence counts are also kept as Python ints, so a loop over sequences never has to
# read a GPU tensor back. The caller describes each sequence as
# `(block_table, num_computed, num_new)`: tokens already in the cache, tokens in this step.
#
# The layout goes to the GPU **without waiting for it**: a plain copy from ordinary host
# memory makes PyTorch wait until the GPU has finished everything queued before it, which
# would stop the engine from building a step while the previous one runs (chapter 08). A copy
# from pinned (page-locked) memory is queued like a kernel instead.

# %%
#| export
def to_device(t: torch.Tensor, device) -> torch.Tensor:
    "A host tensor on `device`, by a copy from pinned memory: queued behind the GPU's work, not waiting for it."
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def to_device_together(tensors: Sequence[torch.Tensor], device) -> list[torch.Tensor]:
    """Host tensors of one dtype on `device` by one copy (each copy queued on a GPU costs a few microseconds, whatever
    its size): concatenated, copied as `to_device` does, and split again into views of their shapes."""
    flat = to_device(torch.cat([t.reshape(-1) for t in tensors]), device)
    return [
        part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)
    ]


@dataclass
class StepLayout:
    "Where the tokens of one flattened engine step go and what they attend to. B sequences, T tokens."

    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long
    query_start: torch.Tensor  # [B+1] long
    context_lens: torch.Tensor  # [B] long
    block_tables: torch.Tensor  # [B, max_blocks] long, -1 = no block
    last_token_index: torch.Tensor  # [B] long
    num_computed: list[int]  # host copies of the per-sequence counts
    num_new: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.num_new)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]


def build_step_layout(
    seqs: Sequence[tuple[Sequence[int], int, int]], block_size: int, device="cpu"
) -> StepLayout:
    "The layout of one step from `(block_table, num_computed, num_new)` per sequence."
    if not seqs:
        raise ValueError("a step needs at least one sequence")
    positions, slots = [], []
    for i, (table, computed, new) in enumerate(seqs):
        if computed < 0 or new < 1:
            raise ValueError(
                f"sequence {i}: needs num_computed >= 0 and num_new >= 1, got {computed} and {new}"
            )
        if len(table) * block_size < computed + new:
            raise ValueError(
                f"sequence {i}: {computed + new} tokens need {-(-(computed + new) // block_size)} "
                f"blocks of {block_size}, its block table has {len(table)}"
            )
        if min(table) < 0:
            raise ValueError(f"sequence {i}: block table has a negative block id")
        pos = torch.arange(computed, computed + new)
        slots.append(torch.tensor(table)[pos // block_size] * block_size + pos % block_size)
        positions.append(pos)
    num_computed, num_new = [s[1] for s in seqs], [s[2] for s in seqs]
    query_start = torch.tensor([0, *num_new]).cumsum(0)
    width = max(len(s[0]) for s in seqs)
    block_tables = torch.tensor([list(s[0]) + [-1] * (width - len(s[0])) for s in seqs])
    parts = to_device_together(
        [
            t.long()
            for t in (
                torch.cat(positions),
                torch.cat(slots),
                query_start,
                torch.tensor(num_computed) + torch.tensor(num_new),
                block_tables,
                query_start[1:] - 1,
            )
        ],
        device,
    )  # one copy, not six
    return StepLayout(*parts, num_computed=num_computed, num_new=num_new)


# %% [markdown]
# Three sequences in one step, block size 4: A prefills its first 6 tokens, B decodes its 10th
# token, C prefills tokens 4..6 after a cached 4-token prefix.

# %%
lay = build_step_layout([([7, 2], 0, 6), ([0, 5, 9], 9, 1), ([4, 8], 4, 3)], block_size=4)
assert (
    lay.positions.untyped_storage().data_ptr() == lay.block_tables.untyped_storage().data_ptr()
)  # one tensor
assert lay.positions.tolist() == [0, 1, 2, 3, 4, 5, 9, 4, 5, 6]
assert lay.slot_mapping.tolist() == [28, 29, 30, 31, 8, 9, 37, 32, 33, 34]
assert lay.query_start.tolist() == [0, 6, 7, 10] and lay.context_lens.tolist() == [6, 10, 7]
assert lay.block_tables.tolist() == [[7, 2, -1], [0, 5, 9], [4, 8, -1]]
assert lay.last_token_index.tolist() == [5, 6, 9] and (lay.num_seqs, lay.num_tokens) == (3, 10)
with pytest.raises(
    ValueError, match="sequence 1: 9 tokens need 3 blocks of 4, its block table has 2"
):
    build_step_layout([([7, 2], 0, 6), ([0, 5], 8, 1)], block_size=4)
with pytest.raises(ValueError, match="num_new >= 1"):
    build_step_layout([([7], 0, 0)], block_size=4)


# %% [markdown]
# ## Paged attention, the reference
#
# The attention backend of one step (chapter 03's `(layer, q, k, v) -> out`): write the new
# tokens' K/V into their slots, then for each sequence gather its K/V through its block table
# and run the same `causal_attention` as everywhere else, with the new tokens placed after the
# `num_computed` cached ones. A loop over sequences, no loop over tokens: it is the reference
# the Triton kernels of chapter 09 are tested against.
#
# A decode step is one query per sequence that sees every key. For that, PyTorch's
# `scaled_dot_product_attention` is a poor fit on a CPU: its kernel takes 0.7 ms for Qwen3-4B's
# 32 query heads over 160 keys, 1.9 ms over 400, where two small matmuls (`single_query_attention`,
# each KV head's group of query heads as the rows of one product) take 0.06 and 0.11 ms
# (`PYTHONPATH=. python3 kernels_lab/cpu_decode_attention.py`; 2.2-8x for SmolLM2's 9 heads).
# Several decodes of one step go together through one padded, masked SDPA call instead: on two
# CPU cores that was faster at 160 keys and slower at 400 than a loop of the two matmuls, so it
# stays (and it is the shape a CUDA graph needs).

# %%
#| export
def paged_decode_attention_torch(
    q: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor:
    """One query per sequence against its paged context: q [B, Hq, D], k/v_layer [num_blocks, block_size, Hkv, D],
    block_tables [B, W] (padding may be any valid block id or -1), context_lens [B] -> [B, Hq, D].
    Reads all W blocks of every row and masks what lies past the context: fixed shapes, so it can
    be captured in a CUDA graph; the Triton kernel of chapter 09 is the fast version."""
    tables = block_tables.clamp(min=0).long()
    k_ctx = k_layer[tables].flatten(1, 2).transpose(1, 2)  # [B, Hkv, W * block_size, D]
    v_ctx = v_layer[tables].flatten(1, 2).transpose(1, 2)
    positions = torch.arange(k_ctx.shape[2], device=q.device)
    mask = (positions[None, :] < context_lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k_ctx, v_ctx, attn_mask=mask, enable_gqa=q.shape[1] != k_layer.shape[2]
    )
    return out[:, :, 0, :]


def single_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    "One query that sees every key (a decode): q [1, Hq, D], k/v [L, Hkv, D] -> [1, Hq, D], in fp32 matmuls."
    q_heads, dim, kv_heads = q.shape[1], q.shape[2], k.shape[1]
    grouped = q.float().reshape(
        kv_heads, q_heads // kv_heads, dim
    )  # the query heads of each KV head: rows
    k, v = k.float().transpose(0, 1), v.float().transpose(0, 1)  # [Hkv, L, D]
    probs = (grouped @ k.transpose(1, 2) * dim**-0.5).softmax(-1)  # [Hkv, group, L]
    return (probs @ v).reshape(1, q_heads, dim).to(q.dtype)


class PagedAttention:
    """Attention backend for one step over the paged pool: write through `slot_mapping`, read through block tables.

    Sequences with several new tokens (prefill chunks) are attended one by one. Sequences with one
    new token (decodes) are attended together in one call, their contexts padded to the longest and
    masked, unless there is one, or `batch_decodes=False`: then each is attended alone
    (`single_query_attention`), so its result never depends on the others (the batch-invariant mode
    of the engine needs that). On a CPU, with a float32 pool, the decodes go to chapter 09's C kernel
    instead, all in one call, each row computed alone (`cpu_decode_attention`)."""

    def __init__(self, cache: PagedKVCache, layout: StepLayout, batch_decodes: bool = True):
        if int(layout.block_tables.max()) >= cache.num_blocks:
            raise ValueError(
                f"block tables name block {int(layout.block_tables.max())}; "
                f"the pool has {cache.num_blocks}"
            )
        self.cache, self.layout = cache, layout
        starts = layout.query_start.tolist()
        single = [i for i, new in enumerate(layout.num_new) if new == 1]
        # the decodes attended together: by the C kernel of chapter 09 (each row alone), else padded and masked
        in_c = single and cpu_decode_attention_runs(layout.block_tables.device, cache.k_cache.dtype)
        self.batched = single if in_c or (batch_decodes and len(single) > 1) else []
        self.decode_attention = cpu_decode_attention if in_c else paged_decode_attention_torch
        self.one_by_one = [i for i in range(layout.num_seqs) if i not in set(self.batched)]
        self.starts = starts
        # the first block of each one-by-one sequence whose blocks are consecutive, found once for all layers: its K/V
        # are then a view of the pool (on a GPU this path runs without Triton only; reading tables there would wait)
        self.first_blocks = {}
        if layout.block_tables.device.type == "cpu":
            for i in self.one_by_one:
                n = -(-(layout.num_computed[i] + layout.num_new[i]) // cache.block_size)
                self.first_blocks[i] = consecutive_from(layout.block_tables[i, :n].tolist())
        if self.batched:  # the decoding sequences' rows, block tables and context lengths
            index = torch.tensor(self.batched, device=layout.block_tables.device)
            self.batched_rows = layout.query_start[index]
            self.batched_tables, self.batched_lens = (
                layout.block_tables[index],
                layout.context_lens[index],
            )

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        layout = self.layout
        if q.shape[0] != layout.num_tokens:
            raise ValueError(f"the step has {layout.num_tokens} tokens, attention got {q.shape[0]}")
        self.cache.write(layer, layout.slot_mapping, k, v)
        out = torch.empty_like(q)
        for i in self.one_by_one:
            start, computed, new = self.starts[i], layout.num_computed[i], layout.num_new[i]
            k_seq, v_seq = self.cache.gather(
                layer, layout.block_tables[i], computed + new, self.first_blocks.get(i)
            )
            if new == 1:
                out[start : start + 1] = single_query_attention(q[start : start + 1], k_seq, v_seq)
            else:
                out[start : start + new] = causal_attention(
                    q[start : start + new], k_seq, v_seq, q_offset=computed
                )
        if self.batched:
            out[self.batched_rows] = self.decode_attention(
                q[self.batched_rows],
                self.cache.k_cache[layer],
                self.cache.v_cache[layer],
                self.batched_tables,
                self.batched_lens,
            )
        return out


# %% [markdown]
# The test that matters: the paged cache must not change a single logit. A prompt goes through
# in chunks of 5, 3 and 4 tokens, then 3 decode steps, its blocks scattered over the pool; the
# logits of every token must match one plain forward over the whole sequence.

# %%
@torch.no_grad()
def paged_step(model, cache, seqs, token_ids):
    "One engine step: the logits of every new token. `seqs` as for `build_step_layout`."
    layout = build_step_layout(seqs, cache.block_size)
    hidden = model(torch.tensor(token_ids), layout.positions, PagedAttention(cache, layout))
    return model.compute_logits(hidden)


model = init_random_weights(empty_model(preset("qwen3-tiny")), seed=0, std=0.1)
tokens = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32]
with torch.no_grad():
    full = model.compute_logits(model(torch.tensor(tokens), torch.arange(len(tokens))))
cache = PagedKVCache(model.config, num_blocks=10, block_size=4)
table = [7, 2, 9, 4]  # scattered, not in order
done, logits = 0, []
for n in [5, 3, 4, 1, 1, 1]:
    logits.append(paged_step(model, cache, [(table, done, n)], tokens[done : done + n]))
    done += n
# fp32: paged attention sums the same products in another order (blocks, chunks), ~1e-7 relative each, through 2
# layers: ~1e-6 on logits of O(1) (measured 2.9e-6), so 1e-5; the same below
torch.testing.assert_close(torch.cat(logits), full, rtol=1e-5, atol=1e-5)
with pytest.raises(ValueError, match="the pool has 10"):
    PagedAttention(cache, build_step_layout([([10], 0, 1)], 4))

# %% [markdown]
# A mixed step, one sequence prefilling while two decode, gives each the logits it gets alone:

# %%
others = [[5, 6, 7, 8, 9, 10], [40, 41, 42]]
mixed_cache = PagedKVCache(model.config, num_blocks=10, block_size=4)
tables = [[0, 3], [8, 1], [6, 5]]
paged_step(
    model, mixed_cache, [(tables[1], 0, 5), (tables[2], 0, 2)], others[0][:5] + others[1][:2]
)
mixed = paged_step(
    model,
    mixed_cache,
    [(tables[0], 0, 6), (tables[1], 5, 1), (tables[2], 2, 1)],
    tokens[:6] + others[0][5:] + others[1][2:],
)
torch.testing.assert_close(mixed[:6], full[:6], rtol=1e-5, atol=1e-5)
for row, seq in zip(mixed[6:], others):
    with torch.no_grad():
        alone = model.compute_logits(model(torch.tensor(seq), torch.arange(len(seq))))
    torch.testing.assert_close(row, alone[-1], rtol=1e-5, atol=1e-5)

# %% [markdown]
# ## The picture: a pool over time
#
# A small simulation with the allocator alone: 16 blocks of 4 tokens. Sequences A and B share
# an 8-token system prompt; B reuses A's two prefix blocks (`2` = two references). When A
# finishes, its private blocks go back to the pool, its registered full blocks stay *cached*;
# D arrives later with the same system prompt and picks them up again. At the end every block
# is free or cached: the idle invariant.

# %%
import matplotlib.pyplot as plt
from matplotlib.colors import ListedColormap


def simulate_pool():
    "Run a few admissions, decodes and finishes; snapshot (owner per block, refs, label) after each event."
    alloc = BlockAllocator(num_blocks=16, block_size=4)
    system = [1, 2, 3, 4, 5, 6, 7, 8]
    live: dict[str, tuple[list[int], list[int]]] = {}  # name -> (tokens, block table)
    snapshots = []

    def admit(name, tokens):
        table = alloc.match_prefix(tokens)
        table += alloc.allocate(alloc.blocks_needed(len(tokens)) - len(table))
        live[name] = (list(tokens), table)
        register(name)

    def register(name):  # K/V written: offer the full blocks to the cache
        tokens, table = live[name]
        parent = None
        for i in range(len(tokens) // 4):
            parent = alloc.register_full_block(table[i], parent, tokens[4 * i : 4 * i + 4])

    def decode(name, n):
        tokens, table = live[name]
        for _ in range(n):
            tokens.append(len(tokens) + 100)
            if len(tokens) > 4 * len(table):
                table += alloc.allocate(1)
        register(name)

    def finish(name):
        alloc.free(live.pop(name)[1])

    def snap(label):
        owner = [""] * alloc.num_blocks
        for name, (_, table) in live.items():
            for b in table:
                owner[b] = owner[b] + name
        snapshots.append(
            (
                label,
                owner,
                [alloc.ref_count(b) for b in range(16)],
                [alloc.hash_of(b) is not None for b in range(16)],
            )
        )

    admit("A", system + [20, 21, 22, 23, 24])
    snap("A: prompt of 13")
    admit("B", system + [30, 31, 32])
    snap("B: same 8-token prefix")
    decode("A", 4)
    decode("B", 2)
    snap("both decode")
    admit("C", [50 + i for i in range(9)])
    snap("C: another prompt")
    finish("A")
    snap("A finishes")
    finish("B")
    snap("B finishes")
    admit("D", system + [40, 41, 42, 43, 44, 45])
    snap("D: finds the prefix")
    admit("E", [200 + i for i in range(30)])
    snap("E: evicts cached blocks")
    for name in ["C", "D", "E"]:
        finish(name)
    snap("all finish: idle")
    alloc.check_idle()
    return snapshots, alloc.stats()


snapshots, final = simulate_pool()
assert final.used_blocks == 0 and final.hit_tokens == 16 and final.cached_blocks > 0

names = ["free", "cached", "A", "B", "C", "D", "E", "shared"]
colors = ["white", "#d9d9d9", "#4c72b0", "#dd8452", "#55a868", "#c44e52", "#937860", "#8172b3"]


def state(owner, cached):
    if len(owner) > 1:
        return names.index("shared")
    return names.index(owner) if owner else names.index("cached" if cached else "free")


grid = [[state(o, c) for o, c in zip(owner, cached)] for _, owner, _, cached in snapshots]
fig, ax = plt.subplots(figsize=(9, 3.6))
ax.imshow(grid, cmap=ListedColormap(colors), vmin=0, vmax=len(names) - 1)
for row, (_, owner, refs, _) in enumerate(snapshots):
    for col, r in enumerate(refs):
        if r:
            ax.text(col, row, str(r), ha="center", va="center", color="white", fontsize=8)
ax.set_xticks(range(16))
ax.set_yticks(range(len(snapshots)), [s[0] for s in snapshots])
ax.set_xticks([x - 0.5 for x in range(17)], minor=True)
ax.set_yticks([y - 0.5 for y in range(len(snapshots) + 1)], minor=True)
ax.grid(which="minor", color="black", linewidth=0.5)
ax.tick_params(which="minor", length=0)
ax.set(xlabel="block id", title="the block pool after each event (number = references)")
ax.legend(
    handles=[plt.Rectangle((0, 0), 1, 1, facecolor=c, edgecolor="black") for c in colors],
    labels=names,
    loc="upper left",
    bbox_to_anchor=(1.01, 1),
    fontsize=8,
)
plt.tight_layout()
plt.show()
