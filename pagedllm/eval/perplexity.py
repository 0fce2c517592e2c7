"""Perplexity with llama.cpp's convention (``llama-perplexity``).

The text is tokenized once, as llama-perplexity tokenizes it (:func:`tokenize_text`: BOS first
when the vocabulary asks for it, special-token text such as ``<|im_start|>`` kept as plain text);
it is cut into windows of ``ctx`` tokens (the last partial window is dropped); when the vocabulary
asks for a BOS token, each window's first token is replaced by BOS;
only the second half of each window is scored: with ``first = ctx // 2``, the logits at positions
``first .. ctx-2`` predict tokens ``first+1 .. ctx-1``, so a window of 512 scores 255 tokens.
``PPL = exp(mean NLL)``, and its uncertainty is ``PPL * sqrt(var(NLL) / (n - 1))``, as
llama.cpp prints it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class PerplexityResult:
    ppl: float
    """exp of the mean negative log-likelihood of the scored tokens."""
    stderr: float
    """llama.cpp's uncertainty of ``ppl``."""
    windows: int
    scored_tokens: int
    seconds: float
    tokens_per_s: float
    """Tokens evaluated (windows x ctx) per second of model time."""
    ctx: int
    chunk_ppl: list[float] = field(default_factory=list)
    """Running PPL after each window, as llama.cpp prints it."""

    def line(self) -> str:
        return f"PPL = {self.ppl:.4f} +/- {self.stderr:.5f}"


def windows_of(tokens: list[int], ctx: int, bos: int | None, chunks: int | None) -> list[list[int]]:
    """Non-overlapping windows of ``ctx`` tokens, the first replaced by BOS when given.

    e.g. 1100 tokens, ctx 512 -> windows [0:512], [512:1024]; the last 76 tokens are dropped.
    """
    n = len(tokens) // ctx
    if chunks is not None:
        n = min(n, chunks)
    out = []
    for i in range(n):
        w = list(tokens[i * ctx : (i + 1) * ctx])
        if bos is not None:
            w[0] = bos
        out.append(w)
    return out


def score_window(window: list[int], logprob_of_next: list[float]) -> list[float]:
    """NLLs of the scored half: ``logprob_of_next[j]`` is log p(window[j+1] | window[:j+1])."""
    first = len(window) // 2
    return [-logprob_of_next[j] for j in range(first, len(window) - 1)]


def summarize(nlls_per_window: list[list[float]], ctx: int, seconds: float) -> PerplexityResult:
    count, total, total2, running = 0, 0.0, 0.0, []
    for nlls in nlls_per_window:
        count += len(nlls)
        total += sum(nlls)
        total2 += sum(v * v for v in nlls)
        running.append(math.exp(total / count))
    mean = total / count
    var = total2 / count - mean * mean
    ppl = math.exp(mean)
    stderr = ppl * math.sqrt(var / (count - 1)) if var > 0 and count > 1 else 0.0
    evaluated = len(nlls_per_window) * ctx
    return PerplexityResult(ppl=ppl, stderr=stderr, windows=len(nlls_per_window), scored_tokens=count,
                            seconds=seconds, tokens_per_s=evaluated / max(seconds, 1e-9), ctx=ctx,
                            chunk_ppl=running)


def wants_bos(tokenizer: Any) -> int | None:
    """The BOS id when encoding with special tokens prepends it (the vocabulary asks for it)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer.encode("a", add_special_tokens=True)
    return bos if ids and ids[0] == bos else None


def tokenize_text(tokenizer: Any, text: str) -> list[int]:
    """The token ids llama-perplexity scores for ``text``: BOS first when the vocabulary asks for
    it (:func:`wants_bos`), then the text with special-token strings cut like any other text
    (llama.cpp tokenizes the file with ``parse_special`` off)."""
    ids = list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
    bos = wants_bos(tokenizer)
    return ([bos] if bos is not None else []) + ids


def perplexity(model: str | None = None, file: str | Path | None = None, ctx: int = 512,
               chunks: int | None = None, progress: bool = True, llm: Any = None,
               **engine_args: Any) -> PerplexityResult:
    """Perplexity of ``model`` on ``file`` (default: :func:`pagedllm.eval.corpus.default_corpus`).

    ``engine_args`` are :class:`pagedllm.engine.arg_utils.EngineArgs` fields (``quantization``,
    ``dtype``, ``kv_cache_dtype``...); an existing ``llm`` (:class:`pagedllm.LLM`) may be passed
    instead. ``chunks`` caps the number of windows.
    """
    from pagedllm.eval.corpus import default_corpus
    from pagedllm.llm import LLM

    if ctx < 4:
        raise ValueError(f"ctx must be at least 4 tokens, got {ctx}")
    if chunks is not None and chunks < 1:
        raise ValueError(f"chunks must be at least 1, got {chunks}")
    path = Path(file) if file is not None else default_corpus()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read text file {str(path)!r}: {exc}") from None
    if llm is None:
        engine_args.setdefault("max_model_len", ctx + 1)
        llm = LLM(model, **engine_args)
    tok = llm.get_tokenizer().hf
    tokens = tokenize_text(tok, text)
    windows = windows_of(tokens, ctx, wants_bos(tok), chunks)
    if not windows:
        raise ValueError(f"text file {str(path)!r} has {len(tokens)} tokens, fewer than one window of ctx={ctx}")
    return perplexity_of_windows(llm, windows, progress)


def perplexity_of_windows(llm: Any, windows: list[list[int]], progress: bool = False) -> PerplexityResult:
    """Score token windows (from :func:`windows_of`) with ``llm`` (:class:`pagedllm.LLM`): one batch
    with prompt logprobs, the second half of each window scored."""
    from pagedllm.sampling_params import SamplingParams

    ctx = len(windows[0])
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=progress)
    seconds = time.perf_counter() - start
    nlls = []
    for w, out in zip(windows, outputs):
        lp = out.prompt_logprobs or []
        # prompt_logprobs[j] holds log p(w[j] | w[:j]) (None at j = 0): shift by one
        nexts = [lp[j + 1][w[j + 1]].logprob for j in range(len(w) - 1)]  # type: ignore[index]
        nlls.append(score_window(w, nexts))
    return summarize(nlls, ctx, seconds)
