"""What a preemption costs: recomputing a victim's tokens later, or moving its blocks out and back.

`--preemption-mode auto` picks, per victim, the cheaper of the two. The model runner measures the
two rates once at startup (a matmul for FLOP/s, a block copy device <-> host for bytes/s); the
model's shape gives the work per token and the bytes per block. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PreemptionCostModel:
    flops_per_second: float
    """Measured matmul throughput of the device."""
    copy_bytes_per_second: float
    """Measured throughput of moving KV blocks between the device and the host pool."""
    flops_per_token: float
    """Linear-layer work of one token: 2 x the parameters every token goes through."""
    attention_flops_per_pair: float
    """Attention work of one (query, key) pair over all layers: 4 x layers x heads x head_dim."""
    kv_bytes_per_block: int
    """Bytes of one KV block over all layers (K and V)."""

    def __post_init__(self) -> None:
        for name in ("flops_per_second", "copy_bytes_per_second"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def recompute_seconds(self, num_tokens: int) -> float:
        """Prefill of `num_tokens` tokens again: linear layers plus causal attention.

        Causal attention over n tokens sees n (n + 1) / 2 (query, key) pairs: 4 tokens -> 10.
        """
        pairs = num_tokens * (num_tokens + 1) / 2
        return (num_tokens * self.flops_per_token + pairs * self.attention_flops_per_pair) / self.flops_per_second

    def swap_seconds(self, num_blocks: int) -> float:
        """Moving `num_blocks` blocks to the host now and back later."""
        return 2 * num_blocks * self.kv_bytes_per_block / self.copy_bytes_per_second

    def prefers_swap(self, num_tokens: int, num_blocks: int) -> bool:
        return self.swap_seconds(num_blocks) < self.recompute_seconds(num_tokens)

    def break_even_tokens(self, block_size: int) -> float:
        """Sequence length above which swapping is cheaper (0: always; inf: never).

        Per token, recompute costs u + n v (attention grows with the length n) and a swap costs
        s, a constant: swap wins once n > (s - u) / v.
        """
        v = self.attention_flops_per_pair / (2 * self.flops_per_second)
        u = self.flops_per_token / self.flops_per_second + v
        s = 2 * self.kv_bytes_per_block / (block_size * self.copy_bytes_per_second)
        if s <= u:
            return 0.0
        return (s - u) / v if v > 0 else float("inf")
