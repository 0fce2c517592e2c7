"""The attention backend: one object, chosen once by the model runner and bound to its layers."""

from __future__ import annotations

import logging

import torch

from pagedllm.attention.cpu_kernel import QUERY_TILE, load_kernel
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_backend import paged_attention
from pagedllm.native.declare import Binding

logger = logging.getLogger(__name__)


class PagedAttentionBackend:
    """Paged attention on CPU: the native C kernel or the torch SDPA reference."""

    query_tile = QUERY_TILE

    def __init__(self, native: Binding | None) -> None:
        self.native = native

    @property
    def name(self) -> str:
        return "cpu-native" if self.native is not None else "torch-sdpa"

    @property
    def needs_groups(self) -> bool:
        """The torch path attends per padded group; the native kernel reads the blocks in place."""
        return self.native is None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                md: AttentionMetadata, scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        return paged_attention(q, k, v, kv_cache, md, scale, k_scale, v_scale)


class TritonAttentionBackend:
    """Paged attention in Triton kernels: CUDA tensors, or the CPU under Triton's interpreter."""

    native = None
    name = "triton"
    needs_groups = False

    def __init__(self, block_size: int, num_queries_per_kv: int) -> None:
        from pagedllm.attention.triton_attention import check_block_size, query_tile

        check_block_size(block_size)
        # Work items are cut to the kernel's query tile (rows of one KV head's query group).
        self.query_tile = query_tile(num_queries_per_kv)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                md: AttentionMetadata, scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        """The step's new K/V into their slots, then attention over the cache."""
        from pagedllm.attention.triton_attention import paged_attention, write_kv

        write_kv(kv_cache, k, v, md.slot_mapping, k_scale, v_scale)
        return paged_attention(q, kv_cache, md.block_tables, md.query_start_loc, md.seq_lens, md.work, scale,
                               md.sliding_window, md.max_query_len, md.num_splits, k_scale, v_scale)


AttentionBackend = PagedAttentionBackend | TritonAttentionBackend


def select_attention_backend(
    triton: bool = False, block_size: int = 16, num_queries_per_kv: int = 1
) -> AttentionBackend:
    """Triton when asked (GPU); on the CPU the native kernel (every dtype and KV cache dtype), or
    the torch reference where no compiler is found."""
    backend: AttentionBackend
    if triton:
        backend = TritonAttentionBackend(block_size, num_queries_per_kv)
    else:
        backend = PagedAttentionBackend(load_kernel())
    logger.debug("attention backend: %s", backend.name)
    return backend
