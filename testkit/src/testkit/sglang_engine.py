"""The testkit SGLang engine: one scheduler on the CPU behind SGLang's two native wires.

``SglangTestEngine`` is the facade the wires and the tests use. It owns the lifecycle (both
servers, the ready delay, kill/restart), admission through ``Book``, SGLang's request checks
in their order, aborts by rid prefix, and one scheduler task per request that drives the
deterministic ``generator`` and the test's fault plan. Rendering each request as SGLang's
tokenizer manager does lives in ``sglang_core`` (shared by both wires, pure), the info JSON and
the configuration in ``sglang_info``, the console entry in ``sglang_cli``; the wire modules
(``sglang_grpc``, ``sglang_http``) only frame.

Behaviour copied in spirit (not code) from SGLang 0.5.23, with the choices the spec leaves
open noted where they are made.

Scheduler death (``scheduler_dies()``, or the ``engine_dies`` fault after k tokens): in SGLang a
scheduler that raises signals its parent at once, and a watchdog polling every second notices
one that crashed; the parent then kills its whole process tree, HTTP and gRPC servers included.
Here every request stalls where it is and, ``SCHEDULER_DEATH_EXIT_SECS`` later, both wires go
away as in ``kill()`` (the testkit process itself stays up).

Pause, continue and weight updates (SGLang 0.5.23's ``tokenizer_manager.pause_generation`` /
``continue_generation`` / ``update_weights_from_disk``, ``scheduler.pause_generation``):

* Every pause holds new requests before the scheduler (the tokenizer manager's pause
  condition), as a weight update from disk on an unpaused engine does (its model-update
  lock, which waits for the requests in flight first). A held request is not on the
  scheduler: an abort does not reach it (SGLang's scheduler does not know it), its client
  leaving drops it. The testkit checks a request before holding it (SGLang checks it after),
  so a request SGLang would refuse on continue is refused at once.
* ``abort``: everything on the scheduler is aborted (as ``/abort_request`` with abort_all),
  and the pause returns once none is left. ``in_place``: the scheduler stops between steps;
  its requests keep their KV and resume on continue (a request aborted meanwhile ends on
  continue, its pending step's token riding on the abort). ``retract``: the scheduler stops
  and its running requests go back to the waiting queue with their output, their KV released
  (``num_retractions`` counts it); on continue each is prefilled again (prompt and output so
  far) and goes on; one aborted meanwhile answers at once from the waiting queue.
* Versions (``testkit.weight_versions``): the scheduler's labels the tokens, the tokenizer
  manager's is reported; a change records itself on every request on the scheduler that has
  output, so a final output's ``weight_versions`` spans say which version made which tokens.
  The generator does not depend on the version: a version labels tokens, it does not change them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from sidecar_common.endpoint import format_host_port
from testkit.book import Book, Outcome
from testkit.faults import KV_EVENT_FAULTS, FaultBook, FaultKind, FaultPlan
from testkit.generator import GeneratedToken, Generator, ModelSpec
from testkit.kv_publisher import EngineKvCache
from testkit.pacing import decode_step_secs
from testkit.prefix_cache import NO_EXTRA, BlockExtra
from testkit.sglang_checks import check_request
from testkit.sglang_core import (
    PAUSE_MODES,
    AbortRecord,
    Bootstrap,
    Chunk,
    Cut,
    Fail,
    NativeRequest,
    Now,
    RequestRejected,
    RequestState,
    RequestStream,
    abort_out,
    bad_request_reason,
    chosen_ids,
    queue_full_reason,
    raised_abort,
    sampling_spec,
)
from testkit.sglang_info import SglangEngineConfig, loads, model_info, server_info
from testkit.weight_versions import EngineVersions

__all__ = ["SCHEDULER_DEATH_EXIT_SECS", "SglangTestEngine", "flush_failed_after_update"]

# SGLang's message when a weight update's cache flush is refused (the update call fails).
flush_failed_after_update = (
    "Weights were updated, but the cache was not flushed because requests are still running or "
    "queued. Retract or finish them, then call /flush_cache."
)

SCHEDULER_DEATH_EXIT_SECS = 0.5

log = logging.getLogger("testkit.sglang")


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
    # Held before the scheduler (a pause, a weight update) until it passes the gate; dropped
    # when its client left meanwhile.
    held: bool = True
    dropped: bool = False
    # Set while retracted: True once the scheduler runs it again, False if aborted meanwhile.
    readmission: asyncio.Future[bool] | None = None

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
        self.kv_cache = EngineKvCache(
            "sglang",
            block_size=self.config.page_size,
            capacity_blocks=self.config.kv_capacity_tokens // self.config.page_size,
            data_parallel_size=self.config.dp_size,
            events=self.config.kv_events,
        )
        self._scheduler_dead = asyncio.Event()
        self._death: asyncio.Task[None] | None = None  # the server going away after it
        self._reset_control()

    def _reset_control(self) -> None:
        """A (re)started engine: unpaused, at its launch version, nothing held."""
        self.versions = EngineVersions(self.config.weight_version, self.config.weight_version)
        self.updated_model_path: str | None = None  # the last weight update's model path
        self._pause_mode: str | None = None  # the tokenizer manager's pause (any mode)
        self._scheduler_paused: str | None = None  # "in_place" or "retract": stopped between steps
        self._scheduler_running = asyncio.Event()
        self._scheduler_running.set()
        self._weight_updates = 0  # updates waiting for the requests in flight, or applying
        self._gate = asyncio.Event()  # set: a request may go to the scheduler
        self._gate.set()
        self._past_gate = 0  # live requests on the scheduler (SGLang's model-update readers)
        self._drained = asyncio.Event()  # set: none
        self._drained.set()
        self.book.admission_paused = False

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
    def http_url(self) -> str:
        return f"http://{format_host_port(self.config.http_host, self.http_port)}"

    async def start(self) -> tuple[int, int]:
        """Bind the wires (port 0 picks free ports) and return (gRPC port, HTTP port), 0 for a
        wire not served; the engine is ready after ``startup_delay_secs``."""
        from testkit.sglang_grpc import SglangGrpcServer
        from testkit.sglang_http import SglangHttpServer

        cfg = self.config
        self._ready = asyncio.Event()
        self._scheduler_dead = asyncio.Event()
        self._reset_control()
        self._started_at = time.time()
        servers: list[_Server] = []
        # A (re)started engine has a cold cache, and says so first (AllBlocksCleared).
        await self.kv_cache.start()
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
            await self.kv_cache.stop()
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
        await self.kv_cache.stop()
        self._ready = asyncio.Event()

    async def kill(self) -> None:
        """Engine-wide fault: die now. Streams break mid-way, then connections are refused."""
        await self.stop()

    def scheduler_dies(self) -> None:
        """Engine-wide fault inside a live server: the scheduler dies (see the module doc)."""
        if self._scheduler_dead.is_set():
            return
        self._scheduler_dead.set()

        async def exit_later() -> None:
            await asyncio.sleep(SCHEDULER_DEATH_EXIT_SECS)
            await self.kill()

        # Not one of the engine's own tasks: the kill it makes cancels those.
        self._death = asyncio.get_running_loop().create_task(exit_later())

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
        req, refusal = check_request(self.config, req)
        stream = RequestStream(req)
        if refusal is not None:
            if not req.stream:
                # The tokenizer manager turns a 400 abort of a non-streaming request into a raise.
                raise raised_abort(400, refusal)
            stream.put(
                Chunk(abort_out(req.rid, bad_request_reason(refusal), 0.0, self.versions.current), True)
            )
            stream.put(None)
            self.book.refused(req.rid, Outcome.ERROR, refusal)
            return stream
        if self._queue_full():
            # As SGLang's scheduler: turned away with a 503 abort (a clean terminal of a stream;
            # the tokenizer manager raises it as HTTP 503 for a unary request).
            if not req.stream:
                raise raised_abort(503, "The request queue is full.")
            stream.put(Chunk(abort_out(req.rid, queue_full_reason(), 0.0, self.versions.current), True))
            stream.put(None)
            self.book.refused(req.rid, Outcome.ERROR, "The request queue is full.")
            return stream
        experts = self.config.experts_shape if self.config.enable_return_routed_experts else None
        state = RequestState(
            req,
            self.model,
            self.config.incremental,
            time.perf_counter(),
            versions=self.versions,
            experts=experts,
            runs_prompt=self.config.disaggregation_mode != "decode",
        )
        live = _Live(state, stream, plan)
        self._live[req.rid] = live
        if req.bootstrap is not None:
            self.bootstraps[req.rid] = req.bootstrap
        self.spawn(self._produce(live))
        return stream

    def _queue_full(self) -> bool:
        """A new request would have to wait, and ``max_queued_requests`` already wait."""
        limit = self.config.max_queued_requests
        if limit is None:
            return False
        must_wait = self.book.waiting_count > 0 or self.book.running_count >= self.book.max_running
        return must_wait and self.book.waiting_count >= limit

    def abort(self, rid: str, abort_all: bool = False, *, source: str) -> list[str]:
        """The scheduler's abort: every rid on the scheduler starting with ``rid`` (or all;
        a held request is not on it). Returns them."""
        scheduled = [r for r, live in self._live.items() if not live.held]
        if abort_all:
            matched = scheduled
        elif not rid:
            matched = []  # an empty prefix would match everything: SGLang ignores it
        else:
            matched = [r for r in scheduled if r.startswith(rid)]
        self.abort_log.append(AbortRecord(rid, abort_all, source, tuple(matched)))
        if source in ("grpc", "http"):
            self.book.record_aborts([rid] if not abort_all else matched)
        for r in matched:
            live = self._live[r]
            # A retracted request's abort is answered from the waiting queue; its event still
            # wakes a request whose fault plan waits on it.
            if not self.book.abort_waiting(r) or live.readmission is not None:
                live.abort_evt.set()
        return matched

    def drop_held(self, rid: str) -> bool:
        """The client of ``rid`` left while it was held: it never reaches the scheduler.
        False when ``rid`` is not held."""
        live = self._live.get(rid)
        if live is None or not live.held:
            return False
        live.dropped = True
        live.abort_evt.set()
        return True

    def note_ignored_abort(self, rid: str, *, source: str) -> None:
        """An abort a wire received but did not forward (no such live rid): still on record."""
        self.abort_log.append(AbortRecord(rid, False, source, ()))
        self.book.record_aborts([rid])

    def abort_later(self, rid: str, delay: float, *, source: str) -> None:
        """As SGLang's background task: abort ``rid`` after ``delay`` if it still runs. A held
        request is dropped at once (SGLang's request task is cancelled with its connection)."""
        if self.drop_held(rid):
            return

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
            self.kv_cache.end(req.rid)
            self.book.release(req.rid, outcome, detail)
            self._live.pop(req.rid, None)
            if not live.held:
                self._past_gate -= 1
                if self._past_gate == 0:
                    self._drained.set()
            if send_end:
                stream.put(None)

    async def _run(self, live: _Live) -> tuple[Outcome, bool]:
        """One request from admission to its end: (outcome, whether its stream ends)."""
        req, plan, stream, state = live.request, live.plan, live.stream, live.state
        if not await self._pass_gate(live):
            return Outcome.CANCELLED, True
        if not await self.book.admit(req.rid, len(req.input_ids)):
            reason = {"type": "abort", "message": "Abort in waiting queue"}
            elapsed = time.perf_counter() - state.started
            stream.put(Chunk(abort_out(req.rid, reason, elapsed, self.versions.current), True))
            return Outcome.ABORTED, True
        if plan is not None and plan.kind in KV_EVENT_FAULTS:
            await self._kv_fault(plan, req.routed_dp_rank or 0)
            plan = live.plan = None
        state.cached = self.kv_cache.begin(req.rid, req.input_ids, self._extra(req), req.routed_dp_rank or 0)
        prefill = (len(req.input_ids) - state.cached) * self.config.prefill_us_per_token / 1e6
        if prefill > 0 and await self._wait_abort(live, prefill):
            stream.put(state.abort_chunk(live.abort_message, _now()))
            return Outcome.ABORTED, True
        self.kv_cache.store(req.rid, req.input_ids)
        if plan is not None and plan.kind is FaultKind.STALL_FIRST_TOKEN:
            await plan.stall(live.abort_evt, plan.stall_secs)
        fault_at = None
        cuts = (FaultKind.CLOSE_AFTER, FaultKind.ERROR_AFTER, FaultKind.HANG, FaultKind.ENGINE_DIES)
        if plan is not None and plan.kind in cuts:
            fault_at = plan.after
        gen = Generator(self.model, req.input_ids, sampling_spec(req))
        if gen.limit <= 0 and chosen_ids(req):
            # A prompt-only request asking token_ids_logprob: SGLang scores the position after
            # the prompt (its logprob-only pass), reported with no token.
            ahead = Generator(self.model, req.input_ids, replace(sampling_spec(req), max_tokens=1)).step()
            if ahead.logprobs is not None:
                state.take_logprobs(ahead.logprobs, token=False)
        c = self.config
        finished: GeneratedToken | None = None
        while True:
            if self._scheduler_dead.is_set():
                # Nothing more comes from a dead scheduler; the server goes away soon.
                await asyncio.Event().wait()
            frozen = self._scheduler_paused is not None or live.readmission is not None
            if frozen and not await self._turn(live):
                stream.put(state.waiting_abort_chunk(_now()))
                return Outcome.ABORTED, True
            # Every request in the batch waits the whole step, whose time grows with the batch.
            latency = decode_step_secs(c.token_latency_ms, c.token_latency_slope_ms, self.book.running_count)
            if len(state.ids) == fault_at and plan is not None:
                self._flush(live)
                return await self._apply_fault(live, plan)
            aborted = live.abort_evt.is_set() or (latency > 0 and await self._wait_abort(live, latency))
            if self._scheduler_paused is not None or live.readmission is not None:
                continue  # paused or retracted meanwhile: this step does not run
            if aborted:
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
            if state.unsent >= c.chunk_tokens:
                self._flush(live)
                if latency <= 0:
                    await asyncio.sleep(0)  # let aborts and other requests in
        # The output's KV is cached too (all but the last token's, never computed).
        self.kv_cache.store(req.rid, req.input_ids + tuple(state.ids[:-1]))
        chunks, outcome = state.finish(finished, plan, _now())
        for chunk in chunks:
            stream.put(chunk)
        if plan is not None and plan.kind is FaultKind.HOLD_AFTER_TERMINAL:
            # Finished (and released from the book), but the stream never ends by itself:
            # the wire keeps it open until the client leaves.
            return outcome, False
        return outcome, True

    async def _pass_gate(self, live: _Live) -> bool:
        """Hold the request while the engine is paused or a weight update waits (SGLang's pause
        condition and model-update lock), then put it on the scheduler. False: dropped."""
        while not self._gate.is_set() and not live.dropped:
            waits = [asyncio.ensure_future(self._gate.wait()), asyncio.ensure_future(live.abort_evt.wait())]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()
        if live.dropped:
            return False
        live.held = False
        self._past_gate += 1
        self._drained.clear()
        return True

    async def _turn(self, live: _Live) -> bool:
        """Until the scheduler runs this request: it waits out an in-place pause, and a
        retracted request waits to be scheduled again, then is prefilled anew. False: it was
        aborted in the waiting queue meanwhile."""
        while True:
            if live.readmission is not None:
                admitted = await live.readmission
                live.readmission = None
                if not admitted:
                    return False
                await self._prefill_again(live)
                continue
            if self._scheduler_paused is None:
                return True
            await self._scheduler_running.wait()

    async def _prefill_again(self, live: _Live) -> None:
        """A retracted request back on the scheduler computes its prompt and output again (the
        prefix cache may hold part of it); an abort meanwhile is seen at its next step."""
        req = live.request
        seq = req.input_ids + tuple(live.state.ids)
        self.kv_cache.end(req.rid)  # it may have begun between its admission and the retraction
        cached = self.kv_cache.begin(req.rid, seq, self._extra(req), req.routed_dp_rank or 0)
        prefill = (len(seq) - cached) * self.config.prefill_us_per_token / 1e6
        if prefill > 0:
            await self._wait_abort(live, prefill)
        self.kv_cache.store(req.rid, seq)

    def _reopen_gate(self) -> None:
        if self._pause_mode is None and self._weight_updates == 0:
            self._gate.set()
        else:
            self._gate.clear()

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
        if plan.kind is FaultKind.ENGINE_DIES:
            self.scheduler_dies()
            await asyncio.Event().wait()  # stalled until the server goes away
        # HANG: send nothing more and keep the stream open; only an abort frees the slot.
        await live.abort_evt.wait()
        return Outcome.ABORTED, False

    @staticmethod
    def _extra(req: NativeRequest) -> BlockExtra:
        """An adapter's pages and a salted prompt's are their own (SGLang keys its radix tree
        by both)."""
        if req.lora_path is None and req.cache_salt is None:
            return NO_EXTRA
        return BlockExtra(lora_name=req.lora_path, cache_salt=req.cache_salt)

    async def _kv_fault(self, plan: FaultPlan, rank: int) -> None:
        if plan.kind is FaultKind.DROP_KV_BATCH:
            self.kv_cache.drop_next_batch(rank)
        elif plan.kind is FaultKind.RESTART_KV_PUBLISHER:
            await self.kv_cache.restart()

    def flush_cache(self) -> bool:
        """SGLang's /flush_cache: refused while requests run, or wait unless the scheduler is
        paused (a retract pause can flush, an in-place one cannot); else ``AllBlocksCleared``."""
        if self._scheduler_paused is None and self.book.waiting_count:
            return False
        return self.kv_cache.flush()

    # -- pause, continue, weight versions (see the module doc) ---------------------------
    @property
    def pause_mode(self) -> str | None:
        """The mode of the pause in force (None: not paused)."""
        return self._pause_mode

    @property
    def holding(self) -> bool:
        """New requests are held before the scheduler (a pause, or a weight update waiting)."""
        return not self._gate.is_set()

    def output_tokens(self, rid: str) -> int | None:
        """The tokens a live request has produced so far (None: not live)."""
        live = self._live.get(rid)
        return None if live is None else len(live.state.ids)

    @property
    def held_count(self) -> int:
        """Requests held before the scheduler by a pause or a weight update."""
        return sum(1 for live in self._live.values() if live.held and not live.dropped)

    async def pause_generation(self, mode: str = "abort") -> None:
        """SGLang's ``/pause_generation``; ValueError for a mode it does not have."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        self._pause_mode = mode
        self._reopen_gate()
        if mode == "abort":
            # The tokenizer manager aborts all and returns once no request holds its lock.
            self.abort("", True, source="pause")
            await self._drained.wait()
            return
        self._scheduler_paused = mode
        self._scheduler_running.clear()
        self.book.pause_admission()
        if mode == "retract":
            for rid in self.book.running_ids():
                live = self._live.get(rid)
                if live is not None and live.readmission is None:
                    live.readmission = self.book.retract(rid)
                    live.state.retractions += 1
                    self.kv_cache.end(rid)

    def continue_generation(self) -> None:
        """SGLang's ``/continue_generation``: the scheduler runs again, held requests go to it."""
        self._pause_mode = None
        self._scheduler_paused = None
        self._scheduler_running.set()
        self.book.resume_admission()
        self._reopen_gate()

    def update_weight_version(self, new_version: str, *, abort_all_requests: bool = True) -> None:
        """SGLang's ``/update_weight_version`` (it aborts everything first unless told not to)."""
        if abort_all_requests:
            self.abort("", True, source="update_weight_version")
        self._change_version(new_version)
        self.versions.reported = new_version

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
    ) -> tuple[bool, str, int]:
        """SGLang's ``/update_weights_from_disk``: (success, message, num_paused_requests).
        Unpaused, it first waits for the requests in flight while holding new ones; paused, it
        applies at once. The cache flush after it (``flush_cache``) failing fails the call, but
        the scheduler has taken the new version by then (the tokenizer manager has not)."""
        if abort_all_requests:
            self.abort("", True, source="update_weights")
        waits_for_requests = self._pause_mode is None
        if waits_for_requests:
            self._weight_updates += 1
            self._reopen_gate()
        try:
            if waits_for_requests:
                await self._drained.wait()
            success, message = True, "Succeeded to update model weights."
            self._change_version(weight_version)
            if flush_cache and not self.flush_cache():
                success, message = False, flush_failed_after_update
            if success:
                self.updated_model_path = model_path
                if weight_version is not None:
                    self.versions.reported = weight_version
                    message += f" Weight version updated to {weight_version}."
            return success, message, 0
        finally:
            if waits_for_requests:
                self._weight_updates -= 1
                self._reopen_gate()

    def _change_version(self, new_version: str | None) -> None:
        """The scheduler's version moves (SGLang's ``record_weight_version_change``)."""
        if new_version is None or new_version == self.versions.current:
            return
        old = self.versions.current
        self.versions.current = new_version
        for live in self._live.values():
            if not live.held:
                live.state.record_version_change(old)

    async def health_probe(self) -> bool:
        """``/health`` and ``/health_generate``: SGLang generates one token and answers 503
        when nothing comes back within its timeout, as while paused or updating weights."""
        if not self.ready:
            return False
        try:
            await asyncio.wait_for(self._gate.wait(), self.config.health_check_timeout_secs)
        except TimeoutError:
            return False
        return True

    # -- what the info endpoints report -------------------------------------------------
    def server_info(self, *, http: bool) -> dict[str, Any]:
        return server_info(
            self.config,
            http=http,
            http_port=self.http_port,
            grpc_port=self.grpc_port,
            started_at=self._started_at,
            kv_events=self.kv_cache.sglang_descriptor(),
        )

    def model_info(self, *, http: bool) -> dict[str, Any]:
        return model_info(
            self.config, http=http, weight_version=self.versions.reported, model_path=self.updated_model_path
        )

    def loads(self, dp_rank: int | None = None) -> list[dict[str, Any]]:
        return loads(self.config, self.book, dp_rank, time.time())
