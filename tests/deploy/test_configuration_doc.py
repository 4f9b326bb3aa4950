"""docs/configuration.md keeps up with the command lines: every flag each console script's
`--help` lists has a row (or a mention) there."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.deploy.conftest import ROOT
from tests.e2e_helpers import WAIT, child_env, script

DOC = (ROOT / "docs" / "configuration.md").read_text()
# Flags every argparse program has, documented by argparse itself.
GENERIC = {"--help", "--version"}


@pytest.mark.parametrize("program", ["sidecar-vllm", "sidecar-sglang", "sidecar-frontend"])
def test_every_flag_is_documented(program: str) -> None:
    result = subprocess.run(
        [script(program), "--help"], capture_output=True, text=True, timeout=WAIT, env=child_env(), check=True
    )
    flags = set(re.findall(r"^\s+(--[a-z][a-z0-9-]*)", result.stdout, re.M)) - GENERIC
    assert flags, result.stdout
    missing = sorted(flag for flag in flags if f"`{flag}" not in DOC)
    assert not missing, f"{program}: not in docs/configuration.md: {missing}"
