"""Every failure reason has an entry in every table that decides what happens to it: the
kernel's (retried, migrated, the worker busy, a sidecar's status) and each format's HTTP
answer. A reason added to ``FailureReason`` without a row fails here, not as a client's 500.

The expectations are written out by hand from the formats' servers, not derived from the
modules' own tables.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import grpc
import pytest

from sidecar_common.errors import FAILURE_RULES, FRONTEND_STATUS, SIDECAR_REASONS, FailureReason
from sidecar_frontend.cli import FORMATS
from sidecar_frontend.formats.base import Encoder, WorkerFailure
from sidecar_frontend.formats.sglang import FORMAT as SGLANG
from sidecar_frontend.formats.sglang.wire import FAILURE_STATUS
from sidecar_frontend.formats.vllm import FORMAT as VLLM
from sidecar_frontend.formats.vllm.errors import FAILURE_ANSWERS, REFUSED_BEFORE_STREAM
from tests.unit.frontend.test_format_sglang_support import accepted as sglang_accepted
from tests.unit.frontend.test_format_vllm_support import accepted as vllm_accepted

R = FailureReason
C = grpc.StatusCode

# (a sidecar's gRPC status or None, migratable after tokens, retried before any, busy)
RULES: Mapping[FailureReason, tuple[grpc.StatusCode | None, bool, bool, bool]] = {
    R.INVALID_ARGUMENT: (C.INVALID_ARGUMENT, False, False, False),  # fails the same anywhere
    R.CANNOT_CONNECT: (C.UNAVAILABLE, True, True, False),
    R.CONNECTION_TIMEOUT: (C.DEADLINE_EXCEEDED, True, True, False),
    R.ENGINE_SHUTDOWN: (C.UNAVAILABLE, True, True, False),
    R.CANCELLED: (C.CANCELLED, False, False, False),  # the frontend's own doing
    R.OVERLOADED: (C.RESOURCE_EXHAUSTED, False, True, True),  # another worker may have room
    R.PROTOCOL_ERROR: (C.INTERNAL, False, False, False),
    R.UNKNOWN: (C.UNKNOWN, False, False, False),
    # vLLM refused it while paused: nothing delivered, retried; not busy (it goes on at continue).
    R.ENGINE_PAUSED: (C.UNAVAILABLE, False, True, False),
    R.NO_WORKER: (None, False, False, False),  # the frontend's own: never on the wire
    R.DEADLINE: (None, False, False, False),
    # gRPC's server core refused the call before the sidecar took it: no engine saw it, so it
    # runs again (on the same worker too, after a pause: not busy).
    R.NOT_STARTED: (None, False, True, False),
}

# The HTTP status a unary request gets when its only sub-request fails with the reason.
VLLM_UNARY_STATUS: Mapping[FailureReason, int] = {
    R.INVALID_ARGUMENT: 400,
    R.CANNOT_CONNECT: 500,
    R.CONNECTION_TIMEOUT: 500,
    R.ENGINE_SHUTDOWN: 500,
    R.CANCELLED: 200,  # an abort: finish_reason "abort", the tokens so far
    R.OVERLOADED: 503,
    R.PROTOCOL_ERROR: 500,
    R.UNKNOWN: 500,
    R.ENGINE_PAUSED: 503,  # vLLM's RetryableRequestError
    R.NO_WORKER: 500,
    R.DEADLINE: 200,
    R.NOT_STARTED: 503,  # vLLM's admission refusal
}
SGLANG_UNARY_STATUS: Mapping[FailureReason, int] = {
    R.INVALID_ARGUMENT: 400,
    R.CANNOT_CONNECT: 503,
    R.CONNECTION_TIMEOUT: 503,
    R.ENGINE_SHUTDOWN: 503,
    R.CANCELLED: 200,  # an abort by rid: the abort finish reason, the output so far
    R.OVERLOADED: 503,
    R.PROTOCOL_ERROR: 500,
    R.UNKNOWN: 500,
    R.ENGINE_PAUSED: 503,
    R.NO_WORKER: 503,
    R.DEADLINE: 503,
    R.NOT_STARTED: 503,
}

# One unary request per format, and the status each reason gets: a format added to the
# frontend without a row here fails the last test.
UNARY: Mapping[str, tuple[Callable[[], Encoder], Mapping[FailureReason, int]]] = {
    "vllm": (
        lambda: VLLM.new_encoder(vllm_accepted({"token_ids": [5, 6, 7], "sampling_params": {}}), 1.0),
        VLLM_UNARY_STATUS,
    ),
    "sglang": (lambda: SGLANG.new_encoder(sglang_accepted({"input_ids": [1, 2]}), 1.0), SGLANG_UNARY_STATUS),
}


def test_every_reason_has_a_row_in_every_table() -> None:
    every = set(FailureReason)
    assert set(FAILURE_RULES) == every
    assert set(FAILURE_ANSWERS) == every
    assert set(FAILURE_STATUS) == every
    for expected in (RULES, VLLM_UNARY_STATUS, SGLANG_UNARY_STATUS):
        assert set(expected) == every


@pytest.mark.parametrize("reason", list(FailureReason), ids=lambda r: r.value)
def test_the_kernels_rule_for_each_reason(reason: FailureReason) -> None:
    status, migratable, retried, busy = RULES[reason]
    rule = FAILURE_RULES[reason]
    assert (rule.status, rule.migratable, rule.retried, rule.busy) == (status, migratable, retried, busy)


def test_the_sidecars_send_their_reasons_only() -> None:
    assert set(FailureReason) - SIDECAR_REASONS == {R.NO_WORKER, R.DEADLINE, R.NOT_STARTED}
    assert set(FRONTEND_STATUS) == SIDECAR_REASONS


def test_only_a_busy_engine_is_answered_before_a_vllm_stream_starts() -> None:
    assert {R.OVERLOADED, R.NOT_STARTED, R.ENGINE_PAUSED} == REFUSED_BEFORE_STREAM


@pytest.mark.parametrize("reason", list(FailureReason), ids=lambda r: r.value)
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_format_answers_every_reason_with_its_servers_status(fmt: str, reason: FailureReason) -> None:
    assert set(UNARY) == set(FORMATS), "a format with no expectations here"
    new_encoder, statuses = UNARY[fmt]
    encoder = new_encoder()
    encoder.on_failure(0, WorkerFailure(reason, "it failed"), 2.0)
    reply = encoder.reply()
    assert reply.status == statuses[reason]
    body: Any = json.loads(reply.body)
    assert isinstance(body, dict | list)
