"""Behaviour under faults, every part a real process on loopback: etcd, three testkit vLLM
engines, their ``sidecar-vllm`` (registered in etcd) and one ``sidecar-frontend --discovery
etcd``. 300 concurrent streams (both formats); one sidecar is killed with SIGKILL, another
drained with SIGTERM, then both are started again (new processes, new ports, same engines).

Every stream either completes with the no-failure output or ends with a typed error its
format documents; no request is left running on any engine; the frontend's in-flight count
returns to zero; each restarted worker takes traffic once registered."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc
from testkit.generator import SamplingSpec, generate
from testkit.vllm_engine import VllmEngineConfig

from tests.e2e_helpers import WAIT, child_env, free_port, script
from tests.etcd_fixture import EtcdServer, running_etcd
from tests.integration.fleet.helpers import engine_argv, sidecar_argv, static_sidecar_argv

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow(20)]

STREAMS = 300
MAX_TOKENS = 40
MODEL = VllmEngineConfig().model


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    yield from running_etcd(tmp_path)


class Proc:
    """A process whose JSON log lines are read as they come (a full pipe would stall it), each
    noted with the monotonic time it arrived, so a test can wait on a line (an event)."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.popen = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**child_env(), **(env or {})},
        )
        self.lines: list[tuple[float, dict[str, Any]]] = []
        self.raw: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            if not line.startswith("{"):
                self.raw.append(line.rstrip("\n"))  # a traceback, grpc core's own lines
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            with self._changed:
                self.lines.append((time.monotonic(), entry))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def first(
        self, match: Callable[[dict[str, Any]], bool], timeout: float = WAIT, nth: int = 1
    ) -> tuple[float, dict[str, Any]]:
        """The first (or ``nth``) log line ``match`` accepts (waiting for it, bounded), with
        its arrival time."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = [(at, entry) for at, entry in self.lines if match(entry)]
                if len(found) >= nth:
                    return found[nth - 1]
                left = deadline - time.monotonic()
                if left <= 0 or (self.popen.poll() is not None and not self._reader.is_alive()):
                    events = [e.get("event") for _, e in self.lines[-20:]]
                    raise AssertionError(f"no such log line; exit {self.popen.poll()}; last events {events}")
                self._changed.wait(left)

    def port(self) -> int:
        return int(self.first(lambda e: e.get("event") == "serving")[1]["port"])

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=WAIT)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=WAIT)
        self._reader.join(timeout=WAIT)


@contextmanager
def proc(stack: ExitStack, argv: list[str], env: dict[str, str] | None = None) -> Iterator[Proc]:
    p = Proc(argv, env)
    try:
        yield p
    finally:
        p.stop()


def start(stack: ExitStack, argv: list[str], env: dict[str, str] | None = None) -> Proc:
    return stack.enter_context(proc(stack, argv, env))


def engine_running(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        loads = stub.GetLoads(vllm_engine_pb2.GetLoadsRequest(), timeout=5)
        return sum(load.num_total_reqs for load in loads.loads)


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def bounded(condition: Callable[[], bool], what: str, secs: float = WAIT) -> None:
    deadline = time.monotonic() + secs
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.05)  # polling real processes: there is no event to wait on


def prompt_of(n: int) -> list[int]:
    return [500 + n, 7000 + n % 13, 9000 + n % 5]


def expected(n: int, max_tokens: int = MAX_TOKENS) -> list[int]:
    return [t.token_id for t in generate(MODEL, prompt_of(n), SamplingSpec(max_tokens=max_tokens))]


class Delivered:
    """Tokens the clients received so far, and an event once ``mark`` of them arrived."""

    def __init__(self, mark: int) -> None:
        self.count = 0
        self.mark = mark
        self.reached = asyncio.Event()

    def add(self, tokens: int) -> None:
        self.count += tokens
        if self.count >= self.mark:
            self.reached.set()


async def one_stream(
    http: aiohttp.ClientSession, url: str, n: int, delivered: Delivered, max_tokens: int = MAX_TOKENS
) -> dict[str, Any]:
    """Stream ``n`` (even: SGLang /generate, odd: vLLM): its tokens and how it ended."""
    sglang = n % 2 == 0
    if sglang:
        path = "/generate"
        body: dict[str, Any] = {
            "input_ids": prompt_of(n),
            "stream": True,
            "sampling_params": {"max_new_tokens": max_tokens},
        }
    else:
        path = "/inference/v1/generate"
        body = {"token_ids": prompt_of(n), "stream": True, "sampling_params": {"max_tokens": max_tokens}}
    result: dict[str, Any] = {"tokens": [], "finish": None, "error": None}
    async with http.post(url + path, json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            text = line.decode().rstrip("\r\n")
            if not text.startswith("data: ") or text == "data: [DONE]":
                continue
            event = json.loads(text[len("data: ") :])
            before = len(result["tokens"])
            if sglang:
                result["tokens"] = event["output_ids"]
                reason = event["meta_info"]["finish_reason"]
                if reason is not None:
                    result["finish"] = reason["type"]
                    if reason["type"] == "abort":
                        result["error"] = reason
            elif "error" in event:
                result["error"] = event["error"]
            else:
                for choice in event["choices"]:
                    result["tokens"].extend(choice["token_ids"])
                    result["finish"] = choice.get("finish_reason") or result["finish"]
            delivered.add(len(result["tokens"]) - before)
    return result


def test_kill_and_drain_under_300_streams_then_restart(etcd: EtcdServer) -> None:
    with ExitStack() as stack:
        engine_ports = [free_port() for _ in range(3)]
        for port in engine_ports:
            start(stack, engine_argv(port, "--token-latency-ms", "25", "--max-num-seqs", "512"))
        drain = ("--drain-timeout-secs", "0.5")
        sidecars = [start(stack, sidecar_argv(port, etcd, *drain)) for port in engine_ports]
        for sidecar in sidecars:
            sidecar.first(lambda e: e.get("event") == "registered in etcd")
        metrics_port = free_port()
        frontend = start(
            stack,
            [
                script("sidecar-frontend"),
                "--listen",
                "127.0.0.1:0",
                "--log-format",
                "json",
                "--discovery",
                "etcd",
                "--etcd-endpoints",
                etcd.endpoint,
                "--metrics-port",
                str(metrics_port),
            ],
        )
        url = f"http://127.0.0.1:{frontend.port()}"
        addresses = [f"127.0.0.1:{s.port()}" for s in sidecars]
        for address in addresses:
            frontend.first(serving_line(address))

        killed, drained = sidecars[0], sidecars[1]
        restarted: list[Proc] = []

        async def scenario() -> dict[int, dict[str, Any]]:
            delivered = Delivered(STREAMS * 3)
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=120)
            ) as http:
                tasks = {
                    n: asyncio.ensure_future(one_stream(http, url, n, delivered)) for n in range(STREAMS)
                }
                await asyncio.wait_for(delivered.reached.wait(), WAIT)
                os.kill(killed.popen.pid, signal.SIGKILL)
                drained.popen.send_signal(signal.SIGTERM)
                assert await asyncio.to_thread(drained.popen.wait, WAIT) == 0
                assert killed.popen.wait(timeout=WAIT) == -signal.SIGKILL
                restarted.extend(
                    start(stack, sidecar_argv(port, etcd, *drain, "--log-level", "debug"))
                    for port in engine_ports[:2]
                )

                async def probe(k: int) -> None:
                    # Short requests from the restart on, until each new worker served one (a
                    # bound in time, not in requests: the new sidecars may start cold).
                    loop = asyncio.get_running_loop()
                    deadline, n = loop.time() + 2 * WAIT, 0
                    while not all(_served(new) for new in restarted) and loop.time() < deadline:
                        await one_stream(http, url, STREAMS + 1000 * k + n % 1000, Delivered(0), max_tokens=2)
                        n += 1

                probes = [asyncio.ensure_future(probe(k)) for k in range(8)]
                for new in restarted:
                    await asyncio.to_thread(new.first, lambda e: e.get("event") == "registered in etcd")
                results = {n: await task for n, task in tasks.items()}
                await asyncio.gather(*probes)
            return results

        try:
            results = asyncio.run(scenario())
        except BaseException:
            _tell(frontend)
            raise

        completed = 0
        for n, result in results.items():
            if result["error"] is None:
                assert result["tokens"] == expected(n), (n, result["finish"], len(result["tokens"]))
                assert result["finish"] == "length"
                completed += 1
            else:
                # The typed errors the formats document: SGLang's abort finish with a message
                # and a status, vLLM's error object with a type and a code.
                error = result["error"]
                if n % 2 == 0:
                    assert error["type"] == "abort"
                    assert error["message"]
                    assert error["status_code"] >= 400
                else:
                    assert error["type"]
                    assert error["code"] >= 400
        assert completed >= STREAMS * 9 // 10, f"only {completed} streams completed"

        # Each restarted worker took traffic once registered (how soon after registering is
        # measured by ``python -m bench.discovery``, not asserted here).
        for new in restarted:
            new.first(lambda e: e.get("event") == "generate started", timeout=5)

        bounded(lambda: all(engine_running(port) == 0 for port in engine_ports), "no engine runs a request")
        bounded(
            lambda: all(
                value == 0
                for name, value in scrape(metrics_port).items()
                if name.startswith("frontend_worker_inflight")
            ),
            "the frontend has nothing in flight",
        )
        samples = scrape(metrics_port)
        migrated = sum(
            v for k, v in samples.items() if k.startswith("frontend_migrations_total") and "migrated" in k
        )
        assert migrated > 0, "the killed and drained workers' streams moved"


def _tell(frontend: Proc) -> None:
    """On a failure: the frontend's exit code and its warning and error lines (the client's
    side alone does not say why a stream was cut)."""
    lines = [e for _, e in frontend.lines if e.get("level") in ("warning", "error", "critical")]
    print(f"frontend exit code: {frontend.popen.poll()}", file=sys.stderr)
    for entry in lines[-60:]:
        print(json.dumps(entry), file=sys.stderr)
    print("frontend output that is not a log line:", *frontend.raw[-80:], sep="\n", file=sys.stderr)


def serving_line(address: str) -> Callable[[dict[str, Any]], bool]:
    def match(entry: dict[str, Any]) -> bool:
        return (entry.get("event"), entry.get("worker"), entry.get("state")) == (
            "worker state",
            address,
            "serving",
        )

    return match


def _served(new: Proc) -> bool:
    return any(e.get("event") == "generate started" for _, e in new.lines)


# --- a model rollout -----------------------------------------------------------------------------

ROLLOUT_CLIENTS = 8
# The rollout's sidecars, static workers of the frontend, drain for up to 20 s.
ROLLOUT_DRAIN = ("--drain-timeout-secs", "20")


def model_line(address: str, model: str) -> Callable[[dict[str, Any]], bool]:
    def match(entry: dict[str, Any]) -> bool:
        return serving_line(address)(entry) and entry.get("model") == model

    return match


def test_a_rollout_from_model_a_to_model_b_under_traffic_loses_no_request() -> None:
    """Two workers (``--worker``, fixed addresses) serve model-a; under a steady load of streams
    (both formats, naming no model) each worker in turn is drained (SIGTERM), its engine
    replaced by one serving model-b, its sidecar started again at the same address. Every
    request completes with the exact tokens; afterwards the frontend serves model-b only."""
    with ExitStack() as stack:
        engine_ports = [free_port() for _ in range(2)]
        sidecar_ports = [free_port() for _ in range(2)]
        latency = ("--token-latency-ms", "10")
        engines = [
            start(stack, engine_argv(port, *latency, "--served-model-name", "model-a"))
            for port in engine_ports
        ]
        sidecars = [
            start(stack, static_sidecar_argv(engine, port, *ROLLOUT_DRAIN))
            for engine, port in zip(engine_ports, sidecar_ports, strict=True)
        ]
        metrics_port = free_port()
        addresses = [f"127.0.0.1:{port}" for port in sidecar_ports]
        frontend = start(
            stack,
            [
                script("sidecar-frontend"),
                *("--listen", "127.0.0.1:0", "--log-format", "json", "--metrics-port", str(metrics_port)),
                *(arg for address in addresses for arg in ("--worker", address)),
            ],
        )
        url = f"http://127.0.0.1:{frontend.port()}"
        for address in addresses:
            frontend.first(model_line(address, "model-a"))

        async def scenario() -> list[tuple[int, dict[str, Any]]]:
            done: list[tuple[int, dict[str, Any]]] = []
            stop = asyncio.Event()
            completed = asyncio.Condition()

            async def client(k: int, http: aiohttp.ClientSession) -> None:
                n = k
                while not stop.is_set():
                    result = await one_stream(http, url, n, Delivered(0), max_tokens=12)
                    async with completed:
                        done.append((n, result))
                        completed.notify_all()
                    n += ROLLOUT_CLIENTS

            async def more_completed(count: int) -> None:
                async with completed:
                    target = len(done) + count
                    await asyncio.wait_for(completed.wait_for(lambda: len(done) >= target), WAIT)

            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT)) as http:
                clients = [asyncio.ensure_future(client(k, http)) for k in range(ROLLOUT_CLIENTS)]
                await more_completed(ROLLOUT_CLIENTS)
                for i, (engine_port, port) in enumerate(zip(engine_ports, sidecar_ports, strict=True)):
                    sidecars[i].popen.send_signal(signal.SIGTERM)
                    assert await asyncio.to_thread(sidecars[i].popen.wait, WAIT) == 0
                    await more_completed(ROLLOUT_CLIENTS)  # the other worker alone serves
                    await asyncio.to_thread(engines[i].stop)
                    engines[i] = start(
                        stack, engine_argv(engine_port, *latency, "--served-model-name", "model-b")
                    )
                    sidecars[i] = start(stack, static_sidecar_argv(engine_port, port, *ROLLOUT_DRAIN))
                    await asyncio.to_thread(frontend.first, model_line(addresses[i], "model-b"))
                    await more_completed(ROLLOUT_CLIENTS)
                stop.set()
                await asyncio.gather(*clients)
            return done

        results = asyncio.run(scenario())
        assert len(results) >= 5 * ROLLOUT_CLIENTS
        for n, result in results:
            assert result["error"] is None, (n, result)
            want = [t.token_id for t in generate(MODEL, prompt_of(n), SamplingSpec(max_tokens=12))]
            assert result["tokens"] == want, n
            assert result["finish"] == "length"

        with urllib.request.urlopen(f"{url}/v1/models", timeout=WAIT) as response:
            assert [card["id"] for card in json.load(response)["data"]] == ["model-b"]
        samples = scrape(metrics_port)
        assert samples['frontend_model_workers{model="model-b",role="agg"}'] == 2
        assert [name for name in samples if "model-a" in name] == []
        ok = sum(
            v for k, v in samples.items() if k.startswith("frontend_requests_total") and 'outcome="ok"' in k
        )
        assert (
            ok
            == sum(v for k, v in samples.items() if k.startswith("frontend_requests_total"))
            == len(results)
        )
