"""Runs `pagedllm bench structured`'s workload on vLLM's CPU build; executed by `.venv-peers/bin/python`.

Standalone on purpose (standard library and vllm only; pagedllm is not installed beside vLLM).
The same steps as pagedllm's child (pagedllm/benchmarks/structured.py): the constrained requests
once to warm up, then timed, then the same prompts unconstrained with each reply's token count and
ignore_eos. usage: structured_vllm_worker.py SPEC.json
"""

from __future__ import annotations

import sys
import time


def run(spec: dict) -> dict:
    from peer_child import constrained_then_free  # this script's folder is first on sys.path

    t_load = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    kwargs = {"model": spec["hf_model_dir"], "seed": 0}
    if spec.get("max_model_len"):
        kwargs["max_model_len"] = spec["max_model_len"]
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t_load
    return {"load_s": load_s, **constrained_then_free(llm, spec["workload"], SamplingParams, StructuredOutputsParams),
            "vllm_version": vllm.__version__,
            "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch.")}


if __name__ == "__main__":
    from peer_child import child_main

    sys.exit(child_main(sys.argv[1:], run))
