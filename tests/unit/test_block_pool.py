"""BlockPool and KVCacheManager: free-queue order, ref counts, integrity checks, prefix caching."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

from pagedllm.core.block_pool import BlockPool, hash_block_tokens
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams


def make_req(rid: str, tokens: list[int], cache_salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1), arrival_time=0.0, cache_salt=cache_salt)


def run_tokens(kv: KVCacheManager, req: Request, n: int, hits=()) -> list | None:
    """Allocates slots for `n` tokens after `hits` and marks them computed, as one executed step does
    (the request's K/V is then valid for all_token_ids[:num_computed_tokens])."""
    new = kv.allocate_slots(req, n, hits)
    if new is not None:
        req.num_computed_tokens += len(hits) * kv.block_size + n
    return new


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def drain_order(pool: BlockPool) -> list[int]:
    """The free queue's order, read by taking every free block (the pool is unusable afterwards)."""
    return ids(pool.get_new_blocks(pool.num_free_blocks))


def reference_hash(parent: bytes | None, tokens: list[int], extra: tuple = ()) -> bytes:
    """The block key recomputed here with hashlib: parent key (32 zero bytes for the first block),
    then the token ids as native-endian int64, then repr() of the extra keys if any."""
    data = (parent or bytes(32)) + b"".join(t.to_bytes(8, sys.byteorder, signed=True) for t in tokens)
    if extra:
        data += repr(extra).encode()
    return hashlib.sha256(data).digest()


# ---- BlockPool ----------------------------------------------------------------------------


def test_allocation_pops_free_queue_front_and_sets_ref_counts() -> None:
    pool = BlockPool(6)
    assert pool.num_free_blocks == 6
    assert ids(pool.get_new_blocks(2)) == [0, 1]
    assert ids(pool.get_new_blocks(3)) == [2, 3, 4]
    assert [b.ref_cnt for b in pool.blocks] == [1, 1, 1, 1, 1, 0]
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(5 / 6)
    pool.check_integrity({0: 1, 1: 1, 2: 1, 3: 1, 4: 1})
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1  # a failed request takes nothing


def test_next_free_ids_names_what_the_next_allocation_takes_and_changes_nothing() -> None:
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)
    pool.free_blocks(a[1:2])  # a block without a cached prefix goes to the front
    assert pool.next_free_ids(3) == [1, 3, 4]
    assert pool.next_free_ids(10) == [1, 3, 4, 5]
    assert pool.num_free_blocks == 4 and pool.blocks[1].ref_cnt == 0
    assert ids(pool.get_new_blocks(3)) == [1, 3, 4]


def test_touch_and_free_count_references() -> None:
    pool = BlockPool(4)
    b0, b1 = pool.get_new_blocks(2)
    pool.touch([b0])  # a second owner
    assert (b0.ref_cnt, b1.ref_cnt) == (2, 1)
    pool.check_integrity({0: 2, 1: 1})
    pool.free_blocks([b0])
    assert b0.ref_cnt == 1 and pool.num_free_blocks == 2  # still held once: not free
    pool.free_blocks([b0, b1])
    assert pool.num_free_blocks == 4
    pool.check_integrity({})


def test_free_appends_cached_blocks_to_back_in_given_order() -> None:
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)  # 0, 1, 2; free queue now [3, 4]
    for i, b in enumerate(blocks):
        pool.cache_block(b, bytes([i]) * 32)
    pool.free_blocks([blocks[2], blocks[0], blocks[1]])
    assert drain_order(pool) == [3, 4, 2, 0, 1]


def test_free_puts_blocks_without_a_cached_prefix_first() -> None:
    """A freed block with no cached content is taken before never-used blocks (its pages are in
    memory already) and before blocks holding a cached prefix (nothing is evicted for it)."""
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(4)  # 0..3; free queue now [4, 5]
    pool.cache_block(blocks[0], b"\x01" * 32)
    pool.free_blocks([blocks[0], blocks[1]])  # 0 cached -> back; 1 uncached -> front
    pool.free_blocks([blocks[3], blocks[2]])  # uncached, tail first: 3 then 2 to the front
    assert drain_order(pool) == [2, 3, 1, 4, 5, 0]
    assert pool.num_evictions == 1  # only block 0 lost a cached prefix, and last


def test_without_caching_a_finished_request_blocks_are_reused_before_unused_ones() -> None:
    kv = KVCacheManager(6, 4, enable_caching=False)
    a = make_req("a", list(range(8)))
    assert ids(kv.allocate_slots(a, 8)) == [0, 1]
    kv.free(a)
    kv.check_integrity()
    b = make_req("b", list(range(10, 18)))
    assert ids(kv.allocate_slots(b, 8)) == [0, 1]  # a's blocks again, not 2 and 3


def test_manager_free_returns_blocks_tail_first() -> None:
    kv = KVCacheManager(6, 4)
    a, b = make_req("a", list(range(8))), make_req("b", list(range(10, 18)))
    assert ids(run_tokens(kv, a, 8)) == [0, 1]  # two full blocks, computed: cached
    assert ids(run_tokens(kv, b, 8)) == [2, 3]
    kv.free(a)  # queue: [4, 5] + a's cached blocks tail first
    kv.free(b)
    kv.check_integrity()
    assert drain_order(kv.pool) == [4, 5, 1, 0, 3, 2]


def test_check_integrity_passes_in_normal_use() -> None:
    kv = KVCacheManager(8, 4)
    reqs = [make_req(f"r{i}", list(range(i, i + 4 * i + 3))) for i in range(3)]
    for r in reqs:
        assert kv.allocate_slots(r, r.num_tokens) is not None
        kv.check_integrity()
    kv.free(reqs[1])
    kv.check_integrity()
    kv.reset_prefix_cache()
    kv.check_integrity()


def test_check_integrity_detects_negative_ref_count() -> None:
    pool = BlockPool(4)
    pool.check_integrity({})
    pool.blocks[3].ref_cnt = -1
    with pytest.raises(AssertionError, match="negative ref count"):
        pool.check_integrity()


def test_check_integrity_detects_block_both_free_and_owned() -> None:
    kv = KVCacheManager(4, 4)
    r = make_req("r", list(range(6)))
    kv.allocate_slots(r, 6)
    kv.check_integrity()
    kv.pool._free[kv.req_blocks["r"][0].block_id] = None  # corrupt: an owned block in the free queue
    with pytest.raises(AssertionError):
        kv.check_integrity()


def test_check_integrity_detects_owned_map_mismatch() -> None:
    kv = KVCacheManager(4, 4)
    r = make_req("r", list(range(6)))
    kv.allocate_slots(r, 6)
    kv.check_integrity()
    # A block table that names a free block (the pool's ref counts do not know about it).
    kv.req_blocks["r"].append(kv.pool.blocks[3])
    with pytest.raises(AssertionError, match="referenced 1 times"):
        kv.check_integrity()
    kv.req_blocks["r"].pop()
    kv.check_integrity()
    # And directly: an owner map that disagrees with a held block's ref count.
    with pytest.raises(AssertionError):
        kv.pool.check_integrity({0: 2, 1: 1})


def test_check_integrity_detects_stale_hash_table_entry() -> None:
    kv = KVCacheManager(4, 4)
    r = make_req("r", list(range(8)))
    kv.allocate_slots(r, 8)
    block = kv.req_blocks["r"][0]
    assert block.block_hash is not None
    block.block_hash = b"x" * 32  # the table still maps the old key to it
    with pytest.raises(AssertionError):
        kv.check_integrity()


# ---- allocate_slots ---------------------------------------------------------------------------


def test_allocate_slots_grows_at_block_boundaries() -> None:
    kv = KVCacheManager(8, 4, enable_caching=False)
    r = make_req("r", list(range(4)))
    assert len(kv.allocate_slots(r, 4)) == 1  # 4 tokens -> 1 block
    r.num_computed_tokens = 4
    r.append_output_token(99)  # token 5
    new = kv.allocate_slots(r, 1)
    assert len(new) == 1 and len(kv.req_blocks["r"]) == 2  # 5 tokens -> 2 blocks
    r.num_computed_tokens = 5
    for n_tokens in (6, 7, 8):  # tokens 6..8 fit the second block
        r.append_output_token(99)
        assert kv.allocate_slots(r, 1) == []
        r.num_computed_tokens = n_tokens
    r.append_output_token(99)  # token 9 -> third block
    assert len(kv.allocate_slots(r, 1)) == 1
    assert len(kv.req_blocks["r"]) == 3
    kv.check_integrity()

    r5 = make_req("r5", list(range(5)))
    assert len(kv.allocate_slots(r5, 5)) == 2  # 5 tokens at once -> 2 blocks


def test_allocate_slots_returns_none_and_allocates_nothing_when_short() -> None:
    kv = KVCacheManager(3, 4)
    a = make_req("a", list(range(8)))
    run_tokens(kv, a, 8)
    b = make_req("b", list(range(100, 109)))  # 9 tokens need 3 blocks; 1 free
    assert kv.allocate_slots(b, 9) is None
    assert kv.num_free_blocks == 1
    assert "b" not in kv.req_blocks
    kv.check_integrity()
    # Short counting prefix hits that sit in the free queue: the hits are not taken either.
    kv.free(a)  # free queue: [2, 1, 0]
    kv.allocate_slots(make_req("d", list(range(200, 204))), 4)  # takes block 2
    c = make_req("c", list(range(8)) + [50])  # 9 tokens: 2 hits (blocks 1, 0) + 1 fresh
    hits, n_hit = kv.get_computed_blocks(c)
    assert ids(hits) == [0, 1] and n_hit == 8
    assert kv.allocate_slots(c, 1, hits) is None  # the 2 free blocks are the hits themselves
    assert kv.num_free_blocks == 2
    assert [b.ref_cnt for b in hits] == [0, 0]
    assert "c" not in kv.req_blocks
    kv.check_integrity()
    big = make_req("big", list(range(300, 313)))  # 13 tokens: 4 blocks > 2 free
    assert kv.allocate_slots(big, 13) is None
    assert kv.num_free_blocks == 2
    kv.check_integrity()


# ---- prefix cache -----------------------------------------------------------------------------


def test_block_keys_are_chained_sha256() -> None:
    kv = KVCacheManager(8, 4)
    tokens = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    r = make_req("r", tokens)
    kv.get_computed_blocks(r)
    assert len(r.block_hashes) == 2  # only full blocks
    h0 = reference_hash(None, tokens[:4])
    h1 = reference_hash(h0, tokens[4:8])
    assert r.block_hashes == [h0, h1]
    assert all(len(h) == 32 for h in r.block_hashes)
    assert hash_block_tokens(None, tokens[:4]) == h0
    # Chained: the same 4 tokens after a different first block get a different key.
    other = make_req("o", [1, 2, 3, 4] + tokens[4:8])
    kv.get_computed_blocks(other)
    assert other.block_hashes[1] != h1
    # The salt enters the first key (and so every key after it).
    s = make_req("s", tokens, cache_salt="alice")
    kv.get_computed_blocks(s)
    assert s.block_hashes[0] == reference_hash(None, tokens[:4], ("alice",))
    assert s.block_hashes[1] == reference_hash(s.block_hashes[0], tokens[4:8])


def test_block_keys_are_deterministic_across_processes() -> None:
    code = (
        "from pagedllm.core.block_pool import hash_block_tokens as h;"
        "p = h(None, [1, 2, 3, 4], ('salt',)); print(h(p, [5, 6, 7, 8]).hex())"
    )
    outs = set()
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        outs.add(res.stdout.strip())
    expected = reference_hash(reference_hash(None, [1, 2, 3, 4], ("salt",)), [5, 6, 7, 8]).hex()
    assert outs == {expected}


def test_second_request_hits_exact_blocks_of_first() -> None:
    kv = KVCacheManager(16, 4)
    prompt = list(range(40, 53))  # 13 tokens: 3 full blocks + 1
    a = make_req("a", prompt)
    run_tokens(kv, a, 13)
    a_blocks = kv.get_block_ids("a")
    b = make_req("b", prompt + [7, 7])
    hits, n_hit = kv.get_computed_blocks(b)
    assert ids(hits) == a_blocks[:3] and n_hit == 12
    free_before = kv.num_free_blocks
    new = run_tokens(kv, b, b.num_tokens - n_hit, hits)
    assert len(new) == 1  # 15 tokens -> 4 blocks: 3 hits + 1 fresh
    assert kv.get_block_ids("b")[:3] == a_blocks[:3]
    assert kv.num_free_blocks == free_before - 1  # hits were held by a: not taken from the free queue
    assert [kv.pool.blocks[i].ref_cnt for i in a_blocks[:3]] == [2, 2, 2]
    kv.check_integrity()
    kv.free(a)
    kv.free(b)
    kv.check_integrity()
    assert kv.usage == 0


def test_hit_is_capped_below_num_tokens() -> None:
    kv = KVCacheManager(8, 4)
    prompt = list(range(8))
    run_tokens(kv, make_req("a", prompt), 8)  # both blocks cached
    b = make_req("b", prompt)
    hits, n_hit = kv.get_computed_blocks(b)
    assert n_hit == 4 and len(hits) == 1  # the last token must be computed
    # One more token and the whole 8 may be reused.
    c = make_req("c", prompt + [9])
    assert kv.get_computed_blocks(c)[1] == 8


def test_hit_after_owner_finished_revives_free_blocks() -> None:
    kv = KVCacheManager(6, 4)
    prompt = list(range(100, 109))  # 9 tokens, 2 full blocks
    a = make_req("a", prompt)
    run_tokens(kv, a, 9)
    a_blocks = kv.get_block_ids("a")
    kv.free(a)
    assert kv.num_free_blocks == 6
    b = make_req("b", prompt)
    hits, n_hit = kv.get_computed_blocks(b)
    assert ids(hits) == a_blocks[:2] and n_hit == 8
    assert run_tokens(kv, b, 1, hits) is not None
    assert kv.get_block_ids("b")[:2] == a_blocks[:2]
    assert len(kv.get_block_ids("b")) == 3  # 9 tokens -> 3 blocks, not more
    assert kv.num_free_blocks == 6 - 3  # 2 revived + 1 fresh
    assert all(kv.pool.blocks[i].ref_cnt == 1 for i in a_blocks[:2])
    kv.check_integrity()


def test_different_cache_salt_gets_no_hit() -> None:
    kv = KVCacheManager(8, 4)
    prompt = list(range(9))
    run_tokens(kv, make_req("a", prompt, cache_salt="alice"), 9)
    assert kv.get_computed_blocks(make_req("b", prompt, cache_salt="bob"))[1] == 0
    assert kv.get_computed_blocks(make_req("c", prompt))[1] == 0
    assert kv.get_computed_blocks(make_req("d", prompt, cache_salt="alice"))[1] == 8


def test_disabled_caching_never_hits() -> None:
    kv = KVCacheManager(8, 4, enable_caching=False)
    prompt = list(range(9))
    run_tokens(kv, make_req("a", prompt), 9)
    assert kv.get_computed_blocks(make_req("b", prompt)) == ([], 0)
    assert all(b.block_hash is None for b in kv.pool.blocks)


def test_lru_eviction_order() -> None:
    kv = KVCacheManager(4, 4)
    pa, pb = list(range(8)), list(range(50, 58))
    a, b = make_req("a", pa), make_req("b", pb)
    run_tokens(kv, a, 8)  # blocks 0, 1
    run_tokens(kv, b, 8)  # blocks 2, 3
    kv.free(a)  # freed first: evicted first, tail (1) before head (0)
    kv.free(b)

    def n_hit(prompt: list[int]) -> int:
        return kv.get_computed_blocks(make_req("q", prompt + [1]))[1]

    assert (n_hit(pa), n_hit(pb)) == (8, 8)
    evicted = []
    for i in range(4):
        filler = make_req(f"f{i}", [1000 + i] * 4)
        evicted += ids(kv.allocate_slots(filler, 4))
        kv.check_integrity()
        if i == 0:
            assert (n_hit(pa), n_hit(pb)) == (4, 8)  # a's tail gone, its head still cached
        elif i == 1:
            assert (n_hit(pa), n_hit(pb)) == (0, 8)
        elif i == 2:
            assert (n_hit(pa), n_hit(pb)) == (0, 4)
    assert evicted == [1, 0, 3, 2]
    assert (n_hit(pa), n_hit(pb)) == (0, 0)
    assert kv.pool.num_evictions == 4


def test_reset_prefix_cache_while_blocks_are_held() -> None:
    kv = KVCacheManager(8, 4)
    prompt = list(range(9))
    a = make_req("a", prompt)
    run_tokens(kv, a, 9)
    kv.free(make_req("x", []))  # freeing an unknown request is a no-op
    kv.reset_prefix_cache()
    kv.check_integrity()
    assert all(b.block_hash is None for b in kv.pool.blocks)
    assert kv.get_computed_blocks(make_req("b", prompt)) == ([], 0)
    assert kv.get_block_ids("a") == [0, 1, 2]  # a keeps its blocks
    kv.free(a)
    kv.check_integrity()
    assert kv.usage == 0
    assert kv.get_computed_blocks(make_req("c", prompt)) == ([], 0)


def test_free_drops_keys_of_blocks_never_computed() -> None:
    """Keys are registered when tokens are scheduled; a request freed before they were computed
    (preempted later in the same step) must not leave those keys behind for later hits."""
    kv = KVCacheManager(8, 4)
    prompt = list(range(13))
    a = make_req("a", prompt)
    run_tokens(kv, a, 4)  # block 0 computed
    kv.allocate_slots(a, 8)  # tokens 4..11 scheduled: blocks 1 and 2 keyed, not yet computed
    assert kv.get_computed_blocks(make_req("probe", prompt))[1] == 12
    kv.free(a)
    kv.check_integrity()
    hits, n_hit = kv.get_computed_blocks(make_req("b", prompt))
    assert n_hit == 4 and ids(hits) == [0]
    assert [b.block_hash is None for b in kv.pool.blocks[:3]] == [False, True, True]


def test_prefix_query_and_hit_counters() -> None:
    kv = KVCacheManager(8, 4)
    prompt = list(range(9))
    run_tokens(kv, make_req("a", prompt), 9)
    kv.record_prefix_query(9, 0)
    hits, n_hit = kv.get_computed_blocks(make_req("b", prompt))
    kv.record_prefix_query(9, n_hit)
    assert (kv.prefix_queries, kv.prefix_hits) == (18, 8)
    off = KVCacheManager(8, 4, enable_caching=False)
    off.record_prefix_query(9, 0)
    assert (off.prefix_queries, off.prefix_hits) == (0, 0)


def test_prompt_logprobs_request_bypasses_prefix_cache() -> None:
    """Cached positions are not computed again, so they would get no prompt logprobs."""
    kv = KVCacheManager(8, 4)
    prompt = list(range(9))
    run_tokens(kv, make_req("a", prompt), 9)
    r = Request("b", prompt, SamplingParams(max_tokens=1, prompt_logprobs=1), arrival_time=0.0)
    assert kv.get_computed_blocks(r) == ([], 0)
    assert kv.get_computed_blocks(make_req("c", prompt))[1] == 8


# ---- fork and copy-on-write ---------------------------------------------------------------------


def test_fork_shares_all_blocks_and_copy_on_write_exact_ids() -> None:
    kv = KVCacheManager(8, 4)
    prompt = list(range(100, 110))  # 10 tokens: blocks 0, 1 full (keyed), block 2 holds 2 tokens
    parent = make_req("p", prompt)
    run_tokens(kv, parent, 10)
    children = [make_req(f"c{i}", prompt) for i in range(2)]
    for c in children:
        kv.fork(parent, c)
        c.num_computed_tokens = 10
    assert [kv.get_block_ids(r) for r in ("p", "c0", "c1")] == [[0, 1, 2]] * 3
    assert [b.ref_cnt for b in kv.pool.blocks[:4]] == [3, 3, 3, 0]
    assert kv.pool.blocks[2].block_hash is None  # partly filled: never keyed
    kv.check_integrity()
    # c0 writes token 10 into block 2 (shared): copy first. Exact ids: block 3 is the copy.
    for r, t in ((children[0], 7), (children[1], 8), (parent, 9)):
        r.append_output_token(t)
    assert kv.allocate_slots(children[0], 1) == []  # nothing appended: block 2 is replaced
    assert kv.replaced_blocks("c0") == [(2, 3)] and kv.get_block_ids("c0") == [0, 1, 3]
    assert [b.ref_cnt for b in kv.pool.blocks[:4]] == [3, 3, 2, 1]
    assert kv.allocate_slots(children[1], 1) == []
    assert kv.get_block_ids("c1") == [0, 1, 4]
    assert kv.allocate_slots(parent, 1) == []  # the last holder writes in place
    assert kv.replaced_blocks("p") == [] and kv.get_block_ids("p") == [0, 1, 2]
    assert [b.ref_cnt for b in kv.pool.blocks[:5]] == [3, 3, 1, 1, 1]
    kv.check_integrity()
    assert kv.take_block_moves() == ([], [], [(2, 3), (2, 4)])
    assert kv.take_block_moves() == ([], [], []) and kv.replaced_blocks("c0") == []
    assert kv.num_cow_copies == 2
    for r in (parent, *children):
        kv.free(r)
    kv.check_integrity()
    assert kv.usage == 0


def test_copy_on_write_counts_the_copy_when_the_pool_is_short() -> None:
    kv = KVCacheManager(3, 4)
    prompt = list(range(6))
    parent, child = make_req("p", prompt), make_req("c", prompt)
    run_tokens(kv, parent, 6)  # blocks 0, 1 (2 tokens in block 1)
    kv.fork(parent, child)
    child.num_computed_tokens = 6
    run_tokens(kv, make_req("x", [50, 51, 52]), 3)  # takes the last free block
    child.append_output_token(9)
    assert not kv.can_fit(child, 1) and kv.allocate_slots(child, 1) is None
    assert kv.get_block_ids("c") == [0, 1] and kv.take_block_moves() == ([], [], [])
    kv.check_integrity()


# ---- swap pool ----------------------------------------------------------------------------------


def test_swap_out_and_in_move_exact_blocks() -> None:
    kv = KVCacheManager(6, 4, num_swap_blocks=4)
    prompt = list(range(200, 210))  # 10 tokens: 3 blocks, 2 of them full and keyed
    a = make_req("a", prompt)
    run_tokens(kv, a, 10)
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.can_swap_out(a)
    kv.swap_out(a)
    assert kv.get_block_ids("a") == [] and [b.block_id for b in kv.swapped_blocks["a"]] == [0, 1, 2]
    assert kv.num_free_blocks == 6 and kv.swap_pool.num_free_blocks == 1
    kv.check_integrity()
    # The device copies of its full blocks stay in the prefix cache until evicted.
    assert kv.get_computed_blocks(make_req("probe", prompt))[1] == 8
    x = make_req("x", list(range(16)))
    # takes 4 blocks from the free queue [2, 3, 4, 5, 1, 0]: a's partial block (no cached prefix)
    # first, then the never-used ones, then a's keyed blocks tail first
    run_tokens(kv, x, 16)
    assert kv.get_block_ids("x") == [2, 3, 4, 5]
    a.append_output_token(7)  # its pending token: position 10
    assert kv.can_swap_in(a, 1) is False  # needs 3 blocks, 2 free
    assert kv.swap_in(a, 1) is None and "a" in kv.swapped_blocks
    kv.free(x)
    assert kv.swap_in(a, 1) == []  # 3 blocks back (position 10 fits the third), nothing appended
    out, into, copies = kv.take_block_moves()
    assert out == [(0, 0), (1, 1), (2, 2)]
    assert into == [(0, kv.get_block_ids("a")[0]), (1, kv.get_block_ids("a")[1]), (2, kv.get_block_ids("a")[2])]
    assert copies == [] and kv.swap_pool.num_free_blocks == 4
    kv.check_integrity()


def test_swap_out_after_copy_on_write_moves_the_shared_source() -> None:
    """A request that replaced a shared block this step and is then swapped out: its copy has not
    run, so the host must receive the shared source, and the copy is dropped."""
    kv = KVCacheManager(8, 4, num_swap_blocks=4)
    prompt = list(range(6))
    parent, child = make_req("p", prompt), make_req("c", prompt)
    run_tokens(kv, parent, 6)
    kv.fork(parent, child)
    child.num_computed_tokens = 6
    child.append_output_token(9)
    kv.allocate_slots(child, 1)
    assert kv.get_block_ids("c") == [0, 2]  # block 1 replaced by its copy, block 2
    kv.swap_out(child)
    assert kv.take_block_moves() == ([(0, 0), (1, 1)], [], [])
    assert [b.ref_cnt for b in kv.pool.blocks[:3]] == [1, 1, 0]
    kv.check_integrity()


def test_check_integrity_covers_the_swap_pool() -> None:
    kv = KVCacheManager(4, 4, num_swap_blocks=4)
    a = make_req("a", list(range(6)))
    run_tokens(kv, a, 6)
    kv.swap_out(a)
    kv.check_integrity()
    kv.swapped_blocks["a"].append(kv.swap_pool.blocks[3])  # a host table naming a free host block
    with pytest.raises(AssertionError, match="referenced 1 times"):
        kv.check_integrity()
