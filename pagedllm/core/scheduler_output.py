"""The engine <-> worker contract: what to compute this step, and what came out. No torch here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the worker has not seen (or must forget and re-learn after a recompute preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: set[int] | frozenset[int]
    block_ids: list[int]
    num_computed_tokens: int
    # The LoRA adapter it runs with: (name, id, folder), or None for the base model.
    lora_request: tuple[str, int, str] | None = None
    # A pooling request's PoolingParams (resolved): the worker pools its hidden states instead of sampling.
    pooling: Any = None


@dataclass
class CachedRequestData:
    """A request the worker already holds: only what changed."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # (index in its block table, new block id): entries replaced by a private copy (copy-on-write),
    # applied before new_block_ids are appended. The copy itself is in blocks_to_copy.
    replaced_block_ids: list[tuple[int, int]] = field(default_factory=list)
    # Speculative decoding: when >= 0, the table is first cut to this many blocks (the blocks of
    # rejected proposals were freed), before new_block_ids are appended.
    num_blocks: int = -1


@dataclass
class ForkedRequestData:
    """A sample of an n > 1 request split off its parent in the step that completes the parent's
    prompt. After the forward pass the worker creates it with the parent's tokens and
    `block_ids` (the parent's table: the blocks are shared, ref-counted by the scheduler) and
    samples its first token from the parent's last logits with its own parameters. Forked
    requests follow the scheduled ones in ModelRunnerOutput.req_ids, in this list's order."""

    req_id: str
    parent_id: str
    sampling_params: SamplingParams
    block_ids: list[int]


@dataclass
class SchedulerOutput:
    new_reqs: list[NewRequestData]
    cached_reqs: list[CachedRequestData]
    # req_id -> tokens to compute this step, in batch order (new requests after cached ones).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the worker must forget: finished, aborted or preempted since the last step.
    finished_req_ids: set[str] = field(default_factory=set)
    # The subset of finished_req_ids that were preempted and will be sent again in full later.
    preempted_req_ids: set[str] = field(default_factory=set)
    # Block moves, done in every layer before the forward pass. The worker reads every source
    # before it writes any destination (a block freed by one move may be another's destination).
    # Swap-out: (device block, host block); swap-in: (host block, device block).
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Copy-on-write: (source block, destination block), both on the device.
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Samples of n > 1 requests forked off their parent this step (see ForkedRequestData).
    forked_reqs: list[ForkedRequestData] = field(default_factory=list)
    num_preempted: int = 0
    # Structured output: one int32 row of token bits (bit i of word j allows token 32j+i) per
    # constrained sequence that samples this step, and req_id -> its row. The driver applies the
    # rows to those sequences' logits before sampling. A torch tensor, filled by the engine core.
    grammar_bitmask: Any = None
    structured_rows: dict[str, int] = field(default_factory=dict)
    # Speculative decoding: req_id -> the tokens proposed after its last one. Such a request is
    # scheduled for 1 + len(proposals) tokens; the worker verifies them and returns the accepted
    # ones followed by one token of the target's own (pagedllm/worker/spec_decode.py).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class Logprobs:
    """Logprobs for a run of positions: for each, the chosen token first, then the top-k."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


@dataclass
class PooledOutput:
    """A pooling request's result: float32 values, row-major, of this shape ([dims], or [tokens,
    hidden] for pooling type ALL)."""

    shape: list[int]
    data: bytes


@dataclass
class ModelRunnerOutput:
    # The scheduled requests in batch order, then the forked ones.
    req_ids: list[str]
    # Per request in req_ids: the tokens sampled this step (empty while its prompt is unfinished;
    # a speculating request's accepted proposals, then its own token).
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, Logprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, Logprobs] = field(default_factory=dict)
    # req_id -> error, for requests whose sampling raised this step (they sampled nothing; the
    # scheduler ends them with finish_reason "error"). The rest of the batch is unaffected.
    failed: dict[str, str] = field(default_factory=dict)
    # req_id -> pooled output, for pooling requests whose last prompt chunk ran this step.
    pooled: dict[str, PooledOutput] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    """What one step produced for one request, handed from the scheduler to the engine."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    # Why the engine ended this request, when finish_reason is "error".
    error: str | None = None
    pooled: PooledOutput | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
