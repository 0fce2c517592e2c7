"""Seeded randomized simulation of the scheduler against a fake worker that tracks KV contents.

Random arrivals (some sharing prompt prefixes, some asking n > 1 samples), random aborts and a
pool small enough to force preemption, under every policy and preemption mode. After every step:
the scheduler's and both pools' integrity checks (device and host swap pool), and the fake
worker's own checks that every position a request attends to holds that request's token in the
block its block table names (so prefix hits, forks, copy-on-write, swapping, preemption and block
reuse never serve wrong K/V). The fake worker honours swap and copy pairs the way the model runner
does: every source is read before any destination is written.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_groups import plan_kv_groups
from pagedllm.core.preemption import PreemptionCostModel
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.spec_decode import Proposer
from pagedllm.sampling_params import SamplingParams
from fake_worker import FakeWorker, sampled_token

MAX_PROMPT = 100
MAX_TOKENS = 50
AGING_STEPS = 50  # max_waiting_steps: small, so that the starvation bound below means something
# Preemption mode auto: recompute costs n + 0.05 * n (n + 1) / 2 for n tokens, a swap 2 per token
# (2 x block_size per block), so victims with fewer than 39 computed tokens are recomputed.
SIM_COSTS = {"flops_per_second": 1.0, "copy_bytes_per_second": 1.0, "flops_per_token": 1.0,
             "attention_flops_per_pair": 0.05}


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


class ScriptedProposer(Proposer):
    """Speculative decoding's proposals for the simulation: up to 4 tokens, a random number of
    them the fake model's own next tokens and the rest wrong, so the fake worker accepts a random
    prefix and rejects the rest (their KV slots then hold wrong tokens until overwritten)."""

    def __init__(self, seed: str) -> None:
        super().__init__()
        self.rng = random.Random(seed)
        self.proposed = 0

    def propose(self, req: Request, max_tokens: int) -> list[int]:
        k = min(self.rng.randint(0, 4), max_tokens)
        good = self.rng.randint(0, k)
        self.proposed += k
        base = req.num_output_tokens
        return [sampled_token(req.request_id, base + j) + (j >= good) for j in range(k)]


def simulate(
    policy: str,
    mode: str,
    case: SimCase,
    arrival_steps: int = 1000,
    aging_steps: int = AGING_STEPS,
    layer_windows: tuple[int, ...] = (0,),
    speculate: bool = False,
    prefill_cap: int = 0,
) -> dict[str, object]:
    rng = random.Random(f"{policy}-{mode}-{case.seed}")
    config = SchedulerConfig(
        max_num_batched_tokens=case.max_num_batched_tokens,
        max_num_seqs=case.max_num_seqs,
        max_model_len=MAX_PROMPT + MAX_TOKENS,
        policy=policy,
        preemption_mode=mode,
        long_prefill_token_threshold=case.long_prefill_token_threshold,
        max_num_shared_prefill_tokens=prefill_cap,
        max_waiting_steps=aging_steps,
        time_slice=16,
        user_weights={"u0": 2.0, "u1": 1.0, "u2": 0.5},
    )
    # A host pool half the device pool's size: it fills up now and then (swap falls back to recompute).
    num_swap_blocks = 0 if mode == "recompute" else case.num_blocks // 2
    groups = plan_kv_groups(layer_windows)
    kv = KVCacheManager(case.num_blocks, case.block_size, enable_caching=True, num_swap_blocks=num_swap_blocks,
                        groups=groups)
    costs = PreemptionCostModel(**SIM_COSTS, kv_bytes_per_block=case.block_size)
    proposer = ScriptedProposer(f"{policy}-{mode}-{case.seed}") if speculate else None
    sched = Scheduler(config, kv, costs, proposer)  # type: ignore[arg-type]
    worker = FakeWorker(case.block_size, case.num_blocks, num_swap_blocks, windows=groups.windows)
    prefixes = [[rng.randint(10, 30_000) for _ in range(n)] for n in (8, 20, 33, 60)]

    requests: dict[str, Request] = {}
    parent_of: dict[str, str] = {}
    outputs: dict[str, list[int]] = {}
    aborted: set[str] = set()
    swap_dropped = 0
    finished: set[str] = set()
    arrival_step: dict[str, int] = {}
    aged_since: dict[str, int] = {}  # step at which a never-admitted request became aged
    served_ahead: dict[str, int] = {}  # admissions in earlier steps while it was aged and waiting
    first_admitted: dict[str, int] = {}
    deadline = math.inf
    max_k = 0
    T = drain_bound(case)
    max_wait = 0
    max_swapped = 0

    step = 0
    while step < arrival_steps or sched.has_unfinished_requests():
        assert step < arrival_steps + 20_000, "the simulation does not drain"
        # Arrivals; some ask for n = 2 or 3 samples (forked off sample 0 after its prompt).
        if step < arrival_steps:
            n_new = (rng.random() < case.arrival_rate) + (rng.random() < case.arrival_rate / 4)
            if step % 250 == 100:
                n_new += case.burst
            for j in range(n_new):
                rid = f"r{step}.{j}"
                prompt = make_prompt(rng, prefixes)
                n = rng.choice([2, 3]) if rng.random() < 0.15 else 1
                params = SamplingParams(n=n, max_tokens=rng.randint(1, MAX_TOKENS), ignore_eos=True)
                priority, user = rng.randint(0, 3), rng.choice(["u0", "u1", "u2"])
                group = [
                    Request(rid if i == 0 else f"{rid}/s{i}", prompt, params, eos_token_ids={10},
                            arrival_time=step + j / 100, priority=priority, user=user)
                    for i in range(n)
                ]
                sched.add_request(group[0], forks=group[1:])
                for req in group:
                    requests[req.request_id] = req
                    arrival_step[req.request_id] = step
                    parent_of[req.request_id] = rid
        # Random aborts: running, waiting, swapped, or a sample still waiting for its fork.
        if rng.random() < 0.03 and sched.has_unfinished_requests():
            victim = sched.requests[rng.choice(sorted(sched.requests))]
            swap_dropped += len(kv.swapped_blocks.get(victim.request_id, ()))  # never swapped back in
            assert sched.finish_requests(victim.request_id, RequestStatus.FINISHED_ABORTED) == [victim]
            aborted.add(victim.request_id)
            sched.check_integrity()
            # Samples still waiting for an aborted parent's fork go on alone: they wait from now on.
            for rid, parent in parent_of.items():
                if parent == victim.request_id and rid in sched.requests and rid not in first_admitted:
                    assert sched.requests[rid] in sched.waiting
                    arrival_step[rid] = step

        # Starvation bookkeeping, before the step (see test_randomized_simulation for the bound).
        aged = sorted((r for r in sched.waiting + sched.swapped if r.aged), key=lambda r: r.arrival_time)
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
        admitted = [d.req_id for d in so.new_reqs]  # admissions and resumes from the swap pool
        # Aging: while aged requests wait, they are admitted first, oldest arrival first ...
        # (the samples of one request arrive together: any order among them)
        for got, want in zip(admitted, aged):
            assert requests[got].aged and requests[got].arrival_time == want.arrival_time, (
                f"step {step}: admitted {got} before the aged {want.request_id}"
            )
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
        for f in so.forked_reqs:  # a forked sample starts when its parent's prompt is done
            assert f.req_id not in first_admitted and parent_of[f.req_id] == f.parent_id
            first_admitted[f.req_id] = step

        out = worker.execute(so)
        for rid in so.num_scheduled_tokens:  # speculating ones: after the rejected are taken back
            if rid not in so.spec_token_ids:
                assert sched.requests[rid].num_computed_tokens == worker.reqs[rid].num_computed
        for res in sched.update_from_output(so, out):
            outputs.setdefault(res.req_id, []).extend(res.new_token_ids)
            if res.finished:
                assert res.finish_reason == "length"
                finished.add(res.req_id)
            elif res.req_id in so.spec_token_ids:
                assert sched.requests[res.req_id].num_computed_tokens == worker.reqs[res.req_id].num_computed
        sched.check_integrity()
        for r in sched.running:  # window groups hold exactly the blocks of the next query's window
            kv.check_windows(r, r.num_computed_tokens)
        max_swapped = max(max_swapped, len(sched.swapped))
        step += 1

    # Flush the last finished ids to the worker; then nothing may be left anywhere.
    worker.execute(sched.schedule())
    assert worker.reqs == {} and worker.parked == set()
    null = kv.null_block is not None  # held for good by a manager with window groups
    assert kv.num_free_blocks == case.num_blocks - null
    assert kv.swap_pool is None or kv.swap_pool.num_free_blocks == num_swap_blocks
    assert sched.requests == {} and not sched.running and not sched.waiting and not sched.swapped
    sched.check_integrity()
    assert finished | aborted == set(requests) and not finished & aborted
    for rid in finished:
        req = requests[rid]
        assert outputs[rid] == [sampled_token(rid, i) for i in range(req.max_tokens)], rid
        assert req.output_token_ids == outputs[rid]
    # Every block swapped out came back in, is still out, or belonged to a request aborted while out.
    assert worker.moved["swap_out"] == worker.moved["swap_in"] + sum(
        len(b) for b in kv.swapped_blocks.values()
    ) + swap_dropped
    return {
        "steps": step,
        "requests": len(requests),
        "finished": len(finished),
        "aborted": len(aborted),
        "preemptions": dict(sched.num_preemptions_by_mode),
        "max_swapped": max_swapped,
        "prefix_hits": kv.prefix_hits,
        "cow_copies": kv.num_cow_copies,
        "moved": dict(worker.moved),
        "max_wait": max_wait,
        "bound_T": T,
        "max_k": max_k,
        "spec": sched.spec_stats,
    }


@pytest.mark.parametrize("case_name", list(CASES))
@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
@pytest.mark.parametrize("policy", ["fcfs", "priority", "srtf", "fair"])
def test_randomized_simulation(policy: str, mode: str, case_name: str) -> None:
    """Also the starvation check, asserted inside `simulate` at every step and for every request.

    Derivation (see also pagedllm/core/policies.py). A waiting or swapped request is *aged* once
    it has waited AGING_STEPS = 50 steps, and stays aged. The admission loop then tries aged
    requests first, oldest arrival first, and stops at the first that does not fit: while an aged
    request waits, nobody else is admitted or resumed and the running set only shrinks (forked
    samples join it, but finish with their parent). Since max_num_batched_tokens >= max_num_seqs
    * long_prefill_token_threshold, every running request gets its whole chunk or decode token
    every step, or leaves `running`; so the running set is empty after D = steps_to_drain(running)
    steps, and the next step admits the oldest aged request (a whole pool fits any request:
    add_request checks that). D <= T = drain_bound(case) = ceil(150 / threshold) + 50: 65 steps
    for bs4 (threshold 10), 63 for bs16 and bs8 (threshold 12). Asserted:
      - per step: aged requests are admitted before anyone else, oldest first, and an admission
        happens at the latest D steps after a step that saw aged requests waiting;
      - per request: wait(R) = first admission step - arrival step
            <= AGING_STEPS + (k + 1) * (T + 1),
        where k is the number of requests admitted in earlier steps while R was aged (by the
        per-step check, each of them is aged and older than R).
    The runs are overloaded on purpose (bursts of 10-12 arrivals): with aging the longest
    first-admission wait is 421 steps (fcfs; priority 306, srtf 359, fair 288), each within its
    bound; with aging off (max_waiting_steps 100000) the same runs wait up to 998 steps (srtf),
    972 (priority), 620 (fair).
    """
    stats = simulate(policy, mode, CASES[case_name])
    print(policy, mode, case_name, stats)
    assert stats["steps"] >= 1000
    assert stats["finished"] > 50 and stats["aborted"] > 0
    assert stats["prefix_hits"] > 0
    assert stats["moved"]["fork"] > 0 and stats["cow_copies"] > 0 and stats["moved"]["copy"] > 0
    by_mode = stats["preemptions"]
    assert by_mode["recompute"] + by_mode["swap"] > 0
    if mode == "recompute":
        assert by_mode["swap"] == 0 and stats["moved"]["swap_out"] == 0
    else:
        assert by_mode["swap"] > 0 and stats["moved"]["swap_in"] > 0
    if mode == "auto":
        assert by_mode["recompute"] > 0  # short victims are cheaper to recompute


# Layer windows of 4 layers: a full group and window groups of 8 and 16 tokens (2 and 4 blocks of 4).
HYBRID_LAYERS = (16, 16, 0, 8)
HYBRID_CASES = {
    "bs4": SimCase(4, 240, 128, 8, 10, 0.1, 12, 1),
    "bs8": SimCase(8, 120, 96, 8, 12, 0.12, 12, 6),
}


@pytest.mark.parametrize("case_name", list(HYBRID_CASES))
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_randomized_simulation_with_window_groups(mode: str, case_name: str) -> None:
    """The same simulation over a cache of layer groups (one full, windows of 8 and 16 tokens):
    the fake worker checks every position each group's queries read, and after every step each
    running request's window groups hold exactly the blocks its next query's window reads (none
    before it left allocated, none in it freed), through prefix hits, forks, copy-on-write,
    swapping and recompute."""
    stats = simulate("fcfs", mode, HYBRID_CASES[case_name], layer_windows=HYBRID_LAYERS)
    print(mode, case_name, stats)
    assert stats["finished"] > 50 and stats["prefix_hits"] > 0
    assert stats["moved"]["fork"] > 0 and stats["cow_copies"] > 0
    by_mode = stats["preemptions"]
    assert by_mode["recompute"] + by_mode["swap"] > 0
    if mode == "swap":
        assert by_mode["swap"] > 0 and stats["moved"]["swap_in"] > 0


@pytest.mark.parametrize(("policy", "mode", "case_name"),
                         [("fcfs", "swap", "bs4"), ("priority", "recompute", "bs16"), ("fair", "auto", "bs8")])
def test_randomized_simulation_with_speculation(policy: str, mode: str, case_name: str) -> None:
    """The same simulation with speculative steps: every decoding request proposes up to 4 tokens,
    of which the fake worker accepts a random prefix. Every step keeps the integrity checks and the
    fake worker's check that each position read holds the request's token (a rejected proposal's
    slot is never read before it is written again); outputs are the fake model's tokens exactly,
    and the rejected proposals' blocks come back (the pool is whole at the end)."""
    stats = simulate(policy, mode, CASES[case_name], arrival_steps=400, speculate=True)
    spec = stats["spec"]
    assert spec.num_drafts > 100 and 0 < spec.num_accepted_tokens < spec.num_draft_tokens, spec
    assert stats["finished"] > 20


def test_randomized_simulation_with_speculation_and_window_groups() -> None:
    """Speculative steps over window layer groups: the blocks of rejected proposals are cut from
    every group's entries, and the window groups keep exactly the blocks their queries read."""
    stats = simulate("fcfs", "swap", HYBRID_CASES["bs4"], arrival_steps=400, layer_windows=HYBRID_LAYERS,
                     speculate=True)
    spec = stats["spec"]
    assert spec.num_drafts > 100 and 0 < spec.num_accepted_tokens < spec.num_draft_tokens, spec
    assert stats["finished"] > 20


@pytest.mark.parametrize(("policy", "mode", "case_name"),
                         [("fcfs", "recompute", "bs4"), ("srtf", "swap", "bs4"), ("priority", "auto", "bs4")])
def test_randomized_simulation_with_prefill_cap(policy: str, mode: str, case_name: str) -> None:
    """The same simulation with the prompt-token cap of a shared step at max_num_seqs x threshold
    (below the token budget): every running request still gets its whole chunk or decode token
    every step, so the aging bound holds as it is, while admissions get only what the cap leaves.
    Every step keeps the integrity checks; outputs are the fake model's tokens exactly."""
    case = CASES[case_name]
    cap = case.max_num_seqs * case.long_prefill_token_threshold
    assert cap < case.max_num_batched_tokens
    stats = simulate(policy, mode, case, arrival_steps=400, prefill_cap=cap)
    assert stats["finished"] > 20
