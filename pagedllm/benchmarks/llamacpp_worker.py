"""Times one request on llama.cpp (llama-cpp-python), or quantizes a GGUF with llama.cpp's own
quantizer; run by the peers' python as a script.

Standalone on purpose (standard library, numpy and llama_cpp only). usage: llamacpp_worker.py SPEC.json
A timing spec names the GGUF file, the prompt token ids, the output length, the iterations and the
threads; the result has the median prefill time and mean decode time per token (greedy: argmax of
the last logits, one token evaluated per step, as pagedllm's decode step does); ``"extra_bufts":
false`` loads the weights without llama.cpp's repacked layouts. A spec with
``"quantize"`` (a llama.cpp file type such as ``Q4_0``) writes ``model_path`` quantized to ``output``
with ``llama_model_quantize`` and its default choices (as the ``llama-quantize`` tool makes them).
"""

from __future__ import annotations

import statistics
import sys
import time


def quantize(spec: dict) -> dict:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{spec['quantize']}")
    params.nthread = spec["threads"]
    rc = llama_cpp.llama_model_quantize(spec["model_path"].encode(), spec["output"].encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize returned {rc}")
    return {"output": spec["output"], "llama_cpp_version": llama_cpp.__version__}


def _without_extra_bufts(kwargs: dict):
    """A Llama whose weights stay in the GGUF's layout: llama.cpp's extra buffer types (weights
    repacked for its AMX or AVX2/AVX-512 kernels) off, as pagedllm/eval/llamacpp.py loads them (its
    AMX buffer type stops the process on hosts that do not give it the AMX tile state)."""
    import llama_cpp
    import llama_cpp.llama as llama_module

    default = llama_cpp.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    llama_module.llama_cpp.llama_model_default_params = params
    try:
        return llama_module.Llama(**kwargs)
    finally:
        llama_module.llama_cpp.llama_model_default_params = default


def run(spec: dict) -> dict:
    if "quantize" in spec:
        return quantize(spec)
    import llama_cpp
    import numpy as np

    t0 = time.perf_counter()
    prompt = spec["prompt_token_ids"]
    threads = spec["threads"]
    n_ctx = len(prompt) + spec["output_len"] + 8
    # the prompt in one call; llama-cpp-python keeps the logits of n_batch positions (a decode step
    # past the n_batch-th token reads beyond them), so n_batch covers the whole context
    kwargs = dict(model_path=spec["model_path"], n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                  n_batch=max(512, n_ctx), verbose=False)
    llm = llama_cpp.Llama(**kwargs) if spec.get("extra_bufts", True) else _without_extra_bufts(kwargs)
    load_s = time.perf_counter() - t0
    ready = time.time()
    iters = []
    for it in range(spec["num_warmup"] + spec["num_iters"]):
        llm.reset()
        s0 = time.perf_counter()
        llm.eval(prompt)
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        prefill = time.perf_counter() - s0
        steps = []
        for _ in range(spec["output_len"] - 1):
            s0 = time.perf_counter()
            llm.eval([tok])
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            steps.append(time.perf_counter() - s0)
        if it >= spec["num_warmup"]:
            iters.append((prefill, statistics.fmean(steps)))
    decode = statistics.median(d for _, d in iters)
    return {
        "ready_time": ready,
        "load_s": load_s,
        "elapsed_s": sum(p + d * (spec["output_len"] - 1) for p, d in iters),
        "prefill_ms": 1000 * statistics.median(p for p, _ in iters),
        "decode_ms_per_token": 1000 * decode,
        "decode_tokens_per_s": 1 / decode,
        "llama_cpp_version": llama_cpp.__version__,
    }


if __name__ == "__main__":
    from peer_child import child_main  # this script's folder is first on sys.path

    sys.exit(child_main(sys.argv[1:], run))
