"""KV-cache-aware routing as an operator runs it: testkit vLLM engines publishing their KV events
on the real ZMQ wire (``--kv-events-config``), ``sidecar-vllm --kv-events-endpoint`` beside
each, ``sidecar-frontend`` over them, all real processes on loopback.

- a second request sharing a long prefix lands on the worker that cached it, and its response
  reports the cached tokens;
- an engine that publishes nothing: routing falls back (to the frontend's own decisions), and
  nothing breaks;
- two frontends see the same map: a prefix cached through one is found through the other;
- the deltas carry the engine's batch time: the frontend's events-lag histogram counts them.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import pytest

from tests.e2e_helpers import WAIT, free_port, process, script, serving_port

pytestmark = pytest.mark.timeout(180)

BLOCK = 16
PREFIX = [(13 * i) % 30000 + 1 for i in range(64 * BLOCK)]  # 1,024 tokens: 64 blocks


@dataclass(frozen=True)
class Frontend:
    url: str
    metrics_url: str

    def generate(self, prompt: list[int]) -> dict[str, Any]:
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}}
        request = urllib.request.Request(
            self.url + "/generate",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=WAIT) as response:
            assert response.status == 200
            reply: dict[str, Any] = json.loads(response.read())
            return reply

    def samples(self, name: str) -> dict[str, float]:
        return samples(self.metrics_url, name)

    def wait_for(self, name: str, condition: Any, what: str) -> dict[str, float]:
        """Until ``condition(samples of name)`` holds (polling a real process: bounded)."""
        deadline = time.monotonic() + WAIT
        while True:
            samples = self.samples(name)
            if condition(samples):
                return samples
            assert time.monotonic() < deadline, f"not reached within {WAIT}s: {what}; {name}: {samples}"
            time.sleep(0.05)


def samples(metrics_url: str, name: str) -> dict[str, float]:
    """Each sample of ``name`` a process exports: its label text (``{...}`` or "") -> value."""
    with urllib.request.urlopen(metrics_url, timeout=WAIT) as response:
        text: str = response.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        match = re.fullmatch(rf"{re.escape(name)}(\{{[^}}]*\}})? (\S+)", line)
        if match:
            found[match.group(1) or ""] = float(match.group(2))
    return found


def worker(
    stack: ExitStack, *, publishes: bool = True, subscribes: bool = True, metrics_port: int | None = None
) -> str:
    """A testkit vLLM engine (publishing its KV events when ``publishes``) and its sidecar
    (subscribed to them when ``subscribes``, serving its metrics on ``metrics_port`` if
    given); the sidecar's address."""
    engine_port, events_port, replay_port = free_port(), free_port(), free_port()
    engine_argv = [script("testkit-engine"), "vllm", "--listen", f"127.0.0.1:{engine_port}"]
    engine_argv += ["--block-size", str(BLOCK)]
    if publishes:
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{events_port}",
            "replay_endpoint": f"tcp://*:{replay_port}",
        }
        engine_argv += ["--kv-events-config", json.dumps(config)]
    stack.enter_context(process(engine_argv))
    sidecar_argv = [
        script("sidecar-vllm"),
        *("--grpc-endpoint", f"127.0.0.1:{engine_port}", "--listen", "127.0.0.1:0"),
        *("--grpc-retry-interval-secs", "0.2", "--log-format", "json"),
    ]
    if metrics_port is not None:
        sidecar_argv += ["--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.1"]
    if subscribes:
        sidecar_argv += ["--kv-events-endpoint", f"tcp://127.0.0.1:{events_port}"]
        sidecar_argv += ["--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay_port}"]
    sidecar = stack.enter_context(process(sidecar_argv))
    return f"127.0.0.1:{serving_port(sidecar)}"


def frontend(stack: ExitStack, workers: list[str], *flags: str) -> Frontend:
    metrics_port = free_port()
    argv = [script("sidecar-frontend"), "--listen", "127.0.0.1:0", "--log-format", "json"]
    argv += ["--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.1", *flags]
    for address in workers:
        argv += ["--worker", address]
    proc = stack.enter_context(process(argv))
    fe = Frontend(f"http://127.0.0.1:{serving_port(proc)}", f"http://127.0.0.1:{metrics_port}/metrics")
    fe.wait_for(
        "frontend_workers",
        lambda s: s.get('{role="agg",state="serving"}') == len(workers),
        "every worker serves",
    )
    return fe


def _live_streams(samples: dict[str, float]) -> int:
    return sum(1 for labels, value in samples.items() if value == 1 and 'publishing="' in labels)


@dataclass(frozen=True)
class Fleet:
    workers: list[str]
    first: Frontend
    second: Frontend
    # Each worker's sidecar's /metrics.
    sidecar_metrics: list[str]


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    """Three publishing workers behind two frontends (--routing kv)."""
    with ExitStack() as stack:
        ports = [free_port() for _ in range(3)]
        workers = [worker(stack, metrics_port=port) for port in ports]
        first = frontend(stack, workers, "--routing", "kv")
        second = frontend(stack, workers, "--routing", "kv")
        for fe in (first, second):
            fe.wait_for("frontend_kv_stream_live", lambda s: _live_streams(s) == 3, "three streams live")
        yield Fleet(workers, first, second, [f"http://127.0.0.1:{port}/metrics" for port in ports])


def _blocks(fe: Frontend) -> float:
    return sum(fe.samples("frontend_kv_index_blocks").values())


def test_a_shared_prefix_lands_where_it_is_cached_and_the_response_says_so(fleet: Fleet) -> None:
    fe = fleet.first
    before = _blocks(fe)
    first = fe.generate([*PREFIX, 1, 2, 3])
    assert first["meta_info"]["cached_tokens"] == 0
    # The engine's BlockStored events reach the frontend through its sidecar's stream.
    fe.wait_for("frontend_kv_index_blocks", lambda s: sum(s.values()) >= before + 64, "the prefix indexed")
    # The engine's batches carry its time: the sidecar that heard them and the frontend that
    # applied their deltas observed the events lag.
    lagged = fe.samples("frontend_kv_events_lag_seconds_count")
    assert sum(lagged.values()) > 0, lagged
    heard = [samples(url, "sidecar_kv_events_lag_seconds_count") for url in fleet.sidecar_metrics]
    assert sum(sum(each.values()) for each in heard) > 0, heard
    second = fe.generate([*PREFIX, 4, 5, 6])
    assert second["meta_info"]["cached_tokens"] == len(PREFIX)
    decisions = fe.samples("frontend_routing_decisions_total")
    assert decisions.get('{reason="affinity",role="agg"}', 0) >= 1, decisions
    predicted = sum(fe.samples("frontend_kv_predicted_cached_tokens_total").values())
    reported = sum(fe.samples("frontend_kv_reported_cached_tokens_total").values())
    assert predicted >= len(PREFIX)
    assert reported >= len(PREFIX)


def test_two_frontends_see_the_same_map(fleet: Fleet) -> None:
    first, second = fleet.first, fleet.second
    prefix = [p + 1 for p in PREFIX]  # a prefix neither has seen
    before = _blocks(second)
    assert first.generate([*prefix, 7])["meta_info"]["cached_tokens"] == 0
    second.wait_for("frontend_kv_index_blocks", lambda s: sum(s.values()) >= before + 64, "indexed there too")
    # Routed by the second frontend, which never sent that prefix anywhere.
    assert second.generate([*prefix, 8])["meta_info"]["cached_tokens"] == len(prefix)
    first.wait_for(
        "frontend_kv_index_blocks", lambda s: sum(s.values()) == _blocks(second), "both indexes alike"
    )


def test_an_engine_that_publishes_nothing_falls_back_and_nothing_breaks() -> None:
    with ExitStack() as stack:
        # One sidecar subscribed to an engine that never publishes, one not subscribed at all.
        workers = [worker(stack, publishes=False), worker(stack, publishes=False, subscribes=False)]
        fe = frontend(stack, workers)  # the default routing: kv where published, else approx
        first = fe.generate([*PREFIX, 1])
        assert first["meta_info"]["cached_tokens"] == 0
        # The frontend's own decision says where the prefix went: the next request follows it.
        second = fe.generate([*PREFIX, 2])
        assert second["meta_info"]["cached_tokens"] == len(PREFIX)
        streams = fe.samples("frontend_kv_stream_live")
        assert all('publishing="false"' in labels for labels in streams), streams
