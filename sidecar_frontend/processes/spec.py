"""What the parent of ``--processes N`` hands each process, and what a process tells back.

The parent writes a :class:`ChildSpec` on the process's stdin (an 8-byte length, then the
pickled spec: both ends are this package, in one interpreter's version) and keeps stdin open
for as long as the process runs: the process reads end-of-file there when the parent is gone
(even killed outright) and stops as after SIGTERM. After the spec, the parent writes the
membership API's changes there, and the weight versions admin calls set, one JSON line each;
the process writes JSON lines on its status pipe (``status_fd``): :func:`serving_line` once it
serves, and the admin changes it asks for (sidecar_frontend/membership_relay.py).
"""

from __future__ import annotations

import json
import pickle
import struct
from dataclasses import dataclass
from typing import BinaryIO, Final

from sidecar_frontend.cli import FrontendConfig
from sidecar_frontend.membership import Registration

__all__ = ["ChildSpec", "parse_status", "read_spec", "serving_line", "spec_bytes"]

_LENGTH: Final = struct.Struct(">Q")


@dataclass(frozen=True)
class ChildSpec:
    config: FrontendConfig
    index: int  # 0 .. N-1, the ``process`` field of its log lines and label of its metrics
    listen_fds: tuple[int, ...]  # the sockets the parent bound for it, one per --listen address
    status_fd: int  # the write end of its status pipe
    # The membership API's registrations when the process was started (later changes follow
    # on stdin).
    registrations: tuple[Registration, ...] = ()
    # The fleet's weight version an admin call set (POST /weight_version) when the process
    # was started; None: none was.
    weight_version: str | None = None


def spec_bytes(spec: ChildSpec) -> bytes:
    body = pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


def read_spec(stream: BinaryIO) -> ChildSpec:
    """The spec from ``stream`` (the process's stdin); ValueError when it is not there."""
    head = _read_exactly(stream, _LENGTH.size)
    if len(head) != _LENGTH.size:
        raise ValueError("no process spec on stdin: this module is started by sidecar-frontend --processes")
    (length,) = _LENGTH.unpack(head)
    body = _read_exactly(stream, length)
    if len(body) != length:
        raise ValueError("a truncated process spec on stdin")
    spec = pickle.loads(body)  # our own parent's bytes, through a pipe it created
    if not isinstance(spec, ChildSpec):
        raise ValueError("stdin held something other than a process spec")
    return spec


def _read_exactly(stream: BinaryIO, size: int) -> bytes:
    """``size`` bytes, fewer only at end of file: an unbuffered pipe returns what it holds, and
    the spec is read unbuffered so that no line after it is read ahead and lost."""
    chunks: list[bytes] = []
    left = size
    while left:
        chunk = stream.read(left)
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def serving_line(metrics_port: int) -> bytes:
    return json.dumps({"event": "serving", "metrics_port": metrics_port}).encode() + b"\n"


def parse_status(line: bytes) -> int | None:
    """The metrics port a ``serving`` status line names (None for any other line)."""
    try:
        entry = json.loads(line)
    except ValueError:
        return None
    if isinstance(entry, dict) and entry.get("event") == "serving":
        port = entry.get("metrics_port")
        if isinstance(port, int) and 0 < port < 65536:
            return port
    return None
