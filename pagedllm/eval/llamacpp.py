"""llama.cpp as the peer of pagedllm's tokenizer, ``pagedllm eval perplexity`` and greedy decoding.

pagedllm tokenizes the text and cuts the windows; this file, run as a script with the peers'
Python (``PAGEDLLM_PEERS_VENV``, else ``.venv-peers`` in the working directory or the repository,
where ``llama-cpp-python`` is installed: ``make peers-llamacpp``), runs llama.cpp on the same GGUF:

* ``perplexity``: evaluates each window and scores the same positions, so both numbers differ only
  by the model arithmetic;
* ``tokenize``: llama.cpp's own tokenization of a text (its vocabulary only, as llama-perplexity
  tokenizes: no BOS unless the GGUF asks for it, special-token text left as text);
* ``greedy``: argmax decoding from given prompt ids, one token evaluated per step.

The script part imports neither pagedllm nor torch.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path


class PeerUnavailable(RuntimeError):
    """No Python with llama-cpp-python to run the peer with (the message says where it looked)."""


def peer_python() -> str:
    """The peers' interpreter: ``$PAGEDLLM_PEERS_VENV``, else ``.venv-peers`` in the working
    directory or in the repository root."""
    from pagedllm import envs  # not at the top: the script part runs in the peers' Python, without pagedllm

    venv = envs.PAGEDLLM_PEERS_VENV
    repo = Path(__file__).resolve().parents[2]
    candidates = [Path(venv)] if venv else [Path(".venv-peers"), repo / ".venv-peers"]
    for c in candidates:
        if (c / "bin" / "python").exists():
            return str(c.resolve() / "bin" / "python")
    tried = ", ".join(str(c.resolve()) for c in candidates)
    raise PeerUnavailable(f"no peers' Python with llama-cpp-python: no bin/python in {tried}; "
                          "create it with `make peers-llamacpp` (builds llama.cpp from source, several minutes), "
                          "or set PAGEDLLM_PEERS_VENV")


def llamacpp_unavailable() -> str | None:
    """None when the peers' Python imports llama_cpp, else why not (for a test's skip reason)."""
    try:
        python = peer_python()
    except PeerUnavailable as exc:
        return str(exc)
    out = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return f"{python} cannot import llama_cpp (install it with `make peers-llamacpp`): {out.stderr.strip()[-300:]}"
    return None


def _run_peer(job: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.json"
        path.write_text(json.dumps(job))
        out = subprocess.run([peer_python(), __file__, str(path)], capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"llama.cpp peer failed: {out.stderr.strip()[-2000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])


def llamacpp_perplexity(gguf_path: str, windows: list[list[int]], threads: int, decode_tokens: int = 0) -> dict:
    """{"nlls": [[...] per window], "seconds": s, "decode_tok_s": x} from llama.cpp, run in the
    peers' Python; ``decode_tokens`` > 0 also times single-stream greedy decoding after 8 tokens."""
    return _run_peer({"kind": "perplexity", "model": gguf_path, "windows": windows, "threads": threads,
                      "decode_tokens": decode_tokens})


def llamacpp_tokenize(gguf_path: str, text: str, special: bool = False) -> list[int]:
    """llama.cpp's token ids for ``text`` with the GGUF's vocabulary, BOS added only when the GGUF
    says ``tokenizer.ggml.add_bos_token: true``; ``special`` parses special-token text (as
    llama-perplexity does not)."""
    return _run_peer({"kind": "tokenize", "model": gguf_path, "text": text, "special": special})["ids"]


def llamacpp_greedy(gguf_path: str, prompts: list[list[int]], max_tokens: int, threads: int = 2,
                    top: int = 5, lora: str | None = None) -> list[tuple[list[int], list[list[int]]]]:
    """llama.cpp's greedy continuation of each prompt of token ids (argmax of the last logits,
    ``max_tokens`` tokens, end of text ignored): (tokens, the ``top`` best ids at each step);
    ``lora``: a GGUF LoRA adapter applied at scale 1 (llama.cpp's ``--lora``)."""
    out = _run_peer({"kind": "greedy", "model": gguf_path, "prompts": prompts, "max_tokens": max_tokens,
                     "threads": threads, "top": top, "lora": lora})
    return [(o["tokens"], o["top"]) for o in out["outputs"]]


def _log_softmax_at(row, token: int) -> float:
    import numpy as np

    row = np.asarray(row, dtype=np.float64)
    m = float(row.max())
    return float(row[token] - m - math.log(float(np.exp(row - m).sum())))


def _llama(**kwargs):
    """A ``llama_cpp.Llama`` whose weights stay in the GGUF's own layout: llama.cpp's extra buffer
    types (weights repacked for its AMX or AVX2 kernels) are turned off. Its AMX buffer type stops
    the process with an illegal instruction on hosts whose CPU has AMX but whose kernel does not
    give the process the AMX tile state; without it llama.cpp's plain CPU dot products run."""
    import llama_cpp
    import llama_cpp.llama as llama_module

    default = llama_cpp.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    llama_module.llama_cpp.llama_model_default_params = params
    try:
        return llama_module.Llama(**kwargs)
    finally:
        llama_module.llama_cpp.llama_model_default_params = default


def _perplexity(job: dict) -> dict:
    windows = job["windows"]
    ctx = len(windows[0])
    llm = _llama(model_path=job["model"], n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, logits_all=True,
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
    return {"nlls": nlls, "seconds": seconds, "decode_tok_s": decode}


def _tokenize(job: dict) -> dict:
    llm = _llama(model_path=job["model"], vocab_only=True, verbose=False)
    # add_bos=True is llama_tokenize's add_special: BOS (and EOS) only where the vocabulary asks
    # for them, as llama-perplexity tokenizes its text
    return {"ids": llm.tokenize(job["text"].encode("utf-8"), add_bos=True, special=bool(job["special"]))}


def _greedy(job: dict) -> dict:
    import numpy as np

    n, top = int(job["max_tokens"]), int(job["top"])
    longest = max(len(p) for p in job["prompts"])
    # logits_all: this llama-cpp-python leaves ``scores`` at zero for the last position otherwise
    lora = {"lora_path": job["lora"]} if job.get("lora") else {}
    llm = _llama(model_path=job["model"], n_ctx=longest + n + 8, n_batch=max(512, longest), logits_all=True,
                 n_threads=job["threads"], n_threads_batch=job["threads"], verbose=False, **lora)
    outputs = []
    for prompt in job["prompts"]:
        llm.reset()
        llm.eval(prompt)
        tokens, tops = [], []
        for _ in range(n):
            row = llm.scores[llm.n_tokens - 1]
            best = [int(i) for i in np.argsort(-row, kind="stable")[:top]]
            tokens.append(best[0])
            tops.append(best)
            if len(tokens) < n:
                llm.eval([best[0]])
        outputs.append({"tokens": tokens, "top": tops})
    return {"outputs": outputs}


def _peer_main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    run = {"perplexity": _perplexity, "tokenize": _tokenize, "greedy": _greedy}[job.get("kind", "perplexity")]
    print(json.dumps(run(job)))


if __name__ == "__main__":
    _peer_main(sys.argv[1])
