"""`pagedllm run-batch` against `LLM.chat` on the same conversations: a chat batch file of
--lines lines (short distinct prompts, greedy, --max-tokens tokens each with ignore_eos, so both
sides generate the same number of tokens) through the CLI in a subprocess, and the same
conversations through `LLM.chat` (chat template, tokenization, generation) in this process, one
after the other on the same flags. Each side's time is its generation phase only: run-batch's is
the one its last stderr line reports (first request submitted to last line written), not the
model load. Prints both throughputs and run-batch's ratio to LLM.chat's.

usage: .venv/bin/pagedllm bench run-batch [--lines 10000] [--max-tokens 8] [--dtype bfloat16]
                                          [--output-json benchmarks/results/run_batch.json]
"""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagedllm.benchmarks.env import run_metadata
from pagedllm.benchmarks.script import parser

TOPICS = ["the sea", "a cat", "rain", "bread", "the moon", "a train", "winter", "music", "a forest", "coffee",
          "a river", "chess", "a lamp", "the wind", "a garden", "snow"]
# The run-batch summary line: "... N lines in S s: P prompt tokens, C output tokens ..."
SUMMARY = re.compile(r"pagedllm run-batch: (\d+) lines in ([0-9.]+) s: (\d+) prompt tokens, (\d+) output tokens")


def conversations(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"Write one sentence about {TOPICS[i % len(TOPICS)]} (note {i})."}]
            for i in range(n)]


def run_cli_batch(convs: list, max_tokens: int, engine_flags: list[str], workdir: Path) -> dict:
    src, out = workdir / "in.jsonl", workdir / "out.jsonl"
    body = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    src.write_text("".join(
        json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"messages": c, **body}}) + "\n" for i, c in enumerate(convs)))
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "run-batch", "-i", str(src), "-o", str(out),
           *engine_flags]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"run-batch failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    m = SUMMARY.search(proc.stderr)
    if m is None:
        raise SystemExit(f"run-batch printed no summary line:\n{proc.stderr[-3000:]}")
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    bad = [x["custom_id"] for x in lines if x["response"]["status_code"] != 200]
    if len(lines) != len(convs) or bad:
        raise SystemExit(f"run-batch wrote {len(lines)} lines for {len(convs)}, {len(bad)} failed: {bad[:5]}")
    seconds, prompt_tokens, output_tokens = float(m.group(2)), int(m.group(3)), int(m.group(4))
    return {"seconds": seconds, "process_wall_s": round(wall, 2), "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens, "output_tok_s": round(output_tokens / seconds, 1),
            "lines_per_s": round(len(convs) / seconds, 1)}


def run_llm_chat(convs: list, max_tokens: int, dtype: str, max_num_seqs: int | None) -> dict:
    from pagedllm import LLM, SamplingParams

    kwargs = {"max_num_seqs": max_num_seqs} if max_num_seqs else {}
    llm = LLM(dtype=dtype, **kwargs)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=True)
    seconds = time.perf_counter() - t0
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    output_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    del llm, outs
    gc.collect()
    return {"seconds": round(seconds, 2), "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "output_tok_s": round(output_tokens / seconds, 1), "lines_per_s": round(len(convs) / seconds, 1)}


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = parser(__doc__, prog)
    ap.add_argument("--lines", type=int, default=10_000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    meta = run_metadata()
    convs = conversations(args.lines)
    flags = ["--dtype", args.dtype] + (["--max-num-seqs", str(args.max_num_seqs)] if args.max_num_seqs else [])
    with tempfile.TemporaryDirectory() as d:
        batch = run_cli_batch(convs, args.max_tokens, flags, Path(d))
    offline = run_llm_chat(convs, args.max_tokens, args.dtype, args.max_num_seqs)
    if batch["output_tokens"] != offline["output_tokens"] or batch["prompt_tokens"] != offline["prompt_tokens"]:
        raise SystemExit(f"the two sides did different work: run-batch {batch}, LLM.chat {offline}")
    ratio = round(batch["output_tok_s"] / offline["output_tok_s"], 3)
    print(f"| {args.lines} chat lines, {args.max_tokens} tokens each ({args.dtype}) | seconds | output tok/s | "
          "lines/s |\n|---|---|---|---|")
    for name, r in (("pagedllm run-batch", batch), ("LLM.chat", offline)):
        print(f"| {name} | {r['seconds']:.2f} | {r['output_tok_s']:.1f} | {r['lines_per_s']:.1f} |")
    print(f"run-batch / LLM.chat: {ratio:.3f}x (target >= 0.95; CPU {meta['cpu_model']}, "
          f"{os.cpu_count()} logical CPUs, load at start {meta['load_avg_at_start']})")
    if args.output_json:
        report = {"metadata": meta, "lines": args.lines, "max_tokens": args.max_tokens, "dtype": args.dtype,
                  "run_batch": batch, "llm_chat": offline, "ratio": ratio}
        Path(args.output_json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
