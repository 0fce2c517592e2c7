"""The prompt-token cap of a shared step (max_num_shared_prefill_tokens, core/step.py): a step that
more than one request could use carries at most that many prompt tokens, decodes on top; a lone
request keeps the whole budget. Driven with the fake worker of test_scheduler.py (no model, no torch)."""

from __future__ import annotations

import pytest

from test_scheduler import Driver, chunks, make_req, make_sched


def first_token_steps(d: Driver, rids: list[str], prompt_len: int) -> dict[str, int]:
    """The step (0-based, in d.history) whose chunk completes each request's prompt."""
    out = {}
    for rid in rids:
        done = 0
        for i, so in enumerate(d.history):
            done += so.num_scheduled_tokens.get(rid, 0)
            if done >= prompt_len:
                out[rid] = i
                break
    return out


def decoding_batch(d: Driver, n: int, max_tokens: int = 40) -> list[str]:
    """n requests with 4-token prompts, run until every one of them decodes."""
    rids = [f"d{i}" for i in range(n)]
    for i, rid in enumerate(rids):
        d.sched.add_request(make_req(rid, 4, max_tokens=max_tokens, arrival=i))
    while not all(d.sched.requests[r].num_output_tokens for r in rids):
        d.step()
    return rids


@pytest.mark.parametrize("cap", [0, 20])
def test_a_burst_beside_decodes_gets_its_first_tokens_one_prompt_a_step(cap: int) -> None:
    sched = make_sched(max_num_batched_tokens=256, max_num_shared_prefill_tokens=cap)
    d = Driver(sched)
    decoders = decoding_batch(d, 4)
    start = len(d.history)
    burst = [f"p{i}" for i in range(4)]
    for i, rid in enumerate(burst):
        sched.add_request(make_req(rid, 20, max_tokens=2, arrival=10 + i))
    d.step()
    so = d.history[start]
    assert all(so.num_scheduled_tokens[r] == 1 for r in decoders)  # decodes are never held back
    firsts = first_token_steps(d, burst, 20)
    if cap:
        # 20 prompt tokens a step: one prompt of the burst is done per step, in arrival order.
        assert sum(n for r, n in so.num_scheduled_tokens.items() if r in burst) == 20
        for _ in range(3):
            d.step()
        firsts = first_token_steps(d, burst, 20)
        assert [firsts[r] - start for r in burst] == [0, 1, 2, 3]
    else:
        # The whole budget: the four prompts share one long step and all finish at its end.
        assert [firsts[r] - start for r in burst] == [0, 0, 0, 0]
    d.run()
    assert all(len(d.outputs[r]) == 2 for r in burst)


def test_a_lone_prompt_keeps_the_whole_budget() -> None:
    sched = make_sched(max_num_batched_tokens=256, max_model_len=512, max_num_shared_prefill_tokens=20)
    sched.add_request(make_req("long", 200, max_tokens=2))
    d = Driver(sched)
    so, _ = d.step()
    assert so.num_scheduled_tokens == {"long": 200}


def test_a_burst_on_an_idle_engine_is_capped_from_its_first_step() -> None:
    sched = make_sched(max_num_batched_tokens=256, max_num_shared_prefill_tokens=30)
    burst = [f"p{i}" for i in range(4)]
    for i, rid in enumerate(burst):
        sched.add_request(make_req(rid, 30, max_tokens=8, arrival=i))
    d = Driver(sched)
    for _ in range(4):
        d.step()
    # One prompt a step: the first gets its first token after one short step, not four prompts' worth.
    assert [first_token_steps(d, burst, 30)[r] for r in burst] == [0, 1, 2, 3]
    assert all(so.total_num_scheduled_tokens <= 30 + 3 for so in d.history)


def test_no_cap_by_default() -> None:
    assert make_sched().config.max_num_shared_prefill_tokens == 0
    sched = make_sched(max_num_batched_tokens=256)
    for i in range(4):
        sched.add_request(make_req(f"p{i}", 30, max_tokens=2, arrival=i))
    so, _ = Driver(sched).step()
    assert so.num_scheduled_tokens == {f"p{i}": 30 for i in range(4)}


def test_a_waiting_prompt_is_scheduled_within_its_chunks_under_a_full_decode_batch() -> None:
    # 30 requests decode in every step; the budget of 64 leaves 34 tokens, the cap 16 of them to prompts.
    sched = make_sched(num_blocks=256, max_num_batched_tokens=64, max_num_shared_prefill_tokens=16)
    d = Driver(sched)
    for i in range(30):
        sched.add_request(make_req(f"d{i}", 2, max_tokens=60, arrival=i))
    while not all(r.num_output_tokens for r in sched.requests.values()):
        d.step()  # 16 prompt tokens a step: eight 2-token prompts, until all 30 decode
    start = len(d.history)
    sched.add_request(make_req("late", 40, max_tokens=2, arrival=100))
    for _ in range(3):
        so, _ = d.step()
        assert sum(1 for r, n in so.num_scheduled_tokens.items() if r.startswith("d") and n == 1) == 30
    # ceil(40 / 16) = 3 steps to its first token, and the chunks are the cap's.
    assert chunks(d.history[start:], "late") == [16, 16, 8]
    assert sched.requests["late"].num_output_tokens == 1


def test_a_running_prompt_chunk_counts_against_the_cap() -> None:
    sched = make_sched(num_blocks=256, max_num_batched_tokens=256, max_num_shared_prefill_tokens=24,
                       long_prefill_token_threshold=16)
    d = Driver(sched)
    decoding_batch(d, 2)
    sched.add_request(make_req("long", 64, max_tokens=2, arrival=10))
    sched.add_request(make_req("next", 8, max_tokens=2, arrival=11))
    so, _ = d.step()
    # The running set goes first: "long" takes its 16-token chunk, "next" what is left of the 24.
    assert so.num_scheduled_tokens["long"] == 16 and so.num_scheduled_tokens["next"] == 8
    so, _ = d.step()
    assert so.num_scheduled_tokens["long"] == 16 and "next" in so.num_scheduled_tokens  # next decodes


def test_the_cap_is_checked() -> None:
    with pytest.raises(ValueError, match="max_num_shared_prefill_tokens"):
        make_sched(max_num_shared_prefill_tokens=-1)


def test_the_server_caps_shared_steps_by_default_and_offline_engines_do_not() -> None:
    from pagedllm.config import SERVE_MAX_NUM_SHARED_PREFILL_TOKENS
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.entrypoints.cli import build_parser

    def cap(argv: list[str]) -> int:
        args = EngineArgs.from_cli_args(build_parser().parse_args(argv))
        return args.create_scheduler_config(1024).max_num_shared_prefill_tokens

    assert SERVE_MAX_NUM_SHARED_PREFILL_TOKENS == 1024
    assert cap(["serve"]) == 1024
    assert cap(["serve", "--max-num-shared-prefill-tokens", "0"]) == 0
    assert cap(["serve", "--max-num-shared-prefill-tokens", "256"]) == 256
    assert cap(["run-batch", "-i", "in.jsonl", "-o", "out.jsonl"]) == 0
    assert EngineArgs().create_scheduler_config(1024).max_num_shared_prefill_tokens == 0  # LLM(...)
