"""`pagedllm bench spec`: speculative decoding against none, in one run, on a workload where the
prompt holds most of the answer (code edits, summaries that quote their text): output tokens/s of
one request at a time (single stream) and of a batch of concurrent requests, the ratio, the
acceptance rate and mean acceptance length, and whether greedy outputs are the same token for
token. Both engines are loaded once and warmed up before they are timed."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

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


def _generate(llm: Any, conversations: list[list[dict[str, str]]], params: Any) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    outs = llm.chat(conversations, params, use_tqdm=False)
    return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]


def _measure(llm: Any, convs: list[list[dict[str, str]]], params: Any, num_single: int,
             concurrency: int) -> dict[str, Any]:
    """Single stream: the first `num_single` conversations alone, one after another; concurrent:
    the first `concurrency` together."""
    single_s, single_tokens = 0.0, []
    for conv in convs[:num_single]:
        dt, toks = _generate(llm, [conv], params)
        single_s += dt
        single_tokens += toks
    batch_s, batch_tokens = _generate(llm, convs[:concurrency], params)
    n_single = sum(map(len, single_tokens))
    n_batch = sum(map(len, batch_tokens))
    return {"single": {"seconds": single_s, "output_tokens": n_single, "output_tok_s": n_single / single_s},
            "concurrent": {"seconds": batch_s, "output_tokens": n_batch, "output_tok_s": n_batch / batch_s},
            "tokens": single_tokens, "concurrent_tokens": batch_tokens}


def run_spec(opts: dict[str, Any]) -> dict[str, Any]:
    from pagedllm import LLM, SamplingParams
    from pagedllm.benchmarks.env import run_metadata

    config = json.loads(opts["speculative_config"])
    engine = {"dtype": opts["dtype"], "kv_cache_memory": opts["kv_cache_memory"], "max_model_len": 2048}
    params = SamplingParams(temperature=0.0, max_tokens=opts["max_tokens"])
    convs = [[{"role": "user", "content": t}] for t in TASKS]
    warm = [[{"role": "user", "content": "Say hello."}]]
    report: dict[str, Any] = {"meta": run_metadata(), "model": opts["model"] or "default", "dtype": opts["dtype"],
                              "speculative_config": config, "max_tokens": opts["max_tokens"],
                              "num_prompts": opts["num_prompts"], "concurrency": opts["concurrency"]}
    for name, spec in (("off", None), ("on", config)):
        llm = LLM(opts["model"], speculative_config=spec, **engine)
        _generate(llm, warm, SamplingParams(temperature=0.0, max_tokens=16))
        report[name] = _measure(llm, convs, params, opts["num_prompts"], opts["concurrency"])
        if spec is not None:
            s = llm.llm_engine.scheduler.get_stats().spec_decode
            report["acceptance"] = {"num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
                                    "num_accepted_tokens": s.num_accepted_tokens,
                                    "acceptance_rate": s.acceptance_rate,
                                    "mean_acceptance_length": s.mean_acceptance_length,
                                    "accepted_per_position": s.accepted_per_position}
        llm.llm_engine.shutdown()
        del llm
    off, on = report["off"], report["on"]
    report["same_greedy_tokens"] = {"single": off.pop("tokens") == on.pop("tokens"),
                                    "concurrent": off.pop("concurrent_tokens") == on.pop("concurrent_tokens")}
    report["ratio"] = {k: on[k]["output_tok_s"] / off[k]["output_tok_s"] for k in ("single", "concurrent")}
    return report


def format_table(r: dict[str, Any]) -> str:
    a = r["acceptance"]
    lines = [f"{r['num_prompts']} edit / quote tasks, {r['model']} ({r['dtype']}), greedy, up to {r['max_tokens']} "
             f"tokens; speculative config {json.dumps(r['speculative_config'])}; CPU: {r['meta'].get('cpu_model', '?')}",
             "                      off tok/s    on tok/s   ratio"]
    for k, label in (("single", "single stream"), ("concurrent", f"{r['concurrency']} concurrent")):
        lines.append(f"  {label:18s} {r['off'][k]['output_tok_s']:9.1f}  {r['on'][k]['output_tok_s']:9.1f}  "
                     f"{r['ratio'][k]:6.2f}x")
    lines.append(f"  acceptance rate {100 * a['acceptance_rate']:.1f}%, mean acceptance length "
                 f"{a['mean_acceptance_length']:.2f} tokens per speculating step, accepted by position "
                 f"{a['accepted_per_position']}")
    same = r["same_greedy_tokens"]
    lines.append(f"  greedy tokens the same with and without: single {same['single']}, concurrent {same['concurrent']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model (default: the embedded default model)")
    ap.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4}',
                    help="the configuration measured against none (JSON, as --speculative-config)")
    ap.add_argument("--num-prompts", type=int, default=4, help=f"tasks run one at a time (at most {len(TASKS)})")
    ap.add_argument("--concurrency", type=int, default=8, help="tasks run together in the concurrent part")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--output-json", default=None, help="write the report here")
    args = ap.parse_args(argv)
    if not 1 <= args.num_prompts <= len(TASKS) or not 1 <= args.concurrency <= len(TASKS):
        ap.error(f"--num-prompts and --concurrency must be in [1, {len(TASKS)}]")
    report = run_spec({k: v for k, v in vars(args).items() if k != "output_json"})
    print(format_table(report))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=1) + "\n")
