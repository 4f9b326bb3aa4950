"""The frontend dialling its workers over mutual TLS, as an operator runs it: real
``testkit-engine``, ``sidecar-vllm`` and ``sidecar-frontend`` processes on loopback, certificates
made by the test (nothing committed), files rotated in place as cert-manager does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.e2e_helpers import WAIT, free_port, log_lines, process, script
from tests.pki import Ca, Pem, make_ca, make_leaf
from tests.process.test_frontend_process import PROMPT, post_json, wait_ready

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow(20)]

REFUSED = "worker refused: TLS handshake failed"
RECONNECTED = "worker reconnected with the new TLS files"


class Log:
    """A child's JSON log lines, read as they come and kept, so a line that came before the
    test asked for it is not lost."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.seen: list[dict[str, Any]] = []
        self._lines = log_lines(proc)

    def wait_for(self, event: str, count: int = 1) -> dict[str, Any]:
        """The ``count``-th line of ``event`` (blocks until it is written; the test's timeout
        bounds it)."""
        found = [e for e in self.seen if e.get("event") == event]
        for entry in self._lines:
            self.seen.append(entry)
            if entry.get("event") == event:
                found.append(entry)
            if len(found) >= count:
                break
        assert len(found) >= count, f"no {event!r} line (#{count}); exit {self.proc.poll()}: {self.seen}"
        return found[count - 1]

    def rest(self) -> list[dict[str, Any]]:
        """Every line, once the process has exited."""
        self.seen.extend(self._lines)
        return self.seen


def write(path: Path, data: bytes) -> None:
    """Replace ``path`` atomically (a new inode, as a rotated Secret's files are)."""
    temporary = path.with_suffix(path.suffix + ".new")
    temporary.write_bytes(data)
    os.replace(temporary, path)


def server_files(where: Path, name: str, ca: Ca, client_ca: Ca) -> tuple[str, ...]:
    """The sidecar flags for mutual TLS with a server certificate ``ca`` signed and clients
    ``client_ca`` signed."""
    leaf = make_leaf("sidecar", ca, server=True)
    write(where / f"{name}.pem", leaf.cert)
    write(where / f"{name}.key", leaf.key)
    write(where / f"{name}-clients.pem", client_ca[0].cert)
    return (
        *("--tls-cert", str(where / f"{name}.pem"), "--tls-key", str(where / f"{name}.key")),
        *("--tls-client-ca", str(where / f"{name}-clients.pem")),
    )


def frontend_files(where: Path, ca: Ca, client: Pem) -> dict[str, str]:
    """The frontend's TLS files (written, or rotated, in place) as SIDECAR_FRONTEND_* values."""
    where.mkdir(exist_ok=True)
    write(where / "ca.pem", ca[0].cert)
    write(where / "tls.key", client.key)
    write(where / "tls.crt", client.cert)
    return {
        "SIDECAR_FRONTEND_WORKER_TLS_CA": str(where / "ca.pem"),
        "SIDECAR_FRONTEND_WORKER_TLS_CERT": str(where / "tls.crt"),
        "SIDECAR_FRONTEND_WORKER_TLS_KEY": str(where / "tls.key"),
    }


def engine(stack: ExitStack, *flags: str) -> str:
    port = free_port()
    argv = [script("testkit-engine"), "vllm", "--listen", f"127.0.0.1:{port}", *flags]
    proc = stack.enter_context(process(argv))
    assert proc.stderr is not None
    for line in proc.stderr:
        if "ready on " in line:
            return f"127.0.0.1:{port}"
    raise AssertionError(f"the testkit engine did not come up (exit {proc.poll()})")


def sidecar_argv(engine_address: str, port: int, tls: tuple[str, ...]) -> list[str]:
    return [
        script("sidecar-vllm"),
        *("--grpc-endpoint", engine_address, "--listen", f"127.0.0.1:{port}", "--log-format", "json"),
        *("--grpc-connections", "1", "--grpc-startup-deadline-secs", str(WAIT), *tls),
    ]


def sidecar(stack: ExitStack, engine_address: str, tls: tuple[str, ...], port: int = 0) -> tuple[Log, int]:
    proc = stack.enter_context(process(sidecar_argv(engine_address, port, tls)))
    log = Log(proc)
    return log, int(log.wait_for("serving")["port"])


@contextmanager
def frontend(workers: list[int], env: dict[str, str]) -> Iterator[tuple[Log, str]]:
    """A frontend over ``workers``, its TLS flags given as the environment variables (the
    way a Kubernetes Secret mounted as files is wired in)."""
    argv = [script("sidecar-frontend"), "--listen", "127.0.0.1:0", "--log-format", "json"]
    for port in workers:
        argv += ["--worker", f"127.0.0.1:{port}"]
    with process(argv, env) as proc:
        log = Log(proc)
        url = f"http://127.0.0.1:{int(log.wait_for('serving')['port'])}"
        wait_ready(url)
        yield log, url


def generate(url: str, tokens: int = 3) -> None:
    status, body = post_json(
        url + "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": tokens}}
    )
    assert status == 200, body
    assert len(body["output_ids"]) == tokens


def test_mutual_tls_workers_serve_and_one_whose_certificate_the_ca_did_not_sign_is_refused(
    tmp_path: Path,
) -> None:
    fleet_ca, rogue_ca = make_ca("fleet CA"), make_ca("some other CA")
    with ExitStack() as stack:
        engine_address = engine(stack)
        _, good = sidecar(stack, engine_address, server_files(tmp_path, "good", fleet_ca, fleet_ca))
        _, rogue = sidecar(stack, engine_address, server_files(tmp_path, "rogue", rogue_ca, fleet_ca))
        env = frontend_files(tmp_path / "frontend", fleet_ca, make_leaf("frontend", fleet_ca, server=False))
        with frontend([good, rogue], env) as (log, url):
            refused = log.wait_for(REFUSED)
            assert refused["worker"] == f"127.0.0.1:{rogue}"
            assert refused["level"] == "error"
            # What the operator needs: which worker, and that its certificate is the problem.
            assert "its certificate is not trusted" in refused["error"], refused
            for _ in range(4):
                generate(url)
            log.proc.send_signal(signal.SIGTERM)
            assert log.proc.wait(timeout=WAIT) == 0
            requests = [e for e in log.rest() if e.get("event") == "request"]
            assert len(requests) == 4
            assert all(e["workers"] == [f"127.0.0.1:{good}"] for e in requests), requests


def test_a_worker_that_refuses_the_client_certificate_and_a_plaintext_worker_are_refused_by_name(
    tmp_path: Path,
) -> None:
    fleet_ca, other_ca = make_ca("fleet CA"), make_ca("some other CA")
    with ExitStack() as stack:
        engine_address = engine(stack)
        _, good = sidecar(stack, engine_address, server_files(tmp_path, "good", fleet_ca, fleet_ca))
        _, strict = sidecar(stack, engine_address, server_files(tmp_path, "strict", fleet_ca, other_ca))
        _, plain = sidecar(stack, engine_address, ())
        env = frontend_files(tmp_path / "frontend", fleet_ca, make_leaf("frontend", fleet_ca, server=False))
        with frontend([good, strict, plain], env) as (log, url):
            why: dict[str, str] = {}
            seen = 0
            while len(why) < 2:  # a refused worker is retried (and logged again) meanwhile
                seen += 1
                line = log.wait_for(REFUSED, count=seen)
                why.setdefault(line["worker"], line["error"])
            assert "does not trust this client's certificate" in why[f"127.0.0.1:{strict}"], why
            assert "does not speak TLS" in why[f"127.0.0.1:{plain}"], why
            generate(url)


def test_rotated_files_are_used_for_new_connections_and_calls_in_flight_finish_on_the_old_ones(
    tmp_path: Path,
) -> None:
    old_ca, new_ca = make_ca("CA 2026"), make_ca("CA 2027")
    files = tmp_path / "frontend"
    port = free_port()
    with ExitStack() as stack:
        # A request whose id holds "held" streams two tokens, then holds its stream open.
        engine_address = engine(stack, "--fault", "held=hang:2")
        first = stack.enter_context(
            process(sidecar_argv(engine_address, port, server_files(tmp_path, "s1", old_ca, old_ca)))
        )
        first_log = Log(first)
        first_log.wait_for("serving")
        env = frontend_files(files, old_ca, make_leaf("frontend", old_ca, server=False))
        with frontend([port], env) as (log, url):
            body = {
                "rid": "held",
                "input_ids": PROMPT,
                "sampling_params": {"max_new_tokens": 8},
                "stream": True,
            }
            request = urllib.request.Request(
                url + "/generate",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=WAIT) as held:
                assert held.readline().startswith(b"data: ")
                # 1. A new client certificate from the same CA: new connections are made with
                # it, while the held stream stays on its connection.
                frontend_files(files, old_ca, make_leaf("frontend renewed", old_ca, server=False))
                log.wait_for(RECONNECTED)
                generate(url)
                held.close()
            # 2. A new CA for everything: the worker restarts with a certificate of the new CA
            # that only accepts clients of the new CA; only connections made with the rotated
            # files reach it.
            first.send_signal(signal.SIGTERM)
            assert first.wait(timeout=WAIT) == 0
            frontend_files(files, new_ca, make_leaf("frontend", new_ca, server=False))
            second = stack.enter_context(
                process(sidecar_argv(engine_address, port, server_files(tmp_path, "s2", new_ca, new_ca)))
            )
            Log(second).wait_for("serving")
            log.wait_for(RECONNECTED, count=2)
            wait_ready(url)
            generate(url)
        finished = [e["public_id"] for e in first_log.rest() if e.get("event") == "generate finished"]
        # The held stream was never cut by the rotation: one generation, ended when the client
        # left, after the request made on the new connections.
        assert finished.count("held") == 1, finished
        assert finished.index("held") > 0, finished
