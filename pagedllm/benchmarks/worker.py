"""Child process of `pagedllm bench throughput` for the pagedllm and hf backends (and of `bench
scale`'s one-prompt measurements: the `latency` backend).

`python -m pagedllm.benchmarks.worker SPEC.json` loads the model, runs the workload named in the
spec, and writes a result JSON (or {"error": ...}). Each backend runs in a fresh process so that
its start-up time and peak RSS are its own.
"""

from __future__ import annotations

import json
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from pagedllm.benchmarks.peer_child import timed_generate
from pagedllm.benchmarks.workloads import BenchRequest


def _load_workload(path: str) -> list[BenchRequest]:
    return [BenchRequest(r["prompt_token_ids"], r["output_len"]) for r in json.loads(Path(path).read_text())]


def run_pagedllm(spec: dict[str, Any]) -> dict[str, Any]:
    def make_llm() -> Any:
        from pagedllm.llm import LLM

        return LLM(spec.get("model"), **spec.get("engine_args", {}))

    def make_params(output_len: int) -> Any:
        from pagedllm.sampling_params import SamplingParams

        return SamplingParams(max_tokens=output_len, ignore_eos=True, detokenize=spec.get("detokenize", True),
                              **spec["sampling"])

    llm, result = timed_generate(make_llm, make_params, spec["workload"])
    return {**result, "num_kv_blocks": llm.llm_engine.num_blocks, "dtype": llm.llm_engine.model_config.dtype}


def _hf_sampling(sampling: dict[str, Any]) -> dict[str, Any]:
    """generate() arguments for the run's sampling settings: greedy at temperature 0, else sampling
    with exactly these (top_k 0 and top_p 1.0 switch HF's own defaults off)."""
    if sampling["temperature"] == 0.0:
        return {"do_sample": False}
    return {"do_sample": True, **sampling}


def _hf_batches(model, reqs: list[BenchRequest], batch_size: int, pad_id: int, bar: tqdm,
                sampling: dict[str, Any]) -> tuple[float, int, int]:
    """Runs `reqs` in order in static, left-padded batches; each batch generates exactly its
    longest requested output. Returns (seconds, requested output tokens, generated tokens)."""
    import torch

    elapsed, requested, generated = 0.0, 0, 0
    for start in range(0, len(reqs), batch_size):
        batch = reqs[start : start + batch_size]
        width = max(r.prompt_len for r in batch)
        new = max(r.output_len for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - r.prompt_len :] = torch.tensor(r.prompt_token_ids)
            mask[i, width - r.prompt_len :] = 1
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 pad_token_id=pad_id, **_hf_sampling(sampling))
        elapsed += time.perf_counter() - t0
        assert out.shape[1] - width == new, "HF generate stopped before min_new_tokens"
        requested += sum(r.output_len for r in batch)
        generated += len(batch) * new
        bar.update(len(batch))
    return elapsed, requested, generated


def run_hf(spec: dict[str, Any]) -> dict[str, Any]:
    t_load = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = spec["hf_model_dir"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, spec.get("dtype", "float32")),
                                                 local_files_only=True)
    model.eval()
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    pad_id = int(pad_id if pad_id is not None else 0)
    with torch.inference_mode():  # warm-up: one token for one prompt
        model.generate(input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=1, do_sample=False, pad_token_id=pad_id)
    load_s = time.perf_counter() - t_load
    ready = time.time()

    reqs = _load_workload(spec["workload"])
    sizes = sorted(set(spec.get("hf_batch_sizes") or [8, 16, 32]))
    # The probe is the first K requests, K a multiple of every candidate size, so that the probe's
    # batches at the chosen size are exactly the first batches of a full run at that size and
    # are reused: the full run only adds the remaining requests.
    k = min(len(reqs), spec.get("hf_probe_prompts") or math.lcm(*sizes))
    probe, rest = reqs[:k], reqs[k:]
    bar = tqdm(total=len(probe) * len(sizes) + len(rest), desc="HF generate (probe + rest)", dynamic_ncols=True)
    trials = []
    for b in sizes:
        secs, requested, generated = _hf_batches(model, probe, b, pad_id, bar, spec["sampling"])
        trials.append({"batch_size": b, "num_requests": len(probe), "elapsed_s": secs,
                       "output_tokens": requested, "generated_tokens": generated,
                       "output_tokens_per_s": requested / secs})
    best = max(trials, key=lambda t: t["output_tokens_per_s"])
    secs, requested, generated = (_hf_batches(model, rest, best["batch_size"], pad_id, bar, spec["sampling"])
                                  if rest else (0.0, 0, 0))
    bar.close()
    return {
        "ready_time": ready,
        "load_s": load_s,
        "elapsed_s": best["elapsed_s"] + secs,
        "num_requests": len(reqs),
        "prompt_tokens": sum(r.prompt_len for r in reqs),
        "output_tokens": best["output_tokens"] + requested,
        "generated_tokens": best["generated_tokens"] + generated,
        "best_batch_size": best["batch_size"],
        "batch_probe": trials,
        "probe_requests": k,
        "measured_s": sum(t["elapsed_s"] for t in trials) + secs,
    }


def run_latency_child(spec: dict[str, Any]) -> dict[str, Any]:
    """`bench latency`'s measurement of one engine (pagedllm or hf) on one prompt (`bench scale`)."""
    from pagedllm.benchmarks.latency import run_hf_latency, run_latency

    n = (spec["input_len"], spec["output_len"], spec["num_iters"], spec["num_warmup"])
    if spec["engine"] == "hf":
        return run_hf_latency(spec["model"], spec["engine_kwargs"]["dtype"], *n, spec["seed"])
    return run_latency(spec["model"], spec["engine_kwargs"], *n, seed=spec["seed"])


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    try:
        result = {"pagedllm": run_pagedllm, "hf": run_hf, "latency": run_latency_child}[spec["backend"]](spec)
    except Exception as exc:  # reported by the parent as the reason this backend has no numbers
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"}
    Path(spec["result"]).write_text(json.dumps(result))
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
