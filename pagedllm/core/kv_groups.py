"""The paged KV cache's layer groups: which layers share a block table, and how far back each keeps.

A model whose layers all attend alike has one group: every layer holds a block for every block of
tokens, and one block id names that block in all of them. A model whose layers differ (Gemma 3:
five sliding-window layers of 512 tokens to one global layer) splits its layers into groups of
equal size, each group of one window: a group's layers share one block table, and a block of the
pool holds `layers_per_block` layers' K/V for one block of tokens. Full-attention groups keep every
block; a sliding-window group of W tokens frees a block once it falls wholly before the window of
the request's next query, so a long context holds in those groups only about W / block_size
blocks. All groups draw from one pool, so the memory a window group gives back serves any group.

E.g. Gemma 3 270M: 18 layers, 3 global and 15 sliding -> 6 groups of 3 layers (1 full, 5 window).
At an 8K context with 16-token blocks a request holds 512 blocks in the full group and 33 in each
window group: 677 blocks against 6 x 512 = 3072 with every block kept (0.22x).

The layers of group g are the ones with `layer_group[i] == g`; layer i stores its K/V in the cache
tensor `layer_slot[i]` (the worker allocates `layers_per_block` tensors of the pool's size, and
the layers of different groups at the same slot share one).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.config import CacheConfig, ModelConfig


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheGroups:
    windows: tuple[int, ...]
    """Per group: the sliding window in tokens whose out-of-window blocks are freed; 0 keeps all."""
    layer_group: tuple[int, ...]
    """Per layer: its group."""
    layer_slot: tuple[int, ...]
    """Per layer: its index inside its group (the cache tensor it writes)."""

    def __post_init__(self) -> None:
        if not self.windows or any(w < 0 for w in self.windows):
            raise ValueError(f"KV cache group windows must be non-negative, one per group, got {self.windows}")
        if len(self.layer_group) != len(self.layer_slot):
            raise ValueError("layer_group and layer_slot must name every layer")

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def layers_per_block(self) -> int:
        """Layers whose K/V one block of the pool holds (the layers of one group)."""
        return max(self.layer_slot, default=0) + 1

    @property
    def hybrid(self) -> bool:
        """Whether any group frees blocks (a single full-attention group does not)."""
        return any(self.windows)

    def first_kept_block(self, group: int, num_computed: int, block_size: int) -> int:
        """Index of the group's first block the request's next query (at position `num_computed`)
        may read: keys from num_computed - W + 1 on. E.g. W 8, block_size 4, 13 tokens computed ->
        keys 6.. -> block 1. Always 0 for a full-attention group."""
        w = self.windows[group]
        return max(0, num_computed - w + 1) // block_size if w else 0

    def request_blocks(self, num_tokens: int, max_step_tokens: int, block_size: int) -> int:
        """The most blocks a request of `num_tokens` tokens ever holds at once when each step
        computes at most `max_step_tokens` of them: every block in full groups; in a window group
        the blocks of one step's tokens and the window before them."""
        full = cdiv(num_tokens, block_size)
        total = 0
        for w in self.windows:
            total += min(full, cdiv(w - 1 + max_step_tokens, block_size) + 1) if w else full
        return total

    def describe(self) -> str:
        """E.g. '6 groups of 3 layers: 1 full attention, 5 sliding window (512 tokens)'."""
        parts = []
        for w in sorted(set(self.windows)):
            n = self.windows.count(w)
            parts.append(f"{n} full attention" if not w else f"{n} sliding window ({w} tokens)")
        n = self.num_groups
        return f"{n} group{'s' if n > 1 else ''} of {self.layers_per_block} layers: {', '.join(parts)}"


def describe_capacity(groups: KVCacheGroups, num_blocks: int, block_size: int, max_model_len: int,
                      max_step_tokens: int) -> str:
    """The start-up log's capacity: tokens per group and the requests of max_model_len tokens that
    fit at once. E.g. '6 groups of 3 layers: 1 full attention, 5 sliding window (512 tokens);
    4095 blocks of 16 tokens, 10920 tokens per group when all fill alike; a 8192-token request
    holds 1162 blocks (3072 with every block kept): maximum concurrency 3.52x'."""
    if not groups.hybrid and groups.num_groups == 1:
        tokens = num_blocks * block_size
        return (f"{num_blocks} blocks of {block_size} tokens = {tokens} tokens; maximum concurrency at "
                f"max_model_len={max_model_len}: {tokens / max_model_len:.2f}x")
    usable = num_blocks - 1  # the null block
    per_group = usable // groups.num_groups * block_size
    need = groups.request_blocks(max_model_len, max_step_tokens, block_size)
    kept = groups.num_groups * cdiv(max_model_len, block_size)
    return (f"{groups.describe()}; {usable} blocks of {block_size} tokens, {per_group} tokens per group when all "
            f"fill alike; a max_model_len={max_model_len} request holds at most {need} blocks ({kept} with every "
            f"block kept): maximum concurrency {usable / need:.2f}x")


def single_group(num_layers: int) -> KVCacheGroups:
    """Every layer in one full-attention group (blocks kept for the whole sequence)."""
    return KVCacheGroups((0,), (0,) * num_layers, tuple(range(num_layers)))


def plan_kv_groups(layer_windows: Sequence[int], enabled: bool = True) -> KVCacheGroups:
    """Groups of the layers by window, all of one size: the greatest common divisor of the
    layer counts per window, taken in layer order. Layers without a window, or `enabled` False
    (--disable-hybrid-kv-cache-manager), give one group that keeps every block.

    E.g. windows [W, W, 0, W, W, 0] -> counts {W: 4, 0: 2}, groups of 2: (layers 0, 1: W),
    (3, 4: W), (2, 5: full); layer slots 0, 1, 0, 0, 1, 1."""
    n = len(layer_windows)
    if not enabled or not any(layer_windows):
        return single_group(n)
    kinds = sorted(set(layer_windows))
    members = {w: [i for i, lw in enumerate(layer_windows) if lw == w] for w in kinds}
    size = math.gcd(*(len(m) for m in members.values()))
    windows: list[int] = []
    layer_group = [0] * n
    layer_slot = [0] * n
    for w in kinds:
        layers = members[w]
        for k in range(0, len(layers), size):
            for slot, layer in enumerate(layers[k : k + size]):
                layer_group[layer] = len(windows)
                layer_slot[layer] = slot
            windows.append(w)
    return KVCacheGroups(tuple(windows), tuple(layer_group), tuple(layer_slot))


def engine_kv_groups(model_config: ModelConfig, cache_config: CacheConfig) -> KVCacheGroups:
    """The groups of the engine's model: its layers' windows, unless the cache config disables
    freeing (every engine part that needs them derives them here, from the same configs)."""
    return plan_kv_groups(model_config.layer_windows(), not cache_config.disable_hybrid_kv_cache_manager)
