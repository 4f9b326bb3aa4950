"""The worker choice: cached prefix against load, and the hot-spot guard."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar_frontend.routing.policy import Candidate, PolicyConfig, Reason, choose

RAND = random.Random(0)


def test_no_candidate_no_decision() -> None:
    assert choose([], 100, RAND) is None


def test_the_worker_holding_the_prefix_wins_among_equals() -> None:
    decision = choose([Candidate("a"), Candidate("b", cached_tokens=2048), Candidate("c")], 2176, RAND)
    assert decision is not None
    assert (decision.worker, decision.reason, decision.cached_tokens) == ("b", Reason.AFFINITY, 2048)


def test_without_any_cached_prefix_the_least_busy_wins() -> None:
    decision = choose(
        [Candidate("a", running=3), Candidate("b", running=1), Candidate("c", running=2)], 500, RAND
    )
    assert decision is not None
    assert (decision.worker, decision.reason, decision.cached_tokens) == ("b", Reason.LOAD, 0)


def test_queued_prefill_counts_against_a_worker() -> None:
    decision = choose(
        [Candidate("a", cached_tokens=64, queued_prefill_tokens=10_000), Candidate("b")], 1000, RAND
    )
    assert decision is not None
    assert (decision.worker, decision.reason) == ("b", Reason.LOAD)


def test_a_short_prefix_is_not_worth_a_busier_worker() -> None:
    config = PolicyConfig(running_request_tokens=128, hot_spot_slack=10)
    decision = choose(
        [Candidate("a", cached_tokens=16, running=2), Candidate("b", running=0)], 1000, RAND, config
    )
    assert decision is not None
    assert (decision.worker, decision.reason) == ("b", Reason.LOAD)


def test_a_hot_worker_loses_its_affinity() -> None:
    config = PolicyConfig(hot_spot_ratio=1.5, hot_spot_slack=2)
    hot = Candidate("a", cached_tokens=2048, running=9)  # 9 > 1.5 * 4 + 2
    decision = choose([hot, Candidate("b", running=4), Candidate("c", running=5)], 2176, RAND, config)
    assert decision is not None
    assert (decision.worker, decision.reason, decision.cached_tokens) == ("b", Reason.HOT_SPOT, 0)
    # At the threshold it keeps it.
    warm = Candidate("a", cached_tokens=2048, running=8)
    decision = choose([warm, Candidate("b", running=4), Candidate("c", running=5)], 2176, RAND, config)
    assert decision is not None
    assert (decision.worker, decision.reason) == ("a", Reason.AFFINITY)


def test_the_predicted_cache_never_exceeds_the_prompt() -> None:
    decision = choose([Candidate("a", cached_tokens=4096)], 100, RAND)
    assert decision is not None
    assert decision.cached_tokens == 100


def test_ties_go_to_the_worker_sent_the_fewest_requests() -> None:
    candidates = [Candidate("a", sent=3), Candidate("b", sent=1), Candidate("c", sent=2)]
    for seed in range(20):
        decision = choose(candidates, 10, random.Random(seed))
        assert decision is not None
        assert decision.worker == "b"


def test_the_fewest_sent_breaks_ties_only() -> None:
    # b was sent fewer requests but holds less of the prompt: the cheaper worker still wins.
    candidates = [Candidate("a", cached_tokens=64, sent=9), Candidate("b", sent=0)]
    decision = choose(candidates, 100, RAND)
    assert decision is not None
    assert decision.worker == "a"


def test_ties_are_drawn_at_random() -> None:
    rand = random.Random(1)
    seen = {choose([Candidate("a"), Candidate("b"), Candidate("c")], 10, rand).worker for _ in range(60)}  # type: ignore[union-attr]
    assert seen == {"a", "b", "c"}


@pytest.mark.parametrize(
    "kwargs", [{"hot_spot_ratio": 0.5}, {"hot_spot_slack": -1}, {"running_request_tokens": -1}]
)
def test_config_refuses_nonsense(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        PolicyConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(5))
def test_a_burst_sharing_a_prefix_cached_on_one_of_three_workers(seed: int) -> None:
    """100 concurrent long requests (2,048-token shared prefix + 128 of their own) over 3 equal
    workers, the prefix cached on one: that worker takes between 40 % and 90 % of them."""
    rand = random.Random(seed)
    prefix, question = 2048, 128
    running = {"a": 0, "b": 0, "c": 0}
    queued = {"a": 0, "b": 0, "c": 0}
    reasons: dict[Reason, int] = {}
    for _ in range(100):
        candidates = [
            Candidate(
                w,
                cached_tokens=prefix if w == "a" else 0,
                running=running[w],
                queued_prefill_tokens=queued[w],
            )
            for w in running
        ]
        decision = choose(candidates, prefix + question, rand)
        assert decision is not None
        running[decision.worker] += 1
        queued[decision.worker] += prefix + question - decision.cached_tokens
        reasons[decision.reason] = reasons.get(decision.reason, 0) + 1
    assert 40 <= running["a"] <= 90, running
    assert reasons.get(Reason.HOT_SPOT, 0) > 0


@given(
    st.lists(
        st.tuples(st.integers(0, 4096), st.integers(0, 50), st.integers(0, 100_000)), min_size=1, max_size=8
    ),
    st.integers(1, 8192),
)
def test_law_the_choice_is_a_cheapest_candidate(workers: list[tuple[int, int, int]], prompt: int) -> None:
    config = PolicyConfig()
    candidates = [Candidate(f"w{i}", c, r, q) for i, (c, r, q) in enumerate(workers)]
    decision = choose(candidates, prompt, random.Random(0), config)
    assert decision is not None
    least = min(c.running for c in candidates)

    def hot(c: Candidate) -> bool:
        return c.running > config.hot_spot_ratio * least + config.hot_spot_slack

    def cost(c: Candidate) -> float:
        cached = min(c.cached_tokens, prompt)
        return prompt - cached + c.queued_prefill_tokens + c.running * config.running_request_tokens

    chosen = next(c for c in candidates if c.worker == decision.worker)
    assert not hot(chosen)
    assert cost(chosen) == min(cost(c) for c in candidates if not hot(c))
    assert decision.cached_tokens == min(chosen.cached_tokens, prompt)
    if decision.reason is Reason.AFFINITY:
        assert chosen.cached_tokens == max(c.cached_tokens for c in candidates) > 0
