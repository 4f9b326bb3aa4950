"""Logging: structlog in front, stdlib logging underneath, one formatter for both.

Our own modules log through structlog (``structlog.get_logger(__name__)``); libraries that
use stdlib ``logging`` (grpc, aiohttp, asyncio) reach the same handler and renderer, so a
log shipper sees one format. Libraries are held at WARNING+: their INFO/DEBUG chatter is
not the operator's concern, and it would cost CPU on the hot path.
"""

from __future__ import annotations

import logging
import sys
from typing import Final, Literal, TextIO

import structlog
from structlog.typing import Processor

__all__ = ["LOG_LEVELS", "OUR_LOGGERS", "LogFormat", "configure_logging", "default_log_format"]

LogFormat = Literal["json", "console"]

LOG_LEVELS: Final = ("debug", "info", "warning", "error", "critical")

# Loggers that follow --log-level; everything else stays at WARNING or above.
OUR_LOGGERS: Final = (
    "sidecar_common",
    "sidecar_vllm",
    "sidecar_sglang",
    "sidecar_frontend",
    "testkit",
    "sidecar",
)

_HANDLER_NAME: Final = "sidecar-logs"


def default_log_format(stream: TextIO | None = None) -> LogFormat:
    """JSON lines for machines (not a terminal), the console renderer for humans."""
    target = sys.stdout if stream is None else stream
    try:
        return "console" if target.isatty() else "json"
    except (AttributeError, ValueError):
        return "json"


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
        renderer = structlog.dev.ConsoleRenderer(colors=_wants_colour(stream))

    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    handler = logging.StreamHandler(sys.stdout if stream is None else stream)
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
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        # Not cached: a logger created before configuration (at import) must pick it up.
        cache_logger_on_first_use=False,
    )
    logging.captureWarnings(True)


def _wants_colour(stream: TextIO | None) -> bool:
    target = sys.stdout if stream is None else stream
    try:
        return target.isatty()
    except (AttributeError, ValueError):
        return False
