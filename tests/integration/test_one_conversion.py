"""A request is converted to the engine's native form once: validate() converts it (and
refuses it before any engine call), generate() sends that same conversion under the
private id. For vLLM and for SGLang over both transports, against testkit engines."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest

from sidecar_common.api import sidecar_pb2
from sidecar_sglang import engine as sglang_engine
from sidecar_vllm import engine as vllm_engine
from tests.e2e_helpers import collect, collect_until_error, private_ids, public_request
from tests.sglang_fixtures import sglang_stack
from tests.vllm_fixtures import vllm_stack

pytestmark = pytest.mark.timeout(60)


def count_calls(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    """Wraps ``module.name`` (the real function still runs) and counts its calls."""
    calls: list[int] = []
    real: Callable[..., Any] = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


async def test_vllm_converts_a_request_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = count_calls(monkeypatch, vllm_engine, "to_generate_request")
    async with vllm_stack() as s:
        outs = await collect(s.stub.Generate(public_request("one", max_tokens=3)))
        assert outs[-1].finish_reason == sidecar_pb2.LENGTH
        assert len(calls) == 1
        # The one conversion reached the engine under the private id, not validate's.
        (private_id,) = private_ids(s)
        assert private_id.endswith("-one")


@pytest.mark.parametrize("transport", ["grpc", "http"])
async def test_sglang_converts_a_request_once(monkeypatch: pytest.MonkeyPatch, transport: Any) -> None:
    calls = count_calls(monkeypatch, sglang_engine, "build_native")
    async with sglang_stack(transport) as s:
        outs = await collect(s.stub.Generate(public_request("one", max_tokens=3)))
        assert outs[-1].finish_reason == sidecar_pb2.LENGTH
        assert len(calls) == 1
        (private_id,) = private_ids(s)
        assert private_id.endswith("-one")


async def test_a_refused_request_is_converted_once_and_never_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = count_calls(monkeypatch, vllm_engine, "to_generate_request")
    async with vllm_stack() as s:
        bad = public_request("bad", max_tokens=3)
        bad.sampling_options.temperature = -1.0
        outs, err = await collect_until_error(s.stub.Generate(bad))
        assert (outs, err.code()) == ([], grpc.StatusCode.INVALID_ARGUMENT)
        assert len(calls) == 1
        assert private_ids(s) == []
