"""The engine's own state (sidecar_server.engine_state, pure): what each wire's answers mean,
and which readings are worth a log line and a pushed report."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar_common.api import sidecar_pb2
from sidecar_server.engine_state import (
    UNKNOWN_STATUS,
    Continued,
    EngineStatus,
    Paused,
    WeightVersionChanged,
    changes,
    last_known,
    proto_state,
    sglang_http_paused,
    vllm_paused,
    weight_version_of,
)

S = EngineStatus


@pytest.mark.parametrize(
    ("ready", "ping", "paused"),
    [
        (200, 0, False),  # takes new requests: running (/ping not asked)
        (200, 200, False),
        (503, 200, True),  # not ready yet healthy: SGLang's is_pause
        (503, 503, None),  # starting, unhealthy or shutting down: not a pause
        (503, 404, None),  # an older server without /ping: cannot say
        (404, 200, None),  # no /ready at all
        (500, 200, None),
    ],
)
def test_sglang_http_pause_from_its_two_flag_checks(ready: int, ping: int, paused: bool | None) -> None:
    assert sglang_http_paused(ready, ping) is paused


@pytest.mark.parametrize(
    ("is_paused", "seen", "paused"),
    [
        (True, False, True),
        (True, True, True),
        # smg-grpc-servicer 0.14.1 leaves the field false: not known until a true was seen.
        (False, False, None),
        (False, True, False),
    ],
)
def test_vllm_is_paused_is_believed_false_only_after_a_true(
    is_paused: bool, seen: bool, paused: bool | None
) -> None:
    assert vllm_paused(is_paused, seen_paused=seen) is paused


@pytest.mark.parametrize(
    ("paused", "state"),
    [
        (None, sidecar_pb2.ENGINE_STATE_UNSPECIFIED),
        (False, sidecar_pb2.ENGINE_STATE_RUNNING),
        (True, sidecar_pb2.ENGINE_STATE_PAUSED),
    ],
)
def test_the_load_reports_engine_state(paused: bool | None, state: int) -> None:
    assert proto_state(paused) == state


@pytest.mark.parametrize(
    ("info", "version"),
    [
        ({"weight_version": "v2"}, "v2"),
        ({"weight_version": "default"}, "default"),
        ({}, None),
        ({"weight_version": None}, None),
        ({"weight_version": 3}, None),
    ],
)
def test_sglang_model_info_weight_version(info: dict[str, object], version: str | None) -> None:
    assert weight_version_of(info) == version


@pytest.mark.parametrize(
    ("known", "after", "expected"),
    [
        (UNKNOWN_STATUS, S(True, "v1"), S(True, "v1")),
        (S(True, "v1"), UNKNOWN_STATUS, S(True, "v1")),
        (S(True, "v1"), S(False, None), S(False, "v1")),
        (S(None, "v1"), S(None, "v2"), S(None, "v2")),
    ],
)
def test_what_is_known_after_a_reading(
    known: EngineStatus, after: EngineStatus, expected: EngineStatus
) -> None:
    assert last_known(known, after) == expected


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [
        (UNKNOWN_STATUS, UNKNOWN_STATUS, ()),
        (UNKNOWN_STATUS, S(paused=False), ()),  # running from the start: nothing happened
        (UNKNOWN_STATUS, S(paused=True), (Paused(),)),
        (S(paused=False), S(paused=True), (Paused(),)),
        (S(paused=True), S(paused=True), ()),
        (S(paused=True), S(paused=False), (Continued(),)),
        (S(paused=True), UNKNOWN_STATUS, ()),  # the wire stopped saying: nothing seen to happen
        (UNKNOWN_STATUS, S(weight_version="v1"), (WeightVersionChanged(None, "v1"),)),
        (S(weight_version="v1"), S(weight_version="v1"), ()),
        (S(weight_version="v1"), S(weight_version="v2"), (WeightVersionChanged("v1", "v2"),)),
        (S(weight_version="v1"), S(), ()),
        (
            S(paused=True, weight_version="v1"),
            S(paused=False, weight_version="v2"),
            (Continued(), WeightVersionChanged("v1", "v2")),
        ),
    ],
)
def test_what_a_reading_changed(
    before: EngineStatus, after: EngineStatus, expected: tuple[object, ...]
) -> None:
    assert changes(before, after) == expected


statuses = st.builds(EngineStatus, st.sampled_from([None, False, True]), st.sampled_from([None, "a", "b"]))


@given(st.lists(statuses, max_size=30))
def test_pauses_and_continues_alternate_and_each_version_change_names_the_last_version(
    readings: list[EngineStatus],
) -> None:
    known = UNKNOWN_STATUS
    paused_said = False
    version_said: str | None = None
    for after in readings:
        for change in changes(known, after):
            match change:
                case Paused():
                    assert not paused_said
                    paused_said = True
                case Continued():
                    assert paused_said
                    paused_said = False
                case WeightVersionChanged(old=old, new=new):
                    assert old == known.weight_version
                    assert new == after.weight_version != old
                    version_said = new
        known = last_known(known, after)
        # Whatever was said last agrees with the last reading that said anything.
        if after.paused is not None:
            assert paused_said is after.paused
        if after.weight_version is not None:
            assert version_said == after.weight_version
