"""The testkit SGLang engine: one scheduler on the CPU behind SGLang's two native wires.

``SglangTestEngine`` owns the request lifecycle (admission through ``Book``, deterministic
tokens from ``generator``, faults from ``FaultBook``, aborts by rid prefix) and renders each
request as SGLang's tokenizer manager does: a list of plain-JSON "out" dicts
``{text, output_ids, meta_info}``, cumulative unless ``incremental``. The wire modules
(``sglang_grpc``, ``sglang_http``) only frame those dicts; everything they must agree on
lives here so the two wires cannot drift apart.

Behaviour copied in spirit (not code) from SGLang 0.5.23, with the choices the spec leaves
open noted where they are made.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time
import uuid
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from testkit.book import Book, Outcome
from testkit.faults import FaultBook, FaultKind, FaultPlan, parse_fault_flag
from testkit.generator import GeneratedToken, Generator, ModelSpec
from testkit.sglang_core import (
    DEFAULT_MAX_NEW_TOKENS,
    SGLANG_VERSION,
    AbortRecord,
    Bootstrap,
    Chunk,
    Closed,
    Cut,
    Fail,
    NativeRequest,
    Now,
    RequestRejected,
    RequestState,
    RequestStream,
    StreamEvent,
    abort_out,
    bad_request_reason,
    sampling_spec,
    verify_sampling,
)

# The wire-neutral names are re-exported: the wires and the tests import them from here.
__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "SGLANG_VERSION",
    "AbortRecord",
    "Bootstrap",
    "Chunk",
    "Closed",
    "Cut",
    "Fail",
    "NativeRequest",
    "RequestRejected",
    "RequestStream",
    "SglangEngineConfig",
    "SglangTestEngine",
    "StreamEvent",
    "add_arguments",
    "config_from_args",
    "run",
]

log = logging.getLogger("testkit.sglang")
DISAGG_MODES = ("null", "prefill", "decode")


@dataclass(frozen=True)
class SglangEngineConfig:
    grpc_host: str = "127.0.0.1"
    grpc_port: int | None = 0  # None: do not serve gRPC
    http_host: str = "127.0.0.1"
    http_port: int | None = 0  # None: do not serve HTTP
    incremental: bool = False
    model_path: str = "testkit/tiny-sglang"
    served_model_name: str | None = None  # None: the model path, as SGLang does
    eos_token_id: int = 2
    vocab_size: int = 32000
    context_length: int = 4096
    # SGLang's server info reports the --context-length launch flag, null when not given.
    context_length_flag: int | None = None
    kv_capacity_tokens: int = 1 << 20  # max_total_num_tokens
    page_size: int = 1
    max_running_requests: int = 256
    dp_size: int = 1
    token_latency_ms: float = 0.0
    chunk_tokens: int = 1  # SGLang's --stream-interval
    startup_delay_secs: float = 0.0
    disaggregation_mode: str = "null"
    bootstrap_port: int = 8998
    # SGLang aborts a request whose HTTP client left ~2 s later (a background task).
    disconnect_abort_delay_secs: float = 2.0
    # With one tokenizer worker SGLang ignores an HTTP abort whose rid names no live request
    # (so a bare prefix aborts nothing); with more it forwards it and the scheduler matches
    # every rid that starts with it.
    tokenizer_workers: int = 1

    def __post_init__(self) -> None:
        if self.disaggregation_mode not in DISAGG_MODES:
            raise ValueError(f"disaggregation_mode must be one of {DISAGG_MODES}")
        if self.chunk_tokens < 1 or self.max_running_requests < 1 or self.dp_size < 1:
            raise ValueError("chunk_tokens, max_running_requests and dp_size must be >= 1")
        if self.token_latency_ms < 0 or self.startup_delay_secs < 0 or self.disconnect_abort_delay_secs < 0:
            raise ValueError("latencies and delays must be >= 0")
        if self.context_length < 2 or self.kv_capacity_tokens < 1 or self.page_size < 1:
            raise ValueError("context_length, kv_capacity_tokens and page_size must be positive")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path


class _Server(Protocol):
    port: int

    async def start(self) -> None: ...
    async def stop(self) -> None: ...


@dataclass
class _Live:
    """The engine's handle on one request: its rendering state plus what drives it."""

    state: RequestState
    stream: RequestStream
    plan: FaultPlan | None
    abort_evt: asyncio.Event = field(default_factory=asyncio.Event)
    abort_message: str = "Aborted"

    @property
    def request(self) -> NativeRequest:
        return self.state.request


def _now() -> Now:
    return Now(time.time(), time.perf_counter())


class SglangTestEngine:
    """Both SGLang wires over one deterministic scheduler. Lives on one event loop."""

    def __init__(self, config: SglangEngineConfig | None = None) -> None:
        self.config = config or SglangEngineConfig()
        self.book = Book(
            max_running=self.config.max_running_requests, kv_capacity=self.config.kv_capacity_tokens
        )
        self.faults = FaultBook()
        self.model = ModelSpec(
            vocab_size=self.config.vocab_size,
            eos_token_ids=(self.config.eos_token_id,),
            context_length=self.config.context_length,
        )
        self.bootstraps: dict[str, Bootstrap] = {}  # every disaggregated request's triple
        self.abort_log: list[AbortRecord] = []
        self.grpc_port = 0
        self.http_port = 0
        self._live: dict[str, _Live] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._servers: list[_Server] = []
        self._ready = asyncio.Event()
        self._started_at = 0.0
        self._prefix_cache: deque[tuple[int, ...]] = deque(maxlen=256)

    @property
    def task_count(self) -> int:
        """Tasks the engine still owns (requests, delayed aborts); 0 after ``stop``."""
        return len(self._tasks)

    # -- lifecycle ------------------------------------------------------------------------
    async def __aenter__(self) -> SglangTestEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def grpc_target(self) -> str:
        return f"{self.config.grpc_host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.config.http_host}:{self.http_port}"

    async def start(self) -> tuple[int, int]:
        """Bind the wires (port 0 picks free ports) and return (gRPC port, HTTP port), 0 for a
        wire not served; the engine is ready after ``startup_delay_secs``."""
        from testkit.sglang_grpc import SglangGrpcServer
        from testkit.sglang_http import SglangHttpServer

        cfg = self.config
        self._ready = asyncio.Event()
        self._started_at = time.time()
        self._prefix_cache.clear()  # a (re)started engine has a cold cache
        servers: list[_Server] = []
        try:
            if cfg.grpc_port is not None:
                g = SglangGrpcServer(self, cfg.grpc_host, self.grpc_port or cfg.grpc_port)
                await g.start()
                servers.append(g)
                self.grpc_port = g.port
            if cfg.http_port is not None:
                h = SglangHttpServer(self, cfg.http_host, self.http_port or cfg.http_port)
                await h.start()
                servers.append(h)
                self.http_port = h.port
        except BaseException:
            for s in reversed(servers):
                await s.stop()
            raise
        self._servers = servers
        if cfg.startup_delay_secs > 0:
            self.spawn(self._become_ready(cfg.startup_delay_secs))
        else:
            self._ready.set()
        return self.grpc_port, self.http_port

    async def _become_ready(self, delay: float) -> None:
        await asyncio.sleep(delay)
        self._ready.set()

    async def wait_ready(self, timeout: float | None) -> None:
        """Until the startup delay has passed; ``None`` waits as long as the caller's task lives."""
        if timeout is None:
            await self._ready.wait()
        else:
            await asyncio.wait_for(self._ready.wait(), timeout)

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    async def stop(self) -> None:
        """Stop both wires and every request; nothing keeps running afterwards."""
        servers, self._servers = self._servers, []
        for s in reversed(servers):
            await s.stop()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._ready = asyncio.Event()

    async def kill(self) -> None:
        """Engine-wide fault: die now. Streams break mid-way, then connections are refused."""
        await self.stop()

    async def restart(self, startup_delay_secs: float | None = None) -> tuple[int, int]:
        """Engine-wide fault: die, then come back on the same ports (same book)."""
        await self.kill()
        if startup_delay_secs is not None:
            self.config = replace(self.config, startup_delay_secs=startup_delay_secs)
        return await self.start()

    def spawn(self, coro: Awaitable[None]) -> asyncio.Task[None]:
        """Run a task the engine owns: ``stop`` cancels and awaits it."""

        async def _run() -> None:
            await coro

        task = asyncio.get_running_loop().create_task(_run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- requests -------------------------------------------------------------------------
    def is_live(self, rid: str) -> bool:
        return rid in self._live

    def live_ids(self) -> list[str]:
        return list(self._live)

    def new_rid(self) -> str:
        return str(uuid.uuid4())

    def submit(self, req: NativeRequest) -> RequestStream:
        """Validate and start one request; RequestRejected if SGLang would refuse it."""
        try:
            return self._submit(req)
        except RequestRejected as e:
            self.book.refused(req.rid, Outcome.ERROR, e.message)
            raise
        except Exception as e:
            # SGLang's tokenizer manager fails such a request alone (gRPC INTERNAL, HTTP 400).
            log.exception("testkit sglang: request %s refused", req.rid)
            self.book.refused(req.rid, Outcome.ERROR, str(e))
            raise RequestRejected(f"{type(e).__name__}: {e}") from e

    def _submit(self, req: NativeRequest) -> RequestStream:
        if not self.ready:
            raise RequestRejected("The server is starting up", http_status=503, grpc_code="UNAVAILABLE")
        plan = self.faults.plan_for(req.rid)
        if plan is not None and plan.kind is FaultKind.FAIL_OPEN:
            raise RequestRejected(
                plan.message or "testkit fault: fail_open", http_status=503, grpc_code="UNAVAILABLE"
            )
        if req.rid in self._live:
            raise RequestRejected(f"Duplicate request ID detected: {req.rid}")
        req, refusal = self._validate(req)
        stream = RequestStream(req)
        if refusal is not None:
            if not req.stream:
                # The tokenizer manager turns a 400 abort of a non-streaming request into a raise.
                raise RequestRejected(refusal)
            stream.put(Chunk(abort_out(req.rid, bad_request_reason(refusal), 0.0), True))
            stream.put(None)
            self.book.refused(req.rid, Outcome.ERROR, refusal)
            return stream
        state = RequestState(req, self.model, self.config.incremental, time.perf_counter())
        live = _Live(state, stream, plan)
        self._live[req.rid] = live
        if req.bootstrap is not None:
            self.bootstraps[req.rid] = req.bootstrap
        self.spawn(self._produce(live))
        return stream

    def _validate(self, req: NativeRequest) -> tuple[NativeRequest, str | None]:
        """SGLang's checks in its order. The tokenizer manager's raise (RequestRejected: gRPC
        INTERNAL, HTTP 400); the scheduler's are returned as a message: the request is
        accepted and ends at once with an ``abort`` finish of status 400."""
        cfg = self.config
        ctx = cfg.context_length
        n_in = len(req.input_ids)
        if n_in == 0:
            raise RequestRejected("The input_ids is empty; at least one token is required.")
        bad = [t for t in req.input_ids if t < 0 or t >= cfg.vocab_size]
        if bad:
            raise RequestRejected(
                f"The input_ids {bad[:4]} are outside the vocabulary [0, {cfg.vocab_size})."
            )
        dp = cfg.dp_size
        rank = req.routed_dp_rank
        if rank is not None and not (dp <= 1 and rank == 0) and not 0 <= rank < dp:
            raise RequestRejected(f"routed_dp_rank={rank} out of range [0, {dp})")
        if n_in >= ctx:
            raise RequestRejected(
                f"The input ({n_in} tokens) is longer than the model's context length ({ctx} tokens)."
            )
        max_new = DEFAULT_MAX_NEW_TOKENS if req.max_new_tokens is None else req.max_new_tokens
        if n_in + max_new > ctx and cfg.disaggregation_mode != "prefill":
            raise RequestRejected(
                f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
                f"You requested a total of {n_in + max_new} tokens: {n_in} tokens from the input "
                f"messages and {max_new} tokens for the completion. Please reduce the number of tokens "
                "in the input messages or the completion to fit within the limit."
            )
        verify_sampling(req, None if cfg.disaggregation_mode == "prefill" else max_new)
        if req.n != 1:
            raise RequestRejected("The testkit SGLang engine serves n=1 only.")
        if req.return_logprob and not 0 <= req.top_logprobs_num <= cfg.vocab_size:
            # SGLang has no check (its top-k over the vocabulary fails inside the scheduler);
            # the testkit refuses rather than compute an impossible top-N.
            raise RequestRejected(
                f"top_logprobs_num={req.top_logprobs_num} out of range [0, {cfg.vocab_size}] (testkit)"
            )
        if cfg.disaggregation_mode == "prefill":
            # The prefill server computes the KV cache and the first token only.
            req = replace(req, max_new_tokens=1, min_new_tokens=0)
        else:
            req = replace(req, max_new_tokens=max_new)
        return req, self._scheduler_refusal(req)

    def _scheduler_refusal(self, req: NativeRequest) -> str | None:
        cfg = self.config
        n_in = len(req.input_ids)
        if cfg.disaggregation_mode != "null" and req.bootstrap is None:
            return (
                "Invalid request: Disaggregated request received without bootstrap room id. "
                f"req.rid={req.rid!r}"
            )
        max_input = min(cfg.context_length, cfg.kv_capacity_tokens) - 1
        if n_in >= max_input:
            return (
                f"Input length ({n_in} tokens) exceeds the maximum allowed length ({max_input} tokens). "
                "Use a shorter input or enable --allow-auto-truncate."
            )
        if req.return_logprob and req.logprob_start_len > n_in:
            return (
                f"req.logprob_start_len={req.logprob_start_len} is higher than the number of input tokens "
                f"len(req.origin_input_ids)={n_in}. Please use a smaller logprob_start_len."
            )
        return None

    def abort(self, rid: str, abort_all: bool = False, *, source: str) -> list[str]:
        """The scheduler's abort: every live rid starting with ``rid`` (or all). Returns them."""
        if abort_all:
            matched = list(self._live)
        elif not rid:
            matched = []  # an empty prefix would match everything: SGLang ignores it
        else:
            matched = [r for r in self._live if r.startswith(rid)]
        self.abort_log.append(AbortRecord(rid, abort_all, source, tuple(matched)))
        if source in ("grpc", "http"):
            self.book.record_aborts([rid] if not abort_all else matched)
        for r in matched:
            live = self._live[r]
            if not self.book.abort_waiting(r):
                live.abort_evt.set()
        return matched

    def note_ignored_abort(self, rid: str, *, source: str) -> None:
        """An abort a wire received but did not forward (no such live rid): still on record."""
        self.abort_log.append(AbortRecord(rid, False, source, ()))
        self.book.record_aborts([rid])

    def abort_later(self, rid: str, delay: float, *, source: str) -> None:
        """As SGLang's background task: abort ``rid`` after ``delay`` if it still runs."""

        async def _later() -> None:
            await asyncio.sleep(delay)
            if rid in self._live:
                self.abort(rid, source=source)

        self.spawn(_later())

    # -- the scheduler loop for one request ---------------------------------------------
    async def _wait_abort(self, live: _Live, secs: float) -> bool:
        """Sleep ``secs`` (at least one loop turn); True when aborted meanwhile."""
        if secs <= 0:
            await asyncio.sleep(0)
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(live.abort_evt.wait(), secs)
        return live.abort_evt.is_set()

    async def _produce(self, live: _Live) -> None:
        req, stream = live.request, live.stream
        outcome, detail, send_end = Outcome.FINISHED, "", True
        try:
            outcome, send_end = await self._run(live)
        except asyncio.CancelledError:
            outcome, detail = Outcome.ERROR, "engine stopped"
            raise
        except Exception as e:
            # As SGLang's gRPC bridge: an error while generating ends that request's stream
            # with the error (gRPC INTERNAL, an HTTP error event); the engine and every other
            # request carry on, and nothing of this one stays in the book.
            log.exception("testkit sglang: request %s failed", req.rid)
            outcome, detail = Outcome.ERROR, f"{type(e).__name__}: {e}"
            stream.put(Fail("INTERNAL", detail))
        finally:
            self.book.release(req.rid, outcome, detail)
            self._live.pop(req.rid, None)
            if send_end:
                stream.put(None)

    async def _run(self, live: _Live) -> tuple[Outcome, bool]:
        """One request from admission to its end: (outcome, whether its stream ends)."""
        req, plan, stream, state = live.request, live.plan, live.stream, live.state
        if not await self.book.admit(req.rid, len(req.input_ids)):
            reason = {"type": "abort", "message": "Abort in waiting queue"}
            stream.put(Chunk(abort_out(req.rid, reason, time.perf_counter() - state.started), True))
            return Outcome.ABORTED, True
        state.cached = self._prefix_lookup(req.input_ids)
        if plan is not None and plan.kind is FaultKind.STALL_FIRST_TOKEN:
            await self._wait_abort(live, plan.stall_secs)
        fault_at = None
        if plan is not None and plan.kind in (FaultKind.CLOSE_AFTER, FaultKind.ERROR_AFTER, FaultKind.HANG):
            fault_at = plan.after
        gen = Generator(self.model, req.input_ids, sampling_spec(req))
        latency = self.config.token_latency_ms / 1000.0
        finished: GeneratedToken | None = None
        while True:
            if len(state.ids) == fault_at and plan is not None:
                self._flush(live)
                return await self._apply_fault(live, plan)
            if live.abort_evt.is_set() or (latency > 0 and await self._wait_abort(live, latency)):
                if state.ids and not gen.done:
                    # SGLang marks a decoding request to finish and still runs the decode step
                    # already scheduled: its token rides on the abort.
                    state.take(gen.step())
                stream.put(state.abort_chunk(live.abort_message, _now()))
                return Outcome.ABORTED, True
            if gen.limit <= 0 or gen.done:
                break
            tok = gen.step()
            state.take(tok)
            self.book.set_tokens(req.rid, len(req.input_ids) + len(state.ids))
            if tok.finish is not None:
                finished = tok
                break
            if state.unsent >= self.config.chunk_tokens:
                self._flush(live)
                if latency <= 0:
                    await asyncio.sleep(0)  # let aborts and other requests in
        chunks, outcome = state.finish(finished, plan, _now())
        for chunk in chunks:
            stream.put(chunk)
        return outcome, True

    def _flush(self, live: _Live) -> None:
        chunk = live.state.flush(_now())
        if chunk is not None:
            live.stream.put(chunk)

    async def _apply_fault(self, live: _Live, plan: FaultPlan) -> tuple[Outcome, bool]:
        if plan.kind is FaultKind.CLOSE_AFTER:
            live.stream.put(Cut())
            return Outcome.FAULTED, True
        if plan.kind is FaultKind.ERROR_AFTER:
            live.stream.put(Fail(plan.code, plan.error_message))
            return Outcome.FAULTED, True
        # HANG: send nothing more and keep the stream open; only an abort frees the slot.
        await live.abort_evt.wait()
        return Outcome.ABORTED, False

    def _prefix_lookup(self, prompt: tuple[int, ...]) -> int:
        """A radix cache in miniature: whole pages shared with an earlier prompt are cached.

        The last prompt token is always computed (its logits make the first output token).
        """
        best = 0
        for seen in self._prefix_cache:
            n = 0
            for a, b in zip(seen, prompt, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        self._prefix_cache.append(prompt)
        page = self.config.page_size
        return min(best // page * page, len(prompt) - 1)

    # -- what the info endpoints report -------------------------------------------------
    def server_info(self, *, http: bool) -> dict[str, Any]:
        cfg = self.config
        info: dict[str, Any] = {
            "model_path": cfg.model_path,
            "tokenizer_path": cfg.model_path,
            "served_model_name": cfg.model_name,
            "skip_tokenizer_init": False,
            "host": cfg.http_host,
            "port": self.http_port,
            "grpc_port": self.grpc_port or None,
            "context_length": cfg.context_length_flag,
            "page_size": cfg.page_size,
            "max_running_requests": cfg.max_running_requests,
            "max_total_tokens": None,
            "dp_size": cfg.dp_size,
            "tp_size": 1,
            "pp_size": 1,
            "stream_interval": cfg.chunk_tokens,
            "incremental_streaming_output": cfg.incremental,
            "tokenizer_worker_num": cfg.tokenizer_workers,
            "disaggregation_mode": cfg.disaggregation_mode,
            "disaggregation_bootstrap_port": cfg.bootstrap_port,
            "device": "cpu",
            "launch_command": "testkit-engine sglang",
            "status": "ready",
            "max_total_num_tokens": cfg.kv_capacity_tokens,
            "max_req_input_len": min(cfg.context_length, cfg.kv_capacity_tokens) - 1,
            "kv_events": None,
        }
        if http:
            info.update(
                startup_time=self._started_at,
                internal_states=[{"last_gen_throughput": 0.0}],
                version=SGLANG_VERSION,
                frontend="python",
            )
        else:
            info["grpc_features"] = []
        return info

    def model_info(self, *, http: bool) -> dict[str, Any]:
        cfg = self.config
        info: dict[str, Any] = {
            "model_path": cfg.model_path,
            "served_model_name": cfg.model_name,
            "tokenizer_path": cfg.model_path,
            "is_generation": True,
            "weight_version": "default",
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": cfg.disaggregation_mode,
            "model_type": "testkit",
            "architectures": ["TestkitForCausalLM"],
        }
        if http:
            info.update(
                preferred_sampling_params=None, has_image_understanding=False, has_audio_understanding=False
            )
        return info

    def loads(self, dp_rank: int | None = None) -> list[dict[str, Any]]:
        if dp_rank is not None and not 0 <= dp_rank < self.config.dp_size:
            return []
        used = self.book.used_tokens()
        total = self.config.kv_capacity_tokens
        running = self.book.running_count
        waiting_tokens = 0
        rows = []
        for rank in range(self.config.dp_size):
            if dp_rank is not None and rank != dp_rank:
                continue
            mine = rank == 0  # one scheduler does the work; other ranks idle
            rows.append(
                {
                    "timestamp": time.time(),
                    "dp_rank": rank,
                    "num_running_reqs": running if mine else 0,
                    "num_waiting_reqs": self.book.waiting_count if mine else 0,
                    "num_waiting_uncached_tokens": waiting_tokens,
                    "num_used_tokens": used if mine else 0,
                    "num_total_tokens": used if mine else 0,
                    "num_active_tokens": used if mine else 0,
                    "num_prealloc_ready_tokens": 0,
                    "max_total_num_tokens": total,
                    "max_running_requests": self.config.max_running_requests,
                    "token_usage": round(used / total, 4) if mine else 0.0,
                    "gen_throughput": 0.0,
                    "cache_hit_rate": 0.0,
                    "utilization": round(running / self.config.max_running_requests, 4) if mine else 0.0,
                    "total_prefill_uncached_tokens": 0,
                    "total_prefill_busy_us": 0,
                    "decode_moments": None,
                }
            )
        return rows


# -- the console entry (testkit-engine sglang ...) -------------------------------------------
def _listen(text: str) -> tuple[str, int] | None:
    if text.lower() in ("off", "none", ""):
        return None
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def _fault(text: str) -> tuple[str, FaultPlan]:
    try:
        return parse_fault_flag(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``testkit-engine sglang``."""
    d = SglangEngineConfig()
    a = parser.add_argument
    a("--grpc-listen", type=_listen, default=("127.0.0.1", 30001), help="HOST:PORT or 'off'")
    a("--http-listen", type=_listen, default=("127.0.0.1", 30000), help="HOST:PORT or 'off'")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--incremental", dest="incremental", action="store_true", default=False,
                      help="stream deltas (SGLang's --incremental-streaming-output)")  # fmt: skip
    mode.add_argument("--cumulative", dest="incremental", action="store_false",
                      help="stream cumulative output_ids and text (SGLang's default)")  # fmt: skip
    a("--model-path", default=d.model_path)
    a("--served-model-name", default=None, help="default: the model path")
    a("--eos-token-id", type=int, default=d.eos_token_id)
    a("--vocab-size", type=int, default=d.vocab_size)
    a("--context-length", type=int, default=None,
      help=f"default {d.context_length}; server info reports it only when given")  # fmt: skip
    a("--kv-capacity-tokens", type=int, default=d.kv_capacity_tokens, help="max_total_num_tokens")
    a("--page-size", type=int, default=d.page_size)
    a("--max-running-requests", type=int, default=d.max_running_requests)
    a("--dp-size", type=int, default=d.dp_size)
    a("--token-latency-ms", type=float, default=d.token_latency_ms)
    a("--chunk-tokens", type=int, default=d.chunk_tokens, help="tokens per streamed chunk")
    a("--startup-delay-secs", type=float, default=d.startup_delay_secs)
    a("--disaggregation-mode", choices=DISAGG_MODES, default=d.disaggregation_mode)
    a("--disaggregation-bootstrap-port", "--bootstrap-port", dest="bootstrap_port", type=int,
      default=d.bootstrap_port)  # fmt: skip
    a("--disconnect-abort-delay-secs", type=float, default=d.disconnect_abort_delay_secs)
    a("--tokenizer-workers", type=int, default=d.tokenizer_workers)
    a("--fault", type=_fault, action="append", default=[], metavar="MATCH=KIND[:ARG]...",
      help="install a fault plan for request ids containing MATCH (repeatable)")  # fmt: skip


def config_from_args(args: argparse.Namespace) -> SglangEngineConfig:
    grpc_l: tuple[str, int] | None = args.grpc_listen
    http_l: tuple[str, int] | None = args.http_listen
    d = SglangEngineConfig()
    return SglangEngineConfig(
        grpc_host=grpc_l[0] if grpc_l else d.grpc_host,
        grpc_port=grpc_l[1] if grpc_l else None,
        http_host=http_l[0] if http_l else d.http_host,
        http_port=http_l[1] if http_l else None,
        incremental=args.incremental,
        model_path=args.model_path,
        served_model_name=args.served_model_name,
        eos_token_id=args.eos_token_id,
        vocab_size=args.vocab_size,
        context_length=args.context_length or d.context_length,
        context_length_flag=args.context_length,
        kv_capacity_tokens=args.kv_capacity_tokens,
        page_size=args.page_size,
        max_running_requests=args.max_running_requests,
        dp_size=args.dp_size,
        token_latency_ms=args.token_latency_ms,
        chunk_tokens=args.chunk_tokens,
        startup_delay_secs=args.startup_delay_secs,
        disaggregation_mode=args.disaggregation_mode,
        bootstrap_port=args.bootstrap_port,
        disconnect_abort_delay_secs=args.disconnect_abort_delay_secs,
        tokenizer_workers=args.tokenizer_workers,
    )


async def _serve(config: SglangEngineConfig, faults: list[tuple[str, FaultPlan]]) -> int:
    log = logging.getLogger("testkit.sglang")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    engine = SglangTestEngine(config)
    for match, plan in faults:
        engine.faults.add(match, plan)
    try:
        await engine.start()
        where = f"grpc={config.grpc_host}:{engine.grpc_port} http={config.http_host}:{engine.http_port}"
        log.info("testkit-engine sglang listening %s", where)
        ready = asyncio.ensure_future(engine.wait_ready(None))
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({ready, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if ready.done() and not ready.cancelled() and ready.exception() is None:
                log.info("testkit-engine sglang ready %s", where)
            await stopping
        finally:
            for fut in (ready, stopping):
                fut.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await fut
    finally:
        await engine.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    log.info("testkit-engine sglang stopped")
    return 0


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; exit 0."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"testkit-engine sglang: {e}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_serve(config, list(args.fault)))
    except OSError as e:
        logging.getLogger("testkit.sglang").error("testkit-engine sglang: %s", e)
        return 1
