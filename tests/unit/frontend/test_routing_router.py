"""The router: keys per block size, kv / approx / unset, round-robin and random."""

from __future__ import annotations

import random

import pytest

from sidecar_common.kv_keys import block_keys
from sidecar_frontend.routing.policy import PolicyConfig, Reason
from sidecar_frontend.routing.router import Prompt, Router, RouterConfig, Routing, Target

PREFIX = list(range(1000, 1000 + 2048))


def _router(routing: Routing | None = None, **kwargs: object) -> Router:
    return Router(RouterConfig(routing=routing, **kwargs), block_keys, random.Random(0))  # type: ignore[arg-type]


def test_kv_routes_to_the_worker_whose_stream_says_it_holds_the_prefix() -> None:
    router = _router(Routing.KV)
    router.index("m").store("b", block_keys(PREFIX, 16))
    targets = [
        Target("a", 16, publishes=True),
        Target("b", 16, publishes=True),
        Target("c", 16, publishes=True),
    ]
    decision = router.choose("m", Prompt([*PREFIX, 1, 2, 3]), targets, now=0.0)
    assert decision is not None
    assert (decision.worker, decision.reason, decision.cached_tokens) == ("b", Reason.AFFINITY, 2048)


def test_the_last_prompt_token_is_never_predicted_cached() -> None:
    # The engines compute at least the last token: a prompt that is exactly the cached
    # prefix hits one block less.
    router = _router(Routing.KV)
    router.index("m").store("a", block_keys(PREFIX, 16))
    decision = router.choose("m", Prompt(PREFIX), [Target("a", 16, publishes=True)], now=0.0)
    assert decision is not None
    assert decision.cached_tokens == 2048 - 16


def test_keys_follow_each_workers_block_size() -> None:
    router = _router(Routing.KV)
    router.index("m").store("page1", block_keys(PREFIX[:100], 1))
    router.index("m").store("block16", block_keys(PREFIX[:64], 16))
    targets = [Target("page1", 1, publishes=True), Target("block16", 16, publishes=True)]
    decision = router.choose("m", Prompt(PREFIX[:200]), targets, now=0.0)
    assert decision is not None
    assert (decision.worker, decision.cached_tokens) == ("page1", 100)


def test_lora_and_salt_take_part_in_the_key() -> None:
    router = _router(Routing.KV)
    router.index("m").store("a", block_keys(PREFIX, 16, lora_name="x"))
    router.index("m").store("b", block_keys(PREFIX, 16, cache_salt="s"))
    targets = [Target("a", 16, publishes=True), Target("b", 16, publishes=True)]
    on_a = router.choose("m", Prompt([*PREFIX, 1], lora_name="x"), targets, now=0.0)
    on_b = router.choose("m", Prompt([*PREFIX, 1], cache_salt="s"), targets, now=0.0)
    assert on_a is not None
    assert on_b is not None
    assert (on_a.worker, on_a.cached_tokens, on_b.worker, on_b.cached_tokens) == ("a", 2048, "b", 2048)


def test_kv_ignores_a_worker_that_publishes_nothing_and_records_no_guess() -> None:
    router = _router(Routing.KV)
    targets = [Target("quiet", 16, publishes=False)]
    first = router.choose("m", Prompt([*PREFIX, 1]), targets, now=0.0)
    second = router.choose("m", Prompt([*PREFIX, 1]), targets, now=1.0)
    assert first is not None
    assert second is not None
    assert (second.worker, second.reason, second.cached_tokens) == ("quiet", Reason.LOAD, 0)
    assert router.index("m").entries == 0


def test_approx_learns_from_its_own_decisions_until_they_expire() -> None:
    router = _router(Routing.APPROX, approx_ttl=60.0)
    targets = [Target("a", 16), Target("b", 16), Target("c", 16)]
    first = router.choose("m", Prompt([*PREFIX, 1]), targets, now=0.0)
    assert first is not None
    assert first.reason is Reason.LOAD
    again = router.choose("m", Prompt([*PREFIX, 2]), targets, now=30.0)
    assert again is not None
    assert (again.worker, again.reason, again.cached_tokens) == (first.worker, Reason.AFFINITY, 2048)
    # Refreshed at 30: still there at 80, gone at 90.
    still = router.choose("m", Prompt([*PREFIX, 3]), [Target(first.worker, 16)], now=80.0)
    assert still is not None
    assert still.cached_tokens == 2048
    router.index("m").expire(200.0)
    assert router.index("m").entries == 0


def test_unset_routing_mixes_exact_and_approximate_workers() -> None:
    router = _router(None)
    targets = [Target("exact", 16, publishes=True), Target("guess", 16, publishes=False)]
    for now in range(6):
        decision = router.choose("m", Prompt([*PREFIX, now]), targets, now=float(now))
        assert decision is not None
    # Only the worker that publishes nothing got approximate entries.
    assert router.index("m").blocks_of("exact") == 0
    assert router.index("m").blocks_of("guess") == 2048 // 16


def test_uncacheable_prompts_are_routed_on_load_and_recorded_nowhere() -> None:
    router = _router(Routing.APPROX)
    router.index("m").store("a", block_keys(PREFIX, 16))
    decision = router.choose(
        "m", Prompt([*PREFIX, 1], cacheable=False), [Target("a", 16, running=5), Target("b", 16)], now=0.0
    )
    assert decision is not None
    assert (decision.worker, decision.reason) == ("b", Reason.LOAD)
    assert router.index("m").blocks_of("b") == 0


def test_models_have_separate_indexes() -> None:
    router = _router(Routing.KV)
    router.index("one").store("a", block_keys(PREFIX, 16))
    decision = router.choose("two", Prompt([*PREFIX, 1]), [Target("a", 16, publishes=True)], now=0.0)
    assert decision is not None
    assert decision.cached_tokens == 0


def test_forget_worker_drops_it_from_every_index() -> None:
    router = _router(Routing.KV)
    router.index("one").store("a", [1, 2])
    router.index("two").store("a", [3])
    router.forget_worker("a")
    assert all("a" not in index.workers() for index in router.indexes().values())


def test_round_robin_turns_per_key_in_address_order() -> None:
    router = _router(Routing.ROUND_ROBIN)
    targets = [Target("b"), Target("a"), Target("c")]
    picks = [router.choose("m", Prompt([1]), targets, 0.0, turn_key="agg/m") for _ in range(4)]
    assert [p.worker for p in picks if p] == ["a", "b", "c", "a"]
    other = router.choose("m", Prompt([1]), targets, 0.0, turn_key="prefill/m")
    assert other is not None
    assert (other.worker, other.reason) == ("a", Reason.ROUND_ROBIN)


def test_random_reaches_every_worker() -> None:
    router = _router(Routing.RANDOM)
    targets = [Target("a"), Target("b"), Target("c")]
    seen = {d.worker for d in (router.choose("m", Prompt([1]), targets, 0.0) for _ in range(60)) if d}
    assert seen == {"a", "b", "c"}


def test_no_target_no_decision() -> None:
    assert _router().choose("m", Prompt([1, 2]), [], 0.0) is None


def test_load_is_not_a_routers_choice() -> None:
    with pytest.raises(ValueError, match="load"):
        _router(Routing.LOAD)


def test_a_burst_on_one_cached_worker_of_three_spreads_within_bounds() -> None:
    """100 concurrent long requests sharing a prefix the index places on one of three equal
    workers: that worker takes 40-90 % of them."""
    router = _router(Routing.KV)
    router.index("m").store("a", block_keys(PREFIX, 16))
    running = {"a": 0, "b": 0, "c": 0}
    queued = {"a": 0, "b": 0, "c": 0}
    for i in range(100):
        targets = [Target(w, 16, True, running[w], queued[w]) for w in running]
        decision = router.choose("m", Prompt([*PREFIX, *range(i * 128, i * 128 + 128)]), targets, now=0.0)
        assert decision is not None
        running[decision.worker] += 1
        queued[decision.worker] += 2048 + 128 - decision.cached_tokens
    assert 40 <= running["a"] <= 90, running


def test_retain_drops_the_entries_of_workers_that_no_longer_serve_the_model() -> None:
    # A rollout: w1 served model-a, now serves model-b at the same address; w2 left.
    router = Router(RouterConfig(routing=Routing.APPROX), block_keys)
    router.index("model-a").store("w1", [1, 2, 3])
    router.index("model-a").store("w2", [1, 2])
    router.index("model-b").store("w1", [7])
    router.retain({"w1": "model-b"})
    assert set(router.indexes()) == {"model-b"}
    assert router.index("model-b").workers() == frozenset({"w1"})


def test_retain_keeps_what_still_serves() -> None:
    router = Router(RouterConfig(routing=Routing.APPROX), block_keys)
    router.index("model-a").store("w1", [1, 2])
    router.retain({"w1": "model-a", "w2": "model-a"})
    assert router.index("model-a").workers() == frozenset({"w1"})
    assert router.index("model-a").holders(1) == frozenset({"w1"})


@pytest.mark.parametrize("routing", [Routing.KV, Routing.APPROX, None])
def test_new_prefixes_on_idle_workers_are_spread_in_turn(routing: Routing | None) -> None:
    """Prompts that no worker holds, on workers equally idle: each worker gets its share
    (random ties gave one of 4 workers twice another's share of multi-turn conversations)."""
    router = _router(routing)
    targets = [Target(w, 16, routing is Routing.KV) for w in ("a", "b", "c", "d")]
    sent: dict[str, int] = {}
    for i in range(40):
        decision = router.choose("m", Prompt(list(range(i * 1000, i * 1000 + 64))), targets, now=0.0)
        assert decision is not None
        sent[decision.worker] = sent.get(decision.worker, 0) + 1
    assert sent == {"a": 10, "b": 10, "c": 10, "d": 10}


@pytest.mark.parametrize("leaves", ["forget_worker", "retain"])
def test_a_worker_that_left_and_came_back_starts_its_count_again(leaves: str) -> None:
    router = _router(Routing.KV)
    targets = [Target(w, 16, True) for w in ("a", "b")]

    def pick(i: int) -> str:
        decision = router.choose("m", Prompt(list(range(i * 100, i * 100 + 40))), targets, now=0.0)
        assert decision is not None
        return decision.worker

    assert sorted(pick(i) for i in range(8)) == ["a"] * 4 + ["b"] * 4
    if leaves == "forget_worker":
        router.forget_worker("a")
    else:
        router.retain({"b": "m"})
    # "a" is back with a count of 0 and "b" has 4: the next four ties all go to "a".
    assert [pick(100 + i) for i in range(4)] == ["a"] * 4


def test_retain_keeps_a_worker_whose_model_is_unknown_for_now() -> None:
    # Its health watch broke (the frontend asks for its model again once it serves): its
    # entries came from its cache stream, which will not send them again.
    router = Router(RouterConfig(routing=Routing.KV), block_keys)
    router.index("model-a").store("w1", [1, 2, 3])
    router.retain({"w1": None})
    assert router.index("model-a").holders(1) == frozenset({"w1"})
    router.retain({"w1": "model-b"})  # known again, and it serves another model now
    assert "model-a" not in router.indexes()


@pytest.mark.parametrize("routing", [Routing.KV, Routing.APPROX, None])
def test_the_first_new_prefixes_go_to_distinct_idle_workers(routing: Routing | None) -> None:
    targets = [Target(w, 16, routing is Routing.KV) for w in ("a", "b", "c", "d")]
    for seed in range(10):
        router = Router(RouterConfig(routing=routing), block_keys, random.Random(seed))
        picks = []
        for i in range(4):
            decision = router.choose("m", Prompt(list(range(i * 1000, i * 1000 + 64))), targets, now=0.0)
            assert decision is not None
            picks.append(decision.worker)
        assert sorted(picks) == ["a", "b", "c", "d"], (seed, picks)


def test_round_robin_and_random_predict_nothing_cached() -> None:
    for routing, reason in ((Routing.ROUND_ROBIN, Reason.ROUND_ROBIN), (Routing.RANDOM, Reason.RANDOM)):
        decision = _router(routing).choose("m", Prompt([*PREFIX, 1]), [Target("a", 16)], 0.0)
        assert decision is not None
        assert (decision.worker, decision.reason, decision.cached_tokens) == ("a", reason, 0)


def test_a_two_token_prompt_can_hit_a_page_of_one() -> None:
    router = _router(Routing.KV)
    router.index("m").store("a", block_keys([7], 1))
    targets = [Target("a", 1, publishes=True), Target("b", 1, publishes=True)]
    decision = router.choose("m", Prompt([7, 8]), targets, now=0.0)
    assert decision is not None
    assert (decision.worker, decision.reason, decision.cached_tokens) == ("a", Reason.AFFINITY, 1)


def test_the_configured_policy_is_the_one_applied() -> None:
    # b holds the conversation but is busy with a queued prefill about as long as the turn.
    targets = [Target("a", 16, True), Target("b", 16, True, running=1, queued_prefill_tokens=1088)]
    turn = Prompt([*PREFIX[:1088], *range(72)])
    chosen = {}
    for weight in (0.0, 1.0):
        router = _router(Routing.KV, policy=PolicyConfig(left_behind_weight=weight))
        router.index("m").store("b", block_keys(PREFIX[:1088], 16))
        decision = router.choose("m", turn, targets, now=0.0)
        assert decision is not None
        chosen[weight] = decision.worker
    assert chosen == {0.0: "a", 1.0: "b"}


def test_a_worker_of_unknown_block_size_is_matched_in_blocks_of_16() -> None:
    router = _router(Routing.KV)
    router.index("m").store("a", block_keys(PREFIX, 16))
    decision = router.choose("m", Prompt([*PREFIX, 1]), [Target("a", 0, publishes=True)], now=0.0)
    assert decision is not None
    assert decision.cached_tokens == 2048


def test_unset_routing_guesses_only_for_the_workers_that_publish_nothing() -> None:
    router = _router(None)
    targets = [Target("exact", 16, publishes=True), Target("guess", 16, publishes=False)]
    chosen = set()
    for i in range(6):  # prompts sharing nothing: ties, dealt out in turn
        decision = router.choose("m", Prompt(list(range(i * 1000, i * 1000 + 64))), targets, now=0.0)
        assert decision is not None
        chosen.add(decision.worker)
    assert chosen == {"exact", "guess"}
    assert router.index("m").blocks_of("exact") == 0
    assert router.index("m").blocks_of("guess") == 3 * 4


def test_approx_guesses_even_for_a_worker_that_publishes() -> None:
    router = _router(Routing.APPROX)
    decision = router.choose("m", Prompt([*PREFIX, 1]), [Target("a", 16, publishes=True)], now=0.0)
    assert decision is not None
    assert router.index("m").blocks_of("a") == 2048 // 16


def test_approx_records_a_one_token_prompt_on_a_page_of_one() -> None:
    router = _router(Routing.APPROX)
    decision = router.choose("m", Prompt([7]), [Target("a", 1)], now=0.0)
    assert decision is not None
    assert router.index("m").blocks_of("a") == 1


def test_the_index_cap_is_the_configured_one() -> None:
    router = _router(Routing.KV, index_max_bytes=64 * 1024)
    router.index("m").store("a", block_keys(list(range(16 * 4096)), 16))
    stats = router.index("m").stats()
    assert stats.evicted > 0
    assert stats.bytes <= 64 * 1024


def test_forgetting_one_worker_keeps_the_others_entries() -> None:
    router = _router(Routing.KV)
    router.index("m").store("a", [1, 2])
    router.index("m").store("b", [1])
    router.forget_worker("a")
    assert router.indexes()["m"].blocks_of("b") == 1


@pytest.mark.parametrize("ttl", [0.0, -1.0])
def test_approx_ttl_must_be_positive(ttl: float) -> None:
    with pytest.raises(ValueError, match="approx_ttl must be positive"):
        RouterConfig(approx_ttl=ttl)
    assert RouterConfig(approx_ttl=0.5).approx_ttl == 0.5
