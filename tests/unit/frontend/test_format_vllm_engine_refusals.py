"""A refusal only the engine can make reaches a vLLM client in the engine's own words.

The sidecar marks such an error (ErrorInfo ``origin: engine``, ``WorkerFailure.from_engine``);
the vLLM format then shows the message unchanged and reads ``param`` from vLLM's
``(parameter=…, value=…)`` ending, as vLLM's own error handler fills ``param`` from the
exception's ``parameter``. The texts below are vLLM 0.33's (``SamplingParams.verify``,
``InputProcessor``), with the ending ``VLLMValidationError.__str__`` writes.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar_common.errors import FailureReason
from sidecar_frontend.formats.base import WorkerFailure
from sidecar_frontend.formats.vllm.response import engine_param, failure_error
from tests.unit.frontend.test_format_vllm_response import _encoder
from tests.unit.frontend.test_format_vllm_support import error_of

ENGINE_WORDS: list[tuple[str, str | None]] = [
    (
        "Requested sample logprobs of 21, which is greater than max allowed: 20 "
        "(parameter=logprobs, value=21)",
        "logprobs",
    ),
    (
        "Requested prompt logprobs of 30, which is greater than max allowed: 20 "
        "(parameter=prompt_logprobs, value=30)",
        "prompt_logprobs",
    ),
    (
        "token_id(s) [32000, 40000] in logit_bias contain out-of-vocab token ids. Vocabulary size: 32000 "
        "(parameter=logit_bias, value=[32000, 40000])",
        "logit_bias",
    ),
    ("max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)", "max_tokens"),
    ("prompt_logprob_token_ids requires the V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1).", None),
    ("some check (parameter=top_k)", "top_k"),  # a parameter without a value
    ("some check (value=3)", None),  # a value without a parameter names nothing
    ("data_parallel_rank 3 is out of range [0, 2).", None),
    ("Token id 32000 is out of vocabulary", None),
    ("The decoder prompt cannot be empty", None),
    ("", None),
]


@pytest.mark.parametrize(("message", "param"), ENGINE_WORDS)
def test_param_comes_from_vllms_parameter_ending(message: str, param: str | None) -> None:
    assert engine_param(message) == param


@pytest.mark.parametrize(("message", "param"), [w for w in ENGINE_WORDS if w[0]])
def test_an_engine_refusal_is_a_400_in_the_engines_words(message: str, param: str | None) -> None:
    failure = WorkerFailure(FailureReason.INVALID_ARGUMENT, message, from_engine=True)
    unary = _encoder()
    unary.on_failure(0, failure, 0.0)
    assert unary.reply().status == 400
    assert error_of(unary.reply()) == {
        "message": message,
        "type": "BadRequestError",
        "param": param,
        "code": 400,
    }

    stream = _encoder(stream=True)
    event = stream.on_failure(0, failure, 0.0)
    expected = {"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}
    assert event == b"data: " + json.dumps(expected).encode() + b"\n\n"
    assert stream.close() == b"data: [DONE]\n\n"


# vLLM 0.33: a VLLMNotFoundError (LoRAAdapterNotFoundError's words, or the serving layer's
# "The model `x` does not exist.") goes through create_error_response: NotFoundError, 404,
# param None, str(exc). Unary: the JSONResponse of the exception handler; streamed: the
# stream generator's create_streaming_error_response event (json.dumps), then [DONE].
NOT_FOUND_WORDS = "Loading lora sql failed: No adapter found for /adapters/sql"


@pytest.mark.parametrize("engine_status", ["NOT_FOUND", "404"])
def test_an_engine_not_found_is_vllms_404_not_found_error(engine_status: str) -> None:
    failure = WorkerFailure(
        FailureReason.INVALID_ARGUMENT, NOT_FOUND_WORDS, from_engine=True, engine_status=engine_status
    )
    expected = {"message": NOT_FOUND_WORDS, "type": "NotFoundError", "param": None, "code": 404}
    unary = _encoder()
    assert unary.on_failure(0, failure, 0.0) == b""
    assert unary.reply().status == 404
    assert error_of(unary.reply()) == expected

    stream = _encoder(stream=True)
    assert (
        stream.on_failure(0, failure, 0.0) == b"data: " + json.dumps({"error": expected}).encode() + b"\n\n"
    )
    assert stream.close() == b"data: [DONE]\n\n"


@pytest.mark.parametrize("engine_status", ["INVALID_ARGUMENT", "400", "not sent"])
def test_any_other_engine_refusal_stays_a_400(engine_status: str) -> None:
    failure = WorkerFailure(
        FailureReason.INVALID_ARGUMENT, NOT_FOUND_WORDS, from_engine=True, engine_status=engine_status
    )
    enc = _encoder()
    enc.on_failure(0, failure, 0.0)
    assert enc.reply().status == 400


def test_the_sidecars_own_refusal_is_read_by_its_field_not_by_vllms_ending() -> None:
    # Not the engine's words: the message starts with the sidecar.v1 field it names.
    failure = WorkerFailure(
        FailureReason.INVALID_ARGUMENT, "sampling_options.seed: 4294967296 does not fit (parameter=x)"
    )
    enc = _encoder()
    enc.on_failure(0, failure, 0.0)
    assert error_of(enc.reply())["param"] == "seed"


@given(st.sampled_from(list(FailureReason)), st.text(), st.booleans(), st.booleans())
def test_no_error_is_without_words(
    reason: FailureReason, message: str, from_engine: bool, stream: bool
) -> None:
    failure = WorkerFailure(reason, message, from_engine=from_engine)
    error = failure_error(failure)
    if error is None:
        assert reason in (FailureReason.CANCELLED, FailureReason.DEADLINE)  # an abort, not an error
        return
    assert error.message
    encoder = _encoder(stream=stream)
    data = encoder.on_failure(0, failure, 0.0)
    if stream:
        assert json.loads(data.removeprefix(b"data: "))["error"]["message"]
    else:
        assert error_of(encoder.reply())["message"]


QUEUE_FULL = (
    "The engine is currently busy and cannot accept new requests. "
    "Please try again later or on a different instance."
)
PREFILL_BACKLOG = (
    "The engine has reached its prefill token backlog limit. "
    "Please try again later or on a different instance."
)


@pytest.mark.parametrize(
    ("failure", "message"),
    [
        # vLLM's two admission refusals, each in its own words (MaxQueuedTokensError is not
        # QueueOverflowError's sentence).
        (
            WorkerFailure(
                FailureReason.OVERLOADED, PREFILL_BACKLOG, from_engine=True, engine_status="UNAVAILABLE"
            ),
            PREFILL_BACKLOG,
        ),
        (
            WorkerFailure(
                FailureReason.OVERLOADED, QUEUE_FULL, from_engine=True, engine_status="UNAVAILABLE"
            ),
            QUEUE_FULL,
        ),
        # Busy without the engine's words (a sidecar's or a proxy's text): vLLM's sentence.
        (WorkerFailure(FailureReason.OVERLOADED, "Generate: busy (RESOURCE_EXHAUSTED)"), QUEUE_FULL),
        (WorkerFailure(FailureReason.OVERLOADED, "", from_engine=True), QUEUE_FULL),
    ],
)
def test_a_busy_refusal_is_vllms_503_in_the_engines_words(failure: WorkerFailure, message: str) -> None:
    error = failure_error(failure)
    assert error is not None
    assert error.body() == {
        "error": {"message": message, "type": "Service Unavailable", "param": None, "code": 503}
    }
