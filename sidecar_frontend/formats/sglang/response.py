"""``LLMEngineOutput`` -> SGLang ``/generate`` responses (pure): the streaming encoder and the
unary assembler are one state machine, so a unary reply is by construction the fold of the
events a stream would have carried.

One item per sub-request (see :class:`~sidecar_frontend.formats.sglang.plan.ItemPlan`).
Outputs are deltas; an item keeps everything it has produced and renders either all of it
(cumulative streams, unary) or what is new since its last event (incremental streams). While
the client reads slower than the stream comes, outputs are only added to their item
(``hold``) and ``flush`` writes one event per item for all of them (``base.HoldingEncoder``).

Weights and experts (docs/metadata.md): every event's ``meta_info.weight_version`` is the
label of the item's latest output (``"default"``, SGLang's launch default, where the worker's
wire does not say); the final event adds the terminal's ``weight_versions`` spans and, when
asked, ``routed_experts`` (base64 of the worker's bytes), where SGLang's tokenizer manager
puts them.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from sidecar_common import prompt_logprobs
from sidecar_common.api import sidecar_pb2
from sidecar_common.structs import StructError, json_from_struct
from sidecar_frontend.formats.base import HttpReply, WorkerFailure
from sidecar_frontend.formats.sglang.plan import ItemPlan, SglangOptions
from sidecar_frontend.formats.sglang.wire import (
    DONE_EVENT,
    FAILURE_STATUS,
    dumps,
    event,
    status_error,
    stream_error_event,
)

__all__ = ["SglangEncoder"]

Triple = list[object]  # [logprob | None, token_id, text (always None: no tokenizer)]

_ABORTED: Final[Mapping[str, object]] = {
    "type": "abort",
    "message": "Aborted",
    "status_code": None,
    "err_type": None,
}


def _abort_reason(status: int, message: str) -> dict[str, object]:
    return {
        "type": "abort",
        "message": message,
        "status_code": status,
        "err_type": "InternalServerError" if status == 500 else None,
    }


def _float_or_none(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _top_row(candidates: Sequence[tuple[int, float | None, int | None]], limit: int) -> list[Triple]:
    """SGLang's top-k row from (token, logprob, rank) candidates: by rank where the worker
    gave ranks, else by logprob; the sampled token drops out when it was not in the top k."""
    ranked = [c for c in candidates if c[2] is not None]
    if ranked:
        ordered = sorted(ranked, key=lambda c: c[2] or 0)
    else:
        ordered = sorted(candidates, key=lambda c: -(c[1] if c[1] is not None else float("-inf")))
    return [[lp, token, None] for token, lp, _ in ordered[:limit]]


def _output_top(entries: sidecar_pb2.TopLogprobs, limit: int) -> list[Triple]:
    candidates = [(e.token_id, e.logprob, e.rank if e.HasField("rank") else None) for e in entries.entries]
    return _top_row(candidates, limit)


def _position(
    entry: sidecar_pb2.TopLogprobs | None, token: int
) -> tuple[float | None, list[tuple[int, float | None, int | None]]]:
    """One prompt position: the prompt token's logprob and the candidates (unranked, as SGLang
    shows prompt alternatives; NaN, a value the worker did not give, reads as none)."""
    entries = entry.entries if entry is not None else ()
    pairs = [(e.token_id, None if math.isnan(e.logprob) else e.logprob) for e in entries]
    own = next((lp for tid, lp in pairs if tid == token), None)
    return own, [(tid, lp, None) for tid, lp in pairs]


def _chosen_rows(output: sidecar_pb2.LLMEngineOutput, key: str) -> list[list[Triple] | None]:
    """``engine_data[key]``: per position null or ``[{"token_id", "logprob"}, ...]``, as triples."""
    if not output.HasField("engine_data") or key not in output.engine_data.fields:
        return []
    try:
        rows = json_from_struct(output.engine_data).get(key)
    except StructError:
        return []
    if not isinstance(rows, list):
        return []
    out: list[list[Triple] | None] = []
    for row in rows:
        if not isinstance(row, list):
            out.append(None)
            continue
        triples: list[Triple] = []
        for entry in row:
            if isinstance(entry, dict) and isinstance(entry.get("token_id"), int):
                triples.append([_float_or_none(entry.get("logprob")), entry["token_id"], None])
        out.append(triples)
    return out


def _engine_rows(output: sidecar_pb2.LLMEngineOutput, key: str) -> list[object] | None:
    """``engine_data[key]`` when it is a list (None: absent)."""
    if not output.HasField("engine_data") or key not in output.engine_data.fields:
        return None
    try:
        rows = json_from_struct(output.engine_data).get(key)
    except StructError:
        return None
    return list(rows) if isinstance(rows, list) else None


@dataclass
class _Item:
    plan: ItemPlan
    index: int
    output_ids: list[int] = field(default_factory=list)
    token_logprobs: list[Triple] = field(default_factory=list)
    top_logprobs: list[list[Triple]] = field(default_factory=list)
    input_token_logprobs: list[Triple] = field(default_factory=list)
    input_top_logprobs: list[list[Triple] | None] = field(default_factory=list)
    # token_ids_logprob: per position the asked ids' triples, or None.
    input_chosen: list[list[Triple] | None] = field(default_factory=list)
    output_chosen: list[list[Triple] | None] = field(default_factory=list)
    finish: Mapping[str, object] | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # Tokens already carried by an event (incremental streams render from here).
    sent: int = 0
    events: int = 0
    finished_at: float | None = None
    first_at: float | None = None
    input_logprobs_known: bool = False
    # The version the worker labelled its latest output with (None: its wire does not say).
    weight_version: str | None = None
    # The terminal's spans over the whole output ([]: the worker's wire does not say).
    weight_versions: list[dict[str, object]] = field(default_factory=list)
    routed_experts: bytes | None = None
    # return_sampling_mask: per output token the ids sampling could choose, and their logprobs
    # (None: the worker sent none, and SGLang then writes no such keys).
    sampling_mask: list[object] | None = None
    sampling_logprobs: list[object] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prompt_tokens = len(self.plan.prompt)

    @property
    def done(self) -> bool:
        return self.finish is not None

    def add(self, output: sidecar_pb2.LLMEngineOutput) -> None:
        plan = self.plan
        new = list(output.token_ids)
        self.output_ids.extend(new)
        if output.HasField("weight_version"):
            self.weight_version = output.weight_version
        if plan.return_sampling_mask and new:
            self._sampling_mask(output)
        if plan.return_logprob and not self.input_logprobs_known and prompt_logprobs.carried(output):
            # SGLang shows the prompt's logprobs from its first event after prefill on: render
            # them from the first output that carries them.
            self._input_logprobs(output)
        if plan.token_ids_logprob:
            self.output_chosen.extend(
                [[e.logprob, e.token_id, None] for e in row.entries] for row in output.token_ids_logprobs
            )
        if plan.return_logprob:
            for k, token in enumerate(new):
                lp = output.log_probs[k] if k < len(output.log_probs) else None
                self.token_logprobs.append([lp, token, None])
                if plan.top_logprobs_num > 0:
                    tops = output.top_logprobs
                    row = _output_top(tops[k], plan.top_logprobs_num) if k < len(tops) else []
                    self.top_logprobs.append(row)

    def end(self, output: sidecar_pb2.LLMEngineOutput) -> None:
        usage = output.completion_usage
        if output.HasField("completion_usage"):
            self.prompt_tokens = usage.prompt_tokens or self.prompt_tokens
            self.cached_tokens = usage.cached_tokens if usage.HasField("cached_tokens") else 0
        if self.plan.return_logprob and not self.input_logprobs_known:
            # No output carried them (a worker that sends them with its last output, or none):
            # the final event has them, with null logprobs where the worker gave none.
            self._input_logprobs(output)
        self.finish = self._finish(output)
        self.weight_versions = [
            {"version": span.version, "start": span.start, "end": span.end} for span in output.weight_versions
        ]
        if self.plan.return_routed_experts and output.HasField("routed_experts"):
            self.routed_experts = output.routed_experts

    def _finish(self, output: sidecar_pb2.LLMEngineOutput) -> Mapping[str, object]:
        reason = output.finish_reason
        if reason == sidecar_pb2.LENGTH:
            cap = self.plan.max_new_tokens
            return {"type": "length", "length": cap if cap is not None else len(self.output_ids)}
        if reason in (sidecar_pb2.STOP, sidecar_pb2.EOS):
            which = output.WhichOneof("stop_reason")
            if which == "stop_token_id":
                return {"type": "stop", "matched": output.stop_token_id}
            if which == "stop_string":
                return {"type": "stop", "matched": output.stop_string}
            # EOS and other hidden stops name no token on our wire; SGLang reports the
            # matched id, and the stop token is the last output token.
            return {"type": "stop", "matched": self.output_ids[-1] if self.output_ids else None}
        if reason == sidecar_pb2.CONTENT_FILTER:
            return {"type": "abort", "message": "Content filtered", "status_code": None, "err_type": None}
        return _ABORTED

    def _sampling_mask(self, output: sidecar_pb2.LLMEngineOutput) -> None:
        rows = _engine_rows(output, "sampling_mask")
        if rows is None:
            return
        if self.sampling_mask is None:
            self.sampling_mask = []
        self.sampling_mask.extend(rows)
        self.sampling_logprobs.extend(_engine_rows(output, "sampling_logprobs") or ())

    def _input_logprobs(self, output: sidecar_pb2.LLMEngineOutput) -> None:
        plan = self.plan
        start, prompt = plan.logprob_start_len, plan.prompt
        self.input_logprobs_known = True
        if not 0 <= start < len(prompt):
            return
        table = prompt_logprobs.of_output(output, prompt) or ()
        if plan.token_ids_logprob:
            chosen = _chosen_rows(output, "prompt_token_ids_logprobs")
            # SGLang's first entry has no logprobs, whatever the start (as input_token_logprobs).
            self.input_chosen = [
                None,
                *(chosen[p] if p < len(chosen) else None for p in range(start + 1, len(prompt))),
            ]
        for position in range(start, len(prompt)):
            entry = table[position] if position < len(table) else None
            own, candidates = _position(entry, prompt[position])
            first = position == start
            # SGLang's first input entry never has a logprob, whatever the start.
            self.input_token_logprobs.append([None if first else own, prompt[position], None])
            if plan.top_logprobs_num > 0:
                row = None if first or not candidates else _top_row(candidates, plan.top_logprobs_num)
                self.input_top_logprobs.append(row)

    def body(
        self, *, incremental: bool, started_at: float, wall_time: float, unary: bool
    ) -> dict[str, object]:
        """The item's next event (or, ``unary``, its response) rendered from its state."""
        plan = self.plan
        offset = self.sent if incremental else 0
        meta: dict[str, object] = {
            "id": plan.rid,
            "finish_reason": dict(self.finish) if self.finish is not None else None,
            "prompt_tokens": self.prompt_tokens,
            # SGLang's launch default stands in where the worker's wire does not say.
            "weight_version": self.weight_version if self.weight_version is not None else "default",
            "num_retractions": 0,
        }
        if plan.return_logprob:
            meta["input_token_logprobs"] = self.input_token_logprobs
            meta["output_token_logprobs"] = self.token_logprobs[offset:]
            meta["output_token_logprobs_length"] = len(self.token_logprobs)
            if plan.top_logprobs_num > 0:
                meta["input_top_logprobs"] = self.input_top_logprobs
                meta["output_top_logprobs"] = self.top_logprobs[offset:]
            if plan.token_ids_logprob:
                meta["input_token_ids_logprobs"] = self.input_chosen
                meta["output_token_ids_logprobs"] = self.output_chosen[offset:]
        if plan.return_sampling_mask and self.sampling_mask is not None:
            # Where SGLang's tokenizer manager writes them: after the logprobs.
            meta["output_token_sampling_mask"] = self.sampling_mask[offset:]
            meta["output_token_sampling_logprobs"] = self.sampling_logprobs[offset:]
            meta["output_token_sampling_mask_length"] = len(self.sampling_mask)
        meta["reasoning_tokens"] = 0
        meta["completion_tokens"] = len(self.output_ids)
        meta["cached_tokens"] = self.cached_tokens
        if self.finish is not None and self.weight_versions:
            # Where SGLang's tokenizer manager adds them (its weight_version keeps its place).
            meta["weight_versions"] = self.weight_versions
        meta["cached_tokens_details"] = (
            {"device": self.cached_tokens, "host": 0} if self.cached_tokens else None
        )
        if self.finish is not None and self.routed_experts is not None:
            meta["routed_experts"] = base64.b64encode(self.routed_experts).decode("ascii")
        meta["dp_rank"] = None
        if self.finished_at is not None:
            meta["e2e_latency"] = self.finished_at - started_at
        if unary or self.events == 0:
            sent_at = self.finished_at if unary else self.first_at
            meta["response_sent_to_client_ts"] = wall_time + ((sent_at or started_at) - started_at)
        body: dict[str, object] = {"output_ids": self.output_ids[offset:], "meta_info": meta}
        if plan.return_prompt_token_ids:
            body["prompt_token_ids"] = list(plan.prompt)
        return body


class SglangEncoder:
    """One generate call's response (``base.Encoder``)."""

    def __init__(self, options: SglangOptions, *, stream: bool, started_at: float) -> None:
        self._options = options
        self._stream = stream
        self._started_at = started_at
        self._items = [_Item(plan, index) for index, plan in enumerate(options.items)]
        self._aborted = False
        self._error: HttpReply | None = None

    @property
    def aborted(self) -> bool:
        return self._aborted

    def on_output(self, index: int, output: sidecar_pb2.LLMEngineOutput, now: float) -> bytes:
        item = self._items[index]
        if self._aborted or item.done:
            return b""
        before = len(item.output_ids)
        item.add(output)
        if output.finish_reason != sidecar_pb2.UNSPECIFIED:
            item.end(output)
            item.finished_at = now
        elif len(item.output_ids) == before:
            return b""
        elif item.events and len(item.output_ids) - item.sent < item.plan.stream_interval:
            return b""  # held back until stream_interval tokens are unsent (or the end)
        return self._emit(item, now)

    def hold(self, index: int, output: sidecar_pb2.LLMEngineOutput, now: float) -> bytes:
        """The output joins its item's state; only its end is written now, carrying every
        token not yet sent (``base.HoldingEncoder``)."""
        item = self._items[index]
        if self._aborted or item.done:
            return b""
        item.add(output)
        if output.finish_reason == sidecar_pb2.UNSPECIFIED:
            return b""
        item.end(output)
        item.finished_at = now
        return self._emit(item, now)

    def flush(self, now: float) -> bytes:
        """One event for each item with tokens not yet sent, as ``on_output`` would write it
        (``stream_interval`` still holds an item back until that many are unsent)."""
        if self._aborted:
            return b""
        events = []
        for item in self._items:
            unsent = len(item.output_ids) - item.sent
            if item.done or unsent <= 0:
                continue
            if item.events and unsent < item.plan.stream_interval:
                continue
            events.append(self._emit(item, now))
        return b"".join(events)

    def on_failure(self, index: int, failure: WorkerFailure, now: float) -> bytes:
        item = self._items[index]
        if self._aborted or item.done:
            return b""
        message = failure.message
        status = FAILURE_STATUS[failure.reason]
        if status is None:
            # An abort by rid: SGLang ends the request with the abort finish reason and the
            # output so far, on HTTP 200; the other items go on.
            item.finish = _ABORTED
            item.finished_at = now
            return self._emit(item, now)
        if self._stream and status == 400:
            # A refused value: SGLang's SSE error event (no index), then [DONE].
            # Tokens held for a slow client go out first, as they would have without holding.
            held = self.flush(now)
            self._aborted = True
            return held + stream_error_event(message)
        if self._stream:
            # Any other failure ends that item with an abort chunk carrying the status.
            item.finish = _abort_reason(status, message)
            item.finished_at = now
            return self._emit(item, now)
        self._aborted = True
        self._error = status_error(status, message)
        return b""

    def close(self) -> bytes:
        return DONE_EVENT

    def reply(self) -> HttpReply:
        if self._error is not None:
            return self._error
        bodies = [
            item.body(
                incremental=False, started_at=self._started_at, wall_time=self._options.wall_time, unary=True
            )
            for item in self._items
        ]
        return HttpReply(200, dumps(bodies if self._options.batch else bodies[0]))

    def _emit(self, item: _Item, now: float) -> bytes:
        if not self._stream:
            return b""
        if item.events == 0:
            item.first_at = now
        body = item.body(
            incremental=self._options.incremental,
            started_at=self._started_at,
            wall_time=self._options.wall_time,
            unary=False,
        )
        if self._options.batch:
            body["index"] = item.index
        item.events += 1
        item.sent = len(item.output_ids)
        return event(body)
