"""Worker choice: power of two choices over the load score, never a worker that does not serve."""

from __future__ import annotations

import random
from collections import Counter

import anyio
from hypothesis import given
from hypothesis import strategies as st

from sidecar_common.api import sidecar_pb2_grpc
from sidecar_common.endpoint import parse_endpoint
from sidecar_common.pool import ChannelPool, PoolConfig
from sidecar_common.rpc import StubCache
from sidecar_frontend.registry import Registry, Worker, WorkerState
from sidecar_frontend.worker_events import WorkerEvents

STATES = list(WorkerState)


def worker(
    address: str, state: WorkerState, inflight: int = 0, role: str = "agg", reported: int = 0
) -> Worker:
    pool = ChannelPool(PoolConfig(parse_endpoint(address)))  # never connected: choice does no I/O
    stubs = StubCache(pool, lambda channel: sidecar_pb2_grpc.WorkerStub(channel))
    w = Worker(address, role, pool, stubs)  # type: ignore[arg-type]
    w.state = state
    w.inflight = inflight
    w.reported_inflight = reported
    return w


def worker_set(workers: list[Worker], seed: int = 0) -> Registry:
    ws = Registry(WorkerEvents(), rand=random.Random(seed))
    for w in workers:
        ws.add(w)  # filled without the network
    return ws


@given(
    st.lists(
        st.tuples(st.sampled_from(STATES), st.integers(0, 50), st.sampled_from(["agg", "decode"])), max_size=8
    ),
    st.sets(st.integers(0, 7)),
    st.integers(0, 2**32),
)
def test_pick_returns_a_serving_worker_of_the_role_not_excluded_or_none_when_there_is_none(
    specs: list[tuple[WorkerState, int, str]], excluded: set[int], seed: int
) -> None:
    # The workers' events and scopes belong to an event loop, as in the running frontend.
    anyio.run(check_pick, specs, excluded, seed)


async def check_pick(specs: list[tuple[WorkerState, int, str]], excluded: set[int], seed: int) -> None:
    workers = [worker(f"10.0.0.{n}:1", state, load, role) for n, (state, load, role) in enumerate(specs)]
    exclude = frozenset(f"10.0.0.{n}:1" for n in excluded)
    chosen = worker_set(workers, seed).pick(exclude=exclude)
    candidates = [
        w for w in workers if w.state is WorkerState.SERVING and w.role == "agg" and w.address not in exclude
    ]
    if not candidates:
        assert chosen is None
    else:
        assert chosen in candidates
        # Two choices: it is never the most loaded when that one is alone at the top with 2+ candidates.
        if len(candidates) >= 2:
            worst = max(w.score() for w in candidates)
            if sum(w.score() == worst for w in candidates) == 1:
                assert chosen.score() < worst


async def test_the_less_loaded_worker_is_chosen_far_more_often() -> None:
    busy, idle = worker("10.0.0.1:1", WorkerState.SERVING, 10), worker("10.0.0.2:1", WorkerState.SERVING, 1)
    ws = worker_set([busy, idle])
    picks = Counter(ws.pick().address for _ in range(200))  # type: ignore[union-attr]
    assert picks == Counter({idle.address: 200}), "of two, the less loaded always wins"
    third = worker("10.0.0.3:1", WorkerState.SERVING, 5)
    ws = worker_set([busy, idle, third])
    picks = Counter(ws.pick().address for _ in range(600))  # type: ignore[union-attr]
    assert picks[busy.address] == 0
    assert picks[idle.address] > picks[third.address] > 0


async def test_the_score_counts_other_frontends_from_the_last_load_report() -> None:
    w = worker("10.0.0.1:1", WorkerState.SERVING, inflight=3, reported=10)
    w.own_at_report = 4  # the report included 4 of ours: 6 belong to other frontends
    assert w.score() == 3 + 6
    w.own_at_report = 12  # more of ours than reported (calls ended since): never negative
    assert w.score() == 3


async def test_pick_by_role() -> None:
    agg = worker("10.0.0.1:1", WorkerState.SERVING)
    decode = worker("10.0.0.2:1", WorkerState.SERVING, role="decode")
    ws = worker_set([agg, decode])
    assert ws.pick(role="decode") is decode
    assert ws.pick(role="prefill") is None
    assert ws.serving("agg") == [agg]


async def test_a_lease_counts_and_reports_in_flight() -> None:
    w = worker("10.0.0.1:1", WorkerState.SERVING)
    seen: list[int] = []
    with w.lease(lambda x: seen.append(x.inflight)):
        assert w.inflight == 1
        assert not w.idle.is_set()
    assert w.inflight == 0
    assert w.idle.is_set()
    assert seen == [1, 0]
