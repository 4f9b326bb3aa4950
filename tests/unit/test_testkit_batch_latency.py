"""The testkit engines' decode step grows with the running batch (``--token-latency-slope-ms``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from testkit.__main__ import add_vllm_arguments, vllm_config_from_args
from testkit.book import Outcome
from testkit.pacing import decode_step_secs
from testkit.sglang_cli import add_arguments, config_from_args
from testkit.sglang_core import NativeRequest
from testkit.sglang_engine import SglangTestEngine
from testkit.sglang_info import SglangEngineConfig
from testkit.vllm_config import VllmEngineConfig
from testkit.vllm_engine import VllmTestEngine

from sidecar_common.flags import FlagParser

pytestmark = pytest.mark.timeout(60)

# (base ms, slope ms, running) -> the step in seconds
ROWS = [
    (20.0, 0.0, 1, 0.020),
    (20.0, 0.0, 64, 0.020),
    (20.0, 0.5, 1, 0.020),
    (20.0, 0.5, 2, 0.0205),
    (20.0, 0.5, 9, 0.024),
    (10.0, 2.0, 4, 0.016),
    (0.0, 1.0, 3, 0.002),
    (0.0, 1.0, 1, 0.0),
    (5.0, 1.0, 0, 0.005),
]


@pytest.mark.parametrize(("base", "slope", "running", "secs"), ROWS)
def test_a_step_costs_the_base_plus_the_slope_per_request_beyond_the_first(
    base: float, slope: float, running: int, secs: float
) -> None:
    assert decode_step_secs(base, slope, running) == pytest.approx(secs)


ms = st.floats(min_value=0.0, max_value=10_000.0, allow_nan=False)


@given(ms, st.integers(min_value=0, max_value=4096))
def test_a_zero_slope_is_the_flat_token_latency(base: float, running: int) -> None:
    assert decode_step_secs(base, 0.0, running) == base / 1000.0


@given(ms, ms, st.integers(min_value=0, max_value=4096), st.integers(min_value=0, max_value=64))
def test_a_bigger_batch_never_steps_faster(base: float, slope: float, running: int, more: int) -> None:
    assert decode_step_secs(base, slope, running) <= decode_step_secs(base, slope, running + more)
    assert decode_step_secs(base, slope, running) >= base / 1000.0


def test_the_engines_command_lines_take_the_slope() -> None:
    vllm = FlagParser(prog="t")
    add_vllm_arguments(vllm)
    assert vllm_config_from_args(vllm.parse_args([])).token_latency_slope_ms == 0.0
    v = vllm_config_from_args(vllm.parse_args(["--token-latency-ms=20", "--token-latency-slope-ms=0.5"]))
    assert (v.token_latency_ms, v.token_latency_slope_ms) == (20.0, 0.5)
    sglang = FlagParser(prog="t")
    add_arguments(sglang)
    assert config_from_args(sglang.parse_args([])).token_latency_slope_ms == 0.0
    g = config_from_args(sglang.parse_args(["--token-latency-ms=20", "--token-latency-slope-ms=0.5"]))
    assert (g.token_latency_ms, g.token_latency_slope_ms) == (20.0, 0.5)


def test_a_negative_slope_is_refused() -> None:
    with pytest.raises(ValueError, match="token_latency_slope_ms"):
        VllmEngineConfig(token_latency_slope_ms=-1.0)
    with pytest.raises(ValueError, match="token_latency_slope_ms"):
        SglangEngineConfig(token_latency_slope_ms=-1.0)


class _Context:
    """The little of a grpc.aio servicer context the vLLM engine's Generate uses here."""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    async def abort(self, code: object, details: str) -> None:
        raise AssertionError(f"aborted: {code} {details}")


OTHERS = 3  # running beside the request under test: a batch of 4


async def test_the_vllm_engine_paces_each_step_by_the_running_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    config = VllmEngineConfig(token_latency_ms=10.0, token_latency_slope_ms=2.0, chunk_tokens=2)
    engine = VllmTestEngine(config)
    for i in range(OTHERS):
        assert await engine.book.admit(f"other-{i}")
    paced: list[float] = []

    async def pause(live: Any, secs: float) -> None:
        paced.append(secs)

    monkeypatch.setattr(engine, "_pause", pause)
    request = pb.GenerateRequest(
        request_id="r",
        tokenized=pb.TokenizedInput(input_ids=[101, 202, 303, 404]),
        sampling_params=pb.SamplingParams(max_tokens=4),
        stream=True,
    )
    async with asyncio.timeout(30):
        msgs = [m async for m in engine.Generate(request, _Context())]
    assert msgs
    assert paced  # one pause per step of chunk_tokens tokens
    step = decode_step_secs(10.0, 2.0, OTHERS + 1)
    assert step == pytest.approx(0.016)
    assert paced == [step * 2] * len(paced)


async def test_the_sglang_engine_paces_each_step_by_the_running_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = SglangTestEngine(SglangEngineConfig(token_latency_ms=10.0, token_latency_slope_ms=2.0))
    await engine.start()
    try:
        for i in range(OTHERS):
            assert await engine.book.admit(f"other-{i}")
        paced: list[float] = []

        async def wait_abort(live: Any, secs: float) -> bool:
            paced.append(secs)
            return False

        monkeypatch.setattr(engine, "_wait_abort", wait_abort)
        stream = engine.submit(
            NativeRequest(rid="r", input_ids=(101, 102, 103, 104), wire="grpc", max_new_tokens=4, stream=True)
        )
        async with asyncio.timeout(30):
            while await stream.next() is not None:
                pass
        assert paced  # one wait per decode step
        assert paced == [decode_step_secs(10.0, 2.0, OTHERS + 1)] * len(paced)
    finally:
        for i in range(OTHERS):
            engine.book.release(f"other-{i}", Outcome.FINISHED)
        await engine.stop()
