"""Both formats answer the same whether a worker sends prompt logprobs in the typed field
(0.2 sidecars) or only in its 0.1 Struct shape (sidecars of the previous release)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar_common import prompt_logprobs
from sidecar_common.api import sidecar_pb2
from sidecar_common.prompt_logprobs import Shape
from sidecar_frontend.formats import vllm
from tests.unit.frontend import test_format_sglang_support as sglang_support
from tests.unit.frontend import test_format_vllm_support as vllm_support

TOKENS = st.integers(0, 50)
LOGPROBS = st.floats(-30.0, 0.0, allow_nan=False) | st.just(-1e9)


@st.composite
def positions(draw: st.DrawFn, *, ranked: bool) -> tuple[list[int], list[sidecar_pb2.TopLogprobs]]:
    """A prompt and the positions a sidecar sends for it: the first (and maybe others) without
    logprobs, else the prompt token first, then alternatives with distinct ids."""
    prompt = draw(st.lists(TOKENS, min_size=1, max_size=5))
    made = []
    for index, token in enumerate(prompt):
        if index == 0 or draw(st.integers(0, 4)) == 0:
            made.append(sidecar_pb2.TopLogprobs())
            continue
        tokens = [token, *(t for t in draw(st.lists(TOKENS, unique=True, max_size=3)) if t != token)]
        # Distinct values: a 0.1 Struct keeps no order, so between equal logprobs its order was
        # the map's (the typed field keeps the sidecar's).
        values = draw(st.lists(LOGPROBS, unique=True, min_size=len(tokens), max_size=len(tokens)))
        ranks = st.none() | st.integers(0, 9) if ranked else st.none()
        entries = [
            prompt_logprobs.candidate(t, lp, draw(ranks)) for t, lp in zip(tokens, values, strict=True)
        ]
        made.append(sidecar_pb2.TopLogprobs(entries=entries))
    return prompt, made


def typed_and_struct(
    found: list[sidecar_pb2.TopLogprobs], shape: Shape
) -> tuple[sidecar_pb2.LLMEngineOutput, sidecar_pb2.LLMEngineOutput]:
    """The same terminal from a 0.2 sidecar (the typed field only, as from 0.3 on) and from a
    0.1 sidecar (only the Struct, after crossing the wire)."""
    typed = sidecar_pb2.LLMEngineOutput(
        token_ids=[9], finish_reason=sidecar_pb2.LENGTH, prompt_logprobs=found
    )
    both = sidecar_pb2.LLMEngineOutput(token_ids=[9], finish_reason=sidecar_pb2.LENGTH)
    prompt_logprobs.attach(both, found, shape)
    both.ClearField("prompt_logprobs")
    return typed, sidecar_pb2.LLMEngineOutput.FromString(both.SerializeToString())


def vllm_reply(prompt: list[int], output: sidecar_pb2.LLMEngineOutput) -> Any:
    call = vllm_support.accepted(
        {"token_ids": prompt, "sampling_params": {"prompt_logprobs": 2}, "request_id": "r"}
    )
    encoder = vllm.FORMAT.new_encoder(call, 0.0)
    encoder.on_output(0, output, 0.0)
    return encoder.reply().body


def sglang_reply(prompt: list[int], output: sidecar_pb2.LLMEngineOutput) -> Any:
    fields = {"input_ids": prompt, "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0}
    call = sglang_support.accepted(fields)
    _, reply = sglang_support.drive(call, [(0, output, sglang_support.STARTED_AT + 1)])
    assert reply is not None
    meta = json.loads(reply.body)["meta_info"]
    return meta["input_token_logprobs"], meta["input_top_logprobs"]


@settings(deadline=None)
@given(case=positions(ranked=True))
def test_vllm_reads_the_typed_field_as_a_vllm_sidecars_struct(
    case: tuple[list[int], list[sidecar_pb2.TopLogprobs]],
) -> None:
    prompt, found = case
    typed, struct = typed_and_struct(found, Shape.BY_TOKEN)
    assert vllm_reply(prompt, typed) == vllm_reply(prompt, struct)


@settings(deadline=None)
@given(case=positions(ranked=False))
def test_vllm_reads_the_typed_field_as_an_sglang_sidecars_struct(
    case: tuple[list[int], list[sidecar_pb2.TopLogprobs]],
) -> None:
    prompt, found = case
    typed, struct = typed_and_struct(found, Shape.LISTED)
    assert vllm_reply(prompt, typed) == vllm_reply(prompt, struct)


@settings(deadline=None)
@given(case=positions(ranked=True), shape=st.sampled_from(Shape))
def test_sglang_reads_the_typed_field_as_either_sidecars_struct(
    case: tuple[list[int], list[sidecar_pb2.TopLogprobs]], shape: Shape
) -> None:
    prompt, found = case
    typed, struct = typed_and_struct(found, shape)
    assert sglang_reply(prompt, typed) == sglang_reply(prompt, struct)


def test_the_typed_field_wins_over_the_struct() -> None:
    prompt = [4, 5]
    found = [sidecar_pb2.TopLogprobs(), sidecar_pb2.TopLogprobs(entries=[prompt_logprobs.candidate(5, -0.5)])]
    output = sidecar_pb2.LLMEngineOutput(
        token_ids=[9], finish_reason=sidecar_pb2.LENGTH, prompt_logprobs=found
    )
    output.engine_data.update({"prompt_logprobs": [None, [{"token_id": 5, "logprob": -7.0}]]})
    assert json.loads(vllm_reply(prompt, output))["prompt_logprobs"] == [
        None,
        {"5": {"logprob": -0.5, "rank": None, "decoded_token": None}},
    ]
    assert sglang_reply(prompt, output)[0] == [[None, 4, None], [-0.5, 5, None]]
