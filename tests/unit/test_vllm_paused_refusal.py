"""vLLM's refusal of a new request while paused (``core.py``'s ``_reject_add_while_paused``,
ended INTERNAL by smg-grpc-servicer with its text) is ENGINE_PAUSED in vLLM's words: retried,
not migratable, not an engine fault the health watch must look into."""

from __future__ import annotations

import grpc
import pytest

from sidecar_common.errors import FAILURE_RULES, EngineOrigin, FailureReason, is_engine_fault
from sidecar_vllm.refusals import PAUSED_REFUSAL, generate_error

TESTKIT_WORDS = "Generation is paused. Please retry after it resumes."


def test_the_testkit_says_vllms_words() -> None:
    assert PAUSED_REFUSAL == TESTKIT_WORDS


@pytest.mark.parametrize("code", [grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE])
def test_the_paused_refusal_is_engine_paused_in_vllms_words(code: grpc.StatusCode) -> None:
    error = generate_error(code, PAUSED_REFUSAL)
    assert error.reason is FailureReason.ENGINE_PAUSED
    assert error.message == PAUSED_REFUSAL
    assert error.origin == EngineOrigin("Generate", code.name)
    assert error.code is grpc.StatusCode.UNAVAILABLE
    assert not error.migratable
    assert FAILURE_RULES[FailureReason.ENGINE_PAUSED].retried
    assert not is_engine_fault(error)


@pytest.mark.parametrize(
    ("code", "details"),
    [
        (grpc.StatusCode.INTERNAL, "Generation is paused."),  # not vLLM's whole sentence
        (grpc.StatusCode.INVALID_ARGUMENT, PAUSED_REFUSAL),  # a refusal of the request itself
        (grpc.StatusCode.INTERNAL, None),
    ],
)
def test_anything_else_reads_as_before(code: grpc.StatusCode, details: str | None) -> None:
    assert generate_error(code, details).reason is not FailureReason.ENGINE_PAUSED
