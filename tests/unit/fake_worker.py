"""The fake worker every scheduler test drives: the worker's side of the SchedulerOutput contract,
with the token stored in every KV slot. It checks that every position a request attends to holds
that request's token in the block its block table names, honours swap and copy pairs the way the
model runner does (every source read before any destination is written), and samples tokens from
a deterministic fake model. With KV layer groups (`windows`, one per group) a request's table
holds one block id per group per block of tokens, interleaved; every group stores the tokens, and
a window group is checked only where its queries read (the window before each query). Proposed tokens
(speculative decoding) are written to their slots and verified against the fake model: accepted
while they are its tokens, then one token of its own; the slots of rejected ones hold wrong tokens
until overwritten, so reading one fails the check."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


def sampled_token(req_id: str, index: int) -> int:
    """The fake model's `index`-th output token for a request (deterministic, never below 10)."""
    return 10 + (zlib.crc32(req_id.encode()) + 7919 * index) % 30_000


@dataclass
class WorkerRequest:
    tokens: list[int]
    num_prompt: int
    block_table: list[int]
    num_computed: int


@dataclass
class FakeWorker:
    """The worker side of the SchedulerOutput contract, with the token stored in every KV slot."""

    block_size: int
    num_blocks: int
    num_swap_blocks: int = 0
    reqs: dict[str, WorkerRequest] = field(default_factory=dict)
    # Preempted requests the worker was told about separately (if the output says so).
    parked: set[str] = field(default_factory=set)
    slots: list[list[int | None]] = field(default_factory=list)
    host_slots: list[list[int | None]] = field(default_factory=list)
    moved: dict[str, int] = field(default_factory=lambda: {"swap_out": 0, "swap_in": 0, "copy": 0, "fork": 0})
    # The fake model: (request id, index among its output tokens) -> the token it samples.
    sample: Callable[[str, int], int] = sampled_token
    # KV layer groups: each one's window (0: full attention).
    windows: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        self.slots = [[None] * self.block_size for _ in range(self.num_blocks)]
        self.host_slots = [[None] * self.block_size for _ in range(self.num_swap_blocks)]

    def check_reads(self, rid: str, r: WorkerRequest, end: int, start: int | None = None) -> None:
        """Positions [0, end) must hold the request's tokens in the blocks its table names; in a
        window group only those that queries from position `start` (default: end) on read."""
        bs, G = self.block_size, len(self.windows)
        assert len(r.block_table) * bs >= end * G, f"{rid}: {len(r.block_table)} blocks for {end} tokens"
        start = end if start is None else start
        for g, w in enumerate(self.windows):
            first = max(0, start - w + 1) // bs if w else 0
            for i in range(first, math.ceil(end / bs)):
                k = min(bs, end - i * bs)
                block = r.block_table[i * G + g]
                got = self.slots[block][:k]
                assert got == r.tokens[i * bs : i * bs + k], f"{rid}: group {g} block {block} (#{i}) holds {got}"

    def move_blocks(self, so: SchedulerOutput) -> None:
        """Swap-out, swap-in and copy pairs: all sources are read, then all destinations written."""
        moves = [
            (so.blocks_to_swap_out, self.slots, self.host_slots, "swap_out"),
            (so.blocks_to_swap_in, self.host_slots, self.slots, "swap_in"),
            (so.blocks_to_copy, self.slots, self.slots, "copy"),
        ]
        dsts = [(id(dst_pool), d) for pairs, _, dst_pool, _ in moves for _, d in pairs]
        assert len(dsts) == len(set(dsts)), f"a block is written twice in one step: {dsts}"
        data = [[list(src_pool[s]) for s, _ in pairs] for pairs, src_pool, _, _ in moves]
        for (pairs, _, dst_pool, name), values in zip(moves, data):
            for (_, d), v in zip(pairs, values):
                dst_pool[d] = v
            self.moved[name] += len(pairs)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        preempted = getattr(so, "preempted_req_ids", set())
        for rid in so.finished_req_ids:
            if rid in self.reqs:
                del self.reqs[rid]
                if rid in preempted:
                    self.parked.add(rid)
            else:
                assert rid in self.parked, f"told to forget {rid}, which the worker never had"
                self.parked.discard(rid)
        assert list(so.num_scheduled_tokens) == [d.req_id for d in so.cached_reqs] + [d.req_id for d in so.new_reqs]
        for d in so.cached_reqs:
            r = self.reqs[d.req_id]
            assert d.num_computed_tokens == r.num_computed
            for i, block_id in d.replaced_block_ids:
                # Copy-on-write replaces the partly filled block the request is about to write.
                assert i // len(self.windows) == r.num_computed // self.block_size and r.num_computed % self.block_size
                assert (r.block_table[i], block_id) in so.blocks_to_copy
                r.block_table[i] = block_id
            if d.num_blocks >= 0:  # blocks of rejected proposals were freed
                assert d.num_blocks // len(self.windows) * self.block_size >= r.num_computed
                del r.block_table[d.num_blocks :]
            r.block_table += d.new_block_ids
        swapped_in = {d for _, d in so.blocks_to_swap_in}
        for d in so.new_reqs:
            assert d.req_id not in self.reqs
            r = WorkerRequest(
                list(d.prompt_token_ids) + list(d.output_token_ids),
                len(d.prompt_token_ids),
                list(d.block_ids),
                d.num_computed_tokens,
            )
            # Prefix-cache hits are whole blocks; only a request swapped back in may bring a partly
            # filled one, moved by this step's swap-in pairs. All of them are read after this
            # step's moves and writes (below): a block keyed earlier in this step (by a request
            # scheduled or swapped in before this one) is filled by this very step.
            i, partial = divmod(r.num_computed, self.block_size)
            if partial:
                G = len(self.windows)
                assert d.req_id in self.parked and all(
                    b in swapped_in for b in r.block_table[i * G : (i + 1) * G]), f"{d.req_id}: partial hit"
            self.parked.discard(d.req_id)
            self.reqs[d.req_id] = r
        self.move_blocks(so)
        # One forward pass: every layer writes all new K/V before any attention reads the cache.
        bs, G = self.block_size, len(self.windows)
        spec = getattr(so, "spec_token_ids", {})
        for rid, n in so.num_scheduled_tokens.items():
            r = self.reqs[rid]
            seq = r.tokens + spec.get(rid, [])
            assert r.num_computed + n <= len(seq)
            assert rid not in spec or r.num_computed + n == len(seq) and r.num_computed == len(r.tokens) - 1
            for pos in range(r.num_computed, r.num_computed + n):
                for g in range(G):
                    self.slots[r.block_table[pos // bs * G + g]][pos % bs] = seq[pos]
        # Samples forked off a parent whose prompt completes now: its tokens, its table, shared.
        forks = []
        for f in so.forked_reqs:
            parent = self.reqs[f.parent_id]
            # The parent's table as the worker holds it; window groups' freed entries excepted
            # (the scheduler names the null block there, the worker still the old block).
            freed = {a for a, b in zip(f.block_ids, parent.block_table) if a != b}
            assert len(f.block_ids) == len(parent.block_table) and len(freed) <= (1 if any(self.windows) else 0)
            assert parent.num_computed + so.num_scheduled_tokens[f.parent_id] == len(parent.tokens)
            child = WorkerRequest(list(parent.tokens), parent.num_prompt, list(f.block_ids), len(parent.tokens))
            forks.append((f.req_id, child))
            self.moved["fork"] += 1
        sampled = []
        for rid, n in so.num_scheduled_tokens.items():
            r = self.reqs[rid]
            if rid in spec:
                kept = []
                for t in spec[rid]:
                    if t != self.sample(rid, len(r.tokens) - r.num_prompt + len(kept)):
                        break
                    kept.append(t)
                kept.append(self.sample(rid, len(r.tokens) - r.num_prompt + len(kept)))
                r.tokens += kept
                start, r.num_computed = r.num_computed, len(r.tokens) - 1
                self.check_reads(rid, r, r.num_computed, start)
                sampled.append(kept)
                continue
            r.num_computed += n
            self.check_reads(rid, r, r.num_computed, r.num_computed - n)
            if r.num_computed == len(r.tokens):
                t = self.sample(rid, len(r.tokens) - r.num_prompt)
                r.tokens.append(t)
                sampled.append([t])
            else:
                sampled.append([])
        for rid, r in forks:
            assert rid not in self.reqs
            self.check_reads(rid, r, r.num_computed)
            self.reqs[rid] = r
            t = self.sample(rid, 0)
            r.tokens.append(t)
            sampled.append([t])
        return ModelRunnerOutput(list(so.num_scheduled_tokens) + [rid for rid, _ in forks], sampled)
