"""`pagedllm bench embed`'s vLLM peer: embeds the texts with vLLM's CPU build (`LLM.embed`, runner
"pooling"), after a warm-up pass, and reports the time and the embeddings; executed by
`.venv-peers/bin/python` as a script. Standard library and vllm only (pagedllm is not installed in the
peers' environment). usage: embed_vllm_worker.py SPEC.json

vLLM's CPU build reserves `gpu_memory_utilization` of the host's total memory and checks it against
the free memory at start (0.92 of 23.6 GiB does not start beside other jobs), and sizes its KV cache
by VLLM_CPU_KVCACHE_SPACE (GiB, set by the parent): an encoder keeps no KV cache, so both are small.
"""

from __future__ import annotations

import json
import os
import sys
import time

_ENGINE: list = []  # the engine, kept alive until the process ends (below)


def run(spec: dict) -> dict:
    from vllm import LLM

    with open(spec["texts"]) as f:
        texts = json.load(f)
    t_load = time.perf_counter()
    llm = LLM(model=spec["hf_model_dir"], runner="pooling", dtype=spec["dtype"], seed=0,
              gpu_memory_utilization=spec["gpu_memory_utilization"],
              max_num_batched_tokens=spec["max_num_batched_tokens"])
    load_s = time.perf_counter() - t_load
    _ENGINE.append(llm)
    llm.embed(texts[: spec["warmup"]], use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.embed(texts, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    import vllm

    return {"load_s": load_s, "elapsed_s": elapsed, "embeddings": [o.outputs.embedding for o in outs],
            "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs), "vllm_version": vllm.__version__,
            "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch.")}


if __name__ == "__main__":
    from peer_child import child_main  # this script's folder is first on sys.path

    rc = child_main(sys.argv[1:], run)
    # The result is written before vLLM's teardown, which the engine (kept alive until here) starts
    # now: its race between the engine process's exit and its monitor thread aborted this process
    # (SIGABRT, "terminate called without an active exception") in one of two runs here, before the
    # result was written when the teardown ran as `run` returned. The parent reads the result.
    if _ENGINE:
        _ENGINE[0].llm_engine.engine_core.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
