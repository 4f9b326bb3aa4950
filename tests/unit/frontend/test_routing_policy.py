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


def test_a_few_requests_more_than_an_idle_worker_is_not_a_hot_spot() -> None:
    """The holder runs 3 requests that hit its cache, another worker none: with the other
    frontends' requests counted from a GetLoad up to a second old, that is noise, not a hot
    spot (a slack of 2 moved such requests off their prefix: docs/frontend.md)."""
    holder = Candidate("a", cached_tokens=2048, running=3, queued_prefill_tokens=256)
    decision = choose([holder, Candidate("b")], 2176, RAND)
    assert decision is not None
    assert (decision.worker, decision.reason) == ("a", Reason.AFFINITY)
    moved = choose([holder, Candidate("b")], 2176, RAND, PolicyConfig(hot_spot_slack=2))
    assert moved is not None
    assert (moved.worker, moved.reason) == ("b", Reason.HOT_SPOT)
    # Beyond the slack it is one: 5 > 1.5 * 0 + 4.
    busy = Candidate("a", cached_tokens=2048, running=5, queued_prefill_tokens=256)
    decision = choose([busy, Candidate("b")], 2176, RAND)
    assert decision is not None
    assert (decision.worker, decision.reason) == ("b", Reason.HOT_SPOT)


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


def test_a_holder_briefly_busy_keeps_the_conversation() -> None:
    """A turn of 1,160 tokens, 1,088 of them cached on b, where another conversation's first
    turn (1,088 uncached tokens) is prefilling; a is idle. Moving the turn to a would save a
    little waiting and copy the conversation's 1,088 cached tokens there (bench/README.md, "Two
    frontends on multi-turn")."""
    candidates = [Candidate("a"), Candidate("b", cached_tokens=1088, running=1, queued_prefill_tokens=1088)]
    stays = choose(candidates, 1160, RAND)
    assert stays is not None
    assert (stays.worker, stays.reason, stays.cached_tokens) == ("b", Reason.AFFINITY, 1088)
    # Counting only the wait, as before the left-behind term: it moved.
    moves = choose(candidates, 1160, RAND, PolicyConfig(left_behind_weight=0.0))
    assert moves is not None
    assert (moves.worker, moves.reason, moves.cached_tokens) == ("a", Reason.LOAD, 0)


def test_a_long_queue_still_moves_the_request() -> None:
    # b's queue is worth more than the prefix's prefill here and its copy's room elsewhere.
    candidates = [Candidate("a"), Candidate("b", cached_tokens=1088, queued_prefill_tokens=2400)]
    decision = choose(candidates, 1160, RAND)
    assert decision is not None
    assert (decision.worker, decision.reason) == ("a", Reason.LOAD)


def test_left_behind_counts_only_what_the_prompt_uses() -> None:
    # b holds 4,096 tokens of this family of prompts but the prompt has 100: a worker holding
    # 64 of them leaves 36 behind, not 4,032.
    candidates = [
        Candidate("a", cached_tokens=64),
        Candidate("b", cached_tokens=4096, queued_prefill_tokens=80),
    ]
    decision = choose(candidates, 100, RAND)  # a: 36 + 36; b: 0 + 80
    assert decision is not None
    assert decision.worker == "a"
    decision = choose(candidates, 100, RAND, PolicyConfig(left_behind_weight=2.0))  # a: 36 + 72; b: 80
    assert decision is not None
    assert decision.worker == "b"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"hot_spot_ratio": 0.5},
        {"hot_spot_slack": -1},
        {"running_request_tokens": -1},
        {"left_behind_weight": -0.5},
        {"left_behind_weight": float("nan")},
    ],
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
    st.sampled_from([0.0, 0.5, 1.0, 3.0]),
)
def test_law_the_choice_is_a_cheapest_candidate(
    workers: list[tuple[int, int, int]], prompt: int, left_behind_weight: float
) -> None:
    config = PolicyConfig(left_behind_weight=left_behind_weight)
    candidates = [Candidate(f"w{i}", c, r, q) for i, (c, r, q) in enumerate(workers)]
    decision = choose(candidates, prompt, random.Random(0), config)
    assert decision is not None
    least = min(c.running for c in candidates)

    def hot(c: Candidate) -> bool:
        return c.running > config.hot_spot_ratio * least + config.hot_spot_slack

    best_held = min(max(c.cached_tokens for c in candidates), prompt)

    def cost(c: Candidate) -> float:
        cached = min(c.cached_tokens, prompt)
        return (
            prompt
            - cached
            + c.queued_prefill_tokens
            + c.running * config.running_request_tokens
            + (best_held - cached) * left_behind_weight
        )

    chosen = next(c for c in candidates if c.worker == decision.worker)
    assert not hot(chosen)
    assert cost(chosen) == min(cost(c) for c in candidates if not hot(c))
    assert decision.cached_tokens == min(chosen.cached_tokens, prompt)
    if decision.reason is Reason.AFFINITY:
        assert chosen.cached_tokens == max(c.cached_tokens for c in candidates) > 0


def test_one_cached_token_is_affinity() -> None:
    # SGLang's default page of one token: a hit can be a single token.
    decision = choose([Candidate("a", cached_tokens=1), Candidate("b")], 10, RAND)
    assert decision is not None
    assert (decision.worker, decision.reason, decision.cached_tokens) == ("a", Reason.AFFINITY, 1)


def test_a_holder_at_the_hot_spot_threshold_that_loses_on_cost_is_a_load_decision() -> None:
    # a runs exactly 1.5 * 0 + 4 = 4 requests: not hot, just too busy for its 16 tokens.
    decision = choose([Candidate("a", cached_tokens=16, running=4), Candidate("b")], 1000, RAND)
    assert decision is not None
    assert (decision.worker, decision.reason) == ("b", Reason.LOAD)


def test_a_hot_worker_holding_no_more_than_the_choice_is_not_why() -> None:
    # a holds the most but its queue decides; h is hot but holds nothing b lacks.
    candidates = [
        Candidate("a", cached_tokens=2048, queued_prefill_tokens=100_000),
        Candidate("h", cached_tokens=0, running=9),
        Candidate("b", cached_tokens=0, running=1),
    ]
    decision = choose(candidates, 2176, RAND)
    assert decision is not None
    assert (decision.worker, decision.reason) == ("b", Reason.LOAD)


def test_ties_at_no_cost_still_go_to_the_fewest_sent() -> None:
    # Both hold the whole prompt and run nothing: equal (and the cheapest possible) costs.
    candidates = [Candidate("a", cached_tokens=100, sent=5), Candidate("b", cached_tokens=100, sent=2)]
    for seed in range(10):
        decision = choose(candidates, 100, random.Random(seed))
        assert decision is not None
        assert decision.worker == "b"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"hot_spot_ratio": 1.0},
        {"hot_spot_slack": 0},
        {"running_request_tokens": 0},
        {"left_behind_weight": 0.0},
    ],
)
def test_config_takes_its_bounds(kwargs: dict[str, float]) -> None:
    config = PolicyConfig(**kwargs)  # type: ignore[arg-type]
    for name, value in kwargs.items():
        assert getattr(config, name) == value
