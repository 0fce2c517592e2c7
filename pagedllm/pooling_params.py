"""What a pooling request asks for (vLLM's `PoolingParams`), and --pooler-config's parser.

A pooling request is a prompt whose hidden states are pooled into one vector (or, with pooling
type ALL, one per token) instead of being sampled from. Each field left None takes the served
model's `PoolerConfig` default when the engine accepts the request (`resolved`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pagedllm.config import POOLING_TYPES, PoolerConfig, read_json_object

POOLING_TASKS = ("embed", "classify", "encode")
"""embed: a pooled, optionally normalised vector; classify: the classifier head's scores (its
activation applied); encode: the pooled hidden states as they are (no normalisation unless asked)."""


@dataclass
class PoolingParams:
    """Per request: how its hidden states are pooled and post-processed."""

    task: str = "embed"
    pooling_type: str | None = None
    """LAST, MEAN, CLS or ALL; None: the model's pooler config."""
    normalize: bool | None = None
    """L2-normalise the pooled vector; None: the model's pooler config (embed), off (encode)."""
    dimensions: int | None = None
    """Keep the first `dimensions` values (Matryoshka); None: the pooler config's, else all."""
    activation: bool | None = None
    """classify: apply sigmoid (one label) or softmax (several); None: the pooler config's."""

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"pooling task must be one of {POOLING_TASKS}, got {self.task!r}")
        if self.pooling_type is not None:
            self.pooling_type = str(self.pooling_type).upper()
            if self.pooling_type not in POOLING_TYPES:
                raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")

    def resolved(self, config: PoolerConfig, hidden_size: int, is_classifier: bool) -> PoolingParams:
        """Every field filled in from the model's pooler config; ValueError naming a bad value."""
        dims = self.dimensions if self.dimensions is not None else config.dimensions
        if self.task == "classify" and not is_classifier:
            raise ValueError("this model has no classifier head: classify/score with a cross-encoder "
                             "(a *ForSequenceClassification model), or embed")
        if dims is not None and (self.task == "classify" or dims > hidden_size):
            raise ValueError(f"dimensions={dims} is not supported: the model's embeddings have {hidden_size} "
                             "values" if self.task != "classify" else
                             f"dimensions={dims} does not apply to a classifier's scores")
        if self.task == "embed":
            normalize = config.normalize if self.normalize is None else self.normalize
        else:
            normalize = bool(self.normalize)
        return PoolingParams(
            task=self.task,
            pooling_type=self.pooling_type or config.pooling_type,
            normalize=normalize and self.task != "classify",
            dimensions=dims,
            activation=(config.activation if self.activation is None else self.activation),
        )

    @property
    def uses_prefix_cache(self) -> bool:
        """Whether the request may take cached prefix blocks: only LAST pooling, whose one hidden
        state (the last prompt token's) is always computed; MEAN, CLS and ALL need the hidden
        states of positions a cache hit would skip."""
        return self.pooling_type == "LAST"

    def clone(self) -> PoolingParams:
        return dataclasses.replace(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def pooler_overrides(text: str | dict[str, Any] | PoolerConfig | None) -> dict[str, Any]:
    """The keys --pooler-config sets (vLLM's JSON, e.g. '{"pooling_type": "MEAN", "normalize": true}'),
    validated (ValueError naming an unknown key or a bad value); the keys left out keep the model's
    defaults."""
    if text is None:
        return {}
    if isinstance(text, PoolerConfig):
        return dataclasses.asdict(text)
    out = read_json_object(text, PoolerConfig, '{"pooling_type": "MEAN", "normalize": true}')
    if isinstance(out.get("pooling_type"), str):
        out["pooling_type"] = out["pooling_type"].upper()
    PoolerConfig(**out)  # validates the values given
    return out


def attach_pooling(request: Any, pooling: dict[str, Any], model_config: Any) -> None:
    """Makes a scheduler Request a pooling one (an encoder's prompt also unchunkable)."""
    request.pooling = PoolingParams(**pooling)
    request.chunkable = not model_config.is_encoder
