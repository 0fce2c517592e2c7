"""Runs a throughput workload on vLLM's CPU build; executed by `.venv-peers/bin/python` as a script.

Standalone on purpose: it imports only the standard library and vllm, since pagedllm is not
installed in the peers' virtual environment. usage: vllm_worker.py SPEC.json
The spec names the Hugging Face model folder, the workload JSON and where to write the result;
with "lora" ({"paths": [...], "max_lora_rank": R}) request i runs with adapter i mod N (PEFT
folders, N = max_loras), "rounds" repeats the generate call (the fastest kept), and
"enable_prefix_caching" (where given) sets vLLM's prefix caching.
"""

from __future__ import annotations

import sys


def run(spec: dict) -> dict:
    from peer_child import timed_generate  # this script's folder is first on sys.path

    def make_llm():
        from vllm import LLM

        kwargs = {"model": spec["hf_model_dir"], "dtype": spec.get("dtype", "auto"), "seed": spec.get("seed", 0)}
        if spec.get("max_model_len"):
            kwargs["max_model_len"] = spec["max_model_len"]
        if lora:
            kwargs.update(enable_lora=True, max_loras=len(lora["paths"]), max_lora_rank=lora["max_lora_rank"])
        if spec.get("enable_prefix_caching") is not None:
            kwargs["enable_prefix_caching"] = spec["enable_prefix_caching"]
        return LLM(**kwargs)

    lora = spec.get("lora")

    def lora_for(i: int):
        from vllm.lora.request import LoRARequest

        k = i % len(lora["paths"])
        return LoRARequest(f"a{k}", k + 1, lora["paths"][k])

    def make_params(output_len: int):
        from vllm import SamplingParams

        return SamplingParams(max_tokens=output_len, ignore_eos=True, detokenize=spec.get("detokenize", True),
                              **spec["sampling"])

    llm, result = timed_generate(make_llm, make_params, spec["workload"], spec.get("rounds", 1),
                                 lora_for if lora else None)
    import vllm

    return {**result, "vllm_version": vllm.__version__,
            "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch.")}


if __name__ == "__main__":
    from peer_child import child_main

    sys.exit(child_main(sys.argv[1:], run))
