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
from pagedllm.core.scheduler_output import EngineCoreOutput
from pagedllm.engine.snapshot import EngineSnapshot
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
    lora_request: tuple[str, int, str] | None = None
    """The LoRA adapter (name, id, folder), checked by the front end; None: the base model."""
    # A pooling request's resolved PoolingParams as a dict (sampling_params then holds the defaults).
    pooling: dict[str, Any] | None = None

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

    scheduler: SchedulerStats
    num_scheduled_tokens: int = 0
    num_preempted: int = 0
    step_time: float = 0.0

    @classmethod
    def idle(cls) -> StepStats:
        return cls(SchedulerStats(0, 0, 0, 0.0, 0, 0, 0))


class EngineCoreOutputs(msgspec.Struct, array_like=True):
    """One step's outputs (EngineCoreOutput dataclasses travel as MessagePack maps) and stats."""

    outputs: list[EngineCoreOutput]
    stats: StepStats


class MsgKind(enum.IntEnum):
    ADD = 0
    ABORT = 1
    SHUTDOWN = 2
    READY = 3
    OUTPUTS = 4
    DEAD = 5
    STOP = 6
    WATCH = 7  # front end -> engine core: a viewer watches (True) or none does (False)
    SNAPSHOT = 8  # engine core -> front end: an EngineSnapshot, while watched


class EngineReady(msgspec.Struct, array_like=True):
    """Sent once the model is loaded and the KV cache allocated."""

    num_blocks: int
    pid: int


# Every message is (kind, payload): one frame of MessagePack.
_PAYLOADS: dict[MsgKind, Any] = {
    MsgKind.ADD: EngineCoreRequest,
    MsgKind.ABORT: list[str],
    MsgKind.SHUTDOWN: None,
    MsgKind.READY: EngineReady,
    MsgKind.OUTPUTS: EngineCoreOutputs,
    MsgKind.DEAD: str,
    MsgKind.STOP: list[str],
    MsgKind.WATCH: bool,
    MsgKind.SNAPSHOT: EngineSnapshot,
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
