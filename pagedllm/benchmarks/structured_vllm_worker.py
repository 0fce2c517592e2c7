"""Runs `pagedllm bench structured`'s workload on vLLM's CPU build; executed by `.venv-peers/bin/python`.

Standalone on purpose (standard library and vllm only; pagedllm is not installed beside vLLM).
The same steps as pagedllm's child (pagedllm/benchmarks/structured.py): the constrained requests
once to warm up, then timed, then the same prompts unconstrained with each reply's token count and
ignore_eos. usage: structured_vllm_worker.py SPEC.json
"""

from __future__ import annotations

import json
import sys
import time


def run(spec: dict) -> dict:
    t_load = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    kwargs = {"model": spec["hf_model_dir"], "seed": 0}
    if spec.get("max_model_len"):
        kwargs["max_model_len"] = spec["max_model_len"]
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t_load
    with open(spec["workload"]) as f:
        reqs = json.load(f)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]

    def constrained() -> list:
        return [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0,
                               structured_outputs=StructuredOutputsParams(**r["structured"])) for r in reqs]

    llm.generate(prompts, constrained(), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, constrained(), use_tqdm=False)
    constrained_s = time.perf_counter() - t0
    counts = [len(o.outputs[0].token_ids) for o in outs]
    free = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in counts]
    t0 = time.perf_counter()
    free_outs = llm.generate(prompts, free, use_tqdm=False)
    free_s = time.perf_counter() - t0
    return {"load_s": load_s, "constrained_s": constrained_s, "unconstrained_s": free_s,
            "output_tokens": sum(counts),
            "unconstrained_output_tokens": sum(len(o.outputs[0].token_ids) for o in free_outs),
            "texts": [o.outputs[0].text for o in outs], "finish": [o.outputs[0].finish_reason for o in outs],
            "vllm_version": vllm.__version__,
            "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch.")}


if __name__ == "__main__":
    from peer_child import child_main  # this script's folder is first on sys.path

    sys.exit(child_main(sys.argv[1:], run))
