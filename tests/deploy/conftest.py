"""What an operator or a frontend author receives: the wheel, the image's command line, the
manifests and the systemd unit, checked as they would use them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What goes into the wheel: pyproject's packages plus the files its metadata reads.
_SOURCES = (
    "pyproject.toml",
    "README.md",
    "sidecar_common",
    "sidecar_vllm",
    "sidecar_sglang",
    "sidecar_frontend",
    "testkit",
)
# Building takes a while on a loaded machine; far above what it needs, never hit when green.
BUILD_WAIT = 300.0


@pytest.fixture(scope="session")
def built_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built from a copy of the tree (a build in the checkout would
    write build/ beside other people's work), offline with the venv's own setuptools."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "src"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", ".mypy_cache")
    for name in _SOURCES:
        origin = ROOT / name
        if origin.is_dir():
            shutil.copytree(origin, source / name, ignore=ignore)
        else:
            shutil.copy2(origin, source / name)
    out = work / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "--wheel-dir",
            str(out),
            str(source),
        ],
        check=True,
        timeout=BUILD_WAIT,
        capture_output=True,
        text=True,
    )
    wheels = sorted(out.glob("llm_sidecars-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]
