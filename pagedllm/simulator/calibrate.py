"""`pagedllm simulate calibrate`: measure this machine with the real engine, fit the cost model,
and (optionally) validate the simulator against the real engine on several configurations.

Calibration runs a few short workloads through the real LLMEngine, times every `step()` (the
whole step: schedule, forward, sample, update, detokenize) and computes the same StepFeatures the
simulated worker computes, from the same SchedulerOutputs (a SimWorker shadows the real one).
Time is the engine process's CPU time on one thread (torch and OpenMP), not wall time: the
machine this runs on is shared, and wall-clock step times of the same work varied 6x between
runs minutes apart, while CPU time of a single thread stays with the work done. With more than
one thread (`Setup.threads`, as a server runs on a multi-core host) CPU time counts every thread's
work and spin, so the clock is wall time instead, and the machine must be otherwise quiet.
A non-negative least-squares fit of step time gives the profile's rates. Its regressors are
[1, tokens, prefill pairs, decode context, sequences, sampled rows, 1 if the step computes prompt
tokens], with tokens and the prompt indicator split in two by the step's size: steps of at most
`small_step_tokens(dtype)` tokens (the small-M kernel's row limit, where a GEMM streams the weights
once for all its rows) and larger ones (oneDNN's blocked GEMMs) each get their own cost per token
and per prompt step. A step is stored as its 7 measured features (`StepFeatures.as_row`), so a
stored validation can be fitted again under a changed model (`refit_validation`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from pagedllm.simulator.hardware import HardwareProfile
from pagedllm.simulator.model import SimModel, model_from_checkpoint
from pagedllm.simulator.runner import RequestTimes
from pagedllm.simulator.trace import TraceRequest, prompt_token_ids, synthetic_trace
from pagedllm.simulator.worker import SimWorker

logger = logging.getLogger(__name__)

FIT_TERMS = ("step_s", "per_token_s", "per_prefill_pair_s", "per_decode_context_s", "per_seq_s", "per_sample_s",
             "prompt_step_s", "per_small_step_token_s", "small_prompt_step_s")


def small_step_tokens(dtype: str) -> int:
    """The most tokens a step may hold for its GEMMs to run the small-M kernel on this CPU in `dtype`
    (0 where the kernel does not run)."""
    import torch

    from pagedllm.layers.native_linear import small_m_rows

    return small_m_rows(getattr(torch, dtype))


def design(rows: list[list[float]], small_tokens: int) -> np.ndarray:
    """The fit's regressors (FIT_TERMS' order) from stored step features (StepFeatures.as_row):
    tokens and the prompt-step indicator go to the small-step columns in steps of at most
    `small_tokens` tokens."""
    x = np.asarray(rows, dtype=float).reshape(-1, 7)
    small = (x[:, 1] > 0) & (x[:, 1] <= small_tokens)
    big_tokens, small_tokens_col = np.where(small, 0.0, x[:, 1]), np.where(small, x[:, 1], 0.0)
    big_prompt, small_prompt = np.where(small, 0.0, x[:, 6]), np.where(small, x[:, 6], 0.0)
    return np.column_stack([x[:, 0], big_tokens, x[:, 2], x[:, 3], x[:, 4], x[:, 5], big_prompt, small_tokens_col,
                            small_prompt])


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every real run of a calibration shares: the engine's dtype and its threads."""

    dtype: str = "float32"
    threads: int = 1

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"calibration dtype must be float32, bfloat16 or float16, not {self.dtype!r}")
        if self.threads < 1:
            raise ValueError(f"calibration threads must be at least 1, not {self.threads}")

    def clock(self) -> float:
        """Seconds on the run's clock: CPU time on one thread, wall time on several."""
        return time.process_time() if self.threads == 1 else time.perf_counter()


@dataclasses.dataclass
class RealRun:
    requests: list[RequestTimes]
    elapsed_s: float
    steps: list[tuple[list[float], float]]  # (feature row, measured seconds)
    preemptions_by_mode: dict[str, int]
    num_kv_blocks: int


def run_real(model: str | None, engine_kwargs: dict[str, Any], trace: list[TraceRequest], seed: int = 0,
             setup: Setup = Setup()) -> RealRun:
    """Replays a trace through the real engine (`setup`'s threads and dtype); returns per-request
    times and steps, on `setup`'s clock (see the module docstring)."""
    import torch

    from pagedllm.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    torch.set_num_threads(setup.threads)
    llm = LLM(model, **{**engine_kwargs, "dtype": setup.dtype})
    eng = llm.llm_engine
    vocab = eng.model_config.vocab_size
    # Warm-up (first-call costs), then forget its prefix blocks.
    for j in range(2):
        eng.add_request(f"warm{j}", [100 + j] * 48, SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0))
    while eng.has_unfinished_requests():
        eng.step()
    eng.reset_prefix_cache()
    base_preempt = dict(eng.scheduler.num_preemptions_by_mode)

    shadow = SimWorker(eng.config.cache_config.block_size, check=True)
    captured: list[Any] = []
    original_schedule = eng.scheduler.schedule

    def schedule_and_capture():
        so = original_schedule()
        captured.append(so)
        return so

    eng.scheduler.schedule = schedule_and_capture  # type: ignore[method-assign]
    times = [RequestTimes(r.arrival_s, r.prompt_len, r.output_len) for r in trace]
    prompts = [prompt_token_ids(r, i, vocab, seed) for i, r in enumerate(trace)]
    steps: list[tuple[list[float], float]] = []
    i, n = 0, len(trace)
    # The engine's clock: its own CPU seconds on one thread (wall seconds on several). Arrivals are
    # replayed on this clock, so a one-thread run does not depend on what else the machine runs.
    clock = 0.0
    wall0 = time.perf_counter()
    while i < n or eng.has_unfinished_requests():
        while i < n and trace[i].arrival_s <= clock:
            r = trace[i]
            eng.add_request(str(i), {"prompt_token_ids": prompts[i]},
                            SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0))
            i += 1
        if not eng.has_unfinished_requests():
            clock = trace[i].arrival_s  # idle until the next arrival
            continue
        c0 = setup.clock()
        outputs = eng.step()
        dt = setup.clock() - c0
        clock += dt
        so = captured.pop()
        _, feats = shadow.execute_model(so)
        if not so.is_empty:
            steps.append((feats.as_row(), dt))
        for out in outputs:
            rt = times[int(out.request_id)]
            if rt.first_token_s < 0 and out.outputs and out.outputs[0].token_ids:
                rt.first_token_s = clock
            if out.finished:
                rt.finish_s = clock
    elapsed = clock
    logger.info("real run: %.1f engine clock seconds in %.1f s wall", clock, time.perf_counter() - wall0)
    eng.scheduler.schedule = original_schedule  # type: ignore[method-assign]
    preempt = {k: v - base_preempt.get(k, 0) for k, v in eng.scheduler.num_preemptions_by_mode.items()}
    return RealRun(times, elapsed, steps, preempt, eng.num_blocks)


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (drops the most negative term until none is)."""
    active = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (coef >= 0).all() or not active:
            out = np.zeros(x.shape[1])
            out[active] = coef
            return out
        del active[int(np.argmin(coef))]


def fit_profile(model: SimModel, rows: list[list[float]], seconds: list[float], swap_bw: float,
                memory_bytes: int, name: str, small_tokens: int = 0) -> tuple[HardwareProfile, dict[str, Any]]:
    """Profile rates from the fitted coefficients (seconds per regressor); steps of at most
    `small_tokens` tokens get their own per-token and prompt-step costs (0: one cost for all). Where
    the fit gives small steps' tokens no cost, they are fitted again at the larger steps' rate."""
    x, y = design(rows, small_tokens), np.asarray(seconds, dtype=float)
    c = nnls(x, y)
    if small_tokens and c[7] <= 0:
        # The fit gives small steps' tokens no cost of their own: they take the larger steps' rate
        # (small_step_gemm_flops None); small steps keep their own prompt-step cost.
        x[:, 1] += x[:, 7]
        x[:, 7] = 0.0
        c = nnls(x, y)
    pred = x @ c
    step, per_tok, per_pair, per_ctx, per_seq, per_sample, prompt_step, per_small_tok, small_prompt = map(float, c)
    if per_tok <= 0:
        raise RuntimeError("calibration found no per-token cost: the calibration runs were too small")
    gemm_flops = model.flops_per_token / per_tok
    profile = HardwareProfile(
        name=name,
        gemm_flops=gemm_flops,
        attn_flops=model.attention_flops_per_pair / per_pair if per_pair > 0 else None,
        kv_read_bw=model.kv_bytes_per_token / per_ctx if per_ctx > 0 else None,
        weight_read_bw=None,
        step_overhead_s=step,
        per_seq_s=per_seq,
        per_sample_s=max(0.0, per_sample - model.lm_head_flops / gemm_flops),
        prompt_step_s=prompt_step,
        small_step_tokens=small_tokens,
        small_step_gemm_flops=model.flops_per_token / per_small_tok if small_tokens and per_small_tok > 0 else None,
        small_prompt_step_s=small_prompt,
        swap_bw=swap_bw,
        copy_bw=swap_bw,
        memory_bytes=memory_bytes,
        memory_utilization=0.3,
        source={"calibrated_on": model.name, "coefficients": dict(zip(FIT_TERMS, map(float, c))),
                "num_steps": len(y), "note": "weight streaming is folded into step_overhead_s"},
    )
    fit = {
        "coefficients": dict(zip(FIT_TERMS, map(float, c))),
        "num_steps": len(y),
        "total_measured_s": float(y.sum()),
        "total_predicted_s": float(pred.sum()),
        "mean_abs_rel_err": float(np.mean(np.abs(pred - y) / y)),
    }
    return profile, fit


CALIBRATION_WORKLOADS = [
    # (engine kwargs, trace): chunked prefill mixed with decodes, then long contexts, then steps as
    # large as a server's (2048-token prompt steps, decode batches up to 32 rows): where a step's cost
    # per token falls with its size (bf16 GEMMs on AMX tiles), a fit on small steps alone overprices
    # large ones.
    ({"max_num_batched_tokens": 256}, dict(num_requests=8, prompt_lens="16:200", output_lens="4:24")),
    ({"max_num_batched_tokens": 128}, dict(num_requests=3, prompt_lens="400:600", output_lens="4:8")),
    ({"max_num_batched_tokens": 2048, "num_kv_blocks": 2048},
     dict(num_requests=32, prompt_lens="64:640", output_lens="16:64")),
]


def _calibration_workloads(quick: bool) -> list[tuple[dict[str, Any], list[TraceRequest]]]:
    out = []
    for j, (kw, tr) in enumerate(CALIBRATION_WORKLOADS):
        tr = dict(tr)
        if quick:
            tr["num_requests"] = max(2, tr["num_requests"] // 2)
        out.append(({"block_size": 16, "num_kv_blocks": 512, "preemption_mode": "swap",
                     "swap_space": 0.25, **kw},
                    synthetic_trace(rate=math.inf, seed=100 + j, **tr)))
    return out


def calibration_steps(model: str | None, quick: bool = False,
                      setup: Setup = Setup()) -> list[tuple[list[float], float]]:
    """(regressors, measured seconds) of every step of the calibration workloads."""
    steps: list[tuple[list[float], float]] = []
    for kw, trace in _calibration_workloads(quick):
        steps += run_real(model, kw, trace, setup=setup).steps
    return steps


def measure_swap_bw(model: str | None, setup: Setup = Setup()) -> float:
    """Bytes/s of the engine's own block moves out to the host pool and back."""
    from pagedllm.llm import LLM

    llm = LLM(model, num_kv_blocks=64, preemption_mode="swap", swap_space=0.05, dtype=setup.dtype)
    return llm.llm_engine.executor.measure_preemption_rates()[1]


def profile_from_steps(model: str | None, steps: list[tuple[list[float], float]], swap_bw: float,
                       setup: Setup = Setup(), small_tokens: int = 0) -> tuple[HardwareProfile, dict[str, Any]]:
    import os
    import platform

    import psutil

    sim_model = model_from_checkpoint(model, setup.dtype)
    name = f"cpu-{platform.node() or 'host'}-{psutil.cpu_count()}cores"
    profile, fit = fit_profile(sim_model, [r for r, _ in steps], [s for _, s in steps], swap_bw,
                               psutil.virtual_memory().total, name, small_tokens)
    source = {**profile.source, "swap_copy_bytes_per_s": swap_bw, "load_average": list(os.getloadavg()),
              "dtype": setup.dtype, "threads": setup.threads}
    return dataclasses.replace(profile, source=source), fit


def calibrate(model: str | None, quick: bool = False, setup: Setup = Setup()) -> tuple[HardwareProfile, dict[str, Any]]:
    return profile_from_steps(model, calibration_steps(model, quick, setup), measure_swap_bw(model, setup), setup,
                              small_step_tokens(setup.dtype))


# ---- validation -------------------------------------------------------------------------------
VALIDATION_BASE = {"block_size": 16, "max_num_batched_tokens": 2048, "scheduling_policy": "fcfs",
                   "preemption_mode": "recompute", "enable_prefix_caching": True, "num_kv_blocks": 512,
                   "swap_space": 0.25}  # the dtype is the calibration's (Setup)
VALIDATION_CONFIGS = [
    ("base (budget 2048, fcfs, bs16, prefix on)", {}),
    ("budget 64", {"max_num_batched_tokens": 64}),
    ("srtf", {"scheduling_policy": "srtf"}),
    ("block size 32", {"block_size": 32, "num_kv_blocks": 256}),
    ("small KV, recompute", {"num_kv_blocks": 20}),
    ("small KV, swap", {"num_kv_blocks": 20, "preemption_mode": "swap"}),
    ("prefix caching off", {"enable_prefix_caching": False}),
]


# Held out: a larger workload than any above (decode batches up to 48 rows, 2048-token prompt
# steps), offline and at a Poisson rate; its steps are in no fit (neither the leave-one-out fits
# nor the profile written), so it is simulated with the written profile.
HELD_OUT_ARGS = {**VALIDATION_BASE, "num_kv_blocks": 2048}


def validation_trace(mode: str, quick: bool) -> list[TraceRequest]:
    n = 6 if quick else 8
    rate = math.inf if mode == "offline" else 0.5
    return synthetic_trace(n, rate, "16:96", "4:16", seed=7, num_prefixes=2, prefix_len=32)


def held_out_trace(mode: str, quick: bool) -> list[TraceRequest]:
    rate = math.inf if mode == "offline" else 0.5
    return synthetic_trace(12 if quick else 48, rate, "uniform:32:512", "uniform:16:256", seed=11)


def simulate_like(engine_kwargs: dict[str, Any], profile: HardwareProfile, sim_model: SimModel,
                  trace: list[TraceRequest], num_kv_blocks: int) -> dict[str, Any]:
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.simulator.runner import run_one

    ea = EngineArgs(**{**engine_kwargs, "num_kv_blocks": num_kv_blocks})
    return run_one(ea, sim_model, profile, trace, 1, 1, True, 2.0, 0.1)


def real_validation_runs(model: str | None, quick: bool = False, setup: Setup = Setup()) -> list[dict[str, Any]]:
    """Every validation configuration and the held-out workload through the real engine, offline
    and at a Poisson rate."""
    from pagedllm.simulator.report import summarize

    plan = [(name, mode, {**VALIDATION_BASE, **kw}, validation_trace(mode, quick), False)
            for mode in ("offline", "poisson") for name, kw in VALIDATION_CONFIGS]
    for mode in ("offline", "poisson"):
        trace = held_out_trace(mode, quick)
        plan.append((f"held out: {len(trace)} requests, prompts 32-512, outputs 16-256", mode, HELD_OUT_ARGS,
                     trace, True))
    runs = []
    for name, mode, kwargs, trace, held_out in plan:
        run = run_real(model, kwargs, trace, setup=setup)
        runs.append({"name": name, "mode": mode, "engine_args": {**kwargs, "dtype": setup.dtype}, "trace": trace, "run": run,
                     "held_out": held_out, "summary": summarize(run.requests, run.elapsed_s, 2.0, 0.1)})
        logger.info("real %s %s: %.1f s", name, mode, run.elapsed_s)
    return runs


def fitted_steps(calibration: list[tuple[list[float], float]], runs: list[dict[str, Any]],
                 leave_out: int = -1) -> list[tuple[list[float], float]]:
    """The steps a profile is fitted on: the calibration workloads' and those of every validation
    run but the held-out ones and run `leave_out`."""
    return list(calibration) + [st for j, o in enumerate(runs) if j != leave_out and not o["held_out"]
                                for st in o["run"].steps]


def validate(model: str | None, runs: list[dict[str, Any]], calibration: list[tuple[list[float], float]],
             swap_bw: float, setup: Setup = Setup(), small_tokens: int = 0) -> list[dict[str, Any]]:
    """Simulator vs real engine per run. Each run is simulated with a profile fitted on the steps
    of the calibration workloads and of every *other* run (leave one out), never its own; the
    held-out runs' steps are in no fit."""
    sim_model = model_from_checkpoint(model, setup.dtype)
    keys = ("elapsed_s", "output_tok_s", "mean_ttft_s", "p99_ttft_s", "mean_tpot_s")
    rows = []
    for i, r in enumerate(runs):
        profile, _ = profile_from_steps(model, fitted_steps(calibration, runs, i), swap_bw, setup, small_tokens)
        sim = simulate_like(r["engine_args"], profile, sim_model, r["trace"], r["run"].num_kv_blocks)
        real = r["summary"]
        row = {
            "name": r["name"], "mode": r["mode"], "held_out": r["held_out"], "engine_args": r["engine_args"],
            "real": {k: real[k] for k in keys} | {"preemptions_by_mode": r["run"].preemptions_by_mode,
                                                   "num_steps": len(r["run"].steps)},
            "sim": {k: sim[k] for k in keys} | {"preemptions_by_mode": sim["preemptions_by_mode"],
                                                 "num_steps": sim["num_steps"]},
        }
        row["tput_err"] = row["sim"]["output_tok_s"] / row["real"]["output_tok_s"] - 1
        row["ttft_err"] = row["sim"]["mean_ttft_s"] / row["real"]["mean_ttft_s"] - 1
        logger.info("%s %s: throughput %+.1f%%, mean TTFT %+.1f%%", r["name"], r["mode"], 100 * row["tput_err"],
                    100 * row["ttft_err"])
        rows.append(row)
    return rows


def steps_file_path(steps_file: str, validation_path: str) -> Path:
    """Where the `steps_file` named by the validation JSON at `validation_path` is. An absolute path
    is used as given, as is a relative one that exists from the current directory; otherwise a
    relative path is taken from the validation file's folder or, failing that, from the nearest
    folder above it that holds it (a path from the repository root, as the committed validations
    name theirs, so they can be refit from any directory). ValueError names the path given and the
    one resolved against the validation file's folder when no such file exists."""
    given = Path(steps_file)
    if given.exists():
        return given
    if given.is_absolute():
        raise ValueError(f"{validation_path} names steps_file {steps_file!r}, which does not exist")
    folder = Path(validation_path).resolve().parent
    for base in (folder, *folder.parents):
        if (base / given).exists():
            return base / given
    raise ValueError(f"{validation_path} names steps_file {steps_file!r}: neither {given.resolve()} nor "
                     f"{folder / given} exists (nor does it under a folder above {folder})")


def load_validation(path: str) -> dict[str, Any]:
    """A validation JSON of `simulate calibrate --validate` (or of --refit, whose measured steps are
    read from the file it names in `steps_file`, found by `steps_file_path`; `steps_file` itself is
    kept as stored); ValueError names what is missing."""
    stored = json.loads(Path(path).read_text(encoding="utf-8"))
    if "steps_file" in stored:
        steps = json.loads(steps_file_path(stored["steps_file"], path).read_text(encoding="utf-8"))
        stored |= {k: steps[k] for k in ("calibration_steps", "validation_steps") if k in steps}
    for key in ("profile", "rows", "calibration_steps", "validation_steps"):
        if key not in stored:
            raise ValueError(f"{path} has no {key!r}: not a validation JSON of `simulate calibrate --validate`")
    return stored


def stored_runs(stored: dict[str, Any]) -> tuple[list[tuple[list[float], float]], list[dict[str, Any]]]:
    """The calibration steps and the real validation runs of a validation JSON that
    `pagedllm simulate calibrate --validate` wrote: each run's measured steps and real summary as
    recorded, its trace made again from the same seeds."""
    for i, row in enumerate(stored["rows"]):
        missing = [k for k in ("name", "mode", "held_out", "engine_args", "real") if k not in row]
        if missing:
            raise ValueError(f"validation row {i} has no {', '.join(map(repr, missing))}: written by an older "
                             "`simulate calibrate --validate`, it cannot be fitted again")
    quick = "--quick" in str(stored.get("meta", {}).get("command", ""))
    steps_by_run = {(v["name"], v["mode"]): v["steps"] for v in stored["validation_steps"]}
    calibration = [(list(r), float(t)) for r, t in stored["calibration_steps"]]
    runs = []
    for row in stored["rows"]:
        mode = row["mode"]
        trace = held_out_trace(mode, quick) if row["held_out"] else validation_trace(mode, quick)
        real = row["real"]
        run = RealRun([], real["elapsed_s"], [(list(r), float(t)) for r, t in steps_by_run[(row["name"], mode)]],
                      dict(real.get("preemptions_by_mode", {})), int(row["engine_args"]["num_kv_blocks"]))
        runs.append({"name": row["name"], "mode": mode, "engine_args": row["engine_args"], "trace": trace,
                     "run": run, "held_out": row["held_out"], "summary": real})
    return calibration, runs


def refit_validation(stored: dict[str, Any], model: str | None = None,
                     small_tokens: int | None = None) -> tuple[HardwareProfile, dict[str, Any], list[dict[str, Any]]]:
    """A stored validation fitted and simulated again under this cost model, without the engine:
    the profile fitted on its steps (held-out ones excluded) and the rows of `validate`.
    `small_tokens` defaults to the stored profile's `small_step_tokens`."""
    source = stored["profile"].get("source", {})
    setup = Setup(source.get("dtype", "float32"), int(source.get("threads", 1)))
    if small_tokens is None:
        small_tokens = int(stored["profile"].get("small_step_tokens", 0))
    if small_tokens < 0:
        raise ValueError(f"small_step_tokens must be non-negative, got {small_tokens}")
    swap_bw = float(source.get("swap_copy_bytes_per_s") or stored["profile"]["swap_bw"])
    calibration, runs = stored_runs(stored)
    profile, fit = profile_from_steps(model, fitted_steps(calibration, runs), swap_bw, setup, small_tokens)
    profile = dataclasses.replace(profile, name=stored["profile"].get("name", profile.name),
                                  source={**profile.source, "load_average": source.get("load_average"),
                                          "refit_of": stored.get("meta", {})})
    rows = validate(model, runs, calibration, swap_bw, setup, small_tokens)
    return profile, fit, rows
