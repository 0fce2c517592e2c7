"""The attention backend: one object, chosen once by the model runner and bound to its layers."""

from __future__ import annotations

import ctypes
import logging

import torch

from pagedllm.attention.cpu_kernel import load_kernel
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_backend import paged_attention

logger = logging.getLogger(__name__)


class PagedAttentionBackend:
    """Paged attention on CPU: the native C kernel (float32) or the torch SDPA reference."""

    def __init__(self, native: ctypes.CDLL | None) -> None:
        self.native = native

    @property
    def name(self) -> str:
        return "cpu-native" if self.native is not None else "torch-sdpa"

    @property
    def needs_groups(self) -> bool:
        """The torch path attends per padded group; the native kernel reads the blocks in place."""
        return self.native is None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                md: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_attention(q, k, v, kv_cache, md, scale)


def select_attention_backend(dtype: torch.dtype) -> PagedAttentionBackend:
    """The native kernel serves float32; other dtypes use the torch backend."""
    backend = PagedAttentionBackend(load_kernel() if dtype == torch.float32 else None)
    logger.debug("attention backend: %s", backend.name)
    return backend
