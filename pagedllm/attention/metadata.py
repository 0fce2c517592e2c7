"""Per-step attention metadata, built once per step by the model runner and read by every layer."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionGroup:
    """Requests attended together: queries padded to [B, max_q], keys gathered to [B, L].

    Decodes form one group (max_q = 1) and prompt chunks another, so a long chunk never pads
    hundreds of one-token decodes.
    """

    batch_size: int
    max_query_len: int
    # [B * max_q] flat token index of each padded query slot; padding points at row T (a zero row).
    query_index: torch.Tensor
    # [N] rows of the padded [B * max_q] output that are real tokens, and [N] their flat index.
    out_rows: torch.Tensor
    out_dest: torch.Tensor
    # [B, max_blocks] block ids (padding repeats a valid id; the mask hides it).
    block_tables: torch.Tensor
    # [B, 1, max_q, max_blocks * block_size] True where a query may attend to a key slot.
    mask: torch.Tensor


@dataclass
class DenseAttention:
    """A long prompt chunk attended with fused SDPA over its gathered context (native path)."""

    query_start: int
    query_len: int
    blocks: torch.Tensor  # [nblocks] block ids of keys 0 .. seq_len - 1
    seq_len: int  # keys 0 .. seq_len - 1; the chunk's queries are the last query_len positions


@dataclass
class AttentionMetadata:
    num_tokens: int
    # [T] cache slot (block_id * block_size + offset) of each new token's K/V.
    slot_mapping: torch.Tensor
    # [R, max_blocks] block ids, [R + 1] query start offsets, [R] sequence lengths after this step.
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    # [W, 3] work items of the native kernel: (request, first query token, number of tokens).
    work: torch.Tensor
    sliding_window: int = 0
    # Groups for the torch backend (empty when the native kernel runs).
    groups: list[AttentionGroup] = field(default_factory=list)
    # The compiled native kernel, or None to use the torch backend.
    native: Any = None
    # Triton backend (GPU): on/off, largest query count of a work item, and programs per work
    # item sharing its key range (1: no split).
    triton: bool = False
    max_query_len: int = 0
    num_splits: int = 1
    # Long prompt chunks that bypass the native kernel's work items (see DenseAttention).
    dense: list[DenseAttention] = field(default_factory=list)
    # This step's metadata for layers with their own window (with_window), built on first use.
    windows: dict[int, AttentionMetadata] = field(default_factory=dict)
    # KV layer groups 1 .. G - 1 (core/kv_groups.py): the same step over their own block tables.
    kv_groups: list[AttentionMetadata] = field(default_factory=list)


class ForwardContext:
    """The metadata of the forward pass in progress. Each model runner owns one and binds it to its
    attention layers, so two engines (or two ranks in one process) never share it."""

    def __init__(self) -> None:
        self._current: AttentionMetadata | None = None

    @contextlib.contextmanager
    def set(self, md: AttentionMetadata) -> Iterator[None]:
        """Installs the step's metadata for the duration of one forward pass."""
        prev, self._current = self._current, md
        try:
            yield
        finally:
            self._current = prev

    def get(self) -> AttentionMetadata:
        if self._current is None:
            raise RuntimeError("attention layers run only inside ForwardContext.set()")
        return self._current


def for_kv_group(md: AttentionMetadata, group: int) -> AttentionMetadata:
    """The step's metadata over the block tables of KV layer group `group` (0: the step's own)."""
    return md.kv_groups[group - 1] if group else md


def with_window(md: AttentionMetadata, window: int) -> AttentionMetadata:
    """The step's metadata for a layer with its own sliding window (`window` > 0: each query sees the
    `window` keys ending at its own position; 0: all keys), where the step was built without one
    (models whose layers differ: Gemma 3's sliding and global layers). Built once per step and
    window: the torch backend's group masks are narrowed; the native and Triton kernels take the
    window as an argument. The cache (block tables, slots) is the same for every layer."""
    if md.sliding_window == window:
        return md
    if md.sliding_window:
        raise ValueError(f"a layer window of {window} over a step built with sliding_window={md.sliding_window}")
    memo = md.windows.get(window)
    if memo is None:
        memo = md.windows[window] = dataclasses.replace(
            md, sliding_window=window, groups=[_narrow(g, window) for g in md.groups], windows={}, kv_groups=[])
    return memo


def _narrow(g: AttentionGroup, window: int) -> AttentionGroup:
    """The group with its causal mask cut to `window` keys a query: a query at position p sees keys
    0..p, so p is its row's count of visible keys minus one (padding rows see none and stay so)."""
    mask = g.mask
    qpos = mask.sum(-1, keepdim=True) - 1  # [B, 1, max_q, 1]
    kpos = torch.arange(mask.shape[-1], device=mask.device)
    return dataclasses.replace(g, mask=mask & (kpos > qpos - window))
