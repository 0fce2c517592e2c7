"""The adaptive speculation controller (core/spec_adaptive.py): proposal lengths follow a request's
measured acceptance (checked against the decayed counts computed by hand), drop to none where
proposals never land, probe back, and a step's proposals stay within its spare rows."""

from __future__ import annotations

import pytest

from pagedllm.core.spec_adaptive import (
    DECAY,
    MIN_GAIN,
    PRIOR_ACCEPTED,
    PRIOR_TRIED,
    PROBE_EVERY,
    SpecController,
    tokens_worth_proposing,
)


def test_tokens_worth_proposing_is_the_largest_power_above_the_gain() -> None:
    for rate in (0.0, 0.05, 0.2, 0.5, 0.66, 0.9, 0.99, 1.0):
        for k in (1, 4, 8):
            want = max((j for j in range(k + 1) if rate ** j >= MIN_GAIN), default=0)
            assert tokens_worth_proposing(rate, k) == want, (rate, k)


def test_rate_is_the_decayed_share_of_tried_tokens_accepted() -> None:
    c = SpecController(4, 64)
    assert c.num_tokens("a") == 4 and c.rate("a") == 1.0  # nothing measured: k
    history = [(4, 4), (4, 1), (3, 0), (4, 2)]
    acc, tried = PRIOR_ACCEPTED, PRIOR_TRIED
    for proposed, accepted in history:
        c.record("a", proposed, accepted)
        acc = DECAY * acc + accepted
        tried = DECAY * tried + min(accepted + 1, proposed)
        assert c.rate("a") == pytest.approx(acc / tried)
        assert c.num_tokens("a") == tokens_worth_proposing(acc / tried, 4)
    c.record("a", 0, 0)  # no proposals: nothing learnt
    assert c.rate("a") == pytest.approx(acc / tried)


def test_never_accepted_goes_to_zero_then_probes_and_recovers() -> None:
    c = SpecController(4, 64)
    for _ in range(12):
        c.record("r", c.num_tokens("r") or 1, 0)
    assert c.num_tokens("r") == 0
    counts = [c.num_tokens("r") for _ in range(3 * PROBE_EVERY)]
    # one token every PROBE_EVERY steps without proposals (the 0 above was the first of them)
    assert counts.count(1) == 3 and set(counts) == {0, 1}, counts
    assert counts[PROBE_EVERY - 2] == 1
    steps = 0
    while c.num_tokens("r") < 4:  # proposals land from now on: back to k
        c.record("r", max(1, c.num_tokens("r")), max(1, c.num_tokens("r")))
        steps += 1
        assert steps < 20
    c.forget("r")
    assert c.rate("r") == 1.0


def test_kinds_of_proposal_keep_counts_of_their_own() -> None:
    c = SpecController(4, 64)
    for _ in range(12):
        c.record("r", 4, 0, kind=1)  # proposals after one-token matches never land
        c.record("r", 4, 4, kind=4)  # those after four-token matches always do
    assert c.num_tokens("r", 1) == 0 and c.num_tokens("r", 4) == 4
    assert c.rate("r") == 1.0 and c.num_tokens("r") == 4  # no kind named: counts of its own, none yet
    c.begin_step(1)
    assert c.allowance("r", 8, kind=1) == 0 and c.allowance("r", 8, kind=4) == 4 and c.allowance("r", 8, kind=2) == 4
    c.forget("r")
    assert c.rate("r", 1) == 1.0 and c.num_tokens("r", 1) == 4


def test_step_rows_bound_the_proposals() -> None:
    c = SpecController(4, 16)
    c.begin_step(6)  # 10 rows left for proposals
    got = []
    for rid in "abcd":
        n = c.allowance(rid, room=100)
        got.append(n)
        c.took(n)
    assert got == [4, 4, 2, 0]
    c.begin_step(16)
    assert c.allowance("a", 100) == 0  # as many running requests as rows: off
    c.begin_step(1)
    assert c.allowance("a", 3) == 3  # the request's own room
    with pytest.raises(ValueError, match="max_rows"):
        SpecController(4, 0)


def test_rows_rule_per_device() -> None:
    from pagedllm.core.spec_adaptive import CPU_ROWS, GPU_ROWS, max_spec_rows

    assert max_spec_rows("cpu") == CPU_ROWS and max_spec_rows("cuda") == GPU_ROWS
