"""Reliability suites: quiet logs (a per-request debug line would dominate the CPU of a soak)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import structlog


@pytest.fixture(autouse=True)
def quiet_logs() -> Iterator[None]:
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    try:
        yield
    finally:
        structlog.configure(**saved)
