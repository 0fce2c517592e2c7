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
per request per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedllm.core.block_pool import BlockPool, KVBlock, hash_block_tokens
from pagedllm.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
        self, num_blocks: int, block_size: int, enable_caching: bool = True, num_swap_blocks: int = 0
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if num_swap_blocks < 0:
            raise ValueError(f"num_swap_blocks must be non-negative, got {num_swap_blocks}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        # Host pool for swapped-out requests: plain accounting, no prefix cache.
        self.swap_pool = BlockPool(num_swap_blocks, enable_caching=False) if num_swap_blocks else None
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.swapped_blocks: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self._num_cached: dict[str, int] = {}
        # This step's copy-on-write, per request: (table index, shared source, private destination).
        self._cow: dict[str, tuple[int, KVBlock, KVBlock]] = {}
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
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
        """Longest cached prefix of the request's tokens: (blocks, number of tokens they hold).

        The hit is capped at num_tokens - 1 so the last token is always computed (its logits are
        needed to sample). E.g. block_size 4, 8 prompt tokens fully cached -> 1 block, 4 tokens.
        """
        if not self.enable_caching:
            return [], 0
        if request.sampling_params.prompt_logprobs is not None:
            # Cached positions are not recomputed, so they would have no prompt logprobs.
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counts one admission's lookup (called once per admitted request, not per retry)."""
        if self.enable_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit_tokens

    # ---- allocation -----------------------------------------------------------------------
    def _shared_write_index(self, request: Request) -> int | None:
        """Index of a block that the request's next tokens write into while others share it.

        Writes start at position num_computed_tokens; only a partly filled block can already hold
        K/V there. E.g. block_size 4, 6 tokens computed, table [7, 9] with block 9 shared by a
        sibling sample -> the next token goes to slot 2 of block 9: index 1 must be copied first.
        """
        blocks = self.req_blocks.get(request.request_id)
        i, offset = divmod(request.num_computed_tokens, self.block_size)
        if blocks and offset and i < len(blocks) and blocks[i].ref_cnt > 1:
            return i
        return None

    def can_fit(self, request: Request, num_new_tokens: int, new_computed: Sequence[KVBlock] = ()) -> bool:
        blocks = self.req_blocks.get(request.request_id, ())
        total = request.num_computed_tokens + len(new_computed) * self.block_size + num_new_tokens
        need = self.blocks_needed(total) - len(blocks) - len(new_computed)
        if self._shared_write_index(request) is not None:
            need += 1  # the copy of the shared block
        # Cache hits sitting in the free queue leave it when taken.
        revived = sum(1 for b in new_computed if b.ref_cnt == 0)
        return need <= self.pool.num_free_blocks - revived

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed: Sequence[KVBlock] = ()
    ) -> list[KVBlock] | None:
        """Makes room for `num_new_tokens` more tokens after the computed ones.

        `new_computed` are prefix-cache hits (from get_computed_blocks) that precede them.
        Returns the blocks appended to the request's table, or None (allocating nothing) if the
        pool is short. A shared block about to be written is first replaced by a private copy
        (see `take_block_moves` and `replaced_blocks`).
        """
        if not self.can_fit(request, num_new_tokens, new_computed):
            return None
        rid = request.request_id
        blocks = self.req_blocks.setdefault(rid, [])
        shared = self._shared_write_index(request)
        if shared is not None:
            src = blocks[shared]
            (dst,) = self.pool.get_new_blocks(1)
            self.pool.free_blocks([src])  # drops only this request's reference: others hold it
            blocks[shared] = dst
            self._cow[rid] = (shared, src, dst)
            self.num_cow_copies += 1
        if new_computed:
            self.pool.touch(new_computed)
            blocks.extend(new_computed)
            self._num_cached[rid] = len(blocks)
        num_computed = request.num_computed_tokens + len(new_computed) * self.block_size
        need = self.blocks_needed(num_computed + num_new_tokens) - len(blocks)
        new_blocks = self.pool.get_new_blocks(need) if need > 0 else []
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def replaced_blocks(self, request_id: str) -> list[tuple[int, int]]:
        """This step's (table index, new block id) replacements of the request (copy-on-write)."""
        cow = self._cow.get(request_id)
        return [(cow[0], cow[2].block_id)] if cow else []

    def fork(self, parent: Request, child: Request) -> None:
        """Gives `child` the parent's block table: every block, the partly filled last one too,
        gains a reference; whoever writes into a shared block first copies it."""
        blocks = self.req_blocks[parent.request_id]
        assert child.request_id not in self.req_blocks
        self.pool.touch(blocks)
        self.req_blocks[child.request_id] = list(blocks)
        self._num_cached[child.request_id] = self._num_cached.get(parent.request_id, 0)

    def take_block_moves(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's (swap-out, swap-in, copy) pairs for the worker; resets them for the next step.

        The worker reads every source before it writes any destination (so a block freed by a
        swap-out may be reused by a swap-in or a copy of the same step), then runs the forward pass.
        """
        copies = [(src.block_id, dst.block_id) for _, src, dst in self._cow.values()]
        moves = (self._swap_out, self._swap_in, copies)
        self._swap_out, self._swap_in, self._cow = [], [], {}
        return moves

    # ---- swapping -------------------------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        n = self.blocks_needed(request.num_computed_tokens)
        return self.swap_pool is not None and 0 < n <= self.swap_pool.num_free_blocks

    def swap_out(self, request: Request) -> None:
        """Moves the blocks of the request's computed tokens to the host pool; frees its device blocks.

        A block copied-on-write earlier in this step still holds nothing of its own (the copy has
        not run), so its shared source is moved instead.
        """
        assert self.swap_pool is not None
        rid = request.request_id
        blocks = self.req_blocks.get(rid, [])
        n = self.blocks_needed(request.num_computed_tokens)
        sources = [b.block_id for b in blocks[:n]]
        cow = self._cow.get(rid)
        if cow is not None and cow[0] < n:
            sources[cow[0]] = cow[1].block_id
        host = self.swap_pool.get_new_blocks(n)
        self.swapped_blocks[rid] = host
        self._swap_out.extend(zip(sources, (h.block_id for h in host)))
        self.free(request)

    def can_swap_in(self, request: Request, num_new_tokens: int) -> bool:
        return self.blocks_needed(request.num_computed_tokens + num_new_tokens) <= self.pool.num_free_blocks

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
        self.req_blocks[rid] = dev
        self._num_cached[rid] = 0
        if self.enable_caching:
            # Keys of its full blocks come back unless another block holds them meanwhile.
            self._cache_full_blocks(request, request.num_computed_tokens)
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
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self._num_cached[rid] = num_full

    def lends_unwritten_blocks(self, request: Request) -> bool:
        """Whether another request holds a block keyed for tokens this request has scheduled but
        not yet computed (a prefix hit taken in this same step). Freeing this request now would
        drop that block's key and its computation, leaving the other request's hit unwritten."""
        blocks = self.req_blocks.get(request.request_id, ())
        start = request.num_computed_tokens // self.block_size
        return any(b.ref_cnt > 1 and b.block_hash is not None for b in blocks[start:])

    def free(self, request: Request) -> None:
        """Returns all of a request's blocks to the pool, tail first."""
        blocks = self.req_blocks.pop(request.request_id, None)
        self._num_cached.pop(request.request_id, None)
        self._cow.pop(request.request_id, None)  # its copy is moot: the destination is freed below
        if blocks:
            # Keys are registered when tokens are scheduled. A request preempted later in that same
            # step never computes them: e.g. block_size 4, 8 tokens computed, a chunk of 4 scheduled
            # -> block 2 is keyed but empty, so blocks from index 8 // 4 = 2 on lose their keys.
            for block in blocks[request.num_computed_tokens // self.block_size :]:
                self.pool.uncache_block(block)
            self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        self.pool.check_integrity(_count_owners(self.req_blocks))
        assert not set(self.req_blocks) & set(self.swapped_blocks), "a request holds device and host blocks"
        if self.swap_pool is not None:
            self.swap_pool.check_integrity(_count_owners(self.swapped_blocks))
        else:
            assert not self.swapped_blocks, "swapped blocks without a swap pool"
        for rid, (i, _src, dst) in self._cow.items():
            assert self.req_blocks[rid][i] is dst, f"{rid}: copy-on-write destination left its table"


def _count_owners(tables: dict[str, list[KVBlock]]) -> dict[int, int]:
    owned: dict[int, int] = {}
    for blocks in tables.values():
        for b in blocks:
            owned[b.block_id] = owned.get(b.block_id, 0) + 1
    return owned
