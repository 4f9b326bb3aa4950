"""Which error a vLLM client hears when its request has two: vLLM's order.

vLLM 0.33 checks a request's sampling parameters first (``SamplingParams.verify``: logprobs,
logit_bias, stop_token_ids, structured outputs), then the data-parallel rank, then the
prompt's length, then its vocabulary (``InputProcessor.process_inputs`` and
``_validate_model_input``). The format makes the checks the workers' model info allows, in
that order; each row below has two or more problems and expects the first one's words.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.frontend.test_format_vllm_support import JSON_HEADERS, context, error_of, refused

# context(): vocabulary 32000, context 4096, data_parallel_size 2.
OOV_BIAS = (
    "token_id(s) [40000] in logit_bias contain out-of-vocab token ids. Vocabulary size: 32000 "
    "(parameter=logit_bias, value=[40000])"
)
OOV_STOP = (
    "token_id(s) [32000] in stop_token_ids contain out-of-vocab token ids. Vocabulary size: 32000 "
    "(parameter=stop_token_ids, value=[32000])"
)
STRUCTURED = "Structured outputs requires a tokenizer so it can't be used with 'skip_tokenizer_init'"
RANK = "data_parallel_rank 5 is out of range [0, 2)."
LONG = (
    "The decoder prompt (length 4097) is longer than the maximum model length of 4096. "
    "Make sure that `max_model_len` is no smaller than the number of text tokens."
)
FULL = (
    "The decoder prompt (length 4096) plus the number of requested output tokens (at least 1) is "
    "longer than the maximum model length of 4096. Make sure that `max_model_len` is no smaller "
    "than the number of text tokens (prompt + requested output tokens)."
)
OOV_PROMPT = "Token id 50000 is out of vocabulary"

SHORT = [1, 50000]  # out of vocabulary
TOO_LONG = [50000] + [1] * 4096
FILLS = [50000] + [1] * 4095
BIAS = {"logit_bias": {"40000": 1.0}}
STOP = {"stop_token_ids": [5, 32000]}
SO = {"structured_outputs": {"regex": "a+"}}

ROWS: list[tuple[str, list[int], dict[str, Any], str | None, str]] = [
    ("logit_bias before stop_token_ids", [1], {**STOP, **BIAS}, None, OOV_BIAS),
    ("stop_token_ids before structured outputs", [1], {**SO, **STOP}, None, OOV_STOP),
    ("sampling before the rank", [1], STOP, "5", OOV_STOP),
    ("structured outputs before the rank", [1], SO, "5", STRUCTURED),
    ("sampling before the prompt's length", TOO_LONG, BIAS, None, OOV_BIAS),
    ("sampling before the prompt's vocabulary", SHORT, STOP, None, OOV_STOP),
    ("the rank before the prompt's length", TOO_LONG, {}, "5", RANK),
    ("the rank before the prompt's vocabulary", SHORT, {}, "5", RANK),
    ("the length before the vocabulary", TOO_LONG, {}, None, LONG),
    ("a prompt filling the context before the vocabulary", FILLS, {}, None, FULL),
    ("the vocabulary last", SHORT, {}, None, OOV_PROMPT),
]


@pytest.mark.parametrize(
    ("prompt", "sampling", "rank", "message"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS]
)
def test_the_first_error_in_vllms_order_answers(
    prompt: list[int], sampling: dict[str, Any], rank: str | None, message: str
) -> None:
    headers = JSON_HEADERS if rank is None else {**JSON_HEADERS, "X-data-parallel-rank": rank}
    params: dict[str, Any] = {"max_tokens": 4, **sampling}
    reply = refused({"token_ids": prompt, "sampling_params": params}, headers, context())
    assert reply.status == 400
    assert error_of(reply)["message"] == message
