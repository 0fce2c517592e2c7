"""The offline API's pooling half (vLLM's shapes): `LLM.encode`, `embed`, `classify` and `score`.

Every call queues its prompts as pooling requests on the same engine as `generate` (continuous
batching, chunked decoder prompts, whole encoder prompts) and returns the outputs in input order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedllm.engine.llm_engine import PromptType
from pagedllm.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagedllm.pooling_params import PoolingParams


def resolve_truncation(k: int | None, side: str | None, max_model_len: int) -> int | None:
    """vLLM's `truncate_prompt_tokens`: None (no truncation), -1 (the model's context) or k in
    [1, max_model_len], as the number of tokens to keep; ValueError naming a bad value."""
    if side not in (None, "left", "right"):
        raise ValueError(f"truncation_side must be 'left' or 'right', got {side!r}")
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, int):
        raise ValueError(f"truncate_prompt_tokens must be an integer, got {k!r}")
    if k == -1:
        return max_model_len
    if k < 1:
        raise ValueError(f"truncate_prompt_tokens must be -1 or at least 1, got {k}")
    if k > max_model_len:
        raise ValueError(f"truncate_prompt_tokens ({k}) cannot be greater than max_model_len ({max_model_len})")
    return k


def _cut(ids: list[int], k: int | None, side: str) -> list[int]:
    if k is None or len(ids) <= k:
        return ids
    return ids[-k:] if side == "left" else ids[:k]


def pooling_token_ids(tokenizer: Any, item: str | list[int], k: int | None = None, side: str | None = None,
                      pair: str | None = None) -> list[int]:
    """A pooling input's token ids (a text, a text pair as a cross-encoder's tokenizer joins them,
    or token ids), cut to `k` tokens as vLLM cuts them: a text with no `side` is truncated by its
    tokenizer (on the tokenizer's truncation side, its special tokens kept, a pair longest first,
    as sentence-transformers truncates at max_seq_length); with a `side`, or token ids, the ids are
    cut, the last k kept for 'left' and the first k for 'right' (the tokenizer's side when none)."""
    if isinstance(item, str):
        if k is not None and side is None:
            return list(tokenizer.hf(item, pair, truncation=True, max_length=k)["input_ids"])
        ids = list(tokenizer.hf(item, pair)["input_ids"]) if pair is not None else tokenizer.encode(item)
    else:
        ids = list(item)
    return _cut(ids, k, side or getattr(tokenizer.hf, "truncation_side", "right"))


def pair_token_ids(tokenizer: Any, text_1: str, text_2: str, k: int | None = None,
                   side: str | None = None) -> list[int]:
    """A cross-encoder's input for a text pair, as its tokenizer joins them ([CLS] a [SEP] b [SEP])."""
    return pooling_token_ids(tokenizer, text_1, k, side, pair=text_2)


def score_pairs(data_1: str | Sequence[str], data_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text against each of the others (1:N), or pairwise (N:N)."""
    one = [data_1] if isinstance(data_1, str) else list(data_1)
    two = [data_2] if isinstance(data_2, str) else list(data_2)
    if not one or not two:
        raise ValueError("score needs at least one text on each side")
    for t in (*one, *two):
        if not isinstance(t, str):
            raise ValueError(f"score takes texts, got {type(t).__name__}")
    if len(one) == 1:
        return [(one[0], t) for t in two]
    if len(one) != len(two):
        raise ValueError(f"score pairs texts 1:1, 1:N or N:N (one to one): got {len(one)} and {len(two)} texts "
                         "(or pass one text first)")
    return list(zip(one, two))


def cosine(a: Any, b: Any) -> float:
    import torch

    return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=0))


class PoolingAPI:
    """Mixed into `LLM` (which provides llm_engine, _counter, _run_engine and _as_prompt_list).

    Every call takes vLLM's truncation: `truncate_prompt_tokens=k` (or, as vLLM 0.32 spells it,
    `tokenization_kwargs={"truncate_prompt_tokens": k, "truncation_side": "left" | "right"}`)
    keeps k tokens of each prompt (-1: the model's context), as `pooling_token_ids` cuts them."""

    llm_engine: Any

    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               use_tqdm: bool = True, *, truncate_prompt_tokens: int | None = None,
               tokenization_kwargs: dict[str, Any] | None = None) -> list[PoolingRequestOutput]:
        """Pools each prompt's hidden states (`outputs.data`, a float32 tensor), by the model's
        pooler config unless `pooling_params` says otherwise."""
        prompt_list = self._as_prompt_list(prompts)  # type: ignore[attr-defined]
        k, side = self._truncation(truncate_prompt_tokens, tokenization_kwargs)
        if k is not None:
            prompt_list = [self._truncated(p, k, side) for p in prompt_list]
        n = len(prompt_list)
        params = self._per_prompt(pooling_params or PoolingParams(), n, "pooling_params")  # type: ignore[attr-defined]
        ids: list[str] = []
        try:
            for prompt, p in zip(prompt_list, params):
                rid = str(next(self._counter))  # type: ignore[attr-defined]
                self.llm_engine.add_request(rid, prompt, p)
                ids.append(rid)
        except ValueError:
            self.llm_engine.abort_request(ids)  # reject the batch as a whole
            raise
        return self._run_engine(ids, use_tqdm)  # type: ignore[attr-defined, no-any-return]

    def embed(self, prompts: PromptType | Sequence[PromptType], *, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None, truncate_prompt_tokens: int | None = None,
              tokenization_kwargs: dict[str, Any] | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`outputs.embedding`, a list of floats)."""
        params = pooling_params or PoolingParams()
        if params.task != "embed":
            raise ValueError(f"embed takes pooling_params with task 'embed', got {params.task!r}")
        outs = self.encode(prompts, params, use_tqdm, truncate_prompt_tokens=truncate_prompt_tokens,
                           tokenization_kwargs=tokenization_kwargs)
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(self, prompts: PromptType | Sequence[PromptType], *, use_tqdm: bool = True,
                 pooling_params: PoolingParams | None = None, truncate_prompt_tokens: int | None = None,
                 tokenization_kwargs: dict[str, Any] | None = None) -> list[ClassificationRequestOutput]:
        """A classifier's class probabilities per prompt (`outputs.probs`)."""
        params = pooling_params or PoolingParams(task="classify")
        if params.task != "classify":
            raise ValueError(f"classify takes pooling_params with task 'classify', got {params.task!r}")
        outs = self.encode(prompts, params, use_tqdm, truncate_prompt_tokens=truncate_prompt_tokens,
                           tokenization_kwargs=tokenization_kwargs)
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], /, *, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None, truncate_prompt_tokens: int | None = None,
              tokenization_kwargs: dict[str, Any] | None = None) -> list[ScoringRequestOutput]:
        """A score per text pair (`outputs.score`): a cross-encoder's (its classifier's activated
        logit) or, for an embedding model, the cosine similarity of the two embeddings. With
        truncation, a cross-encoder's pair is cut as one input, an embedding model's texts each."""
        pairs = score_pairs(data_1, data_2)
        k, side = self._truncation(truncate_prompt_tokens, tokenization_kwargs)
        from pagedllm.models.loader.pooling import is_classifier

        if is_classifier(self.llm_engine.model_config.hf_config):
            tok = self.llm_engine.tokenizer
            prompts = [{"prompt_token_ids": pair_token_ids(tok, a, b, k, side)} for a, b in pairs]
            params = pooling_params or PoolingParams(task="classify")
            outs = self.encode(prompts, params, use_tqdm)
            return [self._scoring(o, float(o.outputs.data[0])) for o in outs]
        texts = list(dict.fromkeys([t for pair in pairs for t in pair]))
        params = pooling_params or PoolingParams(task="embed")
        by_text = dict(zip(texts, self.encode(texts, params, use_tqdm, truncate_prompt_tokens=k,
                                              tokenization_kwargs={"truncation_side": side} if side else None)))
        out = []
        for a, b in pairs:
            ea, eb = by_text[a], by_text[b]
            ids = ea.prompt_token_ids + eb.prompt_token_ids
            out.append(ScoringRequestOutput(f"{ea.request_id}-{eb.request_id}",
                                            ScoringOutput(cosine(ea.outputs.data, eb.outputs.data)), ids))
        return out

    def _truncation(self, k: int | None, kwargs: dict[str, Any] | None) -> tuple[int | None, str | None]:
        """(tokens to keep or None, side or None) from the keyword and tokenization_kwargs."""
        kwargs = dict(kwargs or {})
        unknown = sorted(set(kwargs) - {"truncate_prompt_tokens", "truncation_side"})
        if unknown:
            raise ValueError(f"tokenization_kwargs takes truncate_prompt_tokens and truncation_side, got {unknown}")
        if k is not None and kwargs.get("truncate_prompt_tokens") not in (None, k):
            raise ValueError(f"truncate_prompt_tokens={k} and tokenization_kwargs' "
                             f"{kwargs['truncate_prompt_tokens']} disagree")
        k = k if k is not None else kwargs.get("truncate_prompt_tokens")
        side = kwargs.get("truncation_side")
        if side is not None and k is None:
            raise ValueError("truncation_side applies with truncate_prompt_tokens only")
        return resolve_truncation(k, side, self.llm_engine.model_config.max_model_len), side

    def _truncated(self, prompt: PromptType, k: int, side: str | None) -> PromptType:
        tok = self.llm_engine.tokenizer
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return {"prompt_token_ids": pooling_token_ids(tok, list(prompt["prompt_token_ids"]), k, side)}
            if isinstance(prompt.get("prompt"), str):
                return {"prompt_token_ids": pooling_token_ids(tok, prompt["prompt"], k, side)}
            return prompt  # the engine names what is wrong with it
        if isinstance(prompt, (str, list)):
            return {"prompt_token_ids": pooling_token_ids(tok, prompt, k, side)}
        return prompt

    @staticmethod
    def _scoring(o: PoolingRequestOutput, score: float) -> ScoringRequestOutput:
        return o.with_outputs(ScoringRequestOutput, ScoringOutput(score))
