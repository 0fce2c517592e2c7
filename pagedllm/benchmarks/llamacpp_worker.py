"""Times one request on llama.cpp (llama-cpp-python), or quantizes a GGUF with llama.cpp's own
quantizer; run by the peers' python as a script.

Standalone on purpose (standard library, numpy and llama_cpp only). usage: llamacpp_worker.py SPEC.json
A timing spec names the GGUF file, the prompt token ids, the output length, the iterations and the
threads; the result has the median prefill time and mean decode time per token (greedy: argmax of
the last logits, one token evaluated per step, as pagedllm's decode step does); ``"extra_bufts":
false`` loads the weights without llama.cpp's repacked layouts. A spec with
``"quantize"`` (a llama.cpp file type such as ``Q4_0``) writes ``model_path`` quantized to ``output``
with ``llama_model_quantize`` and its default choices (as the ``llama-quantize`` tool makes them).
A spec with ``"generate"`` (a list of prompts' token ids) generates each greedily, one request at
a time, up to ``max_tokens`` or a token of ``stop_token_ids`` (counted), with llama-cpp-python's speculative
decoding where ``"draft"`` names one: ``{"method": "prompt_lookup", "max_ngram_size": n,
"num_pred_tokens": k}`` (its ``LlamaPromptLookupDecoding``) or ``{"method": "draft_model",
"model_path": gguf, "num_pred_tokens": k}`` (a second Llama decoding k tokens greedily, through
its ``LlamaDraftModel`` interface); the result has each prompt's seconds and tokens.
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


def _draft_llama(model_path: str, k: int, kwargs: dict):
    """llama-cpp-python's draft interface over a second Llama: it keeps the K/V of the longest
    prefix it shares with the tokens it is given, evaluates the rest and decodes k tokens greedily.
    Loaded without llama.cpp's repacked layouts (_without_extra_bufts): on the AMX host its Q4_0
    and Q8_0 weights in them stop the process at the first decode."""
    import llama_cpp
    import numpy as np
    from llama_cpp.llama_speculative import LlamaDraftModel

    class DraftLlama(LlamaDraftModel):
        def __init__(self) -> None:
            self.llm = _without_extra_bufts({**kwargs, "model_path": model_path})

        def __call__(self, input_ids, /, **_):
            llm, ids = self.llm, input_ids.tolist()
            have = llm.input_ids[: llm.n_tokens].tolist()
            keep = 0
            while keep < min(len(have), len(ids) - 1) and have[keep] == ids[keep]:
                keep += 1
            llm.n_tokens = keep
            llm._ctx.kv_cache_seq_rm(-1, keep, -1)
            llm.eval(ids[keep:])
            out = []
            while True:
                out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
                if len(out) == k:
                    return np.asarray(out, dtype=np.intc)
                llm.eval(out[-1:])

    return DraftLlama()


def generate(spec: dict) -> dict:
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    t0 = time.perf_counter()
    threads = spec["threads"]
    n_ctx = max(map(len, spec["generate"])) + spec["max_tokens"] + 16
    kwargs = dict(n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=max(512, n_ctx), verbose=False)
    d = spec.get("draft")
    draft = None
    if d and d["method"] == "prompt_lookup":
        draft = LlamaPromptLookupDecoding(max_ngram_size=d["max_ngram_size"], num_pred_tokens=d["num_pred_tokens"])
    elif d:
        draft = _draft_llama(d["model_path"], d["num_pred_tokens"], kwargs)
    llm = llama_cpp.Llama(model_path=spec["model_path"], draft_model=draft, **kwargs)
    load_s = time.perf_counter() - t0
    stop = set(spec["stop_token_ids"])

    def one(prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
        s0 = time.perf_counter()
        out: list[int] = []
        for tok in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(tok))  # a stop token counts, as in pagedllm's outputs
            if tok in stop or len(out) == max_tokens:
                break
        return time.perf_counter() - s0, out

    one(spec["warm"], 16)  # warm-up (a prompt of its own: the timed ones find no cached prefix of theirs)
    runs = [one(p, spec["max_tokens"]) for p in spec["generate"]]
    return {"load_s": load_s, "seconds": [r[0] for r in runs], "tokens": [r[1] for r in runs],
            "llama_cpp_version": llama_cpp.__version__}


def run(spec: dict) -> dict:
    if "quantize" in spec:
        return quantize(spec)
    if "generate" in spec:
        return generate(spec)
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
