"""A fleet on loopback and a client that replays a workload through it.

Per run: ``workers`` testkit vLLM engines with a paged prefix cache (blocks of ``block_size``,
``capacity_blocks`` each, a simulated prefill of ``prefill_us_per_token`` per uncached prompt
token, ``max_num_seqs`` requests generated at once, the rest queued), each publishing its KV
events on the real ZMQ wire; one ``sidecar-vllm`` per engine (subscribed to its events when
the sidecar has ``--kv-events-endpoint``); ``replicas`` frontends over all the sidecars with
``--routing <policy>`` (when the frontend has that flag; without it the frontend routes on
load, the one policy it has). Every run starts a fresh fleet, so every cache starts empty.

The client (this process, asyncio + aiohttp) sends SGLang-format ``/generate`` requests with
``input_ids`` (streamed), to the frontends in turn, at the workload's times; it records the
time to the first output token, the output ids, and the ``cached_tokens`` the engine reported
(``meta_info``). Requests per worker come from the frontends' own
``frontend_worker_request_duration_seconds_count`` (one count per finished Generate call).
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.kv_routing.workloads import Conversation, SharedRequest
from bench.plan import _script
from bench.procs import Proc, free_port, wait_grpc_ready, wait_http_ready
from bench.procstat import cpu_seconds

__all__ = ["Completed", "Fleet", "FleetSpec", "features", "run_multi_turn", "run_shared"]

STARTUP_S = 120.0
# Engine starts on fresh ports after a port taken between its pick and its bind.
PORT_ATTEMPTS = 3


@dataclass(frozen=True)
class FleetSpec:
    workers: int = 4
    block_size: int = 16
    capacity_blocks: int = 1024
    prefill_us_per_token: float = 8.0
    max_num_seqs: int = 2
    token_latency_ms: float = 2.0
    max_tokens: int = 16
    replicas: int = 1
    sidecar_events: bool = True  # subscribe the sidecars to their engines' KV events (if they can)


@dataclass
class Completed:
    sent_s: float  # from the run's start
    prompt: tuple[int, ...]
    output: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    ttft_s: float | None = None
    done_s: float | None = None
    error: str | None = None


@functools.cache
def _help(script: str, *args: str) -> str:
    try:
        done = subprocess.run([_script(script), *args, "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout + done.stderr


def features() -> dict[str, Any]:
    """What the installed commands offer: the frontend's routing policies (``load`` alone when
    it has no ``--routing``) and the sidecar's KV-event flags (None when it has none)."""
    frontend = _help("sidecar-frontend")
    match = re.search(r"--routing\s+\{([^}]*)\}", frontend)
    policies = match.group(1).split(",") if match else (["load"] if "--routing" not in frontend else [])
    if "--routing" in frontend and not policies:
        policies = ["kv", "approx", "load", "round-robin", "random"]
    sidecar = _help("sidecar-vllm")
    flags = re.findall(r"--kv-events-[a-z][a-z-]*", sidecar)
    return {
        "routing_flag": "--routing" in frontend,
        "policies": policies,
        "sidecar_kv_flags": sorted(set(flags)),
    }


class Fleet:
    def __init__(self, spec: FleetSpec, policy: str, tag: str) -> None:
        self.spec = spec
        self.policy = policy
        self.tag = tag
        self.procs: list[Proc] = []
        self.urls: list[str] = []
        self.metrics_urls: list[str] = []
        self.sidecars: list[str] = []

    def _start_engine(self, i: int) -> tuple[Proc, str, int, int]:
        """Engine ``i``, serving; started again on fresh ports when one it was given was taken
        by another process between the pick and the bind (a test run beside others)."""
        spec = self.spec
        for attempt in range(PORT_ATTEMPTS):
            addr = f"127.0.0.1:{free_port()}"
            pub, replay = free_port(), free_port()
            events = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{pub}",
                "replay_endpoint": f"tcp://*:{replay}",
            }
            argv = [
                _script("testkit-engine"), "vllm", "--listen", addr,
                "--block-size", str(spec.block_size),
                "--num-gpu-blocks-override", str(spec.capacity_blocks),
                "--prefill-us-per-token", f"{spec.prefill_us_per_token:g}",
                "--max-num-seqs", str(spec.max_num_seqs),
                "--token-latency-ms", f"{spec.token_latency_ms:g}",
                # One token a chunk, as vLLM streams each step: a chunk of the whole answer
                # would hold the first token back for the answer's decode (8 ms here).
                "--chunk-tokens", "1",
                "--kv-events-config", json.dumps(events),
            ]  # fmt: skip
            proc = Proc(f"kv-{self.tag}-engine{i}", argv, None).start()
            try:
                wait_grpc_ready(proc, addr, STARTUP_S)
            except RuntimeError as err:
                proc.stop()
                if "Address already in use" in str(err) and attempt + 1 < PORT_ATTEMPTS:
                    continue
                raise
            self.procs.append(proc)
            return proc, addr, pub, replay
        raise AssertionError("unreachable: the last attempt raises")

    def start(self) -> None:
        spec, feats = self.spec, features()
        engines: list[tuple[Proc, str, int, int]] = []
        for i in range(spec.workers):
            engines.append(self._start_engine(i))
        sidecars: list[tuple[Proc, str]] = []
        kv_flags = feats["sidecar_kv_flags"]
        for i, (_, engine_addr, pub, replay) in enumerate(engines):
            listen = f"127.0.0.1:{free_port()}"
            argv = [_script("sidecar-vllm"), "--grpc-endpoint", engine_addr, "--listen", listen]
            if spec.sidecar_events and "--kv-events-endpoint" in kv_flags:
                argv += ["--kv-events-endpoint", f"tcp://127.0.0.1:{pub}"]
                replay_flag = next((f for f in kv_flags if "replay" in f), None)
                if replay_flag is not None:
                    argv += [replay_flag, f"tcp://127.0.0.1:{replay}"]
            argv += ["--log-level", "warning"]
            proc = Proc(f"kv-{self.tag}-sidecar{i}", argv, None).start()
            self.procs.append(proc)
            sidecars.append((proc, listen))
        for proc, listen in sidecars:
            wait_grpc_ready(proc, listen, STARTUP_S)
            self.sidecars.append(listen)
        for r in range(spec.replicas):
            port, metrics_port = free_port(), free_port()
            argv = [_script("sidecar-frontend"), "--listen", f"127.0.0.1:{port}", "--format", "sglang"]
            for listen in self.sidecars:
                argv += ["--worker", listen]
            argv += [
                "--metrics-port",
                str(metrics_port),
                "--log-level",
                "warning",
                "--request-timeout-secs",
                "0",
            ]
            if feats["routing_flag"]:
                argv += ["--routing", self.policy]
            elif self.policy != "load":
                raise RuntimeError(f"the frontend has no --routing: policy {self.policy!r} unavailable")
            proc = Proc(f"kv-{self.tag}-frontend{r}", argv, None).start()
            self.procs.append(proc)
            url = f"http://127.0.0.1:{port}"
            wait_http_ready(proc, url + "/health", STARTUP_S)
            self.urls.append(url)
            self.metrics_urls.append(f"http://127.0.0.1:{metrics_port}/metrics")

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time used so far by the engines, the sidecars and the frontends (each role's sum)."""
        roles: dict[str, float] = {}
        for proc in self.procs:
            role = re.sub(r"^kv-.*-(engine|sidecar|frontend)\d+$", r"\1", proc.name)
            roles[role] = roles.get(role, 0.0) + cpu_seconds(proc.pid)
        return {role: round(value, 2) for role, value in roles.items()}

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()

    def __enter__(self) -> Fleet:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


_COUNT = re.compile(
    r'^frontend_worker_request_duration_seconds_count\{worker="([^"]+)"\}\s+([0-9.e+]+)', re.M
)


async def requests_per_worker(session: aiohttp.ClientSession, metrics_urls: Sequence[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for url in metrics_urls:
        async with session.get(url) as resp:
            text = await resp.text()
        for worker, value in _COUNT.findall(text):
            counts[worker] = counts.get(worker, 0) + int(float(value))
    return counts


async def _generate(
    session: aiohttp.ClientSession, url: str, prompt: tuple[int, ...], max_tokens: int, t0: float
) -> Completed:
    body = {
        "input_ids": list(prompt),
        "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True, "temperature": 0},
        "stream": True,
    }
    clock = time.perf_counter
    sent = clock()
    done = Completed(sent - t0, prompt)
    try:
        async with session.post(url + "/generate", json=body) as resp:
            if resp.status != 200:
                done.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return done
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                ids = event.get("output_ids") or []
                if ids and done.ttft_s is None:
                    done.ttft_s = clock() - sent
                done.output = list(ids)  # cumulative: the whole output so far
                meta = event.get("meta_info") or {}
                if "cached_tokens" in meta:
                    done.cached_tokens = int(meta["cached_tokens"] or 0)
                if "error" in event:
                    done.error = str(event["error"])[:200]
    except (TimeoutError, aiohttp.ClientError, ValueError) as err:
        done.error = f"{type(err).__name__}: {err}"
    done.done_s = clock() - t0
    return done


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=300)
    )


async def run_shared(
    fleet: Fleet, requests: Sequence[SharedRequest]
) -> tuple[list[Completed], dict[str, int], float]:
    """Send every request at its time; (completions in send order, requests per worker, the
    run's wall time)."""
    async with _session() as session:
        t0 = time.perf_counter()

        async def one(i: int, req: SharedRequest) -> Completed:
            await asyncio.sleep(max(0.0, req.arrival_s - (time.perf_counter() - t0)))
            url = fleet.urls[i % len(fleet.urls)]
            return await _generate(session, url, req.token_ids, fleet.spec.max_tokens, t0)

        done = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        wall = time.perf_counter() - t0
        counts = await requests_per_worker(session, fleet.metrics_urls)
    return sorted(done, key=lambda c: c.sent_s), counts, wall


async def run_multi_turn(
    fleet: Fleet, conversations: Sequence[Conversation]
) -> tuple[list[Completed], dict[str, int], float]:
    """Each conversation from its start time, one turn after the other: a turn's prompt is the
    previous prompt, the engine's answer, and the next user message."""
    async with _session() as session:
        t0 = time.perf_counter()
        sent = 0

        async def talk(conv: Conversation) -> list[Completed]:
            nonlocal sent
            await asyncio.sleep(max(0.0, conv.start_s - (time.perf_counter() - t0)))
            history: tuple[int, ...] = conv.system
            turns: list[Completed] = []
            for user in conv.user_messages:
                prompt = history + user
                url = fleet.urls[sent % len(fleet.urls)]
                sent += 1
                done = await _generate(session, url, prompt, fleet.spec.max_tokens, t0)
                turns.append(done)
                if done.error is not None:
                    break
                history = prompt + tuple(done.output)
            return turns

        talks = await asyncio.gather(*(talk(c) for c in conversations))
        wall = time.perf_counter() - t0
        counts = await requests_per_worker(session, fleet.metrics_urls)
    return sorted((c for t in talks for c in t), key=lambda c: c.sent_s), counts, wall
