"""The testkit vLLM engine refuses as vLLM 0.33 does: its words, in its order.

vLLM checks a request's sampling parameters first (``SamplingParams`` itself, then
``verify``: logprobs, prompt logprobs, logit_bias, stop_token_ids), then the data-parallel
rank, then the prompt's length, then its vocabulary (``InputProcessor.process_inputs``). Each
row has two or more problems at once; the expected text is the first one's, as vLLM words it
(``VLLMValidationError`` appends `` (parameter=…, value=…)``).
"""

from __future__ import annotations

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from testkit.vllm_engine import VllmEngineConfig, VllmTestEngine, _RequestError
from testkit.vllm_wire import prompt_refusal, sampling_refusal

CONFIG = VllmEngineConfig(vocab_size=100, context_length=8, data_parallel_size=2, max_logprobs=20)
LONG = (
    "The decoder prompt (length 9) is longer than the maximum model length of 8. Make sure that "
    "`max_model_len` is no smaller than the number of text tokens."
)
FULL = (
    "The decoder prompt (length 8) plus the number of requested output tokens (at least 1) is longer "
    "than the maximum model length of 8. Make sure that `max_model_len` is no smaller than the number "
    "of text tokens (prompt + requested output tokens)."
)
LOGPROBS = (
    "Requested sample logprobs of 21, which is greater than max allowed: 20 (parameter=logprobs, value=21)"
)


def request(prompt: list[int], rank: int | None = None, **sampling: object) -> pb.GenerateRequest:
    native = pb.GenerateRequest(
        request_id="r",
        tokenized=pb.TokenizedInput(input_ids=prompt),
        sampling_params=pb.SamplingParams(**sampling),
    )
    if rank is not None:
        native.data_parallel_rank = rank
    return native


ORDER: list[tuple[str, pb.GenerateRequest, str]] = [
    (
        "max_tokens before logprobs",
        request([1], max_tokens=0, logprobs=21),
        "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
    ),
    ("logprobs before prompt logprobs", request([1], logprobs=21, prompt_logprobs=25), LOGPROBS),
    (
        "prompt logprobs before logit_bias",
        request([1], prompt_logprobs=25, logit_bias={500: 1.0}),
        "Requested prompt logprobs of 25, which is greater than max allowed: 20 "
        "(parameter=prompt_logprobs, value=25)",
    ),
    (
        "logit_bias before stop_token_ids",
        request([1], logit_bias={500: 1.0, 100: 2.0, 3: 0.5}, stop_token_ids=[200]),
        "token_id(s) [100, 500] in logit_bias contain out-of-vocab token ids. Vocabulary size: 100 "
        "(parameter=logit_bias, value=[100, 500])",
    ),
    (
        "stop_token_ids before the rank",
        request([1], rank=2, stop_token_ids=[200, 7]),
        "token_id(s) [200] in stop_token_ids contain out-of-vocab token ids. Vocabulary size: 100 "
        "(parameter=stop_token_ids, value=[200])",
    ),
    ("sampling before the rank", request([1], rank=5, logprobs=21), LOGPROBS),
    ("sampling before the prompt's length", request(list(range(9)), logprobs=21), LOGPROBS),
    ("sampling before the vocabulary", request([1000], logprobs=21), LOGPROBS),
    (
        "the rank before the prompt's length",
        request(list(range(9)), rank=2),
        "data_parallel_rank 2 is out of range [0, 2).",
    ),
    (
        "the rank before the vocabulary",
        request([1000], rank=3),
        "data_parallel_rank 3 is out of range [0, 2).",
    ),
    ("the length before the vocabulary", request([1000] * 9), LONG),
    ("a prompt that fills the context", request([1000] * 8), FULL),
    ("the vocabulary last", request([1, 1000, 150]), "Token id 1000 is out of vocabulary"),
    ("an empty prompt", request([], rank=1), "The decoder prompt cannot be empty"),
    (
        "logprobs -1 is the whole vocabulary",
        request([1], logprobs=-1),
        "Requested sample logprobs of 100, which is greater than max allowed: 20 "
        "(parameter=logprobs, value=100)",
    ),
]


@pytest.mark.parametrize(("native", "words"), [row[1:] for row in ORDER], ids=[row[0] for row in ORDER])
def test_the_first_problem_in_vllms_order_is_refused_in_vllms_words(
    native: pb.GenerateRequest, words: str
) -> None:
    engine = VllmTestEngine(CONFIG)
    with pytest.raises(_RequestError) as refused:
        engine._check(native)
    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert str(refused.value) == words


def test_limits_that_are_met_say_nothing() -> None:
    fine = request(
        [1, 2, 3],
        rank=1,
        max_tokens=1,
        logprobs=20,
        prompt_logprobs=20,
        logit_bias={99: 1.0},
        stop_token_ids=[0, 99],
    )
    assert sampling_refusal(fine.sampling_params, 100, 20) is None
    assert prompt_refusal((1, 2, 99), 100, 8) is None
    VllmTestEngine(CONFIG)._check(fine)
