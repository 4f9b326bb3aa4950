"""The fleet manifests' frontends run one process per CPU they request (deploy/README.md,
"Processes or replicas"), with settings the frontend's command line accepts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from sidecar_frontend.cli import parse_config
from tests.deploy.conftest import ROOT

FLEETS = [ROOT / "deploy" / "kubernetes" / name for name in ("fleet-dns.yaml", "fleet-etcd.yaml")]


def frontend(path: Path) -> dict[str, Any]:
    for doc in yaml.safe_load_all(path.read_text()):
        if doc["kind"] == "Deployment":
            (container,) = doc["spec"]["template"]["spec"]["containers"]
            if container["args"][0] == "frontend":
                return dict(container)
    raise AssertionError("no frontend Deployment")


@pytest.mark.parametrize("path", FLEETS, ids=lambda p: p.name)
def test_one_frontend_process_per_cpu_requested(path: Path) -> None:
    container = frontend(path)
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    # The manifest's settings, with a static worker in place of the cluster's discovery.
    config = parse_config(["--worker", "10.0.3.17:50061"], env)
    cpu = container["resources"]["requests"]["cpu"]
    assert config.processes == int(cpu) > 1
    assert config.admission.capacity.processes == config.processes
