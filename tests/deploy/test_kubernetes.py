"""deploy/kubernetes/sidecar.yaml read as the kubelet reads it: the sidecar is a native
sidecar, the probes name the health services the sidecar really serves, the settings are
ones the real CLI accepts, and the shutdown numbers leave the drain its time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from sidecar_command import ENGINES, engine_spec
from sidecar_server import daemon
from sidecar_server.cli import parse_config
from sidecar_server.config import SidecarConfig
from sidecar_server.server import LIVENESS_SERVICE, WORKER_SERVICE
from tests.deploy.conftest import ROOT

MANIFEST = ROOT / "deploy" / "kubernetes" / "sidecar.yaml"
# What the manifest allows the engine between its SIGTERM and its exit (see its timeline).
ENGINE_STOP_SECS = 30


def _documents(path: Path) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for document in yaml.safe_load_all(path.read_text()):
        assert document["kind"] not in found, f"one {document['kind']} per manifest"
        found[document["kind"]] = document
    return found


@pytest.fixture(scope="module")
def manifest() -> dict[str, dict[str, Any]]:
    return _documents(MANIFEST)


@pytest.fixture(scope="module")
def pod(manifest: dict[str, dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = manifest["Deployment"]["spec"]["template"]["spec"]
    return spec


def _sidecar(pod: dict[str, Any]) -> dict[str, Any]:
    (sidecar,) = [c for c in pod.get("initContainers", []) if c["name"] == "sidecar"]
    return dict(sidecar)


def _engine(pod: dict[str, Any]) -> dict[str, Any]:
    (engine,) = [c for c in pod["containers"] if c["name"] == "engine"]
    return dict(engine)


def _sidecar_config(pod: dict[str, Any]) -> SidecarConfig:
    """The sidecar's settings as the real CLI parses the container's args and env."""
    sidecar = _sidecar(pod)
    engine_name, *flags = sidecar["args"]
    assert engine_name in ENGINES
    environ = {item["name"]: item["value"] for item in sidecar["env"]}
    config, _ = parse_config(engine_spec(engine_name), flags, environ)
    return config


def test_the_sidecar_is_a_native_sidecar_beside_the_engine(pod: dict[str, Any]) -> None:
    # restartPolicy Always on an init container: started before the engine, stopped after it.
    assert _sidecar(pod)["restartPolicy"] == "Always"
    assert [c["name"] for c in pod["containers"]] == ["engine"]
    # Loopback to the engine: the same Pod network namespace.
    engine_args = _engine(pod)["args"]
    engine_port = engine_args[engine_args.index("--port") + 1]
    assert str(_sidecar_config(pod).pool.endpoint) == f"127.0.0.1:{engine_port}"


def test_probes_name_the_services_the_sidecar_serves(pod: dict[str, Any]) -> None:
    sidecar = _sidecar(pod)
    listen_port = int(_sidecar_config(pod).listen.rsplit(":", 1)[1])
    services = {}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        grpc_probe = sidecar[probe]["grpc"]
        assert grpc_probe["port"] == listen_port
        services[probe] = grpc_probe["service"]
    assert services == {
        # The engine starts only once the sidecar has: startup cannot wait for the engine.
        "startupProbe": LIVENESS_SERVICE,
        "readinessProbe": WORKER_SERVICE,
        # Never restarts the sidecar for an engine outage.
        "livenessProbe": LIVENESS_SERVICE,
    }


def test_shutdown_numbers_leave_the_drain_its_time(pod: dict[str, Any]) -> None:
    config = _sidecar_config(pod)
    drain = config.drain_timeout
    cleanup = daemon._cleanup_allowance(daemon._server_config(config))
    command = _engine(pod)["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    engine_pre_stop = int(command[1])
    # In-flight generations get the whole drain before the engine is told to stop.
    assert engine_pre_stop >= drain
    # The engine stops, then the sidecar drains and aborts, all inside the grace period.
    grace = pod["terminationGracePeriodSeconds"]
    assert grace >= engine_pre_stop + ENGINE_STOP_SECS + drain + cleanup
    assert "preStop" not in _sidecar(pod).get("lifecycle", {})


def test_every_container_has_requests_limits_and_a_pinned_image(pod: dict[str, Any]) -> None:
    for container in [*pod.get("initContainers", []), *pod["containers"]]:
        image = container["image"]
        name, _, tag = image.rpartition(":")
        assert name, f"{image}: no tag"
        assert tag not in ("", "latest"), image
        assert "/" not in tag, f"{image}: no tag"
        resources = container["resources"]
        assert resources.get("requests"), container["name"]
        assert "memory" in resources.get("limits", {}), container["name"]


def test_a_disruption_budget_covers_the_workers(manifest: dict[str, dict[str, Any]]) -> None:
    budget = manifest["PodDisruptionBudget"]["spec"]
    deployment = manifest["Deployment"]["spec"]
    assert budget["selector"] == deployment["selector"]
    assert budget["maxUnavailable"] < deployment["replicas"]
    labels = deployment["template"]["metadata"]["labels"]
    assert manifest["Service"]["spec"]["selector"].items() <= labels.items()
