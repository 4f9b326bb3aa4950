"""Response conversion for SGLang (pure): one state machine for both transports.

The transports only decode their wire into :class:`NativeEvent` (gRPC: meta_info values are
JSON text, decoded by :mod:`sidecar_sglang.grpc_events`; HTTP: an SSE ``data:`` JSON
object). :class:`ResponseState` turns events into ``LLMEngineOutput`` deltas with exactly
one terminal, or raises SidecarError.

Choices the spec leaves open:

* An ``abort`` finish with no ``status_code`` (a pause's abort, an abort request's, a weight
  update's) or one the sidecar asked for ends the generation as SGLang answers it: a CANCELLED
  terminal with the tokens not forwarded yet, usage and weight-version spans (in incremental
  mode, only ids its ``completion_tokens`` says are new: SGLang repeats the last id when it
  aborts a queued request). An abort with a status is a refusal or a failure: an error in
  SGLang's words. A prefill's abort is always an error (its handoff never came).
* ``prompt_logprobs`` (when prompt logprobs were asked) come once, on the first output after
  the engine sent them (SGLang does with its first event after prefill), else on the
  terminal: one position per prompt token, no entries where the engine has none (the first),
  else the prompt's own token first, then up to N alternatives (SGLang sends no ranks).
  Through 0.2.x also as ``engine_data.prompt_logprobs`` (``sidecar_common.prompt_logprobs``).
* A terminal whose ``completion_tokens`` disagrees with the tokens streamed is malformed.
* Weights and experts (docs/metadata.md): every output carries ``meta_info.weight_version``
  as ``weight_version``; a terminal its ``weight_versions`` spans (checked: they tile the
  output from 0, as SGLang's ``add_weight_versions_to_meta_info`` writes them) and, when
  asked, ``routed_experts`` decoded from base64 to its little-endian int32 bytes, at most
  :data:`MAX_ROUTED_EXPERTS_BYTES`. With ``return_sampling_mask`` each output carries its
  tokens' sampling masks in ``engine_data``. Nothing the engine sends is trusted: a
  malformed value is a PROTOCOL_ERROR, not dropped. A prefill's terminal carries its
  ``routed_experts`` too (the prompt's rows), for the frontend to join with the decode's.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from sidecar_common import bootstrap_handoff, prompt_logprobs
from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import FailureReason, SidecarError, engine_words, protocol_error
from sidecar_common.limits import exact_integer
from sidecar_sglang.convert_request import NativeRequest, handoff_info
from sidecar_sglang.refusals import abort_reason

__all__ = [
    "MAX_ROUTED_EXPERTS_BYTES",
    "MAX_SAMPLING_MASK_ENTRIES",
    "MAX_WEIGHT_VERSION_CHARS",
    "NativeEvent",
    "ResponseState",
    "abort_reason",
    "answer_error",
    "error_from_http_status",
    "event_from_http",
]

_ENGINE: Final = "sglang"
_UINT32_MAX: Final = 2**32 - 1
# The routed experts of one output: half a gRPC message (sidecar_common.message_size), the
# rest left for the tokens and their logprobs.
MAX_ROUTED_EXPERTS_BYTES: Final = 32 * 1024 * 1024
# The ids and logprobs of one output's sampling masks: a Struct number costs about 9 bytes,
# so this keeps them within half a gRPC message.
MAX_SAMPLING_MASK_ENTRIES: Final = 1 << 21
# A weight version is a label (a step number, a checkpoint name): longer is not one.
MAX_WEIGHT_VERSION_CHARS: Final = 1024


@dataclass(frozen=True)
class NativeEvent:
    """One decoded engine message: ids as the engine sent them (cumulative or delta)."""

    output_ids: Sequence[object]
    meta: Mapping[str, object]
    finished: bool
    text: str | None = None


def error_from_http_status(status: int, message: str, rpc: str = "Generate") -> SidecarError:
    """SGLang HTTP status -> typed error (docs/sglang.md, "The native HTTP wire"). A refusal
    (4xx) keeps SGLang's words as they are, for the client."""
    words = f"{rpc}: {message} (HTTP {status})"
    if status in (401, 403):
        # Auth is not configured on the sidecar's side: not the request's fault.
        return SidecarError(FailureReason.UNKNOWN, words)
    if 400 <= status < 500:
        return engine_words(FailureReason.INVALID_ARGUMENT, message, rpc, str(status))
    if 502 <= status <= 504:
        return SidecarError(FailureReason.CANNOT_CONNECT, words)
    return SidecarError(FailureReason.UNKNOWN, words)


def answer_error(status: int, payload: object, words: str) -> SidecarError:
    """A non-streaming ``POST /generate`` that did not answer 200 (docs/sglang.md, "One
    answer"). What ends a stream with an ``abort`` finish of some status, SGLang's tokenizer
    manager raises for a non-streaming request: a 400 as ``{"error": {"message"}}``, any
    other status through FastAPI's handler as ``{"object": "error", "message", "code"}``. A
    503 in that shape is the scheduler's "busy" abort (a full queue, a timeout): OVERLOADED in
    SGLang's words, as the same abort reads in a stream (:func:`abort_reason`). Every other
    answer reads as its HTTP status does (:func:`error_from_http_status`; a 400 is already a
    refusal in SGLang's words there)."""
    if (
        abort_reason(status) is FailureReason.OVERLOADED
        and isinstance(payload, dict)
        and payload.get("object") == "error"
    ):
        message = payload.get("message")
        if isinstance(message, str) and message:
            return engine_words(FailureReason.OVERLOADED, message, "Generate", str(status))
    return error_from_http_status(status, words)


def event_from_http(payload: object) -> NativeEvent:
    """One SSE ``data:`` object. An ``{"error": …}`` event raises its typed error."""
    if not isinstance(payload, dict):
        raise protocol_error(_ENGINE, "an event is not a JSON object")
    if "error" in payload:
        error = payload["error"]
        if isinstance(error, dict):
            message = str(error.get("message", error))
            code = exact_integer(error.get("code"))
        else:
            message, code = str(error), None
        raise error_from_http_status(code if code is not None else 500, message)
    meta = payload.get("meta_info")
    if not isinstance(meta, dict):
        raise protocol_error(_ENGINE, "an event has no meta_info object")
    ids = payload.get("output_ids", [])
    if not isinstance(ids, list):
        raise protocol_error(_ENGINE, "output_ids is not a list")
    text = payload.get("text")
    return NativeEvent(
        ids, meta, meta.get("finish_reason") is not None, text if isinstance(text, str) else None
    )


def _token_ids(raw: Sequence[object]) -> list[int]:
    ids: list[int] = []
    for item in raw:
        if isinstance(item, bool) or not isinstance(item, int):
            raise protocol_error(_ENGINE, f"output id {item!r} is not an integer")
        if not 0 <= item <= _UINT32_MAX:
            raise protocol_error(_ENGINE, f"output id {item} is negative or too large")
        ids.append(item)
    return ids


def _triple(item: object, where: str) -> tuple[float | None, int, str | None]:
    """``[logprob, token_id, text|null]``; the logprob may be null (first prompt position)."""
    if not isinstance(item, list | tuple) or len(item) < 2:
        raise protocol_error(_ENGINE, f"{where} entry {item!r} is not [logprob, token_id, text]")
    tid = exact_integer(item[1])
    valid, logprob = _logprob(item[0])
    if tid is None or not 0 <= tid <= _UINT32_MAX or not valid:
        raise protocol_error(_ENGINE, f"{where} entry {str(item)[:200]} is not [logprob, token_id, text]")
    text = item[2] if len(item) > 2 and isinstance(item[2], str) else None
    return logprob, tid, text


def _logprob(value: object) -> tuple[bool, float | None]:
    """(valid, logprob): null is valid (no logprob), a number is, anything else is not."""
    if value is None:
        return True, None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False, None
    try:
        return True, float(value)
    except OverflowError:  # a JSON integer beyond any float
        return False, None


def _list(meta: Mapping[str, object], key: str) -> list[object] | None:
    value = meta.get(key)
    return value if isinstance(value, list) else None


def _top_entries(
    sampled: tuple[float | None, int, str | None], alternatives: object, limit: int, where: str
) -> sidecar_pb2.TopLogprobs:
    lp, tid, text = sampled
    first = sidecar_pb2.TopLogprob(token_id=tid, logprob=lp if lp is not None else 0.0)
    if text is not None:
        first.token = text
    entries = [first]
    if isinstance(alternatives, list):
        for rank, alt in enumerate(alternatives[:limit], start=1):
            alp, atid, atext = _triple(alt, where)
            if atid == tid:
                first.rank = rank
                continue
            entry = sidecar_pb2.TopLogprob(token_id=atid, logprob=alp if alp is not None else 0.0, rank=rank)
            if atext is not None:
                entry.token = atext
            entries.append(entry)
    return sidecar_pb2.TopLogprobs(entries=entries)


def _prompt_positions(meta: Mapping[str, object], limit: int) -> list[sidecar_pb2.TopLogprobs] | None:
    """Per prompt position: none where the engine has none, else the prompt token first then
    up to ``limit`` alternatives (SGLang sends no ranks)."""
    tokens = _list(meta, "input_token_logprobs")
    if tokens is None:
        return None
    tops = _list(meta, "input_top_logprobs") or []
    out: list[sidecar_pb2.TopLogprobs] = []
    for position, item in enumerate(tokens):
        row = sidecar_pb2.TopLogprobs()
        out.append(row)
        lp, tid, _ = _triple(item, "input_token_logprobs")
        if lp is None:
            continue
        row.entries.append(prompt_logprobs.candidate(tid, lp))
        alts = tops[position] if position < len(tops) else None
        if isinstance(alts, list):
            for alt in alts[:limit]:
                alp, atid, _ = _triple(alt, "input_top_logprobs")
                if atid != tid and alp is not None:
                    row.entries.append(prompt_logprobs.candidate(atid, alp))
    return out


def _chosen_rows(meta: Mapping[str, object], key: str, start: int, count: int | None) -> list[object]:
    """SGLang's token_ids_logprob rows from ``start`` (``count`` of them; None: all): per
    position null, or the asked ids in order, each ``{"token_id", "logprob"}``."""
    rows = _list(meta, key) or []
    window = rows[start:] if count is None else rows[start : start + count]
    out: list[object] = []
    for row in window:
        if row is None:
            out.append(None)
            continue
        if not isinstance(row, list):
            raise protocol_error(_ENGINE, f"{key} entry {str(row)[:200]} is not a list")
        entries: list[object] = []
        for item in row:
            lp, tid, _ = _triple(item, key)
            entries.append({"token_id": tid, "logprob": lp})
        out.append(entries)
    return out


def _weight_version(meta: Mapping[str, object]) -> str | None:
    """``meta_info.weight_version``: None when the engine does not say."""
    value = meta.get("weight_version")
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > MAX_WEIGHT_VERSION_CHARS:
        raise protocol_error(_ENGINE, f"weight_version {str(value)[:200]!r} is not a version label")
    return value


def _weight_versions(meta: Mapping[str, object], completion: int) -> list[sidecar_pb2.WeightVersionSpan]:
    """``meta_info.weight_versions`` of a terminal: spans that tile the ``completion`` output
    tokens from 0 (one empty span when there are none); [] when the engine does not say."""
    value = meta.get("weight_versions")
    if value is None:
        return []
    if not isinstance(value, list) or not value or len(value) > completion + 1:
        raise protocol_error(_ENGINE, f"weight_versions {str(value)[:200]} is not a list of spans")
    spans: list[sidecar_pb2.WeightVersionSpan] = []
    at = 0
    for item in value:
        version = item.get("version") if isinstance(item, dict) else None
        start = exact_integer(item.get("start")) if isinstance(item, dict) else None
        end = exact_integer(item.get("end")) if isinstance(item, dict) else None
        if (
            not isinstance(version, str)
            or len(version) > MAX_WEIGHT_VERSION_CHARS
            or start != at
            or end is None
            or not start <= end <= completion
            or (end == start and completion > 0)
        ):
            raise protocol_error(
                _ENGINE, f"weight_versions entry {str(item)[:200]} does not continue the spans at {at}"
            )
        spans.append(sidecar_pb2.WeightVersionSpan(version=version, start=start, end=end))
        at = end
    if at != completion:
        raise protocol_error(_ENGINE, f"weight_versions end at {at}, the output has {completion} tokens")
    return spans


def _routed_experts(meta: Mapping[str, object]) -> bytes | None:
    """``meta_info.routed_experts`` (base64 of little-endian int32s) as its bytes; None when
    absent (an engine started without --enable-return-routed-experts sends none)."""
    value = meta.get("routed_experts")
    if value is None:
        return None
    # Base64 is 4 characters per 3 bytes: a longer text would decode past the bound.
    if not isinstance(value, str) or len(value) > (MAX_ROUTED_EXPERTS_BYTES + 2) // 3 * 4:
        raise protocol_error(_ENGINE, "routed_experts is not base64 text within the size bound")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise protocol_error(_ENGINE, "routed_experts is not base64") from None
    if len(raw) % 4:
        raise protocol_error(_ENGINE, f"routed_experts has {len(raw)} bytes, not whole int32s")
    return raw


def _attach_sampling_mask(
    out: sidecar_pb2.LLMEngineOutput, meta: Mapping[str, object], start: int, count: int
) -> None:
    """SGLang's ``output_token_sampling_mask`` and ``output_token_sampling_logprobs`` rows of
    this output's ``count`` tokens from ``start``, as ``engine_data.sampling_mask`` (per token
    the ids sampling could choose) and ``engine_data.sampling_logprobs`` (per token a logprob,
    or one per id in ``support`` mode). Absent when the engine sent none."""
    masks = _list(meta, "output_token_sampling_mask")
    if masks is None:
        return
    logprobs = _list(meta, "output_token_sampling_logprobs") or []
    mask_rows, logprob_rows = masks[start : start + count], logprobs[start : start + count]
    if len(mask_rows) != count or len(logprob_rows) != count:
        raise protocol_error(_ENGINE, f"the sampling mask has {len(mask_rows)} rows for {count} tokens")
    entries = 0
    for row, values in zip(mask_rows, logprob_rows, strict=True):
        if not isinstance(row, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _UINT32_MAX for t in row
        ):
            raise protocol_error(_ENGINE, f"a sampling mask row {str(row)[:200]} is not token ids")
        numbers = values if isinstance(values, list) else [values]
        if not all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in numbers
        ):
            raise protocol_error(_ENGINE, f"a sampling logprob {str(values)[:200]} is not a number")
        entries += len(row) + len(numbers)
    if entries > MAX_SAMPLING_MASK_ENTRIES:
        raise protocol_error(_ENGINE, f"the sampling mask of one output has {entries} entries")
    out.engine_data.update({"sampling_mask": mask_rows, "sampling_logprobs": logprob_rows})  # type: ignore[dict-item]


_FINISH_KINDS: Final = {"stop", "length", "abort"}


def _answered_abort(finish: Mapping[str, object]) -> bool:
    """An abort SGLang made with no status of its own (a pause's, an abort request's, a weight
    update's abort of everything): SGLang answers it with the output so far, and so does the
    sidecar (a CANCELLED terminal). An abort with a status is a refusal or a failure (an error)."""
    return finish.get("status_code") is None and finish.get("err_type") is None


def _finish(meta: Mapping[str, object]) -> Mapping[str, object]:
    reason = meta.get("finish_reason")
    if isinstance(reason, str) and reason in _FINISH_KINDS:
        return {"type": reason}
    if isinstance(reason, dict) and reason.get("type") in _FINISH_KINDS:
        return reason
    # meta values are decoded JSON (either wire), so they always encode back.
    shown = "" if reason is None else f" (got {json.dumps(reason)[:200]})"
    raise protocol_error(_ENGINE, f"missing finish_reason{shown}")


@dataclass
class ResponseState:
    """One generation's stream, fed one decoded event at a time.

    ``cumulative``: the engine sends all ids so far in every event (SGLang's default) rather
    than deltas (``--incremental-streaming-output``); logprob lists follow the same form.
    """

    request: NativeRequest
    cumulative: bool
    done: bool = False
    # Tokens forwarded so far; in cumulative mode also where the next event's new ids start.
    completion_tokens: int = 0
    _text_offset: int = 0
    _input_meta: dict[str, object] = field(default_factory=dict)
    _prompt_logprobs_sent: bool = False

    def handoff(self) -> sidecar_pb2.LLMEngineOutput:
        """The prefill handoff, before the terminal (HTTP sends it once headers arrive)."""
        out = sidecar_pb2.LLMEngineOutput()
        if self.request.bootstrap is not None:
            bootstrap_handoff.attach(out, handoff_info(self.request.bootstrap))
        return out

    def feed(self, event: NativeEvent, *, aborted_by_us: bool) -> list[sidecar_pb2.LLMEngineOutput]:
        """The outputs for one event (zero or one). Raises SidecarError; never after done."""
        if self.done:
            raise protocol_error(_ENGINE, "a message after the terminal")
        for key in ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs"):
            # SGLang repeats the prompt's logprobs on every event after prefill; a server that
            # sends them once and then empty lists loses nothing: keep the fullest list seen.
            value = event.meta.get(key)
            held = self._input_meta.get(key)
            if isinstance(value, list) and (not isinstance(held, list) or len(value) > len(held)):
                self._input_meta[key] = value
        finished = event.finished or event.meta.get("finish_reason") is not None
        start = self.completion_tokens if self.cumulative else 0
        if not finished:
            if self.request.prefill:
                return []
            out = self._delta(event)
            if out is None:
                return []
            self._attach_weight_version(out, event.meta)
            self._attach_chosen_ids(out, event.meta, start, len(out.token_ids))
            if self._input_meta.get("input_token_logprobs"):
                # SGLang sends the prompt's logprobs with the first event after prefill:
                # they go out with the first output that follows, not only with the last.
                self._attach_prompt_logprobs(out)
            return [out]
        finish = _finish(event.meta)
        if finish["type"] == "abort":
            self.done = True
            if self.request.prefill or not (aborted_by_us or _answered_abort(finish)):
                raise self._abort_error(finish, aborted_by_us)
            return [self._aborted(event, finish)]
        out = self._delta(event) if not self.request.prefill else None
        reported = exact_integer(event.meta.get("completion_tokens"))
        if not self.request.prefill and reported is not None and reported != self.completion_tokens:
            raise protocol_error(
                _ENGINE, f"completion_tokens is {reported} but {self.completion_tokens} tokens were streamed"
            )
        terminal = out if out is not None else sidecar_pb2.LLMEngineOutput()
        if not self.request.prefill:
            # Every row left: SGLang's prompt-only request (max_new_tokens 0) has one for the
            # position after the prompt, with no token.
            self._attach_chosen_ids(terminal, event.meta, start, None)
        self._terminal(terminal, finish, event.meta)
        if not self.request.prefill:
            self._attach_weights_and_experts(terminal, event.meta)
        else:
            # SGLang's prefill server answers the prompt's rows on its final output (collected
            # once the KV transfer is done, disaggregation/prefill.py); its decode server never
            # runs the prompt, so the frontend joins these with the decode's (docs/metadata.md).
            self._attach_routed_experts(terminal, event.meta)
        self.done = True
        return [terminal]

    def _aborted(self, event: NativeEvent, finish: Mapping[str, object]) -> sidecar_pb2.LLMEngineOutput:
        """The CANCELLED terminal of an abort answered as SGLang answers it: the tokens it made
        that were not forwarded yet, usage, weight-version spans and routed experts. In
        incremental mode the abort of a queued or held request repeats the last id it sent
        (SGLang's ``_handle_abort_req``), which its ``completion_tokens`` shows: only ids the
        count says are new are forwarded."""
        start = self.completion_tokens if self.cumulative else 0
        out: sidecar_pb2.LLMEngineOutput | None = None
        reported = exact_integer(event.meta.get("completion_tokens"))
        if self.cumulative or reported is None or reported - self.completion_tokens == len(event.output_ids):
            out = self._delta(event)
        terminal = out if out is not None else sidecar_pb2.LLMEngineOutput()
        if out is not None:
            self._attach_chosen_ids(terminal, event.meta, start, len(terminal.token_ids))
        self._terminal(terminal, finish, event.meta)
        self._attach_weights_and_experts(terminal, event.meta)
        return terminal

    def end_of_stream(self, *, aborted_by_us: bool) -> SidecarError:
        """The error for a stream that ended before its terminal."""
        if aborted_by_us:
            return SidecarError(FailureReason.CANCELLED, "Generate: the request was aborted (cancelled)")
        return SidecarError(
            FailureReason.ENGINE_SHUTDOWN, "Generate: the SGLang stream ended before its terminal"
        )

    def _delta(self, event: NativeEvent) -> sidecar_pb2.LLMEngineOutput | None:
        raw = event.output_ids
        start = self.completion_tokens if self.cumulative else 0
        if len(raw) < start:
            raise protocol_error(_ENGINE, f"cumulative output_ids shrank from {start} to {len(raw)}")
        # Only the new part is checked: a cumulative stream resends every id in every event.
        new = _token_ids(raw[start:] if start else raw)
        text: str | None = None
        if event.text is not None:
            text = event.text[self._text_offset :]  # the offset stays 0 in incremental mode
            if self.cumulative:
                self._text_offset = max(self._text_offset, len(event.text))
        if not new and not text:
            return None
        out = sidecar_pb2.LLMEngineOutput(token_ids=new)
        if text is not None:
            out.text = text
        if self.request.logprobs is not None and new:
            self._logprobs(out, event.meta, start, len(new))
        if self.request.return_sampling_mask and new:
            _attach_sampling_mask(out, event.meta, start, len(new))
        self.completion_tokens += len(new)
        return out

    def _logprobs(
        self, out: sidecar_pb2.LLMEngineOutput, meta: Mapping[str, object], start: int, n: int
    ) -> None:
        tokens = _list(meta, "output_token_logprobs")
        if tokens is None:
            raise protocol_error(_ENGINE, "logprobs were asked but output_token_logprobs is missing")
        window = tokens[start : start + n]
        if len(window) != n:
            raise protocol_error(_ENGINE, f"output_token_logprobs has {len(window)} entries for {n} tokens")
        tops = _list(meta, "output_top_logprobs") or []
        top_window = tops[start : start + n]
        limit = self.request.logprobs or 0
        for i, item in enumerate(window):
            triple = _triple(item, "output_token_logprobs")
            if triple[1] != out.token_ids[i]:
                raise protocol_error(
                    _ENGINE, f"logprob token {triple[1]} is not output id {out.token_ids[i]}"
                )
            out.log_probs.append(triple[0] if triple[0] is not None else 0.0)
            alts = top_window[i] if i < len(top_window) else None
            out.top_logprobs.append(_top_entries(triple, alts, limit, "output_top_logprobs"))

    def _terminal(
        self, out: sidecar_pb2.LLMEngineOutput, finish: Mapping[str, object], meta: Mapping[str, object]
    ) -> None:
        if finish["type"] == "length":
            out.finish_reason = sidecar_pb2.LENGTH
        elif finish["type"] == "abort":
            out.finish_reason = sidecar_pb2.CANCELLED
        else:
            out.finish_reason = sidecar_pb2.STOP
            matched = finish.get("matched")
            if isinstance(matched, str):
                out.stop_string = matched
            elif (
                isinstance(matched, int)
                and not isinstance(matched, bool)
                and matched in self.request.user_stop_token_ids
            ):
                out.stop_token_id = matched
        prompt = exact_integer(meta.get("prompt_tokens"))
        if prompt is None or not 0 <= prompt <= _UINT32_MAX // 2:
            # The engine always reports it; the request's length is the same number.
            prompt = len(self.request.input_ids)
        completion = self.completion_tokens  # a prefill streams nothing: 0
        usage = out.completion_usage
        usage.prompt_tokens = prompt
        usage.completion_tokens = completion
        usage.total_tokens = prompt + completion
        cached = exact_integer(meta.get("cached_tokens"))
        if cached is not None and cached >= 0:
            usage.cached_tokens = min(cached, prompt)
        if self.request.prefill and self.request.bootstrap is not None:
            bootstrap_handoff.attach(out, handoff_info(self.request.bootstrap))
        self._attach_prompt_logprobs(out)

    def _attach_weight_version(self, out: sidecar_pb2.LLMEngineOutput, meta: Mapping[str, object]) -> None:
        version = _weight_version(meta)
        if version is not None:
            out.weight_version = version

    def _attach_weights_and_experts(
        self, out: sidecar_pb2.LLMEngineOutput, meta: Mapping[str, object]
    ) -> None:
        """The terminal's label, spans over the whole output and (when asked) routed experts."""
        self._attach_weight_version(out, meta)
        out.weight_versions.extend(_weight_versions(meta, self.completion_tokens))
        self._attach_routed_experts(out, meta)

    def _attach_routed_experts(self, out: sidecar_pb2.LLMEngineOutput, meta: Mapping[str, object]) -> None:
        if self.request.return_routed_experts:
            experts = _routed_experts(meta)
            if experts is not None:
                out.routed_experts = experts

    def _attach_prompt_logprobs(self, out: sidecar_pb2.LLMEngineOutput) -> None:
        """``engine_data.prompt_logprobs`` once, on the first output that can carry them."""
        if self.request.prompt_logprobs is None or self._prompt_logprobs_sent:
            return
        positions = _prompt_positions(self._input_meta, self.request.prompt_logprobs)
        if positions is not None:
            prompt_logprobs.attach(out, positions, prompt_logprobs.Shape.LISTED)
            self._prompt_logprobs_sent = True
            if self.request.token_ids_logprob:
                chosen = _chosen_rows(self._input_meta, "input_token_ids_logprobs", 0, None)
                out.engine_data.update({"prompt_token_ids_logprobs": chosen})  # type: ignore[dict-item]

    def _attach_chosen_ids(
        self, out: sidecar_pb2.LLMEngineOutput, meta: Mapping[str, object], start: int, count: int | None
    ) -> None:
        """``token_ids_logprobs``: the rows of this output's positions (``count`` of them from
        ``start``; None: every row left)."""
        if not self.request.token_ids_logprob or self.request.logprobs is None:
            return
        rows = _chosen_rows(meta, "output_token_ids_logprobs", start, count)
        if count is not None and len(rows) != count:
            raise protocol_error(
                _ENGINE, f"output_token_ids_logprobs has {len(rows)} entries for {count} tokens"
            )
        for row in rows:
            entries = out.token_ids_logprobs.add().entries
            for item in row if isinstance(row, list) else ():
                assert isinstance(item, dict)
                if item["logprob"] is None:
                    raise protocol_error(_ENGINE, "an output_token_ids_logprobs entry has no logprob")
                entries.add(token_id=item["token_id"], logprob=item["logprob"])

    def _abort_error(self, finish: Mapping[str, object], aborted_by_us: bool) -> SidecarError:
        if aborted_by_us:
            return SidecarError(FailureReason.CANCELLED, "Generate: the request was aborted (cancelled)")
        status = exact_integer(finish.get("status_code"))
        reason = abort_reason(status)
        said = finish.get("message")
        if reason is not FailureReason.UNKNOWN and isinstance(said, str) and said:
            # A refusal or a busy engine: the client reads SGLang's own sentence.
            return engine_words(reason, said, "Generate", f"abort status_code={status}")
        parts = [f"type={finish.get('type')}"]
        for key in ("status_code", "err_type"):
            if finish.get(key) is not None:
                parts.append(f"{key}={finish.get(key)}")
        message = f"Generate: engine aborted the request: {finish.get('message', '')} ({', '.join(parts)})"
        return SidecarError(reason, message)
