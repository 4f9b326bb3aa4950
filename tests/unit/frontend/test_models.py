"""Which model a request runs on: the model a parsed body names (a table), and the default a request
that names none gets while the fleet serves several (the most placing workers, the newer on a
tie)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar_common.api import sidecar_pb2
from sidecar_frontend.formats.base import named_model
from sidecar_frontend.workers import Worker, WorkerState
from tests.unit.frontend.test_workers_choice import worker, worker_set


@pytest.mark.parametrize(
    ("body", "model"),
    [
        (b'{"model": "a", "token_ids": [1]}', "a"),
        (b'{"token_ids": [1]}', None),
        (b'{"model": "", "token_ids": [1]}', None),
        (b'{"model": null}', None),
        (b'{"model": 5}', None),
        (b'{"model": ["a"]}', None),
        (b'[{"model": "a"}]', None),
        (b'{"sampling_params": {"model": "a"}}', None),
    ],
)
def test_the_model_a_body_names(body: bytes, model: str | None) -> None:
    assert named_model(json.loads(body)) == model


@given(st.dictionaries(st.sampled_from(["model", "token_ids", "rid"]), st.text() | st.integers() | st.none()))
def test_the_named_model_is_the_top_level_model_string_when_non_empty(data: dict[str, object]) -> None:
    value = data.get("model")
    expected = value if isinstance(value, str) and value else None
    assert named_model(data) == expected


def _serving(address: str, model: str, role: str = "agg") -> Worker:
    w = worker(address, WorkerState.SERVING, role=role)
    w.model = sidecar_pb2.ModelInfo(served_model_name=model)
    return w


async def test_the_default_model_has_the_most_placing_workers_and_the_newer_wins_a_tie() -> None:
    a1, a2 = _serving("10.0.0.1:1", "a"), _serving("10.0.0.2:1", "a")
    ws = worker_set([a1, a2])
    ws.rebuild()
    assert ws.default_model() == "a"
    b1 = _serving("10.0.0.3:1", "b")
    ws.add(b1)
    ws.rebuild()
    assert sorted(ws.models()) == ["a", "b"]
    assert ws.default_model() == "a", "two workers place a, one places b"
    a2.state = WorkerState.DRAINING
    ws.rebuild()
    assert ws.default_model() == "b", "a tie: b is the newer model"
    a1.state = WorkerState.DRAINING
    ws.rebuild()
    assert list(ws.models()) == ["b"]


async def test_a_model_served_only_by_prefill_workers_or_only_by_decode_workers_takes_no_generation() -> None:
    ws = worker_set([_serving("10.0.0.1:1", "p", "prefill"), _serving("10.0.0.2:1", "d", "decode")])
    ws.rebuild()
    assert dict(ws.models()) == {}
    assert ws.default_model() is None
    ws.add(_serving("10.0.0.3:1", "p", "decode"))
    ws.rebuild()
    assert list(ws.models()) == ["p"], "a prefill and a decode worker place p"
