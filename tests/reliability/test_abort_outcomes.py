"""Engine aborts are counted by how they ended: an abort the engine never received (it died
under the stream) is ``failed``, one it answered is ``ok`` (sidecar_engine_aborts_total), for
every engine kind."""

from __future__ import annotations

import pytest

from sidecar_server.metrics import Metrics
from tests.reliability.harness import KINDS, Ended, Kind, finish, request, rig

pytestmark = pytest.mark.timeout(60)

PROMPT = [11, 22, 33]


def aborts(metrics: Metrics, engine: str, outcome: str) -> float:
    value = metrics.registry.get_sample_value(
        "sidecar_engine_aborts_total", {"engine": engine, "outcome": outcome}
    )
    return 0.0 if value is None else value


def engine_label(kind: Kind) -> str:
    return "vllm" if kind == "vllm" else "sglang"


@pytest.mark.parametrize("kind", KINDS)
async def test_an_abort_the_dead_engine_never_received_is_counted_failed(kind: Kind) -> None:
    metrics = Metrics(engine_label(kind))
    async with rig(kind, metrics=metrics, token_latency_ms=20) as r:
        call = r.stub.Generate(request("dies", PROMPT, 1000), timeout=30)
        ended = Ended()
        ended.outs.append(await call.read())
        await r.kill_engine()
        ended = await finish(call, ended)
        assert ended.error is not None, "the stream ended although its engine died"
        assert await r.server.wait_idle(15.0), "the generation's cleanup (its abort) did not end"
        label = engine_label(kind)
        assert aborts(metrics, label, "failed") == 1
        assert aborts(metrics, label, "ok") == 0


@pytest.mark.parametrize("kind", KINDS)
async def test_an_abort_the_engine_answered_is_counted_ok(kind: Kind) -> None:
    metrics = Metrics(engine_label(kind))
    async with rig(kind, metrics=metrics, token_latency_ms=20) as r:
        call = r.stub.Generate(request("leaves", PROMPT, 1000), timeout=30)
        assert await call.read() is not None
        call.cancel()
        assert await r.server.wait_idle(15.0)
        label = engine_label(kind)
        assert aborts(metrics, label, "ok") == 1
        assert aborts(metrics, label, "failed") == 0
