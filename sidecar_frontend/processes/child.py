"""One process of ``sidecar-frontend --processes N``: ``python -m sidecar_frontend.processes.child``,
started by the parent (sidecar_frontend/processes/parent.py), never by hand.

It reads its :class:`~sidecar_frontend.processes.spec.ChildSpec` from stdin, then runs one
whole frontend (:func:`sidecar_frontend.server.serve`) on the sockets the parent bound for it,
its log lines carrying ``process`` (its index). It stops as one frontend does on SIGTERM
(the parent forwards its own), and also when its stdin ends: the parent is gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading

import structlog

from sidecar_common.programs import EXIT_USAGE, run_event_loop
from sidecar_frontend.processes.spec import ChildSpec, read_spec, serving_line
from sidecar_frontend.server import Inherited, serve

__all__ = ["main", "run"]


def _stop_when_orphaned() -> None:
    """SIGTERM to this process once its stdin ends (the parent exited or was killed): it then
    drains as after the parent's own SIGTERM, and no frontend outlives its supervisor."""
    # os.read, not sys.stdin: a daemon thread blocked inside a buffered reader's lock stops
    # the interpreter's exit with a fatal error.
    while os.read(sys.stdin.fileno(), 65536):
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def run(spec: ChildSpec) -> int:
    listeners = tuple(socket.socket(fileno=fd) for fd in spec.listen_fds)
    status = os.fdopen(spec.status_fd, "wb", buffering=0)

    def serving(metrics_port: int) -> None:
        # The parent gone (the pipe broken): the orphan watch stops this process.
        with contextlib.suppress(OSError):
            status.write(serving_line(metrics_port))

    structlog.contextvars.bind_contextvars(process=spec.index)
    threading.Thread(target=_stop_when_orphaned, name="orphan-watch", daemon=True).start()
    try:
        return run_event_loop(serve, spec.config, Inherited(spec.index, listeners, serving))
    finally:
        with contextlib.suppress(OSError):
            status.close()


def main() -> None:
    try:
        spec = read_spec(sys.stdin.buffer)
    except ValueError as err:
        print(f"sidecar_frontend.processes.child: {err}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None
    raise SystemExit(run(spec))


if __name__ == "__main__":
    main()
