"""Whether a request could ever complete: its length against the context, its KV blocks against
the whole cache, its samples against the sequence slots. The front end checks before any engine
state changes; the scheduler checks again as a guard. No torch."""

from __future__ import annotations

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_groups import KVCacheGroups


def check_request_limits(
    num_prompt_tokens: int, max_tokens: int, n: int, config: SchedulerConfig, num_blocks: int, block_size: int,
    groups: KVCacheGroups | None = None,
) -> None:
    """Rejects a request that could never complete (ValueError naming the numbers). The front end
    runs it before any engine state changes; the scheduler runs it again as a guard. With layer
    groups (`groups`) a request needs blocks in each, window groups only their window's."""
    max_len = config.max_model_len
    total = num_prompt_tokens + max_tokens
    if total > max_len:
        raise ValueError(
            f"This model's maximum context length is {max_len} tokens, but the request asks for "
            f"{total} tokens ({num_prompt_tokens} in the prompt and {max_tokens} "
            f"to generate). Please reduce the length of the prompt or of max_tokens."
        )
    need = -(-total // block_size)
    if groups is not None and groups.hybrid:
        need = groups.request_blocks(total, config.max_num_batched_tokens, block_size)
        num_blocks -= 1  # the null block
    if need > num_blocks:
        raise ValueError(
            f"the request needs {total} tokens of KV cache ({need} blocks of {block_size}) but the "
            f"whole KV cache holds {num_blocks * block_size} tokens ({num_blocks} blocks)"
        )
    if n > config.max_num_seqs:
        raise ValueError(f"n={n} samples exceed max_num_seqs={config.max_num_seqs} sequences per step")
