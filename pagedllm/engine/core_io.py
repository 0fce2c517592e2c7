"""What crosses between the API server process and the engine-core process, and its wire format.

Messages are msgspec structs encoded as MessagePack (never pickle on a socket). The front end
sends `EngineCoreRequest`s and aborts; the engine core answers with `EngineCoreOutputs` after
every step (and after commands that change its state while idle), carrying the scheduler's
statistics so that metrics never have to ask the engine.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from pagedllm.core.scheduler import SchedulerStats
from pagedllm.core.scheduler_output import EngineCoreOutput, Logprobs
from pagedllm.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One validated request: token ids, resolved limits and the ids of its n sequences."""

    request_id: str
    seq_ids: list[str]
    prompt_token_ids: list[int]
    sampling_params: dict[str, Any]
    max_tokens: int
    arrival_time: float
    priority: int = 0
    user: str | None = None
    cache_salt: str | None = None

    @staticmethod
    def params_to_wire(params: SamplingParams) -> dict[str, Any]:
        d = params.to_dict()
        d["output_kind"] = params.output_kind.value
        return d

    def params(self) -> SamplingParams:
        from pagedllm.sampling_params import RequestOutputKind

        d = dict(self.sampling_params)
        d["output_kind"] = RequestOutputKind(d.get("output_kind", 0))
        if d.get("logit_bias"):
            d["logit_bias"] = {int(k): float(v) for k, v in d["logit_bias"].items()}
        return SamplingParams(**d)


class StepStats(msgspec.Struct, array_like=True):
    """The scheduler's state after a step (or after idle commands) and what the step did."""

    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_preemptions_by_mode: dict[str, int]
    num_scheduled_tokens: int = 0
    num_preempted: int = 0
    step_time: float = 0.0

    @classmethod
    def from_scheduler(cls, s: SchedulerStats, **step: Any) -> StepStats:
        return cls(s.num_running, s.num_waiting, s.num_swapped, s.kv_cache_usage, s.prefix_cache_queries,
                   s.prefix_cache_hits, s.num_preemptions, dict(s.num_preemptions_by_mode), **step)

    def scheduler_stats(self) -> SchedulerStats:
        return SchedulerStats(self.num_running, self.num_waiting, self.num_swapped, self.kv_cache_usage,
                              self.prefix_cache_queries, self.prefix_cache_hits, self.num_preemptions,
                              dict(self.num_preemptions_by_mode))


class WireLogprobs(msgspec.Struct, array_like=True):
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class WireOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: WireLogprobs | None = None
    prompt_logprobs: WireLogprobs | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True):
    outputs: list[WireOutput]
    stats: StepStats


class MsgKind(enum.IntEnum):
    ADD = 0
    ABORT = 1
    SHUTDOWN = 2
    READY = 3
    OUTPUTS = 4
    DEAD = 5
    STOP = 6


class EngineReady(msgspec.Struct, array_like=True):
    """Sent once the model is loaded and the KV cache allocated."""

    num_blocks: int
    pid: int


def _wire_lp(lp: Logprobs | None) -> WireLogprobs | None:
    return None if lp is None else WireLogprobs(lp.token_ids, lp.logprobs, lp.ranks)


def _core_lp(lp: WireLogprobs | None) -> Logprobs | None:
    return None if lp is None else Logprobs(lp.token_ids, lp.logprobs, lp.ranks)


def to_wire(o: EngineCoreOutput) -> WireOutput:
    return WireOutput(o.req_id, o.new_token_ids, o.finish_reason, o.stop_reason, _wire_lp(o.logprobs),
                      _wire_lp(o.prompt_logprobs), o.num_cached_tokens, o.first_scheduled_time)


def from_wire(o: WireOutput) -> EngineCoreOutput:
    return EngineCoreOutput(o.req_id, o.new_token_ids, o.finish_reason, o.stop_reason, _core_lp(o.logprobs),
                            _core_lp(o.prompt_logprobs), o.num_cached_tokens, o.first_scheduled_time)


# Every message is (kind, payload): one frame of MessagePack.
_PAYLOADS: dict[MsgKind, Any] = {
    MsgKind.ADD: EngineCoreRequest,
    MsgKind.ABORT: list[str],
    MsgKind.SHUTDOWN: None,
    MsgKind.READY: EngineReady,
    MsgKind.OUTPUTS: EngineCoreOutputs,
    MsgKind.DEAD: str,
    MsgKind.STOP: list[str],
}


class Codec:
    """MessagePack encoding of (kind, payload) pairs, typed on decode."""

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder()
        self.raw = msgspec.msgpack.Decoder(tuple[int, msgspec.Raw])
        self.decoders = {k: msgspec.msgpack.Decoder(t) for k, t in _PAYLOADS.items() if t is not None}

    def encode(self, kind: MsgKind, payload: Any = None) -> bytes:
        return self.encoder.encode((int(kind), payload))

    def decode(self, data: bytes) -> tuple[MsgKind, Any]:
        kind_value, raw = self.raw.decode(data)
        kind = MsgKind(kind_value)
        dec = self.decoders.get(kind)
        return kind, (dec.decode(raw) if dec is not None else None)
