"""An incremental Server-Sent Events parser (pure): feed bytes as they arrive, get the
``data`` payload of every complete event.

It keeps only the unfinished tail between reads, so a line of any length split across any
number of reads parses the same as in one piece (SGLang's logprob events can be long).
Handles LF, CRLF and CR line ends, comments (``:``), blank lines, multi-line ``data`` (joined
with ``\\n``), and ignores the other SSE fields (event, id, retry).
"""

from __future__ import annotations

__all__ = ["SseParser"]


class SseParser:
    def __init__(self) -> None:
        self._buffer = bytearray()
        self._data: list[str] | None = None
        self._skip_lf = False

    def feed(self, chunk: bytes) -> list[str]:
        """The data payloads of the events completed by ``chunk``, in order."""
        events: list[str] = []
        buffer = self._buffer
        buffer.extend(chunk)
        start = 0
        length = len(buffer)
        while start < length:
            if self._skip_lf:
                # A CR ended the previous line; a LF right after it belongs to the same end.
                self._skip_lf = False
                if buffer[start] == 0x0A:
                    start += 1
                    continue
            lf = buffer.find(b"\n", start)
            cr = buffer.find(b"\r", start)
            if lf < 0 and cr < 0:
                break
            if cr >= 0 and (lf < 0 or cr < lf):
                end, self._skip_lf = cr, True
            else:
                end = lf
            self._line(bytes(buffer[start:end]), events)
            start = end + 1
        del buffer[:start]
        return events

    def _line(self, raw: bytes, events: list[str]) -> None:
        if not raw:
            if self._data is not None:
                events.append("\n".join(self._data))
                self._data = None
            return
        line = raw.decode("utf-8", errors="replace")
        if line.startswith(":"):
            return
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            if self._data is None:
                self._data = []
            self._data.append(value)
