"""Decoding SGLang's gRPC ``GenerateResponse`` bytes into a :class:`NativeEvent` (pure, per request).

Every ``meta_info`` value on SGLang's gRPC wire is JSON text, and in cumulative mode (SGLang's
default) every message restates every output id and every logprob entry so far. Parsed whole,
message after message, a request costs the square of its output. So the message is read from
its wire bytes here rather than through the generated class:

* Only the keys the response state machine reads are decoded (the engine also sends ids,
  timings and counters nobody here uses), and the usage counts only on a finishing message.
* A value that only grows (the output ids, a logprob list) normally starts, byte for byte,
  with what the previous message carried: then only the new tail is parsed and appended.
  The prefix check is a byte comparison; whenever it does not hold the whole value is
  parsed, so the result is always exactly what parsing it whole gives.

Lenient where protobuf is strict, as for every meta_info key: a value that is not UTF-8 JSON
is absent. A message whose framing does not parse is a PROTOCOL_ERROR.
"""

from __future__ import annotations

import json
from typing import Final

from sidecar_common.errors import protocol_error
from sidecar_sglang.convert_request import NativeRequest
from sidecar_sglang.convert_response import NativeEvent

__all__ = ["ABSENT", "CumulativeJsonList", "GrpcEventDecoder", "parse_json"]

ABSENT: Final = object()
_ENGINE: Final = "sglang"

# GenerateResponse: output_ids = 1 (repeated int32), meta_info = 2 (map<string, string>),
# finished = 3 (bool). A map entry: key = 1, value = 2.
_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5
_IDS_PACKED: Final = (1 << 3) | _LEN
_IDS_ONE: Final = (1 << 3) | _VARINT
_META: Final = (2 << 3) | _LEN
_FINISHED: Final = (3 << 3) | _VARINT
_KEY: Final = (1 << 3) | _LEN
_VALUE: Final = (2 << 3) | _LEN

# What every message may need; the usage counts matter only on the terminal.
_ALWAYS: Final = (b"finish_reason", b"weight_version")
_ON_TERMINAL: Final = (b"completion_tokens", b"prompt_tokens", b"cached_tokens", b"weight_versions")
_OUTPUT_LOGPROBS: Final = (b"output_token_logprobs", b"output_top_logprobs")
_INPUT_LOGPROBS: Final = (b"input_token_logprobs", b"input_top_logprobs")


def parse_json(data: bytes) -> object:
    """The JSON value of UTF-8 ``data``, or :data:`ABSENT` when it is not that (a value the
    engine garbled is treated as missing, as for every meta_info key)."""
    try:
        return json.loads(data.decode())
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return ABSENT


class CumulativeJsonList:
    """One meta_info key whose value is a JSON list that grows by appending, message by message.

    ``parse`` returns what :func:`parse_json` of the value returns. A list result is owned by
    this object and may grow in place on a later call: callers read it and slice it, and do
    not keep it across messages expecting it unchanged.
    """

    __slots__ = ("_head", "_items")

    def __init__(self) -> None:
        # The previous value minus its closing bracket and the whitespace around it, when that
        # value was a non-empty JSON list: a later value starting with it extends that list.
        # A view into the previous message, not a copy (copying would cost what it saves).
        self._head: memoryview | None = None
        self._items: list[object] = []

    def parse(self, data: bytes, start: int = 0, end: int | None = None) -> object:
        """The value ``data[start:end]`` (slicing only what is new)."""
        stop = len(data) if end is None else end
        head = self._head
        if head is not None and data.startswith(head, start, stop):
            tail = data[start + len(head) : stop].strip()
            if tail == b"]":
                return self._items
            if tail.startswith(b",") and not tail[1:].lstrip().startswith(b"]"):
                # After the head the parser stands between two top-level items of the list
                # (the head was a whole list but its bracket, and ends on a character
                # boundary): the tail is a comma, the new items, the bracket, nothing else.
                added = parse_json(b"[" + tail[1:])
                if isinstance(added, list):
                    self._items.extend(added)
                    self._head = _head(data, start, stop)
                    return self._items
        value = parse_json(data[start:stop])
        if isinstance(value, list) and value:
            self._items = value
            self._head = _head(data, start, stop)
        else:
            self._items = []
            self._head = None
        return value


_SPACE: Final = b" \t\n\r"


def _head(data: bytes, start: int, stop: int) -> memoryview:
    """``data[start:stop]``, a JSON list, without its closing bracket and the whitespace
    around it, as a view."""
    while data[stop - 1] in _SPACE:
        stop -= 1
    stop -= 1  # the bracket
    while stop > start and data[stop - 1] in _SPACE:
        stop -= 1
    return memoryview(data)[start:stop]


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def _int32(value: int) -> int:
    # An int32 on the wire: negative numbers are sign-extended to 64 bits; protobuf keeps
    # the low 32 bits.
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def _skip(data: bytes, pos: int, end: int, wire: int) -> int:
    if wire == _VARINT:
        return _varint(data, pos, end)[1]
    if wire == _FIXED64:
        pos += 8
    elif wire == _FIXED32:
        pos += 4
    elif wire == _LEN:
        size, pos = _varint(data, pos, end)
        pos += size
    else:
        raise ValueError(f"wire type {wire}")
    if pos > end:
        raise ValueError("truncated field")
    return pos


def _packed_ids(data: bytes, pos: int, end: int, into: list[int]) -> None:
    while pos < end:
        value, pos = _varint(data, pos, end)
        into.append(_int32(value))


def _entry(data: bytes, pos: int, end: int) -> tuple[bytes, int, int]:
    """A map entry's key and the bounds of its value (empty when absent)."""
    key = b""
    value_start = value_end = pos
    while pos < end:
        tag, pos = _varint(data, pos, end)
        if tag in (_KEY, _VALUE):
            size, pos = _varint(data, pos, end)
            if pos + size > end:
                raise ValueError("truncated map entry")
            if tag == _KEY:
                key = data[pos : pos + size]
            else:
                value_start, value_end = pos, pos + size
            pos += size
        else:
            pos = _skip(data, pos, end, tag & 7)
    return key, value_start, value_end


class _Ids:
    """The output ids: in cumulative mode, the packed bytes of one message start with the
    previous message's, so only the new varints are read."""

    __slots__ = ("_bytes", "_cumulative", "_ids")

    def __init__(self, cumulative: bool) -> None:
        self._cumulative = cumulative
        self._bytes: bytes | memoryview = b""  # the previous message's, as a view
        self._ids: list[int] = []

    def packed(self, data: bytes, start: int, end: int) -> list[int]:
        seen = self._bytes
        if self._cumulative and seen and end - start >= len(seen) and data.startswith(seen, start, end):
            _packed_ids(data, start + len(seen), end, self._ids)
        else:
            self._ids = []
            _packed_ids(data, start, end, self._ids)
        if self._cumulative:
            self._bytes = memoryview(data)[start:end]
        return self._ids

    def forget(self) -> None:
        """The ids came in another shape (unpacked, or in several runs): no prefix to reuse."""
        self._bytes = b""
        self._ids = []


class GrpcEventDecoder:
    """Decodes one generation's gRPC messages (see the module docstring)."""

    __slots__ = ("_ids", "_lists", "_plain")

    def __init__(self, request: NativeRequest, *, cumulative: bool) -> None:
        lists: list[bytes] = []
        if request.logprobs is not None:
            lists += _OUTPUT_LOGPROBS
        if request.prompt_logprobs is not None:
            lists += _INPUT_LOGPROBS
        self._ids = _Ids(cumulative)
        if cumulative:
            self._lists = {key: CumulativeJsonList() for key in lists}
            self._plain: frozenset[bytes] = frozenset(_ALWAYS)
        else:
            # Incremental lists are new entries only (or the prompt's once): nothing to reuse.
            self._lists = {}
            self._plain = frozenset((*_ALWAYS, *lists))

    def decode(self, data: bytes) -> NativeEvent:
        """One message's wire bytes; PROTOCOL_ERROR when they are not a GenerateResponse.

        The event's lists (ids, logprobs) may grow in place at the next ``decode``: feed
        each event before decoding the next message.
        """
        try:
            return self._decode(data)
        except (ValueError, IndexError) as err:
            raise protocol_error(_ENGINE, f"a Generate message that does not parse: {err}") from None

    def _decode(self, data: bytes) -> NativeEvent:
        end = len(data)
        pos = 0
        ids: list[int] = []
        id_runs = 0
        finished = False
        # Entries by key, the last one winning (protobuf's rule for a repeated map key).
        entries: dict[bytes, tuple[int, int]] = {}
        while pos < end:
            # Tags and most sizes fit one byte: read those inline (a call per varint costs
            # more than the rest of the framing).
            tag = data[pos]
            if tag < 0x80:
                pos += 1
            else:
                tag, pos = _varint(data, pos, end)
            if tag == _META:
                size = data[pos] if pos < end else 0x80
                if size < 0x80:
                    pos += 1
                else:
                    size, pos = _varint(data, pos, end)
                entry_end = pos + size
                if entry_end > end:
                    raise ValueError("truncated meta_info entry")
                key_size = data[pos + 1] if size > 2 else 0x80
                key_end = pos + 2 + key_size
                if data[pos] == _KEY and key_size < 0x80 and key_end < entry_end and data[key_end] == _VALUE:
                    # The usual entry: key, then value, nothing else.
                    key = data[pos + 2 : key_end]
                    value_size, value_start = _varint(data, key_end + 1, entry_end)
                    value_end = value_start + value_size
                    if value_end != entry_end:
                        key, value_start, value_end = _entry(data, pos, entry_end)
                else:
                    key, value_start, value_end = _entry(data, pos, entry_end)
                entries[key] = (value_start, value_end)
                pos = entry_end
            elif tag == _IDS_PACKED:
                size, pos = _varint(data, pos, end)
                if pos + size > end:
                    raise ValueError("truncated output_ids")
                id_runs += 1
                if id_runs == 1:
                    ids = self._ids.packed(data, pos, pos + size)
                else:
                    if id_runs == 2:
                        ids = list(ids)
                        self._ids.forget()
                    _packed_ids(data, pos, pos + size, ids)
                pos += size
            elif tag == _IDS_ONE:
                number, pos = _varint(data, pos, end)
                if id_runs < 2:
                    ids = list(ids)
                    self._ids.forget()
                id_runs = 2
                ids.append(_int32(number))
            elif tag == _FINISHED:
                number, pos = _varint(data, pos, end)
                finished = number != 0
            else:
                pos = _skip(data, pos, end, tag & 7)
        if id_runs == 0:
            self._ids.forget()
        meta: dict[str, object] = {}
        for key, (value_start, value_end) in entries.items():
            parser = self._lists.get(key)
            if parser is not None:
                value = parser.parse(data, value_start, value_end)
            elif key in self._plain:
                value = parse_json(data[value_start:value_end])
            else:
                continue
            if value is not ABSENT:
                meta[key.decode()] = value
        if finished or meta.get("finish_reason") is not None:
            for key in _ON_TERMINAL:
                bounds = entries.get(key)
                if bounds is not None:
                    value = parse_json(data[bounds[0] : bounds[1]])
                    if value is not ABSENT:
                        meta[key.decode()] = value
        return NativeEvent(ids, meta, finished)
