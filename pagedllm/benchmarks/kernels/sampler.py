"""The sampler's time per decode step for random rows, by batch size and sampling settings.

Usage: .venv/bin/pagedllm bench kernels sampler [--rows 1,16,64,128,256] [--vocab 49152]

Random logits (standard normal times 4, about as peaked as a small model's next-token logits) of
the default model's vocabulary; every row of a batch samples with the same settings. Per batch
size and setting: the median time of `Sampler()(logits, metadata)` over 7 calls (metadata built
once, as the engine builds it once per step; the C heap tuned as the engine tunes it), and the time
of a greedy batch beside it. The
end-to-end effect, side by side with vLLM: `pagedllm bench throughput --compare vllm --temperature
0.8 --top-p 0.95`.
"""

from __future__ import annotations

import statistics

import torch

from pagedllm.benchmarks.env import call_times
from pagedllm.sampling_params import SamplingParams
from pagedllm.utils import tune_heap
from pagedllm.worker.sample import Sampler, SamplingMetadata, SamplingRow
from pagedllm.benchmarks.script import parser

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature 0.8": dict(temperature=0.8),
    "top-k 50": dict(temperature=0.8, top_k=50),
    "top-p 0.95": dict(temperature=0.8, top_p=0.95),
    "top-k 50, top-p 0.9": dict(temperature=0.8, top_k=50, top_p=0.9),
    "min-p 0.05": dict(temperature=0.8, min_p=0.05),
}


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = parser(__doc__, prog)
    ap.add_argument("--rows", default="1,16,64,128,256")
    ap.add_argument("--vocab", type=int, default=49152)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    tune_heap()
    sampler, cpu = Sampler(), torch.device("cpu")
    print(f"{torch.get_num_threads()} threads, vocabulary {a.vocab}; ms per step (median of 7)")
    print("| rows | " + " | ".join(SETTINGS) + " |\n|---|" + "---|" * len(SETTINGS))
    for m in (int(r) for r in a.rows.split(",")):
        logits = torch.randn(m, a.vocab) * 4.0
        cells = []
        for params in SETTINGS.values():
            rows = [SamplingRow(SamplingParams(**params), None, [1], [], set()) for _ in range(m)]
            md = SamplingMetadata.from_rows(rows, a.vocab, cpu)
            with torch.inference_mode():
                cells.append(1e3 * statistics.median(call_times(lambda: sampler(logits, md), 7)))
        print(f"| {m} | " + " | ".join(f"{c:.2f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
