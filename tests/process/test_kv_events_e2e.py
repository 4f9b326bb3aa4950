"""KV events end to end with real processes: a testkit engine publishing on the real wire
(``--kv-events-config``: PUB + replay ROUTER), the sidecar subscribed with
``--kv-events-endpoint``, and a client of WatchKvCache that finds the prefix it sent under
the keys it computes itself (sidecar_common.kv_keys)."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from typing import Any

import grpc
import pytest

from sidecar_common.api import sidecar_pb2, sidecar_pb2_grpc
from sidecar_common.kv_keys import block_keys
from tests.e2e_helpers import WAIT, free_port, log_lines, process, public_request, script, stop

pytestmark = pytest.mark.timeout(180)

PROMPT = list(range(1000, 1040))  # two full blocks of 16, and a partial one


def _kv_events_config(pub_port: int, replay_port: int, *, vllm: bool) -> str:
    config = {
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
    }
    if vllm:
        config["enable_kv_cache_events"] = True  # type: ignore[assignment]
    return json.dumps(config)


BLOCKS_OF_ONE_WARNING = "KV events in blocks of one token"


def _sidecar(stack: ExitStack, program: str, engine_flags: list[str], *flags: str) -> int:
    port, _ = _sidecar_and_log(stack, program, engine_flags, *flags)
    return port


def _sidecar_and_log(
    stack: ExitStack, program: str, engine_flags: list[str], *flags: str
) -> tuple[int, list[dict[str, Any]]]:
    """The sidecar's port, and its log lines up to the one that says it serves."""
    sidecar = stack.enter_context(
        process(
            [
                script(program),
                *engine_flags,
                "--listen",
                "127.0.0.1:0",
                "--grpc-connections",
                "1",
                "--grpc-retry-interval-secs",
                "0.2",
                "--log-format",
                "json",
                *flags,
            ]
        )
    )
    lines = []
    for entry in log_lines(sidecar):
        lines.append(entry)
        if entry.get("event") == "serving":
            return int(entry["port"]), lines
    raise AssertionError(f"the sidecar never served; exit {sidecar.poll()}; log: {lines}")


Worker = tuple[int, list[dict[str, Any]]]  # the sidecar's port, its log up to serving


def _engine(stack: ExitStack, argv_on: Callable[[list[int]], list[str]], ports: int) -> list[int]:
    """A testkit engine on ``ports`` free ports (``argv_on`` makes its command line from them),
    once its first port takes connections. A port ``free_port`` found free can be taken by
    another test's process before the engine binds it: the engine then exits at once, and is
    started again on other ports (at most three times), rather than leaving its sidecar to wait
    out its startup deadline."""
    for _ in range(3):
        chosen = [free_port() for _ in range(ports)]
        engine = stack.enter_context(process(argv_on(chosen)))
        end = time.monotonic() + WAIT
        while engine.poll() is None and time.monotonic() < end:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", chosen[0]), timeout=1):
                if engine.poll() is None:  # not another process's listener while ours exited
                    return chosen
            time.sleep(0.05)
        if engine.poll() is None:
            raise AssertionError(f"the engine took no connection within {WAIT}s: {argv_on(chosen)}")
    raise AssertionError("the engine exited at start three times (its ports taken?)")


def vllm_worker(stack: ExitStack, *, publish: bool, engine_flags: tuple[str, ...] = ()) -> Worker:
    def argv(ports: list[int]) -> list[str]:
        engine_port, pub_port, replay_port = ports
        events = (
            ["--kv-events-config", _kv_events_config(pub_port, replay_port, vllm=True)] if publish else []
        )
        return [
            script("testkit-engine"),
            "vllm",
            "--listen",
            f"127.0.0.1:{engine_port}",
            *events,
            *engine_flags,
        ]

    engine_port, pub_port, replay_port = _engine(stack, argv, 3)
    return _sidecar_and_log(
        stack,
        "sidecar-vllm",
        ["--grpc-endpoint", f"127.0.0.1:{engine_port}"],
        # The engine's own address for it, wildcard host and all: the sidecar dials this host.
        "--kv-events-endpoint",
        f"tcp://*:{pub_port}",
        "--kv-events-replay-endpoint",
        f"tcp://127.0.0.1:{replay_port}",
    )


def sglang_worker(stack: ExitStack) -> Worker:
    def argv(ports: list[int]) -> list[str]:
        grpc_port, http_port, pub_port, replay_port = ports
        return [
            script("testkit-engine"),
            "sglang",
            "--grpc-listen",
            f"127.0.0.1:{grpc_port}",
            "--http-listen",
            f"127.0.0.1:{http_port}",
            "--kv-events-config",
            _kv_events_config(pub_port, replay_port, vllm=False),
        ]

    grpc_port, _, pub_port, replay_port = _engine(stack, argv, 4)
    return _sidecar_and_log(
        stack,
        "sidecar-sglang",
        ["--grpc-endpoint", f"127.0.0.1:{grpc_port}", "--transport", "grpc"],
        "--kv-events-endpoint",
        f"tcp://127.0.0.1:{pub_port}",
        "--kv-events-replay-endpoint",
        f"tcp://127.0.0.1:{replay_port}",
    )


def generate(stub: sidecar_pb2_grpc.WorkerStub, request_id: str, tokens: list[int]) -> None:
    request = public_request(request_id, tokens, max_tokens=2)
    for _ in stub.Generate(request, timeout=WAIT):
        pass


def watched_keys(
    updates: Iterable[sidecar_pb2.KvCacheUpdate], wanted: set[int], unwanted: frozenset[int] = frozenset()
) -> set[int]:
    """Apply updates until every wanted key is held and no unwanted one (the call's deadline
    bounds the wait)."""
    keys: set[int] = set()
    pending: set[int] = set()
    for update in updates:
        if update.HasField("snapshot"):
            pending.update(update.snapshot.keys)
            if update.snapshot.last_chunk:
                keys, pending = pending, set()
        else:
            if update.delta.cleared:
                keys.clear()
            keys.difference_update(update.delta.removed)
            keys.update(update.delta.added_keys)
        if wanted <= keys and not unwanted & keys:
            return keys
    raise AssertionError("the stream ended")


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_prompt_the_engine_cached_is_found_under_the_keys_a_frontend_computes(engine: str) -> None:
    with ExitStack() as stack:
        port, log = vllm_worker(stack, publish=True) if engine == "vllm" else sglang_worker(stack)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = sidecar_pb2_grpc.WorkerStub(channel)
            block_size = stub.GetModelInfo(sidecar_pb2.GetModelInfoRequest(), timeout=WAIT).kv_block_size
            assert block_size == (16 if engine == "vllm" else 1)
            generate(stub, "first", PROMPT)
            wanted = set(block_keys(PROMPT, block_size))
            stream: Any = stub.WatchKvCache(sidecar_pb2.WatchKvCacheRequest(), timeout=WAIT)
            watched_keys(stream, wanted)
            stream.cancel()
            load = stub.GetLoad(sidecar_pb2.GetLoadRequest(), timeout=WAIT)
            assert load.kv_cache.subscribed
            assert load.kv_cache.batches_received >= 1
            assert load.kv_cache.block_size == block_size
        # SGLang's default page of one token is worth a warning at start; blocks of 16 are not.
        warned = [e for e in log if str(e.get("event", "")).startswith(BLOCKS_OF_ONE_WARNING)]
        assert [e.get("level") for e in warned] == (["warning"] if block_size == 1 else [])


def test_the_sidecar_announces_a_prompts_blocks_before_the_engine_has_prefilled_them() -> None:
    # A long prefill (40 tokens at 0.1 s each): the announcement must come on the stream while
    # the engine is still at it, and the engine's own stored blocks after it. The sidecar
    # announces for an engine that has published: a first request (one block) shows it does.
    with ExitStack() as stack:
        port, _ = vllm_worker(stack, publish=True, engine_flags=("--prefill-us-per-token", "100000"))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = sidecar_pb2_grpc.WorkerStub(channel)
            warm_up = [7] * 16
            generate(stub, "warm-up", warm_up)
            stream: Any = stub.WatchKvCache(sidecar_pb2.WatchKvCacheRequest(), timeout=WAIT)
            watched_keys(stream, set(block_keys(warm_up, 16)))
            wanted = block_keys(PROMPT, 16)
            # A server stream's call is under way once made, and is a future too (done()).
            call: Any = stub.Generate(public_request("slow", PROMPT, max_tokens=2), timeout=WAIT)
            seen: list[str] = []
            for update in stream:
                delta = update.delta
                if list(delta.announced_keys) == wanted:
                    seen.append("announced")
                    assert not call.done()  # the prefill has 4 seconds to go
                if set(wanted) <= set(delta.added_keys):
                    seen.append("stored")
                    break
            stream.cancel()
            outputs = list(call)
            assert outputs[-1].finish_reason != sidecar_pb2.UNSPECIFIED
            assert seen == ["announced", "stored"]


def test_an_engine_that_publishes_nothing_breaks_nothing() -> None:
    with ExitStack() as stack:
        port, _ = vllm_worker(stack, publish=False)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = sidecar_pb2_grpc.WorkerStub(channel)
            generate(stub, "first", PROMPT)
            load = stub.GetLoad(sidecar_pb2.GetLoadRequest(), timeout=WAIT)
            assert load.kv_cache.subscribed
            assert load.kv_cache.batches_received == 0
            stream: Any = stub.WatchKvCache(sidecar_pb2.WatchKvCacheRequest(), timeout=WAIT)
            first = next(stream)
            assert first.snapshot.last_chunk
            assert list(first.snapshot.keys) == []
            stream.cancel()


def test_an_engine_restart_leaves_none_of_the_old_engines_blocks() -> None:
    engine_port, pub_port, replay_port = free_port(), free_port(), free_port()
    engine_argv = [
        script("testkit-engine"),
        "vllm",
        "--listen",
        f"127.0.0.1:{engine_port}",
        "--kv-events-config",
        _kv_events_config(pub_port, replay_port, vllm=True),
    ]
    other = list(range(2000, 2032))
    with ExitStack() as stack:
        engine = stack.enter_context(process(engine_argv))
        port = _sidecar(
            stack,
            "sidecar-vllm",
            ["--grpc-endpoint", f"127.0.0.1:{engine_port}"],
            "--kv-events-endpoint",
            f"tcp://127.0.0.1:{pub_port}",
            "--kv-events-replay-endpoint",
            f"tcp://127.0.0.1:{replay_port}",
        )
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = sidecar_pb2_grpc.WorkerStub(channel)
            generate(stub, "before", PROMPT)
            old = set(block_keys(PROMPT, 16))
            stream: Any = stub.WatchKvCache(sidecar_pb2.WatchKvCacheRequest(), timeout=WAIT)
            watched_keys(stream, old)
            stream.cancel()
            # A new engine process on the same ports: an empty cache, sequence numbers from 0.
            stop(engine)
            stack.enter_context(process(engine_argv))
            deadline = time.monotonic() + WAIT
            while True:
                try:
                    generate(stub, "after", other)
                    break
                except grpc.RpcError:
                    assert time.monotonic() < deadline, "the sidecar never served the new engine"
                    time.sleep(0.2)  # polling a real process: the sidecar reconnects on its own
            # The sidecar's subscriber reconnects to the new publisher on ZMQ's own timer, and a
            # PUB socket drops what it publishes before then: a fresh prompt each try, until one's
            # blocks show (the old engine's must never be there).
            attempt = 0
            while True:
                stream = stub.WatchKvCache(sidecar_pb2.WatchKvCacheRequest(), timeout=3.0)
                try:
                    watched_keys(stream, set(block_keys(other, 16)), unwanted=frozenset(old))
                    break
                except grpc.RpcError as err:
                    if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED or time.monotonic() > deadline:
                        raise
                finally:
                    stream.cancel()
                attempt += 1
                other = list(range(3000 + 100 * attempt, 3032 + 100 * attempt))
                generate(stub, f"after-{attempt}", other)
