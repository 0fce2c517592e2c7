"""The rates preemption mode auto weighs: a token's recompute against swapping its KV out and back.

flops_per_token gives the work of recomputing one token; measure_preemption_rates times this
machine's prefill-sized GEMM and the swap path's block moves, once at start-up.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from pagedllm.layers.linear import Linear, dense_linear
from pagedllm.worker.kv_memory import KVMemory


def best_time(fn: Callable[[], object], reps: int = 5) -> float:
    """Fastest of `reps` timed calls after one warm-up call, in seconds."""
    fn()
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def flops_per_token(model: torch.nn.Module) -> float:
    """Linear-layer work of one token through the decoder layers (2 FLOPs per weight)."""
    return 2.0 * sum(m.in_features * m.out_features for name, m in model.named_modules()
                     if isinstance(m, Linear) and "layers." in name)


def measure_preemption_rates(kv: KVMemory, hidden: int, dtype: torch.dtype) -> tuple[float, float]:
    """(FLOP/s of a prefill-sized matmul, bytes/s of swapping KV blocks out and back in).

    The copy moves blocks of the idle cache through the real swap path (its contents are garbage
    before the first request anyway).
    """
    device = kv.device
    a = torch.randn(256, hidden, dtype=dtype, device=device)
    w = torch.randn(4 * hidden, hidden, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if kv.is_cuda else (lambda: None)
    # The GEMM path the model's own prefill takes (oneDNN for float32 on the CPU, where torch.mm's
    # MKL path runs at about half that rate).
    flops = 2.0 * 256 * hidden * 4 * hidden / best_time(lambda: (dense_linear(a, w), sync()))
    k = min(16, kv.num_blocks, kv.num_swap_blocks)
    if k == 0:
        return flops, 1.0  # no swap pool: nothing can be swapped, whatever the rate
    pairs = [(i, i) for i in range(k)]
    copy = 2.0 * k * kv.bytes_per_block() / best_time(lambda: (kv.move_blocks(pairs, pairs), sync()))
    return flops, copy
