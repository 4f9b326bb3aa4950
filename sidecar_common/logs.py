"""Logging: one format for our structlog lines and for libraries' stdlib logging.

Our own modules log through structlog (``structlog.get_logger(__name__)``), rendered by
structlog itself and written straight to the stream: no stdlib ``LogRecord`` per line (one
INFO line per request is on the request path; the stdlib route costs about three times as
much), and a call below the level is a no-op. Libraries that use stdlib ``logging`` (grpc,
aiohttp, asyncio, the testkit) reach a handler on the same stream with the same processors
and renderer, so a log shipper sees one format. Libraries are held at WARNING+: their
INFO/DEBUG chatter is not the operator's concern.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Final, TextIO

import structlog
from structlog.typing import Processor

# What the flags need (no structlog there, for the command lines); re-exported here.
from sidecar_common.log_settings import LOG_LEVELS, LogFormat, default_log_format

__all__ = ["LOG_LEVELS", "OUR_LOGGERS", "LogFormat", "configure_logging", "default_log_format"]

# Loggers that follow --log-level; everything else stays at WARNING or above.
OUR_LOGGERS: Final = (
    "sidecar_common",
    "sidecar_server",
    "sidecar_vllm",
    "sidecar_sglang",
    "sidecar_frontend",
    "testkit",
    "sidecar",
)

_HANDLER_NAME: Final = "sidecar-logs"


def _shared_processors(log_format: LogFormat) -> list[Processor]:
    processors: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.PositionalArgumentsFormatter(),
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    if log_format == "json":
        # JSON must stay one line per event: tracebacks become a string field.
        processors.append(structlog.processors.format_exc_info)
    return processors


def configure_logging(log_format: LogFormat, level: str = "info", *, stream: TextIO | None = None) -> None:
    """Install the handler and renderer. Safe to call again (replaces the previous setup)."""
    level_name = level.upper()
    numeric = logging.getLevelName(level_name)
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")

    shared = _shared_processors(log_format)
    renderer: Processor
    if log_format == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        # Plain tracebacks: rich's default (boxes, source, every local) turned one bug into
        # hundreds of lines, and locals may hold what a log must not.
        renderer = structlog.dev.ConsoleRenderer(
            colors=_wants_colour(stream), exception_formatter=structlog.dev.plain_traceback
        )

    target = sys.stdout if stream is None else stream
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    handler = logging.StreamHandler(target)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(formatter)

    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(max(numeric, logging.WARNING))
    for name in OUR_LOGGERS:
        logging.getLogger(name).setLevel(numeric)

    structlog.configure(
        processors=[*shared, renderer],
        logger_factory=_NamedWriteLoggerFactory(target),
        # Every structlog logger is one of ours: they all follow --log-level.
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # Not cached: a logger created before configuration (at import) must pick it up.
        cache_logger_on_first_use=False,
    )
    logging.captureWarnings(True)


class _NamedWriteLogger(structlog.WriteLogger):
    """structlog's line writer, with the name it was asked for (the ``logger`` field)."""

    def __init__(self, file: TextIO, name: str) -> None:
        super().__init__(file)
        self.name = name


class _NamedWriteLoggerFactory:
    def __init__(self, file: TextIO) -> None:
        self._file = file

    def __call__(self, *args: Any) -> _NamedWriteLogger:
        name = args[0] if args and isinstance(args[0], str) else ""
        return _NamedWriteLogger(self._file, name)


def _wants_colour(stream: TextIO | None) -> bool:
    target = sys.stdout if stream is None else stream
    try:
        return target.isatty()
    except (AttributeError, ValueError):
        return False
