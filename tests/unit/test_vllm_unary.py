"""One answer from vLLM (``OutputOptions.unary``): the engine is asked with ``stream`` false, and
each choice's one output equals what its stream would join to, field for field.

The engine side is the testkit's rendering of vLLM's servicer in both modes
(``testkit.vllm_wire.step``: DELTA chunks and restating completes, or FINAL_ONLY completes),
driven by the native request the conversion made; the sidecar side is
:class:`~sidecar_vllm.convert.ResponseState`. The join is the relay's own
(:func:`sidecar_server.coalesce.merge_outputs`), so "equal" is message equality: every field,
presence included (an absent field and an explicit zero stay apart).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from smg_grpc_proto.generated import vllm_engine_pb2
from testkit.generator import EOS_TRIGGER_TOKEN, PIECES, Generator, ModelSpec, prompt_logprobs
from testkit.vllm_wire import Choice, input_logprobs, sampling_spec, step, stopped

from sidecar_common.api import sidecar_pb2
from sidecar_common.disaggregation import DisaggregationMode
from sidecar_server.coalesce import merge_outputs
from sidecar_vllm.convert import ResponseState, asks_one_answer, to_generate_request

Out = sidecar_pb2.LLMEngineOutput
MODEL = ModelSpec()
EOS = MODEL.eos_token_ids[0]


@dataclass(frozen=True)
class Case:
    """One request, and how the engine runs it (its step size, cached tokens, an abort)."""

    request: sidecar_pb2.PreprocessedRequest
    chunk_tokens: int
    cached: int
    abort_after_steps: int | None


def _request(
    prompt: list[int],
    *,
    n: int = 1,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    stops: list[int] | None = None,
    stop_strings: list[str] | None = None,
    ignore_eos: bool | None = None,
    include_stop_str: bool | None = None,
    seed: int | None = None,
    logprobs: int | None = None,
    prompt_logprobs_k: int | None = None,
    unary: bool = False,
) -> sidecar_pb2.PreprocessedRequest:
    req = sidecar_pb2.PreprocessedRequest(request_id="r", token_ids=prompt, eos_token_ids=[EOS])
    req.sampling_options.n = n
    if seed is not None:
        req.sampling_options.seed = seed
    if include_stop_str is not None:
        req.sampling_options.include_stop_str_in_output = include_stop_str
    stop = req.stop_conditions
    if max_tokens is not None:
        stop.max_tokens = max_tokens
    if min_tokens is not None:
        stop.min_tokens = min_tokens
    stop.stop_token_ids.extend(stops or [])
    stop.stop.extend(stop_strings or [])
    stop.stop_token_ids_hidden.append(EOS)
    if ignore_eos is not None:
        stop.ignore_eos = ignore_eos
    if logprobs is not None:
        req.output_options.logprobs = logprobs
    if prompt_logprobs_k is not None:
        req.output_options.prompt_logprobs = prompt_logprobs_k
    req.output_options.unary = unary
    return req


def _engine_messages(
    case: Case, native: vllm_engine_pb2.GenerateRequest
) -> list[vllm_engine_pb2.GenerateResponse]:
    """What the testkit engine sends for ``native``, uninterrupted unless the case aborts."""
    prompt = tuple(native.tokenized.input_ids)
    sampling = sampling_spec(native)
    choices = [Choice(Generator(MODEL, prompt, sampling, i)) for i in range(sampling.n)]
    plp = None
    if sampling.prompt_logprobs is not None:
        plp = prompt_logprobs(prompt, max(0, sampling.prompt_logprobs), MODEL)
    in_lp = input_logprobs(prompt, plp, sampling.prompt_logprobs)
    messages: list[vllm_engine_pb2.GenerateResponse] = []
    steps = 0
    while not all(ch.gen.done for ch in choices):
        if case.abort_after_steps is not None and steps == case.abort_after_steps:
            messages += stopped(
                choices,
                stream=native.stream,
                chunk_tokens=case.chunk_tokens,
                primary_eos=EOS,
                prompt_tokens=len(prompt),
                cached=case.cached,
                in_lp=in_lp,
                sampling=sampling,
            )
            break
        made, _ = step(
            choices,
            stream=native.stream,
            chunk_tokens=case.chunk_tokens,
            primary_eos=EOS,
            prompt_tokens=len(prompt),
            cached=case.cached,
            in_lp=in_lp,
            sampling=sampling,
            handoff=lambda: None,
        )
        messages += made
        steps += 1
    return messages


def _served(case: Case, unary: bool) -> tuple[list[Out], bool]:
    """The sidecar's outputs for the case's request asked ``unary`` (or not), and whether the
    engine was asked to stream."""
    request = sidecar_pb2.PreprocessedRequest()
    request.CopyFrom(case.request)
    request.output_options.unary = unary
    native = to_generate_request(request, "private", mode="agg", supports_vision=False)
    state = ResponseState(request, "agg")
    outs = [out for message in _engine_messages(case, native) for out in state.feed(message)]
    assert state.finished
    return outs, native.stream


def _joined(outs: list[Out], index: int) -> Out:
    return merge_outputs([out for out in outs if out.index == index])


ordinary = st.integers(100, 2000)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    body = draw(st.lists(ordinary, min_size=1, max_size=6))
    if draw(st.booleans()):
        # The testkit model's EOS rule: the k-th token is EOS, k the prompt's second id.
        body = [EOS_TRIGGER_TOKEN, draw(st.integers(1, 6)), *body]
    n = draw(st.integers(1, 3))
    stops = draw(st.lists(st.integers(100, 140), max_size=3))
    max_tokens = draw(st.none() | st.integers(1, 14))
    request = _request(
        body,
        n=n,
        max_tokens=max_tokens,
        min_tokens=draw(st.none() | st.integers(0, min(3, max_tokens or 3))),
        stops=stops,
        stop_strings=draw(st.lists(st.sampled_from(PIECES[:12]), max_size=2)),
        ignore_eos=draw(st.none() | st.booleans()),
        include_stop_str=draw(st.none() | st.booleans()),
        seed=draw(st.none() | st.integers(0, 2**31 - 1)),
        logprobs=draw(st.none() | st.integers(0, 3)),
        prompt_logprobs_k=draw(st.none() | st.integers(0, 2)),
    )
    return Case(
        request,
        chunk_tokens=draw(st.integers(1, 4)),
        cached=draw(st.integers(0, len(body))),
        abort_after_steps=draw(st.none() | st.integers(1, 3)),
    )


@settings(max_examples=300, deadline=None)
@given(cases())
def test_each_choice_is_one_output_equal_to_its_joined_stream(case: Case) -> None:
    streamed, asked_stream = _served(case, unary=False)
    answered, asked_answer_stream = _served(case, unary=True)
    assert asked_stream
    assert not asked_answer_stream
    n = case.request.sampling_options.n
    assert sorted(out.index for out in answered) == list(range(n)), "one output per choice"
    for index in range(n):
        (answer,) = [out for out in answered if out.index == index]
        assert answer.finish_reason != sidecar_pb2.UNSPECIFIED, "the one output is the terminal"
        assert answer == _joined(streamed, index)


# ------------------------------------------------------------------------------ tables


@pytest.mark.parametrize(
    ("unary", "mode", "stream"),
    [
        (False, "agg", True),
        (True, "agg", False),
        # A prefill sends its handoff terminal either way; a decode's cancel hold needs its
        # first token: both stream.
        (True, "prefill", True),
        (True, "decode", True),
        (False, "prefill", True),
        (False, "decode", True),
    ],
)
def test_the_engine_is_asked_for_one_answer_only_by_an_aggregated_worker(
    unary: bool, mode: DisaggregationMode, stream: bool
) -> None:
    request = _request([100, 101], unary=unary)
    assert asks_one_answer(request, mode) is not stream
    if mode == "decode":
        request.prefill_result.disaggregated_params.update({"remote_host": "h", "remote_port": 1})
    native = to_generate_request(request, "private", mode=mode, supports_vision=False)
    assert native.stream is stream


def _final(**fields: object) -> vllm_engine_pb2.GenerateResponse:
    return vllm_engine_pb2.GenerateResponse(complete=vllm_engine_pb2.GenerateComplete(**fields))


def _answer(
    request: sidecar_pb2.PreprocessedRequest, *messages: vllm_engine_pb2.GenerateResponse
) -> list[Out]:
    state = ResponseState(request, "agg")
    outs = [out for message in messages for out in state.feed(message)]
    assert state.finished
    return outs


@pytest.mark.parametrize(
    ("fields", "stops", "expect_stop"),
    [
        # A stop string the caller gave.
        ({"finish_reason": "stop", "matched_stop_str": " cat"}, [], ("stop_string", " cat")),
        # A stop token the caller listed.
        ({"finish_reason": "stop", "matched_token_id": 120}, [120], ("stop_token_id", 120)),
        # A hidden stop (EOS) the caller did not list: no stop reason (vLLM names none for it).
        ({"finish_reason": "stop"}, [], None),
        # EOS the caller listed among its stops: named, as in a stream.
        ({"finish_reason": "stop"}, [EOS], ("stop_token_id", EOS)),
        ({"finish_reason": "length"}, [], None),
    ],
)
def test_the_final_answer_carries_every_token_and_the_finish(
    fields: dict[str, object], stops: list[int], expect_stop: tuple[str, object] | None
) -> None:
    ids = [300, 301, EOS] if expect_stop == ("stop_token_id", EOS) or not stops else [300, 301, 120]
    request = _request([100, 101], stops=stops, unary=True)
    (out,) = _answer(
        request,
        _final(output_ids=ids, prompt_tokens=2, completion_tokens=len(ids), cached_tokens=1, **fields),
    )
    assert list(out.token_ids) == ids
    assert out.finish_reason == (
        sidecar_pb2.LENGTH if fields["finish_reason"] == "length" else sidecar_pb2.STOP
    )
    which = out.WhichOneof("stop_reason")
    assert (which, getattr(out, which) if which else None) == (expect_stop or (None, None))
    usage = out.completion_usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (2, len(ids), 2 + len(ids))
    assert usage.HasField("cached_tokens")
    assert usage.cached_tokens == 1


def test_an_answer_for_each_of_n_choices_each_its_own_terminal() -> None:
    request = _request([100, 101], n=2, unary=True)
    outs = _answer(
        request,
        _final(output_ids=[300], finish_reason="length", completion_tokens=1, index=1),
        _final(output_ids=[400, 401], finish_reason="length", completion_tokens=2, index=0),
    )
    assert [(o.index, list(o.token_ids)) for o in outs] == [(1, [300]), (0, [400, 401])]
    assert all(o.finish_reason == sidecar_pb2.LENGTH for o in outs)


def test_the_answer_carries_the_logprobs_of_every_token_and_the_prompts() -> None:
    request = _request([100, 101], logprobs=1, prompt_logprobs_k=1, unary=True)
    output_lp = vllm_engine_pb2.OutputLogProbs(
        token_logprobs=[-0.5, -1.5],
        token_ids=[300, 301],
        top_logprobs=[
            vllm_engine_pb2.TopLogProbs(values=[-0.5], token_ids=[300]),
            vllm_engine_pb2.TopLogProbs(values=[-1.5, -0.25], token_ids=[301, 7]),
        ],
    )
    input_lp = vllm_engine_pb2.InputLogProbs(
        token_logprobs=[vllm_engine_pb2.InputTokenLogProb(), vllm_engine_pb2.InputTokenLogProb(value=-2.0)],
        token_ids=[100, 101],
        top_logprobs=[
            vllm_engine_pb2.TopLogProbs(),
            vllm_engine_pb2.TopLogProbs(values=[-2.0], token_ids=[101]),
        ],
    )
    (out,) = _answer(
        request,
        _final(
            output_ids=[300, 301],
            finish_reason="length",
            completion_tokens=2,
            output_logprobs=output_lp,
            input_logprobs=input_lp,
        ),
    )
    assert list(out.log_probs) == [-0.5, -1.5]
    assert [[e.token_id for e in t.entries] for t in out.top_logprobs] == [[300], [301, 7]]
    # The first prompt position has no logprob; the second lists the prompt's token.
    assert [[e.token_id for e in p.entries] for p in out.prompt_logprobs] == [[], [101]]


def test_an_abort_answers_cancelled_with_the_tokens_so_far() -> None:
    request = _request([100, 101], unary=True)
    (out,) = _answer(request, _final(output_ids=[300, 301], finish_reason="abort", completion_tokens=2))
    assert out.finish_reason == sidecar_pb2.CANCELLED
    assert list(out.token_ids) == [300, 301]
    assert out.completion_usage.completion_tokens == 2
