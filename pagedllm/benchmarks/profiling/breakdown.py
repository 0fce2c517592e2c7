"""Where the wall time of the throughput workload goes, by category: the native attention kernel
(its ctypes call timed), GEMMs, elementwise ops (torch's and the native bf16 ones), dense (flash)
attention (torch's or the native flash kernel), the fused native decode step, the host's Python
parts (scheduling, batch building, sampling, output processing, each timed as its own range) and
the rest (the model's forward glue and the engine loop).

Arguments: [DTYPE] [NUM_PROMPTS] [KEY=VALUE ...] (default bfloat16, 128: the `bench throughput`
workload, prompts 32-512, outputs 16-256, seed 0); KEY=VALUE pairs are more engine arguments, e.g.
quantization=w8a8.

torch.profiler's self times of aten ops are summed per category; the native calls are wrapped in
`record_function` so they show up as their own rows. The profiler adds per-op overhead, so the
run without it is timed too and both walls are printed.
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import pagedllm.attention.torch_backend as tb
import pagedllm.layers.activation as act
import pagedllm.layers.linear as lin
import pagedllm.layers.rmsnorm as rms
import pagedllm.layers.rotary as rot
import pagedllm.quantization.native as qn
import pagedllm.worker.model_runner as mr
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.native_decode import NativeDecode
from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.script import parser
from pagedllm.benchmarks.workloads import random_workload, vocab_info

GEMM = ("aten::mm", "aten::addmm", "aten::linear", "aten::mkldnn_linear", "mkldnn::_linear_pointwise", "aten::bmm",
        "aten::matmul", "pagedllm::linear_bf16_small_m", "aten::_int_mm", "pagedllm::w8a8_linear")
ATTN = ("pagedllm::paged_attention",)
DENSE = ("aten::_scaled_dot_product_flash_attention_for_cpu", "pagedllm::flash_prefill")
NATIVE_STEP = ("pagedllm::native_decode_step",)
# Python around the model, each timed as its own range (self time: what is not in the ops inside)
HOST = ("pagedllm::schedule", "pagedllm::update_from_output", "pagedllm::prepare_batch", "pagedllm::sample",
        "pagedllm::process_outputs")
ELEMENTWISE = ("aten::mul", "aten::add", "aten::add_", "aten::mul_", "aten::rsqrt", "aten::pow", "aten::mean",
               "aten::silu", "aten::cat", "aten::neg", "aten::index_copy_", "aten::copy_", "aten::to",
               "aten::_to_copy", "aten::index_select", "aten::rms_norm", "aten::_fused_rms_norm",
               "aten::embedding", "aten::to_dense", "aten::to_mkldnn", "aten::contiguous", "aten::clone",
               "aten::sub", "aten::div", "aten::exp", "aten::maximum", "aten::fill_", "aten::zero_",
               "pagedllm::elementwise", "pagedllm::elementwise_bf16")


def _wrap(fn, name):
    def wrapped(*a, **k):
        with record_function(name):
            return fn(*a, **k)
    return wrapped


def _engine_arg(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = parser(__doc__, prog)
    ap.add_argument("dtype", nargs="?", default="bfloat16", help="model dtype (default bfloat16)")
    ap.add_argument("num_prompts", nargs="?", type=int, default=128, help="requests (default 128)")
    ap.add_argument("engine_args", nargs="*", type=_engine_arg, metavar="KEY=VALUE", help="more engine arguments")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    dtype, n = args.dtype, args.num_prompts
    llm = LLM(dtype=dtype, **dict(args.engine_args))
    reqs = random_workload(n, (32, 512), (16, 256), vocab_info(None), seed=0)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    params = [SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True) for r in reqs]
    out_tokens = sum(r.output_len for r in reqs)
    llm.generate(prompts[:4], params[:4], use_tqdm=False)
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    plain = time.perf_counter() - t0
    llm.reset_prefix_cache()  # the profiled run prefills every prompt again, as the first did
    tb.paged_attention_native = _wrap(tb.paged_attention_native, "pagedllm::paged_attention")
    lin.small_m_linear = _wrap(lin.small_m_linear, "pagedllm::linear_bf16_small_m")
    tb.flash_prefill = _wrap(tb.flash_prefill, "pagedllm::flash_prefill")
    qn.w8a8_small_m_linear = _wrap(qn.w8a8_small_m_linear, "pagedllm::w8a8_linear")
    qn.w8a8_batch_linear = _wrap(qn.w8a8_batch_linear, "pagedllm::w8a8_batch_linear")
    rms.rms_norm_bf16 = _wrap(rms.rms_norm_bf16, "pagedllm::elementwise_bf16")
    act.silu_mul_bf16 = _wrap(act.silu_mul_bf16, "pagedllm::elementwise_bf16")
    rot.rope_bf16 = _wrap(rot.rope_bf16, "pagedllm::elementwise_bf16")
    NativeDecode.run = _wrap(NativeDecode.run, "pagedllm::native_decode_step")
    NativeDecode.run_head = _wrap(NativeDecode.run_head, "pagedllm::native_decode_step")
    Scheduler.schedule = _wrap(Scheduler.schedule, "pagedllm::schedule")
    Scheduler.update_from_output = _wrap(Scheduler.update_from_output, "pagedllm::update_from_output")
    InputBatch.prepare = _wrap(InputBatch.prepare, "pagedllm::prepare_batch")
    mr.sample_isolating_faults = _wrap(mr.sample_isolating_faults, "pagedllm::sample")
    OutputProcessor.process_outputs = _wrap(OutputProcessor.process_outputs, "pagedllm::process_outputs")
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    cats: dict[str, float] = defaultdict(float)
    per_op: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        s = ev.self_cpu_time_total / 1e6
        name = ev.key
        cat = ("attention kernel" if name in ATTN else "GEMM" if name in GEMM else "dense attention"
               if name in DENSE else "elementwise" if name in ELEMENTWISE else "fused native decode step"
               if name in NATIVE_STEP else name.removeprefix("pagedllm::") + " (Python)"
               if name in HOST else "other torch ops")
        cats[cat] += s
        per_op[name] += s
    print(f"dtype {dtype}, {n} requests, {out_tokens} output tokens")
    print(f"wall without profiler {plain:.1f} s ({out_tokens / plain:.0f} tok/s); with profiler {wall:.1f} s")
    accounted = sum(cats.values())
    cats["rest (other Python: model forward glue, engine loop; outside the ranges above)"] = wall - accounted
    print("| category | s | % of wall |\n|---|---|---|")
    for k, v in sorted(cats.items(), key=lambda kv: -kv[1]):
        print(f"| {k} | {v:.2f} | {100 * v / wall:.1f} |")
    print("\ntop ops by self time:")
    for k, v in sorted(per_op.items(), key=lambda kv: -kv[1])[:20]:
        print(f"  {k:55s} {v:7.2f} s {100 * v / wall:5.1f}%")


if __name__ == "__main__":
    raise SystemExit(main())
