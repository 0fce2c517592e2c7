"""`pagedllm bench spec`: speculative decoding (n-gram and suffix by default; any
--speculative-config, a draft model's among them) against none, in one run, on a workload where
the prompt holds most of the answer (code edits, summaries that quote their text; `--workload
edit`) or on ordinary chat questions (`--workload chat`): output tokens/s of one request at a time
(single stream) and of a batch of concurrent requests (`--concurrency 0`: single stream only), the
ratio, the acceptance rate and mean acceptance length, whether greedy outputs are the same token
for token, and for a draft model its passes and their mean time beside the target's time per
token without speculation. Each part runs on an engine of its own, loaded and warmed up before it
is timed (the concurrent batch repeats the single-stream tasks: a suffix engine's cache of
finished outputs never holds the answers it is timed on). `--compare llama.cpp`: llama.cpp
(llama-cpp-python in the peers' environment) on the same prompt tokens, single stream, greedy, on
the model's GGUF rewritten unquantized in the same dtype: without speculation, with its prompt
lookup decoding (`LlamaPromptLookupDecoding`, n-grams of up to 2 tokens, 2 proposed: its advice
for CPUs) and with a draft model through its draft interface (the same GGUF quantized by
llama.cpp to Q4_0 and to Q8_0, 3 tokens proposed, as pagedllm's self-drafts)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from pagedllm.benchmarks.script import parser

CODE = '''def load_users(path):
    users = []
    with open(path) as f:
        for line in f:
            name, age, email = line.strip().split(",")
            users.append({"name": name, "age": int(age), "email": email})
    return users


def adults(users):
    result = []
    for user in users:
        if user["age"] >= 18:
            result.append(user)
    return result
'''
ARTICLE = (
    "The city council met on Tuesday evening to discuss the new library. The mayor said that the "
    "library would open in the spring and that it would have a reading room for children, a cafe "
    "and a hall for concerts. Several residents asked about parking; the council answered that "
    "the old bus depot next door would become a car park with two hundred spaces. The budget of "
    "the project is four million euros, of which the region pays half."
)
TASKS = [
    f"Rename the function `adults` to `grown_ups` and the variable `users` to `people` in this code. "
    f"Reply with the whole code only.\n\n{CODE}",
    f"Add a docstring to each function of this code. Reply with the whole code only.\n\n{CODE}",
    f"Summarise this text in three sentences, quoting its words exactly where you can.\n\n{ARTICLE}",
    f"Repeat this text, replacing 'library' with 'museum'.\n\n{ARTICLE}",
    f"Rewrite the function `load_users` to use the csv module. Reply with the whole code only.\n\n{CODE}",
    f"List every number that appears in this text, each with the sentence it appears in.\n\n{ARTICLE}",
    f"Convert this code to use type hints. Reply with the whole code only.\n\n{CODE}",
    f"Repeat this text word for word, then say how many sentences it has.\n\n{ARTICLE}",
]

CHAT = [
    "What are three good habits for staying healthy while working at a desk all day?",
    "Explain in a few sentences why the sky is blue.",
    "Give me a simple recipe for pancakes.",
    "What is the difference between a virus and a bacterium?",
    "Suggest a name for a small coffee shop near the sea, and say why it fits.",
    "How do I politely decline an invitation to a party?",
    "Write a short story about a robot who learns to paint.",
    "What should I pack for a weekend hiking trip in the mountains?",
]
WORKLOADS = {"edit": TASKS, "chat": CHAT}

MAX_CONCURRENCY = 128
DEFAULT_CONFIGS = ['{"method": "ngram", "num_speculative_tokens": 4}', '{"method": "suffix"}']


LLAMACPP_DRAFTS: list[dict[str, Any] | None] = [
    None, {"method": "prompt_lookup", "max_ngram_size": 2, "num_pred_tokens": 2},
    {"method": "draft_model", "quantization": "Q4_0", "num_pred_tokens": 3},
    {"method": "draft_model", "quantization": "Q8_0", "num_pred_tokens": 3}]
"""llama.cpp's runs under --compare llama.cpp (module docstring)."""


def _generate(llm: Any, conversations: list[list[dict[str, str]]], params: Any,
              prompts: list[list[int]] | None = None) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    outs = llm.chat(conversations, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    if prompts is not None:
        prompts += [list(o.prompt_token_ids) for o in outs]
    return dt, [list(o.outputs[0].token_ids) for o in outs]


def _measure(llm: Any, convs: list[list[dict[str, str]]], params: Any, part: str, num_single: int,
             concurrency: int, prompts: list[list[int]] | None = None) -> dict[str, Any]:
    """Single stream: the first `num_single` conversations alone, one after another; concurrent:
    the first `concurrency` together. `prompts` collects the single stream's prompt token ids."""
    if part == "single":
        seconds, tokens = 0.0, []
        for conv in convs[:num_single]:
            dt, toks = _generate(llm, [conv], params, prompts)
            seconds += dt
            tokens += toks
    elif concurrency:
        seconds, tokens = _generate(llm, convs[:concurrency], params)
    else:
        return {"seconds": 0.0, "output_tokens": 0, "output_tok_s": 0.0, "tokens": []}
    n = sum(map(len, tokens))
    return {"seconds": seconds, "output_tokens": n, "output_tok_s": n / seconds, "tokens": tokens}


def run_llamacpp_spec(model: str | None, dtype: str, prompts: list[list[int]], warm: list[int], max_tokens: int,
                      stop_token_ids: list[int], peers_venv: str | None) -> list[dict[str, Any]]:
    """llama.cpp's LLAMACPP_DRAFTS runs over `prompts` one at a time (module docstring), each in a
    child process of the peers' python: tokens/s and the tokens."""
    import os
    import sys
    import tempfile

    import torch

    from pagedllm.benchmarks.gguf_export import export_unquantized_gguf, llamacpp_quantized_gguf
    from pagedllm.benchmarks.latency import _GGUF_TYPES
    from pagedllm.benchmarks.throughput import BackendUnavailable, peers_python, run_child
    from pagedllm.models.loader import resolve_model

    source = resolve_model(model)
    if source.kind != "gguf":
        raise BackendUnavailable(f"llama.cpp needs a GGUF model; {source.path} is a {source.kind} folder")
    python = peers_python(peers_venv)
    path = export_unquantized_gguf(source.path, _GGUF_TYPES[dtype])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = []
    for draft in LLAMACPP_DRAFTS:
        spec_draft = draft
        if draft is not None and draft["method"] == "draft_model":
            spec_draft = {**draft, "model_path": llamacpp_quantized_gguf(source.path, draft["quantization"],
                                                                         peers_venv, torch.get_num_threads())}
        spec = {"backend": "llama.cpp", "tag": "llama.cpp-spec", "model_path": path, "generate": prompts,
                "warm": warm, "max_tokens": max_tokens, "stop_token_ids": stop_token_ids,
                "threads": torch.get_num_threads(), "draft": spec_draft}
        print(f"--- llama.cpp ({_GGUF_TYPES[dtype]}), draft {json.dumps(draft)}: starting ---", file=sys.stderr,
              flush=True)
        with tempfile.TemporaryDirectory(prefix="pagedllm-bench-") as workdir:
            run = run_child([str(python), str(Path(__file__).with_name("llamacpp_worker.py"))], env, spec, workdir,
                            None)
        if run.returncode != 0 or "seconds" not in run.result:
            raise BackendUnavailable(f"llama.cpp failed: {run.result.get('error') or f'exit code {run.returncode}'}")
        r = run.result
        n = sum(map(len, r["tokens"]))
        out.append({"draft": draft, "gguf": Path(path).name, "seconds": sum(r["seconds"]), "output_tokens": n,
                    "output_tok_s": n / sum(r["seconds"]), "tokens": r["tokens"],
                    "llama_cpp_version": r["llama_cpp_version"]})
    return out


def run_spec(opts: dict[str, Any]) -> dict[str, Any]:
    from pagedllm import LLM, SamplingParams
    from pagedllm.benchmarks.env import run_metadata

    configs = [json.loads(c) for c in opts["speculative_config"]]
    engine = {"dtype": opts["dtype"], "kv_cache_memory": opts["kv_cache_memory"], "max_model_len": 2048}
    params = SamplingParams(temperature=0.0, max_tokens=opts["max_tokens"])
    # more concurrent requests than tasks: the tasks again, in order
    tasks = WORKLOADS[opts.get("workload", "edit")]
    convs = [[{"role": "user", "content": tasks[i % len(tasks)]}] for i in range(max(len(tasks), opts["concurrency"]))]
    warm = [[{"role": "user", "content": "Say hello."}]]
    report: dict[str, Any] = {"meta": run_metadata(), "model": opts["model"] or "default", "dtype": opts["dtype"],
                              "max_tokens": opts["max_tokens"], "num_prompts": opts["num_prompts"],
                              "concurrency": opts["concurrency"], "workload": opts.get("workload", "edit"),
                              "runs": []}
    prompts: list[list[int]] = []
    for spec in [None, *configs]:
        run: dict[str, Any] = {"speculative_config": spec}
        counts = [0, 0, 0]
        # A fresh engine per part: the concurrent batch repeats the single-stream tasks, whose
        # outputs a suffix engine would otherwise have in its cache.
        for part in ("single", "concurrent"):
            llm = LLM(opts["model"], speculative_config=spec, **engine)
            _generate(llm, warm, SamplingParams(temperature=0.0, max_tokens=16))
            draft = getattr(getattr(llm.llm_engine.executor, "runner", None), "draft", None)
            if draft is not None:  # count the timed part's passes only
                draft.passes, draft.seconds = 0, 0.0
            run[part] = _measure(llm, convs, params, part, opts["num_prompts"], opts["concurrency"],
                                 prompts if spec is None else None)
            if spec is None and part == "single":
                mc = llm.llm_engine.model_config
                resolved = str(mc.dtype).removeprefix("torch.")
                stop = sorted(mc.eos_token_ids)
                warm_ids: list[int] = []
                _generate(llm, warm, SamplingParams(temperature=0.0, max_tokens=1), warm_ids)
            if spec is not None:
                s = llm.llm_engine.scheduler.get_stats().spec_decode
                counts = [counts[0] + s.num_drafts, counts[1] + s.num_draft_tokens, counts[2] + s.num_accepted_tokens]
                if draft is not None and part == "single":
                    run["draft"] = {"passes": draft.passes, "seconds": draft.seconds,
                                    "ms_per_pass": 1e3 * draft.seconds / max(draft.passes, 1)}
            llm.llm_engine.shutdown()
            del llm
        if spec is not None:
            run["acceptance"] = {"num_drafts": counts[0], "num_draft_tokens": counts[1], "num_accepted_tokens": counts[2],
                                 "acceptance_rate": counts[2] / max(counts[1], 1),
                                 "mean_acceptance_length": 1 + counts[2] / max(counts[0], 1)}
        report["runs"].append(run)
    off = report["runs"][0]
    for run in report["runs"]:
        run["ratio"] = {k: run[k]["output_tok_s"] / off[k]["output_tok_s"] if off[k]["output_tok_s"] else 0.0
                        for k in ("single", "concurrent")}
        run["same_greedy_tokens"] = {k: run[k]["tokens"] == off[k]["tokens"] for k in ("single", "concurrent")}
    if opts.get("compare"):
        peers = run_llamacpp_spec(opts["model"], resolved, prompts, warm_ids[0], opts["max_tokens"], stop,
                                  opts.get("peers_venv"))
        for p in peers:
            p["same_tokens_as_pagedllm"] = sum(a == b for a, b in zip(p.pop("tokens"), off["single"]["tokens"]))
        report["llamacpp"] = peers
    for run in report["runs"]:
        for k in ("single", "concurrent"):
            run[k].pop("tokens")
    return report


def format_table(r: dict[str, Any]) -> str:
    conc = f"{r['concurrency']} concurrent"
    kind = "chat questions" if r.get("workload") == "chat" else "edit / quote tasks"
    lines = [f"{r['num_prompts']} {kind}, {r['model']} ({r['dtype']}), greedy, up to {r['max_tokens']} "
             f"tokens; CPU: {r['meta'].get('cpu_model', '?')}",
             f"  {'speculative config':60s} {'single tok/s':>12s} {'ratio':>6s}  {conc:>13s} "
             f"{'ratio':>6s}  acceptance  same tokens"]
    for run in r["runs"]:
        spec = run["speculative_config"]
        a = run.get("acceptance")
        acc = f"{100 * a['acceptance_rate']:5.1f}% {a['mean_acceptance_length']:.2f}" if a else "-"
        same = run["same_greedy_tokens"]
        lines.append(f"  {json.dumps(spec) if spec else 'off':60s} {run['single']['output_tok_s']:12.1f} "
                     f"{run['ratio']['single']:5.2f}x  {run['concurrent']['output_tok_s']:13.1f} "
                     f"{run['ratio']['concurrent']:5.2f}x  {acc:>10s}  {same['single'] and same['concurrent']}")
    lines.append("  acceptance: rate of proposed tokens accepted, mean tokens per speculating step")
    for p in r.get("llamacpp", ()):
        draft = json.dumps(p["draft"]) if p["draft"] else "none"
        lines.append(f"  llama.cpp {p['llama_cpp_version']} ({p['gguf']}), draft {draft:72s} "
                     f"{p['output_tok_s']:8.1f} tok/s single stream; {p['same_tokens_as_pagedllm']} of "
                     f"{r['num_prompts']} outputs the same as pagedllm's without speculation")
    off = r["runs"][0]["single"]
    for run in r["runs"]:
        d = run.get("draft")
        if d:
            lines.append(f"  draft model {json.dumps(run['speculative_config'])}: {d['passes']} passes, "
                         f"{d['ms_per_pass']:.2f} ms each; without speculation "
                         f"{1e3 * off['seconds'] / max(off['output_tokens'], 1):.2f} ms per token single stream")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = parser(__doc__, prog)
    ap.add_argument("--model", default=None, help="model (default: the embedded default model)")
    ap.add_argument("--speculative-config", action="append", default=None,
                    help="a configuration measured against none (JSON, as --speculative-config); repeat for "
                         f"several (default: {' and '.join(DEFAULT_CONFIGS)})")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="edit",
                    help="edit: code edits and quoting summaries (the prompt holds the answer); chat: ordinary "
                         "chat questions")
    ap.add_argument("--num-prompts", type=int, default=4, help=f"tasks run one at a time (at most {len(TASKS)})")
    ap.add_argument("--concurrency", type=int, default=8,
                    help=f"tasks run together in the concurrent part (1 to {MAX_CONCURRENCY}; beyond {len(TASKS)} "
                         "the tasks repeat)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--compare", choices=["llama.cpp"], default=None,
                    help="also run llama.cpp with and without its speculative decoding, single stream (a GGUF "
                         "model)")
    ap.add_argument("--peers-venv", default=None, help="the peers' environment (llama-cpp-python)")
    ap.add_argument("--output-json", default=None, help="write the report here")
    args = ap.parse_args(argv)
    if not 1 <= args.num_prompts <= len(TASKS):
        ap.error(f"--num-prompts must be in [1, {len(TASKS)}]")
    if not 0 <= args.concurrency <= MAX_CONCURRENCY:
        ap.error(f"--concurrency must be in [0, {MAX_CONCURRENCY}] (0: single stream only)")
    args.speculative_config = args.speculative_config or DEFAULT_CONFIGS
    from pagedllm.engine.arg_utils import parse_speculative_config

    for c in args.speculative_config:
        try:
            parse_speculative_config(c)
        except ValueError as e:
            ap.error(f"--speculative-config {c!r}: {e}")
    report = run_spec({k: v for k, v in vars(args).items() if k != "output_json"})
    print(format_table(report))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=1) + "\n")
