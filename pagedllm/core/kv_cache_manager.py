"""Per-request block tables on top of the block pool: prefix hits, slot allocation, freeing.

The scheduler talks only to this class: `get_computed_blocks`, `allocate_slots`, `free`.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedllm.core.block_pool import BlockPool, KVBlock, hash_block_tokens
from pagedllm.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self._num_cached: dict[str, int] = {}
        # Prefix-cache statistics, in tokens.
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

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
            extra = (request.cache_salt,) if i == 0 and request.cache_salt else ()
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs], extra))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request's tokens: (blocks, number of tokens they hold).

        The hit is capped at num_tokens - 1 so the last token is always computed (its logits are
        needed to sample). E.g. block_size 4, 8 prompt tokens fully cached -> 1 block, 4 tokens.
        """
        if not self.enable_caching:
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
    def can_fit(self, request: Request, num_new_tokens: int, new_computed: Sequence[KVBlock] = ()) -> bool:
        blocks = self.req_blocks.get(request.request_id, ())
        total = request.num_computed_tokens + len(new_computed) * self.block_size + num_new_tokens
        need = self.blocks_needed(total) - len(blocks) - len(new_computed)
        # Cache hits sitting in the free queue leave it when taken.
        revived = sum(1 for b in new_computed if b.ref_cnt == 0)
        return need <= self.pool.num_free_blocks - revived

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed: Sequence[KVBlock] = ()
    ) -> list[KVBlock] | None:
        """Makes room for `num_new_tokens` more tokens after the computed ones.

        `new_computed` are prefix-cache hits (from get_computed_blocks) that precede them.
        Returns the newly allocated blocks, or None (allocating nothing) if the pool is short.
        """
        if not self.can_fit(request, num_new_tokens, new_computed):
            return None
        rid = request.request_id
        blocks = self.req_blocks.setdefault(rid, [])
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

    def free(self, request: Request) -> None:
        """Returns all of a request's blocks to the pool, tail first."""
        blocks = self.req_blocks.pop(request.request_id, None)
        self._num_cached.pop(request.request_id, None)
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
        owned: dict[int, int] = {}
        for blocks in self.req_blocks.values():
            for b in blocks:
                owned[b.block_id] = owned.get(b.block_id, 0) + 1
        self.pool.check_integrity(owned)
