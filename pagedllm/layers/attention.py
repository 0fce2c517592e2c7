"""The attention layer: reads the step's metadata and its own slice of the paged KV cache."""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.cpu_kernel import FP8_DTYPES
from pagedllm.attention.metadata import ForwardContext, for_kv_group, with_window

logger = logging.getLogger(__name__)


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float, layer_idx: int,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        # This layer's own window (keys a query sees, ending at its own position), for models whose
        # layers differ (Gemma 3); None: the model-wide window of the step's metadata, if any.
        self.sliding_window = sliding_window
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.layer_idx = layer_idx
        # Its KV layer group (core/kv_groups.py), whose block tables it reads; bound by the runner.
        self.kv_group = 0
        # Bound by the model runner: [2, num_blocks, block_size, num_kv_heads, head_dim], its
        # forward context and its attention backend.
        self.kv_cache = torch.empty(0)
        self.context: ForwardContext | None = None
        self.backend: AttentionBackend | None = None
        # Per-tensor scales of an fp8 cache (it holds K / k_scale, V / v_scale); 1.0 otherwise.
        self.k_scale = 1.0
        self.v_scale = 1.0
        # Set by the runner for an fp8 cache with --calculate-kv-scales: the first batch sets them.
        self.calculate_kv_scales = False

    def _calculate_scales(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Scales that map the first batch's largest |K| and |V| to the fp8 format's maximum."""
        fmax = torch.finfo(self.kv_cache.dtype).max
        self.k_scale = max(float(k.abs().max()) / fmax, 1e-12)
        self.v_scale = max(float(v.abs().max()) / fmax, 1e-12)
        self.calculate_kv_scales = False
        logger.debug("layer %d: k_scale %.3g, v_scale %.3g", self.layer_idx, self.k_scale, self.v_scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Flat q [T, H*D], k/v [T, KVH*D] -> [T, H*D]."""
        md = self.context.get()  # type: ignore[union-attr]
        if self.kv_group:
            md = for_kv_group(md, self.kv_group)
        if self.sliding_window is not None:
            md = with_window(md, self.sliding_window)
        if self.calculate_kv_scales and self.kv_cache.dtype in FP8_DTYPES:
            self._calculate_scales(k, v)
        T = q.shape[0]
        return self.backend.forward(  # type: ignore[union-attr]
            q.view(T, self.num_heads, self.head_dim),
            k.view(T, self.num_kv_heads, self.head_dim),
            v.view(T, self.num_kv_heads, self.head_dim),
            self.kv_cache,
            md,
            self.scale,
            self.k_scale,
            self.v_scale,
        )
