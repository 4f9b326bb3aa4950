"""`make install-systemd` as an operator runs it, the unit it installs as systemd-analyze
judges it, and the container image's command line run from that same kind of install."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.deploy.conftest import ROOT, Installed
from tests.e2e_helpers import WAIT, free_port, generate_six, process, script, serving_port

# The image installs the same venv layout as `make install-systemd`, at this path.
IMAGE_PREFIX = "/opt/llm-sidecars"
MAX_EXPOSURE = 3.0

# The install fetches every dependency from the package index (minutes, and the network): these
# run in `make deploy-check` (which CI runs), not in `make test`.
pytestmark = pytest.mark.install


def _exec_start(unit: Path) -> list[str]:
    (line,) = [line for line in unit.read_text().splitlines() if line.startswith("ExecStart=")]
    return shlex.split(line.removeprefix("ExecStart="))


def test_install_systemd_points_the_unit_at_the_venv_it_made(installed: Installed) -> None:
    argv = _exec_start(installed.unit)
    assert argv == [str(installed.prefix / "bin" / "sidecar"), "vllm"]
    result = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=WAIT, check=False)
    assert result.returncode == 0, result.stderr
    assert "--grpc-endpoint" in result.stdout
    # The venv runs its own copy of the package, not this checkout.
    where = subprocess.run(
        [
            str(installed.prefix / "bin" / "python"),
            "-c",
            "import sidecar_common; print(sidecar_common.__file__)",
        ],
        capture_output=True,
        text=True,
        timeout=WAIT,
        check=True,
        cwd=installed.prefix,
    )
    assert where.stdout.startswith(str(installed.prefix)), where.stdout


def test_systemd_analyze_verify_passes_on_the_installed_unit(installed: Installed) -> None:
    result = subprocess.run(
        ["systemd-analyze", "verify", str(installed.unit)],
        capture_output=True,
        text=True,
        timeout=WAIT,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert installed.unit.name not in result.stderr, result.stderr


def test_the_unit_is_hardened_to_an_exposure_of_at_most_3(installed: Installed) -> None:
    for unit in (installed.unit, ROOT / "deploy" / "sidecar-vllm.service"):
        result = subprocess.run(
            ["systemd-analyze", "security", "--offline=true", str(unit)],
            capture_output=True,
            text=True,
            timeout=WAIT,
            check=True,
        )
        found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout)
        assert found, result.stdout
        assert float(found.group(1)) <= MAX_EXPOSURE, result.stdout


def _final_stage(dockerfile: Path) -> list[tuple[str, str]]:
    """(instruction, arguments) of the Dockerfile's last stage, continuation lines joined."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    instructions = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
    last_from = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    return instructions[last_from:]


def test_the_images_command_line_serves_a_testkit_engine(installed: Installed, tmp_path: Path) -> None:
    stage = _final_stage(ROOT / "Dockerfile")
    copies = [rest for keyword, rest in stage if keyword == "COPY"]
    assert f"--from=build {IMAGE_PREFIX} {IMAGE_PREFIX}" in copies
    (entrypoint,) = [json.loads(rest) for keyword, rest in stage if keyword == "ENTRYPOINT"]
    image_env: dict[str, str] = {}
    for keyword, rest in stage:
        if keyword == "ENV":
            for item in shlex.split(rest):
                name, _, value = item.partition("=")
                image_env[name] = value
    # The image's environment, with its venv where this install put it.
    env = {
        name: value.replace(IMAGE_PREFIX, str(installed.prefix)).replace("$PATH", os.environ["PATH"])
        for name, value in image_env.items()
    }
    assert env["PATH"].startswith(f"{installed.prefix}/bin:")
    program = installed.prefix / "bin" / entrypoint[0]
    # `docker run IMAGE vllm` plus the Pod's settings, as variables (deploy/kubernetes).
    engine_port = free_port()
    env.update(
        SIDECAR_GRPC_ENDPOINT=f"127.0.0.1:{engine_port}",
        SIDECAR_LISTEN="127.0.0.1:0",
        SIDECAR_GRPC_CONNECTIONS="2",
        SIDECAR_GRPC_STARTUP_DEADLINE_SECS=str(WAIT),
    )
    argv = [str(program), *entrypoint[1:], "vllm"]
    with process([script("testkit-engine"), "vllm", "--listen", f"127.0.0.1:{engine_port}"]):
        sidecar = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env
        )
        try:
            # The image's SIDECAR_LOG_FORMAT=json is what makes these lines parseable.
            port = serving_port(sidecar)
            outputs = generate_six(port)
            assert sum(len(out.token_ids) for out in outputs) == 6
            assert outputs[-1].finish_reason != 0
            sidecar.terminate()
            assert sidecar.wait(timeout=WAIT) == 0
        finally:
            if sidecar.poll() is None:
                sidecar.kill()
                sidecar.wait(timeout=WAIT)
            for stream in (sidecar.stdout, sidecar.stderr):
                if stream is not None:
                    stream.close()
