"""A slow reader does not make the sidecar buffer the whole generation: once the buffers
between engine and client are full (the relay's bounded buffer plus gRPC flow-control
windows), the sidecar reads from the engine only as fast as the client drains.

Two observation points, both compared with the tokens the client has read:

* what the sidecar pulled from its engine connection (a pass-through counter around the
  adapter's stream): the relay's own backpressure, for every engine kind;
* what the vLLM testkit engine has sent (its book counts tokens as its gRPC stream yields
  them, so it is paced by the wire). The SGLang testkit's scheduler, like SGLang's, generates
  into a queue whatever the wire does, so its book says nothing about pacing.

The client reads one chunk per PERIOD (scaled down from one a second) and, like a frontend that
wants backpressure, turns off gRPC's BDP probing (which would let its receive window grow).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from sidecar_common.api import sidecar_pb2
from sidecar_common.pool import CHANNEL_OPTIONS
from sidecar_server.engine import GenerateCall
from tests.reliability.harness import KINDS, Kind, Rig, request, rig, until

pytestmark = [pytest.mark.timeout(60), pytest.mark.slow(48)]

PROMPT = [101, 202, 303]
LENGTH = 200_000  # far more than any buffer between the engine and the client can hold
CHUNK = 32  # tokens per engine message: the windows fill in fewer messages
PERIOD = 0.05  # one chunk per PERIOD
FILL_READS = 60  # reads at least before the steady state is measured (the windows fill meanwhile)
FILL_MAX = 400  # a loaded machine fills the windows slower: read on until nothing moved for
FILL_QUIET = 5  # this many reads in a row (neither the sidecar's pulls nor the engine's sends)
STEADY_READS = 20
STEADY_SLACK = 2_000  # tokens the engine may run ahead of the reads during the steady state
CLIENT_OPTIONS = [("grpc.http2.bdp_probe", 0)]
CLIENT_WINDOW = 64 * 1024  # HTTP/2's default, which the client keeps with BDP probing off
ENGINE_WINDOW = dict(CHANNEL_OPTIONS)["grpc.http2.lookahead_bytes"]  # the sidecar's, per stream
# Tokens held between engine and client: the two flow-control windows (the testkit's ids take
# two or three bytes on the wire) and what the relay and the sockets hold, which is far less.
BOUND = (CLIENT_WINDOW + ENGINE_WINDOW) // 2


class Pulled:
    """Counts the tokens the relay takes from the adapter's stream (a pass-through)."""

    def __init__(self, r: Rig) -> None:
        self.tokens = 0
        inner = r.adapter.generate

        async def counted(call: GenerateCall) -> AsyncIterator[sidecar_pb2.LLMEngineOutput]:
            async for out in inner(call):
                self.tokens += len(out.token_ids)
                yield out

        setattr(r.adapter, "generate", counted)  # noqa: B010 - an instance attribute over the method


def engine_sent(r: Rig) -> int:
    """Tokens the engine has sent for the one request (all of them once it has ended)."""
    if not r.book.running_ids():
        return LENGTH
    return r.book.used_tokens() - len(PROMPT)


async def read_slowly(call: Any, reads: int) -> int:
    got = 0
    for _ in range(reads):
        out = await call.read()
        assert isinstance(out, sidecar_pb2.LLMEngineOutput), out
        got += len(out.token_ids)
        await asyncio.sleep(PERIOD)
    return got


async def slow_reader(kind: Kind, *, engine_side: bool = False, check_abort: bool = False) -> None:
    extra: dict[str, Any] = {"incremental": True} if kind != "vllm" else {}
    async with rig(
        kind, context_length=LENGTH + 1000, chunk_tokens=CHUNK, channel_options=CLIENT_OPTIONS, **extra
    ) as r:
        pulled = Pulled(r)
        call = r.stub.Generate(request("slow", PROMPT, LENGTH), timeout=60)
        read = await read_slowly(call, FILL_READS)
        quiet, seen = 0, (engine_sent(r), pulled.tokens)
        for _ in range(FILL_MAX - FILL_READS):
            if quiet >= FILL_QUIET:
                break
            read += await read_slowly(call, 1)
            now = (engine_sent(r), pulled.tokens)
            quiet = quiet + 1 if now == seen else 0
            seen = now
        sent1, pulled1, read1, t1 = engine_sent(r), pulled.tokens, read, time.monotonic()
        read += await read_slowly(call, STEADY_READS)
        sent2, pulled2, t2 = engine_sent(r), pulled.tokens, time.monotonic()
        print(
            f"\nslow_reader[{kind}] client read={read} sidecar pulled={pulled2} engine sent={sent2};"
            f" steady {t2 - t1:.2f}s: client +{read - read1}, pulled +{pulled2 - pulled1},"
            f" engine +{sent2 - sent1}"
        )
        assert pulled2 < LENGTH, "the sidecar took the whole generation for a client that read little"
        assert pulled2 - read <= BOUND, f"{pulled2 - read} tokens buffered in the sidecar and windows"
        assert pulled2 - pulled1 <= (read - read1) + STEADY_SLACK, (
            f"the sidecar pulled {pulled2 - pulled1} tokens while the client read {read - read1}"
        )
        if engine_side:
            assert sent2 - read <= BOUND, f"the engine ran {sent2 - read} tokens ahead of the client"
            assert sent2 - sent1 <= (read - read1) + STEADY_SLACK, (
                f"the engine sent {sent2 - sent1} tokens while the client read {read - read1}"
            )
        assert call.cancel()
        await until(lambda: r.engine_busy() == 0, "the engine stopped the request after the cancel")
        assert await r.server.wait_idle(5.0)
        if check_abort:
            # The engine request was left unfinished: the sidecar must abort it, exactly once.
            assert len(r.book.aborts) == 1, f"engine aborts after the client's cancel: {r.book.aborts}"


@pytest.mark.parametrize("kind", KINDS)
async def test_the_relay_reads_the_engine_only_as_fast_as_a_slow_client_drains(kind: Kind) -> None:
    await slow_reader(kind)


async def test_a_slow_client_paces_the_vllm_engine() -> None:
    await slow_reader("vllm", engine_side=True)


@pytest.mark.parametrize("kind", KINDS)
async def test_cancelling_a_slow_reader_aborts_the_engine_request_once(kind: Kind) -> None:
    await slow_reader(kind, check_abort=True)
