"""Per-request block tables on top of the block pool: prefix hits, slot allocation, freeing,
copy-on-write of shared blocks, forks (n > 1) and swapping to a host pool.

The scheduler talks only to this class: `get_computed_blocks`, `allocate_slots`, `free`, `fork`,
`swap_out` / `swap_in`, and `take_block_moves` once per step.

Sharing. A block may sit in several block tables: a prefix-cache hit (always a full block, never
written again) or a fork, where the n samples of a request start from one table that names all of
the prompt's blocks, the partly filled last one included (ref count n). Before a request writes
into a block that another table also names, the block is copied (copy-on-write): the writer gets
a fresh block, a (src, dst) pair goes to `SchedulerOutput.blocks_to_copy`, and the worker copies
it before the forward pass. Only the partly filled last block can be written, so at most one copy
per request per step and layer group.

Layer groups (core/kv_groups.py). With G groups a request's table holds G entries per block of
tokens, interleaved: entry i * G + g is block i of group g (one group: the plain table). The
worker reads group g's table as every G-th entry from g. A sliding-window group frees its blocks
that fall wholly before the window of the request's next query as the request advances; their
entries then name the null block (held by this class, never written, never read: every kernel
skips or masks keys outside a layer's window), so the tables of all groups keep one length.

Prefix caching with groups. A block of group g is keyed by the logical block's key and g. A hit of
h tokens (a multiple of the block size) needs, in every full group, the blocks of all h tokens,
and in every window group of W tokens only the blocks from the one holding position h - W + 1 on
(the keys the first computed query, at position h, reads); the entries before them are null.
The longest h for which every group has its blocks is taken.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedllm.core.block_pool import BlockPool, KVBlock, hash_block_tokens
from pagedllm.core.kv_groups import KVCacheGroups, cdiv, single_group
from pagedllm.core.request import Request

__all__ = ["KVCacheManager", "KVCacheStats", "cdiv"]


def group_key(block_hash: bytes, group: int) -> bytes:
    """The prefix-cache key of a logical block's block in layer group `group`."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")


@dataclass(frozen=True)
class KVCacheStats:
    """The KV cache's figures, as the scheduler reports them (the only way they leave this class)."""

    usage: float
    """Fraction of device blocks in use."""
    num_free_blocks: int
    swap_usage: float
    """Fraction of the host swap pool in use (0 without one)."""
    prefix_queries: int
    """Prompt tokens looked up in the prefix cache so far."""
    prefix_hits: int
    """Of those, tokens found."""
    num_cow_copies: int
    """Shared blocks copied before a write so far."""


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True, num_swap_blocks: int = 0,
        groups: KVCacheGroups | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if num_swap_blocks < 0:
            raise ValueError(f"num_swap_blocks must be non-negative, got {num_swap_blocks}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.groups = groups or single_group(1)
        self.num_groups = self.groups.num_groups
        self._window_groups = [g for g, w in enumerate(self.groups.windows) if w]
        # Entries of freed window blocks name this block (taken for good, never written).
        self.null_block: KVBlock | None = self.pool.get_new_blocks(1)[0] if self._window_groups else None
        # Per request and group: leading table entries that are null (0 for a full group), and the
        # position of the query whose window they were last cut to.
        self._nulled: dict[str, list[int]] = {}
        self._window_pos: dict[str, int] = {}
        # Host pool for swapped-out requests: plain accounting, no prefix cache.
        self.swap_pool = BlockPool(num_swap_blocks, enable_caching=False) if num_swap_blocks else None
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.swapped_blocks: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self._num_cached: dict[str, int] = {}
        # This step's copies-on-write, per request: (table entry, shared source, private destination).
        self._cow: dict[str, list[tuple[int, KVBlock, KVBlock]]] = {}
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        # Tables cut by `trim` since the worker last heard of them: request id -> blocks kept.
        self._trimmed: dict[str, int] = {}
        # Prefix-cache statistics, in tokens.
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.num_cow_copies = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_swap_blocks(self) -> int:
        return self.swap_pool.num_blocks if self.swap_pool else 0

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            usage=self.pool.usage,
            num_free_blocks=self.pool.num_free_blocks,
            swap_usage=self.swap_pool.usage if self.swap_pool else 0.0,
            prefix_queries=self.prefix_queries,
            prefix_hits=self.prefix_hits,
            num_cow_copies=self.num_cow_copies,
        )

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ---- prefix cache ---------------------------------------------------------------------
    def _update_block_hashes(self, request: Request) -> None:
        """Extends `request.block_hashes` to cover every full block of its known tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            # The first block's key names the salt and the LoRA adapter: the rest chain from it.
            extra = ((request.cache_salt,) if request.cache_salt else ()) + (
                (f"lora:{request.lora_int_id}",) if request.lora_int_id else ()) if i == 0 else ()
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs], extra))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request's tokens: (table entries, number of tokens they hold).

        The hit is capped at num_tokens - 1 so the last token is always computed (its logits are
        needed to sample). E.g. block_size 4, 8 prompt tokens fully cached -> 1 block, 4 tokens.
        With layer groups the entries are interleaved as in a block table (see the module's doc).
        """
        if not self.enable_caching:
            return [], 0
        if request.sampling_params.prompt_logprobs is not None:
            # Cached positions are not recomputed, so they would have no prompt logprobs.
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes[:max_blocks]
        if self.num_groups == 1:
            hits: list[KVBlock] = []
            for block_hash in hashes:
                block = self.pool.get_cached_block(block_hash)
                if block is None:
                    break
                hits.append(block)
            return hits, len(hits) * self.block_size
        return self._group_hits(hashes)

    def _group_hits(self, hashes: list[bytes]) -> tuple[list[KVBlock], int]:
        """get_computed_blocks with layer groups: the full groups' common prefix, then shortened
        until every window group holds its window's blocks of that hit."""
        G, bs, cached = self.num_groups, self.block_size, self.pool.get_cached_block
        full = [g for g in range(G) if not self.groups.windows[g]]
        m = 0
        while m < len(hashes) and all(cached(group_key(hashes[m], g)) is not None for g in full):
            m += 1
        # runs[g][i]: cached blocks of group g ending at block i, without a gap.
        runs: dict[int, list[int]] = {}
        for g in self._window_groups:
            run, r = [], 0
            for i in range(m):
                r = r + 1 if cached(group_key(hashes[i], g)) is not None else 0
                run.append(r)
            runs[g] = run
        while m > 0 and not all(
            runs[g][m - 1] >= m - self.groups.first_kept_block(g, m * bs, bs) for g in self._window_groups
        ):
            m -= 1
        null = self.null_block
        assert null is not None
        entries: list[KVBlock] = []
        first = [self.groups.first_kept_block(g, m * bs, bs) for g in range(G)]
        for i in range(m):
            for g in range(G):
                block = cached(group_key(hashes[i], g)) if i >= first[g] else null
                assert block is not None
                entries.append(block)
        return entries, m * bs

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counts one admission's lookup (called once per admitted request, not per retry)."""
        if self.enable_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit_tokens

    # ---- allocation -----------------------------------------------------------------------
    def _shared_write_entries(self, request: Request) -> list[int]:
        """Table entries that the request's next tokens write into while others share them.

        Writes start at position num_computed_tokens; only a partly filled block can already hold
        K/V there. E.g. block_size 4, 6 tokens computed, table [7, 9] with block 9 shared by a
        sibling sample -> the next token goes to slot 2 of block 9: entry 1 must be copied first
        (with G groups, entries G .. 2G - 1, those of block 1).
        """
        blocks = self.req_blocks.get(request.request_id)
        i, offset = divmod(request.num_computed_tokens, self.block_size)
        G = self.num_groups
        if not blocks or not offset or (i + 1) * G > len(blocks):
            return []
        return [e for e in range(i * G, (i + 1) * G) if blocks[e].ref_cnt > 1 and blocks[e] is not self.null_block]

    def _outside_windows(self, request_id: str, blocks: Sequence[KVBlock], num_computed: int) -> list[int]:
        """Entries of window groups still holding a block wholly before the window of the query at
        position `num_computed` (oldest first)."""
        if not self._window_groups or not blocks:
            return []
        G, bs = self.num_groups, self.block_size
        nulled = self._nulled.get(request_id)
        out = []
        for g in self._window_groups:
            start = nulled[g] if nulled else 0
            end = min(self.groups.first_kept_block(g, num_computed, bs), len(blocks) // G)
            out.extend(i * G + g for i in range(start, end) if blocks[i * G + g] is not self.null_block)
        return sorted(out)

    def _free_outside_windows(self, request_id: str, blocks: list[KVBlock], num_computed: int) -> None:
        """Frees the window groups' blocks that no query from position `num_computed` on reads."""
        entries = self._outside_windows(request_id, blocks, num_computed)
        if not self._window_groups:
            return
        nulled = self._nulled.setdefault(request_id, [0] * self.num_groups)
        self._window_pos[request_id] = max(self._window_pos.get(request_id, 0), num_computed)
        for g in self._window_groups:
            nulled[g] = max(nulled[g], min(self.groups.first_kept_block(g, num_computed, self.block_size),
                                           len(blocks) // self.num_groups))
        if not entries:
            return
        null = self.null_block
        assert null is not None
        freed = [blocks[e] for e in entries]
        for e in entries:
            blocks[e] = null
        self.pool.free_blocks(freed)  # oldest first: evicted first among the cached ones

    def free_outside_windows(self, request: Request) -> None:
        """Frees the request's window-group blocks before the window of its next query (called as
        it advances; allocation does the same before it takes new blocks)."""
        blocks = self.req_blocks.get(request.request_id)
        if blocks and self._window_groups:
            self._free_outside_windows(request.request_id, blocks, request.num_computed_tokens)

    def can_fit(self, request: Request, num_new_tokens: int, new_computed: Sequence[KVBlock] = ()) -> bool:
        rid = request.request_id
        blocks = self.req_blocks.get(rid, ())
        G = self.num_groups
        num_computed = request.num_computed_tokens + len(new_computed) // G * self.block_size
        have = (len(blocks) + len(new_computed)) // G
        need = max(0, self.blocks_needed(num_computed + num_new_tokens) - have) * G
        need += len(self._shared_write_entries(request))  # the copies of shared blocks
        # Cache hits sitting in the free queue leave it when taken; window blocks left behind join it.
        revived = sum(1 for b in new_computed if b.ref_cnt == 0)
        released = sum(1 for e in self._outside_windows(rid, blocks, num_computed) if blocks[e].ref_cnt == 1)
        return need <= self.pool.num_free_blocks - revived + released

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed: Sequence[KVBlock] = ()
    ) -> list[KVBlock] | None:
        """Makes room for `num_new_tokens` more tokens after the computed ones.

        `new_computed` are prefix-cache hits (from get_computed_blocks) that precede them.
        Returns the blocks appended to the request's table (G per block of tokens, interleaved),
        or None (allocating nothing) if the pool is short. Window groups first give back their
        blocks before the window; a shared block about to be written is then replaced by a
        private copy (see `take_block_moves` and `replaced_blocks`).
        """
        if not self.can_fit(request, num_new_tokens, new_computed):
            return None
        rid = request.request_id
        G = self.num_groups
        blocks = self.req_blocks.setdefault(rid, [])
        if new_computed:
            self.pool.touch(b for b in new_computed if b is not self.null_block)
            blocks.extend(new_computed)
            self._num_cached[rid] = len(blocks) // G
            if self._window_groups:
                self._nulled[rid] = [
                    sum(1 for i in range(len(blocks) // G) if blocks[i * G + g] is self.null_block)
                    for g in range(G)
                ]
        num_computed = request.num_computed_tokens + len(new_computed) // G * self.block_size
        self._free_outside_windows(rid, blocks, num_computed)
        for e in self._shared_write_entries(request):
            src = blocks[e]
            (dst,) = self.pool.get_new_blocks(1)
            self.pool.free_blocks([src])  # drops only this request's reference: others hold it
            blocks[e] = dst
            self._cow.setdefault(rid, []).append((e, src, dst))
            self.num_cow_copies += 1
        need = self.blocks_needed(num_computed + num_new_tokens) - len(blocks) // G
        new_blocks = self.pool.get_new_blocks(need * G) if need > 0 else []
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def replaced_blocks(self, request_id: str) -> list[tuple[int, int]]:
        """This step's (table entry, new block id) replacements of the request (copy-on-write)."""
        return [(e, dst.block_id) for e, _, dst in self._cow.get(request_id, ())]

    def fork(self, parent: Request, child: Request) -> None:
        """Gives `child` the parent's block table: every block, the partly filled last one too,
        gains a reference; whoever writes into a shared block first copies it."""
        blocks = self.req_blocks[parent.request_id]
        assert child.request_id not in self.req_blocks
        self.pool.touch(b for b in blocks if b is not self.null_block)
        self.req_blocks[child.request_id] = list(blocks)
        self._num_cached[child.request_id] = self._num_cached.get(parent.request_id, 0)
        if parent.request_id in self._nulled:
            self._nulled[child.request_id] = list(self._nulled[parent.request_id])
            self._window_pos[child.request_id] = self._window_pos[parent.request_id]
            # Cut to the child's next query (the parent's, once this step ran). The parent still
            # holds those blocks for this step's queries, so this only drops the child's references.
            self._free_outside_windows(child.request_id, self.req_blocks[child.request_id],
                                       parent.num_computed_tokens)

    def take_block_moves(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's (swap-out, swap-in, copy) pairs for the worker; resets them for the next step.

        The worker reads every source before it writes any destination (so a block freed by a
        swap-out may be reused by a swap-in or a copy of the same step), then runs the forward pass.
        """
        copies = [(src.block_id, dst.block_id) for cows in self._cow.values() for _, src, dst in cows]
        moves = (self._swap_out, self._swap_in, copies)
        self._swap_out, self._swap_in, self._cow = [], [], {}
        return moves

    # ---- swapping -------------------------------------------------------------------------
    def held_entries(self, num_computed: int) -> int:
        """Blocks a request with `num_computed` tokens computed holds for them (window groups
        only their window's): what it swaps out and back in."""
        n = self.blocks_needed(num_computed)
        return sum(n - min(n, self.groups.first_kept_block(g, num_computed, self.block_size))
                   for g in range(self.num_groups))

    def can_swap_out(self, request: Request) -> bool:
        n = self.held_entries(request.num_computed_tokens)
        return self.swap_pool is not None and 0 < n <= self.swap_pool.num_free_blocks

    def swap_out(self, request: Request) -> None:
        """Moves the blocks of the request's computed tokens to the host pool (window groups:
        those of the window); frees its device blocks.

        A block copied-on-write earlier in this step still holds nothing of its own (the copy has
        not run), so its shared source is moved instead.
        """
        assert self.swap_pool is not None
        rid = request.request_id
        blocks = self.req_blocks.get(rid, [])
        self._free_outside_windows(rid, blocks, request.num_computed_tokens)
        sources = {e: b.block_id for e, b in enumerate(blocks[: self.blocks_needed(request.num_computed_tokens)
                                                               * self.num_groups]) if b is not self.null_block}
        for e, src, _ in self._cow.get(rid, ()):
            if e in sources:
                sources[e] = src.block_id
        host = self.swap_pool.get_new_blocks(len(sources))
        self.swapped_blocks[rid] = host
        self._swap_out.extend(zip(sources.values(), (h.block_id for h in host)))
        self.free(request)

    def can_swap_in(self, request: Request, num_new_tokens: int) -> bool:
        c = request.num_computed_tokens
        grow = self.blocks_needed(c + num_new_tokens) - self.blocks_needed(c)
        return self.held_entries(c) + grow * self.num_groups <= self.pool.num_free_blocks

    def swap_in(self, request: Request, num_new_tokens: int) -> list[KVBlock] | None:
        """Moves a swapped request's blocks back to fresh device blocks and allocates room for
        `num_new_tokens` more; None (changing nothing) if the device pool is short."""
        if not self.can_swap_in(request, num_new_tokens):
            return None
        rid = request.request_id
        host = self.swapped_blocks.pop(rid)
        dev = self.pool.get_new_blocks(len(host))
        self._swap_in.extend(zip((h.block_id for h in host), (d.block_id for d in dev)))
        assert self.swap_pool is not None
        self.swap_pool.free_blocks(reversed(host))
        c, G, bs = request.num_computed_tokens, self.num_groups, self.block_size
        first = [self.groups.first_kept_block(g, c, bs) for g in range(G)]
        fresh = iter(dev)
        table = [next(fresh) if i >= first[g] else self.null_block
                 for i in range(self.blocks_needed(c)) for g in range(G)]
        self.req_blocks[rid] = table  # type: ignore[assignment]
        if self._window_groups:
            self._nulled[rid] = [min(f, self.blocks_needed(c)) for f in first]
            self._window_pos[rid] = c
        self._num_cached[rid] = 0
        if self.enable_caching:
            # Keys of its full blocks come back unless another block holds them meanwhile.
            self._cache_full_blocks(request, c)
        return self.allocate_slots(request, num_new_tokens)

    def free_swapped(self, request: Request) -> None:
        """Returns a swapped request's host blocks (it was aborted while swapped)."""
        host = self.swapped_blocks.pop(request.request_id, None)
        if host and self.swap_pool is not None:
            self.swap_pool.free_blocks(reversed(host))

    def _cache_full_blocks(self, request: Request, num_tokens_after_step: int) -> None:
        """Registers the blocks that this step fills completely.

        Tokens scheduled in a step are known ids, so their block keys can be registered before the
        forward pass: the pass writes every new K/V before any attention reads the cache, so a
        request admitted later in the same step may already hit these blocks.
        """
        rid = request.request_id
        num_full = min(num_tokens_after_step, request.num_tokens) // self.block_size
        start = self._num_cached.get(rid, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        blocks = self.req_blocks[rid]
        G = self.num_groups
        for i in range(start, num_full):
            for g in range(G):
                block = blocks[i * G + g]
                if block is not self.null_block:
                    self.pool.cache_block(block, group_key(request.block_hashes[i], g))
        self._num_cached[rid] = num_full

    def lends_unwritten_blocks(self, request: Request) -> bool:
        """Whether another request holds a block keyed for tokens this request has scheduled but
        not yet computed (a prefix hit taken in this same step). Freeing this request now would
        drop that block's key and its computation, leaving the other request's hit unwritten."""
        blocks = self.req_blocks.get(request.request_id, ())
        start = request.num_computed_tokens // self.block_size * self.num_groups
        return any(b.ref_cnt > 1 and b.block_hash is not None and b is not self.null_block for b in blocks[start:])

    def free(self, request: Request) -> None:
        """Returns all of a request's blocks to the pool, tail first."""
        blocks = self.req_blocks.pop(request.request_id, None)
        self._num_cached.pop(request.request_id, None)
        self._nulled.pop(request.request_id, None)
        self._window_pos.pop(request.request_id, None)
        self._cow.pop(request.request_id, None)  # its copy is moot: the destination is freed below
        self._trimmed.pop(request.request_id, None)  # the worker is sent its table in full when it returns
        if blocks:
            # Keys are registered when tokens are scheduled. A request preempted later in that same
            # step never computes them: e.g. block_size 4, 8 tokens computed, a chunk of 4 scheduled
            # -> block 2 is keyed but empty, so blocks from index 8 // 4 = 2 on lose their keys.
            start = request.num_computed_tokens // self.block_size * self.num_groups
            for block in blocks[start:]:
                if block is not self.null_block:
                    self.pool.uncache_block(block)
            self.pool.free_blocks(reversed([b for b in blocks if b is not self.null_block]))

    def trim(self, request: Request, num_tokens: int) -> None:
        """Frees the request's blocks past those `num_tokens` tokens need: blocks taken for
        speculated tokens that were rejected, which hold nothing else (never shared, never keyed:
        keys cover known tokens only)."""
        blocks = self.req_blocks.get(request.request_id)
        keep = self.blocks_needed(num_tokens) * self.num_groups  # table entries (G per block of tokens)
        if blocks is None or len(blocks) <= keep:
            return
        tail = blocks[keep:]
        del blocks[keep:]
        assert all(b.ref_cnt == 1 and b.block_hash is None and b is not self.null_block for b in tail), tail
        self.pool.free_blocks(reversed(tail))
        self._trimmed[request.request_id] = keep

    def take_trimmed(self, request_id: str) -> int:
        """The number of entries the request's table was cut to since the worker last heard of it,
        or -1."""
        return self._trimmed.pop(request_id, -1) if self._trimmed else -1

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks of the pool the request's table names (null entries aside)."""
        return sum(1 for b in self.req_blocks.get(request_id, ()) if b is not self.null_block)

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        owned = _count_owners(self.req_blocks)
        if self.null_block is not None:
            owned[self.null_block.block_id] = 1  # held by this class, not by the requests naming it
        self.pool.check_integrity(owned)
        assert not set(self.req_blocks) & set(self.swapped_blocks), "a request holds device and host blocks"
        if self.swap_pool is not None:
            self.swap_pool.check_integrity(_count_owners(self.swapped_blocks))
        else:
            assert not self.swapped_blocks, "swapped blocks without a swap pool"
        for rid, cows in self._cow.items():
            for e, _src, dst in cows:
                assert self.req_blocks[rid][e] is dst, f"{rid}: copy-on-write destination left its table"
        for rid, blocks in self.req_blocks.items():
            assert len(blocks) % self.num_groups == 0, f"{rid}: table of {len(blocks)} entries for {self.num_groups} groups"

    def check_windows(self, request: Request, num_computed: int | None = None) -> None:
        """Asserts that each window group of the request holds exactly the blocks that a query at
        position `num_computed` may read (default: where the request's windows were last cut, at
        most its computed tokens): none before its window stays allocated, none in it is freed."""
        blocks = self.req_blocks.get(request.request_id, [])
        if num_computed is None:
            num_computed = self._window_pos.get(request.request_id, 0)
            assert num_computed <= request.num_computed_tokens, f"{request.request_id}: window cut ahead"
        G, bs = self.num_groups, self.block_size
        for g in range(G):
            first = self.groups.first_kept_block(g, num_computed, bs)
            for i in range(len(blocks) // G):
                is_null = blocks[i * G + g] is self.null_block
                assert is_null == (i < first), (
                    f"{request.request_id}: group {g} block {i} is {'freed' if is_null else 'held'} with the "
                    f"window's first block at {first} ({num_computed} tokens computed)")


def _count_owners(tables: dict[str, list[KVBlock]]) -> dict[int, int]:
    owned: dict[int, int] = {}
    for blocks in tables.values():
        for b in blocks:
            owned[b.block_id] = owned.get(b.block_id, 0) + 1
    return owned
