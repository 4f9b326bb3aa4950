"""A prompt id outside the vocabulary on an SGLang worker: SGLang's refusal of it over gRPC
(INTERNAL; a 400 on its Rust HTTP server) is the client's mistake in SGLang's words, while every
other INTERNAL, the same words about an id the prompt does not hold included, stays an engine
fault; and with ``--vocab-size`` the sidecar refuses it first, in the same words.
"""

from __future__ import annotations

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar_common.errors import NOT_SENT, EngineOrigin, FailureReason, SidecarError, from_engine_status
from sidecar_sglang.convert_request import RequestSettings, Transport, build_native
from sidecar_sglang.refusals import OUT_OF_VOCABULARY, generate_error, out_of_vocabulary
from tests.unit.test_sglang_convert_request import PID, req

INTERNAL = grpc.StatusCode.INTERNAL


@pytest.mark.parametrize(
    ("prompt", "token_id"),
    [((101, 32000), 32000), ((99999,), 99999), ((5, -1, 7), -1), ((1, 2**40), 2**40)],
)
def test_the_refusal_of_a_prompt_id_is_invalid_argument_in_sglangs_words(
    prompt: tuple[int, ...], token_id: int
) -> None:
    words = out_of_vocabulary(token_id, 32000)
    error = generate_error(INTERNAL, words, prompt)
    assert error.reason is FailureReason.INVALID_ARGUMENT
    assert error.message == words
    assert error.origin == EngineOrigin("Generate", "INTERNAL")


def test_the_sentence_is_sglangs() -> None:
    # SGLang 0.5.23's HTTP server, as a client reads it.
    assert out_of_vocabulary(32000, 32000) == (
        "input_ids contains out-of-vocabulary token id 32000; valid range is [0, 32000)."
    )


@pytest.mark.parametrize(
    ("code", "details", "prompt"),
    [
        # The id is not the prompt's: some other failure quoting the words.
        (INTERNAL, out_of_vocabulary(40000, 32000), (101, 32000)),
        # The id named lies inside the range stated: not this refusal.
        (INTERNAL, out_of_vocabulary(7, 32000), (7,)),
        # More than the sentence.
        (INTERNAL, "engine crashed: " + out_of_vocabulary(32000, 32000), (32000,)),
        (INTERNAL, out_of_vocabulary(32000, 32000) + " (retry)", (32000,)),
        (INTERNAL, "CUDA error: device-side assert triggered", (32000,)),
        (INTERNAL, None, (32000,)),
        # Another status with the words keeps that status's reading.
        (grpc.StatusCode.UNAVAILABLE, out_of_vocabulary(32000, 32000), (32000,)),
        (grpc.StatusCode.UNKNOWN, out_of_vocabulary(32000, 32000), (32000,)),
    ],
)
def test_anything_else_reads_as_every_engine_status_does(
    code: grpc.StatusCode, details: str | None, prompt: tuple[int, ...]
) -> None:
    error = generate_error(code, details, prompt)
    expected = from_engine_status("Generate", code, details)
    assert (error.reason, error.message, error.origin) == (expected.reason, expected.message, expected.origin)
    assert error.reason is not FailureReason.INVALID_ARGUMENT or code is not INTERNAL


@given(
    prompt=st.lists(st.integers(0, 2**32), min_size=1, max_size=8),
    vocab=st.integers(1, 2**20),
    details=st.text(max_size=80),
)
def test_only_a_true_statement_about_the_prompt_is_a_refusal(
    prompt: list[int], vocab: int, details: str
) -> None:
    error = generate_error(INTERNAL, details, prompt)
    assert error.reason is FailureReason.UNKNOWN or OUT_OF_VOCABULARY.fullmatch(details)
    for token in prompt:
        refused = generate_error(INTERNAL, out_of_vocabulary(token, vocab), prompt)
        expected = FailureReason.INVALID_ARGUMENT if token >= vocab else FailureReason.UNKNOWN
        assert refused.reason is expected


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_with_the_vocabulary_size_given_the_sidecar_refuses_first_in_the_same_words(
    transport: Transport,
) -> None:
    settings = RequestSettings(transport=transport, vocab_size=32000)
    with pytest.raises(SidecarError) as refused:
        build_native(req(token_ids=[5, 40000, 32000]), PID, settings, room=7)
    assert refused.value.reason is FailureReason.INVALID_ARGUMENT
    assert refused.value.message == out_of_vocabulary(40000, 32000)  # the first, as SGLang names it
    assert refused.value.origin == EngineOrigin("Generate", NOT_SENT)
    assert build_native(req(token_ids=[5, 31999]), PID, settings, room=7).input_ids == (5, 31999)
    # Not given: not checked here (SGLang reports no size).
    unchecked = RequestSettings(transport=transport)
    assert build_native(req(token_ids=[40000]), PID, unchecked, room=7).input_ids == (40000,)
