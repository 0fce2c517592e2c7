"""The pool of KV cache blocks: ref counts, an LRU free queue and the prefix-cache hash table.

A block is *free* when its ref count is 0. Free blocks that still hold a cached prefix keep their
hash, so a later request can take them back (a prefix-cache hit); they are evicted lazily, oldest
first, only when a fresh block is needed. No torch here: block ids index the cache tensors that
the model runner owns.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from itertools import islice


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> bytes:
    """sha256 of (parent block key, this block's tokens, extra keys such as the cache salt).

    Chaining the parent's key makes a block's key name its whole prefix, not only its own tokens.
    """
    h = hashlib.sha256()
    h.update(parent_hash or b"\x00" * 32)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


class KVBlock:
    """Metadata of one cache block."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class BlockPool:
    """Owns every block; hands out fresh ones, takes cached ones back, counts references."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least 1 block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Free blocks in the order they are taken: freed blocks without a cached prefix first,
        # then never-used ones, then cached ones, least recently freed first (see free_blocks).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, KVBlock] = {}
        self.num_evictions = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self._cached.get(block_hash)

    def next_free_ids(self, n: int) -> list[int]:
        """The ids of the first `n` blocks of the free queue (those the next allocation takes),
        changing nothing: the engine core's warm-up writes its dummy K/V there."""
        return list(islice(self._free, n))

    # ---- allocation ----------------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Pops `n` blocks from the front of the free queue, evicting their cached content."""
        if n > len(self._free):
            raise RuntimeError(f"cannot get {n} blocks: only {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Takes a reference on blocks found in the prefix cache (reviving free ones)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drops one reference per block. A block reaching 0 that holds a cached prefix joins the
        back of the free queue (evicted last); one that holds none joins the front, to be taken
        next: its content is worth nothing, and its pages are already in memory, where a block
        never used before costs its first write's page faults.

        Callers pass a request's blocks tail first, so its tail is evicted before its head.
        """
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Registers a full block under its key (the first block with a key keeps it)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def uncache_block(self, block: KVBlock) -> None:
        """Drops a block's key from the prefix cache (its K/V will not be written after all)."""
        if block.block_hash is not None and self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
            self.num_evictions += 1

    def reset_prefix_cache(self) -> None:
        """Forgets every cached key. Safe while requests run: their blocks stay theirs."""
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()

    # ---- invariants ----------------------------------------------------------------------
    def check_integrity(self, owned: dict[int, int] | None = None) -> None:
        """Asserts the pool's invariants; `owned` maps block id -> references held by requests."""
        num_free = 0
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"negative ref count: {block}"
            is_free = block.block_id in self._free
            assert is_free == (block.ref_cnt == 0), f"free queue disagrees with ref count: {block}"
            num_free += is_free
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) is block, f"hash table misses {block}"
            if owned is not None:
                assert owned.get(block.block_id, 0) == block.ref_cnt, (
                    f"{block} is referenced {owned.get(block.block_id, 0)} times by requests"
                )
        assert num_free == len(self._free), "free queue holds unknown blocks"
        used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert num_free + used == self.num_blocks, f"free {num_free} + used {used} != total {self.num_blocks}"
        for h, block in self._cached.items():
            assert block.block_hash == h, f"hash table entry points at {block}"
