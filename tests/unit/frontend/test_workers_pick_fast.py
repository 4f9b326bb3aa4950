"""The O(1) choice (eligible workers kept by role on every state change) picks as the scan does:
a serving worker of the role, the less loaded of the two drawn, never a stale one."""

from __future__ import annotations

import anyio
from hypothesis import given
from hypothesis import strategies as st

from sidecar_frontend.registry import Registry, WorkerState
from tests.unit.frontend.test_workers_choice import worker, worker_set

STATES = list(WorkerState)


@given(
    st.lists(
        st.tuples(st.sampled_from(STATES), st.integers(0, 50), st.sampled_from(["agg", "prefill"])),
        max_size=8,
    ),
    st.integers(0, 2**32),
)
def test_the_kept_pool_gives_a_serving_worker_of_the_role_and_the_less_loaded_of_two(
    specs: list[tuple[WorkerState, int, str]], seed: int
) -> None:
    anyio.run(check, specs, seed)


async def check(specs: list[tuple[WorkerState, int, str]], seed: int) -> None:
    workers = [worker(f"10.0.0.{n}:1", state, load, role) for n, (state, load, role) in enumerate(specs)]
    ws = worker_set(workers, seed)
    ws.rebuild()  # what every state change does
    serving = [w for w in workers if w.state is WorkerState.SERVING and w.role == "agg"]
    for _ in range(20):
        chosen = ws.pick()
        if not serving:
            assert chosen is None
            continue
        assert chosen in serving
        # Never the most loaded of several unless it ties: it loses every draw it is in.
        loads = sorted(w.score() for w in serving)
        if len(serving) > 1 and loads[-1] > loads[-2]:
            assert chosen.score() < loads[-1]


async def _stale_worker_is_never_chosen() -> None:
    a, b, c = (worker(f"10.0.0.{n}:1", WorkerState.SERVING) for n in range(3))
    ws: Registry = worker_set([a, b, c])
    ws.rebuild()
    b.state = WorkerState.NOT_SERVING  # changed without a notification: the pool is stale
    for _ in range(50):
        assert ws.pick() is not b


def test_a_worker_that_stopped_serving_is_not_chosen_even_from_a_stale_pool() -> None:
    anyio.run(_stale_worker_is_never_chosen)
