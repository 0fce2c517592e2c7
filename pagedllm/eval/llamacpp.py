"""llama.cpp as the peer of ``pagedllm eval perplexity``: the same windows scored by llama.cpp.

pagedllm tokenizes the text and cuts the windows; this file, run as a script with the peers'
Python (``PAGEDLLM_PEERS_VENV``, where ``llama-cpp-python`` is installed), evaluates each window
with llama.cpp on the same GGUF and scores the same positions, so both numbers differ only by
the model arithmetic. The script part imports neither pagedllm nor torch.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def peer_python() -> str:
    from pagedllm import envs  # not at the top: the script part runs in the peers' Python, without pagedllm

    venv = envs.PAGEDLLM_PEERS_VENV
    if not venv:
        raise ValueError("set PAGEDLLM_PEERS_VENV to the virtual environment where llama-cpp-python is installed")
    return str(Path(venv) / "bin" / "python")


def llamacpp_perplexity(gguf_path: str, windows: list[list[int]], threads: int, decode_tokens: int = 0) -> dict:
    """{"nlls": [[...] per window], "seconds": s, "decode_tok_s": x} from llama.cpp, run in the
    peers' Python; ``decode_tokens`` > 0 also times single-stream greedy decoding after 8 tokens."""
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.json"
        job.write_text(json.dumps({"model": gguf_path, "windows": windows, "threads": threads,
                                   "decode_tokens": decode_tokens}))
        out = subprocess.run([peer_python(), __file__, str(job)], capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"llama.cpp peer failed: {out.stderr.strip()[-2000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])


def _log_softmax_at(row, token: int) -> float:
    import numpy as np

    m = float(row.max())
    return float(row[token] - m - math.log(float(np.exp(row - m).sum())))


def _peer_main(job_path: str) -> None:
    from llama_cpp import Llama

    job = json.loads(Path(job_path).read_text())
    windows = job["windows"]
    ctx = len(windows[0])
    llm = Llama(model_path=job["model"], n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, logits_all=True,
                n_threads=job["threads"], n_threads_batch=job["threads"], verbose=False)
    nlls, seconds = [], 0.0
    for w in windows:
        llm.reset()
        start = time.perf_counter()
        llm.eval(w)
        seconds += time.perf_counter() - start
        scores = llm.scores
        first = ctx // 2
        nlls.append([-_log_softmax_at(scores[j], w[j + 1]) for j in range(first, ctx - 1)])
    decode = None
    if job.get("decode_tokens"):
        n = int(job["decode_tokens"])
        llm.reset()
        start = time.perf_counter()
        llm.eval(windows[0][:8])
        for _ in range(n):
            llm.eval([int(llm.scores[llm.n_tokens - 1].argmax())])
        decode = n / (time.perf_counter() - start)
    print(json.dumps({"nlls": nlls, "seconds": seconds, "decode_tok_s": decode}))


if __name__ == "__main__":
    _peer_main(sys.argv[1])
