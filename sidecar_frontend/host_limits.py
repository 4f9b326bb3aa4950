"""The host's limits on connections, as the frontend meets them at start: the open files limit
(every connection is one open file) and the listen backlog's cap (``net.core.somaxconn``).

The decisions are pure (:func:`open_files_target`, :func:`open_files_problem`,
:func:`effective_backlog`); reading and setting the limits is :func:`raise_open_files` and
:func:`read_somaxconn`, and :func:`connection_limits` does both and logs them, once at start
before the frontend listens (the server's, or with ``--processes`` the parent's, whose limit
its processes inherit).

The frontend raises its soft ``RLIMIT_NOFILE`` to the hard limit: the soft limit is often
1,024, which ten thousand client connections would exhaust (``accept`` then fails with
EMFILE and clients wait in the backlog), while the hard limit, what the administrator allows,
is usually far above (systemd's default is 524,288; containers inherit their runtime's). It
never lowers a limit. With ``--min-open-files N``, a limit that stays below N is a start-up
failure naming both limits.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import structlog

from sidecar_frontend.cli import FrontendConfig

__all__ = [
    "OpenFiles",
    "connection_limits",
    "effective_backlog",
    "open_files_problem",
    "open_files_target",
    "raise_open_files",
    "read_somaxconn",
]

SOMAXCONN_PATH: Final = Path("/proc/sys/net/core/somaxconn")
NR_OPEN_PATH: Final = Path("/proc/sys/fs/nr_open")
# The kernel's own ceiling on a process's open files when the hard limit is "unlimited" and
# /proc does not say (Linux's default fs.nr_open).
_NR_OPEN_DEFAULT: Final = 1_048_576

log = structlog.get_logger("sidecar_frontend.host_limits")


@dataclass(frozen=True)
class OpenFiles:
    """The open files limit before and after the raise."""

    before: int  # the soft limit the process started with
    soft: int  # the soft limit now
    hard: int  # the hard limit (resource.RLIM_INFINITY: unlimited)


def open_files_target(soft: int, hard: int, ceiling: int) -> int:
    """The soft limit to set: the hard limit (``ceiling``, the kernel's own bound, when the hard
    limit is unlimited), never below ``soft``."""
    top = ceiling if hard == resource.RLIM_INFINITY else hard
    if soft == resource.RLIM_INFINITY:
        return soft
    return max(soft, top)


def open_files_problem(limits: OpenFiles, minimum: int | None) -> str | None:
    """Why the frontend must not start with ``limits`` (``--min-open-files``), or None."""
    if minimum is None or limits.soft == resource.RLIM_INFINITY or limits.soft >= minimum:
        return None
    hard = "unlimited" if limits.hard == resource.RLIM_INFINITY else str(limits.hard)
    return (
        f"the open files limit is {limits.soft} (hard limit {hard}), below --min-open-files "
        f"{minimum}: raise the hard limit (ulimit -Hn, systemd's LimitNOFILE=, the container "
        "runtime's nofile ulimit)"
    )


def effective_backlog(asked: int, somaxconn: int | None) -> int:
    """The backlog the kernel grants: ``asked``, capped at ``somaxconn`` when known."""
    if somaxconn is None or somaxconn <= 0:
        return asked
    return min(asked, somaxconn)


def raise_open_files() -> OpenFiles:
    """Raise this process's soft open files limit as far as the hard limit allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = open_files_target(soft, hard, _read_int(NR_OPEN_PATH) or _NR_OPEN_DEFAULT)
    if target != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            target = soft  # refused (a sandbox's own cap): keep what there is, the log says so
    return OpenFiles(before=soft, soft=target, hard=hard)


def read_somaxconn() -> int | None:
    """``net.core.somaxconn`` (None where /proc does not say: another OS)."""
    return _read_int(SOMAXCONN_PATH)


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def connection_limits(config: FrontendConfig) -> str | None:
    """Raise the open files limit, log it with the listen backlog the kernel grants (one
    ``connection limits`` line); why the frontend must not start (--min-open-files), or None."""
    files = raise_open_files()
    somaxconn = read_somaxconn()
    backlog = config.connections.backlog
    log.info(
        "connection limits",
        open_files=files.soft,
        open_files_hard=files.hard,
        open_files_raised_from=files.before if files.before != files.soft else None,
        listen_backlog=effective_backlog(backlog, somaxconn),
        listen_backlog_asked=backlog,
        somaxconn=somaxconn,
        keepalive_timeout_secs=config.connections.keepalive_timeout,
    )
    problem = open_files_problem(files, config.connections.min_open_files)
    if problem is not None:
        return f"{problem} ({config.sources.naming('min_open_files')})"
    return None
