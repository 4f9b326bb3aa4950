"""With admission on, the routed choice sends a request to a worker with a free slot when any
has one (``RoutedChoice`` over ``Gate.with_room``): admission let it in because the fleet had
room, and a worker at its running limit would queue it in its engine. When none has room the
choice is the policy's, as without admission. Real worker set, router and gate; no I/O."""

from __future__ import annotations

import random

import pytest

from sidecar_common.api import sidecar_pb2, sidecar_pb2_grpc
from sidecar_common.endpoint import parse_endpoint
from sidecar_common.kv_keys import block_keys
from sidecar_common.pool import ChannelPool, PoolConfig
from sidecar_common.rpc import StubCache
from sidecar_frontend.admission.gate import Gate
from sidecar_frontend.admission.state import AdmissionSettings
from sidecar_frontend.config import AdmissionConfig
from sidecar_frontend.registry import Worker, WorkerState
from sidecar_frontend.routing.choice import RoutedChoice
from sidecar_frontend.routing.router import Prompt, Router, RouterConfig, Routing, Target
from sidecar_frontend.workers import WorkerSet

NOW = 1000.0
LIMIT = 2
PROMPT = list(range(1, 257))  # 16 blocks of 16: its cached prefix outweighs a running request


def worker(address: str, role: str = "agg") -> Worker:
    pool = ChannelPool(PoolConfig(parse_endpoint(address)))  # never connected: no I/O here
    stubs = StubCache(pool, lambda channel: sidecar_pb2_grpc.WorkerStub(channel))
    w = Worker(address, role, pool, stubs)  # type: ignore[arg-type]
    w.state = WorkerState.SERVING
    w.model = sidecar_pb2.ModelInfo(
        served_model_name="m", vocab_size=100, kv_block_size=16, max_num_seqs=LIMIT
    )
    w.load_reported_at = NOW  # a fresh report of nothing but this frontend's own requests
    return w


def fleet(routing: Routing, *addresses: str, role: str = "agg") -> tuple[WorkerSet, Router, Gate]:
    workers = WorkerSet(rand=random.Random(7))
    for address in addresses:
        workers.registry.add(worker(address, role))
    router = Router(RouterConfig(routing=routing), block_keys, random.Random(0))
    config = AdmissionConfig(settings=AdmissionSettings(headroom=0.0))
    return workers, router, Gate(workers.registry, config, clock=lambda: NOW)


def request() -> sidecar_pb2.PreprocessedRequest:
    return sidecar_pb2.PreprocessedRequest(request_id="r", token_ids=PROMPT)


def get(workers: WorkerSet, address: str) -> Worker:
    found = workers.registry.get(address)
    assert found is not None
    return found


def cache_on(router: Router, address: str) -> None:
    """The router predicts the whole prompt cached on ``address`` (it was sent there)."""
    router.choose("m", Prompt(PROMPT), [Target(address, block_size=16)], NOW)


@pytest.mark.parametrize("room_first", [True, False])
def test_a_worker_at_its_limit_is_passed_over_for_one_with_room_even_holding_the_prefix(
    room_first: bool,
) -> None:
    workers, router, gate = fleet(Routing.APPROX, "10.0.0.1:1", "10.0.0.2:1")
    cache_on(router, "10.0.0.1:1")
    holder, other = get(workers, "10.0.0.1:1"), get(workers, "10.0.0.2:1")
    holder.inflight = LIMIT  # full
    other.inflight = LIMIT - 1
    choice = RoutedChoice(
        workers, router, clock=lambda: NOW, with_room=gate.with_room if room_first else None
    )
    chosen = choice("agg", "m", request(), frozenset())
    # Without admission's reading, the prefix wins: the request would wait in the full engine.
    assert chosen is (other if room_first else holder)


def test_when_no_worker_has_room_the_policy_chooses_among_all() -> None:
    workers, router, gate = fleet(Routing.APPROX, "10.0.0.1:1", "10.0.0.2:1")
    cache_on(router, "10.0.0.1:1")
    for w in workers.workers():
        w.inflight = LIMIT
    choice = RoutedChoice(workers, router, clock=lambda: NOW, with_room=gate.with_room)
    assert choice("agg", "m", request(), frozenset()) is get(workers, "10.0.0.1:1")


def test_an_engine_with_its_own_queue_has_no_room_and_a_late_report_does_not_matter() -> None:
    # Staleness is admission's concern: routing that passed stale workers over would herd every
    # request onto the workers whose reports happened to arrive in time.
    workers, router, gate = fleet(Routing.APPROX, "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1")
    queueing, late, full = (get(workers, f"10.0.0.{i}:1") for i in (1, 2, 3))
    queueing.waiting_requests = 1
    late.load_reported_at = NOW - 60
    late.inflight = LIMIT - 1
    full.inflight = LIMIT
    assert gate.with_room([queueing, late, full]) == [late]
    choice = RoutedChoice(workers, router, clock=lambda: NOW, with_room=gate.with_room)
    assert {choice("agg", "m", request(), frozenset()) for _ in range(6)} == {late}


def test_a_worker_that_never_reported_is_counted_on_this_frontends_own_requests() -> None:
    workers, _, gate = fleet(Routing.APPROX, "10.0.0.1:1", "10.0.0.2:1")
    full, spare = get(workers, "10.0.0.1:1"), get(workers, "10.0.0.2:1")
    for w in (full, spare):
        w.load_reported_at = None
    full.inflight = LIMIT
    assert gate.with_room([full, spare]) == [spare]


def test_the_load_choice_and_decode_workers_take_room_first_too() -> None:
    # No router (--routing load): the worker set's power of two choices, among the roomy ones.
    workers, _, gate = fleet(Routing.APPROX, "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1", role="decode")
    a, b, c = (get(workers, f"10.0.0.{i}:1") for i in (1, 2, 3))
    a.inflight, b.inflight, c.inflight = LIMIT, LIMIT, LIMIT - 1
    a.reported_inflight = 0  # the limit is reached by this frontend's own requests alone
    choice = RoutedChoice(workers, None, clock=lambda: NOW, with_room=gate.with_room)
    assert {choice("decode", "m", request(), frozenset()) for _ in range(12)} == {c}
    # Excluded (tried already): the rest, full or not.
    assert choice("decode", "m", request(), frozenset({c.address})) in (a, b)
