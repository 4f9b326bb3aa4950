"""buf guards the public contract: lint for our own proto, and `buf breaking` against the
released 0.1.0 ``sidecar.proto`` kept in tests/data/released/."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.deploy.conftest import ROOT

BUF = ROOT / "tools" / "buf" / "node_modules" / ".bin" / "buf"
RELEASED = ROOT / "tests" / "data" / "released"
WAIT = 120.0


def _buf(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert BUF.exists(), "buf is not installed: run `make buf` (npm, into tools/buf/node_modules)"
    return subprocess.run(
        [str(BUF), *args], cwd=cwd, capture_output=True, text=True, timeout=WAIT, check=False
    )


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """A copy of the protos and buf.yaml, free to break."""
    shutil.copytree(ROOT / "protos", tmp_path / "protos")
    shutil.copy2(ROOT / "buf.yaml", tmp_path / "buf.yaml")
    return tmp_path


def _edit(workspace: Path, old: str, new: str) -> None:
    proto = workspace / "protos" / "sidecar" / "v1" / "sidecar.proto"
    text = proto.read_text()
    assert text.count(old) == 1, old
    proto.write_text(text.replace(old, new))


def test_the_protos_pass_buf_lint() -> None:
    result = _buf("lint", cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_api_is_compatible_with_the_released_one() -> None:
    result = _buf("breaking", "--against", str(RELEASED), cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("old", "new", "rule"),
    [
        ("  uint32 aborted = 1;", "  uint64 aborted = 1;", "FIELD_SAME_TYPE"),
        ("  string engine_version = 14;\n", "", "FIELD_NO_DELETE"),
        ("  optional uint32 max_tokens = 1;", "  optional uint32 max_tokens = 20;", "FIELD_NO_DELETE"),
        ("  rpc GetLoad(GetLoadRequest) returns (LoadReport);\n", "", "RPC_NO_DELETE"),
        ("  CONTENT_FILTER = 5;", "  CONTENT_FILTERED = 5;", "ENUM_VALUE_SAME_NAME"),
    ],
    ids=["type", "deleted-field", "renumbered", "deleted-rpc", "renamed-enum-value"],
)
def test_an_incompatible_change_fails_buf_breaking(workspace: Path, old: str, new: str, rule: str) -> None:
    _edit(workspace, old, new)
    result = _buf("breaking", "--against", str(RELEASED), "--error-format", "json", cwd=workspace)
    assert result.returncode != 0
    assert f'"type":"{rule}"' in result.stdout, result.stdout + result.stderr


def test_a_compatible_addition_passes_buf_breaking(workspace: Path) -> None:
    _edit(
        workspace, "  string engine_version = 14;\n", "  string engine_version = 14;\n  string region = 99;\n"
    )
    result = _buf("breaking", "--against", str(RELEASED), cwd=workspace)
    assert result.returncode == 0, result.stdout + result.stderr


def test_lint_still_applies_to_the_public_proto(workspace: Path) -> None:
    # The exceptions are five naming rules the 0.1.0 names broke; everything else is linted.
    _edit(
        workspace,
        "  string engine_version = 14;",
        "  string engine_version = 14;\n  string engineRegion = 99;",
    )
    result = _buf("lint", "--error-format", "json", cwd=workspace)
    assert result.returncode != 0
    assert '"type":"FIELD_LOWER_SNAKE_CASE"' in result.stdout, result.stdout
