"""The frontend Deployment's probes against a real `sidecar-frontend` started with the
manifest's settings: readiness (/health on the http port) follows the workers, liveness
(/metrics on the metrics port) does not, so a fleet outage takes frontends out of the Service
without restarting them."""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest
import yaml

from tests.deploy.conftest import ROOT
from tests.e2e_helpers import WAIT, child_env, free_port, script, serving_port

FLEETS = [ROOT / "deploy" / "kubernetes" / name for name in ("fleet-dns.yaml", "fleet-etcd.yaml")]


def frontend_container(path_index: int) -> dict[str, Any]:
    for doc in yaml.safe_load_all(FLEETS[path_index].read_text()):
        if doc["kind"] == "Deployment":
            (container,) = doc["spec"]["template"]["spec"]["containers"]
            if container["args"][0] == "frontend":
                return dict(container)
    raise AssertionError("no frontend Deployment")


@contextmanager
def started(argv: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=WAIT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=WAIT)
        if proc.stdout is not None:
            proc.stdout.close()


def status(url: str) -> int:
    """The answer's status; 0 when none came (refused, reset or slow: asked again)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            code: int = response.status
            return code
    except urllib.error.HTTPError as err:
        return err.code
    except (urllib.error.URLError, OSError):
        return 0


def until_status(url: str, wanted: int, *children: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + WAIT
    while (code := status(url)) != wanted:
        # Which of the processes it waits on are still running (None) or exited (their code).
        running = {" ".join(map(str, child.args[:2])): child.poll() for child in children}  # type: ignore[index]
        assert time.monotonic() < deadline, f"{url}: {code}, never {wanted}; processes: {running}"
        time.sleep(0.05)  # polling a real process: there is no event to wait on


@pytest.mark.parametrize("fleet", [0, 1], ids=["dns", "etcd"])
def test_readiness_follows_the_workers_and_liveness_does_not(fleet: int) -> None:
    container = frontend_container(fleet)
    env = child_env()
    env.update({e["name"]: e["value"] for e in container["env"] if "value" in e})
    http_port, metrics_port = free_port(), free_port()
    # The manifest's settings, on loopback ports; the workers from a static list instead of
    # the cluster's DNS or etcd: one sidecar that is not there yet.
    env["SIDECAR_FRONTEND_LISTEN"] = f"127.0.0.1:{http_port}"
    env["SIDECAR_FRONTEND_METRICS_PORT"] = str(metrics_port)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    probe_port = {ports["http"]: http_port, ports["metrics"]: metrics_port}
    named = {"http": ports["http"], "metrics": ports["metrics"]}

    def probe_url(kind: str) -> str:
        get = container[kind]["httpGet"]
        return f"http://127.0.0.1:{probe_port[named[get['port']]]}{get['path']}"

    engine_port, sidecar_port = free_port(), free_port()
    with ExitStack() as stack:
        frontend = stack.enter_context(
            started([script("sidecar-frontend"), "--worker", f"127.0.0.1:{sidecar_port}"], env)
        )
        assert serving_port(frontend) == http_port
        # No worker: not ready (out of the Service), but alive (no restart).
        until_status(probe_url("readinessProbe"), 503)
        assert status(probe_url("livenessProbe")) == 200
        # A worker comes: ready, and still alive.
        engine = stack.enter_context(
            started([script("testkit-engine"), "vllm", "--listen", f"127.0.0.1:{engine_port}"], child_env())
        )
        sidecar = stack.enter_context(
            started(
                [
                    script("sidecar-vllm"),
                    "--grpc-endpoint",
                    f"127.0.0.1:{engine_port}",
                    "--listen",
                    f"127.0.0.1:{sidecar_port}",
                    "--grpc-connections",
                    "1",
                    "--log-format",
                    "json",
                ],
                child_env(),
            )
        )
        # The sidecar serves first (its own start is not what this test measures), then the
        # frontend notices within the wait.
        assert serving_port(sidecar) == sidecar_port
        until_status(probe_url("readinessProbe"), 200, engine, sidecar, frontend)
        assert status(probe_url("livenessProbe")) == 200
        # The worker goes: not ready again, still alive.
        sidecar.terminate()
        assert sidecar.wait(timeout=WAIT) == 0
        until_status(probe_url("readinessProbe"), 503)
        assert status(probe_url("livenessProbe")) == 200
