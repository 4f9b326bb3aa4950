"""vLLM checks a logprob count against its ``--max-logprobs`` before every other input check of
its engine, and no worker reports that maximum: a request for logprobs of a vLLM worker whose
other problems the engine states in the same words goes to the worker, so the engine names the
first problem as vLLM does; anything else is refused here, in vLLM's order, as before."""

# The refusal texts are vLLM's, verbatim.
# ruff: noqa: E501
from __future__ import annotations

from typing import Any

import pytest

from tests.unit.frontend.test_format_vllm_support import JSON_HEADERS, accepted, context, error_of, refused

OOV_PROMPT = "Token id 40000 is out of vocabulary"
RANK = {**JSON_HEADERS, "X-data-parallel-rank": "5"}  # two ranks in the test fleet: out of range
LONG = [1] * 4096  # fills the 4096-token context


def _body(token_ids: list[int], **sampling: Any) -> dict[str, Any]:
    return {"token_ids": token_ids, "sampling_params": sampling}


LEFT_TO_THE_ENGINE = [
    pytest.param(_body([5, 40000], logprobs=21), id="logprobs and a prompt id"),
    pytest.param(_body([5, 40000], logprobs=1), id="any positive count"),
    pytest.param(_body([5, 40000], prompt_logprobs=21), id="prompt logprobs and a prompt id"),
    pytest.param(_body([5, 6], logprobs=21, stop_token_ids=[40000]), id="a stop id"),
    pytest.param(_body([5, 6], logprobs=21, logit_bias={"40000": 1.0}), id="a biased id"),
    pytest.param(_body(LONG, logprobs=21), id="a prompt that fills the context"),
    pytest.param(_body(LONG, logprobs=21, max_tokens=None), id="the same, up to the context"),
    pytest.param({**_body([5, 40000], logprobs=21), "stream": True}, id="streamed"),
]


@pytest.mark.parametrize("body", LEFT_TO_THE_ENGINE)
def test_a_problem_the_engine_states_alike_is_left_to_it_when_logprobs_are_asked(
    body: dict[str, Any],
) -> None:
    call = accepted(body)
    request = call.requests[0]
    assert list(request.token_ids) == body["token_ids"]
    # Nothing the engine would refuse before the logprobs: no max_tokens below 1.
    assert not request.stop_conditions.HasField("max_tokens")


REFUSED_HERE = [
    # No logprobs (or none counted): nothing for the engine to name first.
    pytest.param(_body([5, 40000]), None, "vllm", OOV_PROMPT, id="no logprobs"),
    pytest.param(_body([5, 40000], logprobs=0), None, "vllm", OOV_PROMPT, id="logprobs 0"),
    # Another engine checks no logprob maximum of vLLM's.
    pytest.param(_body([5, 40000], logprobs=21), None, "sglang", OOV_PROMPT, id="an SGLang worker"),
    # A problem the sidecar states first, in other words: the first problem, in vLLM's order.
    pytest.param(
        _body([5, 40000], logprobs=21),
        RANK,
        "vllm",
        "data_parallel_rank 5 is out of range [0, 2).",
        id="the rank, before the prompt",
    ),
    pytest.param(
        _body([5, 6], logprobs=21, stop_token_ids=[40000]),
        RANK,
        "vllm",
        "token_id(s) [40000] in stop_token_ids contain out-of-vocab token ids. Vocabulary size: 32000 (parameter=stop_token_ids, value=[40000])",
        id="a stop id, before the rank",
    ),
    pytest.param(
        _body([5, 40000], logprobs=21, structured_outputs={"regex": "a"}),
        None,
        "vllm",
        "Structured outputs requires a tokenizer so it can't be used with 'skip_tokenizer_init'",
        id="structured outputs, not carried",
    ),
    # An id no sidecar field holds never reaches the engine.
    pytest.param(
        _body([5, 2**32], logprobs=21),
        None,
        "vllm",
        "Token id 4294967296 is out of vocabulary",
        id="an id beyond 32 bits",
    ),
]


@pytest.mark.parametrize(("body", "headers", "engine", "message"), REFUSED_HERE)
def test_anything_else_is_refused_here_in_vllms_order(
    body: dict[str, Any], headers: dict[str, str] | None, engine: str, message: str
) -> None:
    reply = refused(body, headers, context(engine=engine))
    assert reply.status == 400
    assert error_of(reply)["message"] == message
