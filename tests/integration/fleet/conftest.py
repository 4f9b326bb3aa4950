"""Fixtures of the fleet tests: a real etcd server per test (tests/etcd_fixture.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.etcd_fixture import EtcdServer, running_etcd


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    yield from running_etcd(tmp_path)


@pytest.fixture
def etcd_not_started(tmp_path: Path) -> Iterator[EtcdServer]:
    """Ports and data directory chosen, server not running yet (the test starts it)."""
    server = EtcdServer(tmp_path / "etcd-data")
    try:
        yield server
    finally:
        server.kill()
