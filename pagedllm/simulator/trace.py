"""Request traces: JSON lines read with one clear error per bad line, or a synthetic generator.

A line: {"arrival_s": 0.5, "prompt_len": 512, "output_len": 128} with optional "priority" (int),
"user" (str), "prefix_id" and "prefix_len" (requests with the same prefix_id share their first
prefix_len prompt tokens). Arrivals must be non-decreasing.
"""

from __future__ import annotations

import json
import math
import random
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np


class TraceError(ValueError):
    """A trace that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    prompt_len: int
    output_len: int
    priority: int = 0
    user: str | None = None
    prefix_id: str | None = None
    prefix_len: int = 0

    def to_json(self) -> str:
        d = {k: v for k, v in asdict(self).items() if v not in (None, 0) or k in ("arrival_s", "prompt_len", "output_len")}
        return json.dumps(d)


_INT_FIELDS = ("prompt_len", "output_len")


def parse_trace_line(data: Any, where: str) -> TraceRequest:
    if not isinstance(data, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(data).__name__}")
    missing = [k for k in ("arrival_s", "prompt_len", "output_len") if k not in data]
    if missing:
        raise TraceError(f"{where}: missing field(s) {missing}")
    unknown = sorted(set(data) - {"arrival_s", "prompt_len", "output_len", "priority", "user", "prefix_id",
                                  "prefix_len"})
    if unknown:
        raise TraceError(f"{where}: unknown field(s) {unknown}")
    arrival = data["arrival_s"]
    if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not math.isfinite(arrival) or arrival < 0:
        raise TraceError(f"{where}: arrival_s must be a non-negative number, got {arrival!r}")
    for k in (*_INT_FIELDS, "prefix_len", "priority"):
        v = data.get(k, 0)
        if isinstance(v, bool) or not isinstance(v, int):
            raise TraceError(f"{where}: {k} must be an integer, got {v!r}")
    if data["prompt_len"] < 1 or data["output_len"] < 1:
        raise TraceError(f"{where}: prompt_len and output_len must be at least 1, got "
                         f"prompt_len={data['prompt_len']} output_len={data['output_len']}")
    prefix_len = data.get("prefix_len", 0)
    prefix_id = data.get("prefix_id")
    if prefix_len < 0 or prefix_len > data["prompt_len"]:
        raise TraceError(f"{where}: prefix_len must be in [0, prompt_len={data['prompt_len']}], got {prefix_len}")
    if prefix_len and prefix_id is None:
        raise TraceError(f"{where}: prefix_len={prefix_len} needs a prefix_id")
    user = data.get("user")
    if user is not None and not isinstance(user, str):
        raise TraceError(f"{where}: user must be a string, got {user!r}")
    return TraceRequest(float(arrival), data["prompt_len"], data["output_len"], data.get("priority", 0), user,
                        None if prefix_id is None else str(prefix_id), prefix_len)


def load_trace(path: str | Path) -> list[TraceRequest]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise TraceError(f"cannot read trace {str(p)!r}: {e.strerror}") from None
    reqs: list[TraceRequest] = []
    last = 0.0
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{p}:{lineno}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}: not valid JSON ({e.msg})") from None
        req = parse_trace_line(data, where)
        if req.arrival_s < last:
            raise TraceError(f"{where}: arrival_s={req.arrival_s} is earlier than the previous line's {last} "
                             "(arrivals must be sorted)")
        last = req.arrival_s
        reqs.append(req)
    if not reqs:
        raise TraceError(f"trace {str(p)!r} holds no requests")
    return reqs


def write_trace(reqs: list[TraceRequest], path: str | Path) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(r.to_json() + "\n" for r in reqs), encoding="utf-8")


def _lengths(rng: np.random.Generator, spec: str, n: int, name: str) -> np.ndarray:
    """'uniform:LO:HI', 'lognormal:MEAN:SIGMA[:MAX]', 'const:N' or 'N' / 'LO:HI' (uniform)."""
    parts = spec.split(":")
    try:
        if parts[0] == "const" or (len(parts) == 1 and parts[0].isdigit()):
            out = np.full(n, int(parts[-1]), dtype=np.int64)
        elif parts[0] == "lognormal":
            mean, sigma = float(parts[1]), float(parts[2])
            cap = int(parts[3]) if len(parts) > 3 else 1 << 30
            if not (mean > 0 and sigma >= 0):
                raise ValueError
            mu = math.log(mean) - sigma * sigma / 2  # so that the mean is `mean`
            out = np.clip(np.rint(rng.lognormal(mu, sigma, n)), 1, cap).astype(np.int64)
        else:
            lo, hi = (int(parts[1]), int(parts[2])) if parts[0] == "uniform" else (int(parts[0]), int(parts[1]))
            if not 1 <= lo <= hi:
                raise ValueError
            out = rng.integers(lo, hi + 1, n)
    except (ValueError, IndexError):
        raise TraceError(f"{name} {spec!r}: expected N, LO:HI, uniform:LO:HI, lognormal:MEAN:SIGMA[:MAX] "
                         "or const:N with positive integers") from None
    if n and out.min() < 1:
        raise TraceError(f"{name} {spec!r}: lengths must be at least 1")
    return out


def synthetic_trace(
    num_requests: int,
    rate: float,
    prompt_lens: str,
    output_lens: str,
    arrival: str = "poisson",
    burst_factor: float = 4.0,
    seed: int = 0,
    num_users: int = 0,
    num_prefixes: int = 0,
    prefix_len: int = 0,
) -> list[TraceRequest]:
    """`num_requests` requests; `rate` requests/s (0 or inf: all at time 0).

    poisson: exponential gaps; bursty: a gamma process with the same mean rate and squared
    coefficient of variation burst_factor (shape 1/burst_factor): clumps of arrivals and lulls.
    Prompts are prefix_len shared tokens (one of num_prefixes) plus their drawn length.
    """
    if num_requests < 1:
        raise TraceError(f"--num-requests must be at least 1, got {num_requests}")
    if arrival not in ("poisson", "bursty"):
        raise TraceError(f"arrival process must be poisson or bursty, got {arrival!r}")
    if not burst_factor > 0:
        raise TraceError(f"--burst-factor must be positive, got {burst_factor}")
    rng = np.random.default_rng(seed)
    prompts = _lengths(rng, prompt_lens, num_requests, "--prompt-lens")
    outputs = _lengths(rng, output_lens, num_requests, "--output-lens")
    if rate and math.isfinite(rate):
        if arrival == "poisson":
            gaps = rng.exponential(1.0 / rate, num_requests)
        else:
            shape = 1.0 / burst_factor
            gaps = rng.gamma(shape, 1.0 / (rate * shape), num_requests)
        gaps[0] = 0.0
        arrivals = np.round(np.cumsum(gaps), 6)
    else:
        arrivals = np.zeros(num_requests)
    users = rng.integers(0, num_users, num_requests) if num_users else None
    pids = rng.integers(0, num_prefixes, num_requests) if num_prefixes and prefix_len else None
    plen = prefix_len if pids is not None else 0
    return [
        TraceRequest(a, p + plen, o, 0, None if users is None else f"user{u}", None if pids is None else str(q), plen)
        for a, p, o, u, q in zip(arrivals.tolist(), prompts.tolist(), outputs.tolist(),
                                 users.tolist() if users is not None else [0] * num_requests,
                                 pids.tolist() if pids is not None else [0] * num_requests)
    ]


def prompt_token_ids(req: TraceRequest, index: int, vocab: int | None = None, seed: int = 0) -> list[int]:
    """Prompt token ids for a trace request: the shared prefix (same ids for the same prefix_id)
    then ids unique to the request. With `vocab`, random ids in [100, vocab) (for the real engine);
    without, distinct counting ids (cheap, for the simulator; only equality matters to it)."""
    own = req.prompt_len - req.prefix_len
    if vocab is None:
        prefix = []
        if req.prefix_len:
            tag = zlib.crc32(str(req.prefix_id).encode())
            prefix = [-(tag << 20) - i - 1 for i in range(req.prefix_len)]
        base = (index + 1) << 24
        return prefix + list(range(base, base + own))
    prefix = []
    if req.prefix_len:
        prng = random.Random(f"prefix-{seed}-{req.prefix_id}")
        prefix = [prng.randrange(100, vocab) for _ in range(req.prefix_len)]
    rng = random.Random(f"req-{seed}-{index}")
    return prefix + [rng.randrange(100, vocab) for _ in range(own)]
