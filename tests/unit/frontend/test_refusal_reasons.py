"""The frontend's refusals before any worker (``RefusalReason``): their names are the ``reason``
label of ``frontend_requests_total`` and of the request log line, which dashboards and alerts
match, in one label space with the failures (``FailureReason``)."""

from __future__ import annotations

from sidecar_common.errors import FailureReason, RefusalReason


def test_the_refusal_reasons_keep_their_wire_names() -> None:
    assert {r.name: r.value for r in RefusalReason} == {
        "INVALID_REQUEST": "INVALID_REQUEST",
        "MODEL_NOT_FOUND": "MODEL_NOT_FOUND",
        "BODY_TOO_LARGE": "BODY_TOO_LARGE",
        "MISCONFIGURED": "MISCONFIGURED",
        "QUEUE_FULL": "QUEUE_FULL",
        "QUEUE_TIMEOUT": "QUEUE_TIMEOUT",
        "QUEUE_PUSHED_OUT": "QUEUE_PUSHED_OUT",
        "NO_CAPACITY": "NO_CAPACITY",
        "RATE_LIMITED": "RATE_LIMITED",
    }


def test_a_refusal_reads_apart_from_every_failure() -> None:
    assert not {r.value for r in RefusalReason} & {f.value for f in FailureReason}
