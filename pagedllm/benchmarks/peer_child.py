"""What the benchmark children share (worker.py, structured.py and the peers' vllm_worker.py,
structured_vllm_worker.py, llamacpp_worker.py): the entry point, and the timed runs that pagedllm's
child and vLLM's run alike through their `LLM.generate`.

The peers' children run under the peers' python, where pagedllm is not installed; each imports this
file from its own folder (a script's folder is first on sys.path). Standard library only.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from typing import Any


def child_main(argv: list, run: Callable[[dict], dict]) -> int:
    """Reads the spec named by argv[0], runs it, writes the result (or {"error": ...}) where the
    spec says; exit status 0 on success."""
    with open(argv[0]) as f:
        spec = json.load(f)
    try:
        result = run(spec)
    except BaseException as exc:  # noqa: BLE001 - any failure becomes the reported reason
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"}
    with open(spec["result"], "w") as f:
        json.dump(result, f)
    return 0 if "error" not in result else 1


def timed_generate(make_llm: Callable[[], Any], make_params: Callable[[int], Any],
                   workload: str, rounds: int = 1,
                   lora_for: Callable[[int], Any] | None = None) -> tuple[Any, dict[str, Any]]:
    """Loads the engine (`make_llm()`, its imports included), then generates the workload file's
    requests ({"prompt_token_ids", "output_len"}) with `make_params(output_len)` each, `rounds`
    times (the fastest kept; every round's seconds in "round_s"); `lora_for(i)`: request i's
    adapter (the engine's LoRARequest). Returns the engine and the throughput run's figures (load
    and generate times, request and token counts)."""
    t_load = time.perf_counter()
    llm = make_llm()
    load_s = time.perf_counter() - t_load
    ready = time.time()
    with open(workload) as f:
        reqs = json.load(f)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    params = [make_params(r["output_len"]) for r in reqs]
    extra = {"lora_request": [lora_for(i) for i in range(len(reqs))]} if lora_for is not None else {}
    round_s = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=True, **extra)
        round_s.append(time.perf_counter() - t0)
    result = {
        "ready_time": ready,
        "load_s": load_s,
        "elapsed_s": min(round_s),
        "num_requests": len(outs),
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
        "output_tokens": sum(len(c.token_ids) for o in outs for c in o.outputs),
    }
    if rounds > 1:
        result["round_s"] = round_s
    return llm, result


def constrained_then_free(llm: Any, workload: str, params: Callable[..., Any],
                          structure: Callable[..., Any]) -> dict[str, Any]:
    """`bench structured`'s runs on a loaded engine: the workload's constrained requests
    ({"prompt_token_ids", "max_tokens", "structured"}) once to warm up, then timed, then the same
    prompts unconstrained with ignore_eos and each reply's token count. `params` is the engine's
    SamplingParams, `structure` its StructuredOutputsParams."""
    with open(workload) as f:
        reqs = json.load(f)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]

    def constrained() -> list:
        return [params(max_tokens=r["max_tokens"], temperature=0.0, structured_outputs=structure(**r["structured"]))
                for r in reqs]

    llm.generate(prompts, constrained(), use_tqdm=False)  # warm-up: grammars compiled and cached
    t0 = time.perf_counter()
    outs = llm.generate(prompts, constrained(), use_tqdm=False)
    constrained_s = time.perf_counter() - t0
    counts = [len(o.outputs[0].token_ids) for o in outs]
    free = [params(max_tokens=n, temperature=0.0, ignore_eos=True) for n in counts]
    t0 = time.perf_counter()
    free_outs = llm.generate(prompts, free, use_tqdm=False)
    free_s = time.perf_counter() - t0
    return {"constrained_s": constrained_s, "unconstrained_s": free_s, "output_tokens": sum(counts),
            "unconstrained_output_tokens": sum(len(o.outputs[0].token_ids) for o in free_outs),
            "texts": [o.outputs[0].text for o in outs], "finish": [o.outputs[0].finish_reason for o in outs]}
