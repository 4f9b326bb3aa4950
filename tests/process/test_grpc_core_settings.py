"""Each program chooses grpc core's settings before grpc loads (grpc reads them once, at its
import): a real process of each console script, with an audit hook (a ``sitecustomize``)
that writes down ``GRPC_EXPERIMENTS`` at the moment ``grpc`` is imported. An operator's own
value, even an empty one, is what grpc sees."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.e2e_helpers import ROOT, WAIT, free_port, process, script

pytestmark = [pytest.mark.timeout(120)]

_HOOK = """\
import os
import sys


def _record(event, args):
    if event == "import" and args and args[0] == "grpc" and "GRPC_SEEN" not in os.environ:
        os.environ["GRPC_SEEN"] = "1"
        with open(os.environ["GRPC_SETTINGS_RECORD"], "w") as f:
            f.write(repr(os.environ.get("GRPC_EXPERIMENTS")))


sys.addaudithook(_record)
"""


def _program(name: str) -> list[str]:
    dead = f"127.0.0.1:{free_port()}"  # no engine and no worker: grpc loads all the same
    listen = f"127.0.0.1:{free_port()}"
    if name == "sidecar-frontend":
        return [script(name), "--listen", listen, "--worker", dead]
    if name == "sidecar frontend":
        return [script("sidecar"), "frontend", "--listen", listen, "--worker", dead]
    return [script(name), "--grpc-endpoint", dead, "--listen", listen]


def _seen_at_import(tmp_path: Path, name: str, env: dict[str, str]) -> str:
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(_HOOK)
    record = tmp_path / "record"
    env = {"PYTHONPATH": f"{hooks}:{ROOT}", "GRPC_SETTINGS_RECORD": str(record), **env}
    with process(_program(name), env) as proc:
        end = time.monotonic() + WAIT
        while not record.exists() or not record.read_text():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < end, "grpc was never imported"
            time.sleep(0.05)
    return record.read_text()


@pytest.mark.parametrize("name", ["sidecar-vllm", "sidecar-sglang", "sidecar-frontend", "sidecar frontend"])
def test_grpc_loads_with_the_older_tcp_client_chosen(tmp_path: Path, name: str) -> None:
    assert _seen_at_import(tmp_path, name, {}) == repr("-event_engine_client")


@pytest.mark.parametrize("value", ["", "-event_engine_dns"])
@pytest.mark.parametrize("name", ["sidecar-vllm", "sidecar-frontend"])
def test_an_operators_own_setting_is_what_grpc_sees(tmp_path: Path, name: str, value: str) -> None:
    assert _seen_at_import(tmp_path, name, {"GRPC_EXPERIMENTS": value}) == repr(value)
