"""A request body's sampling fields -> SamplingParams, validated once (400 on a bad value)."""

from __future__ import annotations

from typing import Any, TypeVar

from pagedllm.entrypoints.openai import request_fields
from pagedllm.entrypoints.openai.errors import bad_request
from pagedllm.entrypoints.openai.protocol import SamplingFields
from pagedllm.config import StructuredOutputsConfig
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

T = TypeVar("T")


def sampling_params_from_request(
    body: SamplingFields,
    vocab_size: int,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    output_kind: RequestOutputKind,
    structured_outputs_config: StructuredOutputsConfig | None = None,
) -> SamplingParams:
    """The request's sampling fields as SamplingParams (400 naming the field on a bad value), with
    vLLM's structured-output fields and thinking budget; vLLM fields this server cannot honour are
    a 400 naming them (request_fields.py)."""
    so_config = structured_outputs_config or StructuredOutputsConfig()
    request_fields.reject_unsupported(body)
    structure, structure_param = request_fields.structured_outputs(body, so_config.backend)
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request(f"best_of={body.best_of} is not supported (only best_of == n={body.n})", "best_of")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if body.seed is not None and not -(2**63) <= body.seed < 2**63:
        raise bad_request(f"seed must fit in 64 bits, got {body.seed}", "seed")
    logit_bias = None
    if body.logit_bias:
        logit_bias = {}
        for key, value in body.logit_bias.items():
            try:
                tid = int(key)
            except ValueError:
                raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
            if not -100.0 <= value <= 100.0:
                raise bad_request(f"logit_bias values must be in [-100, 100], got {value}", "logit_bias")
            logit_bias[tid] = value
    kwargs: dict[str, Any] = dict(
        n=body.n,
        presence_penalty=_default(body.presence_penalty, 0.0),
        frequency_penalty=_default(body.frequency_penalty, 0.0),
        repetition_penalty=_default(body.repetition_penalty, 1.0),
        temperature=_default(body.temperature, 1.0),
        top_p=_default(body.top_p, 1.0),
        top_k=_default(body.top_k, 0),
        min_p=_default(body.min_p, 0.0),
        seed=body.seed,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        logit_bias=logit_bias,
        allowed_token_ids=body.allowed_token_ids,
        output_kind=output_kind,
        structured_outputs=structure,
        thinking_token_budget=request_fields.thinking_token_budget(body, so_config.reasoning_parser),
    )
    try:
        params = SamplingParams(**kwargs)
        params.verify_vocab(vocab_size)
    except (ValueError, TypeError) as e:
        # SamplingParams names the field first ("top_p must be in (0, 1], got 0.0.").
        first = str(e).split(" ", 1)[0]
        raise bad_request(str(e), first if first in type(body).model_fields else None) from None
    request_fields.check_structure(params, structure_param, so_config.backend)
    return params


def _default(value: T | None, default: T) -> T:
    return default if value is None else value
