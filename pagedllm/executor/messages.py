"""msgpack encoding of the engine <-> worker messages (SchedulerOutput in, ModelRunnerOutput
out): typed data only, never pickle (a grammar bitmask goes as its shape and bytes)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import msgspec
import torch

from pagedllm.core.scheduler_output import (
    CachedRequestData,
    ForkedRequestData,
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    PooledOutput,
    SchedulerOutput,
)
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

def _enc_hook(obj: Any) -> Any:
    # The step's grammar bitmask (an int32 tensor) travels as its shape and raw bytes.
    if isinstance(obj, torch.Tensor) and obj.dtype == torch.int32:
        return {"shape": list(obj.shape), "int32": obj.contiguous().numpy().tobytes()}
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoder = msgspec.msgpack.Decoder()


def encode(obj: Any) -> bytes:
    """Dataclasses become maps, sets arrays, enums their values, int32 tensors shape + bytes."""
    return _encoder.encode(obj)


def _int32_tensor(d: dict[str, Any]) -> torch.Tensor:
    return torch.frombuffer(bytearray(d["int32"]), dtype=torch.int32).view(*d["shape"])


def decode(data: bytes | memoryview) -> Any:
    return _decoder.decode(data)


def _sampling_params(d: dict[str, Any]) -> SamplingParams:
    # Restored field by field: the values were validated and normalized once, in the engine.
    p = SamplingParams.__new__(SamplingParams)
    names = {f.name for f in fields(SamplingParams)}
    for k, v in d.items():
        if k in names:
            setattr(p, k, v)
    p.output_kind = RequestOutputKind(d["output_kind"])
    p._all_stop_token_ids = set(d["_all_stop_token_ids"])
    if d.get("logit_bias") is not None:
        p.logit_bias = {int(k): float(v) for k, v in d["logit_bias"].items()}
    return p


def scheduler_output_from(d: dict[str, Any]) -> SchedulerOutput:
    d = dict(d)
    d["new_reqs"] = [
        NewRequestData(**{**r, "sampling_params": _sampling_params(r["sampling_params"]),
                          "eos_token_ids": frozenset(r["eos_token_ids"]),
                          "pooling": PoolingParams(**r["pooling"]) if r.get("pooling") else None})
        for r in d["new_reqs"]
    ]
    d["cached_reqs"] = [
        CachedRequestData(**{**r, "replaced_block_ids": [tuple(x) for x in r["replaced_block_ids"]]})
        for r in d["cached_reqs"]
    ]
    d["forked_reqs"] = [
        ForkedRequestData(**{**r, "sampling_params": _sampling_params(r["sampling_params"])}) for r in d["forked_reqs"]
    ]
    d["finished_req_ids"] = set(d["finished_req_ids"])
    d["preempted_req_ids"] = set(d["preempted_req_ids"])
    for k in ("blocks_to_swap_out", "blocks_to_swap_in", "blocks_to_copy"):
        d[k] = [tuple(p) for p in d[k]]
    if d.get("grammar_bitmask") is not None:
        d["grammar_bitmask"] = _int32_tensor(d["grammar_bitmask"])
    return SchedulerOutput(**d)


def runner_output_from(d: dict[str, Any]) -> ModelRunnerOutput:
    return ModelRunnerOutput(
        req_ids=d["req_ids"],
        sampled_token_ids=d["sampled_token_ids"],
        logprobs={k: Logprobs(**v) for k, v in d["logprobs"].items()},
        prompt_logprobs={k: Logprobs(**v) for k, v in d["prompt_logprobs"].items()},
        failed=d.get("failed", {}),
        pooled={k: PooledOutput(**v) for k, v in d.get("pooled", {}).items()},
    )
