"""deploy/kubernetes/fleet-*.yaml read as Kubernetes and our CLIs read them: the headless
Service, the StatefulSet and the frontend's --dns-name agree; the sidecar settings (etcd
registration included) are ones the real CLI accepts; the frontend's discovery flags parse;
the shutdown numbers leave the drain its time."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import yaml

from sidecar_command import engine_spec
from sidecar_frontend.discovery import DiscoveryConfig, add_discovery_arguments, discovery_config_from_args
from sidecar_server.cli import parse_config
from sidecar_server.config import SidecarConfig
from tests.deploy.conftest import ROOT

DNS = ROOT / "deploy" / "kubernetes" / "fleet-dns.yaml"
ETCD = ROOT / "deploy" / "kubernetes" / "fleet-etcd.yaml"
# What Kubernetes would substitute for the downward-API variables.
POD = {"POD_IP": "10.0.3.17", "POD_NAMESPACE": "serving"}
ENGINE_STOP_SECS = 30  # vLLM's own exit after SIGTERM


def documents(path: Path) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(path.read_text())}


def one(docs: dict[tuple[str, str], dict[str, Any]], kind: str, part: str = "") -> dict[str, Any]:
    (found,) = [d for (k, name), d in docs.items() if k == kind and part in name]
    return found


def expand(text: str) -> str:
    for name, value in POD.items():
        text = text.replace(f"$({name})", value)
    return text


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in pod.get("initContainers", []) + pod["containers"] if c["name"] == name]
    return dict(found)


def sidecar_config(pod: dict[str, Any]) -> SidecarConfig:
    sidecar = container(pod, "sidecar")
    engine, *flags = sidecar["args"]
    environ = {e["name"]: expand(e["value"]) for e in sidecar["env"] if "value" in e}
    config, _ = parse_config(engine_spec(engine), flags, environ)
    return config


def frontend_discovery(deployment: dict[str, Any]) -> DiscoveryConfig:
    frontend = container(deployment["spec"]["template"]["spec"], "frontend")
    command, *flags = frontend["args"]
    assert command == "frontend"
    parser = argparse.ArgumentParser()
    add_discovery_arguments(parser)
    known, _ = parser.parse_known_args([expand(f) for f in flags])
    return discovery_config_from_args(known)


@pytest.fixture(scope="module")
def dns() -> dict[tuple[str, str], dict[str, Any]]:
    return documents(DNS)


@pytest.fixture(scope="module")
def etcd() -> dict[tuple[str, str], dict[str, Any]]:
    return documents(ETCD)


def test_dns_frontends_resolve_the_headless_service_of_the_workers(
    dns: dict[tuple[str, str], dict[str, Any]],
) -> None:
    workers = one(dns, "StatefulSet")
    service = dns[("Service", workers["spec"]["serviceName"])]
    assert service["spec"]["clusterIP"] == "None", "headless: one DNS record per ready Pod"
    assert not service["spec"].get("publishNotReadyAddresses"), "only ready (SERVING) Pods"
    labels = workers["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    discovery = frontend_discovery(one(dns, "Deployment"))
    (target,) = discovery.dns_targets
    assert discovery.mode == "dns"
    assert target.host == f"{service['metadata']['name']}.{POD['POD_NAMESPACE']}.svc.cluster.local"
    pod = workers["spec"]["template"]["spec"]
    listen_port = int(sidecar_config(pod).listen.rsplit(":", 1)[1])
    assert target.port == listen_port == service["spec"]["ports"][0]["port"]


def test_dns_workers_run_the_sidecar_as_a_native_sidecar_that_does_not_register(
    dns: dict[tuple[str, str], dict[str, Any]],
) -> None:
    pod = one(dns, "StatefulSet")["spec"]["template"]["spec"]
    assert container(pod, "sidecar")["restartPolicy"] == "Always"
    assert sidecar_config(pod).registration is None
    probes = container(pod, "sidecar")
    assert probes["startupProbe"]["grpc"]["service"] == "liveness", "must not wait for the engine"
    assert probes["readinessProbe"]["grpc"]["service"] == "sidecar.v1.Worker"


def test_dns_shutdown_leaves_the_drain_its_time(dns: dict[tuple[str, str], dict[str, Any]]) -> None:
    pod = one(dns, "StatefulSet")["spec"]["template"]["spec"]
    engine_pre_stop = int(container(pod, "engine")["lifecycle"]["preStop"]["exec"]["command"][1])
    drain = sidecar_config(pod).drain_timeout
    # The Pod leaves DNS at t=0; the frontends stop sending within one refresh plus the TTL.
    discovery = frontend_discovery(one(dns, "Deployment"))
    assert engine_pre_stop >= discovery.dns_refresh + 5 + drain
    needed = engine_pre_stop + ENGINE_STOP_SECS + drain + 20
    assert pod["terminationGracePeriodSeconds"] >= needed


def test_etcd_workers_register_their_pod_ip(etcd: dict[tuple[str, str], dict[str, Any]]) -> None:
    pod = one(etcd, "StatefulSet")["spec"]["template"]["spec"]
    config = sidecar_config(pod)
    assert config.registration is not None
    assert config.registration.advertise == f"{POD['POD_IP']}:50061"
    assert config.listen == "0.0.0.0:50061", "a wildcard listen is why --advertise is needed"
    discovery = frontend_discovery(one(etcd, "Deployment"))
    assert discovery.mode == "etcd"
    assert discovery.etcd_endpoints == config.registration.endpoints
    assert discovery.etcd_prefix == config.registration.prefix


def test_etcd_sidecar_is_stopped_first_and_the_engine_outlives_its_drain(
    etcd: dict[tuple[str, str], dict[str, Any]],
) -> None:
    pod = one(etcd, "StatefulSet")["spec"]["template"]["spec"]
    # An ordinary container: SIGTERM at t=0, so its key goes before anything else happens.
    assert not pod.get("initContainers")
    assert "preStop" not in container(pod, "sidecar").get("lifecycle", {})
    engine_pre_stop = int(container(pod, "engine")["lifecycle"]["preStop"]["exec"]["command"][1])
    drain = sidecar_config(pod).drain_timeout
    assert engine_pre_stop >= drain + 20
    assert pod["terminationGracePeriodSeconds"] >= engine_pre_stop + ENGINE_STOP_SECS


@pytest.mark.parametrize("path", [DNS, ETCD], ids=["dns", "etcd"])
def test_images_are_pinned(path: Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        template = doc.get("spec", {}).get("template")
        if template is None:
            continue
        pod = template["spec"]
        for c in pod.get("initContainers", []) + pod["containers"]:
            assert ":" in c["image"]
            assert not c["image"].endswith(":latest"), c["image"]
