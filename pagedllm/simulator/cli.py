"""`pagedllm simulate` and `pagedllm simulate calibrate`: flags, the run, printing."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_PROFILE = "h100"


class SimulateError(ValueError):
    """A bad simulate argument; the message names the value."""


def add_simulate_parser(sub: Any) -> None:
    from pagedllm.engine.arg_utils import EngineArgs

    p = sub.add_parser("simulate", allow_abbrev=False, help="what-if simulation on the real scheduler with a cost model",
                       description="Drives pagedllm's own scheduler, KV cache manager and policies with a "
                                   "simulated worker whose step times come from a cost model.")
    m = p.add_argument_group("simulated model and hardware")
    m.add_argument("--model-config", default=None,
                   help="model shape: JSON file (layers, hidden, heads, kv_heads, intermediate, vocab, dtype_bytes) "
                        "or llama3-8b, llama3-70b, smollm2-135m (default: the shape of --model)")
    m.add_argument("--profile", default=DEFAULT_PROFILE,
                   help="hardware: a100, h100, h200 or a profile JSON from `pagedllm simulate calibrate`")
    engine_fields = {f.name for f in dataclasses.fields(EngineArgs)}
    if "tensor_parallel_size" not in engine_fields:
        m.add_argument("--tensor-parallel-size", "-tp", dest="tensor_parallel_size", type=int, default=1)
    if "pipeline_parallel_size" not in engine_fields:
        m.add_argument("--pipeline-parallel-size", "-pp", dest="pipeline_parallel_size", type=int, default=1)
    w = p.add_argument_group("workload")
    w.add_argument("--trace", default=None, help="JSON-lines trace: arrival_s, prompt_len, output_len "
                                                 "[priority, user, prefix_id, prefix_len]")
    w.add_argument("--num-requests", type=int, default=1000, help="synthetic: requests")
    w.add_argument("--request-rate", type=float, default=math.inf, help="synthetic: requests/s (inf: all at 0)")
    w.add_argument("--arrival", choices=("poisson", "bursty"), default="poisson", help="synthetic arrivals")
    w.add_argument("--burst-factor", type=float, default=4.0, help="bursty: squared coefficient of variation")
    w.add_argument("--prompt-lens", default="uniform:32:1024",
                   help="synthetic prompt lengths: N, LO:HI, uniform:LO:HI, lognormal:MEAN:SIGMA[:MAX]")
    w.add_argument("--output-lens", default="uniform:16:512", help="synthetic output lengths (same forms)")
    w.add_argument("--num-users", type=int, default=0, help="synthetic: users drawn at random (fair policy)")
    w.add_argument("--num-prefixes", type=int, default=0, help="synthetic: shared prefixes")
    w.add_argument("--prefix-len", type=int, default=0, help="synthetic: tokens per shared prefix")
    w.add_argument("--trace-seed", type=int, default=0, help="synthetic: seed")
    w.add_argument("--save-trace", default=None, help="write the (synthetic) trace as JSON lines")
    o = p.add_argument_group("output")
    o.add_argument("--slo-ttft", type=float, default=2.0, help="goodput SLO on TTFT (s)")
    o.add_argument("--slo-tpot", type=float, default=0.1, help="goodput SLO on TPOT (s)")
    o.add_argument("--output-json", default=None, help="write the results as JSON")
    o.add_argument("--plot", default=None, help="write a PNG: KV usage, queues, latency CDFs (or the sweep)")
    o.add_argument("--sweep", nargs="+", default=None, metavar="FIELD=V1,V2",
                   help="grid over engine fields, e.g. block_size=8,16,32,64 max_num_batched_tokens=512,2048")
    o.add_argument("--ui", action="store_true",
                   help="then replay the run in the web page's engine view (KV blocks, queues, budget) at --ui-port")
    o.add_argument("--ui-port", type=int, default=8000, help="--ui: the page's port on 127.0.0.1")
    o.add_argument("--ui-speed", type=float, default=1.0, help="--ui: simulated seconds replayed per second")
    o.add_argument("--check-integrity", action="store_true",
                   help="run the scheduler's and the worker's integrity checks after every step")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=cmd_simulate)

    subs = p.add_subparsers(dest="simulate_command", metavar="{calibrate}")
    c = subs.add_parser("calibrate", help="measure this machine with the real engine; write a profile JSON")
    c.add_argument("--model", default=None, help="model the real engine runs (default: the embedded default)")
    c.add_argument("--output", default=None,
                   help="profile JSON to write (default benchmarks/results/sim/profile-cpu.json; with --refit, "
                        "written only where given)")
    c.add_argument("--validate", default=None, metavar="JSON",
                   help="then run the validation configurations (real engine vs simulator) and write them here")
    c.add_argument("--quick", action="store_true", help="smaller calibration and validation workloads")
    c.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="the real engine's dtype in every run (the simulated model's KV and weights follow it)")
    c.add_argument("--threads", type=int, default=1,
                   help="the engine's threads; 1 times steps in CPU seconds (robust on a shared machine), more "
                        "in wall seconds (as a server runs them; the machine must be otherwise quiet)")
    c.add_argument("--refit", default=None, metavar="JSON",
                   help="run no engine: fit and validate again from a validation JSON written by --validate "
                        "(its measured steps and real runs) under this version's cost model")
    c.add_argument("--small-step-tokens", type=int, default=None, metavar="N",
                   help="steps of at most N tokens get their own cost per token and per prompt step (default: "
                        "the small-M kernel's row limit for the dtype on this CPU; with --refit, the stored "
                        "profile's; 0: one cost for all steps)")
    c.set_defaults(func=cmd_calibrate)


def _parse_sweep(items: list[str]) -> list[tuple[str, list[Any]]]:
    from pagedllm.engine.arg_utils import EngineArgs

    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    extra = {"tensor_parallel_size": int, "pipeline_parallel_size": int}
    grid = []
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not values:
            raise SimulateError(f"--sweep item {item!r}: expected FIELD=V1,V2,...")
        if key in fields:
            f = fields[key]
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
            cast = f.metadata.get("parse") or (type(default) if default is not None else str)
            if isinstance(default, bool):
                cast = lambda s: s.lower() in ("1", "true", "on", "yes")  # noqa: E731
        elif key in extra:
            cast = extra[key]
        else:
            raise SimulateError(f"--sweep field {key!r} is not an engine flag (e.g. block_size, "
                                "max_num_batched_tokens, scheduling_policy, preemption_mode)")
        try:
            grid.append((key, [cast(v.strip()) for v in values.split(",") if v.strip()]))
        except (TypeError, ValueError):
            raise SimulateError(f"--sweep {item!r}: cannot read the values as {key}") from None
    return grid


def build_trace(args: argparse.Namespace):
    from pagedllm.simulator.trace import load_trace, synthetic_trace, write_trace

    if args.trace:
        trace = load_trace(args.trace)
    else:
        trace = synthetic_trace(args.num_requests, args.request_rate, args.prompt_lens, args.output_lens,
                                args.arrival, args.burst_factor, args.trace_seed, args.num_users,
                                args.num_prefixes, args.prefix_len)
    if args.save_trace:
        write_trace(trace, args.save_trace)
    return trace


def _print_summary(rep: dict[str, Any], label: str = "") -> None:
    pm = rep["preemptions_by_mode"]
    print(f"{label}{rep['num_finished']}/{rep['num_requests']} requests in {rep['elapsed_s']:.2f} simulated s "
          f"({rep['num_steps']} steps, {rep['wall_s']:.2f} s wall, {rep['sim_requests_per_wall_s']:.0f} req/wall-s)")
    print(f"  throughput {rep['output_tok_s']:.1f} output tok/s, {rep['total_tok_s']:.1f} total tok/s, "
          f"goodput {rep['goodput_requests_s']:.2f} req/s ({100 * rep['slo_attainment']:.0f}% within SLOs)")
    for k in ("ttft", "tpot", "e2e"):
        print(f"  {k.upper():4s} mean {rep[f'mean_{k}_s'] * 1e3:9.1f} ms  p50 {rep[f'p50_{k}_s'] * 1e3:9.1f}  "
              f"p90 {rep[f'p90_{k}_s'] * 1e3:9.1f}  p99 {rep[f'p99_{k}_s'] * 1e3:9.1f}")
    print(f"  KV {rep['num_kv_blocks']} blocks, mean usage {100 * rep['mean_kv_usage']:.0f}%, max waiting "
          f"{rep['max_waiting']}, preemptions recompute {pm['recompute']} swap {pm['swap']}, prefix hits "
          f"{100 * rep['prefix_hit_rate']:.0f}%")


def _load_model(args: argparse.Namespace, ea: Any):
    from pagedllm.simulator.model import load_model_config, model_from_checkpoint

    if args.model_config:
        return load_model_config(args.model_config)
    return model_from_checkpoint(ea.model, ea.dtype)


def cmd_simulate(args: argparse.Namespace) -> int:
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.simulator.hardware import load_profile
    from pagedllm.simulator.report import plot_run, plot_sweep
    from pagedllm.simulator.runner import run_one

    if getattr(args, "simulate_command", None):
        return args.func(args)
    ea = EngineArgs.from_cli_args(args)
    model = _load_model(args, ea)
    profile = load_profile(args.profile)
    trace = build_trace(args)
    tp, pp = int(args.tensor_parallel_size), int(args.pipeline_parallel_size)
    common = dict(model=model, profile=profile, trace=trace, check=args.check_integrity,
                  slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot)
    meta = {"model": model.to_dict(), "profile": profile.name, "num_trace_requests": len(trace),
            "tensor_parallel_size": tp, "pipeline_parallel_size": pp}
    ui = getattr(args, "ui", False)
    if ui and args.sweep:
        raise SimulateError("--ui replays one run: it cannot go with --sweep")
    if ui and not args.ui_speed > 0:
        raise SimulateError(f"--ui-speed must be positive, got {args.ui_speed}")
    if not args.sweep:
        recorder = None
        if ui:
            from pagedllm.simulator.recording import SnapshotRecorder

            recorder = SnapshotRecorder()
        rep = run_one(ea, tp=tp, pp=pp, on_step=recorder.on_step if recorder else None, **common)
        _print_summary(rep)
        out = {**rep, **meta, "engine_args": _engine_args_json(ea)}
        if args.plot:
            plot_run(rep, args.plot, f"{model.name} on {tp * pp} x {profile.name}")
        _write_json(out, args.output_json)
        if recorder is not None:  # the web page lives above this package: the CLI hands its replay in
            recorder.hello["model"] = f"{model.name} on {tp * pp} x {profile.name} (simulated)"
            return int(args.ui_replay(recorder, args) or 0)
        return 0
    grid = _parse_sweep(args.sweep)
    keys = [k for k, _ in grid]
    rows = []
    for values in itertools.product(*(v for _, v in grid)):
        params = dict(zip(keys, values))
        point = dataclasses.replace(ea, **{k: v for k, v in params.items() if hasattr(ea, k)})
        rep = run_one(point, tp=params.get("tensor_parallel_size", tp), pp=params.get("pipeline_parallel_size", pp),
                      **common)
        _print_summary(rep, label=" ".join(f"{k}={v}" for k, v in params.items()) + ": ")
        rep.pop("timeline")
        rep.pop("per_request")
        rows.append({"params": params, "summary": rep})
    if args.plot:
        plot_sweep(rows, keys, args.plot, f"{model.name} on {tp * pp} x {profile.name}: sweep")
    best = max(rows, key=lambda r: r["summary"]["output_tok_s"])
    out = {**{k: best["summary"][k] for k in ("elapsed_s", "output_tok_s", "mean_ttft_s", "p99_ttft_s",
                                              "mean_tpot_s")},
           "best_params": best["params"], "sweep": rows, **meta, "engine_args": _engine_args_json(ea)}
    _write_json(out, args.output_json)
    return 0


def _engine_args_json(ea: Any) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(ea).items() if isinstance(v, (int, float, str, bool, dict, type(None)))}


def _write_json(report: dict[str, Any], path: str | None) -> None:
    if path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(report, indent=1, default=float) + "\n", encoding="utf-8")
        print(f"results written to {p}", file=sys.stderr)


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Calibration runs, then (with --validate) the validation runs in the same process, so that
    both see the same machine load; the profile is fitted on every step measured but the held-out
    workload's."""
    from pagedllm.simulator.calibrate import (
        Setup,
        calibration_steps,
        fitted_steps,
        measure_swap_bw,
        profile_from_steps,
        real_validation_runs,
        small_step_tokens,
        validate,
    )

    from pagedllm.benchmarks.env import run_metadata

    if args.small_step_tokens is not None and args.small_step_tokens < 0:
        print(f"pagedllm simulate calibrate: --small-step-tokens must be non-negative, got {args.small_step_tokens}",
              file=sys.stderr)
        return 2
    if args.refit:
        return _refit(args)
    args.output = args.output or "benchmarks/results/sim/profile-cpu.json"
    try:
        setup = Setup(args.dtype, args.threads)
    except ValueError as e:
        print(f"pagedllm simulate calibrate: {e}", file=sys.stderr)
        return 2
    # The threads, set before torch loads: on one thread step times are the engine's CPU time.
    os.environ["OMP_NUM_THREADS"] = str(setup.threads)
    meta = run_metadata()  # machine, versions, commit (+dirty) and command line of this run
    small = small_step_tokens(setup.dtype) if args.small_step_tokens is None else args.small_step_tokens
    swap_bw = measure_swap_bw(args.model, setup)
    steps = calibration_steps(args.model, quick=args.quick, setup=setup)
    runs = real_validation_runs(args.model, quick=args.quick, setup=setup) if args.validate else []
    profile, fit = profile_from_steps(args.model, fitted_steps(steps, runs), swap_bw, setup, small)
    meta["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    profile = dataclasses.replace(profile, source={**profile.source, "run": meta})
    profile.save(args.output)
    _print_fit(args.output, fit)
    if args.validate:
        rows = validate(args.model, runs, steps, swap_bw, setup, small)
        steps_json = [{"name": r["name"], "mode": r["mode"], "held_out": r["held_out"], "steps": r["run"].steps}
                      for r in runs]
        _write_json({"meta": meta, "profile": profile.to_dict(), "fit": fit, "rows": rows, "calibration_steps": steps,
                     "validation_steps": steps_json}, args.validate)
        _print_rows(rows)
    return 0


def _print_fit(path: str | None, fit: dict[str, Any]) -> None:
    print(f"profile{f' written to {path}' if path else ''}: {json.dumps(fit['coefficients'])}; fit error "
          f"{100 * fit['mean_abs_rel_err']:.1f}% per step, {100 * (fit['total_predicted_s'] / fit['total_measured_s'] - 1):+.1f}% "
          f"in total over {fit['num_steps']} steps")


def _print_rows(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        print(f"{r['name']:42s} {r['mode']:8s} tput real {r['real']['output_tok_s']:7.2f} sim "
              f"{r['sim']['output_tok_s']:7.2f} ({100 * r['tput_err']:+.1f}%)  TTFT real "
              f"{r['real']['mean_ttft_s']:6.2f} sim {r['sim']['mean_ttft_s']:6.2f} ({100 * r['ttft_err']:+.1f}%)")


def _refit(args: argparse.Namespace) -> int:
    """--refit: the stored validation's steps and real runs fitted and simulated again; no engine runs."""
    from pagedllm.simulator.calibrate import load_validation, refit_validation

    from pagedllm.benchmarks.env import run_metadata

    try:
        stored = load_validation(args.refit)
        profile, fit, rows = refit_validation(stored, args.model, args.small_step_tokens)
    except (OSError, ValueError, KeyError) as e:
        print(f"pagedllm simulate calibrate --refit: {e}", file=sys.stderr)
        return 2
    meta = run_metadata()
    if args.output:
        profile.save(args.output)
    _print_fit(args.output, fit)
    if args.validate:
        # The measured steps stay in the file they came from; this one names it as the input did
        # (a relative name is found again from the folder of the file that names it).
        _write_json({"meta": meta, "refit_of": stored.get("meta", {}),
                     "steps_file": stored.get("steps_file", args.refit), "profile": profile.to_dict(), "fit": fit,
                     "rows": rows}, args.validate)
    _print_rows(rows)
    return 0
