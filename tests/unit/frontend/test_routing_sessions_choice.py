"""Sticky sessions in the worker choice, over a worker set of unconnected workers: a session's
turns stay on its worker, new ones start on the least loaded, a turn moves when its worker is
saturated, failed it or serves no more, sessions end by /finish_session, idleness or the bound;
and the HTTP side (the header middleware, /finish_session answered as vllm-router answers)."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from sidecar_common.api import sidecar_pb2, sidecar_pb2_grpc
from sidecar_common.endpoint import parse_endpoint
from sidecar_common.kv_keys import block_keys
from sidecar_common.pool import ChannelPool, PoolConfig
from sidecar_common.rpc import StubCache
from sidecar_frontend.registry import Worker, WorkerState
from sidecar_frontend.routing.choice import RoutedChoice
from sidecar_frontend.routing.router import Router, RouterConfig, Routing
from sidecar_frontend.routing.sessions import DEFAULT_SESSION_HEADERS, SessionSettings
from sidecar_frontend.routing.sessions_choice import CURRENT_SESSION, SessionChoice, Sessions
from sidecar_frontend.routing.sessions_http import finish_session_routes, session_middleware
from sidecar_frontend.routing.wiring import RoutingParts
from sidecar_frontend.workers import WorkerSet

A, B, C = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"
MODEL = "m"
PROMPT = list(range(100, 164))  # 64 tokens: 4 blocks of 16


def worker(address: str, *, running_limit: int = 4) -> Worker:
    pool = ChannelPool(PoolConfig(parse_endpoint(address)))  # never connected: no I/O here
    stubs = StubCache(pool, lambda channel: sidecar_pb2_grpc.WorkerStub(channel))
    w = Worker(address, "agg", pool, stubs)
    w.state = WorkerState.SERVING
    w.model = sidecar_pb2.ModelInfo(
        served_model_name=MODEL, vocab_size=1000, kv_block_size=16, max_num_seqs=running_limit
    )
    return w


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Fleet:
    def __init__(self, addresses: list[str], settings: SessionSettings) -> None:
        self.clock = Clock()
        self.registry = CollectorRegistry()
        self.workers = WorkerSet(rand=random.Random(3))
        self.members = {address: worker(address) for address in addresses}
        for member in self.members.values():
            self.workers.registry.add(member)
        self.router = Router(RouterConfig(routing=Routing.APPROX), block_keys, random.Random(0))
        self.sessions = Sessions(settings, self.registry, clock=self.clock)
        routed = RoutedChoice(self.workers, self.router, clock=self.clock)
        self.choice = SessionChoice(routed, self.workers, self.sessions)

    def turn(
        self, session: str | None, prompt: list[int] = PROMPT, *, exclude: frozenset[str] = frozenset()
    ) -> str | None:
        with named(session):
            chosen = self.choice("agg", MODEL, request(prompt), exclude)
        return chosen.address if chosen is not None else None

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


@contextmanager
def named(session: str | None) -> Iterator[None]:
    token = CURRENT_SESSION.set(session)
    try:
        yield
    finally:
        CURRENT_SESSION.reset(token)


def request(prompt: list[int]) -> sidecar_pb2.PreprocessedRequest:
    return sidecar_pb2.PreprocessedRequest(request_id="r", token_ids=prompt)


def test_a_sessions_turns_stay_on_its_worker_and_new_sessions_start_on_the_least_loaded() -> None:
    fleet = Fleet([A, B, C], SessionSettings())
    first = {s: fleet.turn(s) for s in ("s1", "s2", "s3")}
    assert sorted(first.values()) == [A, B, C], "each new session on the worker holding the fewest"  # type: ignore[type-var]
    for _ in range(3):
        for session, address in first.items():
            assert fleet.turn(session, [*PROMPT, 7, 8, 9]) == address
    assert fleet.metric("frontend_sessions_started_total", role="agg") == 3
    assert fleet.metric("frontend_sessions_held", worker=A) == 1
    found = fleet.sessions.table.get(("agg", "s1"))
    assert found is not None
    assert found.turns == 4


def test_a_request_without_a_session_is_routed_as_before_and_held_nowhere() -> None:
    fleet = Fleet([A, B], SessionSettings())
    assert fleet.turn(None) in (A, B)
    assert len(fleet.sessions.table) == 0
    assert fleet.metric("frontend_sessions_started_total", role="agg") == 0


def test_a_decode_step_is_chosen_by_load_not_held() -> None:
    fleet = Fleet([A], SessionSettings())
    decode = worker(B)
    decode.role = "decode"
    fleet.workers.registry.add(decode)
    with named("s"):
        chosen = fleet.choice("decode", MODEL, request(PROMPT), frozenset())
    assert chosen is decode
    assert len(fleet.sessions.table) == 0


def test_a_saturated_workers_session_moves_and_the_cache_it_leaves_is_counted() -> None:
    fleet = Fleet([A, B], SessionSettings())
    held = fleet.turn("s")
    assert held is not None
    other = B if held == A else A
    fleet.members[held].inflight = 4  # its running limit (max_num_seqs 4): saturated
    assert fleet.turn("s", [*PROMPT, 1]) == other
    assert fleet.metric("frontend_sessions_moved_total", role="agg", reason="saturated") == 1
    # The first turn's prompt (4 full blocks) was recorded on the old worker; a prompt's last
    # token is never predicted cached, so 4 blocks of the 65-token turn were.
    assert fleet.metric("frontend_sessions_left_behind_tokens_total") == 64
    fleet.members[held].inflight = 0
    assert fleet.turn("s", [*PROMPT, 1, 2]) == other, "it stays where it moved"


def test_a_saturated_worker_keeps_its_session_when_every_other_is_saturated_too() -> None:
    fleet = Fleet([A, B], SessionSettings())
    held = fleet.turn("s")
    for member in fleet.members.values():
        member.inflight = 4
    assert fleet.turn("s") == held
    assert fleet.metric("frontend_sessions_moved_total", role="agg", reason="saturated") == 0


def test_the_saturation_bound_is_a_factor_of_the_running_limit_or_its_override() -> None:
    fleet = Fleet([A, B], SessionSettings(saturation=2.0, worker_capacity={A: 1, B: 1}))
    held = fleet.turn("s")
    assert held is not None
    fleet.members[held].inflight = 1  # at its (overridden) limit, under twice it
    assert fleet.turn("s") == held
    fleet.members[held].inflight = 2
    assert fleet.turn("s") != held


def test_a_turn_its_worker_failed_moves_the_session() -> None:
    fleet = Fleet([A, B], SessionSettings())
    held = fleet.turn("s")
    assert held is not None
    # The attempt runner asks again with the failed worker excluded.
    moved = fleet.turn("s", exclude=frozenset({held}))
    assert moved not in (None, held)
    assert fleet.metric("frontend_sessions_moved_total", role="agg", reason="failover") == 1
    assert fleet.turn("s") == moved


def test_a_session_whose_worker_serves_no_more_moves() -> None:
    fleet = Fleet([A, B], SessionSettings())
    held = fleet.turn("s")
    assert held is not None
    fleet.workers.registry.set_state(fleet.members[held], WorkerState.NOT_SERVING)
    assert fleet.turn("s") not in (None, held)
    assert fleet.metric("frontend_sessions_moved_total", role="agg", reason="unavailable") == 1


def test_no_worker_serving_no_worker_and_nothing_held() -> None:
    fleet = Fleet([A], SessionSettings())
    fleet.workers.registry.set_state(fleet.members[A], WorkerState.NOT_SERVING)
    assert fleet.turn("s") is None
    assert len(fleet.sessions.table) == 0


def test_a_new_session_goes_where_its_prompt_is_cached_among_the_least_loaded() -> None:
    fleet = Fleet([A, B, C], SessionSettings())
    fleet.router.index(MODEL).store(B, block_keys(PROMPT, 16))
    for n in range(5):
        session = f"group-{n}"
        assert fleet.turn(session, [*PROMPT, n]) == B
        assert fleet.sessions.finish(session) == 1  # back to 0 sessions everywhere


def test_finish_releases_a_session_and_its_next_turn_starts_it_anew() -> None:
    fleet = Fleet([A, B], SessionSettings())
    fleet.turn("s")
    assert fleet.sessions.finish("s") == 1
    assert fleet.sessions.finish("s") == 0, "unknown now: nothing released"
    assert fleet.metric("frontend_sessions_ended_total", reason="finished") == 1
    assert (
        fleet.metric("frontend_sessions_held", worker=A) + fleet.metric("frontend_sessions_held", worker=B)
        == 0
    )
    fleet.turn("s")
    assert fleet.metric("frontend_sessions_started_total", role="agg") == 2


def test_an_idle_session_expires() -> None:
    fleet = Fleet([A, B], SessionSettings(idle=60.0))
    fleet.turn("s")
    fleet.clock.now += 59.0
    fleet.turn("s")
    fleet.clock.now += 59.0
    assert len(fleet.sessions.table) == 1
    fleet.clock.now += 1.0
    assert sum(fleet.sessions.held().values()) == 0, "a scrape expires it"
    assert fleet.metric("frontend_sessions_ended_total", reason="expired") == 1


def test_past_the_bound_the_least_recently_used_session_is_forgotten() -> None:
    fleet = Fleet([A, B], SessionSettings(max_sessions=2))
    for session in ("a", "b", "c"):
        fleet.turn(session)
    assert len(fleet.sessions.table) == 2
    assert fleet.sessions.table.get(("agg", "a")) is None
    assert fleet.metric("frontend_sessions_ended_total", reason="evicted") == 1


# ---------------------------------------------------------------- the HTTP side


@asynccontextmanager
async def app(sessions: Sessions) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    async def probe(request: web.Request) -> web.Response:
        return web.Response(text=CURRENT_SESSION.get() or "none")

    application = web.Application(middlewares=[session_middleware(DEFAULT_SESSION_HEADERS)])
    application.add_routes([*finish_session_routes(sessions), web.get("/probe", probe)])
    async with TestClient(TestServer(application)) as client:
        yield client


async def test_finish_session_is_answered_as_vllm_router_answers_it() -> None:
    fleet = Fleet([A], SessionSettings())
    fleet.turn("traj-1")
    async with app(fleet.sessions) as client:
        response = await client.post("/finish_session", params={"session_id": "traj-1"})
        assert response.status == 200
        assert response.content_type == "application/json"
        assert await response.read() == b'{"status":"ok","session_id":"traj-1"}'
        assert len(fleet.sessions.table) == 0
        # Unknown, or empty: the same answer (a best-effort release).
        for session, body in (
            ("nobody", '{"status":"ok","session_id":"nobody"}'),
            ("", '{"status":"ok","session_id":""}'),
        ):
            response = await client.post("/finish_session", params={"session_id": session})
            assert (response.status, await response.text()) == (200, body)
        response = await client.post("/finish_session?session_id=%E2%9C%93")
        assert await response.read() == '{"status":"ok","session_id":"✓"}'.encode()


async def test_finish_session_refuses_a_missing_or_repeated_id_and_another_method() -> None:
    fleet = Fleet([A], SessionSettings())
    async with app(fleet.sessions) as client:
        response = await client.post("/finish_session")
        assert response.status == 400
        assert response.content_type == "text/plain"
        assert await response.text() == "Failed to deserialize query string: missing field `session_id`"
        response = await client.post("/finish_session?session_id=a&session_id=b")
        assert (response.status, await response.text()) == (
            400,
            "Failed to deserialize query string: duplicate field `session_id`",
        )
        response = await client.get("/finish_session", params={"session_id": "a"})
        assert response.status == 405
        assert response.headers["Allow"] == "POST"
        assert await response.read() == b""


async def test_the_middleware_names_the_session_for_the_request_only() -> None:
    fleet = Fleet([A], SessionSettings())
    async with app(fleet.sessions) as client:
        for headers, expected in (
            ({"X-SMG-Routing-Key": "slime-1"}, "slime-1"),
            ({"X-Session-ID": "skyrl-1"}, "skyrl-1"),
            ({"x-session-id": "prime-1"}, "prime-1"),
            ({}, "none"),
        ):
            response = await client.get("/probe", headers=headers)
            assert await response.text() == expected
    assert CURRENT_SESSION.get() is None


def test_routing_parts_read_the_header_only_with_sessions_on_and_always_answer_finish_session() -> None:
    on = RoutingParts.build(RouterConfig(routing=Routing.LOAD), CollectorRegistry())
    off = RoutingParts.build(
        RouterConfig(routing=Routing.LOAD, sessions=SessionSettings(enabled=False)), CollectorRegistry()
    )
    assert len(on.middlewares()) == 1
    assert off.middlewares() == ()
    for parts in (on, off):
        assert [(r.method, r.path) for r in parts.http_routes()] == [("*", "/finish_session")]


def test_a_disaggregated_session_sticks_its_prefill_worker_and_finish_releases_it() -> None:
    fleet = Fleet([], SessionSettings())
    prefills = [worker(A), worker(B)]
    for member in prefills:
        member.role = "prefill"
        fleet.workers.registry.add(member)
    with named("s"):
        first = fleet.choice("prefill", MODEL, request(PROMPT), frozenset())
        assert first is not None
        for n in range(3):
            assert fleet.choice("prefill", MODEL, request([*PROMPT, n]), frozenset()) is first
    assert fleet.metric("frontend_sessions_started_total", role="prefill") == 1
    assert fleet.sessions.finish("s") == 1
    assert len(fleet.sessions.table) == 0
