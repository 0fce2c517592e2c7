"""The waiting queue: a step's work does not grow with the number of waiting requests, and its
picks are exactly the policy's order over the eligible waiting requests (a plain scan as oracle)."""

from __future__ import annotations

import random

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.policies import make_policy
from pagedllm.core.request import Request
from pagedllm.core.waiting_queue import WaitingQueue
from pagedllm.sampling_params import SamplingParams
from test_scheduler import Driver, make_req, make_sched

POLICIES = ["fcfs", "priority", "srtf", "fair"]


class CountedRequest(Request):
    """Records its id in `touched` whenever the scheduler reads or writes any of its attributes."""

    touched: set[str] = set()
    counting = False

    def __getattribute__(self, name: str):
        if CountedRequest.counting:
            CountedRequest.touched.add(object.__getattribute__(self, "request_id"))
        return object.__getattribute__(self, name)

    def __setattr__(self, name: str, value) -> None:
        if CountedRequest.counting:
            CountedRequest.touched.add(object.__getattribute__(self, "request_id"))
        object.__setattr__(self, name, value)


def counted_req(i: int, rng: random.Random) -> CountedRequest:
    r = CountedRequest(f"r{i}", [100 + 7 * i + k for k in range(6)], SamplingParams(max_tokens=2, ignore_eos=True),
                       eos_token_ids={2}, arrival_time=float(rng.randrange(1000)), priority=rng.randrange(3),
                       user=f"u{i % 3}")
    return r


def touched_per_step(policy: str, num_waiting: int, steps: int = 6) -> list[int]:
    """Requests a step reads or writes besides the ones it schedules, step by step."""
    rng = random.Random(0)
    sched = make_sched(num_blocks=4096, max_num_seqs=4, max_num_batched_tokens=64, policy=policy)
    for i in range(num_waiting):
        sched.add_request(counted_req(i, rng))
    driver = Driver(sched)
    extra = []
    for _ in range(steps):
        CountedRequest.touched = set()
        CountedRequest.counting = True
        try:
            so = sched.schedule()
            out = driver.worker.execute(so)
            sched.update_from_output(so, out)
        finally:
            CountedRequest.counting = False
        assert so.num_scheduled_tokens
        extra.append(len(CountedRequest.touched - set(so.num_scheduled_tokens)))
    return extra


@pytest.mark.parametrize("policy", POLICIES)
def test_a_step_touches_the_scheduled_requests_and_a_few_queue_heads(policy: str) -> None:
    small, large = touched_per_step(policy, 40), touched_per_step(policy, 4000)
    # Each step looks at the head of each bucket (3 users under fair share) besides what it runs,
    # however long the queue is.
    assert max(large) <= 4, large
    assert large == small


def test_aging_touches_each_request_once() -> None:
    rng = random.Random(1)
    sched = make_sched(num_blocks=4096, max_num_seqs=4, max_num_batched_tokens=64, max_waiting_steps=3)
    for i in range(2000):
        sched.add_request(counted_req(i, rng))
    driver = Driver(sched)
    extra = []
    for _ in range(8):
        CountedRequest.touched = set()
        CountedRequest.counting = True
        so = sched.schedule()
        CountedRequest.counting = False
        sched.update_from_output(so, driver.worker.execute(so))
        extra.append(len(CountedRequest.touched - set(so.num_scheduled_tokens)))
    # Every request entered at step 0: the third step ages them all, at once; the others do not look.
    assert extra[2] > 1900 and max(extra[:2] + extra[3:]) <= 4, extra
    assert all(r.aged for r in sched.waiting)


@pytest.mark.parametrize("policy", POLICIES)
def test_picks_match_a_scan_of_the_eligible_requests(policy: str) -> None:
    rng = random.Random(hash(policy) % 1000)
    config = SchedulerConfig(max_num_batched_tokens=64, max_model_len=256, policy=policy, max_waiting_steps=5)
    pol = make_policy(config)
    queue = WaitingQueue(pol)
    order: list[Request] = []  # the list the queue replaces
    entered: dict[str, int] = {}
    step, next_id = 0, 0
    for _ in range(60):  # steps
        for _ in range(rng.randrange(6)):
            r = make_req(f"q{next_id}", rng.randrange(1, 9), max_tokens=rng.randrange(1, 9),
                         arrival=float(rng.randrange(20)))  # ties on purpose
            r.priority, r.user, r.lora_int_id = rng.randrange(3), rng.choice(["a", "b", None]), rng.randrange(3)
            next_id += 1
            queue.append(r, step)
            order.append(r)
            entered[r.request_id] = step
        if policy == "fair":
            pol.served = {u: float(rng.randrange(50)) for u in ["a", "b", None]}
        skip = {r.request_id for r in order if rng.random() < 0.2}
        allowed = {0, *rng.sample([1, 2], rng.randrange(3))}
        for _ in range(rng.randrange(4)):  # admissions in this step
            want = [r for r in order if r.request_id not in skip and r.lora_int_id in allowed]
            got = queue.next_eligible(lambda r: r.request_id not in skip, lambda lora: lora in allowed)
            if not want:
                assert got is None
                break
            assert got is min(want, key=pol.admission_key)
            queue.remove(got)
            order.remove(got)
        for r in rng.sample(order, min(len(order), rng.randrange(2))):  # aborts
            queue.remove(r)
            order.remove(r)
        step += 1
        queue.end_step(step, config.max_waiting_steps)
        assert list(queue) == order and len(queue) == len(order)
        assert all(r.aged == (step - entered[r.request_id] >= config.max_waiting_steps) for r in order)
        assert queue.users == {u: n for u in ["a", "b", None] if (n := sum(r.user == u for r in order))}
