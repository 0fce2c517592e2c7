"""Offline API: `LLM(model=...).generate(prompts, sampling_params)` and `.chat(messages)`."""

from __future__ import annotations

import copy
import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.lora.request import LoRARequest
from pagedllm.llm_pooling import PoolingAPI
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.tokenizer import TokenizerWrapper

logger = logging.getLogger(__name__)


class LLM(PoolingAPI):
    """Generates for a batch of prompts with continuous batching; outputs come back in input order.
    A pooling model embeds, classifies and scores them instead (llm_pooling.PoolingAPI)."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine_args = EngineArgs(model=model, **engine_args)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args)
        self._counter = itertools.count()

    def get_tokenizer(self) -> TokenizerWrapper:
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prompt prefix, so that the next requests prefill in full (as on a
        fresh engine); blocks of requests in flight stay theirs. Returns True, as vLLM's does."""
        self.llm_engine.reset_prefix_cache()
        return True

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        user: Sequence[str | None] | None = None,
        cache_salt: Sequence[str | None] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        if self.llm_engine.model_config.runner == "pooling":
            raise ValueError(f"{self.llm_engine.model_config.served_model_name!r} runs with runner='pooling': use "
                             "embed(), encode(), classify() or score(), or start it with runner='generate'")
        prompt_list = self._as_prompt_list(prompts)
        n = len(prompt_list)
        params_list = [
            self._final_only(p) for p in self._per_prompt(sampling_params or SamplingParams(), n, "sampling_params")
        ]
        prio = self._per_prompt(priority, n, "priority") if priority is not None else [0] * n
        users = self._per_prompt(user, n, "user") if user is not None else [None] * n
        salts = self._per_prompt(cache_salt, n, "cache_salt") if cache_salt is not None else [None] * n
        loras = self._per_prompt(lora_request, n, "lora_request")
        ids = []
        try:
            for i, prompt in enumerate(prompt_list):
                rid = str(next(self._counter))
                self.llm_engine.add_request(rid, prompt, params_list[i], priority=prio[i], user=users[i],
                                            cache_salt=salts[i], lora_request=loras[i])
                ids.append(rid)
        except ValueError:
            self.llm_engine.abort_request(ids)  # reject the batch as a whole: nothing half-queued stays
            raise
        return self._run_engine(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation and generates its reply (vLLM's
        argument order): `lora_request` one adapter for all or one per conversation, `tools` (JSON
        schemas of functions) and `chat_template_kwargs` (e.g. `enable_thinking`) passed to the
        template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.get_tokenizer()
        extra = dict(chat_template_kwargs or {})
        if tools is not None:
            extra["tools"] = tools
        prompts: list[PromptType] = []
        for conv in conversations:
            text = tok.apply_chat_template(conv, add_generation_prompt, chat_template, continue_final_message, **extra)
            prompts.append({"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    @staticmethod
    def _final_only(params: SamplingParams) -> SamplingParams:
        # Offline generation only needs each request's final output, not one per step.
        if params.output_kind == RequestOutputKind.FINAL_ONLY:
            return params
        params = copy.copy(params)
        params.output_kind = RequestOutputKind.FINAL_ONLY
        return params

    @staticmethod
    def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]  # a single token-id prompt
        return list(prompts)  # type: ignore[arg-type]

    @staticmethod
    def _per_prompt(value: Any, n: int, name: str) -> list[Any]:
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
            return list(value)
        return [value] * n

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        t0 = time.perf_counter()
        in_tokens = out_tokens = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        in_tokens += len(out.prompt_token_ids)
                        if isinstance(out, RequestOutput):
                            out_tokens += sum(len(c.token_ids) for c in out.outputs)
                        elapsed = time.perf_counter() - t0
                        bar.set_postfix_str(
                            f"input: {in_tokens / elapsed:.1f} toks/s, output: {out_tokens / elapsed:.1f} toks/s")
                        bar.update(1)
        except BaseException:
            # A request failed (or the caller interrupted): the rest of this call's requests end
            # too, so that the engine is left empty for the next call.
            engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            bar.close()
        return [finished[r] for r in request_ids if r in finished]
