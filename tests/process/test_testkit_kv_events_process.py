"""``testkit-engine vllm|sglang --kv-events-config ...`` as a user runs it: the KV events of a
request, read back from the replay socket of the running process (tests/kv_events_mirror.py)."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import aiohttp
import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from tests.e2e_helpers import WAIT, free_port, process, script
from tests.kv_events_mirror import SglangCleared, SglangStored, Subscriber, VllmStored

pytestmark = pytest.mark.timeout(90)


def wait_for_port(port: int) -> None:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            sock.settimeout(0.5)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port}")


async def replayed(pub_port: int, replay_port: int, engine: str) -> Subscriber:
    sub = Subscriber(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", engine)
    await sub.replay_from(0)
    return sub


def test_vllm_engine_process_publishes_a_requests_blocks() -> None:
    grpc_port, pub_port, replay_port = free_port(), free_port(), free_port()
    config = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://*:{pub_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
    }
    argv = [script("testkit-engine"), "vllm", "--listen", f"127.0.0.1:{grpc_port}", "--block-size", "4"]
    argv += ["--kv-events-config", json.dumps(config)]

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            req = pb.GenerateRequest(
                request_id="p1",
                tokenized=pb.TokenizedInput(input_ids=list(range(10, 19))),
                sampling_params=pb.SamplingParams(max_tokens=1),
                stream=True,
            )
            _ = [m async for m in pb_grpc.VllmEngineStub(channel).Generate(req, timeout=WAIT)]
        sub = await replayed(pub_port, replay_port, "vllm")
        try:
            (stored,) = sub.batches[0].events
            assert isinstance(stored, VllmStored)
            assert stored.token_ids == list(range(10, 18))
        finally:
            sub.close()

    with process(argv):
        wait_for_port(grpc_port)
        asyncio.run(scenario())


def test_sglang_engine_process_starts_with_a_clear_then_publishes_pages() -> None:
    http_port, pub_port, replay_port = free_port(), free_port(), free_port()
    config = {
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
    }
    argv = [
        script("testkit-engine"),
        "sglang",
        "--grpc-listen",
        "off",
        "--http-listen",
        f"127.0.0.1:{http_port}",
    ]
    argv += ["--page-size", "2", "--kv-events-config", json.dumps(config)]

    async def scenario() -> None:
        body = {"input_ids": [5, 6, 7, 8, 9], "sampling_params": {"max_new_tokens": 1}, "rid": "p1"}
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT)) as session,
            session.post(f"http://127.0.0.1:{http_port}/generate", json=body) as resp,
        ):
            assert resp.status == 200
        sub = await replayed(pub_port, replay_port, "sglang")
        try:
            assert sub.batches[0].events == [SglangCleared()]
            (stored,) = sub.batches[1].events
            assert isinstance(stored, SglangStored)
            assert stored.token_ids == [5, 6, 7, 8]
            assert stored.block_size == 2
        finally:
            sub.close()

    with process(argv):
        wait_for_port(http_port)
        asyncio.run(scenario())
