"""A managed sidecar does not outlive the frontend that started it (Linux): the child asks the
kernel for SIGTERM when its parent dies (sidecar_common/parent_death.py). Real processes: a
parent that starts a child as the frontend does, then is killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sidecar_common.parent_death import PARENT_PID_VARIABLE

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's"),
]

CHILD = """
import os, signal, sys, time, pathlib
from sidecar_common.parent_death import die_with_parent
if not die_with_parent(os.environ):
    sys.exit(1)
def on_term(*_):
    pathlib.Path(sys.argv[1]).write_text("terminated")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
pathlib.Path(sys.argv[2]).write_text(str(os.getpid()))
time.sleep(600)
"""

PARENT = """
import os, subprocess, sys, time
env = dict(os.environ, {var}=str(os.getpid()))
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]], env=env, process_group=0)
time.sleep(600)
"""


def _wait_for(path: Path, seconds: float) -> str:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        time.sleep(0.05)
    raise AssertionError(f"{path} not written within {seconds} s")


def test_a_child_gets_sigterm_when_its_parent_is_killed(tmp_path: Path) -> None:
    terminated, started = tmp_path / "terminated", tmp_path / "started"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT.format(var=PARENT_PID_VARIABLE), CHILD, str(terminated), str(started)]
    )
    try:
        child_pid = int(_wait_for(started, 60))
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
        assert _wait_for(terminated, 60) == "terminated"
    finally:
        parent.kill()
        parent.wait(30)
    # It exits on that SIGTERM (reaped by whoever adopted it).
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and Path(f"/proc/{child_pid}").exists():
        state = Path(f"/proc/{child_pid}/stat").read_text().split(")")[-1].split()[0]
        if state == "Z":
            break
        time.sleep(0.05)
    else:
        assert not Path(f"/proc/{child_pid}").exists()


def test_a_child_whose_parent_is_already_gone_exits_at_once(tmp_path: Path) -> None:
    env = dict(os.environ, **{PARENT_PID_VARIABLE: str(os.getpid() + 1_000_000)})
    done = subprocess.run(
        [sys.executable, "-m", "sidecar_vllm", "--grpc-endpoint", "127.0.0.1:1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "the process that started it is gone" in done.stderr
