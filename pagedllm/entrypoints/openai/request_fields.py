"""vLLM's request fields beyond OpenAI's: each one is honoured or answered with HTTP 400 naming it.

Honoured: the structured-output fields (`response_format`, `structured_outputs` and the older
`guided_*` names, mapped onto `SamplingParams.structured_outputs`), `thinking_token_budget`,
`prompt_logprobs` (returned in vLLM's shape), `truncate_prompt_tokens` / `truncation_side`,
`request_id`, `return_token_ids`, chat `echo`, and the defaults of the fields that change nothing.
Refused with 400 when set to anything but their no-op value: what the engine does not have (beam
search, watermarking, bad words, logits processors, KV / encoder-cache transfer, custom extension
arguments, repetition detection, multimodal kwargs, prompt embeddings, ...). docs/structured-output.md
lists every field and its status. Fields that neither OpenAI nor vLLM define stay tolerated and
logged (`OpenAIServing.log_ignored_fields`).
"""

from __future__ import annotations

import json
from typing import Any

from pagedllm.entrypoints.openai.engine_call import EnginePrompt
from pagedllm.entrypoints.openai.errors import bad_request
from pagedllm.entrypoints.openai.protocol import PromptLogprob, PromptLogprobsOut, SamplingFields
from pagedllm.outputs import Logprob
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.structured_output import validate_structured_outputs

# (field, its no-op value, why another value cannot be honoured). A field absent from the body
# reads as its default, which is the no-op value.
UNSUPPORTED: tuple[tuple[str, Any, str], ...] = (
    ("use_beam_search", False, "beam search is not supported by this server"),
    ("length_penalty", 1.0, "length_penalty applies to beam search, which this server does not support"),
    ("watermarking", None, "watermarking is not supported by this server"),
    ("bad_words", None, "bad_words is not supported by this server"),
    ("logprob_token_ids", None, "logprob_token_ids is not supported by this server (use logprobs)"),
    ("logits_processors", None, "per-request logits processors are not supported by this server"),
    ("session_id", None, "session_id is not supported by this server (one engine, no session routing)"),
    ("kv_transfer_params", None, "KV transfer (disaggregated serving) is not supported by this server"),
    ("ec_transfer_params", None, "encoder-cache transfer is not supported by this server"),
    ("vllm_xargs", None, "vllm_xargs (custom extension arguments) is not supported by this server"),
    ("repetition_detection", None, "repetition_detection is not supported by this server"),
    ("routed_experts_prompt_start", 0, "routed-expert data is not returned by this server"),
    ("return_token_offsets", False, "return_token_offsets applies to the render endpoints, which this server lacks"),
    ("return_mm_kwargs", True, "return_mm_kwargs applies to the render endpoints, which this server lacks"),
    ("return_tokens_as_token_ids", None, "return_tokens_as_token_ids is not supported by this server"),
    ("prompt_embeds", None, "prompt_embeds is not supported by this server"),
    ("media_io_kwargs", None, "media_io_kwargs is not supported (this server serves text-only models)"),
    ("mm_processor_kwargs", None, "mm_processor_kwargs is not supported (this server serves text-only models)"),
    ("return_prompt_text", None, "return_prompt_text is not supported by this server"),
)
# Values that equal the no-op (an empty list or dict, False for an optional flag) are accepted too.
_EMPTY = (None, False, [], {})

# JSON has no infinity: the logprob of an impossible token is reported as this (as elsewhere).
_MIN_LOGPROB = -9999.0

# vLLM's older structured-output names -> the StructuredOutputsParams field each maps to.
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def reject_unsupported(body: SamplingFields) -> None:
    """400 naming the first vLLM field set to something this server cannot honour."""
    for name, noop, why in UNSUPPORTED:
        value = getattr(body, name, noop)
        if value == noop or (value in _EMPTY and noop in _EMPTY):
            continue
        raise bad_request(f"{name}={_shown(value)}: {why}", name)
    if body.stream_interval not in (None, 1):
        raise bad_request(
            f"stream_interval={body.stream_interval}: this server sends every token as it comes (only 1)",
            "stream_interval",
        )


def check_chat(body: Any) -> None:
    """The chat-only vLLM fields this server cannot honour."""
    if body.chat_template is not None:
        raise bad_request(
            "a chat_template in the request is not trusted (as vLLM without --trust-request-chat-template); "
            "this server's template is set with --chat-template",
            "chat_template",
        )
    if body.return_token_ids:
        raise bad_request("return_token_ids is supported on /v1/completions only", "return_token_ids")


def structured_outputs(body: SamplingFields, server_backend: str) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's structure (from `response_format`, `structured_outputs` or the `guided_*`
    fields) and the field it came from; 400 naming the fields when more than one gives a structure."""
    sources: list[tuple[str, dict[str, Any]]] = []
    options: dict[str, Any] = {}
    rf = _response_format(body.response_format)
    if rf is not None:
        sources.append(("response_format", rf))
    so = body.structured_outputs
    if so is not None:
        d = so.model_dump(by_alias=True, exclude_defaults=True)
        kinds = {k: v for k, v in d.items() if k in StructuredOutputsParams.KINDS and v is not None}
        if so.json_object is False:
            kinds.pop("json_object", None)
        options.update({k: v for k, v in d.items() if k not in StructuredOutputsParams.KINDS})
        if kinds:
            sources.append(("structured_outputs", kinds))
    for name, kind in GUIDED_FIELDS.items():
        value = getattr(body, name)
        if value is not None:
            sources.append((name, {kind: value}))
    if body.guided_whitespace_pattern is not None:
        options["whitespace_pattern"] = body.guided_whitespace_pattern
    if body.guided_decoding_backend is not None and body.guided_decoding_backend != server_backend:
        raise bad_request(
            f"guided_decoding_backend={body.guided_decoding_backend!r}: a request cannot choose its backend; "
            f"this server runs {server_backend!r} (set --structured-outputs-config backend at start)",
            "guided_decoding_backend",
        )
    if len(sources) > 1:
        names = [s[0] for s in sources]
        raise bad_request(f"only one structured-output field may be given, got {', '.join(names)}", names[0])
    if not sources:
        if options:
            raise bad_request(
                f"structured_outputs options {sorted(options)} need one of {list(StructuredOutputsParams.KINDS)}",
                "structured_outputs" if so is not None else "guided_whitespace_pattern",
            )
        return None, None
    param, kind = sources[0]
    try:
        return StructuredOutputsParams(**kind, **options), param
    except (TypeError, ValueError) as e:
        raise bad_request(f"{param}: {e}", param) from None


def check_structure(params: SamplingParams, param: str | None, server_backend: str) -> None:
    """Compiles the request's structure once here so that a bad schema, regex or grammar is a 400
    naming the field the client used (the engine's front end checks it again, from its cache)."""
    if params.structured_outputs is None:
        return
    try:
        validate_structured_outputs(params, server_backend)
    except ValueError as e:
        raise bad_request(f"{param}: {e}", param) from None


def _response_format(rf: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI's / vLLM's response_format as a structure ({} for text), 400 naming it when malformed.

    `json_schema.strict` is accepted and the schema is enforced as given, as vLLM does (OpenAI's
    strict mode requires schemas that already close their objects with additionalProperties: false;
    use structured_outputs.disable_additional_properties to close them here)."""
    if rf is None:
        return None
    kind = rf.get("type")
    if kind == "text":
        _only_keys(rf, {"type"})
        return None
    if kind == "json_object":
        _only_keys(rf, {"type"})
        return {"json_object": True}
    if kind == "json_schema":
        _only_keys(rf, {"type", "json_schema"})
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise bad_request("response_format type 'json_schema' needs a 'json_schema' object", "response_format")
        unknown = set(js) - {"name", "schema", "strict", "description"}
        if unknown:
            raise bad_request(f"response_format.json_schema has unknown keys {sorted(unknown)}", "response_format")
        if not isinstance(js.get("name"), str):
            raise bad_request("response_format.json_schema.name must be a string", "response_format")
        if js.get("strict") not in (None, True, False):
            raise bad_request("response_format.json_schema.strict must be a boolean", "response_format")
        schema = js.get("schema")
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema.schema must be a JSON schema object", "response_format")
        return {"json": schema}
    if kind == "structural_tag":
        if not ({"structures", "triggers"} <= set(rf) or "format" in rf):
            raise bad_request(
                "response_format type 'structural_tag' needs 'format', or 'structures' and 'triggers'",
                "response_format",
            )
        return {"structural_tag": json.dumps(rf)}
    raise bad_request(
        f"response_format.type {kind!r} is not supported (text, json_object, json_schema, structural_tag)",
        "response_format.type",
    )


def _only_keys(d: dict[str, Any], allowed: set[str]) -> None:
    unknown = set(d) - allowed
    if unknown:
        raise bad_request(f"response_format type {d.get('type')!r} has unknown keys {sorted(unknown)}", "response_format")


def thinking_token_budget(body: SamplingFields, reasoning_parser: str | None) -> int | None:
    """vLLM's rule: a non-negative integer, or -1 for no limit (treated as unset). A budget needs a
    reasoning model served with --reasoning-parser, which says where the thinking ends."""
    b = body.thinking_token_budget
    if b is None or b == -1:
        return None
    if b < 0:
        raise bad_request(f"thinking_token_budget must be -1 or non-negative, got {b}", "thinking_token_budget")
    if reasoning_parser is None:
        raise bad_request(
            f"thinking_token_budget={b} needs a reasoning model served with --reasoning-parser",
            "thinking_token_budget",
        )
    return b


def prompt_logprobs(body: SamplingFields, max_logprobs: int) -> int | None:
    """The requested prompt_logprobs, checked as vLLM does (not with stream; -1 = the whole vocabulary
    is more than any server limit here)."""
    k = body.prompt_logprobs
    if k is None:
        return None
    if body.stream:
        raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")
    if k < 0:
        if k == -1:
            raise bad_request(
                f"prompt_logprobs=-1 (the whole vocabulary) is more than the server's limit of {max_logprobs}",
                "prompt_logprobs",
            )
        raise bad_request(f"prompt_logprobs must be non-negative or -1, got {k}", "prompt_logprobs")
    if k > max_logprobs:
        raise bad_request(f"prompt_logprobs={k} is more than the server's limit of {max_logprobs}", "prompt_logprobs")
    return k


def truncate(prompt: EnginePrompt, body: SamplingFields, max_model_len: int, max_tokens: int | None) -> EnginePrompt:
    """`truncate_prompt_tokens=k` keeps the last k prompt tokens (the first k with
    truncation_side='right'); -1 keeps what fits before max_tokens within max_model_len."""
    k = body.truncate_prompt_tokens
    if k is None:
        return prompt
    if k == -1:
        k = max(max_model_len - (max_tokens or 0), 1)
    elif k < 1:
        raise bad_request(f"truncate_prompt_tokens must be -1 or at least 1, got {k}", "truncate_prompt_tokens")
    elif k > max_model_len:
        raise bad_request(
            f"truncate_prompt_tokens ({k}) cannot be greater than max_model_len ({max_model_len})",
            "truncate_prompt_tokens",
        )
    ids = prompt.token_ids
    if len(ids) <= k:
        return prompt
    kept = ids[:k] if body.truncation_side == "right" else ids[-k:]
    return EnginePrompt(kept, None)


def top_of(d: dict[int, Logprob], k: int, token: int) -> dict[int, Logprob]:
    """A position's entries cut to the top k by rank, plus the token that is there."""
    return {tid: lp for tid, lp in d.items() if tid == token or (lp.rank is not None and lp.rank <= k)}


def prompt_logprobs_out(
    token_ids: list[int], plp: list[dict[int, Logprob] | None] | None, k: int, token_text: Any
) -> PromptLogprobsOut:
    """vLLM's `prompt_logprobs`: None for the first token, then for each prompt token its own
    logprob and the top k, keyed by token id, with rank and decoded text."""
    positions = list(plp or [])
    positions += [None] * (len(token_ids) - len(positions))
    result: PromptLogprobsOut = []
    for i, (tid, d) in enumerate(zip(token_ids, positions)):
        if i == 0 or d is None:
            result.append(None)
            continue
        result.append({
            t: PromptLogprob(
                logprob=lp.logprob if lp.logprob > _MIN_LOGPROB else _MIN_LOGPROB,  # -inf, NaN -> floor
                rank=lp.rank,
                decoded_token=lp.decoded_token if lp.decoded_token is not None else token_text(t),
            )
            for t, lp in top_of(d, k, tid).items()
        })
    return result


def response_id(prefix: str, body: SamplingFields, random: str) -> str:
    """vLLM's rule: a request's own `request_id` names the response (`<prefix>-<request_id>`)."""
    if body.request_id is None:
        return random
    if not body.request_id or len(body.request_id) > 256:
        raise bad_request("request_id must be 1 to 256 characters", "request_id")
    return f"{prefix}-{body.request_id}"


def chat_echo(body: Any, conversation_last: dict[str, Any] | None) -> str:
    """Chat `echo`: the last message's content, when its role is the reply's role (the assistant
    with a generation prompt, else the last message's own role), prefixes the reply."""
    if not body.echo or conversation_last is None:
        return ""
    role = "assistant" if body.add_generation_prompt else conversation_last.get("role")
    if conversation_last.get("role") != role:
        return ""
    content = conversation_last.get("content")
    return content if isinstance(content, str) else ""


def _shown(value: Any) -> str:
    s = json.dumps(value, default=str)
    return s if len(s) <= 60 else s[:57] + "..."
