"""Every supervised task of a real frontend process fails in turn while it serves (issue 26).

Three testkit vLLM engines publishing KV events, a ``sidecar-vllm`` beside each (subscribed),
one ``sidecar-frontend`` over them with ``SIDECAR_TEST_FAULT_FILE`` set (the supervisor's test
hook: each task name appended to the file makes every running task of that name fail once).
While 100 streams run (both formats), the frontend's long-lived per-worker tasks fail in turn:
the health Watch, the load poll, the KV stream. Every stream completes with the no-failure
output (or migrates token-exactly: the output is the same), the process never exits, and each
failure is one error line naming its task and its worker, counted in
``frontend_background_failures_total``, after which the task runs again.
"""

from __future__ import annotations

import asyncio
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.e2e_helpers import WAIT, free_port, script
from tests.integration.fleet.helpers import engine_argv, static_sidecar_argv
from tests.process.test_fleet_faults import (
    Delivered,
    Proc,
    expected,
    one_stream,
    scrape,
    serving_line,
    start,
)
from tests.process.test_kv_events_e2e import _kv_events_config

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow(25)]

STREAMS = 100
MAX_TOKENS = 40
TASKS = ("health", "load_poll", "kv_stream")


def snapshot_line(worker: str) -> Any:
    def match(entry: dict[str, Any]) -> bool:
        return (entry.get("event"), entry.get("worker")) == ("worker cache snapshot", worker)

    return match


def failed_line(task: str, worker: str) -> Any:
    def match(entry: dict[str, Any]) -> bool:
        return (entry.get("event"), entry.get("task"), entry.get("worker")) == (
            "background task failed",
            task,
            worker,
        )

    return match


def test_each_supervised_task_fails_in_turn_under_100_streams_and_the_frontend_serves_on(
    tmp_path: Path,
) -> None:
    fault_file = tmp_path / "faults"
    with ExitStack() as stack:
        sidecars: list[Proc] = []
        for _ in range(3):
            engine, pub, replay = free_port(), free_port(), free_port()
            events = _kv_events_config(pub, replay, vllm=True)
            start(stack, engine_argv(engine, "--token-latency-ms", "40", "--kv-events-config", events))
            sidecars.append(
                start(
                    stack,
                    static_sidecar_argv(
                        engine,
                        0,
                        *("--kv-events-endpoint", f"tcp://127.0.0.1:{pub}"),
                        *("--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}"),
                    ),
                )
            )
        addresses = [f"127.0.0.1:{s.port()}" for s in sidecars]
        metrics_port = free_port()
        argv = [script("sidecar-frontend"), "--listen", "127.0.0.1:0", "--log-format", "json"]
        argv += ["--metrics-port", str(metrics_port)]
        for address in addresses:
            argv += ["--worker", address]
        frontend = start(stack, argv, {"SIDECAR_TEST_FAULT_FILE": str(fault_file)})
        url = f"http://127.0.0.1:{frontend.port()}"
        for address in addresses:
            frontend.first(serving_line(address))
            frontend.first(snapshot_line(address))

        async def scenario() -> dict[int, dict[str, Any]]:
            delivered = Delivered(STREAMS * 2)
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=180)
            ) as http:
                tasks = {
                    n: asyncio.ensure_future(one_stream(http, url, n, delivered)) for n in range(STREAMS)
                }
                await asyncio.wait_for(delivered.reached.wait(), WAIT)
                written: list[str] = []
                for task in TASKS:
                    written.append(task)
                    fault_file.write_text("\n".join(written) + "\n")
                    for address in addresses:
                        await asyncio.to_thread(frontend.first, failed_line(task, address))
                return {n: await stream for n, stream in tasks.items()}

        results = asyncio.run(scenario())

        for n, result in results.items():
            assert result["error"] is None, (n, result["error"])
            assert result["tokens"] == expected(n), (n, result["finish"], len(result["tokens"]))
            assert result["finish"] == "length"
        assert frontend.popen.poll() is None, "the frontend process lives"

        # Each failure was said once, for its task and its worker, and counted.
        lines = [e for _, e in frontend.lines if e.get("event") == "background task failed"]
        said = sorted((e["task"], e["worker"]) for e in lines)
        assert said == sorted((task, address) for task in TASKS for address in addresses), lines
        assert all(e["level"] == "error" for e in lines)
        samples = scrape(metrics_port)
        for task in TASKS:
            assert samples[f'frontend_background_failures_total{{task="{task}"}}'] == len(addresses)

        # Every task ran again: each worker's KV stream, failed once, took a new snapshot.
        for address in addresses:
            frontend.first(snapshot_line(address), nth=2)
        after = asyncio.run(_one_more(url))
        assert after["error"] is None
        assert after["tokens"] == expected(STREAMS, 4)


async def _one_more(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT)) as http:
        return await one_stream(http, url, STREAMS, Delivered(0), max_tokens=4)
