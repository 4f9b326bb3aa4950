"""The one table of sampling limits over the wire, for the three engine kinds (vLLM, SGLang over
gRPC, SGLang over HTTP): every bad value is refused before any engine call with
INVALID_ARGUMENT, not migratable, the details naming the same field for every engine that
refuses it; a value only the other engine refuses is served."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

import grpc
import pytest
from google.protobuf import json_format

from sidecar_common.api import sidecar_pb2
from tests.e2e_helpers import collect, collect_until_error, public_request, reason_of, terminal
from tests.sglang_fixtures import sglang_stack
from tests.unit.test_limits import BAD_VALUES
from tests.vllm_fixtures import vllm_stack

pytestmark = pytest.mark.timeout(120)

Kind = Literal["vllm", "sglang-grpc", "sglang-http"]
KINDS: tuple[Kind, ...] = ("vllm", "sglang-grpc", "sglang-http")


@asynccontextmanager
async def stack_of(kind: Kind) -> AsyncIterator[Any]:
    if kind == "vllm":
        async with vllm_stack() as s:
            yield s
    else:
        async with sglang_stack("grpc" if kind == "sglang-grpc" else "http") as s:
            yield s


def with_value(path: str, value: float) -> sidecar_pb2.PreprocessedRequest:
    req = public_request("limits", max_tokens=2)
    section, name = path.split(".")
    setattr(getattr(req, section), name, value)
    return req


@pytest.mark.parametrize("kind", KINDS)
async def test_every_bad_sampling_value_is_refused_by_name_before_the_engine(kind: Kind) -> None:
    engine = "vllm" if kind == "vllm" else "sglang"
    async with stack_of(kind) as s:
        for path, value, refused_by in BAD_VALUES:
            call = s.stub.Generate(with_value(path, value), timeout=10)
            if engine not in refused_by:
                outs = await collect(call)
                assert terminal(outs, last=True).finish_reason != sidecar_pb2.CANCELLED, (path, value)
                continue
            outs, err = await collect_until_error(call)
            assert outs == [], (path, value)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (path, value, err.details())
            assert (err.details() or "").startswith(f"{path}: "), (path, value, err.details())
            assert reason_of(err) == ("INVALID_ARGUMENT", "false")
        served = sum(1 for _, _, refused_by in BAD_VALUES if engine not in refused_by)
        assert len(s.engine.book.received) == served, "only the values this engine accepts reached it"


@pytest.mark.parametrize("kind", KINDS)
async def test_max_tokens_0_scores_the_prompt_on_sglang_and_is_refused_in_vllms_words(kind: Kind) -> None:
    async with stack_of(kind) as s:
        req = public_request("score", max_tokens=0)
        req.output_options.prompt_logprobs = 0
        call = s.stub.Generate(req, timeout=10)
        if kind == "vllm":
            outs, err = await collect_until_error(call)
            assert outs == []
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.details() == "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"
            assert reason_of(err) == ("INVALID_ARGUMENT", "false")
            assert s.engine.book.received == [], "refused before the engine"
            return
        outs = await collect(call)
        [end] = outs
        assert list(end.token_ids) == []
        assert end.finish_reason == sidecar_pb2.LENGTH
        usage = end.completion_usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(req.token_ids), 0)
        rows = json_format.MessageToDict(end.engine_data)["prompt_logprobs"]
        assert len(rows) == len(req.token_ids)
        assert rows[0] is None
        assert [row[0]["token_id"] for row in rows[1:]] == list(req.token_ids[1:])
