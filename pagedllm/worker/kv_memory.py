"""The KV cache of one rank and the host pool its blocks swap out to: sizing, allocation, block moves.

Per attention layer of this rank's pipeline stage the cache is one tensor
[2, num_blocks, block_size, num_kv_heads, head_dim] (K then V, this rank's KV heads only); the swap
pool has the same layout with num_swap_blocks blocks. Blocks move between them (and within the
cache, for copy-on-write) along dim 1. With KV layer groups (core/kv_groups.py) there is one tensor
per slot of a group instead, shared by the layers of every group at that slot: a block id names
one block of tokens of one group, in each of its layers.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import torch

from pagedllm.config import CacheConfig, DeviceConfig, ModelConfig
from pagedllm.core.kv_groups import KVCacheGroups, engine_kv_groups
from pagedllm.hardware import default_cpu_kv_bytes
from pagedllm.layers.attention import Attention
from pagedllm.worker import device as dev
from pagedllm.worker.host_memory import anonymous_zeros

Pairs = Sequence[tuple[int, int]]


ENCODER_BOOKKEEPING_SEQS = 256
"""An encoder's block table covers this many prompts of max_model_len at once (no memory behind it)."""


def _raw(t: torch.Tensor) -> torch.Tensor:
    """fp8 blocks move as bytes (there is no fp8 index_copy_)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


class KVMemory:
    """The KV cache tensors of `layers` (bound by the runner once the model is loaded) and the swap pool."""

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, device_config: DeviceConfig,
                 kv_dtype: torch.dtype, device: torch.device) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.device_config = device_config
        self.block_size = cache_config.block_size
        self.kv_dtype = kv_dtype
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.groups: KVCacheGroups = engine_kv_groups(model_config, cache_config)
        self.layers: list[Attention] = []
        self.kv_caches: list[torch.Tensor] = []
        # Host pool for swapped-out blocks: per layer, the same layout with num_swap_blocks blocks.
        self.swap_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        self.num_swap_blocks = 0
        self._buffers: list[mmap.mmap] = []  # the CPU tensors' anonymous mappings, kept alive
        self.extra_bytes_per_block = 0
        """Bytes another cache keeps per block id beside this one (a speculative draft model's
        KV, indexed by the same block tables), counted when the blocks are sized."""

    def bind(self, layers: list[Attention]) -> None:
        """Takes the model's attention layers (this stage's), each told its KV layer group; a layer
        of a group that frees blocks outside a window must attend within that window."""
        model_window = self.model_config.sliding_window or 0
        for a in layers:
            g = self.groups.layer_group[a.layer_idx]
            window = a.sliding_window if a.sliding_window is not None else model_window
            if self.groups.windows[g] and window != self.groups.windows[g]:
                raise ValueError(f"layer {a.layer_idx} attends within {window or 'all'} tokens but its KV group "
                                 f"keeps {self.groups.windows[g]}")
            a.kv_group = g
        self.layers = layers

    def _slots(self) -> dict[int, Attention]:
        """One layer of this stage per cache tensor (its slot), in slot order."""
        out: dict[int, Attention] = {}
        for a in self.layers:
            out.setdefault(self.groups.layer_slot[a.layer_idx], a)
        return dict(sorted(out.items()))

    def bytes_per_token(self) -> int:
        """KV bytes of one token of one block on this rank: its stage's cache tensors (one per
        layer, or per group slot with KV layer groups) and its KV heads."""
        itemsize = torch.empty(0, dtype=self.kv_dtype).element_size()
        return sum(2 * a.num_kv_heads * a.head_dim * itemsize for a in self._slots().values())

    def bytes_per_block(self) -> int:
        return self.bytes_per_token() * self.block_size + self.extra_bytes_per_block

    def determine_num_blocks(self) -> int:
        """Blocks of the configured count, or of the KV budget: the configured bytes, else on a GPU
        its share of free memory, else a share of the host's available memory (capped)."""
        cc = self.cache_config
        per_block = self.bytes_per_block()
        if cc.num_kv_blocks is not None:
            return cc.num_kv_blocks
        if per_block == 0:  # an encoder keeps no KV: blocks are the scheduler's bookkeeping only
            return ENCODER_BOOKKEEPING_SEQS * -(-self.model_config.max_model_len // self.block_size)
        budget = cc.kv_cache_memory
        if budget is None and self.is_cuda:
            budget = dev.gpu_kv_cache_budget(self.device, self.device_config.gpu_memory_utilization,
                                             self.model_config)
        if budget is None:
            budget = default_cpu_kv_bytes()
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory={budget} bytes holds no block: one block of {self.block_size} tokens "
                f"needs {per_block} bytes for this model"
            )
        return int(num_blocks)

    def allocate(self, num_blocks: int) -> list[torch.Tensor]:
        """The cache tensors, zeroed; each layer's bound to it as layer.kv_cache."""
        slots = self._slots()
        by_slot = {s: self._zeroed((2, num_blocks, self.block_size, a.num_kv_heads, a.head_dim))
                   for s, a in slots.items()}
        self.kv_caches = list(by_slot.values())
        for layer in self.layers:
            layer.kv_cache = by_slot[self.groups.layer_slot[layer.layer_idx]]
            layer.calculate_kv_scales = self.cache_config.calculate_kv_scales
        self.num_blocks = num_blocks
        return self.kv_caches

    def determine_num_swap_blocks(self) -> int:
        """Blocks that fit in `swap_space` GiB of host memory."""
        per_block = self.bytes_per_block()
        return int(self.cache_config.swap_space * (1 << 30)) // per_block if per_block else 0

    def allocate_swap(self, num_swap_blocks: int) -> None:
        """The host pool: pinned memory beside a GPU; on the CPU backend a second set of tensors
        shaped like the KV cache (lazily committed, so unused swap space costs no memory)."""
        shapes = [(2, num_swap_blocks, *kv.shape[2:]) for kv in self.kv_caches]
        if not num_swap_blocks:
            self.swap_caches = []
        elif self.is_cuda:
            self.swap_caches = [dev.pinned_zeros(shape, self.kv_dtype) for shape in shapes]
        else:
            self.swap_caches = [self._zeroed(shape) for shape in shapes]
        self.num_swap_blocks = num_swap_blocks

    def move_blocks(self, swap_out: Pairs = (), swap_in: Pairs = (), copy: Pairs = ()) -> None:
        """Swap-out (cache -> pool), swap-in (pool -> cache) and copy-on-write (cache -> cache)
        pairs (source block, destination block), in every layer.

        Every source is read before any destination is written: a device block freed by a
        swap-out may be the destination of a swap-in or a copy in the same step (and a host block
        freed by a swap-in the destination of a swap-out).
        """
        index = [
            (
                torch.tensor([p[0] for p in pairs], device=src_pool[0].device),
                torch.tensor([p[1] for p in pairs], device=dst_pool[0].device),
                src_pool,
                dst_pool,
            )
            for pairs, src_pool, dst_pool in (
                (swap_out, self.kv_caches, self.swap_caches),
                (swap_in, self.swap_caches, self.kv_caches),
                (copy, self.kv_caches, self.kv_caches),
            )
            if pairs
        ]
        for layer in range(len(self.kv_caches)):
            # Cache layout [2, num_blocks, block_size, heads, head_dim]: blocks on dim 1.
            data = [_raw(src_pool[layer]).index_select(1, src) for src, _, src_pool, _ in index]
            for (_, dst, _, dst_pool), d in zip(index, data):
                _raw(dst_pool[layer]).index_copy_(1, dst, d.to(dst_pool[layer].device))

    def _zeroed(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A zero tensor, its pages committed on first write (host_memory.anonymous_zeros on the CPU)."""
        if self.is_cuda:
            return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        t, buf = anonymous_zeros(shape, self.kv_dtype)
        self._buffers.append(buf)
        return t
