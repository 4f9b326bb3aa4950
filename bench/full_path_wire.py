"""What ``bench.full_path`` sends and how it reads the answers (pure: bytes in, values out).

Both sides get the same request: SGLang's native ``POST /generate`` with token ids, which our
frontend serves and SMG serves in front of a gRPC worker::

    {"model": M, "input_ids": [16 ids], "sampling_params": {"max_new_tokens": N,
     "ignore_eos": true}, "stream": true|false}

Both answer a stream as SSE ``data:`` events whose ``meta_info`` carries ``completion_tokens``
(the tokens so far) and ``finish_reason`` (null until the last), then ``data: [DONE]``. Tokens
are counted from ``completion_tokens``, not from ``output_ids``: SMG's terminal event repeats
the last id, our frontend's carries none. An error inside a stream is a ``data: {"error": ...}``
event on both. A non-streamed answer is one JSON object (SMG: a list holding it) with every
``output_ids``.

An answer is an error of one kind (:class:`ErrorKind`): ``http_<status>`` when its status is
not 200; ``sse_error_event`` when its stream carries an error event; ``abort_finish`` when it
finishes as aborted (SGLang's ``finish_reason`` of type ``abort``, with the status the failure
would have had: how our frontend ends a stream whose worker failed after the headers went
out); ``incomplete`` when it ends before its finish; ``short`` when it finishes with fewer
tokens than asked; ``bad_body`` when its body cannot be read; ``connection`` when the
connection fails.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

__all__ = [
    "DONE",
    "ErrorKind",
    "Event",
    "SseLines",
    "UnaryAnswer",
    "http_error",
    "parse_event",
    "parse_unary",
    "request_body",
    "stream_outcome",
]

_PROMPT_BASE = 1000
_PROMPT_SPREAD = 500
_COMPLETION = re.compile(rb'"completion_tokens":\s*(\d+)')
_NOT_FINISHED = re.compile(rb'"finish_reason":\s*null')
_FINISH_KEY = b'"finish_reason"'
DONE = b"[DONE]"


class ErrorKind(StrEnum):
    SSE_ERROR_EVENT = "sse_error_event"
    ABORT_FINISH = "abort_finish"
    INCOMPLETE = "incomplete"
    SHORT = "short"
    BAD_BODY = "bad_body"
    CONNECTION = "connection"


def http_error(status: int) -> str:
    """The error kind of a non-200 answer: ``http_<status>``."""
    return f"http_{status}"


def request_body(
    model: str, stream_index: int, seq: int, max_tokens: int, stream: bool, prompt_len: int
) -> bytes:
    """One request: a prompt of ``prompt_len`` ids that differs by stream and by request."""
    prompt = [_PROMPT_BASE + (stream_index * 7 + seq + i) % _PROMPT_SPREAD for i in range(prompt_len)]
    body = {
        "model": model,
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True},
        "stream": stream,
    }
    return json.dumps(body, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Event:
    """One SSE ``data:`` payload, read: the output's tokens so far (None: the event names no
    count), whether it is the last, whether it is an error, or the end marker."""

    completion_tokens: int | None = None
    finished: bool = False
    error: str | None = None
    done: bool = False
    aborted: str | None = None  # the abort finish, as sent


def parse_event(payload: bytes) -> Event:
    """Read one ``data:`` payload without decoding the JSON when its count can be found by
    pattern (the common event); anything else is decoded."""
    if payload == DONE:
        return Event(done=True)
    match = _COMPLETION.search(payload)
    if match is not None and b'"error"' not in payload and b'"abort"' not in payload:
        finished = _FINISH_KEY in payload and _NOT_FINISHED.search(payload) is None
        return Event(completion_tokens=int(match.group(1)), finished=finished)
    try:
        value = json.loads(payload)
    except ValueError:
        return Event(error=f"unreadable event: {payload[:120]!r}")
    if not isinstance(value, dict):
        return Event(error=f"unexpected event: {payload[:120]!r}")
    if "error" in value:
        return Event(error=json.dumps(value["error"])[:300])
    meta = value.get("meta_info")
    if isinstance(meta, dict):
        reason = meta.get("finish_reason")
        ids = value.get("output_ids")
        count = meta.get("completion_tokens")
        if not isinstance(count, int):
            count = len(ids) if isinstance(ids, list) else None
        kind = reason.get("type") if isinstance(reason, dict) else reason
        aborted = json.dumps(reason)[:300] if kind == "abort" else None
        return Event(completion_tokens=count, finished=reason is not None, aborted=aborted)
    return Event()


class SseLines:
    """Splits a response body, as it arrives in pieces, into the payloads of its ``data:``
    lines; an ``event: error`` line is reported as an error payload."""

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, data: bytes) -> list[bytes]:
        text = self._rest + data
        lines = text.split(b"\n")
        self._rest = lines.pop()
        payloads: list[bytes] = []
        for line in lines:
            if line.startswith(b"data:"):
                payloads.append(line[5:].strip())
            elif line.startswith(b"event:") and line[6:].strip() == b"error":
                payloads.append(b'{"error": "event: error"}')
        return payloads


def stream_outcome(finished: bool, tokens: int, max_tokens: int, done: bool) -> ErrorKind | None:
    """What a stream that ended without an error event amounts to: None when it finished with
    every token asked for; ``incomplete`` when it ended before its finish (or its end marker);
    ``short`` when it finished with fewer tokens."""
    if not finished or not done:
        return ErrorKind.INCOMPLETE
    if tokens < max_tokens:
        return ErrorKind.SHORT
    return None


@dataclass(frozen=True)
class UnaryAnswer:
    tokens: int
    error: ErrorKind | None
    detail: str = ""


def parse_unary(body: bytes, max_tokens: int) -> UnaryAnswer:
    """Read a non-streamed 200 answer: its token count and whether it is whole."""
    try:
        value: Any = json.loads(body)
    except ValueError:
        return UnaryAnswer(0, ErrorKind.BAD_BODY, f"not JSON: {body[:120]!r}")
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, dict):
        return UnaryAnswer(0, ErrorKind.BAD_BODY, f"unexpected answer: {body[:120]!r}")
    if "error" in value:
        return UnaryAnswer(0, ErrorKind.BAD_BODY, json.dumps(value["error"])[:300])
    ids = value.get("output_ids")
    meta = value.get("meta_info")
    if not isinstance(ids, list) or not isinstance(meta, dict):
        return UnaryAnswer(0, ErrorKind.BAD_BODY, f"no output_ids or meta_info: {body[:120]!r}")
    reason = meta.get("finish_reason")
    if reason is None:
        return UnaryAnswer(len(ids), ErrorKind.INCOMPLETE, "no finish_reason")
    if (reason.get("type") if isinstance(reason, dict) else reason) == "abort":
        return UnaryAnswer(len(ids), ErrorKind.ABORT_FINISH, json.dumps(reason)[:300])
    if len(ids) < max_tokens:
        return UnaryAnswer(len(ids), ErrorKind.SHORT, f"{len(ids)} of {max_tokens} tokens")
    return UnaryAnswer(len(ids), None)
