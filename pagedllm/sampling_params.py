"""Sampling parameters for one request, with vLLM's field names, defaults and validation rules."""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field
from typing import Any

# Temperatures below this are treated as greedy, as vLLM does.
_SAMPLING_EPS = 1e-5
# Bounds that keep one request from exhausting the engine.
MAX_N = 128
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LEN = 1024


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class StructuredOutputsParams:
    """Constrains a request's output to a structure (vLLM's `StructuredOutputsParams`).

    Exactly one of `json`, `regex`, `choice`, `grammar`, `json_object` and `structural_tag` is set.
    The engine compiles it into a grammar (xgrammar or llguidance, see `--structured-outputs-config`)
    and masks, at every step, the tokens that would leave it.
    """

    json: str | dict[str, Any] | None = None
    """A JSON schema (as a dict or its JSON text) the output must validate against."""
    regex: str | None = None
    """A regular expression the whole output must match."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """A context-free grammar in EBNF (GBNF / Lark syntax)."""
    json_object: bool | None = None
    """The output is any JSON object."""
    structural_tag: str | None = None
    """A structural tag (JSON text): free text in which tagged regions follow their schemas."""
    disable_fallback: bool = False
    """Fail instead of trying the other backend when the chosen one cannot compile this."""
    disable_any_whitespace: bool = False
    """JSON without free whitespace between tokens (the compact form)."""
    disable_additional_properties: bool = False
    """Treat JSON objects as if the schema said `additionalProperties: false`."""
    whitespace_pattern: str | None = None
    """A regex for the whitespace allowed between JSON tokens (llguidance only)."""
    _backend: str | None = field(default=None, repr=False)
    """The backend that enforces it, chosen when the request is validated."""

    KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

    def __post_init__(self) -> None:
        if self.json_object is False:
            self.json_object = None
        given = [k for k in self.KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, json_object and "
                f"structural_tag, got {given or 'none'}."
            )
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}.")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}.")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (object or string), got {self.json!r}.")

    @property
    def kind(self) -> str:
        """Which of the KINDS this is."""
        return next(k for k in self.KINDS if getattr(self, k) is not None)

    def to_dict(self) -> dict[str, Any]:
        """The fields that are set (the wire form, and the key of the compiled grammar)."""
        return {k: v for k, v in self.__dict__.items() if v is not None and v is not False}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StructuredOutputsParams:
        return cls(**d)


class RequestOutputKind(enum.Enum):
    """How `RequestOutput`s report text: the whole text so far, only the new part, or only at the end."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """How to sample the continuation of one prompt (field names and rules follow vLLM)."""

    n: int = 1
    """Number of output sequences to return for the prompt."""
    presence_penalty: float = 0.0
    """Penalizes tokens that already appeared in the output (in [-2, 2])."""
    frequency_penalty: float = 0.0
    """Penalizes tokens by how often they appeared in the output (in [-2, 2])."""
    repetition_penalty: float = 1.0
    """Multiplicative penalty for tokens seen in the prompt or output (> 0, 1 = off)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (in (0, 1])."""
    top_k: int = 0
    """Keep only the top_k most likely tokens (0 or -1 = all)."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely one's (in [0, 1])."""
    seed: int | None = None
    """Per-request random seed: the same seed gives the same samples whatever else is batched."""
    stop: str | list[str] | None = None
    """Strings that end generation; not included in the output unless include_stop_str_in_output."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation (included in token_ids, not in the text if special)."""
    ignore_eos: bool = False
    """Keep generating after the EOS token."""
    max_tokens: int | None = 16
    """Maximum number of tokens to generate; None means up to max_model_len."""
    min_tokens: int = 0
    """Generate at least this many tokens before EOS or stop_token_ids may end the request."""
    logprobs: int | None = None
    """Number of top alternatives to return with each sampled token's logprob (0 = sampled token only)."""
    prompt_logprobs: int | None = None
    """Number of top alternatives to return with each prompt token's logprob."""
    detokenize: bool = True
    """Produce text, not only token ids."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text."""
    spaces_between_special_tokens: bool = True
    """Kept for vLLM compatibility; the tokenizer's decoder decides spacing."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the text."""
    logit_bias: dict[int, float] | None = None
    """Added to the logits of the given token ids before sampling."""
    allowed_token_ids: list[int] | None = None
    """If set, only these token ids may be sampled."""
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    """What each RequestOutput carries (used by streaming front ends)."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrains the output to a JSON schema, regex, choice or grammar (see StructuredOutputsParams)."""
    thinking_token_budget: int | None = None
    """With a reasoning model: end the thinking section after this many tokens (the engine then
    forces the end-of-thinking token, and the answer follows)."""
    _all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.seed == -1:
            self.seed = None
        self._verify_args()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the other sampling knobs do not apply.
            self.temperature = 0.0
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
        if self.top_k == -1:
            self.top_k = 0
        self._all_stop_token_ids = set(self.stop_token_ids)

    def _verify_args(self) -> None:
        if not isinstance(self.n, int) or isinstance(self.n, bool):
            raise ValueError(f"n must be an int, but is of type {type(self.n).__name__}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.n > MAX_N:
            raise ValueError(f"n must be at most {MAX_N}, got {self.n}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool):
            raise ValueError(f"top_k must be an integer, got {type(self.top_k).__name__}.")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}.")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}.")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}.")
        assert isinstance(self.stop, list)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}.")
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}.")
            if len(s) > MAX_STOP_STRING_LEN:
                raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_LEN} characters, got {len(s)}.")
        for t in self.stop_token_ids or []:
            if not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}.")
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) == 0:
            raise ValueError("allowed_token_ids is not None and empty!")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            if isinstance(self.structured_outputs, dict):
                self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
            else:
                raise ValueError(
                    f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}."
                )
        if self.thinking_token_budget is not None and (
            not isinstance(self.thinking_token_budget, int) or isinstance(self.thinking_token_budget, bool)
            or self.thinking_token_budget < 0
        ):
            raise ValueError(f"thinking_token_budget must be a non-negative integer, got {self.thinking_token_budget!r}.")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True.")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def all_stop_token_ids(self) -> set[int]:
        return self._all_stop_token_ids

    def verify_vocab(self, vocab_size: int) -> None:
        """Checks token ids named in the params against the model's vocabulary."""
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids or []),
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("logit_bias", list((self.logit_bias or {}).keys())),
        ):
            bad = [t for t in ids if not 0 <= int(t) < vocab_size]
            if bad:
                raise ValueError(f"{name} contains out-of-vocabulary token ids {bad[:8]} (vocab size {vocab_size}).")

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        if self.structured_outputs is not None:
            d["structured_outputs"] = self.structured_outputs.to_dict()
        return d
