"""How many tokens speculative decoding proposes: per request, from the acceptance measured so far;
per step, from how many rows the step can take before it stops being bound by reading weights.

Per request (`SpecController.num_tokens`): each verification tells how many of the proposed tokens
were tried (the accepted ones and the first rejected one, min(a + 1, k)) and how many of those were
accepted (a). Both counts start from a prior (PRIOR_ACCEPTED of PRIOR_TRIED) and decay by DECAY per
verification, so the estimate q = accepted / tried is the acceptance of a proposed token over the
request's recent steps. The j-th proposal of a step is
only verified (and only yields a token) when the j - 1 before it were accepted: it is worth a row
of the step while q^j >= MIN_GAIN, so the request proposes the largest such j, up to k. A request
with no verification yet proposes k. Where q^1 < MIN_GAIN the request proposes nothing; every
PROBE_EVERY of its decode steps it proposes one token anyway (a probe), so a request whose text
turns repetitive later finds its way back.

A proposer may also say what kind of proposal it makes (`kind`: method ngram gives the length of
the match it proposes from): each kind of a request then has counts of its own, since how often a
proposal lands depends on it. On edit tasks, an n-gram proposal after a match of the request's
last token alone had its first token rejected 84% of the time, one after a match of 4 tokens 2%
(default model, the eight tasks of `pagedllm bench spec --workload edit`, k = 8): with one count
per request, the long matches' proposals were cut short by the short ones' failures, and the short
ones went on taking 1 + k rows of a step.

Per step (`SpecController.spare_rows`): a decode step on a CPU reads every weight once for all its
rows; while its rows are few, an extra row costs little, and once they are many the step is bound
by computing them: its time grows with its rows, a rejected proposal costs as much as a decode and
an accepted one saves nothing. `max_rows` is the most rows a step may hold with proposals
(`max_spec_rows`, a per-host rule logged at start-up); a step's proposals take the rows its
running requests leave below it, in scheduling order, and from max_rows running requests on
speculation is off.

The rule: the fused native decode step's time, measured on the 2-core Xeon (AMX) host in bf16 with
256 tokens of context per row (docs/benchmarks.md), is 6.3 ms at 1 row, 9.5 at 4, 11.6 at 8, 15.1
at 16, 24.9 at 32, 43.4 at 64 and 80.0 at 128: from about 32 rows each doubling of the rows nearly
doubles the step (1.7x, 1.8x). In float32 on AVX-512 (13.0 ms at 1 row, 26.9 at 16, 51.4 at 32,
105 at 64) the same holds from 16-32 rows. So on a CPU a step takes proposals up to CPU_ROWS rows:
where it is at about four times its one-row time. A GPU's decode step stays bound by reading the
weights over many more rows (its GEMMs reach their compute rate from a few hundred rows):
GPU_ROWS, not measured here.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

DECAY = 0.8
"""Weight of a request's earlier verifications against its latest one (per verification)."""
MIN_GAIN = 0.1
"""Least chance of being accepted for which a proposed token is worth a row of the step."""
PROBE_EVERY = 16
"""Decode steps without proposals after which a request proposes one token again."""
PRIOR_ACCEPTED, PRIOR_TRIED = 1.0, 2.0
"""The counts a request starts from (an acceptance of one half, worth a few verifications), so
that one rejected step does not end its speculation."""
CPU_ROWS = 32
"""Most rows of a step with proposals on a CPU (module docstring)."""
GPU_ROWS = 256
"""Most rows of a step with proposals on a GPU."""


def max_spec_rows(device: str) -> int:
    """The most rows a step may hold with proposals on this device ('cpu' or 'cuda')."""
    return GPU_ROWS if device == "cuda" else CPU_ROWS


@dataclass
class _Acceptance:
    accepted: float = PRIOR_ACCEPTED
    tried: float = PRIOR_TRIED
    idle_steps: int = 0  # decode steps since the last proposals

    @property
    def rate(self) -> float:
        return self.accepted / self.tried if self.tried > 0 else 1.0


def tokens_worth_proposing(rate: float, k: int) -> int:
    """The largest j <= k with rate^j >= MIN_GAIN (0 when even the first is not)."""
    j, p = 0, 1.0
    while j < k:
        p *= rate
        if p < MIN_GAIN:
            break
        j += 1
    return j


class SpecController:
    """Per-request proposal lengths and the step's rows left for proposals (module docstring)."""

    def __init__(self, k: int, max_rows: int) -> None:
        if k < 1 or max_rows < 1:
            raise ValueError(f"k ({k}) and max_rows ({max_rows}) must be at least 1")
        self.k = k
        self.max_rows = max_rows
        self._state: dict[str, dict[Hashable, _Acceptance]] = {}
        """Each request's counts, by the kind of proposal (None where the proposer names none)."""
        self.rows_left = 0
        """Rows the step being scheduled still has for proposals."""

    def spare_rows(self, num_running: int) -> int:
        """Rows a step with this many running requests has for proposals."""
        return max(0, self.max_rows - num_running)

    def begin_step(self, num_running: int) -> None:
        self.rows_left = self.spare_rows(num_running)

    def allowance(self, request_id: str, room: int, kind: Hashable = None) -> int:
        """Tokens this request may propose in the step being scheduled (at most `room`), as
        proposals of this kind."""
        if self.rows_left < 1:
            return 0
        return min(self.num_tokens(request_id, kind), room, self.rows_left)

    def took(self, num_proposed: int) -> None:
        self.rows_left -= num_proposed

    def num_tokens(self, request_id: str, kind: Hashable = None) -> int:
        """How many tokens of this kind to propose for this request's next decode step (0 to k).
        Counts the step as one without proposals when it returns 0; the caller reports proposals
        it makes with record()."""
        s = self._state.get(request_id, {}).get(kind)
        if s is None:
            return self.k
        n = tokens_worth_proposing(s.rate, self.k)
        if n > 0:
            return n
        s.idle_steps += 1
        if s.idle_steps >= PROBE_EVERY:
            s.idle_steps = 0
            return 1
        return 0

    def record(self, request_id: str, num_proposed: int, num_accepted: int, kind: Hashable = None) -> None:
        """A verification of num_proposed tokens of this kind, num_accepted of them accepted."""
        if num_proposed < 1:
            return
        kinds = self._state.setdefault(request_id, {})
        s = kinds.get(kind)
        if s is None:
            s = kinds[kind] = _Acceptance()
        s.accepted = DECAY * s.accepted + num_accepted
        s.tried = DECAY * s.tried + min(num_accepted + 1, num_proposed)
        s.idle_steps = 0

    def rate(self, request_id: str, kind: Hashable = None) -> float:
        """The request's acceptance estimate for proposals of this kind (1.0 before the first
        verification of one)."""
        s = self._state.get(request_id, {}).get(kind)
        return 1.0 if s is None else s.rate

    def forget(self, request_id: str) -> None:
        self._state.pop(request_id, None)
