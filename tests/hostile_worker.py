"""A scriptable misbehaving ``sidecar.v1`` server on loopback (issue 26, "A worker is not
trusted"): honest until told otherwise, then wrong on the wire in one chosen way per reply kind.

Honest, it answers like a sidecar over a small deterministic engine: health ``SERVING``,
``GetModelInfo`` (a model name and ``vocab_size``), ``GetLoad``, ``WatchKvCache`` with a small
valid snapshot and then nothing (until the cache modes change: then the stream ends, and the
next one misbehaves), and ``Generate`` with a few tokens per choice, one per output,
the last one the terminal (``EOS``, or ``LENGTH`` when ``max_tokens`` ran out). ``WatchLoad``
only with ``watch_load`` (``--watch-load``): GetLoad's report at once, then at each change of
its in-flight count and every ``load_heartbeat`` seconds, the load modes applying to each report
from the stream's ``after + 1``-th on (``load-hang``: silent from there); without it,
``UNIMPLEMENTED``, as a sidecar older than WatchLoad answers.

Every reply is serialized by this module rather than by grpc's stubs (generic RPC handlers
whose response serializer passes :class:`Raw` bytes through untouched), so a mode can put on
the wire what no well-formed message would: undecodable bytes, a varint too wide for its
field, a string that is not UTF-8.

Use it in process::

    async with hostile_worker(model_info=info) as worker:
        ...  # honest
        worker.misbehave(Kind.OUTPUT_GARBAGE)  # from now on; streams waiting are woken

or as a subprocess (it prints ``listening on HOST:PORT`` once it serves)::

    python -m tests.hostile_worker --listen 127.0.0.1:0 --misbehave output-garbage,load-nan \
        [--after N] [--honest-outputs N] [--huge-keys N] [--control FILE] [--model M] [--vocab-size N] \
        [--watch-load]

where ``--control FILE`` names a file of comma-separated kinds, read again whenever it changes
(an empty file: honest), so a test switches a running subprocess.

``after``: a mode applies from the ``after + 1``-th call of its RPC on (for the health Watch,
its ``after + 1``-th message; for WatchLoad, its ``after + 1``-th report counted over every
stream), so a worker can join the fleet honestly and turn later.
``honest_outputs``: a misbehaving ``Generate`` first sends that many honest token outputs
(so tests choose whether a token was delivered before the fault).
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import math
import secrets
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any, Final

import anyio
import anyio.lowlevel
import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2

from sidecar_common.api import sidecar_pb2
from sidecar_common.kv_keys import KEY_SCHEME, root_key

__all__ = [
    "DEFAULT_VOCAB",
    "GARBAGE",
    "HostileWorker",
    "Kind",
    "Raw",
    "hostile_worker",
    "main",
    "parse_kinds",
]

DEFAULT_VOCAB: Final = 32000
# A tag (field 1, length-delimited) claiming far more bytes than follow: no protobuf message
# decodes from it, whatever its type.
GARBAGE: Final = b"\x0a\xff\xff\xff\x0f\x01"
_U32_MAX: Final = 2**32 - 1
_TWO_63: Final = 2**63
_SNAPSHOT_CHUNK: Final = 65_536
_HEALTH_SERVICE: Final = "grpc.health.v1.Health"
_WORKER_SERVICE: Final = "sidecar.v1.Worker"


class Kind(enum.Enum):
    """One way to misbehave; the value is its name on the command line."""

    # Undecodable bytes for each reply kind.
    HEALTH_GARBAGE = "health-garbage"
    MODEL_INFO_GARBAGE = "model-info-garbage"
    LOAD_GARBAGE = "load-garbage"
    KV_GARBAGE = "kv-garbage"
    OUTPUT_GARBAGE = "output-garbage"
    # Generate ends with UNAVAILABLE whose grpc-status-details-bin is not a google.rpc.Status.
    ERROR_DETAILS_GARBAGE = "error-details-garbage"
    # ... whose Status decodes but whose ErrorInfo (an Any of the right type) does not.
    ERROR_INFO_GARBAGE = "error-info-garbage"
    # An output whose text (field 2) is not UTF-8: the message as a whole does not decode.
    TEXT_GARBAGE = "text-garbage"
    # Every output including the terminal, then the stream stays open until the client leaves.
    FINAL_THEN_OPEN = "final-then-open"
    # Token ids at and past vocab_size (and 2**32-1).
    OUT_OF_VOCAB = "out-of-vocab"
    # A LENGTH terminal with no tokens, as the choice's only output.
    LENGTH_NO_TOKENS = "length-no-tokens"
    # An output for a choice the request does not have (index n).
    BAD_INDEX = "bad-index"
    # Every output including the terminal, then one more output, then the stream ends.
    OUTPUT_AFTER_FINAL = "output-after-final"
    # An output with one token and three log_probs (lists that must be parallel).
    LOGPROBS_MISMATCH = "logprobs-mismatch"
    # GetLoad: -1 as a ten-byte varint in the uint32 counts (grpc's decoder keeps the low
    # 32 bits: 2**32-1), kv_usage -1.0.
    LOAD_NEGATIVE = "load-negative"
    LOAD_NAN = "load-nan"
    # 2**63 as the varint of the uint32 counts (decoded: its low 32 bits, 0), kv_usage 2**63,
    # kv_cache blocks and batches 2**63.
    LOAD_HUGE = "load-huge"
    # GetLoad never answers (until the client gives up).
    LOAD_HANG = "load-hang"
    # A snapshot of ``huge_keys`` keys (in chunks) with block size 0 / 2**32-1.
    KV_HUGE_ZERO_BLOCK = "kv-huge-zero-block"
    KV_HUGE_MAX_BLOCK = "kv-huge-max-block"
    # Right after every snapshot a delta two past it: a sequence gap, every time.
    KV_GAP = "kv-gap"


GENERATE_KINDS: Final = frozenset(
    {
        Kind.OUTPUT_GARBAGE,
        Kind.ERROR_DETAILS_GARBAGE,
        Kind.ERROR_INFO_GARBAGE,
        Kind.TEXT_GARBAGE,
        Kind.FINAL_THEN_OPEN,
        Kind.OUT_OF_VOCAB,
        Kind.LENGTH_NO_TOKENS,
        Kind.BAD_INDEX,
        Kind.OUTPUT_AFTER_FINAL,
        Kind.LOGPROBS_MISMATCH,
    }
)
LOAD_KINDS: Final = frozenset(
    {Kind.LOAD_GARBAGE, Kind.LOAD_NEGATIVE, Kind.LOAD_NAN, Kind.LOAD_HUGE, Kind.LOAD_HANG}
)
KV_KINDS: Final = frozenset({Kind.KV_GARBAGE, Kind.KV_HUGE_ZERO_BLOCK, Kind.KV_HUGE_MAX_BLOCK, Kind.KV_GAP})


def parse_kinds(text: str) -> frozenset[Kind]:
    """``a,b`` -> those kinds; blank -> none. Raises ValueError naming an unknown kind."""
    kinds = set()
    for part in text.replace("\n", ",").split(","):
        name = part.strip()
        if not name:
            continue
        try:
            kinds.add(Kind(name))
        except ValueError:
            known = ", ".join(k.value for k in Kind)
            raise ValueError(f"unknown misbehaviour {name!r} (known: {known})") from None
    return frozenset(kinds)


@dataclass(frozen=True)
class Raw:
    """Bytes that go on the wire as they are, in place of a message."""

    data: bytes


def _serialize(message: Any) -> bytes:
    if isinstance(message, Raw):
        return message.data
    data = message.SerializeToString()
    assert isinstance(data, bytes)
    return data


def _varint(value: int) -> bytes:
    """``value`` as a protobuf varint (negative: its 64-bit two's complement, ten bytes)."""
    value &= 2**64 - 1
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _varint_field(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _bytes_field(number: int, data: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def output_with_bad_text(token_id: int) -> bytes:
    """An LLMEngineOutput with one token and a ``text`` that is not UTF-8 (proto3 refuses)."""
    return sidecar_pb2.LLMEngineOutput(token_ids=[token_id]).SerializeToString() + _bytes_field(
        2, b"\xff\xfe"
    )


def load_with_counts(count: int, kv_usage: float) -> bytes:
    """A LoadReport whose uint32 counts carry ``count``'s varint as it is (wider than the
    field when ``count`` is negative or past 2**32), one rank with the same, and kv_usage."""
    rank = (
        _varint_field(1, 0)
        + _varint_field(2, count)
        + _varint_field(3, count)
        + sidecar_pb2.RankLoad(kv_usage=kv_usage).SerializeToString()
    )
    return _varint_field(1, count) + _bytes_field(2, rank)


def status_details_with_bad_error_info(code: grpc.StatusCode, message: str) -> bytes:
    """A google.rpc.Status that decodes (matching code and message) whose one detail claims
    to be an ErrorInfo and is not one."""
    detail = any_pb2.Any(type_url="type.googleapis.com/" + error_details_pb2.ErrorInfo.DESCRIPTOR.full_name)
    detail.value = GARBAGE
    code_value: int = code.value[0]
    assert code_value in code_pb2.Code.values()
    status = status_pb2.Status(code=code_value, message=message, details=[detail])
    return bytes(status.SerializeToString())


def honest_tokens(request: sidecar_pb2.PreprocessedRequest, vocab_size: int, default: int) -> list[int]:
    """The tokens an honest answer carries: a function of the prompt, so every honest worker
    (and a continuation on another one) agrees; ``max_tokens`` of them when set, else
    ``default``; ids in [3, vocab_size)."""
    wanted = request.stop_conditions.max_tokens if request.stop_conditions.HasField("max_tokens") else default
    seed = sum(request.token_ids) + len(request.token_ids)
    span = max(1, vocab_size - 3)
    return [3 + (seed + 7 * i) % span for i in range(wanted)]


def default_model_info(
    model: str = "hostile-model", vocab_size: int = DEFAULT_VOCAB
) -> sidecar_pb2.ModelInfo:
    return sidecar_pb2.ModelInfo(
        engine="vllm",
        served_model_name=model,
        model_path=model,
        max_context_length=4096,
        vocab_size=vocab_size,
        eos_token_ids=[2],
        kv_block_size=16,
        total_kv_blocks=1024,
        max_num_seqs=256,
        data_parallel_size=1,
        disaggregation_mode="agg",
    )


class HostileWorker:
    """The server's state and behaviour; :func:`hostile_worker` runs it on loopback."""

    def __init__(
        self,
        model_info: sidecar_pb2.ModelInfo | None = None,
        *,
        kinds: Iterable[Kind] = (),
        after: int = 0,
        honest_outputs: int = 0,
        default_tokens: int = 4,
        huge_keys: int = 300_000,
        watch_load: bool = False,
        load_heartbeat: float = 0.5,
    ) -> None:
        self.model_info = model_info if model_info is not None else default_model_info()
        self.kinds: frozenset[Kind] = frozenset(kinds)
        self.after = after
        self.honest_outputs = honest_outputs
        self.default_tokens = default_tokens
        self.huge_keys = huge_keys
        self.watch_load = watch_load
        self.load_heartbeat = load_heartbeat
        self.epoch = secrets.randbits(62) + 1
        self.address = ""
        # Calls per RPC (health Watch: messages; "WatchLoad/report": WatchLoad's reports), and
        # misbehaving replies sent per kind.
        self.calls: Counter[str] = Counter()
        self.misbehaved: Counter[Kind] = Counter()
        self.generate_ids: list[str] = []
        self.inflight = 0
        self._changed = anyio.Event()
        # Set (and replaced) when the in-flight count changes: WatchLoad streams report it.
        self._inflight_changed = anyio.Event()
        # Woken whenever anything above is counted: tests wait on it, never on time.
        self._counted = anyio.Event()

    @property
    def vocab_size(self) -> int:
        return self.model_info.vocab_size or DEFAULT_VOCAB

    # ------------------------------------------------------------------ control

    def misbehave(self, *kinds: Kind) -> None:
        """From now on misbehave in these ways (replacing the last set); waiting streams wake."""
        self.kinds = frozenset(kinds)
        changed, self._changed = self._changed, anyio.Event()
        changed.set()

    def behave(self) -> None:
        self.misbehave()

    async def wait_misbehaved(self, kind: Kind, count: int = 1, timeout: float = 30.0) -> None:
        """Until ``count`` misbehaving replies of ``kind`` went out (fails after ``timeout``)."""
        await self._wait(lambda: self.misbehaved[kind] >= count, timeout)

    async def wait_idle(self, timeout: float = 30.0) -> None:
        """Until no Generate call is open here (fails after ``timeout``)."""
        await self._wait(lambda: self.inflight == 0, timeout)

    async def wait_calls(self, rpc: str, count: int = 1, timeout: float = 30.0) -> None:
        """Until ``rpc`` was called ``count`` times (fails after ``timeout``)."""
        await self._wait(lambda: self.calls[rpc] >= count, timeout)

    async def _wait(self, done: Callable[[], bool], timeout: float) -> None:
        with anyio.fail_after(timeout):
            while not done():
                await self._counted.wait()

    def _count(self, rpc: str) -> int:
        self.calls[rpc] += 1
        self._wake()
        return self.calls[rpc]

    def _sent(self, kind: Kind) -> None:
        self.misbehaved[kind] += 1
        self._wake()

    def _wake(self) -> None:
        counted, self._counted = self._counted, anyio.Event()
        counted.set()

    def _inflight_change(self) -> None:
        changed, self._inflight_changed = self._inflight_changed, anyio.Event()
        changed.set()

    def _active(self, kind: Kind, call: int) -> bool:
        return kind in self.kinds and call > self.after

    # ------------------------------------------------------------------ handlers

    def handlers(self) -> Sequence[grpc.GenericRpcHandler[Any, Any]]:
        unary, stream = grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler
        worker = grpc.method_handlers_generic_handler(
            _WORKER_SERVICE,
            {
                "Generate": stream(
                    self._generate,
                    request_deserializer=sidecar_pb2.PreprocessedRequest.FromString,
                    response_serializer=_serialize,
                ),
                "Abort": unary(
                    self._abort,
                    request_deserializer=sidecar_pb2.AbortRequest.FromString,
                    response_serializer=_serialize,
                ),
                "GetModelInfo": unary(
                    self._model_info,
                    request_deserializer=sidecar_pb2.GetModelInfoRequest.FromString,
                    response_serializer=_serialize,
                ),
                "GetLoad": unary(
                    self._load,
                    request_deserializer=sidecar_pb2.GetLoadRequest.FromString,
                    response_serializer=_serialize,
                ),
                "WatchLoad": stream(
                    self._watch_load,
                    request_deserializer=sidecar_pb2.WatchLoadRequest.FromString,
                    response_serializer=_serialize,
                ),
                "WatchKvCache": stream(
                    self._watch_kv,
                    request_deserializer=sidecar_pb2.WatchKvCacheRequest.FromString,
                    response_serializer=_serialize,
                ),
            },
        )
        health = grpc.method_handlers_generic_handler(
            _HEALTH_SERVICE,
            {
                "Check": unary(
                    self._health_check,
                    request_deserializer=health_pb2.HealthCheckRequest.FromString,
                    response_serializer=_serialize,
                ),
                "Watch": stream(
                    self._health_watch,
                    request_deserializer=health_pb2.HealthCheckRequest.FromString,
                    response_serializer=_serialize,
                ),
            },
        )
        return (worker, health)

    async def _health_check(self, request: Any, context: Any) -> Any:
        call = self._count("Health/Check")
        if self._active(Kind.HEALTH_GARBAGE, call):
            self._sent(Kind.HEALTH_GARBAGE)
            return Raw(GARBAGE)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    async def _health_watch(self, request: Any, context: Any) -> AsyncIterator[Any]:
        serving = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
        restate = True  # the first message, and the one after garbage, say SERVING
        while True:
            changed = self._changed
            message = self.calls["Health/Watch"] + 1
            if self._active(Kind.HEALTH_GARBAGE, message):
                self._count("Health/Watch")
                self._sent(Kind.HEALTH_GARBAGE)
                restate = True
                yield Raw(GARBAGE)
            elif restate:
                self._count("Health/Watch")
                restate = False
                yield serving
            await changed.wait()

    async def _model_info(self, request: Any, context: Any) -> Any:
        call = self._count("GetModelInfo")
        if self._active(Kind.MODEL_INFO_GARBAGE, call):
            self._sent(Kind.MODEL_INFO_GARBAGE)
            return Raw(GARBAGE)
        return self.model_info

    async def _abort(self, request: Any, context: Any) -> Any:
        self._count("Abort")
        return sidecar_pb2.AbortResponse(aborted=0)

    async def _load(self, request: Any, context: Any) -> Any:
        call = self._count("GetLoad")
        kind = self._load_kind(call)
        if kind is None:
            return self._load_reply(None)
        self._sent(kind)
        if kind is Kind.LOAD_HANG:
            await anyio.sleep_forever()
        return self._load_reply(kind)

    async def _watch_load(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self._count("WatchLoad")
        if not self.watch_load:
            # What grpc itself answers for a method the server does not have.
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        while True:
            changed, inflight_changed = self._changed, self._inflight_changed
            kind = self._load_kind(self.calls["WatchLoad/report"] + 1)
            if kind is Kind.LOAD_HANG:
                self._sent(kind)
                await changed.wait()  # silent until the modes change
                continue
            if kind is not None:
                self._sent(kind)
            self._count("WatchLoad/report")
            yield self._load_reply(kind)
            with anyio.move_on_after(self.load_heartbeat):
                await inflight_changed.wait()

    def _load_kind(self, call: int) -> Kind | None:
        """The load mode that applies to the ``call``-th load reply, if any."""
        active = [kind for kind in sorted(LOAD_KINDS, key=lambda k: k.value) if self._active(kind, call)]
        return active[0] if active else None

    def _load_reply(self, kind: Kind | None) -> Any:
        """The honest report (``kind`` None), or what ``kind`` sends instead (not LOAD_HANG)."""
        if kind is None:
            return sidecar_pb2.LoadReport(
                inflight_requests=self.inflight,
                ranks=[
                    sidecar_pb2.RankLoad(
                        dp_rank=0, running_requests=self.inflight, waiting_requests=0, kv_usage=0.1
                    )
                ],
                kv_cache=sidecar_pb2.KvCacheStatus(
                    subscribed=True, batches_received=1, blocks=3, block_size=16
                ),
            )
        if kind is Kind.LOAD_GARBAGE:
            return Raw(GARBAGE)
        if kind is Kind.LOAD_NEGATIVE:
            return Raw(load_with_counts(-1, -1.0))
        if kind is Kind.LOAD_NAN:
            return Raw(load_with_counts(1, math.nan))
        status = sidecar_pb2.KvCacheStatus(
            subscribed=True, batches_received=_TWO_63, blocks=_TWO_63, block_size=_U32_MAX
        )
        return Raw(load_with_counts(_TWO_63, float(_TWO_63)) + _bytes_field(3, status.SerializeToString()))

    def _snapshot(self, sequence: int) -> sidecar_pb2.KvCacheUpdate:
        root = root_key()
        snapshot = sidecar_pb2.KvCacheSnapshot(
            epoch=self.epoch,
            sequence=sequence,
            block_size=16,
            model=self.model_info.served_model_name,
            keys=[11, 12, 13],
            parents=[root, 11, 12],
            last_chunk=True,
            status=sidecar_pb2.KvCacheStatus(subscribed=True, batches_received=1, blocks=3, block_size=16),
            key_scheme=KEY_SCHEME,
        )
        return sidecar_pb2.KvCacheUpdate(snapshot=snapshot)

    def _huge_snapshot(self, sequence: int, block_size: int) -> Iterable[sidecar_pb2.KvCacheUpdate]:
        count = self.huge_keys
        status = sidecar_pb2.KvCacheStatus(
            subscribed=True, batches_received=1, blocks=count, block_size=block_size
        )
        for start in range(0, count, _SNAPSHOT_CHUNK):
            stop = min(count, start + _SNAPSHOT_CHUNK)
            keys = range(1_000_000 + start, 1_000_000 + stop)
            yield sidecar_pb2.KvCacheUpdate(
                snapshot=sidecar_pb2.KvCacheSnapshot(
                    epoch=self.epoch,
                    sequence=sequence,
                    block_size=block_size,
                    model=self.model_info.served_model_name,
                    keys=keys,
                    parents=[k - 1 for k in keys],
                    last_chunk=stop == count,
                    status=status,
                    key_scheme=KEY_SCHEME,
                )
            )

    async def _watch_kv(self, request: Any, context: Any) -> AsyncIterator[Any]:
        """One snapshot (or what a mode sends instead), then nothing until the cache modes
        change: the stream then ends, as a restarting sidecar's would, and the client's next
        call gets the new behaviour (a snapshot comes only first on a stream)."""
        call = self._count("WatchKvCache")
        modes = self.kinds & KV_KINDS
        huge = [k for k in (Kind.KV_HUGE_ZERO_BLOCK, Kind.KV_HUGE_MAX_BLOCK) if self._active(k, call)]
        if self._active(Kind.KV_GARBAGE, call):
            self._sent(Kind.KV_GARBAGE)
            yield Raw(GARBAGE)
        elif huge:
            self._sent(huge[0])
            for update in self._huge_snapshot(0, 0 if huge[0] is Kind.KV_HUGE_ZERO_BLOCK else _U32_MAX):
                yield update
        else:
            yield self._snapshot(0)
        if self._active(Kind.KV_GAP, call):
            self._sent(Kind.KV_GAP)
            yield sidecar_pb2.KvCacheUpdate(
                delta=sidecar_pb2.KvCacheDelta(
                    epoch=self.epoch, sequence=2, added_keys=[14], added_parents=[13]
                )
            )
        while self.kinds & KV_KINDS == modes:
            await self._changed.wait()

    async def _generate(self, request: sidecar_pb2.PreprocessedRequest, context: Any) -> AsyncIterator[Any]:
        call = self._count("Generate")
        self.generate_ids.append(request.request_id)
        active = [kind for kind in sorted(GENERATE_KINDS, key=lambda k: k.value) if self._active(kind, call)]
        kind = active[0] if active else None
        choices = max(1, request.sampling_options.n) if request.sampling_options.HasField("n") else 1
        tokens = honest_tokens(request, self.vocab_size, self.default_tokens)
        self.inflight += 1
        self._inflight_change()
        try:
            if kind is Kind.LENGTH_NO_TOKENS:
                self._sent(kind)
                for index in range(choices):
                    yield sidecar_pb2.LLMEngineOutput(index=index, finish_reason=sidecar_pb2.LENGTH)
                return
            honest = (
                len(tokens)
                if kind in (None, Kind.FINAL_THEN_OPEN, Kind.OUTPUT_AFTER_FINAL)
                else min(self.honest_outputs, len(tokens))
            )
            for index in range(choices):
                for position, token in enumerate(tokens[:honest]):
                    await anyio.lowlevel.checkpoint()
                    yield self._output(request, index, token, position, len(tokens))
            if kind is None:
                return
            if kind is Kind.FINAL_THEN_OPEN:
                self._sent(kind)
                await anyio.sleep_forever()
            if kind is Kind.OUTPUT_AFTER_FINAL:
                self._sent(kind)
                yield sidecar_pb2.LLMEngineOutput(token_ids=tokens[:1])
                return
            self._sent(kind)
            if kind is Kind.OUTPUT_GARBAGE:
                yield Raw(GARBAGE)
            elif kind is Kind.TEXT_GARBAGE:
                yield Raw(output_with_bad_text(tokens[0] if tokens else 3))
            elif kind is Kind.BAD_INDEX:
                yield sidecar_pb2.LLMEngineOutput(index=choices, token_ids=tokens[:1])
            elif kind is Kind.LOGPROBS_MISMATCH:
                yield sidecar_pb2.LLMEngineOutput(token_ids=tokens[:1], log_probs=[-0.5, -1.0, -1.5])
            elif kind is Kind.OUT_OF_VOCAB:
                yield sidecar_pb2.LLMEngineOutput(token_ids=[self.vocab_size, self.vocab_size + 1, _U32_MAX])
            elif kind is Kind.ERROR_DETAILS_GARBAGE:
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    "engine went away",
                    trailing_metadata=(("grpc-status-details-bin", GARBAGE), ("migratable", "true")),
                )
            elif kind is Kind.ERROR_INFO_GARBAGE:
                details = status_details_with_bad_error_info(grpc.StatusCode.UNAVAILABLE, "engine went away")
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    "engine went away",
                    trailing_metadata=(("grpc-status-details-bin", details), ("migratable", "true")),
                )
            # The misbehaviour is out: the stream stays open until the client leaves (a hostile
            # worker sends no terminal after it; the client must not wait for one).
            await anyio.sleep_forever()
        finally:
            self.inflight -= 1
            self._inflight_change()
            self._wake()

    def _output(
        self, request: sidecar_pb2.PreprocessedRequest, index: int, token: int, position: int, total: int
    ) -> sidecar_pb2.LLMEngineOutput:
        output = sidecar_pb2.LLMEngineOutput(index=index, token_ids=[token])
        if position == total - 1:
            limited = request.stop_conditions.HasField("max_tokens")
            output.finish_reason = sidecar_pb2.LENGTH if limited else sidecar_pb2.EOS
            output.completion_usage.CopyFrom(
                sidecar_pb2.CompletionUsage(
                    prompt_tokens=len(request.token_ids),
                    completion_tokens=total,
                    total_tokens=len(request.token_ids) + total,
                )
            )
        return output


@asynccontextmanager
async def hostile_worker(
    model_info: sidecar_pb2.ModelInfo | None = None,
    *,
    listen: str = "127.0.0.1:0",
    credentials: grpc.ServerCredentials | None = None,
    **options: Any,
) -> AsyncIterator[HostileWorker]:
    """A :class:`HostileWorker` serving on ``listen`` (loopback, a free port by default; over
    TLS with ``credentials``); its ``address`` is set while the context runs."""
    worker = HostileWorker(model_info, **options)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(worker.handlers())
    host = listen.rsplit(":", 1)[0]
    if credentials is not None:
        port = server.add_secure_port(listen, credentials)
    else:
        port = server.add_insecure_port(listen)
    await server.start()
    worker.address = f"{host}:{port}"
    try:
        yield worker
    finally:
        await server.stop(None)


async def _follow_control(worker: HostileWorker, path: str) -> None:
    """Apply the kinds in ``path`` whenever the file changes (checked every 50 ms)."""
    seen: tuple[float, int] | None = None
    while True:
        try:
            stat = await anyio.Path(path).stat()
            stamp = (stat.st_mtime, stat.st_size)
            if stamp != seen:
                seen = stamp
                worker.misbehave(*parse_kinds(await anyio.Path(path).read_text(encoding="utf-8")))
        except FileNotFoundError:
            pass
        except ValueError as err:
            print(f"hostile worker: {err}", file=sys.stderr, flush=True)
        await asyncio.sleep(0.05)


async def _serve(args: argparse.Namespace) -> None:
    info = default_model_info(args.model, args.vocab_size)
    options = {
        "kinds": args.misbehave,
        "after": args.after,
        "honest_outputs": args.honest_outputs,
        "huge_keys": args.huge_keys,
        "watch_load": args.watch_load,
    }
    async with (
        hostile_worker(info, listen=args.listen, **options) as worker,
        anyio.create_task_group() as tasks,
    ):
        if args.control:
            tasks.start_soon(_follow_control, worker, args.control)
        print(f"listening on {worker.address}", flush=True)
        await anyio.sleep_forever()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tests.hostile_worker", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--misbehave", type=parse_kinds, default=frozenset(), metavar="KIND[,KIND]")
    parser.add_argument("--after", type=int, default=0, metavar="N")
    parser.add_argument("--honest-outputs", type=int, default=0, metavar="N")
    parser.add_argument("--control", default="", metavar="FILE")
    parser.add_argument("--huge-keys", type=int, default=300_000, metavar="N", help="keys of a huge snapshot")
    parser.add_argument("--model", default="hostile-model")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB)
    parser.add_argument("--watch-load", action="store_true", help="serve WatchLoad (else UNIMPLEMENTED)")
    args = parser.parse_args(argv)
    with suppress(KeyboardInterrupt):
        asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
