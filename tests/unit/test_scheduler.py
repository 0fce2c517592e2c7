"""Scheduler driven step by step with fake model outputs (no model, no torch)."""

from __future__ import annotations

import zlib
from collections.abc import Callable

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.preemption import PreemptionCostModel
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from pagedllm.sampling_params import SamplingParams
from fake_worker import FakeWorker

EOS = 2
FILLER = 1000  # a token that is neither EOS nor a stop token


def make_sched(
    num_blocks: int = 64,
    block_size: int = 4,
    caching: bool = False,
    num_swap_blocks: int = 0,
    costs: PreemptionCostModel | None = None,
    **cfg,
) -> Scheduler:
    cfg.setdefault("max_num_batched_tokens", 64)
    cfg.setdefault("max_model_len", 256)
    kv = KVCacheManager(num_blocks, block_size, caching, num_swap_blocks)
    return Scheduler(SchedulerConfig(**cfg), kv, costs)


def make_req(
    rid: str, prompt_len: int, max_tokens: int = 4, arrival: float = 0.0, base: int | None = None, **params
) -> Request:
    """Prompt tokens are distinct per request id unless `base` is given (no accidental prefix sharing)."""
    start = base if base is not None else 10_000 * (1 + zlib.crc32(rid.encode()) % 1000)
    params.setdefault("ignore_eos", True)
    sp = SamplingParams(max_tokens=max_tokens, **params)
    return Request(rid, list(range(start, start + prompt_len)), sp, eos_token_ids={EOS}, arrival_time=arrival)


class Driver:
    """Runs steps against the shared fake worker (tests/unit/fake_worker.py), whose model samples
    `token_fn(request)` for a request exactly when its prompt (and all tokens so far) is computed.
    Checks the scheduler's side of each step as well: budgets, and what it sends the worker
    against what it holds."""

    def __init__(self, sched: Scheduler, token_fn: Callable[[Request], int] | None = None) -> None:
        self.sched = sched
        self.token_fn = token_fn or (lambda req: FILLER)
        kv = sched.kv
        self.worker = FakeWorker(kv.block_size, kv.num_blocks, kv.num_swap_blocks,
                                 sample=lambda rid, _: self.token_fn(sched.requests[rid]))
        self.outputs: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, str] = {}
        self.history: list[SchedulerOutput] = []

    def check_contract(self, so: SchedulerOutput) -> None:
        sched = self.sched
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        for d in so.new_reqs:
            req = sched.requests[d.req_id]
            assert d.prompt_token_ids == req.prompt_token_ids
            assert d.output_token_ids == req.output_token_ids == self.outputs.get(d.req_id, [])
        for rid, n in so.num_scheduled_tokens.items():
            req = sched.requests[rid]
            assert n > 0 and req.num_computed_tokens <= req.num_tokens
            assert len(sched.kv.get_block_ids(rid)) >= sched.kv.blocks_needed(req.num_computed_tokens)

    def step(self) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        sched = self.sched
        so = sched.schedule()
        self.history.append(so)
        assert so.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
        self.check_contract(so)
        results = sched.update_from_output(so, self.worker.execute(so))
        for res in results:
            self.outputs.setdefault(res.req_id, []).extend(res.new_token_ids)
            if res.finished:
                self.finish_reasons[res.req_id] = res.finish_reason
        sched.check_integrity()
        return so, results

    def flush(self) -> SchedulerOutput:
        """An empty step that tells the worker about the last finished requests."""
        so = self.sched.schedule()
        assert so.is_empty
        self.check_contract(so)
        self.worker.execute(so)
        return so

    def run(self, max_steps: int = 1000) -> int:
        steps = 0
        while self.sched.has_unfinished_requests():
            self.step()
            steps += 1
            assert steps < max_steps, "scheduler made no progress"
        return steps


def chunks(history: list[SchedulerOutput], rid: str) -> list[int]:
    return [so.num_scheduled_tokens[rid] for so in history if rid in so.num_scheduled_tokens]


# ---- budget and ordering ----------------------------------------------------------------------


def test_single_request_prefill_then_decode() -> None:
    sched = make_sched()
    sched.add_request(make_req("a", 10, max_tokens=3))
    d = Driver(sched)
    d.run()
    assert chunks(d.history, "a") == [10, 1, 1]
    assert d.outputs["a"] == [FILLER] * 3
    assert d.finish_reasons["a"] == "length"
    assert sched.kv.usage == 0


def test_token_budget_never_exceeded() -> None:
    sched = make_sched(num_blocks=256, max_num_batched_tokens=16)
    for i in range(12):
        sched.add_request(make_req(f"r{i}", 3 + 7 * i, max_tokens=1 + i % 5, arrival=i))
    d = Driver(sched)
    d.run()
    assert all(so.total_num_scheduled_tokens <= 16 for so in d.history)
    assert max(so.total_num_scheduled_tokens for so in d.history) == 16
    assert all(len(d.outputs[f"r{i}"]) == 1 + i % 5 for i in range(12))


def test_decodes_scheduled_before_new_prompts() -> None:
    sched = make_sched(max_num_batched_tokens=3)
    for i in range(3):
        sched.add_request(make_req(f"d{i}", 1, max_tokens=10, arrival=i))
    d = Driver(sched)
    d.step()  # three 1-token prompts: all admitted, each samples its first token
    sched.add_request(make_req("p", 20, arrival=10))
    for _ in range(5):
        so, _ = d.step()
        # The budget of 3 goes to the three decodes; the new prompt waits.
        assert so.num_scheduled_tokens == {"d0": 1, "d1": 1, "d2": 1}
        assert sched.waiting[0].request_id == "p"
    sched.finish_requests("d2", RequestStatus.FINISHED_ABORTED)
    so, _ = d.step()
    assert so.num_scheduled_tokens == {"d0": 1, "d1": 1, "p": 1}


def test_long_prompt_chunked_with_exact_sizes() -> None:
    sched = make_sched(max_num_batched_tokens=8)
    sched.add_request(make_req("a", 25, max_tokens=2))
    d = Driver(sched)
    d.run()
    assert chunks(d.history, "a") == [8, 8, 8, 1, 1]
    assert d.outputs["a"] == [FILLER, FILLER]


def test_several_partial_prefills_share_one_step() -> None:
    sched = make_sched(max_num_batched_tokens=16)
    for i, name in enumerate("abc"):
        sched.add_request(make_req(name, 10, max_tokens=3, arrival=i))
    d = Driver(sched)
    so, res = d.step()
    assert so.num_scheduled_tokens == {"a": 10, "b": 6}
    assert [r.req_id for r in res if r.new_token_ids] == ["a"]  # b's prompt is unfinished
    so, _ = d.step()
    assert so.num_scheduled_tokens == {"a": 1, "b": 4, "c": 10}
    so, _ = d.step()
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1}


def test_max_num_seqs_respected() -> None:
    sched = make_sched(max_num_seqs=2)
    for i in range(5):
        sched.add_request(make_req(f"r{i}", 4, max_tokens=3, arrival=i))
    d = Driver(sched)
    first_step = {}
    for step in range(100):
        if not sched.has_unfinished_requests():
            break
        so, _ = d.step()
        assert len(so.num_scheduled_tokens) <= 2
        assert len(sched.running) <= 2
        for nd in so.new_reqs:
            first_step[nd.req_id] = step
    assert first_step == {"r0": 0, "r1": 0, "r2": 3, "r3": 3, "r4": 6}
    assert all(len(d.outputs[f"r{i}"]) == 3 for i in range(5))


def test_partial_prefill_limit_and_long_prefill_threshold() -> None:
    sched = make_sched(max_num_batched_tokens=100, max_num_partial_prefills=1, long_prefill_token_threshold=4)
    for i in range(3):
        sched.add_request(make_req(f"r{i}", 10, max_tokens=2, arrival=i))
    d = Driver(sched)
    d.run()
    for so in d.history:
        prompt_chunks = {
            rid: n
            for rid, n in so.num_scheduled_tokens.items()
            if n > 1  # more than one token is always a prompt chunk here
        }
        assert len(prompt_chunks) <= 1
        assert all(n <= 4 for n in so.num_scheduled_tokens.values())
    assert chunks(d.history, "r0") == [4, 4, 2, 1]
    assert chunks(d.history, "r1") == [4, 4, 2, 1]
    # r1 starts only after r0's last chunk: one request with an unfinished prompt per step.
    assert [list(so.num_scheduled_tokens) for so in d.history[:4]] == [["r0"], ["r0"], ["r0"], ["r0", "r1"]]


def test_long_prefill_threshold_alone_lets_prompts_share_a_step() -> None:
    sched = make_sched(max_num_batched_tokens=100, long_prefill_token_threshold=6)
    for i in range(3):
        sched.add_request(make_req(f"r{i}", 10, max_tokens=1, arrival=i))
    d = Driver(sched)
    so, _ = d.step()
    assert so.num_scheduled_tokens == {"r0": 6, "r1": 6, "r2": 6}
    so, _ = d.step()
    assert so.num_scheduled_tokens == {"r0": 4, "r1": 4, "r2": 4}


# ---- preemption ---------------------------------------------------------------------------------


def test_preemption_by_recompute_when_blocks_run_out() -> None:
    # 3 requests of 4 + 8 tokens need 3 blocks each (block_size 4) but the pool has 6 blocks.
    sched = make_sched(num_blocks=6)
    for i, name in enumerate("abc"):
        sched.add_request(make_req(name, 4, max_tokens=8, arrival=i))
    d = Driver(sched)
    c = sched.requests["c"]
    while sched.num_preemptions == 0:
        so, _ = d.step()
    # The latest arrival goes; the step that preempts it tells the worker to forget it.
    assert so.num_preempted == 1 and so.finished_req_ids == {"c"}
    assert "c" not in so.num_scheduled_tokens
    assert c.status == RequestStatus.PREEMPTED and c in sched.waiting and c not in sched.running
    assert c.num_computed_tokens == 0
    kept = list(c.output_token_ids)
    assert len(kept) == 5 and d.outputs["c"] == kept  # position 8 (the 9th token) needed a 3rd block
    assert sched.kv.get_block_ids("c") == []
    # It comes back as a new request carrying its generated tokens, and finishes with max_tokens.
    while "c" not in [nd.req_id for nd in d.history[-1].new_reqs]:
        d.step()
    nd = next(nd for nd in d.history[-1].new_reqs if nd.req_id == "c")
    assert nd.output_token_ids == kept and nd.num_computed_tokens == 0
    assert d.history[-1].num_scheduled_tokens["c"] == 4 + len(kept)  # prompt + outputs recomputed
    d.run()
    assert {k: len(v) for k, v in d.outputs.items()} == {"a": 8, "b": 8, "c": 8}
    assert c.num_preemptions >= 1
    assert sched.kv.usage == 0


def test_preempted_chunk_is_not_left_in_prefix_cache() -> None:
    """A request preempted later in the step that scheduled its prompt chunk never computes that
    chunk, so blocks the chunk filled must not stay in the prefix cache: otherwise its own
    readmission (or anyone with the same prefix) would reuse K/V that was never written."""
    sched = make_sched(num_blocks=5, caching=True, policy="priority", long_prefill_token_threshold=5)
    a = make_req("a", 16, max_tokens=1, base=100)
    a.priority = 5  # the victim
    sched.add_request(a)
    d = Driver(sched)
    d.step()  # a: tokens 0..4
    b = make_req("b", 4, max_tokens=3, arrival=1, base=900)
    sched.add_request(b)
    d.step()  # a: 5..9, b: 0..3 (b samples its first token)
    so, _ = d.step()  # a would compute 10..14, filling block 2, but b's decode needs a block: a goes
    assert so.finished_req_ids == {"a"} and "a" not in so.num_scheduled_tokens
    assert a.num_computed_tokens == 0
    assert sched.kv.pool.get_cached_block(a.block_hashes[0]) is not None  # computed in step 1
    assert sched.kv.pool.get_cached_block(a.block_hashes[1]) is not None  # computed in step 2
    assert sched.kv.pool.get_cached_block(a.block_hashes[2]) is None  # tokens 10, 11 never computed
    d.run()
    # On readmission a recomputes from token 8 at the latest.
    first_after = next(so for so in d.history[3:] if any(nd.req_id == "a" for nd in so.new_reqs))
    assert next(nd for nd in first_after.new_reqs if nd.req_id == "a").num_computed_tokens <= 8
    assert d.outputs["a"] == [FILLER]


def test_prefix_hit_of_finished_request_admits_identical_prompt() -> None:
    """Prompt of 12 + 4 generated tokens = 4 blocks = the whole pool. A second request with the
    same prompt hits 2 cached blocks; it must need exactly 4 blocks in all, not count the hit
    tokens twice (which asked for 5 blocks and left it waiting forever)."""
    sched = make_sched(num_blocks=4, caching=True)
    d = Driver(sched)
    sched.add_request(make_req("a", 12, max_tokens=4, base=500))
    d.run()
    sched.add_request(make_req("b", 12, max_tokens=4, base=500, arrival=1))
    so, _ = d.step()
    assert so.new_reqs[0].req_id == "b"
    assert so.new_reqs[0].num_computed_tokens == 8  # 2 blocks hit (capped below 12)
    assert so.num_scheduled_tokens == {"b": 4}
    assert len(sched.kv.get_block_ids("b")) == 3  # 12 tokens, not 8 + 8 + 4
    d.run()
    assert len(d.outputs["b"]) == 4
    assert sched.kv.prefix_hits == 8
    assert sched.kv.usage == 0


# ---- contract, abort, validation ---------------------------------------------------------------


def test_scheduler_output_contract_new_cached_finished() -> None:
    sched = make_sched(num_blocks=6, max_num_batched_tokens=8)
    for i, name in enumerate("abc"):
        sched.add_request(make_req(name, 4, max_tokens=8, arrival=i))
    d = Driver(sched)  # Driver.check_contract checks every step's new/cached/finished lists
    d.run()
    so = sched.schedule()  # nothing to run; tells the worker about the last finishers
    assert so.is_empty
    d.check_contract(so)
    d.worker.execute(so)
    d.history.append(so)
    sent_new: dict[str, int] = {}
    forgotten: dict[str, int] = {}
    for so in d.history:
        for nd in so.new_reqs:
            sent_new[nd.req_id] = sent_new.get(nd.req_id, 0) + 1
        for rid in so.finished_req_ids:
            forgotten[rid] = forgotten.get(rid, 0) + 1
    n_pre = sched.num_preemptions
    assert n_pre > 0
    # Sent as new once plus once per preemption, forgotten once per preemption plus once at the end.
    assert sum(sent_new.values()) == 3 + n_pre
    assert sum(forgotten.values()) == 3 + n_pre
    assert sent_new == forgotten
    assert d.worker.reqs == {}
    assert sched.schedule().finished_req_ids == set()


def test_abort_running_and_waiting_frees_every_block() -> None:
    sched = make_sched(num_blocks=16, caching=True, max_num_batched_tokens=16, max_num_seqs=2)
    for i in range(4):
        sched.add_request(make_req(f"r{i}", 10, max_tokens=5, arrival=i))
    d = Driver(sched)
    d.step()
    d.step()
    assert [r.request_id for r in sched.running] == ["r0", "r1"]
    assert sched.kv.usage > 0
    done = sched.finish_requests(["r1", "r3"], RequestStatus.FINISHED_ABORTED)  # running + waiting
    assert [r.request_id for r in done] == ["r1", "r3"]
    assert all(r.get_finished_reason() == "abort" for r in done)
    sched.check_integrity()
    assert sched.finish_requests("r1", RequestStatus.FINISHED_ABORTED) == []  # already gone
    so, _ = d.step()
    assert so.finished_req_ids == {"r1"}  # the waiting r3 was never sent to the worker
    sched.finish_requests([r.request_id for r in sched.running + sched.waiting], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests()
    assert sched.kv.usage == 0 and sched.kv.num_free_blocks == 16
    sched.check_integrity()
    so = sched.schedule()
    assert so.is_empty and so.finished_req_ids == {"r0", "r2"}


def test_abort_between_schedule_and_update_drops_output() -> None:
    sched = make_sched()
    sched.add_request(make_req("a", 4, max_tokens=5))
    so = sched.schedule()
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert sched.update_from_output(so, ModelRunnerOutput(["a"], [[FILLER]])) == []
    assert sched.kv.usage == 0
    sched.check_integrity()


def test_a_request_whose_sampling_failed_ends_with_error_alone() -> None:
    """The worker reports "b" as failed (its sampling raised): it ends with finish_reason "error"
    and the worker's message, its blocks are freed, the worker is told to forget it, and "a",
    sampled in the same step, goes on to its full length."""
    sched = make_sched(num_blocks=16, caching=True)
    sched.add_request(make_req("a", 6, max_tokens=4))
    sched.add_request(make_req("b", 6, max_tokens=4))
    d = Driver(sched)
    d.step()  # both prompts, first tokens
    so = sched.schedule()
    out = d.worker.execute(so)
    i = out.req_ids.index("b")
    out.sampled_token_ids[i] = []
    out.failed = {"b": "IndexError: index 99 is out of bounds"}
    results = {r.req_id: r for r in sched.update_from_output(so, out)}
    assert results["b"].finish_reason == "error" and results["b"].error == out.failed["b"]
    assert results["b"].new_token_ids == [] and results["a"].new_token_ids == [FILLER]
    d.outputs["a"] += results["a"].new_token_ids
    assert [r.request_id for r in sched.running] == ["a"] and "b" not in sched.requests
    sched.check_integrity()
    so, _ = d.step()
    assert "b" in so.finished_req_ids
    d.run()
    assert d.outputs["a"] == [FILLER] * 4 and d.finish_reasons["a"] == "length"
    assert sched.kv.usage == 0


def test_add_request_rejects_too_long_for_model() -> None:
    sched = make_sched(max_model_len=32)
    with pytest.raises(ValueError, match=r"maximum context length is 32.*35 tokens.*30 in the prompt.*5 to generate"):
        sched.add_request(make_req("a", 30, max_tokens=5))
    sched.add_request(make_req("b", 30, max_tokens=2))  # exactly 32 is fine
    assert not sched.requests.get("a")


def test_add_request_rejects_request_larger_than_pool() -> None:
    sched = make_sched(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match=r"10 tokens.*3 blocks of 4.*8 tokens \(2 blocks\)"):
        sched.add_request(make_req("a", 6, max_tokens=4))
    sched.add_request(make_req("b", 4, max_tokens=4))  # 8 tokens fit exactly
    assert list(sched.requests) == ["b"]


def test_duplicate_request_id_rejected() -> None:
    sched = make_sched()
    sched.add_request(make_req("a", 4))
    with pytest.raises(ValueError, match="'a' is already in use"):
        sched.add_request(make_req("a", 5))
    assert len(sched.waiting) == 1


# ---- stop rules ------------------------------------------------------------------------------------


def scripted(tokens: list[int]) -> Callable[[Request], int]:
    """Token function that emits `tokens` in order, then FILLER."""
    return lambda req: tokens[req.num_output_tokens] if req.num_output_tokens < len(tokens) else FILLER


def run_one(script: list[int], **params) -> tuple[Request, Driver]:
    sched = make_sched()
    req = make_req("a", 4, **params)
    sched.add_request(req)
    d = Driver(sched, scripted(script))
    d.run()
    assert sched.kv.usage == 0
    return req, d


def test_stop_on_eos() -> None:
    req, d = run_one([5, EOS, 6], max_tokens=10, ignore_eos=False)
    assert d.outputs["a"] == [5, EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert d.finish_reasons["a"] == "stop" and req.stop_reason is None


def test_ignore_eos_runs_to_max_tokens() -> None:
    req, d = run_one([EOS, EOS, 6], max_tokens=5, ignore_eos=True)
    assert d.outputs["a"] == [EOS, EOS, 6, FILLER, FILLER]
    assert d.finish_reasons["a"] == "length"


def test_stop_token_ids() -> None:
    req, d = run_one([5, 6, 77, 8], max_tokens=10, stop_token_ids=[77], ignore_eos=True)
    assert d.outputs["a"] == [5, 6, 77]
    assert d.finish_reasons["a"] == "stop" and req.stop_reason == 77


def test_min_tokens_delays_eos_and_stop_tokens() -> None:
    req, d = run_one([EOS, 77, EOS, 9], max_tokens=10, min_tokens=3, stop_token_ids=[77], ignore_eos=False)
    assert d.outputs["a"] == [EOS, 77, EOS]  # the third token may stop it
    assert d.finish_reasons["a"] == "stop"
    req, d = run_one([EOS, EOS, EOS, EOS], max_tokens=4, min_tokens=4, ignore_eos=False)
    assert d.outputs["a"] == [EOS] * 4


def test_max_tokens_one_finishes_after_prefill() -> None:
    req, d = run_one([5], max_tokens=1)
    assert d.outputs["a"] == [5] and d.finish_reasons["a"] == "length"


def test_abort_of_preempted_waiting_request() -> None:
    sched = make_sched(num_blocks=6)
    for i, name in enumerate("abc"):
        sched.add_request(make_req(name, 4, max_tokens=8, arrival=i))
    d = Driver(sched)
    while sched.num_preemptions == 0:
        d.step()
    assert sched.requests["c"].status == RequestStatus.PREEMPTED
    sched.finish_requests("c", RequestStatus.FINISHED_ABORTED)
    sched.check_integrity()
    d.run()  # the contract checks accept the abort of a request the worker was told to forget
    d.flush()
    assert d.worker.reqs == {} and d.worker.parked == set()
    assert "c" not in sched.requests and len(d.outputs["a"]) == len(d.outputs["b"]) == 8
    assert sched.kv.usage == 0


# ---- n > 1: fork after the prompt, copy-on-write ------------------------------------------------


def make_group(rid: str, n: int, prompt_len: int, max_tokens: int = 3, base: int = 500) -> list[Request]:
    """The n samples of one request, as LLMEngine.add_request makes them: ids 0_<rid>, 1_<rid>, ..."""
    sp = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True)
    prompt = list(range(base, base + prompt_len))
    return [Request(f"{i}_{rid}", prompt, sp, eos_token_ids={EOS}, arrival_time=0.0) for i in range(n)]


def per_sample_token(req: Request) -> int:
    """Each sample generates its own tokens: 100 * (sample index + 1) + output index."""
    return per_sample_token_at(req.request_id, req.num_output_tokens)


def test_n_samples_fork_after_prompt_and_copy_on_write() -> None:
    sched = make_sched(num_blocks=16, block_size=4)
    group = make_group("a", 4, prompt_len=10)
    sched.add_request(group[0], forks=group[1:])
    ids = [r.request_id for r in group]
    d = Driver(sched, per_sample_token)
    pool = sched.kv.pool

    # Step 1: sample 0 computes the prompt once; the other three fork off it and sample from its
    # logits, sharing all three blocks, the partly filled last one (tokens 8, 9) included.
    so, res = d.step()
    assert so.num_scheduled_tokens == {"0_a": 10}
    assert [(f.req_id, f.parent_id, f.block_ids) for f in so.forked_reqs] == [
        ("1_a", "0_a", [0, 1, 2]), ("2_a", "0_a", [0, 1, 2]), ("3_a", "0_a", [0, 1, 2])
    ]
    assert [r.req_id for r in res] == ids and all(len(r.new_token_ids) == 1 for r in res)
    assert [pool.blocks[i].ref_cnt for i in range(4)] == [4, 4, 4, 0]
    assert so.blocks_to_copy == []
    assert all(sched.requests[r].num_computed_tokens == 10 for r in ids)

    # Step 2: each sample writes position 10 in block 2. The first three still share it and get a
    # private copy first; the last one holds the only reference left and writes in place.
    so, _ = d.step()
    assert so.num_scheduled_tokens == dict.fromkeys(ids, 1)
    assert so.blocks_to_copy == [(2, 3), (2, 4), (2, 5)]
    assert [c.replaced_block_ids for c in so.cached_reqs] == [[(2, 3)], [(2, 4)], [(2, 5)], []]
    assert [c.new_block_ids for c in so.cached_reqs] == [[], [], [], []]
    assert [sched.kv.get_block_ids(r) for r in ids] == [[0, 1, 3], [0, 1, 4], [0, 1, 5], [0, 1, 2]]
    assert [pool.blocks[i].ref_cnt for i in range(7)] == [4, 4, 1, 1, 1, 1, 0]
    assert sched.kv.num_cow_copies == 3 and sched.get_stats().num_cow_copies == 3

    so, _ = d.step()  # positions 11 fill the private blocks: nothing shared is written any more
    assert so.blocks_to_copy == []
    assert d.outputs == {r: [per_sample_token_at(r, i) for i in range(3)] for r in ids}
    d.run()
    assert sched.kv.usage == 0


def per_sample_token_at(rid: str, index: int) -> int:
    sample, _, _ = rid.partition("_")
    return 100 * (int(sample) + 1) + index if sample.isdigit() else FILLER


def test_fork_of_block_aligned_prompt_needs_no_copy() -> None:
    sched = make_sched(num_blocks=16, block_size=4)
    group = make_group("a", 3, prompt_len=8)
    sched.add_request(group[0], forks=group[1:])
    d = Driver(sched, per_sample_token)
    d.step()
    assert [sched.kv.pool.blocks[i].ref_cnt for i in (0, 1)] == [3, 3]
    so, _ = d.step()  # position 8 starts a new block for each sample
    assert so.blocks_to_copy == [] and [c.new_block_ids for c in so.cached_reqs] == [[2], [3], [4]]
    d.run()
    assert sched.kv.num_cow_copies == 0 and sched.kv.usage == 0


def test_forked_samples_reserve_sequence_slots_and_blocks() -> None:
    """A parent with 3 pending samples counts as 4 sequences: with max_num_seqs 5 nothing else is
    admitted next to it but one request, and the samples' copies find blocks (or preempt)."""
    sched = make_sched(num_blocks=8, block_size=4, max_num_seqs=5)
    group = make_group("a", 4, prompt_len=6, max_tokens=4)
    sched.add_request(group[0], forks=group[1:])
    for i in range(3):
        sched.add_request(make_req(f"x{i}", 2, max_tokens=2, arrival=1 + i))
    d = Driver(sched, per_sample_token)
    so, _ = d.step()
    assert list(so.num_scheduled_tokens) == ["0_a", "x0"]  # 4 + 1 = 5 sequences
    assert len(sched.running) == 5
    d.run()
    assert {r: len(v) for r, v in d.outputs.items()} == {**{f"{i}_a": 4 for i in range(4)}, "x0": 2, "x1": 2, "x2": 2}
    assert sched.kv.usage == 0


def test_abort_of_parent_before_fork_lets_samples_run_alone() -> None:
    sched = make_sched(num_blocks=16, block_size=4, max_num_batched_tokens=4)
    group = make_group("a", 3, prompt_len=10)
    sched.add_request(group[0], forks=group[1:])
    d = Driver(sched, per_sample_token)
    d.step()  # 4 of 10 prompt tokens: no fork yet
    assert sched.finish_requests("0_a", RequestStatus.FINISHED_ABORTED) == [group[0]]
    assert [r.request_id for r in sched.waiting] == ["1_a", "2_a"]
    sched.check_integrity()
    assert sched.finish_requests("2_a", RequestStatus.FINISHED_ABORTED) == [group[2]]
    d.run()
    assert d.outputs["1_a"] == [per_sample_token_at("1_a", i) for i in range(3)] and "2_a" not in d.outputs
    assert sched.kv.usage == 0


def test_n_larger_than_max_num_seqs_rejected() -> None:
    sched = make_sched(max_num_seqs=2)
    group = make_group("a", 3, prompt_len=4)
    with pytest.raises(ValueError, match=r"n=3 .*max_num_seqs=2"):
        sched.add_request(group[0], forks=group[1:])
    assert sched.requests == {}


# ---- swap preemption ----------------------------------------------------------------------------


def test_preemption_by_swap_keeps_computed_tokens_and_resumes_first() -> None:
    # As in the recompute test: 3 requests of 4 + 8 tokens, 6 blocks of 4; "c" is the victim.
    sched = make_sched(num_blocks=6, num_swap_blocks=8, preemption_mode="swap")
    for i, name in enumerate("abc"):
        sched.add_request(make_req(name, 4, max_tokens=8, arrival=i))
    d = Driver(sched)
    c = sched.requests["c"]
    while sched.num_preemptions == 0:
        so, _ = d.step()
    # Its 8 computed tokens (blocks 2 and 5) go to host blocks 0 and 1; the worker forgets it.
    assert so.blocks_to_swap_out == [(2, 0), (5, 1)]
    assert so.finished_req_ids == so.preempted_req_ids == {"c"}
    assert c.status == RequestStatus.SWAPPED and c in sched.swapped and c.num_computed_tokens == 8
    assert sched.kv.get_block_ids("c") == [] and [b.block_id for b in sched.kv.swapped_blocks["c"]] == [0, 1]
    stats = sched.get_stats()
    assert stats.num_swapped == 1 and stats.num_preemptions_by_mode == {"recompute": 0, "swap": 1}
    # A new request that arrived before it still waits: swapped requests resume first.
    sched.add_request(make_req("d", 4, max_tokens=2, arrival=-1))
    while not d.history[-1].new_reqs:
        so, _ = d.step()
    # a's and b's blocks, freed without a cached prefix, are taken first (the most recently freed first)
    assert [(n.req_id, n.num_computed_tokens, n.block_ids) for n in so.new_reqs] == [("c", 8, [1, 4, 5]), ("d", 0, [0])]
    assert so.blocks_to_swap_in == [(0, 1), (1, 4)]
    assert so.num_scheduled_tokens["c"] == 1  # only its pending token: nothing is recomputed
    d.run()
    assert {k: len(v) for k, v in d.outputs.items()} == {"a": 8, "b": 8, "c": 8, "d": 2}
    assert sched.kv.usage == 0 and sched.kv.swap_pool.num_free_blocks == 8
    assert sched.get_stats().num_swapped == 0


def test_full_swap_pool_falls_back_to_recompute() -> None:
    sched = make_sched(num_blocks=6, num_swap_blocks=1, preemption_mode="swap")  # c needs 2 host blocks
    for i, name in enumerate("abc"):
        sched.add_request(make_req(name, 4, max_tokens=8, arrival=i))
    d = Driver(sched)
    while sched.num_preemptions == 0:
        so, _ = d.step()
    assert so.blocks_to_swap_out == [] and sched.requests["c"].status == RequestStatus.PREEMPTED
    assert sched.num_preemptions_by_mode == {"recompute": 1, "swap": 0}
    d.run()
    assert {k: len(v) for k, v in d.outputs.items()} == {"a": 8, "b": 8, "c": 8}


@pytest.mark.parametrize("copy_rate, expected", [(1e12, "swap"), (1.0, "recompute")])
def test_auto_preemption_picks_the_cheaper_mode(copy_rate: float, expected: str) -> None:
    costs = PreemptionCostModel(
        flops_per_second=1e9, copy_bytes_per_second=copy_rate, flops_per_token=1e6,
        attention_flops_per_pair=1e3, kv_bytes_per_block=1 << 16,
    )
    sched = make_sched(num_blocks=6, num_swap_blocks=8, preemption_mode="auto", costs=costs)
    for i, name in enumerate("abc"):
        sched.add_request(make_req(name, 4, max_tokens=8, arrival=i))
    d = Driver(sched)
    d.run()
    assert sched.num_preemptions_by_mode[expected] == sched.num_preemptions > 0
    assert {k: len(v) for k, v in d.outputs.items()} == {"a": 8, "b": 8, "c": 8}


def test_preemption_cost_model_break_even() -> None:
    # Recompute: n tokens at 1 FLOP each plus 0.1 per (query, key) pair; swap: 2 per token.
    costs = PreemptionCostModel(
        flops_per_second=1.0, copy_bytes_per_second=1.0, flops_per_token=1.0,
        attention_flops_per_pair=0.1, kv_bytes_per_block=4,
    )
    assert costs.recompute_seconds(4) == pytest.approx(4 + 0.1 * 10)
    assert costs.swap_seconds(1) == 8  # 4 bytes out and back in
    n = costs.break_even_tokens(block_size=4)  # 1 + 0.05 (n + 1) = 2 -> n = 19
    assert n == pytest.approx(19)
    assert not costs.prefers_swap(16, 4) and costs.prefers_swap(24, 6)


def test_abort_of_swapped_request_frees_host_blocks() -> None:
    sched = make_sched(num_blocks=6, num_swap_blocks=8, preemption_mode="swap")
    for i, name in enumerate("abc"):
        sched.add_request(make_req(name, 4, max_tokens=8, arrival=i))
    d = Driver(sched)
    while not sched.swapped:
        d.step()
    assert sched.finish_requests("c", RequestStatus.FINISHED_ABORTED)[0].request_id == "c"
    assert sched.kv.swap_pool.num_free_blocks == 8
    sched.check_integrity()
    d.run()
    d.flush()
    assert d.worker.reqs == {} and d.worker.parked == set()


# ---- prefix cache through the scheduler ---------------------------------------------------------


def test_reset_prefix_cache_while_requests_run() -> None:
    sched = make_sched(num_blocks=32, caching=True, max_num_batched_tokens=8)
    for i in range(3):
        sched.add_request(make_req(f"r{i}", 13, max_tokens=6, arrival=i, base=700))  # one shared prompt
    d = Driver(sched)
    d.step()
    d.step()
    # r0's three full prompt blocks (12 of its 13 tokens) are keyed in the cache once written;
    # r1 and r2 then each find all three: 3 x 13 tokens looked up, 2 x 12 found.
    assert (sched.kv.prefix_hits, sched.kv.prefix_queries) == (24, 39)
    sched.kv.reset_prefix_cache()  # mid-prefill and mid-decode: every request keeps its blocks
    sched.check_integrity()
    assert all(b.block_hash is None for b in sched.kv.pool.blocks)
    d.run()
    assert {k: len(v) for k, v in d.outputs.items()} == {"r0": 6, "r1": 6, "r2": 6}
    assert sched.kv.usage == 0
    # Blocks keyed before the reset stay unkeyed: a new request with the same prompt gets no hit on
    # them, while its queries and hits are still counted.
    queries, hits = sched.kv.prefix_queries, sched.kv.prefix_hits
    sched.add_request(make_req("late", 13, max_tokens=1, arrival=9, base=700))
    so, _ = d.step()
    assert so.new_reqs[0].num_computed_tokens == 0
    assert (sched.kv.prefix_queries, sched.kv.prefix_hits) == (queries + 13, hits)
    d.run()
    sched.add_request(make_req("later", 13, max_tokens=1, arrival=10, base=700))
    so, _ = d.step()
    assert so.new_reqs[0].num_computed_tokens == 12  # "late" keyed the prompt's 3 full blocks again
    assert (sched.kv.prefix_queries, sched.kv.prefix_hits) == (queries + 26, hits + 12)
