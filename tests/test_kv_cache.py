"""The paged KV cache: allocator corner cases, a property test of the allocation protocol, and
paged attention against plain forwards on the three tiny model families.

The light checks (one model, one path each) are test cells in nbs/05_paged_kv.ipynb.
"""

import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings, strategies as st

from forge_engine.config import preset
from forge_engine.generate import SamplingParams, generate_tokens
from forge_engine.kv_cache import (
    BlockAllocator,
    NoFreeBlocksError,
    PagedAttention,
    PagedKVCache,
    build_step_layout,
    chain_hash,
)
from forge_engine.model import empty_model, init_random_weights

PRESETS = ["qwen3-tiny", "qwen2-tiny", "llama-tiny"]
# fp32: paged attention sums the products of a plain forward in another order (blocks, chunks), each rounding 2^-24,
# through 2 layers: ~1e-6 on logits of O(1) (measured: 2.7e-6 at most), so 1e-5
TOL = dict(rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- allocator


def register_prefix(alloc, table, tokens):
    "Register every full block of `tokens` (held in `table`), chaining the hashes; returns them."
    hashes, parent = [], None
    for i in range(len(tokens) // alloc.block_size):
        parent = alloc.register_full_block(
            table[i], parent, tokens[i * alloc.block_size : (i + 1) * alloc.block_size]
        )
        hashes.append(parent)
    return hashes


def test_refcounts_follow_sharing():
    alloc = BlockAllocator(4, 2)
    table = alloc.allocate(2)
    register_prefix(alloc, table, [1, 2, 3, 4])
    other = alloc.match_prefix([1, 2, 3, 4, 5])
    third = alloc.match_prefix([1, 2, 3, 4, 9])
    assert other == third == table and [alloc.ref_count(b) for b in table] == [3, 3]
    assert alloc.stats().used_blocks == 2
    alloc.free(other)
    alloc.free(table)
    assert [alloc.ref_count(b) for b in table] == [1, 1] and alloc.stats().cached_blocks == 0
    alloc.free(third)
    assert alloc.stats().cached_blocks == 2
    alloc.check_idle()


def test_allocate_bounds():
    alloc = BlockAllocator(3, 4)
    assert alloc.allocate(0) == [] and alloc.blocks_needed(0) == 0 and alloc.blocks_needed(9) == 3
    with pytest.raises(ValueError, match="negative"):
        alloc.allocate(-1)
    held = alloc.allocate(3)
    assert not alloc.can_allocate(1)
    with pytest.raises(NoFreeBlocksError, match="only 0 of 3"):
        alloc.allocate(1)
    alloc.free(held)
    with pytest.raises(ValueError, match="num_blocks and block_size must be >= 1"):
        BlockAllocator(0, 4)


def test_misuse_is_refused_without_side_effects():
    alloc = BlockAllocator(4, 2)
    a = alloc.allocate(2)
    for bad in ([-1], [4], [1.0], ["0"]):
        with pytest.raises(ValueError, match="unknown block id"):
            alloc.free(bad)
    with pytest.raises(ValueError, match="double free"):
        alloc.free([a[1], a[0], a[0]])
    assert [alloc.ref_count(b) for b in a] == [1, 1]  # nothing was dropped
    h = alloc.register_full_block(a[0], None, [1, 2])
    assert alloc.register_full_block(a[0], None, [1, 2]) == h  # again: harmless
    with pytest.raises(ValueError, match="already registered under another hash"):
        alloc.register_full_block(a[0], None, [2, 1])
    alloc.free(a)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(a)
    alloc.check_idle()


def test_lru_eviction_order():
    alloc = BlockAllocator(6, 1)
    x, y = alloc.allocate(3), alloc.allocate(3)
    register_prefix(alloc, x, [1, 2, 3])
    register_prefix(alloc, y, [7, 8, 9])
    alloc.free(y)  # freed first: evicted first, and within a table the tail first
    alloc.free(x)
    assert alloc.allocate(1) == [y[2]] and alloc.allocate(1) == [y[1]]
    assert alloc.match_prefix([7, 8, 9, 0]) == [y[0]]  # the head survived and is usable
    alloc.free([y[0]])  # now the most recently freed
    assert alloc.allocate(3) == [x[2], x[1], x[0]] and alloc.allocate(1) == [y[0]]
    assert alloc.match_prefix([1, 2, 3, 0]) == [] and alloc.stats().cached_blocks == 0


def test_free_blocks_are_taken_before_cached_ones():
    alloc = BlockAllocator(4, 2)
    a = alloc.allocate(2)
    register_prefix(alloc, a, [1, 2, 3, 4])
    alloc.free(a)
    fresh = alloc.allocate(2)
    assert set(fresh).isdisjoint(a) and alloc.match_prefix([1, 2, 3, 4, 5]) == a


def test_never_matches_the_whole_prompt():
    alloc = BlockAllocator(8, 4)
    tokens = list(range(12))
    table = alloc.allocate(3)
    register_prefix(alloc, table, tokens)
    assert (
        alloc.match_prefix(tokens) == table[:2]
    )  # 12 cached tokens, 8 matched: the last is computed
    assert alloc.match_prefix(tokens + [99]) == table
    assert alloc.match_prefix(tokens[:9]) == table[:2]
    assert alloc.match_prefix(tokens[:8]) == table[:1]
    assert alloc.match_prefix(tokens[:4]) == [] and alloc.match_prefix([]) == []


def test_hit_rate_counters():
    alloc = BlockAllocator(8, 4)
    table = alloc.allocate(2)
    register_prefix(alloc, table, list(range(8)))
    got = [
        alloc.match_prefix(list(range(8)) + [50, 51]),
        alloc.match_prefix(list(range(4)) + [9, 9]),
        alloc.match_prefix([5] * 10),
    ]
    s = alloc.stats()
    assert (s.hit_tokens, s.query_tokens) == (
        8 + 4 + 0,
        10 + 6 + 10,
    ) and s.hit_rate == 12 / 26  # the same division
    for blocks in got:
        alloc.free(blocks)
    alloc.free(table)
    assert BlockAllocator(2, 2).stats().hit_rate == 0.0


def test_same_block_computed_twice_is_cached_once():
    alloc = BlockAllocator(6, 2)
    a, b = alloc.allocate(2), alloc.allocate(2)  # two sequences computed the same prompt at once
    assert register_prefix(alloc, a, [1, 2, 3, 4]) == register_prefix(alloc, b, [1, 2, 3, 4])
    assert [alloc.hash_of(x) is not None for x in a + b] == [True, True, False, False]
    alloc.free(b)
    alloc.free(a)
    s = alloc.stats()
    assert (s.cached_blocks, s.free_blocks) == (2, 4)
    assert alloc.match_prefix([1, 2, 3, 4, 5]) == a


def test_chain_hash_is_stable_across_processes():
    # a fixed value: blake2b over packed integers, not Python's salted hash of strings
    import subprocess, sys

    code = "from forge_engine.kv_cache import chain_hash; print(chain_hash(chain_hash(None, [1, 2]), [3, 4]))"
    other = int(
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
    )
    assert other == chain_hash(chain_hash(None, [1, 2]), [3, 4])


def test_prefix_caching_off():
    alloc = BlockAllocator(4, 2, enable_prefix_caching=False)
    a = alloc.allocate(2)
    assert register_prefix(alloc, a, [1, 2, 3, 4]) == [None, None]
    assert alloc.hash_of(a[0]) is None and alloc.match_prefix([1, 2, 3, 4, 5]) == []
    alloc.free(a)
    s = alloc.stats()
    assert (s.free_blocks, s.cached_blocks, s.query_tokens) == (4, 0, 0)


# A random workload that follows the scheduler's protocol. The test keeps its own truth: which
# tokens each block's K/V was computed from, and how many live sequences hold each block.
admit = st.tuples(st.just("admit"), st.lists(st.integers(0, 2), min_size=1, max_size=9))
decode = st.tuples(st.just("decode"), st.integers(0, 7), st.integers(0, 2))
finish = st.tuples(st.just("finish"), st.integers(0, 7))


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.one_of(admit, decode, finish), max_size=40), caching=st.booleans())
def test_random_workload_keeps_invariants(ops, caching):
    bs, alloc = 2, BlockAllocator(10, 2, enable_prefix_caching=caching)
    live: list[tuple[list[int], list[int]]] = []  # (tokens, block table)
    written: dict[int, tuple[int, ...]] = {}  # block -> the token prefix its K/V was computed from

    def compute(tokens, table, start):  # "write K/V" of tokens[start:], then register full blocks
        for p in range(start, len(tokens)):
            block = table[p // bs]
            assert alloc.ref_count(block) == 1, "a sequence writes into a block someone else reads"
            written[block] = tuple(tokens[: p + 1])
        parent = None
        for i in range(len(tokens) // bs):
            parent = alloc.register_full_block(table[i], parent, tokens[i * bs : (i + 1) * bs])

    for op, *args in ops:
        if op == "admit":
            tokens = args[0]
            matched = alloc.match_prefix(tokens)
            assert len(matched) * bs < len(tokens) and (caching or not matched)
            for i, block in enumerate(matched):
                assert written[block] == tuple(tokens[: (i + 1) * bs]), (
                    "matched a block with other K/V"
                )
            need = alloc.blocks_needed(len(tokens)) - len(matched)
            if alloc.can_allocate(need):
                table = matched + alloc.allocate(need)
                compute(tokens, table, len(matched) * bs)
                live.append((list(tokens), table))
            else:
                alloc.free(matched)
        elif op == "decode" and live:
            tokens, table = live[args[0] % len(live)]
            tokens.append(args[1])
            if len(tokens) > len(table) * bs:
                if not alloc.can_allocate(1):  # preempt: give everything back
                    alloc.free(table)
                    live.remove((tokens, table))
                    continue
                table += alloc.allocate(1)
            compute(tokens, table, len(tokens) - 1)
        elif op == "finish" and live:
            alloc.free(live.pop(args[0] % len(live))[1])
        alloc.check_invariants()
        refs = Counter(b for _, table in live for b in table)
        assert all(alloc.ref_count(b) == refs[b] for b in range(alloc.num_blocks))
        s = alloc.stats()
        assert (
            s.used_blocks == len(refs)
            and s.used_blocks + s.free_blocks + s.cached_blocks == s.total_blocks
        )
        assert s.hit_tokens <= s.query_tokens
    for _, table in live:
        alloc.free(table)
    alloc.check_idle()
    s = alloc.stats()
    assert (
        s.used_blocks == 0
        and s.free_blocks + s.cached_blocks == 10
        and (caching or s.cached_blocks == 0)
    )


# ---------------------------------------------------------------- paged attention vs plain forwards


def tiny_model(name):
    return init_random_weights(empty_model(preset(name)), seed=3, std=0.1)


@torch.no_grad()
def paged_step(model, cache, seqs, token_ids):
    "One flattened engine step; the logits of every new token."
    layout = build_step_layout(seqs, cache.block_size)
    hidden = model(torch.tensor(token_ids), layout.positions, PagedAttention(cache, layout))
    return model.compute_logits(hidden)


@torch.no_grad()
def full_logits(model, tokens):
    "Logits at every position from one forward without any cache."
    return model.compute_logits(model(torch.tensor(tokens), torch.arange(len(tokens))))


def scattered_blocks(n, num_blocks=32, seed=0):
    return random.Random(seed).sample(range(num_blocks), n)


PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]


@pytest.mark.parametrize("name", PRESETS)
def test_chunked_prefill_then_decode_matches_plain_forward(name):
    model = tiny_model(name)
    cache = PagedKVCache(model.config, num_blocks=32, block_size=4)
    table = scattered_blocks(6)  # room for 24 tokens
    tokens, done, logits = list(PROMPT), 0, []
    for chunk in [5, 3, 5]:
        logits.append(paged_step(model, cache, [(table, done, chunk)], tokens[done : done + chunk]))
        done += chunk
    for _ in range(8):
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(paged_step(model, cache, [(table, done, 1)], tokens[done:]))
        done += 1
    torch.testing.assert_close(torch.cat(logits), full_logits(model, tokens), **TOL)
    reference = generate_tokens(
        model, PROMPT, SamplingParams(max_tokens=8, temperature=0)
    ).token_ids
    assert tokens[len(PROMPT) :] == reference


@pytest.mark.parametrize("name", PRESETS)
def test_mixed_step_equals_each_sequence_alone(name):
    model = tiny_model(name)
    cache = PagedKVCache(model.config, num_blocks=32, block_size=4)
    prompts = [PROMPT, [5, 6, 7, 8, 9, 10, 11], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
    blocks = scattered_blocks(12, seed=1)
    tables = [blocks[0:4], blocks[4:8], blocks[8:12]]
    # step 1: sequence 0 prefills its first chunk while 1 and 2 prefill whole prompts but their last token
    paged_step(
        model,
        cache,
        [(tables[0], 0, 6), (tables[1], 0, 6), (tables[2], 0, 8)],
        prompts[0][:6] + prompts[1][:6] + prompts[2][:8],
    )
    # step 2: sequence 0 prefills 7 more, 1 and 2 decode one token each
    mixed = paged_step(
        model,
        cache,
        [(tables[0], 6, 7), (tables[1], 6, 1), (tables[2], 8, 1)],
        prompts[0][6:] + prompts[1][6:] + prompts[2][8:],
    )
    torch.testing.assert_close(mixed[:7], full_logits(model, prompts[0])[6:], **TOL)
    torch.testing.assert_close(mixed[7], full_logits(model, prompts[1])[-1], **TOL)
    torch.testing.assert_close(mixed[8], full_logits(model, prompts[2])[-1], **TOL)


@pytest.mark.parametrize("owner_alive", [True, False])
@pytest.mark.parametrize("name", PRESETS)
def test_prefix_cache_hit_gives_the_same_logits(name, owner_alive):
    model, bs = tiny_model(name), 4
    alloc = BlockAllocator(16, bs)
    cache = PagedKVCache(model.config, num_blocks=16, block_size=bs)
    first = PROMPT[:11]  # 2 full blocks + 3 tokens
    second = PROMPT[:8] + [7, 7, 1, 2, 3]  # shares the 2-block prefix
    table1 = alloc.allocate(alloc.blocks_needed(len(first) + 1))
    paged_step(model, cache, [(table1, 0, len(first))], first)
    register_prefix(alloc, table1, first)
    if not owner_alive:
        alloc.free(table1)
    hit = alloc.match_prefix(second)
    assert hit == table1[:2] and [alloc.ref_count(b) for b in hit] == [2 if owner_alive else 1] * 2
    table2 = hit + alloc.allocate(alloc.blocks_needed(len(second)) - len(hit))
    logits = paged_step(model, cache, [(table2, 8, len(second) - 8)], second[8:])
    torch.testing.assert_close(logits, full_logits(model, second)[8:], **TOL)
    if (
        owner_alive
    ):  # the first sequence's blocks were read, not overwritten: it decodes on correctly
        nxt = paged_step(model, cache, [(table1, len(first), 1)], [5])
        torch.testing.assert_close(nxt[0], full_logits(model, first + [5])[-1], **TOL)
        alloc.free(table1)
    alloc.free(table2)
    alloc.check_idle()
    assert alloc.stats().hit_tokens == 8


def test_layout_and_attention_refuse_bad_input():
    model = tiny_model("qwen3-tiny")
    cache = PagedKVCache(model.config, num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="at least one sequence"):
        build_step_layout([], 4)
    with pytest.raises(ValueError, match="negative block id"):
        build_step_layout([([0, -1], 0, 5)], 4)
    layout = build_step_layout([([0, 1], 0, 5)], 4)
    attention = PagedAttention(cache, layout)
    q = torch.zeros(4, model.config.num_heads, model.config.head_dim)
    kv = torch.zeros(4, model.config.num_kv_heads, model.config.head_dim)
    with pytest.raises(ValueError, match="the step has 5 tokens, attention got 4"):
        attention(0, q, kv, kv)
