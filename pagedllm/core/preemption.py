"""What a preemption costs: recomputing a victim's tokens later, or moving its blocks out and back.

`--preemption-mode auto` picks, per victim, the cheaper of the two. The model runner measures the
two rates once at startup (a matmul for FLOP/s, a block copy device <-> host for bytes/s); the
model's shape gives the work per token and the bytes per block. `preempt` takes a victim off the
device for the scheduler. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.step import Step, WorkerView


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
    """Bytes of one block of the pool (K and V): of every layer, or with KV layer groups
    (core/kv_groups.py) of the layers of one group."""
    kv_groups: int = 1
    """KV layer groups: a block of tokens takes one block in each (until a window frees them)."""

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
        """Moving `num_blocks` blocks of the pool (over all groups) to the host now and back later."""
        return 2 * num_blocks * self.kv_bytes_per_block / self.copy_bytes_per_second

    def prefers_swap(self, num_tokens: int, num_blocks: int) -> bool:
        return self.swap_seconds(num_blocks) < self.recompute_seconds(num_tokens)

    def break_even_tokens(self, block_size: int) -> float:
        """Sequence length above which swapping is cheaper (0: always; inf: never).

        Per token, recompute costs u + n v (attention grows with the length n) and a swap costs
        s, a constant: swap wins once n > (s - u) / v. With KV layer groups s is that of a block in
        every group, as long as no window has freed any (afterwards a swap costs less).
        """
        v = self.attention_flops_per_pair / (2 * self.flops_per_second)
        u = self.flops_per_token / self.flops_per_second + v
        s = 2 * self.kv_bytes_per_block * self.kv_groups / (block_size * self.copy_bytes_per_second)
        if s <= u:
            return 0.0
        return (s - u) / v if v > 0 else float("inf")


def preemption_mode(scheduler: Any, req: Request) -> str:
    """How to preempt `req`: "swap" or "recompute" (`--preemption-mode`; auto asks the cost model)."""
    mode = scheduler.config.preemption_mode
    kv = scheduler.kv
    # Nothing computed, nothing to keep; a full (or absent) swap pool falls back to recompute.
    if mode == "recompute" or not kv.can_swap_out(req):
        return "recompute"
    if mode == "auto" and scheduler.costs is not None:
        n = req.num_computed_tokens
        # The blocks it really holds and would move: every group's, a window group's only those of
        # its window (KVCacheManager.held_entries).
        return "swap" if scheduler.costs.prefers_swap(n, kv.held_entries(n)) else "recompute"
    return "swap"


def preempt(scheduler: Any, req: Request, step: Step) -> None:
    """Takes a running request off the device: by swap (its blocks go to the host pool, its
    computed tokens are kept) or by recompute (its blocks are dropped; it keeps its generated
    tokens and computes everything again when readmitted)."""
    kv = scheduler.kv
    assert not kv.lends_unwritten_blocks(req), f"{req} holds blocks hit in this step"
    mode = preemption_mode(scheduler, req)
    rid = req.request_id
    scheduler.running.remove(req)
    if rid in step.scheduled:  # scheduled earlier in this step: its tokens go back to the budget
        step.budget += step.scheduled.pop(rid)
        step.new_block_ids.pop(rid, None)
        step.spec.pop(rid, None)
    if mode == "swap":
        kv.swap_out(req)
        req.status = RequestStatus.SWAPPED
        req.queued_step = scheduler.num_steps
        scheduler.swapped.append(req)
    else:
        kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        scheduler.waiting.append(req, scheduler.num_steps)
    req.num_preemptions += 1
    scheduler.num_preemptions += 1
    scheduler.num_preemptions_by_mode[mode] += 1
    # The worker forgets it (keeping its random generator) and is sent it in full on return.
    if scheduler._worker.get(rid) == WorkerView.HELD:
        scheduler._worker[rid] = WorkerView.DROPPED
        scheduler._forget[rid] = True
    step.preempted.append(req)
