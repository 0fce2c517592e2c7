"""KV layer groups: how layers are grouped by window, and the KV cache manager over a full group and
a sliding-window group: blocks before the window freed as a request advances (pool counts),
admission counting only the window's blocks, and the prefix-cache rule for window groups."""

from __future__ import annotations

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager, group_key
from pagedllm.core.kv_groups import describe_capacity, plan_kv_groups
from pagedllm.core.request import Request
from pagedllm.core.request_limits import check_request_limits
from pagedllm.sampling_params import SamplingParams

BS = 4
W = 8  # the window group keeps the blocks of the last 8 positions: 2 or 3 blocks of 4


def test_gemma3_270m_layers_form_six_groups_of_three() -> None:
    windows = [0 if (i + 1) % 6 == 0 else 512 for i in range(18)]
    g = plan_kv_groups(windows)
    assert g.windows == (0, 512, 512, 512, 512, 512) and g.layers_per_block == 3
    assert [g.layer_group[i] for i in (5, 11, 17)] == [0, 0, 0]
    assert [g.layer_slot[i] for i in (5, 11, 17)] == [0, 1, 2]
    assert g.layer_group[:5] == (1, 1, 1, 2, 2) and g.layer_slot[:5] == (0, 1, 2, 0, 1)
    assert g.describe() == "6 groups of 3 layers: 1 full attention, 5 sliding window (512 tokens)"
    # An 8K request holds 512 blocks in the full group and, decoding, 33 in each window group (its
    # 512 keys span 33 blocks): 677 against 6 x 512 = 3072 kept, 0.22x; in 16-token steps 34.
    assert g.request_blocks(8192, 1, 16) == 512 + 5 * 33
    assert g.request_blocks(8192, 16, 16) == 512 + 5 * 34
    line = describe_capacity(g, 6001, 16, 8192, 1)
    assert "6000 blocks of 16 tokens" in line and "holds at most 677 blocks (3072 with every block kept)" in line
    assert plan_kv_groups(windows, enabled=False).num_groups == 1
    assert plan_kv_groups([0] * 4).windows == (0,) and not plan_kv_groups([0] * 4).hybrid
    assert plan_kv_groups([4096] * 4).windows == (4096,)  # one window for every layer (Mistral)


def _manager(num_blocks: int, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, enable_caching=caching, groups=plan_kv_groups([0, W]))


def _run(kv: KVCacheManager, req: Request, chunk: int) -> list[int]:
    """Computes the request's prompt in chunks (as the scheduler does); the blocks it holds after each."""
    held = []
    while req.num_computed_tokens < req.num_tokens:
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert kv.allocate_slots(req, n) is not None
        req.num_computed_tokens += n
        kv.free_outside_windows(req)
        kv.check_windows(req, req.num_computed_tokens)
        kv.check_integrity()
        held.append(kv.num_held_blocks(req.request_id))
    return held


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4, ignore_eos=True))


def test_window_blocks_are_freed_as_the_request_advances() -> None:
    kv = _manager(64)
    free0 = kv.num_free_blocks  # the null block is taken: 63
    assert free0 == 63
    req = _request("a", list(range(100, 140)))
    held = _run(kv, req, 8)
    # After 8k tokens: 2k blocks in the full group; the window group keeps the blocks of the keys
    # the query at 8k reads among those computed: 8k - 7 .. 8k - 1, blocks 2k - 2 and 2k - 1.
    assert held == [2 + 2, 4 + 2, 6 + 2, 8 + 2, 10 + 2]
    assert kv.num_free_blocks == free0 - held[-1]
    table = kv.get_block_ids("a")
    null = kv.null_block.block_id
    assert table[1::2][:8] == [null] * 8 and null not in table[17::2] and null not in table[0::2]
    kv.free(req)
    assert kv.num_free_blocks == free0


def test_admission_counts_only_the_window() -> None:
    """A 100-token request in a pool of 40 blocks: 25 in the full group and at most 5 in the window
    group at once; keeping every block would take 50."""
    config = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4, max_model_len=128)
    groups = plan_kv_groups([0, W])
    check_request_limits(96, 4, 1, config, 40, BS, groups)
    with pytest.raises(ValueError, match=r"needs 100 tokens of KV cache \(30 blocks of 4\)"):
        check_request_limits(96, 4, 1, config, 30, BS, groups)
    kv = _manager(40, caching=False)
    held = _run(kv, _request("a", list(range(100, 200))), 8)
    assert max(held) <= 25 + 3 and held[-1] == 25 + 2


def test_can_fit_counts_the_blocks_the_window_gives_back() -> None:
    """With the pool empty, the next chunk fits because the blocks leaving the window pay for it."""
    kv = _manager(1 + 4 + 3, caching=False)  # the null block, then 7 blocks
    req = _request("a", list(range(100, 124)))
    assert kv.allocate_slots(req, 8) is not None  # 2 + 2 blocks
    req.num_computed_tokens = 8
    assert kv.allocate_slots(req, 4) is not None  # + 1 + 1 (no window block leaves yet: keys 1..)
    req.num_computed_tokens = 12
    assert kv.num_free_blocks == 1
    # Tokens 12..15 need a block in each group (2); block 0 of the window group (keys 0..3) leaves
    # the window of the query at 12 (keys 5..12).
    assert kv.can_fit(req, 4)
    assert kv.allocate_slots(req, 4) is not None and kv.num_free_blocks == 0
    kv.check_integrity()


def test_prefix_hit_of_a_window_group_needs_only_the_window() -> None:
    kv = _manager(64)
    prompt = list(range(100, 140))
    a = _request("a", prompt)
    _run(kv, a, 8)
    kv.free(a)
    # The same 40 tokens and 4 more: full group blocks 0..9 and window blocks 8, 9 (keys 33..39 of
    # the query at 40) are cached: 40 tokens hit, window entries 0..7 null.
    b = _request("b", prompt + [7, 7, 7, 7])
    hits, n = kv.get_computed_blocks(b)
    null = kv.null_block
    assert n == 40 and [e is null for e in hits[1::2]] == [True] * 8 + [False] * 2
    # Without window block 9 the hit stops at 36 tokens: the query at 36 reads keys 29..35, in
    # blocks 7 and 8, which the window group freed earlier but kept cached.
    kv.pool.uncache_block(hits[19])
    hits, n = kv.get_computed_blocks(b)
    assert n == 36 and [e is null for e in hits[1::2]] == [True] * 7 + [False] * 2
    assert kv.allocate_slots(b, 8, hits) is not None
    b.num_computed_tokens = 36 + 8
    kv.check_integrity()
    # b computed block 9 again (cached anew). Without it and without window block 7: the query
    # at 36 reads blocks 7 and 8, at 32 blocks 6 and 7, at 28 blocks 5 and 6 (freed by request a
    # when they left its window, still cached): 28 tokens.
    c = _request("c", prompt + [8, 8, 8, 8])
    kv.get_computed_blocks(c)
    for i in (7, 9):
        kv.pool.uncache_block(kv.pool.get_cached_block(group_key(c.block_hashes[i], 1)))
    hits, n = kv.get_computed_blocks(c)
    assert n == 28 and [e is null for e in hits[1::2]] == [True] * 5 + [False] * 2


def _recording_costs():
    from dataclasses import dataclass, field

    from pagedllm.core.preemption import PreemptionCostModel

    @dataclass(frozen=True)
    class Recording(PreemptionCostModel):
        asked: list = field(default_factory=list)

        def prefers_swap(self, num_tokens: int, num_blocks: int) -> bool:
            self.asked.append((num_tokens, num_blocks))
            return super().prefers_swap(num_tokens, num_blocks)

    return Recording


_Recording = _recording_costs()


def test_auto_preemption_prices_the_blocks_a_window_group_really_holds() -> None:
    """A 100-token request over a full group and a window group of 8 tokens holds 25 + 2 blocks,
    not 2 x 25: the swap it would cost is that of 27 blocks of one group's layers. Rates chosen so
    that swapping 27 blocks beats recomputing 100 tokens while swapping 50 (every block of both
    groups, what the estimate counted before) would not."""
    from pagedllm.core.preemption import PreemptionCostModel, preemption_mode
    from pagedllm.core.scheduler import Scheduler

    # recompute 100 tokens: 100 x 1 FLOP at 1 FLOP/s = 100 s; swap: 2 x blocks x 1.5 bytes at 1 byte/s
    costs = PreemptionCostModel(flops_per_second=1.0, copy_bytes_per_second=1.0, flops_per_token=1.0,
                                attention_flops_per_pair=0.0, kv_bytes_per_block=1.5, kv_groups=2)
    kv = KVCacheManager(64, BS, enable_caching=False, num_swap_blocks=64, groups=plan_kv_groups([0, W]))
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_model_len=128, preemption_mode="auto"), kv,
                      costs)
    req = _request("a", list(range(100, 200)))
    assert _run(kv, req, 8)[-1] == 25 + 2
    assert kv.held_entries(100) == 27 and kv.blocks_needed(100) * kv.num_groups == 50
    assert costs.swap_seconds(27) < costs.recompute_seconds(100) < costs.swap_seconds(50)
    assert preemption_mode(sched, req) == "swap"
    asked: list[tuple[int, int]] = []
    sched.costs = _Recording(1.0, 1.0, 1.0, 0.0, 1.5, kv_groups=2, asked=asked)
    preemption_mode(sched, req)
    assert asked == [(100, 27)]  # (tokens to recompute, blocks to move)
    # Without a window the two layers share one group: 25 blocks of both layers' bytes (3), and
    # recompute is the cheaper.
    full = KVCacheManager(64, BS, enable_caching=False, num_swap_blocks=64, groups=plan_kv_groups([0, 0]))
    sched_full = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_model_len=128, preemption_mode="auto"),
                           full, PreemptionCostModel(1.0, 1.0, 1.0, 0.0, 3.0))
    req2 = _request("b", list(range(100, 200)))
    _run(full, req2, 8)
    assert full.held_entries(100) == 25 and preemption_mode(sched_full, req2) == "recompute"
    # break-even: a swapped token costs a block in each group while no window frees any
    assert costs.break_even_tokens(BS) == PreemptionCostModel(1.0, 1.0, 1.0, 0.0, 3.0).break_even_tokens(BS)
