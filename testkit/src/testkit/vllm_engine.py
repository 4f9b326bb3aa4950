"""A CPU stand-in for vLLM's gRPC server (``vllm.grpc.engine.VllmEngine``) plus gRPC health.

This module is the server: lifecycle, request checks, admission, the per-step scheduler loop
and fault plans. Building the messages (chunks, completes, logprob shapes, handoffs, malformed
terminals) is pure and lives in ``vllm_wire``.

The stream shape follows smg-grpc-servicer's ``VllmEngineServicer`` with ``stream=true``
(vLLM's DELTA output kind), and with ``stream=false`` (FINAL_ONLY: one answer, nothing until
every choice is done, then one ``complete`` per choice carrying all its tokens, logprobs and
the prompt's; an abort's ``complete`` carries the tokens so far):

* per engine step and per choice, one ``chunk`` with only the new token ids; counts are per
  message (``completion_tokens`` = ids in this message); ``input_logprobs`` ride on each
  choice's first chunk only;
* when a choice finishes, its last ``chunk`` is followed by a ``complete`` that restates that
  final delta (``output_ids`` = the last chunk's ids), with ``input_logprobs`` again,
  ``matched_stop`` and, on a prefill, ``kv_transfer_params_json``;
* an Abort RPC ends every unfinished choice with an empty ``chunk`` and a ``complete`` of
  finish_reason "abort" (vLLM puts a final abort output on the request's queue); a client
  that cancels its stream gets nothing more and the request is stopped;
* request errors are INVALID_ARGUMENT before any message (vLLM's ValueError mapping), checked
  in vLLM's order and worded as vLLM words them (``vllm_wire.sampling_refusal``,
  ``prompt_refusal``), ``(parameter=…, value=…)`` included.

A primary-EOS stop reports no ``matched_stop`` (vLLM's scheduler sets no stop_reason for it);
stop token ids, and EOS ids that are not the primary one, report ``matched_token_id``.

Testkit choices where vLLM has no equivalent:

* ``startup_delay_secs``: connections are *refused* (nothing listens) until the delay passed;
  the port is reserved up front so ``start()`` can return it at once.
* Disaggregation: a request whose kv params say ``do_remote_decode`` is a prefill; on a
  kv_producer/kv_both engine its terminal carries a NIXL-shaped handoff. One that says
  ``do_remote_prefill`` is a decode: it must carry remote_host/remote_port/remote_engine_id/
  remote_block_ids (else INVALID_ARGUMENT) and is recorded in ``handoffs``.
* Engine core death (``core_dies()``, or the ``engine_dies`` fault after k tokens): as vLLM's
  server, the gRPC server stays up, every stream in flight and every new ``Generate`` ends
  INTERNAL with the EngineDeadError text, ``HealthCheck`` answers healthy=false and the standard
  health service NOT_SERVING, until the server is restarted.
* Faults (testkit.faults): ``after`` counts tokens sent over all choices, and a cut fault
  fires at the first terminal when the stream is shorter; a hung stream ignores Abort (a
  wedged engine) and ends only when the client leaves or the engine stops; the wire's ids are
  uint32, so ``negative_id`` sends 0xFFFFFFFF (-1 as int32).
* ``n`` above ``max_num_seqs`` is refused (INVALID_ARGUMENT) instead of fanned out.
* Only tokenized input; sampling temperature/top-p/penalties, logit_bias and guided decoding
  are accepted and ignored (the generator is deterministic).

The prefix cache (``prefix_cache``, one per data-parallel rank, ``--block-size`` tokens a
block, ``--num-gpu-blocks-override`` blocks): a request reuses the cached full blocks its
prompt starts with and reports them as ``cached_tokens`` (vLLM's ``num_cached_tokens``) on
every chunk and complete; its first token waits ``prefill_us_per_token`` for each prompt
token not cached; its prompt's blocks are cached after that prefill and its output's when it
finishes. With ``--kv-events-config`` every change is published on vLLM's KV-event wire
(``kv_events``, ``kv_publisher``); a restarted engine has a cold cache and restarts its
sequence numbers without a word (vLLM publishes ``AllBlocksCleared`` only on a cache reset).

Pause, resume and weight versions (vLLM 0.34.0's ``EngineCoreProc.pause_generation``, its
scheduler's pause states and ``output_processor.track_weight_version``) are served on the
admin HTTP port (``testkit.vllm_admin``), as vLLM serves them only over HTTP:

* ``abort``: every request, running or queued, ends as an Abort RPC ends it (``abort``
  finish); ``wait``: running requests finish, queued ones stay queued; both refuse new
  requests until resume with vLLM's retryable error, which smg's servicer ends INTERNAL with
  its text (``PAUSED_MESSAGE``), and clear the prefix cache once drained unless
  ``clear_cache`` is false. ``keep``: nothing is scheduled (a running request stops between
  steps), new requests are accepted and queued, and all go on at resume. The pause call
  returns once its mode's drain is done. ``GetServerInfo.is_paused`` says whether a pause is
  in force (smg-grpc-servicer 0.14.1 leaves it false; the testkit fills the field).
* Weight versions: each step labels the tokens it made with the engine's version (initially
  "default"), and a request's spans (``weight_versions_of``) are kept when it ends (the last
  ``KEPT_SPANS`` requests': kept forever, they grew the heap every collection walks). vLLM's
  gRPC wire has no field for them (nor for routed experts): nothing here is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from sidecar_common.endpoint import format_host_port
from sidecar_common.message_size import GRPC_MAX_MESSAGE_BYTES
from testkit.book import Book, Outcome, trace_fields
from testkit.faults import KV_EVENT_FAULTS, FaultBook, FaultKind, FaultPlan
from testkit.generator import Generator, prompt_logprobs
from testkit.kv_publisher import EngineKvCache
from testkit.pacing import decode_step_secs
from testkit.vllm_admin import VLLM_PAUSE_MODES, admin_app

# Plain data apart (no grpc there, for the command line); re-exported here.
from testkit.vllm_config import VllmEngineConfig
from testkit.vllm_wire import (
    HANDOFF_FIELDS,
    Choice,
    from_abort,
    handoff,
    input_logprobs,
    malform,
    prompt_refusal,
    sampling_refusal,
    sampling_spec,
    step,
    stopped,
)
from testkit.weight_versions import DEFAULT_WEIGHT_VERSION, WeightVersionSpan, vllm_spans, vllm_track

__all__ = [
    "ENGINE_DEAD_MESSAGE",
    "MAX_QUEUED_TOKENS_MESSAGE",
    "PAUSED_MESSAGE",
    "QUEUE_OVERFLOW_MESSAGE",
    "SERVICE_NAME",
    "VllmEngineConfig",
    "VllmTestEngine",
]

SERVICE_NAME = "vllm.grpc.engine.VllmEngine"
# Ended requests whose weight-version spans are kept (weight_versions_of), the newest.
KEPT_SPANS = 1024
# What vLLM's gRPC servicer sends (INTERNAL) on every stream once the engine core is dead: the
# text of vLLM's EngineDeadError. Its HealthCheck then answers healthy=false with this message.
ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."
ENGINE_NOT_ALIVE = "Engine is not alive"
# vLLM's admission refusals (vllm/exceptions.py; its HTTP server answers both 503): the texts
# smg's servicer ends Generate with, as gRPC UNAVAILABLE.
QUEUE_OVERFLOW_MESSAGE = (
    "The engine is currently busy and cannot accept new requests. "
    "Please try again later or on a different instance."
)
# vLLM's RequestError for a request added while a pause (abort or wait) refuses new ones.
PAUSED_MESSAGE = "Generation is paused. Please retry after it resumes."
MAX_QUEUED_TOKENS_MESSAGE = (
    "The engine has reached its prefill token backlog limit. "
    "Please try again later or on a different instance."
)


class _RequestError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Live:
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    # Admission bookkeeping (vLLM's output processor): the sequences the request occupies, and
    # its prompt tokens while it is still in prefill (0 once its first output went out).
    seqs: int = 1
    prefill_tokens: int = 0


class VllmTestEngine(pb_grpc.VllmEngineServicer):  # type: ignore[misc]
    """The engine. ``start()`` returns the port; faults and bookkeeping are attributes."""

    def __init__(self, config: VllmEngineConfig | None = None) -> None:
        self.config = config or VllmEngineConfig()
        self.book = Book(max_running=self.config.max_num_seqs, kv_capacity=self.config.total_kv_tokens)
        self.faults = FaultBook()
        self.handoffs: list[tuple[str, dict[str, Any]]] = []  # decode requests' kv params
        self.port = self.config.port
        self._server: grpc.aio.Server | None = None
        self._live: dict[str, _Live] = {}
        self._ready = asyncio.Event()
        self._bind_task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._core_dead = asyncio.Event()
        self._health: Any = None
        self._started_at = time.monotonic()
        self._last_receive = 0.0
        self.kv_cache = EngineKvCache(
            "vllm",
            block_size=self.config.block_size,
            capacity_blocks=self.config.num_gpu_blocks,
            data_parallel_size=self.config.data_parallel_size,
            events=self.config.kv_events,
        )
        self._next_block = 1
        # The admission limits in force: the config's, changeable on a live engine (a test
        # makes one worker of a fleet busy without filling it).
        self.max_num_queued_reqs = self.config.max_num_queued_reqs
        self.max_num_queued_tokens = self.config.max_num_queued_tokens
        self.admin_port = self.config.admin_port
        self._admin: web.AppRunner | None = None
        self._released = asyncio.Event()  # pulsed when a request ends
        # Each ended request's weight-version spans, per choice (vLLM's final output has them).
        self.weight_spans: dict[str, list[list[WeightVersionSpan] | None]] = {}
        self._reset_control()

    def _reset_control(self) -> None:
        """A (re)started engine: unpaused, at vLLM's initial version."""
        self.weight_version = DEFAULT_WEIGHT_VERSION
        self._pause_mode: str | None = None
        self._reject_new = False
        self._unfrozen = asyncio.Event()  # cleared by a keep pause: no step runs
        self._unfrozen.set()
        self.book.admission_paused = False

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> int:
        """Bind (after ``startup_delay_secs``, refusing connections until then); the port."""
        if self.port == 0 and self.config.startup_delay_secs > 0 and not self._ready.is_set():
            # The port must be known before a delayed bind, so reserve a free one now (another
            # socket may take it before the bind: only a delayed start takes that chance).
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((self.config.host, 0))
                self.port = int(s.getsockname()[1])
        self._stopping.clear()
        self._core_dead = asyncio.Event()  # a (re)started server has a live engine core
        self._reset_control()
        await self.kv_cache.start()  # a (re)started engine has a cold cache
        if self.admin_port is not None:
            await self._start_admin(self.admin_port)
        if self.config.startup_delay_secs > 0 and not self._ready.is_set():
            self._bind_task = asyncio.create_task(self._bind_later(self.config.startup_delay_secs))
        else:
            await self._bind()
        return self.port

    async def _bind_later(self, delay: float) -> None:
        await asyncio.sleep(delay)
        await self._bind()

    async def _bind(self) -> None:
        server = grpc.aio.server(
            options=[
                ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
                # grpcio turns SO_REUSEPORT on by default: a second engine would share a
                # taken port and split its traffic. Off, the bind fails and start-up says so.
                ("grpc.so_reuseport", 0),
            ]
        )
        pb_grpc.add_VllmEngineServicer_to_server(self, server)
        health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        bound = server.add_insecure_port(format_host_port(self.config.host, self.port))
        if bound == 0 or self.port not in (0, bound):
            raise OSError(f"testkit vllm engine: cannot bind {format_host_port(self.config.host, self.port)}")
        self.port = bound  # a port 0 bind keeps its port for a restart
        await server.start()
        for name in ("", SERVICE_NAME):
            await health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._health = health
        self._server = server
        self._ready.set()

    async def wait_ready(self, timeout: float = 30.0) -> None:
        await asyncio.wait_for(self._ready.wait(), timeout)

    async def stop(self, grace: float | None = None) -> None:
        """Stop serving: in-flight streams get ``grace`` seconds, then are cancelled."""
        self._stopping.set()
        if self._bind_task is not None:
            self._bind_task.cancel()
            await asyncio.gather(self._bind_task, return_exceptions=True)
            self._bind_task = None
        if self._server is not None:
            server, self._server = self._server, None
            await server.stop(grace)
        if self._admin is not None:
            admin, self._admin = self._admin, None
            await admin.cleanup()
        await self.kv_cache.stop()
        self._ready.clear()

    async def _start_admin(self, port: int) -> None:
        runner = web.AppRunner(admin_app(self), access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.config.admin_host, port, reuse_address=True).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._admin = runner
        self.admin_port = int(runner.addresses[0][1])  # a port 0 bind keeps its port for a restart

    # -- pause, resume, weight versions (see the module doc) ------------------------------
    @property
    def is_paused(self) -> bool:
        return self._pause_mode is not None

    @property
    def pause_mode(self) -> str | None:
        return self._pause_mode

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """vLLM's ``/pause``; ValueError for a mode it does not have."""
        if mode not in VLLM_PAUSE_MODES:
            raise ValueError(f"Invalid pause mode: {mode}")
        self._pause_mode = mode
        self._reject_new = mode != "keep"
        self.book.pause_admission()
        if mode == "keep":
            self._unfrozen.clear()
            return
        self._unfrozen.set()
        if mode == "abort":
            for rid, live in list(self._live.items()):
                if not self.book.abort_waiting(rid):
                    live.aborted.set()
        # Drained: nothing runs (abort: nothing is queued either).
        while self.book.running_count or (mode == "abort" and self.book.waiting_count):
            self._released.clear()
            await self._released.wait()
        if clear_cache:
            self.kv_cache.flush()

    def resume_generation(self) -> None:
        """vLLM's ``/resume``: queued requests run, new ones are accepted."""
        self._pause_mode = None
        self._reject_new = False
        self._unfrozen.set()
        self.book.resume_admission()

    def update_weight_version(self, new_version: str) -> None:
        """vLLM's ``/update_weight_version`` (and ``/finish_weight_update`` with a version):
        the steps from now on label their tokens with it."""
        self.weight_version = new_version

    def weight_versions_of(self, request_id: str) -> list[list[WeightVersionSpan] | None] | None:
        """An ended request's spans, per choice (None: no such request ended)."""
        return self.weight_spans.get(request_id)

    async def die(self) -> None:
        """Engine-wide fault: the server goes away now, mid-stream (streams end without status)."""
        await self.stop(0)

    async def core_dies(self) -> None:
        """Engine-wide fault inside a live server: the engine core dies (see the module doc)."""
        if self._core_dead.is_set():
            return
        self._core_dead.set()
        if self._health is not None:
            for name in ("", SERVICE_NAME):
                await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    @property
    def core_dead(self) -> bool:
        return self._core_dead.is_set()

    async def restart(self) -> int:
        """Stop, then serve again on the same port; the book and faults are kept."""
        await self.stop(0)
        return await self.start()

    def running_count(self) -> int:
        return self.book.running_count

    # -- discovery RPCs -------------------------------------------------------------------
    async def HealthCheck(self, request: pb.HealthCheckRequest, context: Any) -> pb.HealthCheckResponse:
        if self._core_dead.is_set():
            return pb.HealthCheckResponse(healthy=False, message=ENGINE_NOT_ALIVE)
        return pb.HealthCheckResponse(healthy=True, message="Health")

    async def FlushCache(
        self, request: common_pb2.FlushCacheRequest, context: Any
    ) -> common_pb2.FlushCacheResponse:
        """vLLM's prefix cache reset: refused while requests hold blocks (vLLM's
        ``reset_prefix_cache`` fails then too; the wording is the testkit's), else the cache is
        emptied and ``AllBlocksCleared`` published. ``timeout_s`` is not waited for."""
        if not self.kv_cache.flush():
            return common_pb2.FlushCacheResponse(
                success=False, message="cannot reset the prefix cache: requests are running"
            )
        return common_pb2.FlushCacheResponse(success=True, message="prefix cache reset")

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: Any) -> pb.GetModelInfoResponse:
        c = self.config
        return pb.GetModelInfoResponse(
            model_path=c.model_path,
            is_generation=True,
            max_context_length=c.context_length,
            vocab_size=c.vocab_size,
            supports_vision=c.supports_vision,
            served_model_name=c.served_model_name,
            tokenizer_path=c.model_path,
            model_type="testkit",
            architectures=["TestkitForCausalLM"],
            eos_token_ids=list(c.eos_token_ids),
            pad_token_id=0,
            bos_token_id=1,
            max_req_input_len=c.context_length,
        )

    async def GetServerInfo(self, request: pb.GetServerInfoRequest, context: Any) -> pb.GetServerInfoResponse:
        c = self.config
        return pb.GetServerInfoResponse(
            active_requests=self.book.running_count + self.book.waiting_count,
            last_receive_timestamp=self._last_receive,
            uptime_seconds=time.monotonic() - self._started_at,
            server_type="vllm-grpc",
            is_paused=self.is_paused,
            kv_connector="NixlConnector" if c.kv_role else "",
            kv_role=c.kv_role,
            kv_engine_id=c.kv_engine_id if c.kv_role else "",
            data_parallel_size=c.data_parallel_size,
            kv_cache_dtype="auto",
            block_size=c.block_size,
            model_dtype="torch.float32",
            max_num_seqs=c.max_num_seqs,
        )

    async def GetLoads(self, request: pb.GetLoadsRequest, context: Any) -> pb.GetLoadsResponse:
        c, b = self.config, self.book
        used = min(b.used_tokens(), c.total_kv_tokens)
        loads = [
            pb.SchedulerLoad(
                dp_rank=rank,
                num_running_reqs=b.running_count if rank == 0 else 0,
                num_waiting_reqs=b.waiting_count if rank == 0 else 0,
                num_total_reqs=b.running_count + b.waiting_count if rank == 0 else 0,
                num_used_tokens=used if rank == 0 else 0,
                max_total_num_tokens=c.total_kv_tokens,
                token_usage=used / c.total_kv_tokens if rank == 0 else 0.0,
                max_running_requests=c.max_num_seqs,
                utilization=b.running_count / c.max_num_seqs if rank == 0 else 0.0,
            )
            for rank in range(c.data_parallel_size)
        ]
        return pb.GetLoadsResponse(
            timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            version="testkit",
            dp_rank_count=len(loads),
            loads=loads,
        )

    async def Abort(self, request: pb.AbortRequest, context: Any) -> pb.AbortResponse:
        ids = list(request.request_ids)
        self.book.record_aborts(ids)
        for rid in ids:
            if not self.book.abort_waiting(rid) and rid in self._live:
                self._live[rid].aborted.set()
        return pb.AbortResponse()

    # -- Generate -------------------------------------------------------------------------
    def admission_refusal(self, seqs: int) -> str | None:
        """vLLM's admission check (``AsyncLLM.check_admission``), after the request's own checks:
        a request whose ``seqs`` sequences would take the unfinished ones past
        ``max_num_queued_reqs`` is refused (QueueOverflowError), then one arriving while the
        prompt tokens still in prefill are at ``max_num_queued_tokens`` (MaxQueuedTokensError)."""
        limit = self.max_num_queued_reqs
        if limit is not None and sum(live.seqs for live in self._live.values()) + seqs > limit:
            return QUEUE_OVERFLOW_MESSAGE
        limit = self.max_num_queued_tokens
        if limit is not None and sum(live.prefill_tokens for live in self._live.values()) >= limit:
            return MAX_QUEUED_TOKENS_MESSAGE
        return None

    def _check(self, request: pb.GenerateRequest) -> tuple[tuple[int, ...], dict[str, Any] | None]:
        """vLLM's request checks, in its order and in its words: the sampling parameters
        (``SamplingParams`` and its ``verify``), then the data-parallel rank, then the prompt's
        length, then its vocabulary (``InputProcessor.process_inputs``)."""
        c = self.config
        bad = grpc.StatusCode.INVALID_ARGUMENT
        if request.WhichOneof("input") != "tokenized":
            raise _RequestError(bad, "the testkit engine takes tokenized input only")
        prompt = tuple(request.tokenized.input_ids)
        sp = request.sampling_params
        refusal = sampling_refusal(sp, c.vocab_size, c.max_logprobs)
        if refusal is not None:
            raise _RequestError(bad, refusal)
        if sp.n > c.max_num_seqs:
            # vLLM has no such check (it fans the request out into n sequences); the testkit
            # refuses rather than build millions of generators on its event loop.
            raise _RequestError(bad, f"n={sp.n} is more than max_num_seqs={c.max_num_seqs} (testkit)")
        if request.HasField("data_parallel_rank") and not (
            0 <= request.data_parallel_rank < c.data_parallel_size
        ):
            rank, size = request.data_parallel_rank, c.data_parallel_size
            raise _RequestError(bad, f"data_parallel_rank {rank} is out of range [0, {size}).")
        refusal = prompt_refusal(prompt, c.vocab_size, c.context_length)
        if refusal is not None:
            raise _RequestError(bad, refusal)
        has_media = request.HasField("mm_inputs") or request.HasField("media_refs")
        if has_media and not c.supports_vision:
            raise _RequestError(bad, "this model does not support multimodal inputs")
        if self.book.is_live(request.request_id):
            raise _RequestError(bad, f"request id {request.request_id!r} is already running")
        kv: dict[str, Any] | None = None
        if request.HasField("kv_transfer_params_json"):
            try:
                kv = json.loads(request.kv_transfer_params_json)
            except json.JSONDecodeError as e:
                raise _RequestError(bad, f"Invalid kv_transfer_params_json: {e}") from None
            if not isinstance(kv, dict):
                raise _RequestError(bad, "kv_transfer_params_json must be a JSON object")
            if kv.get("do_remote_prefill"):
                missing = [f for f in HANDOFF_FIELDS if f not in kv]
                if missing:
                    raise _RequestError(bad, f"kv_transfer_params lacks {', '.join(missing)}")
        return prompt, kv

    async def Generate(self, request: pb.GenerateRequest, context: Any) -> AsyncIterator[pb.GenerateResponse]:
        rid = request.request_id
        self._last_receive = time.time()
        self.book.record_request(rid, request)
        # vLLM's wire carries a request's trace context as gRPC metadata.
        self.book.record_trace_context(rid, trace_fields(context.invocation_metadata() or ()))
        if self._core_dead.is_set():
            self.book.refused(rid, Outcome.FAULTED, ENGINE_DEAD_MESSAGE)
            await context.abort(grpc.StatusCode.INTERNAL, ENGINE_DEAD_MESSAGE)
            return
        try:
            prompt, kv = self._check(request)
        except _RequestError as e:
            self.book.refused(rid, Outcome.ERROR, str(e))
            await context.abort(e.code, str(e))
            return
        refusal = self.admission_refusal(request.sampling_params.n or 1)
        if refusal is not None:
            self.book.refused(rid, Outcome.ERROR, refusal)
            await context.abort(grpc.StatusCode.UNAVAILABLE, refusal)
            return
        if self._reject_new:
            # vLLM's engine core refuses it with a retryable RequestError; smg's servicer ends
            # the stream INTERNAL with its text.
            self.book.refused(rid, Outcome.ERROR, PAUSED_MESSAGE)
            await context.abort(grpc.StatusCode.INTERNAL, PAUSED_MESSAGE)
            return
        plan = self.faults.plan_for(rid)
        if plan is not None and plan.kind is FaultKind.FAIL_OPEN:
            self.book.refused(rid, Outcome.FAULTED, plan.kind.value)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "testkit fault: fail_open")
            return
        if plan is not None and plan.kind in KV_EVENT_FAULTS:
            await self._kv_fault(plan, self._rank(request))
            plan = None
        if kv is not None and kv.get("do_remote_prefill"):
            self.handoffs.append((rid, kv))
        live = self._live[rid] = _Live(seqs=request.sampling_params.n or 1, prefill_tokens=len(prompt))
        outcome, detail = Outcome.CANCELLED, "client left"
        try:
            stall = plan if plan is not None and plan.kind is FaultKind.STALL_FIRST_TOKEN else None
            stream = self._faulted(self._stream(request, prompt, kv, live, stall), plan, live)
            async with contextlib.aclosing(stream):
                async for msg in stream:
                    live.prefill_tokens = 0  # its prefill is done: it counts no more as a backlog
                    yield msg
            outcome, detail = self._end_state(live, plan)
        except _FaultError as e:
            outcome, detail = Outcome.FAULTED, str(e)
            await context.abort(e.code, str(e))
        finally:
            self.kv_cache.end(rid)
            self._live.pop(rid, None)
            self.book.release(rid, outcome, detail)
            self._released.set()

    @staticmethod
    def _rank(request: pb.GenerateRequest) -> int:
        """The data-parallel rank (its cache and publisher) a request runs on."""
        return request.data_parallel_rank if request.HasField("data_parallel_rank") else 0

    async def _kv_fault(self, plan: FaultPlan, rank: int) -> None:
        if plan.kind is FaultKind.DROP_KV_BATCH:
            self.kv_cache.drop_next_batch(rank)
        elif plan.kind is FaultKind.RESTART_KV_PUBLISHER:
            await self.kv_cache.restart()

    # -- the stream -----------------------------------------------------------------------
    async def _pause(self, live: _Live, secs: float) -> None:
        """Sleep ``secs`` (or yield once), waking early on an abort; raises the engine core's
        death (INTERNAL) when it dies meanwhile."""
        if secs <= 0:
            await asyncio.sleep(0)
        else:
            waits = [
                asyncio.ensure_future(live.aborted.wait()),
                asyncio.ensure_future(self._core_dead.wait()),
            ]
            try:
                await asyncio.wait(waits, timeout=secs, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()
        if self._core_dead.is_set():
            raise _FaultError(grpc.StatusCode.INTERNAL, ENGINE_DEAD_MESSAGE)

    def _handoff(self, prompt: tuple[int, ...]) -> dict[str, Any]:
        c = self.config
        params = handoff(len(prompt), c.block_size, self._next_block, c.kv_engine_id, c.kv_host, c.kv_port)
        self._next_block += len(params["remote_block_ids"])
        return params

    async def _stream(
        self,
        request: pb.GenerateRequest,
        prompt: tuple[int, ...],
        kv: dict[str, Any] | None,
        live: _Live,
        stall: FaultPlan | None,
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """The request's messages; ``stall`` delays the first step (an abort still cuts it short)."""
        c, rid = self.config, request.request_id
        sampling = sampling_spec(request)
        choices = [Choice(Generator(c.model, prompt, sampling, i)) for i in range(sampling.n)]
        if not await self.book.admit(rid, len(prompt)):
            live.aborted.set()
            self._keep_spans(rid, choices)
            for ch in choices:
                for msg in from_abort(ch, len(prompt), 0, stream=request.stream):
                    yield msg
            return
        cached = self.kv_cache.begin(rid, prompt, rank=self._rank(request))
        if c.prefill_us_per_token > 0:
            await self._pause(live, (len(prompt) - cached) * c.prefill_us_per_token / 1e6)
        if not live.aborted.is_set():
            self.kv_cache.store(rid, prompt)
        plp = None
        if sampling.prompt_logprobs is not None:
            plp = prompt_logprobs(prompt, max(0, sampling.prompt_logprobs), c.model)
        in_lp = input_logprobs(prompt, plp, sampling.prompt_logprobs)
        prefill = (
            kv is not None and bool(kv.get("do_remote_decode")) and c.kv_role in ("kv_producer", "kv_both")
        )
        produced = len(prompt)
        while True:
            live_choices = [ch for ch in choices if not ch.gen.done]
            if not live_choices:
                break
            if stall is not None:
                await stall.stall(live.aborted, stall.stall_secs)
                stall = None
            await self._unfreeze(live)
            # Every request in the batch waits the whole step, whose time grows with the batch.
            step_secs = decode_step_secs(
                c.token_latency_ms, c.token_latency_slope_ms, self.book.running_count
            )
            await self._pause(live, step_secs * c.chunk_tokens)
            if not self._unfrozen.is_set() and not live.aborted.is_set():
                continue  # a keep pause came meanwhile: this step does not run
            if live.aborted.is_set():
                self._keep_spans(rid, choices)
                for msg in stopped(
                    choices,
                    stream=request.stream,
                    chunk_tokens=c.chunk_tokens,
                    primary_eos=c.eos_token_ids[0],
                    prompt_tokens=len(prompt),
                    cached=cached,
                    in_lp=in_lp,
                    sampling=sampling,
                ):
                    yield msg
                return
            made_before = [len(ch.all_ids) for ch in choices]
            messages, made = step(
                choices,
                stream=request.stream,
                chunk_tokens=c.chunk_tokens,
                primary_eos=c.eos_token_ids[0],
                prompt_tokens=len(prompt),
                cached=cached,
                in_lp=in_lp,
                sampling=sampling,
                handoff=lambda: self._handoff(prompt) if prefill else None,
            )
            produced += made
            self.book.set_tokens(rid, produced)
            for ch, before in zip(choices, made_before, strict=True):
                if len(ch.all_ids) > before:
                    ch.version_starts = vllm_track(ch.version_starts, self.weight_version, before)
            if all(ch.gen.done for ch in choices):
                # The output's KV is cached too (all but the last token's, never computed).
                self.kv_cache.store(rid, prompt + tuple(choices[0].all_ids[:-1]))
                self._keep_spans(rid, choices)
            for msg in messages:
                yield msg

    async def _unfreeze(self, live: _Live) -> None:
        """Wait out a keep pause (an abort still ends the request at once)."""
        if self._unfrozen.is_set():
            return
        waits = [asyncio.ensure_future(self._unfrozen.wait()), asyncio.ensure_future(live.aborted.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    def _keep_spans(self, rid: str, choices: list[Choice]) -> None:
        spans = self.weight_spans
        spans.pop(rid, None)  # a request id used again counts as the newest
        spans[rid] = [vllm_spans(ch.version_starts, len(ch.all_ids)) for ch in choices]
        while len(spans) > KEPT_SPANS:
            del spans[next(iter(spans))]

    async def _faulted(
        self, source: AsyncGenerator[pb.GenerateResponse, None], plan: FaultPlan | None, live: _Live
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """Apply a per-request fault plan to the stream ``source`` makes."""
        async with contextlib.aclosing(source):
            async for msg in self._apply(source, plan, live):
                yield msg

    async def _apply(
        self, source: AsyncIterator[pb.GenerateResponse], plan: FaultPlan | None, live: _Live
    ) -> AsyncIterator[pb.GenerateResponse]:
        if plan is None:
            async for msg in source:
                yield msg
            return
        kind, k = plan.kind, plan.after
        cut = kind in (FaultKind.CLOSE_AFTER, FaultKind.ERROR_AFTER, FaultKind.HANG, FaultKind.ENGINE_DIES)
        sent = 0
        first: pb.GenerateResponse | None = None
        async for msg in source:
            which = msg.WhichOneof("response")
            ids = list(msg.chunk.token_ids) if which == "chunk" else []
            if cut and (which == "complete" or sent + len(ids) > k):
                if k > sent and which == "chunk":
                    part = pb.GenerateResponse()
                    part.CopyFrom(msg)
                    del part.chunk.token_ids[k - sent :]
                    part.chunk.completion_tokens = k - sent
                    yield part
                await self._trip(plan)
                return
            if which == "complete" and kind is FaultKind.MALFORMED_TERMINAL:
                msg = malform(msg, plan.variant)
            sent += len(ids)
            first = first or msg
            yield msg
        if kind is FaultKind.REPEAT_AFTER_TERMINAL and first is not None:
            yield first
        if kind is FaultKind.HOLD_AFTER_TERMINAL:
            # Finished, yet the stream stays open until the client leaves or the engine stops.
            await self._stopping.wait()

    async def _trip(self, plan: FaultPlan) -> None:
        if plan.kind is FaultKind.ENGINE_DIES:
            await self.core_dies()
            raise _FaultError(grpc.StatusCode.INTERNAL, ENGINE_DEAD_MESSAGE)
        if plan.kind is FaultKind.ERROR_AFTER:
            code = getattr(grpc.StatusCode, plan.code, grpc.StatusCode.INTERNAL)
            raise _FaultError(code, plan.error_message)
        if plan.kind is FaultKind.HANG:
            # Hung until the client leaves or the engine stops.
            await self._stopping.wait()

    @staticmethod
    def _end_state(live: _Live, plan: FaultPlan | None) -> tuple[Outcome, str]:
        if live.aborted.is_set():
            return Outcome.ABORTED, "abort"
        if plan is not None:
            return Outcome.FAULTED, plan.kind.value
        return Outcome.FINISHED, ""


class _FaultError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
