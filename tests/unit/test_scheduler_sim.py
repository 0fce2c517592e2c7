"""Seeded randomized simulation of the scheduler against a fake worker that tracks KV contents.

Random arrivals (some sharing prompt prefixes), random aborts and a pool small enough to force
preemption. After every step: the scheduler's and the pool's integrity checks, and the fake
worker's own checks that every position a request attends to holds that request's token in the
block its block table names (so prefix hits, preemption and block reuse never serve wrong K/V).
"""

from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass, field

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.sampling_params import SamplingParams

MAX_PROMPT = 100
MAX_TOKENS = 50
AGING_STEPS = 50  # max_waiting_steps: small, so that the starvation bound below means something


def sampled_token(req_id: str, index: int) -> int:
    """The fake model's `index`-th output token for a request (deterministic, never below 10)."""
    return 10 + (zlib.crc32(req_id.encode()) + 7919 * index) % 30_000


@dataclass
class WorkerRequest:
    tokens: list[int]
    num_prompt: int
    block_table: list[int]
    num_computed: int


@dataclass
class FakeWorker:
    """The worker side of the SchedulerOutput contract, with the token stored in every KV slot."""

    block_size: int
    num_blocks: int
    reqs: dict[str, WorkerRequest] = field(default_factory=dict)
    # Preempted requests the worker was told about separately (if the output says so).
    parked: set[str] = field(default_factory=set)
    slots: list[list[int | None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.slots = [[None] * self.block_size for _ in range(self.num_blocks)]

    def check_reads(self, rid: str, r: WorkerRequest, end: int) -> None:
        """Positions [0, end) must hold the request's tokens in the blocks its table names."""
        bs = self.block_size
        assert len(r.block_table) * bs >= end, f"{rid}: {len(r.block_table)} blocks for {end} tokens"
        for i in range(math.ceil(end / bs)):
            k = min(bs, end - i * bs)
            got = self.slots[r.block_table[i]][:k]
            assert got == r.tokens[i * bs : i * bs + k], f"{rid}: block {r.block_table[i]} (#{i}) holds {got}"

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        preempted = getattr(so, "preempted_req_ids", set())
        for rid in so.finished_req_ids:
            if rid in self.reqs:
                del self.reqs[rid]
                if rid in preempted:
                    self.parked.add(rid)
            else:
                assert rid in self.parked, f"told to forget {rid}, which the worker never had"
                self.parked.discard(rid)
        assert list(so.num_scheduled_tokens) == [d.req_id for d in so.cached_reqs] + [d.req_id for d in so.new_reqs]
        for d in so.cached_reqs:
            r = self.reqs[d.req_id]
            assert d.num_computed_tokens == r.num_computed
            r.block_table += d.new_block_ids
        for d in so.new_reqs:
            assert d.req_id not in self.reqs
            self.parked.discard(d.req_id)
            r = WorkerRequest(
                list(d.prompt_token_ids) + list(d.output_token_ids),
                len(d.prompt_token_ids),
                list(d.block_ids),
                d.num_computed_tokens,
            )
            # Prefix-cache hits: whole blocks. They are read after this pass's writes (below), since
            # a block keyed by a request earlier in the same step is written by this very pass.
            assert r.num_computed % self.block_size == 0
            self.reqs[d.req_id] = r
        # One forward pass: every layer writes all new K/V before any attention reads the cache.
        bs = self.block_size
        for rid, n in so.num_scheduled_tokens.items():
            r = self.reqs[rid]
            assert r.num_computed + n <= len(r.tokens)
            for pos in range(r.num_computed, r.num_computed + n):
                self.slots[r.block_table[pos // bs]][pos % bs] = r.tokens[pos]
        sampled = []
        for rid, n in so.num_scheduled_tokens.items():
            r = self.reqs[rid]
            r.num_computed += n
            self.check_reads(rid, r, r.num_computed)
            if r.num_computed == len(r.tokens):
                t = sampled_token(rid, len(r.tokens) - r.num_prompt)
                r.tokens.append(t)
                sampled.append([t])
            else:
                sampled.append([])
        return ModelRunnerOutput(list(so.num_scheduled_tokens), sampled)


@dataclass
class SimCase:
    block_size: int
    num_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    long_prefill_token_threshold: int
    arrival_rate: float
    burst: int  # extra arrivals every 250 steps, so that queues build up and aging matters
    seed: int


CASES = {
    # Chunk thresholds that are not multiples of the block size leave a partial tail block, so a
    # keyed full block just before it outlives a preemption (and must not serve stale K/V).
    "bs4": SimCase(4, 96, 128, 8, 10, 0.1, 12, 1),
    "bs16": SimCase(16, 24, 60, 5, 12, 0.08, 10, 2),
    "bs8": SimCase(8, 48, 96, 8, 12, 0.12, 12, 6),
}


def drain_bound(case: SimCase) -> int:
    """Steps in which a running set, admitting nobody new, surely finishes or is preempted.

    max_num_batched_tokens >= max_num_seqs * long_prefill_token_threshold, so the running loop
    never runs out of budget: every running request gets its whole chunk (at most the threshold)
    or its decode token every step, or leaves `running` (preempted, finished, aborted). A request
    has at most MAX_PROMPT + MAX_TOKENS tokens to (re)compute, in chunks of the threshold, then at
    most MAX_TOKENS decode steps.
    """
    c = case.long_prefill_token_threshold
    assert case.max_num_batched_tokens >= case.max_num_seqs * c
    return math.ceil((MAX_PROMPT + MAX_TOKENS) / c) + MAX_TOKENS


def steps_to_drain(running: list[Request], threshold: int) -> int:
    """Steps until every running request has finished if each gets its full chunk (at most
    `threshold` tokens) or decode token every step: catch up on uncomputed tokens, then decode."""
    return max(
        (math.ceil((r.num_tokens - r.num_computed_tokens) / threshold) + r.max_tokens - r.num_output_tokens for r in running),
        default=0,
    )


def make_prompt(rng: random.Random, prefixes: list[list[int]]) -> list[int]:
    if rng.random() < 0.5:
        prefix = rng.choice(prefixes)
        suffix = rng.randint(0, MAX_PROMPT - len(prefix))
        return prefix + [rng.randint(10, 30_000) for _ in range(suffix)]
    return [rng.randint(10, 30_000) for _ in range(rng.randint(1, MAX_PROMPT))]


def simulate(
    policy: str, case: SimCase, arrival_steps: int = 1000, aging_steps: int = AGING_STEPS
) -> dict[str, int]:
    rng = random.Random(f"{policy}-{case.seed}")
    config = SchedulerConfig(
        max_num_batched_tokens=case.max_num_batched_tokens,
        max_num_seqs=case.max_num_seqs,
        max_model_len=MAX_PROMPT + MAX_TOKENS,
        policy=policy,
        long_prefill_token_threshold=case.long_prefill_token_threshold,
        max_waiting_steps=aging_steps,
        user_weights={"u0": 2.0, "u1": 1.0, "u2": 0.5},
    )
    kv = KVCacheManager(case.num_blocks, case.block_size, enable_caching=True)
    sched = Scheduler(config, kv)
    worker = FakeWorker(case.block_size, case.num_blocks)
    prefixes = [[rng.randint(10, 30_000) for _ in range(n)] for n in (8, 20, 33, 60)]

    requests: dict[str, Request] = {}
    outputs: dict[str, list[int]] = {}
    aborted: set[str] = set()
    finished: set[str] = set()
    arrival_step: dict[str, int] = {}
    aged_since: dict[str, int] = {}  # step at which a never-admitted request became aged
    served_ahead: dict[str, int] = {}  # admissions in earlier steps while it was aged and waiting
    first_admitted: dict[str, int] = {}
    deadline = math.inf
    max_k = 0
    T = drain_bound(case)
    max_wait = 0

    step = 0
    while step < arrival_steps or sched.has_unfinished_requests():
        assert step < arrival_steps + 20_000, "the simulation does not drain"
        # Arrivals.
        if step < arrival_steps:
            n_new = (rng.random() < case.arrival_rate) + (rng.random() < case.arrival_rate / 4)
            if step % 250 == 100:
                n_new += case.burst
            for j in range(n_new):
                rid = f"r{step}.{j}"
                prompt = make_prompt(rng, prefixes)
                req = Request(
                    rid,
                    prompt,
                    SamplingParams(max_tokens=rng.randint(1, MAX_TOKENS), ignore_eos=True),
                    eos_token_ids={10},
                    arrival_time=step + j / 100,
                    priority=rng.randint(0, 3),
                    user=rng.choice(["u0", "u1", "u2"]),
                )
                sched.add_request(req)
                requests[rid] = req
                arrival_step[rid] = step
        # Random aborts, of running and of waiting requests.
        if rng.random() < 0.03 and sched.has_unfinished_requests():
            victim = rng.choice(sched.running + sched.waiting)
            assert sched.finish_requests(victim.request_id, RequestStatus.FINISHED_ABORTED) == [victim]
            aborted.add(victim.request_id)
            sched.check_integrity()

        # Starvation bookkeeping, before the step (see test_randomized_simulation for the bound).
        aged = sorted((r for r in sched.waiting if r.waiting_steps >= aging_steps), key=lambda r: r.arrival_time)
        for r in aged:
            if r.request_id not in first_admitted:
                aged_since.setdefault(r.request_id, step)
        if aged:
            drain = steps_to_drain(sched.running, case.long_prefill_token_threshold)
            assert drain <= T
            deadline = min(deadline, step + drain)
        else:
            deadline = math.inf

        so = sched.schedule()
        assert so.total_num_scheduled_tokens <= case.max_num_batched_tokens
        assert len(sched.running) <= case.max_num_seqs
        for rid in so.num_scheduled_tokens:
            assert sched.requests[rid].status == RequestStatus.RUNNING
        admitted = [d.req_id for d in so.new_reqs]
        # Aging: while aged requests wait, they are admitted first, oldest arrival first ...
        for got, want in zip(admitted, aged):
            assert got == want.request_id, f"step {step}: admitted {got} before the aged {want.request_id}"
        # ... and the oldest is admitted at the latest once the running set has drained.
        assert admitted or step < deadline, f"step {step}: running set drained but aged {aged[0]} not admitted"
        if admitted:
            deadline = math.inf
            for other in aged_since:
                if other not in first_admitted and other not in admitted:
                    served_ahead[other] = served_ahead.get(other, 0) + 1
        for rid in admitted:
            if rid not in first_admitted:
                first_admitted[rid] = step
                wait = step - arrival_step[rid]
                max_wait = max(max_wait, wait)
                k = served_ahead.get(rid, 0)
                max_k = max(max_k, k)
                assert wait <= aging_steps + (k + 1) * (T + 1), f"{rid} waited {wait} steps ({k} served ahead)"

        out = worker.execute(so)
        for rid in so.num_scheduled_tokens:
            assert sched.requests[rid].num_computed_tokens == worker.reqs[rid].num_computed
        for res in sched.update_from_output(so, out):
            outputs.setdefault(res.req_id, []).extend(res.new_token_ids)
            if res.finished:
                assert res.finish_reason == "length"
                finished.add(res.req_id)
        sched.check_integrity()
        step += 1

    # Flush the last finished ids to the worker; then nothing may be left anywhere.
    worker.execute(sched.schedule())
    assert worker.reqs == {} and worker.parked == set()
    assert kv.usage == 0 and kv.num_free_blocks == case.num_blocks
    assert sched.requests == {} and not sched.running and not sched.waiting
    sched.check_integrity()
    assert finished | aborted == set(requests) and not finished & aborted
    for rid in finished:
        req = requests[rid]
        assert outputs[rid] == [sampled_token(rid, i) for i in range(req.max_tokens)], rid
        assert req.output_token_ids == outputs[rid]
    return {
        "steps": step,
        "requests": len(requests),
        "finished": len(finished),
        "aborted": len(aborted),
        "preemptions": sched.num_preemptions,
        "prefix_hits": kv.prefix_hits,
        "max_wait": max_wait,
        "bound_T": T,
        "max_k": max_k,
    }


@pytest.mark.parametrize("case_name", list(CASES))
@pytest.mark.parametrize("policy", ["fcfs", "priority", "srtf", "fair"])
def test_randomized_simulation(policy: str, case_name: str) -> None:
    """Also the starvation check, asserted inside `simulate` at every step and for every request.

    Derivation. A waiting request is *aged* once it has waited AGING_STEPS = 50 steps. The waiting
    loop then tries aged requests first, oldest arrival first, and stops at the first that does
    not fit: while an aged request waits, nobody younger is admitted and the running set only
    shrinks. Since max_num_batched_tokens >= max_num_seqs * long_prefill_token_threshold, every
    running request gets its whole chunk or decode token every step, or leaves `running`; so the
    running set is empty after D = steps_to_drain(running) steps, and the next step admits the
    oldest aged request (a whole pool fits any request: add_request checks that). D <= T =
    drain_bound(case) = ceil(150 / threshold) + 50: 65 steps for bs4 (threshold 10), 63 for
    bs16 and bs8 (threshold 12). Asserted:
      - per step: aged requests are admitted before anyone else, oldest first, and an admission
        happens at the latest D steps after a step that saw aged requests waiting;
      - per request: wait(R) = first admission step - arrival step
            <= AGING_STEPS + (k + 1) * (T + 1),
        where k is the number of requests admitted in earlier steps while R was aged (by the
        per-step check, each of them is aged and older than R).
    With aging the longest first-admission wait in these runs is 84 steps; with aging off
    (max_waiting_steps 100000) the same runs wait up to 199 (srtf), 562 (fair), 745 (priority).
    """
    stats = simulate(policy, CASES[case_name])
    print(policy, case_name, stats)
    assert stats["steps"] >= 1000
    assert stats["preemptions"] > 0
    assert stats["prefix_hits"] > 0
    assert stats["finished"] > 50 and stats["aborted"] > 0
