"""Every console script answers ``--help`` and refuses a bad flag without importing grpc or
aiohttp's server: an operator's ``--help`` is immediate, and a usage error costs no more than
parsing (issue 19, "Start-up is heavy"). Each run is a real process of the installed script,
under ``python -X importtime``, which lists every module the process imported."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import pytest

from tests.e2e_helpers import ROOT, WAIT, child_env, script

HEAVY = ("grpc", "aiohttp.web")


def _console_scripts() -> list[str]:
    names: list[str] = []
    for pyproject in (ROOT / "pyproject.toml", ROOT / "testkit" / "pyproject.toml"):
        with pyproject.open("rb") as f:
            names.extend(tomllib.load(f)["project"]["scripts"])
    return sorted(names)


def _imported(
    argv: list[str], env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    result = subprocess.run(
        [sys.executable, "-X", "importtime", script(argv[0]), *argv[1:]],
        capture_output=True,
        text=True,
        timeout=WAIT,
        cwd=ROOT,
        env={**child_env(), **(env or {})},
        check=False,
    )
    modules = set(re.findall(r"^import time:\s*\d+ \|\s*\d+ \|\s*(\S+)\s*$", result.stderr, re.MULTILINE))
    assert modules, result.stderr  # -X importtime did report
    return result, modules


# Each console script and each of its subcommands; the list of scripts comes from the
# pyproject files, so a new one is covered (and must be added to SUBCOMMANDS if it has any).
SUBCOMMANDS = {"sidecar": ["vllm", "sglang", "frontend"], "testkit-engine": ["vllm", "sglang"]}
HELP_PAGES = [
    [name, *sub]
    for name in _console_scripts()
    for sub in [[], *([choice] for choice in SUBCOMMANDS.get(name, []))]
]


def test_the_pages_cover_every_console_script() -> None:
    assert {page[0] for page in HELP_PAGES} == {
        "sidecar",
        "sidecar-vllm",
        "sidecar-sglang",
        "sidecar-frontend",
        "testkit-engine",
    }


@pytest.mark.parametrize("command", HELP_PAGES, ids=" ".join)
def test_help_imports_neither_grpc_nor_aiohttp_web(command: list[str]) -> None:
    result, modules = _imported([*command, "--help"])
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout
    assert not modules.intersection(HEAVY), sorted(modules.intersection(HEAVY))


# A usage error of each daemon, each found at a different stage: by argparse, by the checks
# after parsing, by an engine package's own check.
USAGE_ERRORS = [
    ["sidecar-vllm", "--grpc-endpoint", "127.0.0.1:1", "--grpc-connections", "0"],
    ["sidecar", "vllm"],
    ["sidecar-sglang", "--transport", "http"],
    ["sidecar", "sglang", "--grpc-endpoint", "127.0.0.1:1", "--http-endpoint", "127.0.0.1:2"],
    ["sidecar-frontend", "--processes", "2", "--admin-listen", "127.0.0.1:9"],
    ["sidecar-frontend", "--worker", "127.0.0.1:1", "--migration-limit", "-1"],
    ["testkit-engine", "vllm", "--listen", "nowhere"],
    ["testkit-engine", "vllm", "--listen", "127.0.0.1:0", "--chunk-tokens", "0"],
]


@pytest.mark.parametrize("command", USAGE_ERRORS, ids=" ".join)
def test_a_usage_error_imports_neither_grpc_nor_aiohttp_web(command: list[str]) -> None:
    result, modules = _imported(command)
    assert result.returncode == 2, result.stderr
    assert not modules.intersection(HEAVY), sorted(modules.intersection(HEAVY))
