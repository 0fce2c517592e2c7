"""Runs a throughput workload on vLLM's CPU build; executed by `.venv-peers/bin/python` as a script.

Standalone on purpose: it imports only the standard library and vllm, since pagedllm is not
installed in the peers' virtual environment. usage: vllm_worker.py SPEC.json
The spec names the Hugging Face model folder, the workload JSON and where to write the result.
"""

from __future__ import annotations

import json
import sys
import time


def run(spec: dict) -> dict:
    t_load = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams

    kwargs = {"model": spec["hf_model_dir"], "dtype": spec.get("dtype", "auto"), "seed": spec.get("seed", 0)}
    if spec.get("max_model_len"):
        kwargs["max_model_len"] = spec["max_model_len"]
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t_load
    ready = time.time()
    with open(spec["workload"]) as f:
        reqs = json.load(f)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    params = [SamplingParams(max_tokens=r["output_len"], ignore_eos=True, **spec["sampling"]) for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - t0
    return {
        "ready_time": ready,
        "load_s": load_s,
        "elapsed_s": elapsed,
        "num_requests": len(outs),
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
        "output_tokens": sum(len(c.token_ids) for o in outs for c in o.outputs),
        "vllm_version": vllm.__version__,
        "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
    }


if __name__ == "__main__":
    from peer_child import child_main  # this script's folder is first on sys.path

    sys.exit(child_main(sys.argv[1:], run))
