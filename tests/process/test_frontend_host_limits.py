"""The frontend at start against the host's limits, as a real process: ``--min-open-files``
above what the hard limit allows is refused with one line naming both limits (exit 1), with one
process or several; with ``--processes``, a taken port is the same one line and exit 1 as for one
frontend, before any process starts."""

from __future__ import annotations

import resource
import socket

import pytest

from tests.e2e_helpers import WAIT, free_port, log_lines, process, script

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow(4)]


@pytest.mark.parametrize("processes", ["1", "2"])
def test_an_open_files_limit_below_min_open_files_stops_the_start(processes: str) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        pytest.skip("no hard limit to stay below")
    argv = [
        script("sidecar-frontend"),
        "--worker",
        f"127.0.0.1:{free_port()}",
        "--listen",
        "127.0.0.1:0",
        "--log-format",
        "json",
        "--processes",
        processes,
    ]
    with process(argv, {"SIDECAR_FRONTEND_MIN_OPEN_FILES": str(hard + 1)}) as proc:
        assert proc.wait(timeout=WAIT) == 1
        entries = list(log_lines(proc))
    limits = next(e for e in entries if e["event"] == "connection limits")
    assert limits["open_files"] == hard
    (failed,) = [e for e in entries if e["event"] == "start-up failed"]
    assert f"--min-open-files {hard + 1}" in failed["error"]
    assert "SIDECAR_FRONTEND_MIN_OPEN_FILES" in failed["error"]
    assert not [e for e in entries if e["event"] == "process started"]


def test_processes_on_a_taken_port_fail_at_once_naming_the_flag() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [
            script("sidecar-frontend"),
            "--worker",
            f"127.0.0.1:{free_port()}",
            "--listen",
            f"127.0.0.1:{port}",
            "--log-format",
            "json",
            "--processes",
            "2",
        ]
        with process(argv) as proc:
            assert proc.wait(timeout=WAIT) == 1
            entries = list(log_lines(proc))
    (failed,) = [e for e in entries if e["event"] == "start-up failed"]
    assert "in use" in failed["error"]
    assert "--listen" in failed["error"]
    assert not [e for e in entries if e["event"] == "process started"]
