"""What protects the public port, as an operator turns it on: TLS, mutual TLS, reflection off,
request size limits. Real ``sidecar-vllm`` processes in front of a real ``testkit-engine vllm``,
certificates made by the test (nothing committed), loopback only."""

from __future__ import annotations

import argparse
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from sidecar_common.api import sidecar_pb2, sidecar_pb2_grpc
from sidecar_server.cli import parse_config
from sidecar_server.config import EngineSpec, SidecarConfig
from sidecar_server.engine import Engine
from tests.e2e_helpers import ROOT, WAIT, child_env, free_port, log_lines, process, script, serving_port
from tests.pki import Pem, make_ca, make_leaf

pytestmark = pytest.mark.timeout(120)

CONTEXT_LENGTH = 64


# --- certificates -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    ca: Path  # the CA that signs the server's and the good client's certificates
    server_cert: Path
    server_key: Path
    ca_pem: bytes
    client: Pem  # signed by the CA
    stranger: Pem  # a client certificate from another CA


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    where = tmp_path_factory.mktemp("pki")
    ca = make_ca("sidecar test CA")
    other_ca = make_ca("some other CA")
    server = make_leaf("sidecar", ca, server=True)
    paths = {"ca.pem": ca[0].cert, "server.pem": server.cert, "server.key": server.key}
    for name, data in paths.items():
        (where / name).write_bytes(data)
    return Pki(
        ca=where / "ca.pem",
        server_cert=where / "server.pem",
        server_key=where / "server.key",
        ca_pem=ca[0].cert,
        client=make_leaf("frontend", ca, server=False),
        stranger=make_leaf("intruder", other_ca, server=False),
    )


# --- processes --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    """One testkit vLLM engine for the module, with a small context; yields its address."""
    port = free_port()
    argv = [script("testkit-engine"), "vllm", "--listen", f"127.0.0.1:{port}"]
    with process([*argv, "--context-length", str(CONTEXT_LENGTH)]) as proc:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "ready on " in line:
                break
        else:
            raise AssertionError(f"the testkit engine did not come up (exit {proc.poll()})")
        yield f"127.0.0.1:{port}"


def sidecar_argv(engine: str, *flags: str) -> list[str]:
    return [
        script("sidecar-vllm"),
        *("--grpc-endpoint", engine, "--listen", "127.0.0.1:0", "--log-format", "json"),
        *("--grpc-connections", "1", "--grpc-startup-deadline-secs", str(WAIT)),
        *flags,
    ]


def _request(request_id: str, prompt_tokens: int = 4) -> sidecar_pb2.PreprocessedRequest:
    request = sidecar_pb2.PreprocessedRequest(
        request_id=request_id, token_ids=list(range(11, 11 + prompt_tokens))
    )
    request.stop_conditions.max_tokens = 3
    return request


def _generate(
    channel: grpc.Channel, request: sidecar_pb2.PreprocessedRequest
) -> list[sidecar_pb2.LLMEngineOutput]:
    return list(sidecar_pb2_grpc.WorkerStub(channel).Generate(request, timeout=WAIT))


def _refusal(channel: grpc.Channel, request: sidecar_pb2.PreprocessedRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        _generate(channel, request)
    return refused.value


def _tls_channel(port: int, pki: Pki, client: Pem | None) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pki.ca_pem,
        private_key=client.key if client is not None else None,
        certificate_chain=client.cert if client is not None else None,
    )
    return grpc.secure_channel(f"127.0.0.1:{port}", credentials)


def _health(channel: grpc.Channel) -> int:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=WAIT)
    status: int = reply.status
    return status


# --- TLS --------------------------------------------------------------------------------------


def test_tls_serves_a_client_that_trusts_the_ca_and_refuses_plaintext(engine: str, pki: Pki) -> None:
    flags = ("--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key))
    with process(sidecar_argv(engine, *flags)) as sidecar:
        port = serving_port(sidecar)
        with _tls_channel(port, pki, client=None) as channel:
            outs = _generate(channel, _request("over-tls"))
            assert outs[-1].finish_reason != sidecar_pb2.UNSPECIFIED
            assert sum(len(o.token_ids) for o in outs) == 3
        with grpc.insecure_channel(f"127.0.0.1:{port}") as plain:
            refused = _refusal(plain, _request("plaintext"))
            assert refused.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_refuses_clients_without_a_certificate_of_the_ca(engine: str, pki: Pki) -> None:
    # Set through the environment mirrors, as a Kubernetes Secret mounted as files would be.
    env = {
        "SIDECAR_TLS_CERT": str(pki.server_cert),
        "SIDECAR_TLS_KEY": str(pki.server_key),
        "SIDECAR_TLS_CLIENT_CA": str(pki.ca),
    }
    proc = subprocess.Popen(
        sidecar_argv(engine),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**child_env(), **env},
    )
    try:
        port = serving_port(proc)
        with _tls_channel(port, pki, pki.client) as channel:
            assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
            outs = _generate(channel, _request("with-client-cert"))
            assert outs[-1].finish_reason != sidecar_pb2.UNSPECIFIED
        for who in (None, pki.stranger):
            with _tls_channel(port, pki, who) as channel:
                refused = _refusal(channel, _request("no-valid-client-cert"))
                assert refused.code() == grpc.StatusCode.UNAVAILABLE
                with pytest.raises(grpc.RpcError):
                    _health(channel)
        # Neither refused client reached the Worker: no request but the first was served.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT) == 0
        finished = [e for e in log_lines(proc) if e.get("event") == "generate finished"]
        assert [e["public_id"] for e in finished] == ["with-client-cert"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=WAIT)


def _usage_error(*argv: str) -> str:
    result = subprocess.run(
        list(argv), capture_output=True, text=True, timeout=WAIT, cwd=ROOT, env=child_env(), check=False
    )
    assert result.returncode == 2, result.stdout + result.stderr
    return result.stderr


def test_tls_flags_that_cannot_work_are_usage_errors_naming_the_flag(pki: Pki) -> None:
    # Never dialled: a usage error exits before any network I/O.
    base = sidecar_argv("127.0.0.1:1")
    assert "--tls-cert" in _usage_error(*base, "--tls-key", str(pki.server_key))
    assert "--tls-key" in _usage_error(*base, "--tls-cert", str(pki.server_cert))
    assert "--tls-client-ca" in _usage_error(*base, "--tls-client-ca", str(pki.ca))
    swapped = _usage_error(*base, "--tls-cert", str(pki.server_key), "--tls-key", str(pki.server_cert))
    assert str(pki.server_key) in swapped
    assert "certificate" in swapped
    assert "--tls-cert" in _usage_error(
        *base, "--tls-cert", "/nonexistent.pem", "--tls-key", str(pki.server_key)
    )


# --- reflection and size limits ---------------------------------------------------------------


def _list_services(channel: grpc.Channel) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=WAIT
    )
    return [s.name for reply in replies for s in reply.list_services_response.service]


def test_reflection_is_served_by_default_and_off_with_no_reflection(engine: str) -> None:
    with process(sidecar_argv(engine)) as sidecar:
        port = serving_port(sidecar)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert "sidecar.v1.Worker" in _list_services(channel)
    with process(sidecar_argv(engine, "--no-reflection")) as sidecar:
        port = serving_port(sidecar)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.RpcError) as off:
                _list_services(channel)
            assert off.value.code() == grpc.StatusCode.UNIMPLEMENTED
            # Everything else is still served.
            assert _generate(channel, _request("still-served"))[-1].finish_reason != sidecar_pb2.UNSPECIFIED


def test_a_request_larger_than_max_request_bytes_is_refused_before_the_sidecar_reads_it(engine: str) -> None:
    with process(sidecar_argv(engine, "--max-request-bytes", "1024")) as sidecar:
        port = serving_port(sidecar)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            small = _request("small")
            assert small.ByteSize() < 1024
            assert _generate(channel, small)[-1].finish_reason != sidecar_pb2.UNSPECIFIED
            big = _request("big")
            big.multi_modal_data.add(url="data:," + "x" * 2000)
            assert big.ByteSize() > 1024
            refused = _refusal(channel, big)
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "larger than max" in (refused.details() or "")
            assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
        sidecar.send_signal(signal.SIGTERM)
        assert sidecar.wait(timeout=WAIT) == 0
        events = [
            e for e in log_lines(sidecar) if e.get("event") in ("generate finished", "generate refused")
        ]
        # The oversized request never reached the Worker: only the small one was served.
        assert [e["public_id"] for e in events] == ["small"]


def test_a_prompt_that_does_not_fit_the_discovered_context_is_refused_as_invalid_argument(
    engine: str,
) -> None:
    with process(sidecar_argv(engine)) as sidecar:
        port = serving_port(sidecar)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            info = sidecar_pb2_grpc.WorkerStub(channel).GetModelInfo(
                sidecar_pb2.GetModelInfoRequest(), timeout=WAIT
            )
            assert info.max_context_length == CONTEXT_LENGTH
            fits = _request("fits", prompt_tokens=CONTEXT_LENGTH - 4)
            assert _generate(channel, fits)[-1].finish_reason != sidecar_pb2.UNSPECIFIED
            refused = _refusal(channel, _request("too-long", prompt_tokens=CONTEXT_LENGTH))
            assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert str(CONTEXT_LENGTH) in (refused.details() or "")


# --- grpc's own log lines -----------------------------------------------------------------------


def _refused_client_then_stop(engine: str, pki: Pki, **env: str) -> tuple[str, str]:
    """A mutual-TLS sidecar refuses one client without a certificate; its stdout and stderr."""
    flags = (
        "--tls-cert",
        str(pki.server_cert),
        "--tls-key",
        str(pki.server_key),
        "--tls-client-ca",
        str(pki.ca),
    )
    proc = subprocess.Popen(
        sidecar_argv(engine, *flags),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**child_env(), **env},
    )
    try:
        port = serving_port(proc)
        with _tls_channel(port, pki, client=None) as channel, pytest.raises(grpc.RpcError):
            _health(channel)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=WAIT)
        assert proc.returncode == 0
        return out, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=WAIT)


def test_grpc_core_lines_go_to_stderr_as_plain_text_and_grpc_verbosity_silences_them(
    engine: str, pki: Pki
) -> None:
    # What deploy/README.md tells operators: the C core's own lines (here the refused handshake)
    # are plain text on stderr, never mixed into the JSON lines on stdout.
    out, err = _refused_client_then_stop(engine, pki)
    assert "Handshake failed" in err
    assert all(line.startswith("{") for line in out.splitlines() if line.strip())
    _, quiet = _refused_client_then_stop(engine, pki, GRPC_VERBOSITY="ERROR")
    assert "Handshake failed" not in quiet


# --- the flags and their environment mirrors (no process) ----------------------------------------


def _spec() -> EngineSpec:
    def build(config: SidecarConfig, namespace: argparse.Namespace) -> Engine:
        raise AssertionError("parsing must not build the engine")

    return EngineSpec(name="fake", add_arguments=lambda parser: None, build=build)


def test_security_flags_have_environment_mirrors_and_the_flag_wins(pki: Pki) -> None:
    endpoint = ["--grpc-endpoint", "127.0.0.1:1"]
    defaults, _ = parse_config(_spec(), endpoint, {})
    assert (defaults.tls, defaults.reflection, defaults.max_request_bytes) == (None, True, 64 * 1024 * 1024)
    environ = {
        "SIDECAR_TLS_CERT": str(pki.server_cert),
        "SIDECAR_TLS_KEY": str(pki.server_key),
        "SIDECAR_TLS_CLIENT_CA": str(pki.ca),
        "SIDECAR_NO_REFLECTION": "true",
        "SIDECAR_MAX_REQUEST_BYTES": "4096",
    }
    config, _ = parse_config(_spec(), endpoint, environ)
    assert config.tls is not None
    assert (config.tls.cert, config.tls.key, config.tls.client_ca) == (
        pki.server_cert,
        pki.server_key,
        pki.ca,
    )
    assert config.tls.mutual
    assert (config.reflection, config.max_request_bytes) == (False, 4096)
    flagged, _ = parse_config(_spec(), [*endpoint, "--max-request-bytes", "8192"], environ)
    assert flagged.max_request_bytes == 8192


@pytest.mark.parametrize("value", ["0", "-1", "lots", str(2**31)])
def test_a_bad_max_request_bytes_is_a_usage_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_config(_spec(), ["--grpc-endpoint", "127.0.0.1:1", "--max-request-bytes", value], {})
    assert exit_.value.code == 2
    assert "--max-request-bytes" in capsys.readouterr().err
