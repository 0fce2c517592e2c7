"""Timing loops for `pagedllm bench collective`, run inside each rank (they call torch.distributed,
so they live here)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from pagedllm.distributed.parallel_state import ParallelContext


def _timed(fn, iters: int, reps: int = 7) -> float:
    """Seconds per call: `iters` back-to-back calls timed together (the ranks lined up once before
    them, so a late start of one rank is spread over many calls), the median of `reps` such runs."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter() - t0) / iters)
    times.sort()
    return times[len(times) // 2]


def time_all_reduce(ctx: ParallelContext, sizes: list[int], budget_bytes: int = 32 << 20) -> list[dict]:
    """Per message size (bytes, float32): median all-reduce seconds through gloo and shared memory."""
    tp = ctx.tp
    out = []
    for size in sizes:
        t = torch.ones(size // 4)
        iters = max(2, min(100, budget_bytes // size))

        def gloo() -> None:
            dist.all_reduce(t, group=tp.group)

        row = {"bytes": size, "gloo_s": _timed(gloo, iters)}
        if tp.shm is not None and tp.shm.fits(t):
            row["shm_s"] = _timed(lambda: tp.shm.all_reduce(t), iters)  # type: ignore[union-attr]
        out.append(row)
    return out


def time_decode_communication(ctx: ParallelContext, batch: int, hidden: int, num_layers: int, vocab: int,
                              iters: int = 5) -> float:
    """Median seconds of one tensor-parallel decode step's collectives, as the model issues them:
    the embedding all-reduce, two all-reduces per layer (after o_proj and down_proj) of
    [batch, hidden], and the all-gather of the LM head's [batch, vocab / tp] logits."""
    tp = ctx.tp
    x = torch.ones(batch, hidden)
    logits = torch.ones(batch, -(-vocab // tp.size))

    def step() -> None:
        tp.all_reduce(x)
        for _ in range(num_layers):
            tp.all_reduce(x)
            tp.all_reduce(x)
        tp.all_gather(logits)

    return _timed(step, iters)
