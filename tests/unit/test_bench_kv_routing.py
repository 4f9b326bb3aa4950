"""The KV-routing benchmark's pure parts (bench/kv_routing): the workloads it replays and the
bound it checks the hit rate against."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.kv_routing import micro
from bench.kv_routing.__main__ import _half_shared, markdown, summarize, targets
from bench.kv_routing.ab import load_routing_at
from bench.kv_routing.fleet import Completed, FleetSpec
from bench.kv_routing.oracle import best_hits
from bench.kv_routing.sim import simulate_multi_turn, simulate_shared
from bench.kv_routing.workloads import MultiTurn, SharedPrefix, multi_turn, shared_prefix
from sidecar_frontend.routing import router as router_module


def test_shared_prefix_requests_share_their_group_prefix_and_arrive_in_order() -> None:
    spec = SharedPrefix(groups=3, prefix_tokens=32, question_tokens=8, requests=20, rate=10.0)
    requests = shared_prefix(spec)
    assert requests == shared_prefix(spec)  # seeded
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    by_group: dict[int, set[tuple[int, ...]]] = {}
    for r in requests:
        assert len(r.token_ids) == 40
        by_group.setdefault(r.group, set()).add(r.token_ids[:32])
    assert all(len(prefixes) == 1 for prefixes in by_group.values())
    assert len({next(iter(p)) for p in by_group.values()}) == len(by_group)


def test_multi_turn_conversations_have_their_own_system_prompt() -> None:
    convs = multi_turn(MultiTurn(conversations=4, turns=3, system_tokens=16, user_tokens=4, rate=2.0))
    assert len({c.system for c in convs}) == 4
    assert all(len(c.user_messages) == 3 and len(c.system) == 16 for c in convs)


def test_best_hits_counts_whole_blocks_seen_before_and_leaves_the_last_prompt_token() -> None:
    prefix = tuple(range(1000, 1032))  # two blocks of 16
    first = ((*prefix, 1, 2, 3), [7, 8])
    second = ((*prefix, 4, 5, 6), [9])
    exact_repeat = (prefix, [5])  # 32 tokens: only the first block may hit (the last token is computed)
    bound = best_hits([first, second, exact_repeat], 16)
    assert bound.prompt_tokens == 35 + 35 + 32
    assert bound.cached_tokens == 0 + 32 + 16


def test_best_hits_counts_an_earlier_answer_as_cached() -> None:
    turn1 = tuple(range(1000, 1016))
    answer = [2000 + i for i in range(17)]  # all but the last output token is cached
    turn2 = turn1 + tuple(answer) + (5,) * 20
    bound = best_hits([(turn1, answer), (turn2, [1])], 16)
    assert bound.cached_tokens == 32  # the prompt's block and the first block of the answer


def test_capacity_holds_about_half_the_distinct_prefixes() -> None:
    spec = SharedPrefix(groups=64, prefix_tokens=2048, question_tokens=128, requests=1, rate=1.0)
    assert _half_shared(spec) == 32 * 128


def test_decision_cost_runs_the_real_router_and_reports_its_parts() -> None:
    row = micro.decision_cost(256, 3, rounds=1, budget_s=0.001)
    assert set(row) == {
        "prompt_tokens",
        "workers",
        "choose_us",
        "choose_from_list_us",
        "keys_us",
        "walk_us",
        "approx_choose_us",
    }
    assert row["choose_us"] > 0
    assert row["approx_choose_us"] > 0


def test_the_ab_loads_another_commits_routing_beside_the_working_trees(tmp_path: Path) -> None:
    base = load_routing_at("HEAD", tmp_path)
    assert base is not router_module
    assert base.Router is not router_module.Router
    calls = micro.decision_setup(256, 3, base)
    assert base.Router.__module__ == base.__name__
    for call in calls.values():
        call()


def test_index_memory_is_reported_per_million_blocks() -> None:
    row = micro.index_memory(2048, workers=2)
    assert row["blocks"] == 2048
    assert row["tracemalloc_mib_per_million"] > 0
    assert row["estimate_mib_per_million"] > 0


def test_summary_and_report_of_a_run() -> None:
    prefix = tuple(range(1000, 1032))
    done = [
        Completed(0.0, (*prefix, 1), [5, 6], cached_tokens=0, ttft_s=0.02, done_s=0.03),
        Completed(0.1, (*prefix, 2), [5, 6], cached_tokens=32, ttft_s=0.01, done_s=0.12),
        Completed(0.2, (*prefix, 3), [], error="HTTP 503"),
    ]
    row = summarize(done, {"a": 2}, 1.0, 16, 2)
    assert row["hit_rate"] == round(32 / 66, 4)
    assert row["best_hit_rate"] == round(32 / 66, 4)
    assert row["errors"] == 1
    assert row["requests_per_worker"] == [2, 0]
    assert row["spread_max_over_min"] is None  # a worker took nothing
    report: dict[str, Any] = {
        "profile": "t", "date": "d", "commit": "c", "load_start": 1.0,
        "fleet": {"workers": 2, "block_size": 16, "prefill_us_per_token": 8.0, "max_num_seqs": 1,
                  "max_tokens": 2, "token_latency_ms": 1.0},
        "features": {"policies": ["load"], "sidecar_kv_flags": []},
        "sim_runs": [],
        "fleet_runs": [{**row, "workload": "shared", "policy": "kv", "replicas": 1,
                        "load_before": [1.0], "load_after": [1.0]}],
    }  # fmt: skip
    report["targets"] = targets(report)
    assert any(t.startswith("MET: shared: kv hit rate") for t in report["targets"])
    assert "| shared | kv | 1 |" in markdown(report)


def test_simulated_single_worker_with_room_for_everything_reaches_the_bound() -> None:
    spec = FleetSpec(workers=1, capacity_blocks=10_000, max_tokens=4)
    requests = shared_prefix(
        SharedPrefix(groups=3, prefix_tokens=64, question_tokens=8, requests=30, rate=5.0)
    )
    row = simulate_shared(spec, "load", requests).row(16)
    assert row["requests"] == 30
    assert row["hit_rate"] == row["best_hit_rate"]


def test_simulated_multi_turn_sends_every_turn_through_the_real_router() -> None:
    spec = FleetSpec(workers=2, capacity_blocks=10_000, max_tokens=4)
    convs = multi_turn(MultiTurn(conversations=3, turns=3, system_tokens=32, user_tokens=8, rate=2.0))
    row = simulate_multi_turn(spec, "kv", convs).row(16)
    assert row["requests"] == 9
    assert row["hit_rate"] == row["best_hit_rate"]  # room for everything: kv finds every prefix
