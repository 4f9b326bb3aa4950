"""The wire-neutral core of the testkit SGLang engine (pure: no I/O, no clock, no asyncio).

What both wires (``sglang_grpc``, ``sglang_http``) must agree on lives here so they cannot
drift apart: the request as SGLang's tokenizer manager sees it (``NativeRequest``), the
checks it and ``SamplingParams.verify`` apply, the events a wire reads, and the per-request
state machine that renders SGLang's plain-JSON "out" dicts ``{text, output_ids, meta_info}``
(cumulative unless incremental). Times come in as arguments (``Now``), so the rendering is a
function of its inputs. The engine (``sglang_engine``) owns the clock, the tasks and the book.

Behaviour copied in spirit (not code) from SGLang 0.5.23.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from testkit.book import Outcome
from testkit.faults import FaultKind, FaultPlan
from testkit.generator import GeneratedToken, ModelSpec, PositionLogprobs, SamplingSpec, prompt_logprobs
from testkit.routed_experts import ExpertsShape, encode_routed_experts, routed_experts
from testkit.weight_versions import EngineVersions, VersionChange, sglang_meta, sglang_spans

__all__ = [
    "CHOSEN_WIDTH",
    "DEFAULT_MAX_NEW_TOKENS",
    "PAUSE_MODES",
    "SGLANG_VERSION",
    "AbortRecord",
    "Bootstrap",
    "Chunk",
    "Closed",
    "Cut",
    "Fail",
    "NativeRequest",
    "Now",
    "RequestRejected",
    "RequestState",
    "RequestStream",
    "StreamEvent",
    "abort_out",
    "bad_request_reason",
    "chosen_ids",
    "chosen_row",
    "logprob_width",
    "queue_full_reason",
    "raised_abort",
    "sampling_spec",
]

SGLANG_VERSION = "0.5.23"
# PauseGenerationReqInput.mode's values.
PAUSE_MODES = ("abort", "retract", "in_place")
# SGLang's SamplingParams default when a request names no max_new_tokens.
DEFAULT_MAX_NEW_TOKENS = 128


class Bootstrap(NamedTuple):
    host: str
    port: int
    room: int


@dataclass(frozen=True)
class NativeRequest:
    """One generate request as either wire carried it, with SGLang's field names."""

    rid: str
    input_ids: tuple[int, ...]
    wire: str  # "grpc" | "http"
    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    seed: int | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    bootstrap: Bootstrap | None = None
    priority: int | None = None
    routed_dp_rank: int | None = None
    lora_path: str | None = None
    # SGLang's cache_salt (HTTP only: the gRPC subset has no field): a salted prompt's pages
    # are its own. Empty is none, as SGLang normalises it.
    cache_salt: str | None = None
    # Sampling values the generator ignores but SGLang's SamplingParams.verify checks.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    # {token id as text: bias}, as SGLang's HTTP schema carries it (its gRPC wire has no field).
    # Checked as SGLang checks it; the deterministic generator does not apply it.
    logit_bias: tuple[tuple[str, float], ...] | None = None
    # SGLang's token_ids_logprob as the HTTP body gave it (checked in sglang_checks; the gRPC
    # wire has no field). None: not asked.
    token_ids_logprob: object = None
    # SGLang's return_routed_experts and routed_experts_start_len (HTTP only: the gRPC wire has
    # neither). Served when the engine runs with enable_return_routed_experts (testkit.routed_experts).
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0


class RequestRejected(Exception):
    """The request is refused before it runs; each wire renders it its own way: HTTP
    ``http_status`` with ``http_body`` (by default ``{"error": {"message"}}``), gRPC
    ``grpc_code`` with ``grpc_message`` (by default the message)."""

    def __init__(
        self,
        message: str,
        http_status: int = 400,
        grpc_code: str = "INTERNAL",
        *,
        http_body: dict[str, Any] | None = None,
        grpc_message: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.http_status = http_status
        self.grpc_code = grpc_code
        self.http_body: dict[str, Any] = http_body or {"error": {"message": message}}
        self.grpc_message = message if grpc_message is None else grpc_message


def raised_abort(status: int, message: str) -> RequestRejected:
    """What SGLang's tokenizer manager raises, for a non-streaming request, where a stream would
    end with an ``abort`` finish of ``status`` (``_handle_abort_finish_reason``): a ValueError
    for 400 (HTTP 400 ``{"error": {"message"}}``, gRPC INTERNAL with the message), otherwise a
    FastAPI HTTPException (HTTP ``status`` in FastAPI's error shape from SGLang's handler,
    gRPC INTERNAL with the exception's text, ``"<status>: <message>"``)."""
    if status == 400:
        return RequestRejected(message)
    body = {"object": "error", "message": message, "type": str(status), "param": None, "code": status}
    return RequestRejected(message, status, http_body=body, grpc_message=f"{status}: {message}")


@dataclass(frozen=True)
class Chunk:
    out: dict[str, Any]
    finished: bool


@dataclass(frozen=True)
class Cut:
    """The stream ends with no terminal (gRPC: OK status; HTTP: the connection drops)."""


@dataclass(frozen=True)
class Fail:
    code: str  # gRPC status code name
    message: str


@dataclass(frozen=True)
class Closed:
    """gRPC only: the bridge closed this rid's channel (Abort): status CANCELLED."""

    message: str


StreamEvent = Chunk | Cut | Fail | Closed


@dataclass(frozen=True)
class AbortRecord:
    rid: str
    abort_all: bool
    source: str  # "grpc" | "http" (an Abort from a client) | "grpc-cancel" | "http-disconnect"
    matched: tuple[str, ...]


class RequestStream:
    """What a wire reads for one request: events, then ``None`` (end) unless it hangs."""

    def __init__(self, request: NativeRequest) -> None:
        self.request = request
        self.rid = request.rid
        self._queue: asyncio.Queue[StreamEvent | None] = asyncio.Queue()

    def put(self, event: StreamEvent | None) -> None:
        self._queue.put_nowait(event)

    async def next(self) -> StreamEvent | None:
        return await self._queue.get()


@dataclass(frozen=True)
class Now:
    """The engine's clocks at one instant: wall (time.time) and monotonic (perf_counter)."""

    wall: float
    mono: float


# With token_ids_logprob the generator ranks this many ids per position, so that a chosen id
# near the top has the same logprob there as in a top-k list; the others fall below them all.
CHOSEN_WIDTH = 32


def chosen_ids(req: NativeRequest) -> tuple[int, ...]:
    """The token_ids_logprob a checked request asks for (() when none)."""
    ids = req.token_ids_logprob
    return tuple(ids) if isinstance(ids, list | tuple) and req.return_logprob else ()


def logprob_width(req: NativeRequest) -> int:
    """How many alternatives the generator ranks per position for this request."""
    return max(req.top_logprobs_num, CHOSEN_WIDTH) if chosen_ids(req) else req.top_logprobs_num


def chosen_row(position: PositionLogprobs, ids: tuple[int, ...]) -> list[list[Any]]:
    """The testkit model's logprob of each asked id at one position (SGLang's triples)."""
    known = dict(position.top)
    known[position.token_id] = position.logprob
    floor = min(known.values()) - 1.0
    return [[known.get(t, round(floor - (t % 97) / 100.0, 4)), t, None] for t in ids]


def sampling_spec(req: NativeRequest) -> SamplingSpec:
    """The generator's view of a request."""
    return SamplingSpec(
        max_tokens=req.max_new_tokens,
        min_tokens=req.min_new_tokens,
        stop_token_ids=req.stop_token_ids,
        stop=req.stop,
        ignore_eos=req.ignore_eos,
        seed=req.seed,
        logprobs=logprob_width(req) if req.return_logprob else None,
    )


# -- rendering --------------------------------------------------------------------------------
def _triple(lp: float | None, tok: int) -> list[Any]:
    return [lp, tok, None]


def bad_request_reason(message: str) -> dict[str, Any]:
    """The finish reason of a request SGLang's scheduler refuses (``set_finish_with_abort``)."""
    return {"type": "abort", "message": message, "status_code": 400, "err_type": "BadRequestError"}


def queue_full_reason() -> dict[str, Any]:
    """The finish reason of a request SGLang's scheduler turns away because its waiting queue
    is full (``--max-queued-requests``): status 503, in the key order the scheduler writes."""
    return {"type": "abort", "status_code": 503, "message": "The request queue is full."}


def abort_out(rid: str, reason: dict[str, Any], elapsed: float, version: str) -> dict[str, Any]:
    """The out of a request that ends before producing anything (aborted while waiting,
    refused by the scheduler), as SGLang's ``_handle_abort_req`` renders it: its one empty
    weight-version span is of ``version``, the scheduler's version then."""
    shown, last = sglang_meta(sglang_spans((), version, 0), 0)
    meta = {
        "id": rid,
        "finish_reason": reason,
        "weight_version": last,
        "e2e_latency": elapsed,
        "weight_versions": shown,
        "completion_tokens": 0,
    }
    return {"text": "", "output_ids": [], "meta_info": meta}


@dataclass
class RequestState:
    """One running request's output so far, rendered as SGLang streams it.

    ``take`` each generated token; ``flush`` a non-final chunk when the stream interval is
    reached; end with ``finish`` (stop/length, with any malformed-terminal fault),
    ``abort_chunk`` (aborted while it ran) or ``waiting_abort_chunk`` (aborted in the waiting
    queue after a retraction). Cumulative output repeats everything so far in each chunk;
    incremental output (streaming only) sends what is new.

    ``versions`` is the engine's (shared): unfinished outputs say the tokenizer manager's
    version, a final output its spans (``changes`` the scheduler recorded on this request,
    then its current version). ``experts`` (None: not returned) makes a final output that ran
    on the scheduler carry ``routed_experts``.
    """

    request: NativeRequest
    model: ModelSpec
    incremental_output: bool
    started: float  # monotonic
    versions: EngineVersions = field(default_factory=EngineVersions)
    experts: ExpertsShape | None = None
    # False on a decode server (disaggregation): the prompt's KV cache came from its prefill
    # server, so its prompt positions were never run here (testkit.routed_experts).
    runs_prompt: bool = True
    changes: list[VersionChange] = field(default_factory=list)
    retractions: int = 0
    ids: list[int] = field(default_factory=list)
    text: str = ""
    out_lp: list[list[Any]] = field(default_factory=list)
    out_top: list[list[list[Any]] | None] = field(default_factory=list)
    out_chosen: list[list[list[Any]]] = field(default_factory=list)
    sent_ids: int = 0
    sent_text: int = 0
    first: dict[str, Any] | None = None
    cached: int = 0
    stamped: bool = False

    @property
    def incremental(self) -> bool:
        return self.incremental_output and self.request.stream

    def take(self, tok: GeneratedToken) -> None:
        self.ids.append(tok.token_id)
        self.text += tok.text
        if self.request.return_logprob and tok.logprobs is not None:
            self.take_logprobs(tok.logprobs)

    def take_logprobs(self, lp: PositionLogprobs, *, token: bool = True) -> None:
        """One output position's logprobs; ``token`` False: the position after the prompt of a
        prompt-only request, which SGLang reports top and chosen ids for, with no token."""
        req = self.request
        k = req.top_logprobs_num
        if token:
            self.out_lp.append(_triple(lp.logprob, lp.token_id))
        if k or token:
            self.out_top.append([_triple(v, t) for t, v in lp.top[:k]] if k else None)
        ids = chosen_ids(req)
        if ids:
            self.out_chosen.append(chosen_row(lp, ids))

    @property
    def unsent(self) -> int:
        return len(self.ids) - self.sent_ids

    def _input_logprobs(self, kind: str) -> list[Any]:
        """``token``, ``top`` or ``chosen`` rows for the prompt from logprob_start_len; the first
        has no logprob (SGLang's None), whatever the start."""
        req = self.request
        if req.logprob_start_len < 0:
            return []
        start = req.logprob_start_len
        rows: list[PositionLogprobs | None] = list(
            prompt_logprobs(req.input_ids, logprob_width(req), self.model)
        )
        rows = [None, *rows[start + 1 :]] if start < len(rows) else []
        if kind == "top":
            k = req.top_logprobs_num
            return [None if p is None else [_triple(v, t) for t, v in p.top[:k]] for p in rows]
        if kind == "chosen":
            ids = chosen_ids(req)
            return [None if p is None else chosen_row(p, ids) for p in rows]
        toks = req.input_ids[start:]
        return [_triple(None if p is None else p.logprob, t) for p, t in zip(rows, toks, strict=True)]

    def _meta(self, finish_reason: dict[str, Any] | None, final: bool, now: Now) -> dict[str, Any]:
        req = self.request
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": finish_reason,
            "prompt_tokens": len(req.input_ids),
            "weight_version": self.versions.reported,
            "num_retractions": self.retractions,
        }
        if req.return_logprob:
            inc = self.incremental
            start = self.sent_ids if inc else 0
            meta["output_token_logprobs"] = self.out_lp[start:]
            # The prompt's logprobs ride on every event once prefill is done: incremental
            # streaming cuts only the output lists (SGLang's tokenizer manager).
            meta["input_token_logprobs"] = self._input_logprobs("token")
            if req.top_logprobs_num > 0:
                meta["output_top_logprobs"] = self.out_top[start:]
                meta["input_top_logprobs"] = self._input_logprobs("top")
            if chosen_ids(req):
                meta["input_token_ids_logprobs"] = self._input_logprobs("chosen")
                meta["output_token_ids_logprobs"] = self.out_chosen[start:]
        meta["reasoning_tokens"] = 0
        meta["completion_tokens"] = len(self.ids)
        meta["cached_tokens"] = self.cached
        if final:
            self._versions_into(meta)
            if self.experts is not None and req.return_routed_experts:
                rows = routed_experts(
                    req.input_ids + tuple(self.ids),
                    req.routed_experts_start_len,
                    self.experts,
                    run_from=0 if self.runs_prompt else len(req.input_ids),
                )
                meta["routed_experts"] = encode_routed_experts(rows)
        if not self.stamped:
            self.stamped = True
            meta["response_sent_to_client_ts"] = now.wall
        if final:
            meta["e2e_latency"] = now.mono - self.started
        return meta

    def _versions_into(self, meta: dict[str, Any]) -> None:
        """A final output's spans, and its weight_version set to the last (SGLang's
        ``add_weight_versions_to_meta_info``)."""
        spans = sglang_spans(self.changes, self.versions.current, len(self.ids))
        meta["weight_versions"], meta["weight_version"] = sglang_meta(spans, len(self.ids))

    def record_version_change(self, old_version: str) -> None:
        """The scheduler's version moves on from ``old_version``: a request with output keeps
        how many tokens that version made (SGLang's ``record_weight_version_events``)."""
        if self.ids:
            self.changes.append(VersionChange(old_version, len(self.ids)))

    def out(self, finish_reason: dict[str, Any] | None, final: bool, now: Now) -> dict[str, Any]:
        meta = self._meta(finish_reason, final, now)
        if self.incremental:
            ids, text = self.ids[self.sent_ids :], self.text[self.sent_text :]
        else:
            ids, text = list(self.ids), self.text
        self.sent_ids, self.sent_text = len(self.ids), len(self.text)
        return {"text": text, "output_ids": ids, "meta_info": meta}

    def flush(self, now: Now) -> Chunk | None:
        """The non-final chunk of what is unsent, if any (non-streaming requests send none)."""
        if not self.unsent or not self.request.stream:
            return None
        out = self.out(None, False, now)
        if self.first is None:
            self.first = out
        return Chunk(out, False)

    def abort_chunk(self, message: str, now: Now) -> Chunk:
        reason = {"type": "abort", "message": message, "status_code": None, "err_type": None}
        return Chunk(self.out(reason, True, now), True)

    def waiting_abort_chunk(self, now: Now) -> Chunk:
        """Aborted in the waiting queue with output (retracted by a pause): SGLang's
        ``_handle_abort_req`` form, with the whole text and ids so far (an incremental stream
        gets the last id again, as SGLang sends it), its spans and no routed experts. The
        testkit leaves out logprobs here."""
        meta: dict[str, Any] = {
            "id": self.request.rid,
            "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
            "weight_version": self.versions.reported,
            "e2e_latency": now.mono - self.started,
        }
        self._versions_into(meta)
        meta["completion_tokens"] = len(self.ids)
        ids = self.ids[-1:] if self.incremental else list(self.ids)
        self.sent_ids, self.sent_text = len(self.ids), len(self.text)
        return Chunk({"text": self.text, "output_ids": ids, "meta_info": meta}, True)

    def finish(
        self, tok: GeneratedToken | None, plan: FaultPlan | None, now: Now
    ) -> tuple[list[Chunk], Outcome]:
        """The terminal (stop or length), bent by a malformed-terminal or repeat fault."""
        reason: dict[str, Any]
        if tok is None or tok.finish is None or tok.finish.reason == "length":
            reason = {"type": "length", "length": len(self.ids)}
        elif tok.finish.matched_stop_str is not None:
            reason = {"type": "stop", "matched": tok.finish.matched_stop_str}
        else:
            reason = {"type": "stop", "matched": tok.finish.matched_token_id}
        out = self.out(reason, True, now)
        outcome = Outcome.FINISHED
        if plan is not None and plan.kind is FaultKind.MALFORMED_TERMINAL:
            outcome = Outcome.FAULTED
            meta = out["meta_info"]
            if plan.variant == "missing_finish_reason":
                meta["finish_reason"] = None
            elif plan.variant == "unknown_finish_reason":
                meta["finish_reason"] = {"type": "testkit-unknown"}
            elif plan.variant == "count_mismatch":
                meta["completion_tokens"] = len(self.ids) + 1
            else:
                out["output_ids"] = [*out["output_ids"], -1]
        chunks = [Chunk(out, True)]
        if plan is not None and plan.kind is FaultKind.REPEAT_AFTER_TERMINAL:
            chunks.append(Chunk(self.first or out, False))
            outcome = Outcome.FAULTED
        return chunks, outcome
