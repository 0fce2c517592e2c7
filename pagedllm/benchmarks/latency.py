"""`pagedllm bench latency`: one request alone: prefill time, per-token decode time, and what they
achieve against this machine's peaks (fp32 matmul FLOP/s and copy bandwidth, measured first).

Each iteration adds one request (random token ids, greedy, ignore_eos, exact output length) to an
LLMEngine with prefix caching off and times every `step()`: the first step computes the whole
prompt and samples the first token (prefill); each later step decodes one token.
Decode bandwidth = bytes of weights one decode step reads (decoder weights + lm_head) / step time;
the KV cache read for the context is reported on top.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from tqdm.auto import tqdm

from pagedllm.benchmarks.env import measure_copy_bandwidth, measure_matmul_peak, run_metadata
from pagedllm.benchmarks.flops import ModelShape
from pagedllm.benchmarks.workloads import random_workload, vocab_info

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def run_latency(model: str | None, engine_kwargs: dict[str, Any], input_len: int, output_len: int,
                num_iters: int, num_warmup: int, seed: int = 0) -> dict[str, Any]:
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.sampling_params import SamplingParams

    if input_len < 1 or output_len < 2 or num_iters < 1 or num_warmup < 0:
        raise ValueError(f"need input_len >= 1, output_len >= 2, num_iters >= 1, num_warmup >= 0; got "
                         f"{input_len}, {output_len}, {num_iters}, {num_warmup}")
    meta = run_metadata()
    peak_flops = measure_matmul_peak()
    peak_bw = measure_copy_bandwidth()
    kwargs = dict(engine_kwargs)
    kwargs["enable_prefix_caching"] = False
    kwargs["max_num_batched_tokens"] = max(kwargs.get("max_num_batched_tokens") or 2048, input_len)
    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
    load_s = time.perf_counter() - t0
    mc = engine.model_config
    shape = ModelShape.from_hf_config(mc.hf_config)
    itemsize = _ITEMSIZE[mc.dtype]
    prompt = random_workload(1, (input_len, input_len), (output_len, output_len), vocab_info(model), seed)[0]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)

    iters = []
    for it in tqdm(range(num_warmup + num_iters), desc="latency iterations", dynamic_ncols=True):
        engine.add_request(f"latency-{it}", {"prompt_token_ids": prompt.prompt_token_ids}, params)
        steps = []
        while engine.has_unfinished_requests():
            s0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - s0)
        if it >= num_warmup:
            iters.append({"prefill_s": steps[0], "decode_s": steps[1:], "total_s": sum(steps)})

    prefill = statistics.median(i["prefill_s"] for i in iters)
    decode = statistics.median(statistics.fmean(i["decode_s"]) for i in iters)
    total = statistics.median(i["total_s"] for i in iters)
    mean_ctx = input_len + output_len / 2  # a decode step's context, averaged over the request
    weight_bytes = shape.decode_weight_bytes(itemsize)
    kv_bytes = shape.kv_bytes_per_token(itemsize) * mean_ctx
    prefill_flops = shape.prefill_flops(input_len)
    decode_flops = shape.token_flops(int(mean_ctx))
    return {
        "benchmark": "latency",
        "meta": meta,
        "model": {"name": mc.served_model_name, "dtype": mc.dtype, "decoder_params": shape.decoder_params,
                  "total_params": shape.total_params, "decode_weight_bytes": weight_bytes},
        "input_len": input_len,
        "output_len": output_len,
        "num_iters": num_iters,
        "num_warmup": num_warmup,
        "load_s": load_s,
        "peak_matmul_flops_per_s": peak_flops,
        "peak_copy_bytes_per_s": peak_bw,
        "prefill_ms": 1000 * prefill,
        "decode_ms_per_token": 1000 * decode,
        "request_latency_s": total,
        "decode_tokens_per_s": 1 / decode,
        "prefill_flops_per_s": prefill_flops / prefill,
        "prefill_fraction_of_peak_flops": prefill_flops / prefill / peak_flops,
        "decode_flops_per_s": decode_flops / decode,
        "decode_fraction_of_peak_flops": decode_flops / decode / peak_flops,
        "decode_weight_bandwidth": weight_bytes / decode,
        "decode_weight_fraction_of_peak_bw": weight_bytes / decode / peak_bw,
        "decode_weight_kv_bandwidth": (weight_bytes + kv_bytes) / decode,
        "iterations": [{"prefill_ms": 1000 * i["prefill_s"], "decode_ms_per_token": 1000 * statistics.fmean(i["decode_s"]),
                        "total_s": i["total_s"]} for i in iters],
    }


def format_latency(r: dict[str, Any]) -> str:
    g = 1e9
    return "\n".join([
        f"model {r['model']['name']} ({r['model']['dtype']}), prompt {r['input_len']} tokens, output {r['output_len']} "
        f"tokens, median of {r['num_iters']} iterations after {r['num_warmup']} warm-up",
        f"prefill            {r['prefill_ms']:9.1f} ms    {r['prefill_flops_per_s'] / g:7.1f} GFLOP/s "
        f"({100 * r['prefill_fraction_of_peak_flops']:.0f}% of the {r['peak_matmul_flops_per_s'] / g:.1f} GFLOP/s matmul peak)",
        f"decode per token   {r['decode_ms_per_token']:9.2f} ms    {r['decode_flops_per_s'] / g:7.1f} GFLOP/s "
        f"({100 * r['decode_fraction_of_peak_flops']:.0f}% of peak), {r['decode_tokens_per_s']:.1f} tokens/s",
        f"decode bandwidth   {r['decode_weight_bandwidth'] / g:9.2f} GB/s of weights "
        f"({100 * r['decode_weight_fraction_of_peak_bw']:.0f}% of the {r['peak_copy_bytes_per_s'] / g:.1f} GB/s copy peak); "
        f"{r['decode_weight_kv_bandwidth'] / g:.2f} GB/s with the KV cache",
        f"request latency    {r['request_latency_s']:9.2f} s",
    ])
