"""The device check's LoRA part (gpu_check.py, `make gpu-check`): batched multi-LoRA on the GPU.

1. agreement: a tiny random Llama in float32 with two random rank-8 / rank-16 adapters on every
   linear layer, requests mixing both adapters and no adapter, greedy; run three ways on one
   engine: decode steps replayed from the CUDA graphs with the Triton LoRA kernels in them (the
   default), eager with the Triton kernels, and eager with the torch loop over adapter groups
   (two GEMMs per adapter, the path before the Triton kernels). The tokens must be equal, and
   each adapter must change its rows' tokens (else the check proves nothing).
2. timing: a random-weight Llama of the benchmarked shape in bf16, `requests` requests of
   `prompt_len` tokens and `max_tokens` greedy tokens each: output tok/s of the engine without
   --enable-lora, and of a LoRA engine (two rank-16 adapters alternating over the requests) on
   the CUDA graphs with the Triton kernels, and on the eager torch loop.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch


def build(hf_config: Any, folder: Path, tokenizer_dir: str, device: str, dtype: str, max_len: int, max_seqs: int,
          max_rank: int | None, graph_sizes: tuple[int, ...]):
    """An LLMEngine on random weights of `hf_config` (saved into `folder`), with two LoRA slots of
    rank `max_rank` (None: no LoRA)."""
    from pagedllm.config import CacheConfig, DeviceConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
    from pagedllm.engine.llm_engine import LLMEngine

    folder.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(str(folder))
    per_token = 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * (
        hf_config.hidden_size // hf_config.num_attention_heads) * (4 if dtype == "float32" else 2)
    config = EngineConfig(
        ModelConfig(model=folder.name, kind="hf", path=str(folder), served_model_name=folder.name,
                    hf_config=hf_config, dtype=dtype, max_model_len=max_len, tokenizer=tokenizer_dir,
                    load_format="dummy"),
        CacheConfig(block_size=16, kv_cache_memory=2 * max_seqs * max_len * per_token, enable_prefix_caching=False),
        SchedulerConfig(max_num_batched_tokens=max(2048, max_len), max_num_seqs=max_seqs, max_model_len=max_len),
        DeviceConfig(device=device, gpu_memory_utilization=0.9, cuda_graph_sizes=graph_sizes),
        lora_config=None if max_rank is None else LoRAConfig(max_loras=2, max_lora_rank=max_rank),
    )
    return LLMEngine(config, log_stats=False)


def run(engine, tag: str, prompts: np.ndarray, loras: list, max_tokens: int) -> tuple[list[list[int]], float]:
    """Every prompt at once, greedy: each request's tokens and the seconds until all finished."""
    from pagedllm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for rid, p, lora in zip(ids, prompts, loras):
        engine.add_request(rid, {"prompt_token_ids": [int(t) for t in p]}, params, lora_request=lora)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    sync()
    return [tokens[i] for i in ids], time.perf_counter() - t0


def _modes(engine):
    """(name, setter) of the three ways one LoRA engine runs: graphs + Triton, eager Triton, eager loop."""
    runner = engine.executor.runner
    graphs, lora = runner.cuda_graphs, runner.lora

    def use(graph: bool, triton: bool) -> None:
        runner.cuda_graphs = graphs if graph else None
        lora.triton = triton

    return [("graphs_triton", lambda: use(True, True)), ("eager_triton", lambda: use(False, True)),
            ("eager_torch_loop", lambda: use(False, False))]


def _adapters(hf_config: Any, folder: Path, ranks: tuple[int, ...], b_std: float) -> list:
    from pagedllm.benchmarks.lora import write_random_adapter
    from pagedllm.lora.request import LoRARequest

    return [LoRARequest(f"a{i}", i + 1, write_random_adapter(hf_config, folder / f"a{i}", r, i + 1, b_std=b_std))
            for i, r in enumerate(ranks)]


def agreement(tiny_config: Any, tokenizer_dir: str, workdir: Path, device: str) -> dict[str, Any]:
    engine = build(tiny_config, workdir / "lora-tiny", tokenizer_dir, device, "float32", 96, 16, 16,
                   (1, 2, 4, 8, 16))
    adapters = _adapters(tiny_config, workdir / "lora-tiny-adapters", (8, 16), b_std=0.5)
    prompts = np.random.default_rng(0).integers(3, 300, size=(12, 16))
    loras = [(adapters + [None])[i % 3] for i in range(len(prompts))]
    out: dict[str, Any] = {"prompts": len(prompts), "tokens": 16, "adapter_ranks": [8, 16]}
    results = {}
    for name, use in _modes(engine):
        use()
        results[name] = run(engine, f"agree-{name}", prompts, loras, 16)[0]
    base = run(engine, "agree-base", prompts, [None] * len(prompts), 16)[0]
    ref = results["eager_torch_loop"]
    for name in ("graphs_triton", "eager_triton"):
        out[f"{name}_equal_rows"] = sum(a == b for a, b in zip(results[name], ref))
    out["adapter_rows_changed"] = sum(a != b for a, b, lr in zip(ref, base, loras) if lr is not None)
    out["adapter_rows"] = sum(lr is not None for lr in loras)
    out["passed"] = (out["graphs_triton_equal_rows"] == out["eager_triton_equal_rows"] == len(prompts)
                     and out["adapter_rows_changed"] == out["adapter_rows"])
    engine.shutdown()
    return out


def timing(config: Any, tokenizer_dir: str, workdir: Path, device: str, requests: int, prompt_len: int,
           max_tokens: int) -> dict[str, Any]:
    max_len = prompt_len + max_tokens + 16
    sizes = tuple(s for s in (1, 2, 4, 8, 16, 32, 64) if s <= requests)
    prompts = np.random.default_rng(1).integers(3, 32000 if config.vocab_size > 32000 else config.vocab_size - 1,
                                                size=(requests, prompt_len))
    out: dict[str, Any] = {"requests": requests, "prompt_len": prompt_len, "max_tokens": max_tokens, "rank": 16}

    def tok_s(engine, tag: str, loras: list) -> float:
        run(engine, f"{tag}-warm", prompts[:2], loras[:2], 4)
        tokens, seconds = run(engine, tag, prompts, loras, max_tokens)
        return sum(map(len, tokens)) / seconds

    base = build(config, workdir / "lora-timing-base", tokenizer_dir, device, "bfloat16", max_len, requests, None,
                 sizes)
    out["base_tok_s"] = tok_s(base, "base", [None] * requests)
    base.shutdown()
    del base
    _free()
    engine = build(config, workdir / "lora-timing", tokenizer_dir, device, "bfloat16", max_len, requests, 16, sizes)
    adapters = _adapters(config, workdir / "lora-timing-adapters", (16, 16), b_std=0.01)
    mixed = [adapters[i % 2] for i in range(requests)]
    for name, use in _modes(engine):
        if name == "eager_triton":
            continue
        use()
        out[f"lora_{name}_tok_s"] = tok_s(engine, name, mixed)
        if name == "graphs_triton":
            out["lora_engine_no_adapter_rows_tok_s"] = tok_s(engine, "noad", [None] * requests)
    engine.shutdown()
    del engine
    _free()
    return out


def _free() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def lora_check(tiny_config: Any, timing_config: Any, tokenizer_dir: str, workdir: Path, device: str,
               requests: int = 32, prompt_len: int = 128, max_tokens: int = 64) -> dict:
    """Both parts, on `device`: cuda, or cpu under Triton's interpreter with the Triton attention
    backend (PAGEDLLM_ATTENTION_BACKEND=triton, TRITON_INTERPRET=1; no graphs there) for a test
    of this path."""
    result = {"agreement": agreement(tiny_config, tokenizer_dir, workdir, device)}
    _free()
    result["timing"] = timing(timing_config, tokenizer_dir, workdir, device, requests, prompt_len, max_tokens)
    return result
