"""The scheduler with --max-loras: at most that many distinct adapters run at once, a request
whose adapter has no slot waits without blocking the requests behind it, and the prefix cache
keys blocks by adapter (no model, no torch)."""

from __future__ import annotations

import random

from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams
from test_scheduler import Driver, make_sched


def lora_req(rid: str, lora: int, prompt: list[int], max_tokens: int = 4) -> Request:
    wire = (f"a{lora}", lora, f"/adapters/{lora}") if lora else None
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_ids={2},
                   lora_request=wire)


def test_adapters_per_step_never_exceed_max_loras_and_waiters_do_not_block() -> None:
    rng = random.Random(0)
    for trial in range(20):
        sched = make_sched(num_blocks=rng.choice([16, 64]), caching=bool(trial % 2), max_num_seqs=rng.choice([4, 8]))
        sched.max_loras = rng.choice([1, 2, 3])
        driver = Driver(sched)
        loras: dict[str, int] = {}
        for i in range(12):
            lora = rng.choice([0, 1, 2, 3, 4])
            rid = f"r{i}"
            loras[rid] = lora
            sched.add_request(lora_req(rid, lora, [100 + i] * rng.randint(1, 12), rng.randint(1, 6)))
        for _ in range(500):
            if not sched.has_unfinished_requests():
                break
            driver.step()
            running = {r.lora_int_id for r in sched.running if r.lora_int_id}
            assert len(running) <= sched.max_loras
            step = {loras[rid] for rid in driver.history[-1].num_scheduled_tokens if loras[rid]}
            assert len(step) <= sched.max_loras
        assert not sched.has_unfinished_requests()
        assert set(driver.finish_reasons) == set(loras)


def test_request_without_slot_waits_behind_none() -> None:
    sched = make_sched(max_num_seqs=8)
    sched.max_loras = 1
    driver = Driver(sched)
    sched.add_request(lora_req("a", 1, [10, 11, 12], max_tokens=5))
    sched.add_request(lora_req("b", 2, [20, 21, 22]))
    sched.add_request(lora_req("c", 0, [30, 31, 32]))
    sched.add_request(lora_req("d", 1, [40, 41, 42]))
    so, _ = driver.step()
    assert set(so.num_scheduled_tokens) == {"a", "c", "d"}  # b's adapter has no slot: it waits alone
    assert [d.lora_request for d in so.new_reqs if d.req_id == "a"] == [("a1", 1, "/adapters/1")]
    driver.run()
    assert set(driver.finish_reasons) == {"a", "b", "c", "d"}


def test_prefix_cache_keys_blocks_by_adapter() -> None:
    sched = make_sched(caching=True)
    sched.max_loras = 2
    prompt = list(range(500, 520))
    for rid, lora in (("x", 1), ("y", 1), ("z", 2), ("w", 0)):
        sched.add_request(lora_req(rid, lora, prompt))
    for r in sched.waiting:
        sched.kv._update_block_hashes(r)
    h = {r.request_id: r.block_hashes for r in sched.waiting}
    assert h["x"] == h["y"]
    assert not set(h["x"]) & set(h["z"]) and not set(h["x"]) & set(h["w"]) and not set(h["z"]) & set(h["w"])
