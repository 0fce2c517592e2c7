"""Request validation, once, in the front end, before any engine state changes: prompt forms and
vocabulary, sampling parameters against the vocabulary, length and KV capacity, n, and ids that
must not collide with a request (or a sample of an n > 1 request) already in flight."""

from __future__ import annotations

import time
from collections.abc import Container
from typing import Any, Union

from pagedllm.config import EngineConfig
from pagedllm.core.kv_groups import engine_kv_groups
from pagedllm.core.pooling import check_whole_prompt
from pagedllm.core.request_limits import check_request_limits
from pagedllm.engine.core_io import EngineCoreRequest
from pagedllm.engine.output_processor import child_id
from pagedllm.models.loader.pooling import is_classifier
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output import validate_structured_outputs
from pagedllm.tokenizer import TokenizerWrapper

# A prompt: text, token ids, or vLLM's dict forms {"prompt": ...} / {"prompt_token_ids": [...]}.
PromptType = Union[str, list[int], dict[str, Any]]


class Processor:
    def __init__(self, config: EngineConfig, tokenizer: TokenizerWrapper, num_blocks: int) -> None:
        self.config = config
        self.model_config = config.model_config
        self.tokenizer = tokenizer
        self.num_blocks = num_blocks
        self.kv_groups = engine_kv_groups(config.model_config, config.cache_config)
        self._reasoner: Any = None
        self.lora_checker: Any = None  # pagedllm.lora.registry.LoRAChecker, made on the first adapter

    def tokenize_prompt(self, prompt: PromptType, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt, validated against the vocabulary."""
        text: str | None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                text, ids = prompt["prompt"], None
            else:
                raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        elif isinstance(prompt, str):
            text, ids = prompt, None
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, list(prompt)
        else:
            raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
        if ids is None:
            if not isinstance(text, str):
                raise ValueError(f"prompt text must be a string, got {type(text).__name__}")
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if not ids:
            raise ValueError("The decoder prompt cannot be empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:8]} are out of vocabulary (vocab size {vocab})")
        return text, ids

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """A request's structure compiles (its backend chosen, see pagedllm/structured_output), and
        a thinking budget has a reasoning parser to end the thinking with."""
        so_config = self.config.structured_outputs_config
        try:
            validate_structured_outputs(params, so_config.backend)
        except ValueError as e:
            raise ValueError(f"structured_outputs: {e}") from None
        if params.thinking_token_budget is not None:
            if so_config.reasoning_parser is None:
                raise ValueError(
                    f"thinking_token_budget={params.thinking_token_budget} needs a reasoning model served with "
                    "--reasoning-parser (which names where the thinking ends)"
                )
            parser = self._reasoning_parser()
            if parser.end_token_id is None:
                raise ValueError(
                    f"thinking_token_budget={params.thinking_token_budget}: this tokenizer has no single token for "
                    f"{parser.end_text!r}, so the thinking cannot be ended by forcing it"
                )

    def check_lora(self, lora_request: Any) -> None:
        """Raises ValueError for a LoRA adapter the engine cannot serve (pagedllm/lora/registry.py)."""
        if self.lora_checker is None:
            from pagedllm.lora.registry import LoRAChecker

            self.lora_checker = LoRAChecker(self.config)
        self.lora_checker.check(lora_request)

    def resolve_pooling(self, params: PoolingParams) -> PoolingParams:
        """The request's pooling with the model's defaults filled in (ValueError naming a bad value)."""
        mc = self.model_config
        if mc.pooler_config is None:
            raise ValueError(f"model {mc.served_model_name!r} is served with --runner generate; pooling (embeddings, "
                             "scores) needs a server started with --runner pooling")
        return params.resolved(mc.pooler_config, int(mc.hf_config.hidden_size),
                               is_classifier(mc.hf_config))

    def make_pooling_request(
        self, request_id: str, prompt: PromptType, params: PoolingParams, in_use: Container[str],
        arrival_time: float | None = None, priority: int = 0, user: str | None = None,
    ) -> tuple[str | None, EngineCoreRequest]:
        """A pooling request: the prompt's hidden states pooled, nothing generated."""
        if request_id in in_use:
            raise ValueError(f"request id {request_id!r} collides with ids already in use: {[request_id]}")
        resolved = self.resolve_pooling(params)
        text, ids = self.tokenize_prompt(prompt)
        cc, sc = self.config.cache_config, self.config.scheduler_config
        check_request_limits(len(ids), 0, 1, sc, self.num_blocks, cc.block_size, self.kv_groups)
        if self.model_config.is_encoder:
            check_whole_prompt(len(ids), sc)
        req = EngineCoreRequest(
            request_id=request_id,
            seq_ids=[request_id],
            prompt_token_ids=ids,
            sampling_params=EngineCoreRequest.params_to_wire(SamplingParams(max_tokens=1, detokenize=False)),
            max_tokens=0,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=priority,
            user=user,
            pooling=resolved.to_dict(),
        )
        return text, req

    def _reasoning_parser(self) -> Any:
        if self._reasoner is None:
            from pagedllm.reasoning import get_reasoning_parser

            self._reasoner = get_reasoning_parser(self.config.structured_outputs_config.reasoning_parser)(self.tokenizer)
        return self._reasoner

    def make_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        in_use: Container[str],
        arrival_time: float | None = None,
        priority: int = 0,
        user: str | None = None,
        cache_salt: str | None = None,
        lora_request: Any = None,
    ) -> tuple[str | None, EngineCoreRequest]:
        """Validates everything about a request; raises ValueError and changes nothing on bad input.
        `in_use` holds the ids of requests and of their samples already in flight."""
        if isinstance(params, PoolingParams):
            if lora_request is not None:
                raise ValueError(f"lora_request={lora_request.lora_name!r}: LoRA adapters apply to generation requests, "
                                 "not pooling ones")
            return self.make_pooling_request(request_id, prompt, params, in_use, arrival_time, priority, user)
        n = params.n
        seq_ids = [child_id(request_id, i, n) for i in range(n)]
        taken = [i for i in dict.fromkeys([request_id, *seq_ids]) if i in in_use]
        if taken:
            raise ValueError(f"request id {request_id!r} collides with ids already in use: {taken}")
        text, ids = self.tokenize_prompt(prompt)
        params.verify_vocab(self.model_config.vocab_size)
        self.check_structured_outputs(params)
        if lora_request is not None:
            self.check_lora(lora_request)
        max_len = self.model_config.max_model_len
        max_tokens = params.max_tokens if params.max_tokens is not None else max(max_len - len(ids), 1)
        cc = self.config.cache_config
        check_request_limits(len(ids), max_tokens, n, self.config.scheduler_config, self.num_blocks, cc.block_size,
                             self.kv_groups)
        req = EngineCoreRequest(
            request_id=request_id,
            seq_ids=seq_ids,
            prompt_token_ids=ids,
            sampling_params=EngineCoreRequest.params_to_wire(params),
            max_tokens=max_tokens,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=priority,
            user=user,
            cache_salt=cache_salt,
            lora_request=lora_request.to_wire() if lora_request is not None else None,
        )
        return text, req
