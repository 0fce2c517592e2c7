"""The accuracy cost of int8 activations in the native quantized kernel: perplexity (ctx 512,
llama.cpp's convention) with every step at most 16 tokens, so that every linear layer (and the LM
head where it is kept as int8 codes) runs the decode-sized kernel that quantizes activations,
under ``PAGEDLLM_QUANT_ACTIVATIONS=int8`` and ``=bf16``, per scheme, each in its own process
(the mode is chosen once per process). Prompts longer than 16 tokens otherwise take the batch
path (weights expanded for oneDNN), where the mode changes nothing.

Run: flock /tmp/pagedllm-bench.lock pagedllm bench quant activations [--schemes int4-g32,gguf-q4_1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from pagedllm.benchmarks.quant.schemes import SCHEMES, scheme_model
from pagedllm.benchmarks.script import parser

STEP_TOKENS = 16  # the kernel's largest decode batch (pagedllm.quantization.native.SMALL_M)


def one(label: str, chunks: int, threads: int) -> dict:
    import torch

    from pagedllm import LLM
    from pagedllm.eval import perplexity

    torch.set_num_threads(threads)
    model, kwargs = scheme_model(SCHEMES[label])
    kwargs["dtype"] = "bfloat16"
    llm = LLM(model, **kwargs, max_model_len=513, max_num_batched_tokens=STEP_TOKENS, enable_prefix_caching=False)
    r = perplexity(ctx=512, chunks=chunks, progress=False, llm=llm)
    return {"scheme": label, "activations": os.environ.get("PAGEDLLM_QUANT_ACTIVATIONS", "int8"),
            "ppl512": r.ppl, "ppl512_err": r.stderr, "step_tokens": STEP_TOKENS}


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = parser(__doc__, prog)
    ap.add_argument("--schemes", default="int4-g32,gguf-q4_1,int8")
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one, args.chunks, args.threads)), flush=True)
        return
    rows = []
    for label in args.schemes.split(","):
        for mode in ("int8", "bf16"):
            env = {**os.environ, "PAGEDLLM_QUANT_ACTIVATIONS": mode}
            out = subprocess.run([sys.executable, "-m", __name__, "--one", label, "--chunks", str(args.chunks),
                                  "--threads", str(args.threads)], env=env, capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
        a, b = rows[-2], rows[-1]
        print(f"{label}: int8 activations {a['ppl512']:.4f}, bf16 {b['ppl512']:.4f}, "
              f"delta {a['ppl512'] - b['ppl512']:+.4f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
