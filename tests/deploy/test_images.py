"""Every container in deploy/kubernetes/ against deploy/images.yaml, the one place that says
which images we name and what each runs: the command line the kubelet would start (the
image's ENTRYPOINT, or `command`, then `args`) is one that program accepts; one name for our
image everywhere; and what every workload needs in production (engine /dev/shm, hardened
containers of ours, a disruption budget, frontends that survive a restart)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from sidecar_frontend.cli import parse_config as parse_frontend_config
from tests.deploy.conftest import ROOT

IMAGES: dict[str, Any] = yaml.safe_load((ROOT / "deploy" / "images.yaml").read_text())
OURS: str = IMAGES["ours"]["image"]
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
# What the first argument of our image's `sidecar` command may be.
OUR_COMMANDS = ("vllm", "sglang", "frontend")


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def workloads() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in MANIFESTS:
        for doc in documents(path):
            if "template" in doc.get("spec", {}):
                yield f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc


def containers() -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(id, container, pod spec) for every container of every workload."""
    for name, doc in workloads():
        pod = doc["spec"]["template"]["spec"]
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            yield f"{name}/{container['name']}", container, pod


def repository(image: str) -> str:
    name, _, tag = image.rpartition(":")
    assert name, f"{image}: no tag"
    assert tag, f"{image}: no tag"
    assert "/" not in tag, f"{image}: no tag"
    return name


def entrypoint_of(image: str) -> list[str] | None:
    if image == OURS:
        return list(IMAGES["ours"]["entrypoint"])
    engines: dict[str, Any] = IMAGES["engines"]
    assert repository(image) in engines, f"{image} is not in deploy/images.yaml"
    found = engines[repository(image)]["entrypoint"]
    return None if found is None else list(found)


def argv(container: dict[str, Any]) -> list[str]:
    """The command line the kubelet starts: `command` replaces the ENTRYPOINT, `args` follow."""
    command = container.get("command") or entrypoint_of(container["image"])
    assert command, f"{container['name']}: {container['image']} has no ENTRYPOINT we rely on: set command"
    return [*command, *container.get("args", [])]


def test_our_entrypoint_is_the_dockerfiles() -> None:
    (line,) = [ln for ln in (ROOT / "Dockerfile").read_text().splitlines() if ln.startswith("ENTRYPOINT")]
    assert json.loads(line.removeprefix("ENTRYPOINT").strip()) == IMAGES["ours"]["entrypoint"]


def test_every_image_entry_says_where_its_entrypoint_comes_from() -> None:
    for name, entry in IMAGES["engines"].items():
        assert entry.get("source"), name
        assert "entrypoint" in entry, name


@pytest.mark.parametrize(("name", "container", "pod"), [pytest.param(*c, id=c[0]) for c in containers()])
def test_each_container_runs_a_command_line_its_program_accepts(
    name: str, container: dict[str, Any], pod: dict[str, Any]
) -> None:
    line = argv(container)
    image = container["image"]
    if image == OURS:
        assert line[0] == "sidecar"
        assert line[1] in OUR_COMMANDS, line
        return
    if repository(image) == "vllm/vllm-openai":
        # `vllm serve MODEL [flags]`: the model first, once; `serve` is the entrypoint's.
        assert line[:2] == ["vllm", "serve"], line
        model = line[2]
        assert not model.startswith("-"), f"vllm serve {model} ...: the model must follow serve"
        assert model != "serve", "vllm serve serve ...: the image's ENTRYPOINT already says serve"
        assert "serve" not in line[3:], line
        assert "--grpc" in line, "the sidecar speaks vLLM's gRPC API"
        return
    if repository(image) == "lmsysorg/sglang":
        assert line[:3] == ["python3", "-m", "sglang.launch_server"], line
        return
    raise AssertionError(f"{name}: no rule for {image}")


def test_the_old_vllm_args_would_be_refused() -> None:
    # What the manifests said before: `vllm serve serve MODEL`.
    old = {"image": "vllm/vllm-openai:v0.33.0", "args": ["serve", "Qwen/Qwen2.5-0.5B-Instruct", "--grpc"]}
    assert argv(old)[2] == "serve"


def _image_mentions(text: str) -> list[str]:
    return re.findall(r"(?<![\w/.-])((?:[\w.-]+/)*llm-sidecars:[\w.-]+)", text)


@pytest.mark.parametrize(
    "path",
    [
        ROOT / "Dockerfile",
        ROOT / "README.md",
        ROOT / "deploy" / "README.md",
        *MANIFESTS,
        *sorted((ROOT / "docs").glob("*.md")),
    ],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_one_name_for_our_image_everywhere(path: Path) -> None:
    for mention in _image_mentions(path.read_text()):
        assert mention == OURS, f"{path.name} names {mention}, deploy/images.yaml says {OURS}"


def test_the_dockerfile_and_the_manifests_name_our_image() -> None:
    assert OURS in (ROOT / "Dockerfile").read_text()
    assert OURS in (ROOT / "deploy" / "README.md").read_text()
    assert any(container["image"] == OURS for _, container, _ in containers())


def test_the_image_exposes_the_ports_the_manifests_use() -> None:
    exposed: set[int] = set()
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("EXPOSE"):
            exposed.update(int(port) for port in line.split()[1:])
    for name, container, _ in containers():
        if container["image"] == OURS:
            for port in container.get("ports", []):
                assert port["containerPort"] in exposed, f"{name}: {port}"


@pytest.mark.parametrize(("name", "container", "pod"), [pytest.param(*c, id=c[0]) for c in containers()])
def test_engines_get_a_memory_backed_dev_shm(
    name: str, container: dict[str, Any], pod: dict[str, Any]
) -> None:
    if container["image"] == OURS:
        return
    (mount,) = [m for m in container.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in pod.get("volumes", []) if v["name"] == mount["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"
    assert volume["emptyDir"].get("sizeLimit"), "bounded: it counts against the Pod's memory"


@pytest.mark.parametrize(("name", "container", "pod"), [pytest.param(*c, id=c[0]) for c in containers()])
def test_our_containers_are_hardened(name: str, container: dict[str, Any], pod: dict[str, Any]) -> None:
    if container["image"] != OURS:
        return
    context = container["securityContext"]
    assert context["runAsNonRoot"] is True
    assert context["runAsUser"] == context["runAsGroup"] == 65532, "the image's user and group"
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"]["drop"] == ["ALL"]
    assert context["seccompProfile"] == {"type": "RuntimeDefault"}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_workload_has_a_disruption_budget(path: Path) -> None:
    docs = documents(path)
    budgets = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    for doc in docs:
        if "template" not in doc.get("spec", {}):
            continue
        labels = doc["spec"]["template"]["metadata"]["labels"]
        covering = [b for b in budgets if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert len(covering) == 1, f"{doc['metadata']['name']}: {len(covering)} budgets"
        (budget,) = covering
        assert budget["spec"]["maxUnavailable"] < doc["spec"]["replicas"]


def frontends() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for name, doc in workloads():
        pod = doc["spec"]["template"]["spec"]
        if any(c.get("args", [""])[0] == "frontend" for c in pod["containers"]):
            found.append((name, doc))
    return found


def test_there_are_frontend_deployments() -> None:
    assert len(frontends()) >= 2  # one per fleet manifest


@pytest.mark.parametrize(("name", "deployment"), [pytest.param(*f, id=f[0]) for f in frontends()])
def test_frontends_are_replicated_and_probed_where_it_helps(name: str, deployment: dict[str, Any]) -> None:
    assert deployment["kind"] == "Deployment"
    assert deployment["spec"]["replicas"] >= 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    (frontend,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in frontend["env"]}
    ports = {p["name"]: p["containerPort"] for p in frontend["ports"]}
    assert ports["http"] == int(env["SIDECAR_FRONTEND_LISTEN"].rsplit(":", 1)[1])
    assert ports["metrics"] == int(env["SIDECAR_FRONTEND_METRICS_PORT"])
    # The real CLI accepts the container's flags and variables (downward-API values stand in).
    settings = {name: value for name, value in env.items() if value is not None}
    flags = [flag.replace("$(POD_NAMESPACE)", "serving") for flag in frontend["args"][1:]]
    config = parse_frontend_config(flags, settings)
    assert config.metrics_port == ports["metrics"]
    assert config.listen.rsplit(":", 1)[1] == str(ports["http"])
    readiness = frontend["readinessProbe"]["httpGet"]
    assert (readiness["path"], readiness["port"]) == ("/health", "http")
    # tests/deploy/test_frontend_probes.py: /metrics answers while /health does not.
    liveness = frontend["livenessProbe"]["httpGet"]
    assert (liveness["path"], liveness["port"]) == ("/metrics", "metrics")
