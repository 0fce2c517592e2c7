"""The `pagedllm bench` commands that parse their own flags: name -> (module, what it measures).

`pagedllm/benchmarks_cli.py` adds one subcommand per entry and hands the rest of the command line
to the module's `main(argv, prog)`; `pagedllm bench <name> --help` prints the module's flags and
docstring. A group (a dict) is one more word: `pagedllm bench kernels attention`. Modules are
named, not imported, so that `pagedllm --help` loads none of them; the two simulator benchmarks
live in pagedllm.simulator (above this package's layer).
"""

from __future__ import annotations

Entry = tuple[str, str]

COMMANDS: dict[str, Entry | tuple[str, dict[str, Entry]]] = {
    "kernels": ("kernel microbenchmarks, each against its torch or previous form", {
        "attention": ("pagedllm.benchmarks.kernels.attention",
                      "paged attention kernel: decodes and prompt chunks per cache dtype (vs a baseline .c)"),
        "flash-prefill": ("pagedllm.benchmarks.kernels.flash_prefill",
                          "flash prefill kernel on long prompt chunks against torch's flash attention"),
        "small-m-gemm": ("pagedllm.benchmarks.kernels.small_m_gemm",
                         "small-M GEMM kernel against torch's GEMM, by rows"),
        "native-decode": ("pagedllm.benchmarks.kernels.native_decode",
                          "fused native decode step against the torch path, by rows and dtype"),
        "sampler": ("pagedllm.benchmarks.kernels.sampler",
                    "sampler time per decode step, by batch size and sampling settings"),
        "quant": ("pagedllm.benchmarks.kernels.quant",
                  "quantized linear kernels at decode and prefill shapes (--decode-pass, --w8a8)"),
        "quant-rows": ("pagedllm.benchmarks.kernels.quant_rows",
                       "rows where the native quantized kernels stop beating the batch path"),
        "embedding-gather": ("pagedllm.benchmarks.kernels.embedding_gather",
                             "quantized embedding lookup against expanding the whole table"),
    }),
    "profile": ("where the time goes: profiles of generation and decode steps", {
        "breakdown": ("pagedllm.benchmarks.profiling.breakdown",
                      "throughput workload's wall time by category (kernels, GEMMs, host Python)"),
        "generate": ("pagedllm.benchmarks.profiling.generate", "torch.profiler's op table of offline generation"),
        "quant-decode": ("pagedllm.benchmarks.profiling.quant_decode",
                         "quantized single-stream decode step: fused call, LM head, engine step"),
    }),
    "quant": ("quantization: the schemes' speed and quality, activations, docs/quantization.md's table", {
        "schemes": ("pagedllm.benchmarks.quant.schemes",
                    "per scheme: weight memory and perplexity, or (--speed) decode and throughput"),
        "activations": ("pagedllm.benchmarks.quant.activations",
                        "perplexity cost of int8 activations in the quantized decode kernel"),
        "table": ("pagedllm.benchmarks.quant.table", "docs/quantization.md's table from the schemes' JSON files"),
    }),
    "scheduling": ("pagedllm.benchmarks.scheduling",
                   "prefix caching, policies under a mixed workload, recompute versus swap"),
    "host-overhead": ("pagedllm.benchmarks.host_overhead", "per-step host time of decode steps, by batch size"),
    "single-stream": ("pagedllm.benchmarks.single_stream", "per-part time of one request's decode steps"),
    "host-memory": ("pagedllm.benchmarks.host_memory", "what huge pages and the tuned C heap change on this host"),
    "cpu-contention": ("pagedllm.benchmarks.cpu_contention",
                       "single-request decode while other processes keep the cores busy"),
    "kv-quality": ("pagedllm.benchmarks.kv_quality",
                   "greedy agreement and |Δlogprob| of each --kv-cache-dtype against the model dtype's cache"),
    "kv-first-writes": ("pagedllm.benchmarks.kv_first_writes", "what the KV cache's first writes cost"),
    "moe": ("pagedllm.benchmarks.moe",
            "a Qwen3-MoE-shaped random model: throughput against HF transformers, one stream against llama.cpp"),
    "scale": ("pagedllm.benchmarks.scale",
              "a Llama-3.2-1B- or Qwen3-0.6B-shaped random model: offline against vLLM, one stream against "
              "llama.cpp (bf16/Q8_0/Q4_0), a 4,000-token prompt against HF and llama.cpp"),
    "kv-window": ("pagedllm.benchmarks.kv_window",
                  "KV memory of one long request with sliding-window layer groups against every block kept"),
    "embed": ("pagedllm.benchmarks.embed",
              "embedding throughput against sentence-transformers' encode on the same texts (all-MiniLM-L6-v2)"),
    "embed-mixed": ("pagedllm.benchmarks.embed_mixed",
                    "mean TPOT of a generation load at a fixed request rate, alone and with embeddings mixed in"),
    "structured": ("pagedllm.benchmarks.structured",
                   "constrained decoding (JSON schemas, regexes, choices) against the same workload unconstrained "
                   "and against vLLM's CPU build; grammar compile times"),
    "spec": ("pagedllm.benchmarks.spec",
             "speculative decoding against none on code-edit / quote tasks: single stream and concurrent"),
    "lora": ("pagedllm.benchmarks.lora",
             "throughput with N LoRA adapters mixed over the workload against the base model; adapter load time"),
    "run-batch": ("pagedllm.benchmarks.run_batch",
                  "pagedllm run-batch on a chat batch file against LLM.chat on the same conversations"),
    "ttft": ("pagedllm.benchmarks.ttft",
             "time to first token under 1/4/16/64 concurrent chat streams (guidellm) against vLLM's CPU build"),
    "ui-cost": ("pagedllm.benchmarks.ui_cost",
                "pagedllm serve's output tokens/s under full load with and without a viewer on the engine feed"),
    "soak": ("pagedllm.benchmarks.soak",
             "pagedllm serve under rounds of requests: memory against the stated bound, exact completions"),
    "chaos": ("pagedllm.benchmarks.chaos", "the server chaos tests over many seeds, then a storm of disconnects"),
    "gpu-check": ("pagedllm.benchmarks.gpu_check",
                  "the device check: GPU tests, decode and prefill against rooflines, agreement with the CPU"),
    "gpu-carry": ("pagedllm.benchmarks.gpu_carry",
                  "what a GPU machine without network needs for gpu-check's default-model part"),
    "sim-claims": ("pagedllm.simulator.claims", "the design's claims checked with the simulator (docs/claims.md)"),
    "sim-scale": ("pagedllm.simulator.scale", "simulator speed on a one-million-request trace"),
    "run-all": ("pagedllm.benchmarks.run_all", "the measurements behind docs/benchmarks.md, then the report"),
}
