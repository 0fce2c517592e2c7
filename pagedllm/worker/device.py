"""The device-specific parts of the model runner: the GPU memory budget of the KV cache, the
pinned host pool for swapped blocks, and random weights for benchmarks of a model shape."""

from __future__ import annotations

import logging

import torch

from pagedllm.config import ModelConfig

logger = logging.getLogger(__name__)

# Activations are reserved for this many tokens in one step (above the default token budget)
# and this many sampled rows, plus a fixed margin for the CUDA context's own allocations.
_RESERVED_TOKENS = 8192
_RESERVED_ROWS = 256
_MARGIN_BYTES = 512 << 20
# Multiprocessors assumed when the Triton kernels run under the interpreter (an H100/H200's).
INTERPRETER_SMS = 132


def activation_reserve_bytes(mc: ModelConfig) -> int:
    """Upper bound on the memory one forward pass and its sampling need besides weights and KV.

    Per token: the qkv and gate/up outputs, a few hidden-sized buffers, twice (two layers' tensors
    can be alive at once); per sampled row: float32 logits and the sampler's copies of them.
    """
    cfg = mc.hf_config
    hidden, inter = int(cfg.hidden_size), int(cfg.intermediate_size)
    qkv = (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim
    itemsize = 4 if mc.dtype == "float32" else 2
    per_token = (qkv + 2 * inter + 4 * hidden) * itemsize * 2
    return _RESERVED_TOKENS * per_token + _RESERVED_ROWS * mc.vocab_size * 4 * 4 + _MARGIN_BYTES


def gpu_kv_cache_budget(device: torch.device, utilization: float, mc: ModelConfig) -> int:
    """Bytes for the KV cache: utilization x total memory, less what is in use already (weights,
    the CUDA context, other processes) and the activation reserve."""
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * utilization) - (total - free) - activation_reserve_bytes(mc)
    logger.info(
        "GPU memory: %.1f GiB total, %.1f GiB in use after loading; %.0f%% utilization leaves %.2f GiB for the KV cache",
        total / (1 << 30),
        (total - free) / (1 << 30),
        utilization * 100,
        max(budget, 0) / (1 << 30),
    )
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} leaves no memory for the KV cache: "
            f"{(total - free) / (1 << 30):.1f} GiB of {total / (1 << 30):.1f} GiB are in use after loading"
        )
    return budget


def pinned_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor in page-locked memory (fast, asynchronous copies to and from the GPU)."""
    t = torch.empty(shape, dtype=dtype, pin_memory=True)
    t.zero_()
    return t


def num_sms(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


@torch.no_grad()
def initialize_dummy_weights(model: torch.nn.Module, seed: int, low: float = -0.02, high: float = 0.02) -> None:
    """Uniform random weights in place, on the model's device (norm weights stay at one)."""
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if "norm" in name:
            p.fill_(1.0)
            continue
        g = torch.Generator(device=p.device).manual_seed(seed + len(seen))
        if p.is_floating_point():
            p.uniform_(low, high, generator=g)
