"""What the command lines know about logging: the formats, the levels, the default format.
Standard library only, so that parsing the flags does not import structlog; installing the
logging is :mod:`sidecar_common.logs`."""

from __future__ import annotations

import sys
from typing import Final, Literal, TextIO

__all__ = ["LOG_LEVELS", "LogFormat", "default_log_format"]

LogFormat = Literal["json", "console"]

LOG_LEVELS: Final = ("debug", "info", "warning", "error", "critical")


def default_log_format(stream: TextIO | None = None) -> LogFormat:
    """JSON lines for machines (not a terminal), the console renderer for humans."""
    target = sys.stdout if stream is None else stream
    try:
        return "console" if target.isatty() else "json"
    except (AttributeError, ValueError):
        return "json"
