"""Decoding SGLang's gRPC ``GenerateResponse`` into a :class:`NativeEvent` (pure, per request).

Every ``meta_info`` value on SGLang's gRPC wire is JSON text. Two costs are avoided here:

* Only the keys the response state machine reads are decoded (the engine also sends ids,
  timings and counters nobody here uses), and the usage counts only on a finishing message.
* In cumulative mode the logprob lists restate every earlier entry in every message, so
  decoding them whole makes a request's cost grow with the square of its output. A list's
  text in one message normally starts with the previous message's text minus its closing
  bracket: then only the new tail is parsed and appended. Whenever that does not hold, the
  whole value is parsed, so the result is always exactly what ``json.loads`` of the full
  text gives.
"""

from __future__ import annotations

import json
from typing import Final

from sidecar_common.api import sglang_pb2
from sidecar_sglang.convert_request import NativeRequest
from sidecar_sglang.convert_response import NativeEvent

__all__ = ["ABSENT", "CumulativeJsonList", "GrpcEventDecoder", "parse_json"]

ABSENT: Final = object()
# What every message may need; the usage counts matter only on the terminal.
_ALWAYS: Final = ("finish_reason",)
_ON_TERMINAL: Final = ("completion_tokens", "prompt_tokens", "cached_tokens")
_OUTPUT_LOGPROBS: Final = ("output_token_logprobs", "output_top_logprobs")
_INPUT_LOGPROBS: Final = ("input_token_logprobs", "input_top_logprobs")


def parse_json(text: str) -> object:
    """The JSON value of ``text``, or :data:`ABSENT` for text that is not JSON (a value
    the engine garbled is treated as missing, as for every meta_info key)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return ABSENT


class CumulativeJsonList:
    """One meta_info key whose value is a JSON list that grows by appending, message by message.

    ``parse`` returns what ``json.loads(text)`` returns (or the absent marker). When the
    result is a list it is owned by this object and may grow in place on a later call:
    callers read it, slice it, and do not keep it across messages expecting it unchanged.
    """

    __slots__ = ("_head", "_items")

    def __init__(self) -> None:
        # The previous text minus its closing bracket (and the whitespace around it), when that
        # text was a non-empty JSON list: a later text starting with it extends that list.
        self._head: str | None = None
        self._items: list[object] = []

    def parse(self, text: str) -> object:
        head = self._head
        if head is not None and text.startswith(head):
            tail = text[len(head) :].strip()
            if tail == "]":
                return self._items
            if tail.startswith(",") and not tail[1:].lstrip().startswith("]"):
                # After the head the parser stands between two top-level items of the
                # list (the head was a whole list but its bracket): the tail is a
                # comma and the new items, then the bracket, and nothing else.
                added = parse_json("[" + tail[1:])
                if isinstance(added, list):
                    self._items.extend(added)
                    self._head = text.rstrip()[:-1].rstrip()
                    return self._items
        return self._full(text)

    def _full(self, text: str) -> object:
        value = parse_json(text)
        if isinstance(value, list) and value:
            self._items = value
            self._head = text.rstrip()[:-1].rstrip()
        else:
            self._items = []
            self._head = None
        return value


class GrpcEventDecoder:
    """Decodes one generation's gRPC messages: only the keys its request needs, and in
    cumulative mode the logprob lists by their new tail."""

    __slots__ = ("_lists", "_plain")

    def __init__(self, request: NativeRequest, *, cumulative: bool) -> None:
        lists: list[str] = []
        if request.logprobs is not None:
            lists += _OUTPUT_LOGPROBS
        if request.prompt_logprobs is not None:
            lists += _INPUT_LOGPROBS
        if cumulative:
            self._lists = {key: CumulativeJsonList() for key in lists}
            self._plain: tuple[str, ...] = _ALWAYS
        else:
            # Incremental lists are new entries only (or the prompt's once): nothing to reuse.
            self._lists = {}
            self._plain = _ALWAYS + tuple(lists)

    def decode(self, message: sglang_pb2.GenerateResponse) -> NativeEvent:
        raw = message.meta_info
        meta: dict[str, object] = {}
        for key in self._plain:
            text = raw.get(key)
            if text is not None:
                value = parse_json(text)
                if value is not ABSENT:
                    meta[key] = value
        for key, parser in self._lists.items():
            text = raw.get(key)
            if text is not None:
                value = parser.parse(text)
                if value is not ABSENT:
                    meta[key] = value
        finished = message.finished
        if finished or meta.get("finish_reason") is not None:
            for key in _ON_TERMINAL:
                text = raw.get(key)
                if text is not None:
                    value = parse_json(text)
                    if value is not ABSENT:
                        meta[key] = value
        # The repeated field is passed as is: the state machine slices off the part it needs.
        return NativeEvent(message.output_ids, meta, finished)
