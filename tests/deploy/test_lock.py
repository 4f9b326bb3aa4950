"""requirements.lock is the one source of versions: it pins every requirement pyproject.toml
names (dependencies, every extra, the build backend), and every one testkit/pyproject.toml
names but llm-sidecars itself (this checkout), at a version the requirement allows, and
every install path (make setup, make install-systemd, the Dockerfile; .ci/run through make
setup) installs under it. A dependency added without `make lock` fails here."""

from __future__ import annotations

import re
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.deploy.conftest import ROOT

LOCK = ROOT / "requirements.lock"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
TESTKIT = tomllib.loads((ROOT / "testkit" / "pyproject.toml").read_text())


def pins() -> dict[str, list[tuple[Version, Requirement]]]:
    """Each pinned name -> its pins (a universal lock may pin one name twice, under markers)."""
    found: dict[str, list[tuple[Version, Requirement]]] = {}
    for line in LOCK.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        requirement = Requirement(line)
        (specifier,) = requirement.specifier
        assert specifier.operator == "==", f"not an exact pin: {line}"
        found.setdefault(canonicalize_name(requirement.name), []).append(
            (Version(specifier.version), requirement)
        )
    return found


def requirements() -> list[Requirement]:
    named: list[str] = []
    for pyproject in (PYPROJECT, TESTKIT):
        project = pyproject["project"]
        named += [*project["dependencies"], *pyproject["build-system"]["requires"]]
        for extra in project.get("optional-dependencies", {}).values():
            named.extend(extra)
    ours = canonicalize_name(PYPROJECT["project"]["name"])
    unique = {text: Requirement(text) for text in named}
    return [r for r in unique.values() if canonicalize_name(r.name) != ours]


def test_the_testkits_requirements_are_checked_too() -> None:
    names = {canonicalize_name(r.name) for r in requirements()}
    for text in TESTKIT["project"]["dependencies"]:
        name = canonicalize_name(Requirement(text).name)
        assert name in names or name == canonicalize_name(PYPROJECT["project"]["name"])
    assert {"msgspec", "pyzmq"} <= names


@pytest.mark.parametrize("requirement", requirements(), ids=str)
def test_the_lock_pins_every_requirement_at_an_allowed_version(requirement: Requirement) -> None:
    locked = pins().get(canonicalize_name(requirement.name))
    assert locked, f"{requirement.name} is not in requirements.lock: run `make lock` and commit it"
    # The pin that applies on this platform and Python (markers as pip evaluates them).
    applicable = [v for v, pin in locked if pin.marker is None or pin.marker.evaluate()]
    assert applicable, f"no pin of {requirement.name} applies here"
    for version in applicable:
        assert requirement.specifier.contains(version, prereleases=True), (
            f"requirements.lock pins {requirement.name}=={version}, outside {requirement.specifier}:"
            " run `make lock` and commit it"
        )


def test_the_lock_pins_pip_too() -> None:
    assert "pip" in pins()


def test_the_lock_was_written_by_make_lock() -> None:
    header = LOCK.read_text().splitlines()[:2]
    assert header[1].strip() == "#    make lock", header


def test_every_install_path_installs_under_the_lock() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^LOCK := requirements\.lock$", makefile, re.M)
    for target in ("$(STAMP)", "install-systemd"):
        recipe = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", makefile, re.M)
        assert recipe, target
        installs = [line for line in recipe.group(1).splitlines() if "pip install" in line]
        assert installs, target
        for line in installs:
            assert "-c $(LOCK)" in line, f"{target}: {line.strip()}"
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "requirements.lock" in dockerfile.split("RUN", 1)[0], "the Dockerfile copies the lock"
    pip_installs = re.findall(r"pip install[^\n&]*", dockerfile)
    assert pip_installs
    for line in pip_installs:
        assert "--constraint requirements.lock" in line, line
    assert "--no-build-isolation" in dockerfile, "the wheel is built with the locked setuptools"
    # CI installs through make setup, so through the lock.
    assert "make setup" in (ROOT / ".ci" / "run").read_text()


def test_the_build_survives_setuptools_removing_the_license_table() -> None:
    # setuptools removes the `license = {text = ...}` table form after 2027-02-18; the SPDX
    # string (PEP 639) is read from setuptools 77 on. The range has an upper bound, so a later
    # major release cannot change a build until the bound is moved.
    assert isinstance(PYPROJECT["project"]["license"], str)
    (backend,) = [Requirement(r) for r in PYPROJECT["build-system"]["requires"] if r.startswith("setuptools")]
    assert not backend.specifier.contains("76.1.0")
    assert backend.specifier.contains("77.0.3")
    assert any(spec.operator in ("<", "<=", "==", "~=") for spec in backend.specifier), "no upper bound"
