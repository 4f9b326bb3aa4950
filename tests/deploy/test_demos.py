"""`make run ENGINE=...`: every demo the README names runs, through make, as a newcomer runs it;
and a demo whose child process exits early says so at once instead of waiting out its timeout."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from testkit import demo
from tests.deploy.conftest import ROOT

VENV = Path(sys.prefix)
# Far above what a demo needs (seconds); never hit when green.
WAIT = 180.0
README = (ROOT / "README.md").read_text()


def make_run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`make run ...` with this interpreter's venv, never reinstalling it (-o: the stamp counts
    as up to date), as `make run` does right after `make setup`."""
    return subprocess.run(
        [
            "make",
            "--no-print-directory",
            "-C",
            str(ROOT),
            "-o",
            f"{VENV}/.installed",
            "run",
            f"VENV={VENV}",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=WAIT,
        check=False,
        env=env,
    )


def readme_demos() -> set[str]:
    return set(re.findall(r"make run ENGINE=([\w-]+)", README))


def test_the_readme_names_every_demo_and_only_those() -> None:
    assert "make run" in README
    assert readme_demos() == set(demo.DEMOS) - {"vllm"}, "make run alone is the vllm demo"


@pytest.mark.parametrize("name", demo.DEMOS)
def test_each_demo_runs_through_make(name: str) -> None:
    # The README's own command lines: `make run` alone for the vLLM demo (the Makefile's
    # default), `make run ENGINE=<name>` for the others.
    result = make_run() if name == "vllm" else make_run(f"ENGINE={name}")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    if name == "frontend":
        # SGLang's /generate stream through the frontend: events, then the end marker.
        events = [line for line in result.stdout.splitlines() if line.startswith("data: {")]
        assert events, output
        assert "data: [DONE]" in result.stdout
    else:
        assert re.search(r"streamed [1-9]\d* tokens", result.stdout), output
    # Every process it started was stopped and exited cleanly.
    for label in ("engine", "sidecar", *(["frontend"] if name == "frontend" else [])):
        assert f"{label} exited with 0" in result.stdout, output


def test_a_child_that_exits_early_ends_the_demo_with_its_name_and_code() -> None:
    # A bad setting in the environment: the sidecar refuses it (exit 2) before serving.
    env = {**os.environ, "SIDECAR_GRPC_CONNECTIONS": "0"}
    result = make_run(env=env)
    assert result.returncode != 0
    assert "demo failed: sidecar exited with code 2 before the demo was done" in result.stderr, (
        result.stdout + result.stderr
    )
    assert "Traceback" not in result.stderr


def test_an_early_exit_is_noticed_without_waiting_for_the_ready_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With an hour to wait, only noticing the exit ends the wait (pytest's timeout would not).
    monkeypatch.setattr(demo, "READY_WAIT", 3600.0)
    commands = {"child": [sys.executable, "-c", "raise SystemExit(3)"]}
    with (
        pytest.raises(demo.ChildExited, match="child exited with code 3"),
        demo._started(commands) as children,
    ):
        demo._wait_ready(children, "never", lambda: False)
