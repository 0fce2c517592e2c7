"""Ordering properties of the scheduling policies (priority, srtf, fair) and of the aging rule,
driven through the scheduler with fake model outputs (see test_scheduler.Driver)."""

from __future__ import annotations

import pytest

from pagedllm.core.request import Request
from test_scheduler import Driver, make_req, make_sched


def req(rid: str, prompt_len: int, max_tokens: int, arrival: float, priority: int = 0, user: str | None = None):
    r = make_req(rid, prompt_len, max_tokens=max_tokens, arrival=arrival)
    r.priority, r.user = priority, user
    return r


def admission_order(d: Driver) -> list[str]:
    order: list[str] = []
    for so in d.history:
        order += [n.req_id for n in so.new_reqs if n.req_id not in order]
    return order


# ---- priority -----------------------------------------------------------------------------------


def test_priority_order_lower_first_ties_by_arrival() -> None:
    sched = make_sched(policy="priority", max_num_seqs=1)
    for rid, prio, arrival in [("a", 2, 0), ("b", 0, 1), ("c", 1, 2), ("d", 0, 3), ("e", 1, 4)]:
        sched.add_request(req(rid, 4, 2, arrival, priority=prio))
    d = Driver(sched)
    d.run()
    assert admission_order(d) == ["b", "d", "c", "e", "a"]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_high_priority_arrival_preempts_lower_priority_running_request(mode: str) -> None:
    # 6 blocks of 4: "low" holds 5 of them (20 tokens); "high" needs 2 to start.
    sched = make_sched(num_blocks=6, policy="priority", preemption_mode=mode, num_swap_blocks=8)
    low = req("low", 16, 8, arrival=0, priority=5)
    sched.add_request(low)
    d = Driver(sched)
    for _ in range(4):
        d.step()
    assert len(sched.kv.get_block_ids("low")) == 5
    sched.add_request(req("high", 6, 4, arrival=1, priority=0))
    so, _ = d.step()
    assert so.preempted_req_ids == {"low"} and [n.req_id for n in so.new_reqs] == ["high"]
    assert "low" not in so.num_scheduled_tokens  # its decode token went back to the budget
    assert sched.num_preemptions_by_mode[mode] == 1
    d.run()
    assert len(d.outputs["high"]) == 4 and len(d.outputs["low"]) == 8
    last_high = max(i for i, so in enumerate(d.history) if "high" in so.num_scheduled_tokens)
    low_after = [i for i, so in enumerate(d.history) if "low" in so.num_scheduled_tokens and i > 4]
    assert low_after and min(low_after) > 4  # low resumed only after high took its place
    assert sched.kv.usage == 0


def test_equal_priority_arrival_waits_instead_of_preempting() -> None:
    sched = make_sched(num_blocks=6, policy="priority")
    sched.add_request(req("first", 16, 8, arrival=0, priority=1))
    d = Driver(sched)
    for _ in range(4):
        d.step()
    sched.add_request(req("second", 6, 4, arrival=1, priority=1))
    so, _ = d.step()
    assert so.new_reqs == [] and sched.num_preemptions == 0
    d.run()
    assert admission_order(d) == ["first", "second"] and sched.num_preemptions == 0


def test_swapped_low_priority_request_does_not_block_high_priority_arrivals() -> None:
    sched = make_sched(num_blocks=6, policy="priority", preemption_mode="swap", num_swap_blocks=8)
    sched.add_request(req("low", 16, 8, arrival=0, priority=5))
    d = Driver(sched)
    for _ in range(4):
        d.step()
    sched.add_request(req("high1", 6, 4, arrival=1, priority=0))
    d.step()
    assert [r.request_id for r in sched.swapped] == ["low"]
    sched.add_request(req("high2", 4, 2, arrival=2, priority=0))
    so, _ = d.step()
    assert [n.req_id for n in so.new_reqs] == ["high2"]  # admitted ahead of the swapped "low"
    d.run()
    assert {k: len(v) for k, v in d.outputs.items()} == {"low": 8, "high1": 4, "high2": 2}


def test_priority_preemption_spares_a_request_whose_fresh_blocks_were_just_hit() -> None:
    """"x" (low priority) computes its prompt in chunks; in the step that keys its blocks 2 and 3,
    "y" is admitted first and hits them. Preempting "x" for "w" later in that step would drop their
    computation and leave y's hit unwritten (the fake worker checks every read)."""
    from fake_worker import FakeWorker

    sched = make_sched(num_blocks=6, caching=True, policy="priority", long_prefill_token_threshold=8)
    worker = FakeWorker(4, 6)

    def step():
        so = sched.schedule()
        sched.update_from_output(so, worker.execute(so))
        sched.check_integrity()
        return so

    x = req("x", 20, 2, arrival=0, priority=5)
    sched.add_request(x)
    step()  # x: tokens 0..7
    y = Request("y", x.prompt_token_ids[:16] + [7, 7], x.sampling_params, arrival_time=1)
    sched.add_request(y)  # priority 0: admitted first, hitting x's blocks 0..3
    sched.add_request(req("w", 20, 2, arrival=2, priority=1))  # does not fit: x outranks nothing
    so = step()
    assert so.num_scheduled_tokens == {"x": 8, "y": 2} and sched.num_preemptions == 0
    assert so.new_reqs[0].num_computed_tokens == 16
    while sched.has_unfinished_requests():
        step()


# ---- srtf -----------------------------------------------------------------------------------------


def completion_steps(d: Driver) -> dict[str, int]:
    done: dict[str, int] = {}
    for i, so in enumerate(d.history):
        for rid in so.finished_req_ids:
            done.setdefault(rid, i)
    return done


def run_mixed(policy: str) -> dict[str, int]:
    sched = make_sched(num_blocks=128, policy=policy, max_num_seqs=1, max_num_batched_tokens=16)
    sched.add_request(req("long", 60, 30, arrival=0))
    for i in range(4):
        sched.add_request(req(f"short{i}", 4, 2, arrival=1 + i))
    d = Driver(sched)
    d.run()
    d.history.append(sched.schedule())  # the last finisher is reported one step later
    return {"order": admission_order(d), **completion_steps(d)}


def test_srtf_serves_short_jobs_first() -> None:
    srtf, fcfs = run_mixed("srtf"), run_mixed("fcfs")
    assert srtf["order"] == ["short0", "short1", "short2", "short3", "long"]
    assert fcfs["order"] == ["long", "short0", "short1", "short2", "short3"]
    shorts = [f"short{i}" for i in range(4)]
    mean_srtf = sum(srtf[s] for s in shorts) / 4
    mean_fcfs = sum(fcfs[s] for s in shorts) / 4
    assert mean_srtf < mean_fcfs / 5, (mean_srtf, mean_fcfs)
    assert srtf["long"] - fcfs["long"] <= 4 * 3  # the long job waits only for the short ones


# ---- fair share ---------------------------------------------------------------------------------


def test_fair_share_gives_each_user_its_weighted_share_of_tokens() -> None:
    weights = {"alice": 3.0, "bob": 2.0, "carol": 1.0}
    sched = make_sched(num_blocks=256, policy="fair", user_weights=weights, max_num_seqs=4, max_num_batched_tokens=32)
    for user in weights:  # an unbounded backlog each: requests of varied length
        for i in range(300):
            sched.add_request(req(f"{user}{i}", 4 + 7 * (i % 5), 3 + 5 * (i % 3), arrival=i, user=user))
    d = Driver(sched)
    served = dict.fromkeys(weights, 0)
    for _ in range(400):  # every user stays backlogged over the whole window
        so, _ = d.step()
        for rid, n in so.num_scheduled_tokens.items():
            served[rid.rstrip("0123456789")] += n
    assert all(sum(1 for r in sched.waiting if r.user == u) > 0 for u in weights)
    total = sum(served.values())
    for user, w in weights.items():
        share = served[user] / total
        assert share == pytest.approx(w / sum(weights.values()), rel=0.05), (served, user)


def run_time_slice(time_slice: int) -> tuple[Driver, int]:
    """Two long requests of alice fill both sequence slots; bob arrives at step 3."""
    sched = make_sched(num_blocks=64, policy="fair", max_num_seqs=2, time_slice=time_slice)
    for i in range(2):
        sched.add_request(req(f"alice{i}", 8, 60, arrival=i, user="alice"))
    d = Driver(sched)
    for _ in range(3):
        d.step()
    sched.add_request(req("bob", 8, 4, arrival=10, user="bob"))
    steps = 3
    while "bob" not in d.outputs:
        d.step()
        steps += 1
    d.run()
    return d, steps


def test_fair_time_slice_makes_a_long_request_yield_to_another_user() -> None:
    d, steps = run_time_slice(time_slice=5)
    assert steps <= 3 + 5 + 1  # bob waits one slice at most
    assert d.sched.num_preemptions == 1
    assert {k: len(v) for k, v in d.outputs.items()} == {"alice0": 60, "alice1": 60, "bob": 4}
    d_no, steps_no = run_time_slice(time_slice=1000)
    assert steps_no > 55 and d_no.sched.num_preemptions == 0  # without the slice: until alice finishes


# ---- aging --------------------------------------------------------------------------------------


def test_aged_request_is_not_preempted_again_for_younger_ones() -> None:
    """A low-priority request keeps losing its blocks to a stream of high-priority arrivals. Once
    aged it is admitted first, and (the fix) stays protected as a victim while it runs: before, a
    running request counted as aged only while waiting, so it was preempted again and again."""
    sched = make_sched(num_blocks=8, policy="priority", max_waiting_steps=3, max_num_seqs=3)
    low = req("low", 4, 12, arrival=0, priority=9)
    sched.add_request(low)
    d = Driver(sched)
    step = 0
    while "low" not in d.finish_reasons:
        if step % 2 == 0:
            sched.add_request(req(f"h{step}", 4, 8, arrival=step + 1, priority=0))
        d.step()
        step += 1
        assert step < 100
    assert low.aged and low.num_preemptions == 1  # only before it aged (4 with the old rule)
    assert step <= 16
    d.run()
    assert sched.kv.usage == 0


# ---- command line -------------------------------------------------------------------------------


def test_scheduling_flags_parse() -> None:
    import argparse

    from pagedllm.engine.arg_utils import EngineArgs, parse_user_weights

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args([
        "--scheduling-policy", "fair", "--user-weights", "alice=2, bob=0.5", "--time-slice", "8",
        "--preemption-mode", "auto", "--swap-space", "1.5", "--max-waiting-steps", "300",
        "--long-prefill-token-threshold", "64", "--max-num-partial-prefills", "2", "--no-enable-prefix-caching",
    ]))
    assert (args.scheduling_policy, args.user_weights, args.time_slice) == ("fair", {"alice": 2.0, "bob": 0.5}, 8)
    assert (args.preemption_mode, args.swap_space, args.max_waiting_steps) == ("auto", 1.5, 300)
    assert (args.long_prefill_token_threshold, args.max_num_partial_prefills) == (64, 2)
    assert args.enable_prefix_caching is False
    for bad in ("alice", "alice=0", "=2", "bob=x"):
        with pytest.raises(ValueError, match=bad.split("=")[0] or "="):
            parse_user_weights(bad)
