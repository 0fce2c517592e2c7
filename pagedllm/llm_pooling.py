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


def pair_token_ids(tokenizer: Any, text_1: str, text_2: str) -> list[int]:
    """A cross-encoder's input for a text pair, as its tokenizer joins them ([CLS] a [SEP] b [SEP])."""
    return list(tokenizer.hf(text_1, text_2)["input_ids"])


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
        raise ValueError(f"score pairs texts one to one: got {len(one)} and {len(two)} texts (or pass one text first)")
    return list(zip(one, two))


def cosine(a: Any, b: Any) -> float:
    import torch

    return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=0))


class PoolingAPI:
    """Mixed into `LLM` (which provides llm_engine, _counter, _run_engine and _as_prompt_list)."""

    llm_engine: Any

    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """Pools each prompt's hidden states (`outputs.data`, a float32 tensor), by the model's
        pooler config unless `pooling_params` says otherwise."""
        prompt_list = self._as_prompt_list(prompts)  # type: ignore[attr-defined]
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
              pooling_params: PoolingParams | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`outputs.embedding`, a list of floats)."""
        params = pooling_params or PoolingParams()
        if params.task != "embed":
            raise ValueError(f"embed takes pooling_params with task 'embed', got {params.task!r}")
        return [EmbeddingRequestOutput.from_base(o) for o in self.encode(prompts, params, use_tqdm)]

    def classify(self, prompts: PromptType | Sequence[PromptType], *, use_tqdm: bool = True,
                 pooling_params: PoolingParams | None = None) -> list[ClassificationRequestOutput]:
        """A classifier's class probabilities per prompt (`outputs.probs`)."""
        params = pooling_params or PoolingParams(task="classify")
        if params.task != "classify":
            raise ValueError(f"classify takes pooling_params with task 'classify', got {params.task!r}")
        return [ClassificationRequestOutput.from_base(o) for o in self.encode(prompts, params, use_tqdm)]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], /, *, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """A score per text pair (`outputs.score`): a cross-encoder's (its classifier's activated
        logit) or, for an embedding model, the cosine similarity of the two embeddings."""
        pairs = score_pairs(data_1, data_2)
        from pagedllm.models.loader.pooling import is_classifier

        if is_classifier(self.llm_engine.model_config.hf_config):
            tok = self.llm_engine.tokenizer
            prompts = [{"prompt_token_ids": pair_token_ids(tok, a, b)} for a, b in pairs]
            params = pooling_params or PoolingParams(task="classify")
            outs = self.encode(prompts, params, use_tqdm)
            return [self._scoring(o, float(o.outputs.data[0])) for o in outs]
        texts = list(dict.fromkeys([t for pair in pairs for t in pair]))
        params = pooling_params or PoolingParams(task="embed")
        by_text = dict(zip(texts, self.encode(texts, params, use_tqdm)))
        out = []
        for a, b in pairs:
            ea, eb = by_text[a], by_text[b]
            ids = ea.prompt_token_ids + eb.prompt_token_ids
            out.append(ScoringRequestOutput(f"{ea.request_id}-{eb.request_id}",
                                            ScoringOutput(cosine(ea.outputs.data, eb.outputs.data)), ids))
        return out

    @staticmethod
    def _scoring(o: PoolingRequestOutput, score: float) -> ScoringRequestOutput:
        return o.with_outputs(ScoringRequestOutput, ScoringOutput(score))
