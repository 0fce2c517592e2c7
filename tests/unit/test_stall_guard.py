"""The fused decode step's stall guard: two threads while their steps keep pace, one thread for a
while once its recent team steps take over twice their usual time on average (another process
holding a core)."""

from __future__ import annotations

from pagedllm.worker.native_decode import StallGuard


def _step(g: StallGuard, seconds: float, key: int = 3) -> int:
    threads = g.threads()
    g.record(key, threads, seconds)
    return threads


def test_quiet_steps_and_single_outliers_keep_the_team() -> None:
    g = StallGuard(2)
    ms = [0.010 + 0.0001 * (i % 7) for i in range(400)]
    for i in range(0, 400, 8):  # one step in eight three times slower: a GC pause, a page fault
        ms[i] = 0.030
    assert [_step(g, t) for t in ms] == [0] * 400
    assert g.switches == 0


def test_stalls_switch_to_one_thread_probe_back_off_and_recover() -> None:
    g = StallGuard(2)
    for _ in range(20):
        assert _step(g, 0.010) == 0
    stalled = 0
    while g.switches == 0:  # a burst of steps 3.5x slower: the mean of the window passes 2x
        assert _step(g, 0.035) == 0
        stalled += 1
    assert 4 <= stalled <= StallGuard.WINDOW
    # One-thread steps: their times say nothing about the team and are not counted.
    assert [_step(g, 0.020) for _ in range(StallGuard.SOLO)] == [1] * StallGuard.SOLO
    assert _step(g, 0.040) == 0  # the probe stalls: twice as long on one thread
    assert [_step(g, 0.020) for _ in range(2 * StallGuard.SOLO)] == [1] * (2 * StallGuard.SOLO)
    assert _step(g, 0.011) == 0  # the probe keeps pace: the team is back
    assert [_step(g, 0.010) for _ in range(50)] == [0] * 50
    assert g.switches == 1 and g.solo_len == StallGuard.SOLO


def test_step_sizes_have_their_own_baselines_and_follow_growing_contexts() -> None:
    g = StallGuard(2)
    for _ in range(5):
        _step(g, 0.010, key=3)
        _step(g, 0.030, key=9)  # a bigger step is not a stall of the small one
    t = 0.010
    for _ in range(600):  # the context grows: each step a little slower than the last
        t *= 1.001
        assert _step(g, t, key=3) == 0
    assert g.switches == 0


def test_one_thread_machines_never_switch() -> None:
    g = StallGuard(1)
    assert [_step(g, t) for t in [0.01] * 5 + [0.1] * 20] == [0] * 25
    assert g.switches == 0


def test_prompt_steps_run_on_one_thread_while_the_guard_has_decode_steps_on_one(tiny_model_dir: str) -> None:
    import torch

    from pagedllm import LLM, SamplingParams

    team = torch.get_num_threads()
    if team < 2:
        import pytest

        pytest.skip("one torch thread: there is no team to leave")
    llm = LLM(tiny_model_dir, dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    paths = llm.llm_engine.core.executor.runner.paths
    if paths.native is None:
        import pytest

        pytest.skip("no fused decode step on this CPU: no stall guard")
    assert paths.eager.guard is paths.native.nd.guard
    seen: list[int] = []
    paths.eager.model.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([{"prompt_token_ids": list(range(5, 40))}], params)
    paths.native.nd.guard.solo_left = 10  # a stretch of one-thread steps after stalls
    llm.generate([{"prompt_token_ids": list(range(7, 50))}], params)
    assert seen == [team, 1] and torch.get_num_threads() == team
