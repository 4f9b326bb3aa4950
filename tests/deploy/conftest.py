"""What an operator or a frontend author receives: the wheel, the image's command line, the
manifests and the systemd unit, checked as they would use them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What goes into the wheel: pyproject's packages plus the files its metadata reads.
_SOURCES = (
    "pyproject.toml",
    "requirements.lock",
    "README.md",
    "sidecar_common",
    "sidecar_server",
    "sidecar_vllm",
    "sidecar_sglang",
    "sidecar_frontend",
    "sidecar_command",
)
# Building and installing take a while on a loaded machine (the install fetches the
# dependencies); far above what they need, never hit when green.
BUILD_WAIT = 300.0
INSTALL_WAIT = 900.0


def _copy_tree(destination: Path, *extra: str) -> Path:
    """The files a build reads, copied: a build in the checkout would write build/ beside
    other people's work."""
    destination.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", ".mypy_cache", "node_modules")
    for name in (*_SOURCES, *extra):
        origin = ROOT / name
        if origin.is_dir():
            shutil.copytree(origin, destination / name, ignore=ignore)
        else:
            shutil.copy2(origin, destination / name)
    return destination


@pytest.fixture(scope="session")
def built_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built offline with the venv's own setuptools."""
    work = tmp_path_factory.mktemp("wheel")
    source = _copy_tree(work / "src")
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


@dataclass(frozen=True)
class Installed:
    prefix: Path  # the venv `make install-systemd` created
    unit: Path  # the unit file it wrote


@pytest.fixture(scope="session")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """`make install-systemd` as an operator runs it, into a temporary PREFIX and unit
    directory: a fresh venv, the wheel and its dependencies, the unit."""
    work = tmp_path_factory.mktemp("install")
    source = _copy_tree(work / "src", "Makefile", "deploy")
    prefix = work / "prefix"
    units = work / "units"
    result = subprocess.run(
        ["make", "-C", str(source), "install-systemd", f"PREFIX={prefix}", f"UNIT_DIR={units}"],
        timeout=INSTALL_WAIT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return Installed(prefix=prefix, unit=units / "sidecar-vllm.service")
