"""The engine's figures in a believed load report (worker_replies.engine_load, pure): running
and waiting requests summed over the ranks that say, the fullest rank's KV-cache use, None
where no rank says."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar_common.api import sidecar_pb2
from sidecar_frontend.worker_replies import EngineLoad, engine_load, load_problem

Rank = sidecar_pb2.RankLoad


def report(*ranks: sidecar_pb2.RankLoad) -> sidecar_pb2.LoadReport:
    return sidecar_pb2.LoadReport(inflight_requests=3, ranks=list(ranks))


@pytest.mark.parametrize(
    ("load", "figures"),
    [
        (report(), EngineLoad(None, None, None)),
        (report(Rank(dp_rank=0)), EngineLoad(None, None, None)),
        (
            report(Rank(dp_rank=0, running_requests=0, waiting_requests=0, kv_usage=0.0)),
            EngineLoad(0, 0, 0.0),
        ),
        (
            report(
                Rank(dp_rank=0, running_requests=4, waiting_requests=1, kv_usage=0.25),
                Rank(dp_rank=1, running_requests=6, waiting_requests=0, kv_usage=0.75),
            ),
            EngineLoad(10, 1, 0.75),
        ),
        # A rank that does not say is left out, not counted as 0.
        (
            report(Rank(dp_rank=0, running_requests=2), Rank(dp_rank=1, waiting_requests=5, kv_usage=0.5)),
            EngineLoad(2, 5, 0.5),
        ),
    ],
)
def test_the_figures_of_a_report(load: sidecar_pb2.LoadReport, figures: EngineLoad) -> None:
    assert load_problem(load) is None
    assert engine_load(load) == figures


ranks = st.lists(
    st.builds(
        Rank,
        dp_rank=st.integers(0, 7),
        running_requests=st.none() | st.integers(0, 1000),
        waiting_requests=st.none() | st.integers(0, 1000),
        kv_usage=st.none() | st.floats(0.0, 1.0),
    ),
    max_size=8,
)


@given(ranks)
def test_the_figures_bound_every_rank_that_says(given_ranks: list[sidecar_pb2.RankLoad]) -> None:
    figures = engine_load(report(*given_ranks))
    running = [r.running_requests for r in given_ranks if r.HasField("running_requests")]
    waiting = [r.waiting_requests for r in given_ranks if r.HasField("waiting_requests")]
    usage = [r.kv_usage for r in given_ranks if r.HasField("kv_usage")]
    assert (figures.running_requests is None) == (not running)
    assert (figures.waiting_requests is None) == (not waiting)
    assert (figures.kv_usage is None) == (not usage)
    for count in running:
        assert figures.running_requests is not None
        assert figures.running_requests >= count
    for fraction in usage:
        assert figures.kv_usage is not None
        assert fraction <= figures.kv_usage <= 1.0
    if figures.kv_usage is not None:
        assert figures.kv_usage in usage
