"""The API server <-> engine-core messages survive MessagePack unchanged (no pickle involved)."""

from __future__ import annotations

import msgspec
import pytest

from pagedllm.core.scheduler import SchedulerStats
from pagedllm.core.scheduler_output import EngineCoreOutput, Logprobs
from pagedllm.engine.core_io import Codec, EngineCoreOutputs, EngineCoreRequest, EngineReady, MsgKind, StepStats
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


def test_messages_round_trip() -> None:
    codec = Codec()
    params = SamplingParams(n=2, temperature=0.7, top_k=5, seed=3, stop=["\n\n"], logit_bias={7: -2.5},
                            output_kind=RequestOutputKind.DELTA, max_tokens=9)
    req = EngineCoreRequest("r", ["0_r", "1_r"], [1, 2, 3], EngineCoreRequest.params_to_wire(params), 9, 12.5,
                            priority=2, user="u", cache_salt="s")
    kind, back = codec.decode(codec.encode(MsgKind.ADD, req))
    assert kind == MsgKind.ADD and back == req
    assert back.params() == params
    outs = EngineCoreOutputs(
        [EngineCoreOutput("0_r", [5], "length", None, Logprobs([[5, 6]], [[-0.1, -2.0]], [1]), None, 16, 1.5),
         EngineCoreOutput("1_r", []), EngineCoreOutput("2_r", [], "error", error="IndexError: out of bounds")],
        StepStats(SchedulerStats(1, 2, 0, 0.25, 30, 16, 1, {"recompute": 1}), 40, 0, 0.01),
    )
    kind, back = codec.decode(codec.encode(MsgKind.OUTPUTS, outs))
    assert kind == MsgKind.OUTPUTS and back == outs and back.outputs[0].finished
    for kind, payload in ((MsgKind.ABORT, ["a", "b"]), (MsgKind.STOP, ["c"]), (MsgKind.DEAD, "boom"),
                          (MsgKind.READY, EngineReady(64, 123)), (MsgKind.SHUTDOWN, None)):
        assert codec.decode(codec.encode(kind, payload)) == (kind, payload)


def test_malformed_frames_are_refused() -> None:
    codec = Codec()
    with pytest.raises(msgspec.ValidationError):
        codec.decode(codec.encode(MsgKind.ADD, {"not": "a request"}))
    with pytest.raises((msgspec.DecodeError, ValueError)):
        codec.decode(b"\x80\x04\x95 not msgpack")  # e.g. a pickle


def test_runner_output_with_failed_requests_round_trips() -> None:
    """The worker -> engine message of the parallel executors carries the failed requests too."""
    from pagedllm.core.scheduler_output import ModelRunnerOutput
    from pagedllm.executor.messages import decode, encode, runner_output_from

    out = ModelRunnerOutput(["a", "b"], [[3], []], failed={"b": "SamplingFaultInjected: injected"})
    assert runner_output_from(decode(encode(out))) == out
