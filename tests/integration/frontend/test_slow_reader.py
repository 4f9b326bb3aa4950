"""A client that stops reading its stream: the frontend holds a bounded buffer for it, pushes
back on the worker, and once the client reads again it gets every token, exactly.

A real TCP client opens a long stream (thousands of tokens with logprobs: megabytes), reads
the response head, then nothing (both sockets have small kernel buffers, so that the kernel
does not absorb the stream before the frontend's own buffer fills), until the frontend's
write for it has waited for the client (``Exchange.reader_waits``); it then reads to the
end. What the frontend's transport held for the stream at any write
(``Exchange.peak_buffered``) stays within the stream's write buffer plus one event of at
most ``HOLD_TOKENS`` tokens, whatever the output's length. The stream joined equals the
unary answer to the same body, and the events written after the pause carry several tokens
each (the held tokens, one event per choice).
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import anyio
import pytest
from aiohttp import web

from sidecar_frontend.exchange import HOLD_TOKENS, STREAM_WRITE_BUFFER, Exchange
from sidecar_frontend.formats.sglang import SglangFormat
from sidecar_frontend.formats.vllm import FORMAT as VLLM
from tests.e2e_helpers import until
from tests.integration.frontend.fixtures import FrontendStack, frontend_stack
from tests.integration.frontend.plugin import FORMAT as PROBE

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

TOKENS = 4_000
ENGINE = {"context_length": 65_536, "total_kv_tokens": 1 << 20, "max_logprobs": 20}
# An event's bytes per token at most (a vLLM token with 5 logprob candidates is ~400 bytes;
# SGLang's ~200): what one event of HOLD_TOKENS tokens may add over the transport's mark.
EVENT_BYTES_PER_TOKEN = 600


def _body(path: str) -> tuple[str, dict[str, Any]]:
    prompt = [1000 + i for i in range(8)]
    if path == "vllm":
        sampling = {"max_tokens": TOKENS, "ignore_eos": True, "logprobs": 5}
        return "/inference/v1/generate", {"token_ids": prompt, "sampling_params": sampling}
    if path == "sglang":
        sampling = {"max_new_tokens": TOKENS, "ignore_eos": True}
        logprobs = {"return_logprob": True, "top_logprobs_num": 5}
        return "/generate", {"input_ids": prompt, "sampling_params": sampling, **logprobs}
    # The probe's events are small (~40 bytes a token): more of them to fill the buffers.
    return "/t/generate", {"ids": prompt, "max": 3 * TOKENS}


async def _open_stream(url: str, path: str, body: dict[str, Any]) -> tuple[asyncio.StreamReader, Any]:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # A small receive window: the path's kernel buffers fill after a few KiB, not megabytes.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    # A small reader buffer too: asyncio reads ahead up to twice its limit while nobody reads.
    reader, writer = await asyncio.open_connection(sock=sock, limit=16 * 1024)
    payload = json.dumps({**body, "stream": True}).encode()
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
        + payload
    )
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"transfer-encoding: chunked" in head.lower()
    return reader, writer


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return bytes(body)
        body += await reader.readexactly(size)
        await reader.readexactly(2)


def _events(body: bytes) -> list[bytes]:
    assert body.endswith(b"\n\n")
    events = body.split(b"\n\n")[:-1]
    assert all(event.startswith(b"data: ") for event in events)
    return [event[len(b"data: ") :] for event in events]


def _stream_tokens(kind: str, events: list[bytes]) -> tuple[list[list[int]], list[Any]]:
    """Each event's tokens, and the stream's logprobs joined (in the format's terms)."""
    assert events[-1] == b"[DONE]"
    per_event: list[list[int]] = []
    logprobs: list[Any] = []
    for raw in events[:-1]:
        event = json.loads(raw)
        if kind == "vllm":
            ids = [t for c in event["choices"] for t in c["token_ids"]]
            logprobs += [e for c in event["choices"] if c["logprobs"] for e in c["logprobs"]["content"]]
        elif kind == "sglang":
            ids = event["output_ids"]
            logprobs += event["meta_info"]["output_token_logprobs"]
        else:
            ids = event["ids"]
        per_event.append(ids)
    return per_event, logprobs


def _unary_tokens(kind: str, reply: dict[str, Any]) -> tuple[list[int], list[Any]]:
    if kind == "vllm":
        choice = reply["choices"][0]
        return choice["token_ids"], choice["logprobs"]["content"]
    if kind == "sglang":
        return reply["output_ids"], reply["meta_info"]["output_token_logprobs"]
    return reply["outputs"][0]["ids"], []


async def _small_buffer_site(stack: FrontendStack) -> tuple[web.AppRunner, str]:
    """The stack's frontend served again on a listener whose accepted sockets have a small send
    buffer (they inherit it): a stalled client fills the frontend's own buffer within KiBs."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    listener.bind(("127.0.0.1", 0))
    runner = web.AppRunner(stack.frontend.build_app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.SockSite(runner, listener).start()
    return runner, f"http://127.0.0.1:{listener.getsockname()[1]}"


async def _stalled_exchange(stack: FrontendStack) -> Exchange:
    """The one exchange, once a write of its stream has waited for the client."""
    with anyio.fail_after(60):
        while True:
            exchanges = stack.frontend.exchanges
            if exchanges and exchanges[0].reader_waits:
                return exchanges[0]
            await anyio.sleep(0.02)


@pytest.mark.parametrize("kind", ["vllm", "sglang", "probe"])
async def test_a_client_that_stops_reading_holds_a_bounded_buffer_then_gets_every_token(kind: str) -> None:
    # SGLang incremental: cumulative events would restate the whole output each time.
    sglang = SglangFormat(incremental_streaming_output=True)
    fmt = {"vllm": VLLM, "sglang": sglang, "probe": PROBE}[kind]
    async with frontend_stack(engines=[ENGINE], formats=(fmt,)) as stack:
        path, body = _body(kind)
        # The probe's encoder cannot hold: its bound is the mark plus one one-token event.
        bound = STREAM_WRITE_BUFFER + (4096 if kind == "probe" else HOLD_TOKENS * EVENT_BYTES_PER_TOKEN)
        runner, url = await _small_buffer_site(stack)
        reader, writer = await _open_stream(url, path, body)
        try:
            exchange = await _stalled_exchange(stack)
            # The client reads nothing: the frontend stopped there, its buffer bounded.
            assert exchange.peak_buffered <= bound
            assert exchange.held_tokens < 2 * HOLD_TOKENS
            if kind != "probe":
                # Tokens that came while the client was behind are held (the last assertion's
                # fuller events); on a loaded machine the next ones can take a while to come.
                await until(lambda: exchange.held_tokens > 0, "the encoder holds tokens", secs=60)
            streamed = await _read_chunked(reader)
        finally:
            writer.close()
            await runner.cleanup()
        assert exchange.peak_buffered <= bound
        # More went through than the bound: the bound is not the stream's size.
        assert len(streamed) > 2 * bound
        per_event, logprobs = _stream_tokens(kind, _events(streamed))
        async with stack.http.post(stack.url + path, json={**body, "stream": False}) as response:
            assert response.status == 200
            unary_ids, unary_logprobs = _unary_tokens(kind, await response.json())
        assert [t for ids in per_event for t in ids] == unary_ids
        assert len(unary_ids) == (3 * TOKENS if kind == "probe" else TOKENS)
        assert logprobs == unary_logprobs
        if kind != "probe":
            # What was held while the client did not read went out in fuller events.
            assert max(len(ids) for ids in per_event) > 1
