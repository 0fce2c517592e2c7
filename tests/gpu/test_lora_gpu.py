"""The Triton LoRA kernels on a GPU at Llama-3-8B sizes against a float32 torch reference, and an
engine whose decode steps replay CUDA graphs with adapter rows against the same engine eager on
the torch loop over adapters."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.lora.layers import slot_order
from pagedllm.lora.triton_lora import lora_shrink_expand

pytestmark = pytest.mark.gpu
HIDDEN, KV = 4096, 1024


def reference(x, y, a, bt, ranges, rank, slots):
    """y + each row's delta in float32, from the same (rounded) inputs, h rounded as the kernel rounds it."""
    out = y.float().clone()
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        h = (x[t].to(a.dtype).float() @ a[s].float().t()).to(a.dtype).float()
        for j, (lo, hi) in enumerate(ranges.tolist()):
            out[t, lo:hi] += h[j * rank : (j + 1) * rank] @ bt[s, j * rank : (j + 1) * rank, lo:hi].float()
    return out


@pytest.mark.parametrize("xdt,wdt", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                     (torch.float16, torch.float16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("rows", [5, 300])
def test_fused_qkv_deltas_at_8b_sizes(xdt, wdt, rows) -> None:
    """float32: within 1e-4 of the largest delta; 16-bit: within 2% of it (the delta and y are
    rounded to 16 bits: about 0.6% of the largest delta at most here)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    slots_n, rank = 4, 16
    ranges = torch.tensor([[0, HIDDEN], [HIDDEN, HIDDEN + KV], [HIDDEN + KV, HIDDEN + 2 * KV]], device="cuda")
    n_out = HIDDEN + 2 * KV
    a = (torch.randn(slots_n, 3 * rank, HIDDEN, device="cuda", generator=g) / HIDDEN**0.5).to(wdt)
    bt = torch.zeros(slots_n, 3 * rank, n_out, device="cuda")
    for j, (lo, hi) in enumerate(ranges.tolist()):
        bt[:, j * rank : (j + 1) * rank, lo:hi] = torch.randn(slots_n, rank, hi - lo, device="cuda", generator=g)
    bt = bt.to(wdt)
    slots = np.random.default_rng(rows).integers(-1, slots_n, rows).astype(np.int32)
    x = torch.randn(rows, HIDDEN, device="cuda", generator=g).to(xdt)
    y = torch.randn(rows, n_out, device="cuda", generator=g).to(xdt)
    y0 = y.clone()
    want = reference(x, y, a, bt, ranges, rank, slots)
    order, most = slot_order(slots, slots_n)
    lora_shrink_expand(x, y, a, bt, ranges, rank, torch.from_numpy(order).cuda(), most)
    assert torch.equal(y[torch.from_numpy(slots < 0).cuda()], y0[torch.from_numpy(slots < 0).cuda()])
    tol = 1e-4 if xdt == wdt == torch.float32 else 2e-2
    assert (y.float() - want).abs().max() <= tol * (want - y0.float()).abs().max()


def test_lora_decode_steps_on_cuda_graphs_equal_the_eager_torch_loop(tmp_path) -> None:
    from pagedllm import LLM, LoRARequest, SamplingParams
    from pagedllm.benchmarks.lora import write_random_adapter
    from pagedllm.models.testing import make_tiny_checkpoint

    base = make_tiny_checkpoint(str(tmp_path / "base"), arch="llama")
    llm = LLM(base, device="cuda", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              cuda_graph_sizes=[1, 2, 4, 8], kv_cache_memory="64MiB")
    runner = llm.llm_engine.executor.runner
    assert runner.cuda_graphs is not None and runner.cuda_graphs.lora is not None
    cfg = runner.model_config.hf_config
    loras = [LoRARequest(f"a{i}", i + 1, write_random_adapter(cfg, tmp_path / f"a{i}", r, i, b_std=0.5))
             for i, r in enumerate((8, 16))]
    prompts = [[(7 * i + 3 * k) % 300 + 3 for i in range(12)] for k in range(6)]
    which = [loras[0], None, loras[1], loras[0], loras[1], None]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def tokens():
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, lora_request=which, use_tqdm=False)]

    graphs = tokens()
    replays = runner.cuda_graphs
    runner.cuda_graphs, runner.lora.triton = None, False
    loop = tokens()
    runner.cuda_graphs, runner.lora.triton = replays, True
    base_tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert graphs == loop
    assert all(g != b for g, b, w in zip(graphs, base_tokens, which) if w is not None)
