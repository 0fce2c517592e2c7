"""Decode step time of the fused native step against the torch path, by batch rows and dtype.

Usage: .venv/bin/pagedllm bench kernels native-decode [--dtype float32,bfloat16] [--rows 1,2,4,8,16,24,32,48,64,96,128,192,256]
    [--context 256] [--out benchmarks/results/native_decode.json]

Both paths run the same ModelRunner on the default model (same weights, same KV cache, each row a
request with `--context` tokens of cached context); each time is the fastest of 15 calls after a
warm-up, with torch's threads; `fused+head` is the same call on to the LM head and a greedy argmax
of every row (what a greedy decode step runs). This is what chooses the fused step's row limits (DTYPE_ROWS in
pagedllm/worker/native_decode.py): the largest batch at which it is still faster.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from pagedllm import LLM
from pagedllm.benchmarks.env import call_times, measure_copy_bandwidth, run_metadata
from pagedllm.worker.input_batch import RequestState, build_batch
from pagedllm.benchmarks.script import parser


def _best_ms(fn, reps: int = 15) -> float:
    return 1000 * min(call_times(fn, reps))


def measure(dtype: str, rows: list[int], context: int) -> list[dict]:
    llm = LLM(dtype=dtype, kv_cache_memory="4GiB")  # 256 rows of 256 tokens in float32
    runner = llm.llm_engine.core.executor.runner
    nd = runner.native_decode
    if nd is None:
        raise SystemExit(f"the fused decode step does not run here in {dtype} (see the startup log)")
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    nblocks = -(-(context + 1) // runner.block_size)
    out = []
    for m in rows:
        states = [RequestState(f"r{i}", list(range(100, 101 + context)), context, list(range(i * nblocks, (i + 1) * nblocks)),
                               context, None) for i in range(m)]
        batch = build_batch(states, [1] * m, runner.block_size, None, **runner.batch_options)

        def fused() -> None:
            nd.run(batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables, batch.seq_lens)

        def fused_head() -> None:
            nd.run_head(batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables, batch.seq_lens,
                        np.arange(m), greedy=True)

        def torch_path() -> None:
            runner.paths.eager.forward(batch)

        with torch.inference_mode():
            t_fused, t_torch = _best_ms(fused), _best_ms(torch_path)
            t_head = _best_ms(fused_head) if nd.head_applies(m) else None  # the LM head outside the step
        out.append({"dtype": dtype, "rows": m, "fused_ms": t_fused, "fused_head_ms": t_head, "torch_ms": t_torch,
                    "speedup": t_torch / t_fused, "fused_weight_gb_s": weight_bytes / t_fused / 1e6})
        head_ms = "-" if t_head is None else f"{t_head:.2f}"
        print(f"{dtype:9s} rows {m:3d}: fused {t_fused:7.2f} ms   fused+head {head_ms:>7s} ms   torch ops {t_torch:7.2f} ms   "
              f"{t_torch / t_fused:5.2f}x   weights read at {weight_bytes / t_fused / 1e6:5.1f} GB/s", flush=True)
    del llm
    return out


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = parser(__doc__, prog)
    ap.add_argument("--dtype", default="float32,bfloat16", help="model dtypes, comma-separated")
    ap.add_argument("--rows", default="1,2,4,8,16,24,32,48,64,96,128,192,256",
                    help="decode batch rows to time, comma-separated")
    ap.add_argument("--context", type=int, default=256, help="tokens of context per row")
    ap.add_argument("--out", default=None, help="write the results (with this run's metadata) here as JSON")
    a = ap.parse_args(argv)
    bw = measure_copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.1f} GB/s, {torch.get_num_threads()} threads")
    results = [r for d in a.dtype.split(",") for r in measure(d, [int(x) for x in a.rows.split(",")], a.context)]
    if a.out:
        Path(a.out).write_text(json.dumps({"benchmark": "native_decode", "meta": run_metadata(), "context": a.context,
                                           "copy_bytes_per_s": bw, "results": results}, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
