"""One process of ``sidecar-frontend --processes N``: ``python -m sidecar_frontend.processes.child``,
started by the parent (sidecar_frontend/processes/parent.py), never by hand.

It reads its :class:`~sidecar_frontend.processes.spec.ChildSpec` from stdin, then runs one
whole frontend (:func:`sidecar_frontend.server.serve`) on the sockets the parent bound for it,
its log lines carrying ``process`` (its index). It stops as one frontend does on SIGTERM
(the parent forwards its own), and also when its stdin ends: the parent is gone. The lines the
parent writes on stdin after the spec (the membership API's changes) are handed to the event
loop in order (:class:`ControlInbox`); the changes this process asks for go on its status pipe.
The fleet's weight version an admin call set before this process started (its spec's) is
handed to the loop first, as the parent's own line would be, so the process serves with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable

import structlog

from sidecar_common.programs import EXIT_USAGE, run_event_loop
from sidecar_frontend.admin import ParentLink
from sidecar_frontend.membership_relay import SetVersion, set_version_line
from sidecar_frontend.processes.spec import ChildSpec, read_spec, serving_line
from sidecar_frontend.server import Inherited, serve

__all__ = ["ControlInbox", "main", "run"]


class ControlInbox:
    """The parent's lines, from the thread that reads stdin to the event loop, in order: those
    that come before the loop takes them (:meth:`attach`) wait, then go first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[bytes] = []
        self._handler: Callable[[bytes], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def attach(self, handler: Callable[[bytes], None]) -> None:
        """From the event loop: ``handler`` takes every line from now on, the waiting ones first."""
        loop = asyncio.get_running_loop()
        with self._lock:
            self._handler, self._loop = handler, loop
            for line in self._pending:
                loop.call_soon(handler, line)
            self._pending.clear()

    def put(self, line: bytes) -> None:
        """From the reading thread."""
        with self._lock:
            if self._handler is None or self._loop is None:
                self._pending.append(line)
                return
            with contextlib.suppress(RuntimeError):  # the loop closed: the process is ending
                self._loop.call_soon_threadsafe(self._handler, line)


def _read_parent(inbox: ControlInbox) -> None:
    """The parent's lines after the spec, to ``inbox``; then SIGTERM to this process once its
    stdin ends (the parent exited or was killed): it then drains as after the parent's own
    SIGTERM, and no frontend outlives its supervisor."""
    # os.read, not sys.stdin: a daemon thread blocked inside a buffered reader's lock stops
    # the interpreter's exit with a fatal error.
    buffered = b""
    while chunk := os.read(sys.stdin.fileno(), 65536):
        buffered += chunk
        *lines, buffered = buffered.split(b"\n")
        for line in lines:
            if line.strip():
                inbox.put(line)
    os.kill(os.getpid(), signal.SIGTERM)


def run(spec: ChildSpec) -> int:
    listeners = tuple(socket.socket(fileno=fd) for fd in spec.listen_fds)
    status = os.fdopen(spec.status_fd, "wb", buffering=0)

    def serving(metrics_port: int) -> None:
        # The parent gone (the pipe broken): the orphan watch stops this process.
        with contextlib.suppress(OSError):
            status.write(serving_line(metrics_port))

    def send(line: bytes) -> None:
        # One write of a short line to a pipe: never interleaved with another line.
        status.write(line)

    inbox = ControlInbox()
    if spec.weight_version is not None:
        # Before the reader thread starts: ahead of every line the parent writes later.
        inbox.put(set_version_line(SetVersion(spec.weight_version, origin=-1, id=0)))
    parent = ParentLink(spec.index, send, inbox.attach, spec.registrations)
    structlog.contextvars.bind_contextvars(process=spec.index)
    threading.Thread(target=_read_parent, args=(inbox,), name="parent-reader", daemon=True).start()
    try:
        return run_event_loop(serve, spec.config, Inherited(spec.index, listeners, serving, parent))
    finally:
        with contextlib.suppress(OSError):
            status.close()


def main() -> None:
    try:
        # Unbuffered: a buffered reader would read ahead the parent's first lines after the
        # spec, and the thread reading stdin (os.read) would never see them.
        spec = read_spec(os.fdopen(sys.stdin.fileno(), "rb", buffering=0, closefd=False))
    except ValueError as err:
        print(f"sidecar_frontend.processes.child: {err}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None
    raise SystemExit(run(spec))


if __name__ == "__main__":
    main()
