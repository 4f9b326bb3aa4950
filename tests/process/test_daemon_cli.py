"""The console scripts and the daemon as an operator runs them: real processes, real signals,
a real systemd notification socket, loopback only.

The daemon tests run ``run_engine`` with the fake engine below in a child process (python -c),
so they exercise the real CLI, daemon, server and pool without an engine package.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import anyio
import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from sidecar_common.api import sidecar_pb2, sidecar_pb2_grpc
from sidecar_common.pool import ChannelPool, Deadline, SystemClock, retry_until_deadline
from sidecar_server import systemd
from sidecar_server.config import EngineSpec, SidecarConfig
from sidecar_server.engine import HEALTHY, Engine, EngineHealth, EngineLoad, GenerateCall
from tests.e2e_helpers import stop

pytestmark = pytest.mark.slow(58)

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# Bound on every child process wait: far above what any of these needs, never hit when green.
WAIT = 30.0


class FakeEngine:
    """An engine whose start() is chosen by --fake-start (a real pool connect, ok, or hang),
    which streams --fake-tokens tokens --fake-token-delay-secs apart, and which appends every
    private id it is asked to abort to --fake-abort-file."""

    def __init__(self, config: SidecarConfig, namespace: argparse.Namespace) -> None:
        self._config = config
        self._mode: str = namespace.fake_start
        self._tokens: int = namespace.fake_tokens
        self._delay: float = namespace.fake_token_delay_secs
        self._abort_file: str | None = namespace.fake_abort_file
        self._hold_after_terminal: bool = namespace.fake_hold_after_terminal
        self._pool: ChannelPool | None = None

    @property
    def name(self) -> str:
        return "fake"

    async def start(self) -> None:
        if self._mode == "pool":
            self._pool = ChannelPool(self._config.pool)
            await self._pool.connect(Deadline.start(SystemClock(), self._config.pool.startup_deadline))
        elif self._mode == "hang":
            await anyio.sleep(3600)
        elif self._mode == "bug":
            # A programming error inside a start-up attempt (as an adapter bug would be).
            async def attempt(timeout: float) -> None:
                raise TypeError("unsupported operand type(s) for +: 'NoneType' and 'int'")

            deadline = Deadline.start(SystemClock(), self._config.pool.startup_deadline)
            await retry_until_deadline("fake engine", attempt, deadline, self._config.pool.retry)

    def model_info(self) -> sidecar_pb2.ModelInfo:
        return sidecar_pb2.ModelInfo(engine="fake", served_model_name="fake-model", max_context_length=64)

    def validate(self, request: sidecar_pb2.PreprocessedRequest) -> None:
        return None

    async def generate(self, call: GenerateCall) -> AsyncIterator[sidecar_pb2.LLMEngineOutput]:
        for token in range(self._tokens):
            if token:
                await anyio.sleep(self._delay)
            yield sidecar_pb2.LLMEngineOutput(token_ids=[100 + token])
        yield sidecar_pb2.LLMEngineOutput(finish_reason=sidecar_pb2.LENGTH)
        if self._hold_after_terminal:
            await anyio.sleep(3600)  # finished, but the stream stays open

    async def abort(self, private_id: str) -> None:
        if self._abort_file:
            # A real abort is a network call: it yields to the loop before it lands.
            await anyio.sleep(0.01)
            with open(self._abort_file, "a") as f:  # noqa: ASYNC230 - tiny, and must not yield
                f.write(private_id + "\n")

    async def load(self) -> EngineLoad:
        return EngineLoad()

    async def health(self) -> EngineHealth:
        return HEALTHY

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()


def _fake_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fake-start", choices=("pool", "ok", "hang", "bug"), default="pool")
    parser.add_argument("--fake-tokens", type=int, default=3)
    parser.add_argument("--fake-token-delay-secs", type=float, default=0.0)
    parser.add_argument("--fake-abort-file", default=None)
    parser.add_argument("--fake-hold-after-terminal", action="store_true")


def _fake_build(config: SidecarConfig, namespace: argparse.Namespace) -> Engine:
    return FakeEngine(config, namespace)


FAKE_SPEC = EngineSpec(name="fake", add_arguments=_fake_arguments, build=_fake_build)

_RUN_FAKE = (
    "import sys; from tests.process.test_daemon_cli import FAKE_SPEC; "
    "from sidecar_server.cli import run_engine; raise SystemExit(run_engine(FAKE_SPEC))"
)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_") and k != "NOTIFY_SOCKET"}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def _script(name: str) -> str:
    path = BIN / name
    found = str(path) if path.exists() else shutil.which(name)
    assert found, f"console script {name} is not installed"
    return found


def _run(argv: Sequence[str], **extra_env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv), capture_output=True, text=True, timeout=WAIT, cwd=ROOT, env=_env(**extra_env), check=False
    )


def _fake(*args: str) -> list[str]:
    return [sys.executable, "-c", _RUN_FAKE, *args]


@pytest.fixture
def idle_listener() -> Iterator[tuple[socket.socket, str]]:
    """A loopback port that accepts TCP connections but never speaks: any connection attempt
    by the process under test shows up in its backlog."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.setblocking(False)
    try:
        yield sock, f"127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def _nobody_connected(sock: socket.socket) -> bool:
    try:
        conn, _ = sock.accept()
    except BlockingIOError:
        return True
    conn.close()
    return False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# --- the `sidecar` command ------------------------------------------------------------------


def test_sidecar_without_engine_says_so_in_one_line_and_exits_2() -> None:
    result = _run([_script("sidecar")])
    assert result.returncode == 2
    assert result.stderr.startswith("sidecar: error: an engine name is required")
    assert result.stderr.count("\n") == 1
    assert "vllm" in result.stderr
    assert "sglang" in result.stderr


def test_sidecar_unknown_engine_exits_2() -> None:
    result = _run([_script("sidecar"), "nosuch", "--grpc-endpoint", "127.0.0.1:1"])
    assert result.returncode == 2
    assert "nosuch" in result.stderr
    assert "vllm" in result.stderr


def test_sidecar_help_exits_0() -> None:
    result = _run([_script("sidecar"), "--help"])
    assert result.returncode == 0
    assert "vllm" in result.stdout


# --- usage errors: exit 2 before any network I/O ----------------------------------------------


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--grpc-connections", "0"], "--grpc-connections"),
        (["--grpc-startup-deadline-secs", "-1"], "--grpc-startup-deadline-secs"),
        (["--listen", "nowhere"], "--listen"),
    ],
)
def test_bad_flag_exits_2_without_touching_the_engine(
    idle_listener: tuple[socket.socket, str], args: list[str], named: str
) -> None:
    sock, address = idle_listener
    result = _run(_fake("--grpc-endpoint", address, *args))
    assert result.returncode == 2, result.stderr
    assert named in result.stderr
    assert _nobody_connected(sock)


def test_bad_endpoint_exits_2_without_touching_the_engine(idle_listener: tuple[socket.socket, str]) -> None:
    sock, address = idle_listener
    result = _run(_fake("--grpc-endpoint", f"https://{address}"))
    assert result.returncode == 2
    assert "--grpc-endpoint" in result.stderr
    assert "TLS" in result.stderr
    assert _nobody_connected(sock)


def test_bad_environment_value_exits_2_naming_the_variable(idle_listener: tuple[socket.socket, str]) -> None:
    sock, address = idle_listener
    result = _run(_fake(), SIDECAR_GRPC_ENDPOINT=address, SIDECAR_GRPC_CONNECTIONS="-4")
    assert result.returncode == 2
    assert "SIDECAR_GRPC_CONNECTIONS" in result.stderr
    assert _nobody_connected(sock)


# --- systemd notification ---------------------------------------------------------------------


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify.sock")
    sock.bind(path)
    sock.settimeout(WAIT)
    try:
        yield sock, path
    finally:
        sock.close()


def test_notify_sends_one_datagram_to_the_socket(notify_socket: tuple[socket.socket, str]) -> None:
    sock, path = notify_socket
    assert systemd.notify("READY=1\nSTATUS=serving", environ={"NOTIFY_SOCKET": path})
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving"


def test_notify_reaches_an_abstract_socket() -> None:
    name = f"sidecar-test-{os.getpid()}-{time.monotonic_ns()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(WAIT)
        assert systemd.notify("STOPPING=1", environ={"NOTIFY_SOCKET": "@" + name})
        assert sock.recv(4096) == b"STOPPING=1"


def test_notify_without_socket_is_a_no_op(tmp_path: Path) -> None:
    assert systemd.notify("READY=1", environ={}) is False
    # A socket path nobody listens on: reported, never raised.
    assert systemd.notify("READY=1", environ={"NOTIFY_SOCKET": str(tmp_path / "gone.sock")}) is False


# --- the daemon -------------------------------------------------------------------------------


def _json_lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_startup_failure_exits_1_with_one_clear_line() -> None:
    port = _free_port()  # nothing listens there
    result = _run(
        _fake(
            "--grpc-endpoint", f"127.0.0.1:{port}",
            "--grpc-startup-deadline-secs", "1",
            "--grpc-connections", "2",
            "--listen", "127.0.0.1:0",
            "--log-format", "json",
        )
    )  # fmt: skip
    assert result.returncode == 1
    errors = [e for e in _json_lines(result.stdout) if e.get("level") in ("error", "critical")]
    assert len(errors) == 1, result.stdout
    assert errors[0]["event"] == "start-up failed"
    assert f"127.0.0.1:{port}" in str(errors[0]["error"])
    assert "Traceback" not in result.stdout + result.stderr


def test_listen_port_in_use_exits_1_with_one_clear_line() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = _run(
            _fake("--grpc-endpoint", "127.0.0.1:1", "--fake-start", "ok", "--listen", f"127.0.0.1:{port}")
        )
    assert result.returncode == 1
    errors = [e for e in _json_lines(result.stdout) if e.get("level") == "error"]
    assert len(errors) == 1, result.stdout
    assert f"127.0.0.1:{port}" in str(errors[0]["error"])
    assert "Traceback" not in result.stdout + result.stderr


# The engine endpoint is never dialled by these fake engines (nothing listens on port 1).
STARTS = ("--grpc-endpoint", "127.0.0.1:1", "--fake-start", "ok")
HANGS = ("--grpc-endpoint", "127.0.0.1:1", "--fake-start", "hang")


class _Daemon:
    """A daemon child process whose JSON log lines are read as they come."""

    def __init__(self, *args: str, **env: str) -> None:
        self.proc = subprocess.Popen(
            _fake("--listen", "127.0.0.1:0", "--log-format", "json", *args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=_env(**env),
        )
        self.lines: list[dict[str, object]] = []

    @classmethod
    def attach(cls, proc: subprocess.Popen[str]) -> _Daemon:
        daemon = cls.__new__(cls)
        daemon.proc = proc
        daemon.lines = []
        return daemon

    def wait_for(self, event: str) -> dict[str, object]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith("{"):
                entry: dict[str, object] = json.loads(line)
                self.lines.append(entry)
                if entry.get("event") == event:
                    return entry
        raise AssertionError(f"no {event!r} log line; saw {self.lines}")

    def finish(self) -> int:
        try:
            return self.proc.wait(timeout=WAIT)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=WAIT)


def _health(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=WAIT)
        status: int = reply.status
        return status


def test_serves_then_drains_on_sigterm_and_exits_0(notify_socket: tuple[socket.socket, str]) -> None:
    sock, path = notify_socket
    daemon = _Daemon(*STARTS, NOTIFY_SOCKET=path)
    try:
        serving = daemon.wait_for("serving")
        port = int(str(serving["port"]))
        assert _health(port) == health_pb2.HealthCheckResponse.SERVING
        messages = [sock.recv(4096).decode()]
        while "READY=1" not in messages[-1]:
            messages.append(sock.recv(4096).decode())
        assert "STATUS=" in messages[-1]
        daemon.proc.send_signal(signal.SIGTERM)
        assert "STOPPING=1" in sock.recv(4096).decode()
        assert daemon.finish() == 0
    finally:
        daemon.finish()


def test_sigterm_during_startup_stops_promptly_with_exit_0() -> None:
    daemon = _Daemon(*HANGS)
    try:
        listening = daemon.wait_for("connecting to engine")
        assert listening["engine"] == "fake"
        daemon.proc.send_signal(signal.SIGTERM)
        assert daemon.finish() == 0
    finally:
        daemon.finish()


def test_health_is_not_serving_until_the_engine_started() -> None:
    daemon = _Daemon(*HANGS)
    try:
        port = int(str(daemon.wait_for("connecting to engine")["port"]))
        assert _health(port) == health_pb2.HealthCheckResponse.NOT_SERVING
        daemon.proc.send_signal(signal.SIGINT)
        assert daemon.finish() == 0
    finally:
        daemon.finish()


def _wait_health(port: int, wanted: int) -> None:
    deadline = time.monotonic() + WAIT
    while _health(port) != wanted:
        assert time.monotonic() < deadline, f"health never became {wanted}"
        time.sleep(0.05)


def _generate(channel: grpc.Channel, request_id: str) -> Iterator[sidecar_pb2.LLMEngineOutput]:
    stub = sidecar_pb2_grpc.WorkerStub(channel)
    request = sidecar_pb2.PreprocessedRequest(request_id=request_id, token_ids=[1, 2, 3])
    return iter(stub.Generate(request, timeout=WAIT))


def _error_reason(err: grpc.RpcError) -> str:
    """The ErrorInfo reason of a failed call, or "" when the status carries no details."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    if status is None:
        return ""
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return str(info.reason)
    return ""


def test_drain_lets_inflight_generations_finish_and_refuses_new_ones() -> None:
    daemon = _Daemon(
        *STARTS, "--fake-tokens", "8", "--fake-token-delay-secs", "0.25", "--drain-timeout-secs", "60"
    )
    try:
        port = int(str(daemon.wait_for("serving")["port"]))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stream = _generate(channel, "in-flight")
            chunks = [next(stream)]
            daemon.proc.send_signal(signal.SIGTERM)
            _wait_health(port, health_pb2.HealthCheckResponse.NOT_SERVING)
            with pytest.raises(grpc.RpcError) as refused:
                list(_generate(channel, "too-late"))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert _error_reason(refused.value) == "ENGINE_SHUTDOWN"
            chunks.extend(stream)
        tokens = [t for c in chunks for t in c.token_ids]
        assert tokens == [100 + i for i in range(8)]
        assert chunks[-1].finish_reason == sidecar_pb2.LENGTH
        assert daemon.finish() == 0
    finally:
        daemon.finish()


def test_second_sigterm_cancels_inflight_generations_and_aborts_them(tmp_path: Path) -> None:
    aborts = tmp_path / "aborts.txt"
    daemon = _Daemon(
        *STARTS,
        *("--fake-tokens", "5", "--fake-token-delay-secs", "3600", "--drain-timeout-secs", "3600"),
        *("--fake-abort-file", str(aborts)),
    )
    try:
        port = int(str(daemon.wait_for("serving")["port"]))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stream = _generate(channel, "stuck")
            assert list(next(stream).token_ids) == [100]
            daemon.proc.send_signal(signal.SIGTERM)
            daemon.wait_for("stop requested")
            daemon.proc.send_signal(signal.SIGTERM)
            # The drain would wait an hour: the second signal ends it, well within WAIT.
            with pytest.raises(grpc.RpcError) as ended:
                list(stream)
            # UNAVAILABLE with ENGINE_SHUTDOWN: the frontend may migrate the request.
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
            assert _error_reason(ended.value) == "ENGINE_SHUTDOWN"
        assert daemon.finish() == 0
        assert len(aborts.read_text().split()) == 1
    finally:
        daemon.finish()


def test_drain_timeout_cancels_leftovers_with_engine_shutdown_and_aborts_them(tmp_path: Path) -> None:
    aborts = tmp_path / "aborts.txt"
    daemon = _Daemon(
        *STARTS,
        *("--fake-tokens", "5", "--fake-token-delay-secs", "3600", "--drain-timeout-secs", "0"),
        *("--fake-abort-file", str(aborts)),
    )
    try:
        port = int(str(daemon.wait_for("serving")["port"]))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stream = _generate(channel, "left-over")
            assert list(next(stream).token_ids) == [100]
            daemon.proc.send_signal(signal.SIGTERM)
            with pytest.raises(grpc.RpcError) as ended:
                list(stream)
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
            # The stop after the drain gives the final statuses a grace: never a bare one.
            assert _error_reason(ended.value) == "ENGINE_SHUTDOWN"
        assert daemon.finish() == 0
        assert len(aborts.read_text().split()) == 1
    finally:
        daemon.finish()


def test_metrics_endpoint_serves_the_sidecar_registry() -> None:
    metrics_port = _free_port()
    daemon = _Daemon(*STARTS, "--metrics-port", str(metrics_port))
    try:
        port = int(str(daemon.wait_for("serving")["port"]))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert len(list(_generate(channel, "counted"))) >= 2
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=WAIT) as response:
            body = response.read().decode()
        started = [line for line in body.splitlines() if line.startswith("sidecar_requests_started")]
        assert started, body
        assert started[0].endswith(" 1.0")
        daemon.proc.send_signal(signal.SIGTERM)
        assert daemon.finish() == 0
    finally:
        daemon.finish()


# --- the real console scripts -----------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [["sidecar-vllm"], ["sidecar", "vllm"], ["sidecar-sglang"], ["sidecar", "sglang"]],
    ids=" ".join,
)
def test_engine_scripts_refuse_bad_flags_before_any_network_io(
    idle_listener: tuple[socket.socket, str], command: list[str]
) -> None:
    sock, address = idle_listener
    argv = [_script(command[0]), *command[1:]]
    result = _run([*argv, "--grpc-endpoint", address, "--grpc-connections", "0"])
    assert result.returncode == 2
    assert "--grpc-connections" in result.stderr
    result = _run([*argv, "--grpc-endpoint", f"grpcs://{address}"])
    assert result.returncode == 2
    assert "--grpc-endpoint" in result.stderr
    assert _nobody_connected(sock)


def test_bad_engine_specific_value_exits_2_before_any_network_io(
    idle_listener: tuple[socket.socket, str],
) -> None:
    sock, address = idle_listener
    # SGLang over HTTP needs --http-endpoint: the engine package's build() refuses it.
    result = _run([_script("sidecar-sglang"), "--grpc-endpoint", address], SIDECAR_TRANSPORT="http")
    assert result.returncode == 2
    assert "--http-endpoint" in result.stdout + result.stderr
    assert _nobody_connected(sock)


def test_python_dash_m_works() -> None:
    result = _run([sys.executable, "-m", "sidecar_vllm", "--help"])
    assert result.returncode == 0
    assert "--grpc-endpoint" in result.stdout


def test_sidecar_vllm_startup_failure_exits_1_with_one_clear_line() -> None:
    port = _free_port()  # nothing listens there
    result = _run(
        [_script("sidecar-vllm"), "--grpc-endpoint", f"127.0.0.1:{port}", "--listen", "127.0.0.1:0"],
        SIDECAR_GRPC_STARTUP_DEADLINE_SECS="1",
        SIDECAR_LOG_FORMAT="json",
    )
    assert result.returncode == 1
    errors = [e for e in _json_lines(result.stdout) if e.get("level") in ("error", "critical")]
    assert len(errors) == 1, result.stdout
    assert errors[0]["event"] == "start-up failed"
    assert f"127.0.0.1:{port}" in str(errors[0]["error"])
    assert "Traceback" not in result.stdout + result.stderr


@pytest.fixture
def testkit_vllm() -> Iterator[str]:
    """A testkit vLLM engine on a free loopback port; yields its address."""
    proc = subprocess.Popen(
        [_script("testkit-engine"), "vllm", "--listen", "127.0.0.1:0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=_env(),
    )
    try:
        assert proc.stderr is not None
        address = ""
        deadline = time.monotonic() + WAIT
        while not address and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            if "ready on " in line:
                address = line.rsplit("ready on ", 1)[1].strip()
        assert address, "the testkit engine did not come up"
        yield address
    finally:
        stop(proc)


def test_sidecar_vllm_serves_a_testkit_engine_then_stops_cleanly(
    testkit_vllm: str, notify_socket: tuple[socket.socket, str]
) -> None:
    sock, path = notify_socket
    proc = subprocess.Popen(
        [_script("sidecar-vllm"), "--listen", "127.0.0.1:0", "--grpc-connections", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=_env(
            NOTIFY_SOCKET=path,
            SIDECAR_GRPC_ENDPOINT=testkit_vllm,
            SIDECAR_LOG_FORMAT="json",
            SIDECAR_GRPC_STARTUP_DEADLINE_SECS="20",
        ),
    )
    daemon = _Daemon.attach(proc)
    try:
        port = int(str(daemon.wait_for("serving")["port"]))
        message = sock.recv(4096).decode()
        while "READY=1" not in message:
            message = sock.recv(4096).decode()
        assert _health(port) == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            info = sidecar_pb2_grpc.WorkerStub(channel).GetModelInfo(
                sidecar_pb2.GetModelInfoRequest(), timeout=WAIT
            )
            assert info.engine == "vllm"
            chunks = list(_generate(channel, "through-the-script"))
        assert chunks[-1].finish_reason != sidecar_pb2.UNSPECIFIED
        proc.send_signal(signal.SIGTERM)
        assert "STOPPING=1" in sock.recv(4096).decode()
        assert daemon.finish() == 0
    finally:
        daemon.finish()


# --- waiting for an engine that does not answer ---------------------------------------------------


def _sidecar_vllm(endpoint: str) -> _Daemon:
    proc = subprocess.Popen(
        [_script("sidecar-vllm"), "--grpc-endpoint", endpoint, "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=_env(SIDECAR_LOG_FORMAT="json"),
    )
    return _Daemon.attach(proc)


def _three_wait_reports(daemon: _Daemon) -> list[dict[str, object]]:
    daemon.wait_for("connecting to engine")
    return [daemon.wait_for("waiting for engine") for _ in range(3)]


def test_an_engine_port_nobody_listens_on_is_reported_where_and_why_at_a_growing_interval() -> None:
    address = f"127.0.0.1:{_free_port()}"
    daemon = _sidecar_vllm(address)
    try:
        reports = _three_wait_reports(daemon)
        for report in reports:
            assert report["level"] == "warning"
            assert address in str(report["dialling"])
        # Why it fails: the refusal (a first attempt slower than 2 s on a starved machine may
        # be reported as hanging first, so not necessarily in every line).
        assert any("refused" in str(report["error"]) for report in reports), reports
        assert reports[0]["attempts"] == 1  # the first report comes during or right after it
        assert [r["next_report_secs"] for r in reports] == [2.0, 4.0, 8.0]
        daemon.proc.send_signal(signal.SIGTERM)
        assert daemon.finish() == 0
    finally:
        daemon.finish()


def test_an_engine_that_accepts_and_never_answers_is_reported_while_the_attempt_hangs(
    idle_listener: tuple[socket.socket, str],
) -> None:
    _, address = idle_listener
    daemon = _sidecar_vllm(address)  # the attempt timeout is 30 s: the reports come within it
    try:
        reports = _three_wait_reports(daemon)
        for report in reports:
            assert address in str(report["dialling"])
            assert "no answer yet" in str(report["error"])
            assert report["attempts"] == 1
        assert [r["next_report_secs"] for r in reports] == [2.0, 4.0, 8.0]
        daemon.proc.send_signal(signal.SIGTERM)
        assert daemon.finish() == 0
    finally:
        daemon.finish()


# --- configuration mistakes: one clear line, never a traceback, in every daemon ----------------


def _self_signed(common_name: str) -> tuple[bytes, bytes]:
    """A self-signed certificate and its key (PEM)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


@pytest.fixture(scope="module")
def mistakes_context(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """What the table's rows refer to: a taken port, TLS files, a testkit SGLang engine."""
    where = tmp_path_factory.mktemp("mistakes")
    cert, key = _self_signed("sidecar")
    _, other_key = _self_signed("someone else")
    for name, data in (("cert.pem", cert), ("key.pem", key), ("other.key", other_key)):
        (where / name).write_bytes(data)
    engine = subprocess.Popen(
        [_script("testkit-engine"), "sglang", "--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=_env(),
    )
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        assert engine.stderr is not None
        grpc_address = ""
        for line in engine.stderr:
            if " ready grpc=" in line:
                grpc_address = line.split("grpc=", 1)[1].split()[0]
                break
        assert grpc_address, f"the testkit engine did not come up (exit {engine.poll()})"
        yield {
            "taken": f"127.0.0.1:{taken.getsockname()[1]}",
            "taken_port": str(taken.getsockname()[1]),
            "free": f"127.0.0.1:{_free_port()}",
            "cert": str(where / "cert.pem"),
            "key": str(where / "key.pem"),
            "other_key": str(where / "other.key"),
            "sglang_grpc": grpc_address,
        }
    finally:
        taken.close()
        stop(engine)


LOCAL = ("--listen", "127.0.0.1:0")
VLLM = ["sidecar-vllm", "--grpc-endpoint", "{free}"]  # an engine address nobody dials: refused first
FRONTEND = ["sidecar-frontend", "--worker", "{free}"]
# (argv, environment, exit code, what the one line says); {names} come from mistakes_context.
MISTAKES: list[tuple[list[str], dict[str, str], int, str]] = [
    # Flag values, before any I/O: exit 2, one line on stderr.
    ([*VLLM, "--grpc-connections", "0"], {}, 2, "--grpc-connections"),
    (["sidecar-vllm", "--grpc-endpoint", "https://{free}"], {}, 2, "TLS"),
    (["sidecar-vllm", "--grpc-endpoint", "no-port-here"], {}, 2, "--grpc-endpoint"),
    (["sidecar-vllm"], {}, 2, "--grpc-endpoint (or SIDECAR_GRPC_ENDPOINT) is required"),
    (["sidecar-vllm"], {"SIDECAR_GRPC_ENDPOINT": "{free}", "SIDECAR_LOG_LEVEL": "loud"}, 2,
     "SIDECAR_LOG_LEVEL"),
    (VLLM, {"SIDECAR_NO_REFLECTION": "maybe"}, 2, "SIDECAR_NO_REFLECTION"),
    ([*VLLM, "--listen", "nowhere"], {}, 2, "--listen"),
    # TLS files: missing, of the wrong kind, not a pair, half a setting.
    ([*VLLM, "--tls-cert", "/nonexistent.pem"], {}, 2, "no such file"),
    ([*VLLM, "--tls-cert", "{key}", "--tls-key", "{key}"], {}, 2,
     "holds no PEM certificate"),
    ([*VLLM, "--tls-cert", "{cert}", "--tls-key", "{other_key}"], {}, 2,
     "does not go with --tls-cert"),
    (VLLM, {"SIDECAR_TLS_CLIENT_CA": "{cert}"}, 2,
     "--tls-client-ca comes from SIDECAR_TLS_CLIENT_CA"),
    # Flags that do not apply to the chosen mode, named with the variable that set them.
    ([*VLLM, "--metrics-host", "127.0.0.1"], {}, 2,
     "--metrics-host needs --metrics-port"),
    (VLLM, {"SIDECAR_ADVERTISE": "h:1"}, 2,
     "--advertise comes from SIDECAR_ADVERTISE"),
    (["sidecar", "sglang", "--grpc-endpoint", "{free}"], {"SIDECAR_HTTP_ENDPOINT": "{free}"}, 2,
     "--http-endpoint comes from SIDECAR_HTTP_ENDPOINT"),
    (["sidecar-sglang", "--transport", "http", "--http-endpoint", "{free}", "--grpc-endpoint", "{free}"],
     {}, 2,
     "--grpc-endpoint is used only with --transport grpc"),
    (["sidecar-sglang", "--grpc-endpoint", "{free}"], {"SIDECAR_TRANSPORT": "http"}, 2,
     "--transport comes from SIDECAR_TRANSPORT"),
    (["sidecar-sglang", "--transport", "http"], {}, 2, "--transport http needs --http-endpoint"),
    # Found at start-up: one log line. A taken or foreign address may free up (exit 1); an
    # engine that speaks another protocol is a wrong flag (exit 2).
    ([*VLLM, "--listen", "{taken}"], {}, 1,
     "cannot listen on {taken}: the address is in use by another process (--listen)"),
    (VLLM, {"SIDECAR_LISTEN": "{taken}"}, 1,
     "cannot listen on {taken}: the address is in use by another process "
     "(--listen comes from SIDECAR_LISTEN)"),
    ([*VLLM, *LOCAL, "--metrics-port", "{taken_port}"], {}, 1,
     "cannot serve metrics on 127.0.0.1:{taken_port}: the address is in use by another process "
     "(--metrics-port)"),
    ([*VLLM, "--listen", "host.invalid:0"], {}, 1, "does not resolve"),
    (["sidecar", "sglang", "--transport", "http", "--http-endpoint", "{sglang_grpc}", *LOCAL], {}, 2,
     "does not speak HTTP/1.1"),
    (["sidecar", "vllm", "--grpc-endpoint", "{sglang_grpc}", *LOCAL], {}, 2,
     "(HealthCheck): Method not found! (UNIMPLEMENTED)"),
    # The umbrella command.
    (["sidecar"], {}, 2, "an engine name is required"),
    (["sidecar", "nosuch"], {}, 2, "unknown engine 'nosuch'"),
    (["sidecar", "frontend", "--worker", "nonsense"], {}, 2, "--worker"),
    # The frontend.
    (["sidecar-frontend", "--admin-token", " "], {}, 2, "--admin-token: expected a token without spaces"),
    (["sidecar-frontend", "--worker", "{free}"], {"SIDECAR_FRONTEND_DNS_REFRESH_SECS": "9"}, 2,
     "--dns-refresh-secs comes from SIDECAR_FRONTEND_DNS_REFRESH_SECS"),
    # A listen address that cannot be bound: one line naming the address, the cause and the
    # flag (with its variable when the value came from one); exit 1, as in the sidecars.
    ([*FRONTEND, "--listen", "{taken}"], {}, 1,
     "cannot listen on {taken}: the address is in use by another process (--listen)"),
    (FRONTEND, {"SIDECAR_FRONTEND_LISTEN": "{taken}"}, 1,
     "cannot listen on {taken}: the address is in use by another process "
     "(--listen comes from SIDECAR_FRONTEND_LISTEN)"),
    ([*FRONTEND, *LOCAL, "--metrics-port", "{taken_port}"], {}, 1,
     "cannot serve metrics on 127.0.0.1:{taken_port}: the address is in use by another process "
     "(--metrics-port)"),
    ([*FRONTEND, *LOCAL, "--metrics-host", "127.0.0.1"], {"SIDECAR_FRONTEND_METRICS_PORT": "{taken_port}"}, 1,
     "cannot serve metrics on 127.0.0.1:{taken_port}: the address is in use by another process "
     "(--metrics-host, --metrics-port comes from SIDECAR_FRONTEND_METRICS_PORT)"),
    ([*FRONTEND, *LOCAL, "--metrics-port", "0", "--metrics-host", "192.0.2.1"], {}, 1,
     "cannot serve metrics on 192.0.2.1:0: not an address of this host (--metrics-host, --metrics-port)"),
    ([*FRONTEND, "--listen", "host.invalid:0"], {}, 1,
     "cannot listen on host.invalid:0: the host does not resolve"),
    # The testkit engines.
    (["testkit-engine"], {}, 2, "an engine is required"),
    (["testkit-engine", "vllm", "--listen", "nowhere"], {}, 2, "--listen"),
    (["testkit-engine", "vllm", "--listen", "127.0.0.1:0", "--chunk-tokens", "0"], {}, 2, "chunk_tokens"),
    (["testkit-engine", "vllm", "--listen", "{taken}"], {}, 1, "{taken}: the address is in use"),
    (["testkit-engine", "sglang", "--grpc-listen", "{taken}", "--http-listen", "127.0.0.1:0"], {}, 1,
     "{taken}: the address is in use"),
    (["testkit-engine", "sglang", "--grpc-listen", "127.0.0.1:0", "--http-listen", "{taken}"], {}, 1,
     "{taken}: the address is in use"),
]  # fmt: skip


def _complaints(result: subprocess.CompletedProcess[str]) -> list[str]:
    """What a run said at error level: its stderr lines and its error-level log lines."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    for line in result.stdout.splitlines():
        if not line.startswith("{"):
            lines.append(line)  # nothing but JSON log lines belongs on stdout
        elif json.loads(line).get("level") in ("error", "critical"):
            lines.append(line)
    return lines


@pytest.mark.parametrize(
    ("argv", "env", "code", "says"), MISTAKES, ids=[" ".join(row[0]) + f" {row[1]}" for row in MISTAKES]
)
def test_a_configuration_mistake_is_one_clear_line_and_no_traceback(
    mistakes_context: dict[str, str], argv: list[str], env: dict[str, str], code: int, says: str
) -> None:
    def fill(text: str) -> str:
        return text.format(**mistakes_context)

    command = [_script(argv[0]), *map(fill, argv[1:])]
    environment = {"SIDECAR_LOG_FORMAT": "json", "SIDECAR_FRONTEND_LOG_FORMAT": "json"}
    environment.update({name: fill(value) for name, value in env.items()})
    result = _run(command, **environment)
    assert "Traceback" not in result.stdout + result.stderr
    complaints = _complaints(result)
    assert len(complaints) == 1, complaints
    assert fill(says) in complaints[0]
    assert result.returncode == code, complaints


# --- --help: every flag's meaning and default, in one style -------------------------------------

_OPTION_LINE = re.compile(r"^  (-\S.*?)(?: {2,}(\S.*))?$")
_DEFAULT_LAST = re.compile(
    r"^(?P<meaning>.*\S) \(default: (?P<default>.+)\)(?: \[env (?P<env>[A-Z0-9_]+)\])?$"
)
_ENV_PREFIXES = {"sidecar-frontend": "SIDECAR_FRONTEND_", "sidecar frontend": "SIDECAR_FRONTEND_"}


def _console_scripts() -> list[str]:
    """The console scripts of both distributions: llm-sidecars and the testkit's own."""
    scripts: list[str] = []
    for pyproject in (ROOT / "pyproject.toml", ROOT / "testkit" / "pyproject.toml"):
        with open(pyproject, "rb") as f:
            scripts += tomllib.load(f)["project"]["scripts"]
    return sorted(scripts)


def _help(command: list[str]) -> str:
    result = _run([_script(command[0]), *command[1:], "--help"], COLUMNS="2000")
    assert result.returncode == 0, result.stderr
    return result.stdout


def _help_pages() -> list[tuple[str, str]]:
    """(command, --help text) for every console script of both pyproject files, and for each of its
    subcommands (the {a,b} choice of its usage line)."""
    pages = []
    for script in _console_scripts():
        text = _help([script])
        usage = text.split("\n\n", 1)[0]
        choices = re.search(r"\{([a-z][a-z,]*)\}", usage.split("[", 1)[0] + usage.split("]")[-1])
        if choices is None:
            pages.append((script, text))
            continue
        for sub in choices.group(1).split(","):
            pages.append((f"{script} {sub}", _help([script, sub])))
    return pages


def _flags(text: str) -> dict[str, str]:
    """Each option of a --help page -> its help text (continuation lines joined)."""
    entries: dict[str, str] = {}
    current: str | None = None
    for line in text.splitlines():
        match = _OPTION_LINE.match(line)
        if match:
            current = re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", match.group(1))[0]
            entries[current] = match.group(2) or ""
        elif current is not None and line.startswith("   ") and line.strip():
            entries[current] = f"{entries[current]} {line.strip()}".strip()
        else:
            current = None
    return entries


def test_every_console_script_shows_each_flags_meaning_and_default_in_one_style() -> None:
    pages = _help_pages()
    commands = [command for command, _ in pages]
    # The walk reached every daemon, through the umbrella and testkit's subcommands too.
    for expected in ("sidecar vllm", "sidecar sglang", "sidecar frontend", "sidecar-vllm", "sidecar-sglang",
                     "sidecar-frontend", "testkit-engine vllm", "testkit-engine sglang"):  # fmt: skip
        assert expected in commands, commands
    for command, text in pages:
        flags = _flags(text)
        assert len(flags) > 5, (command, text)
        prefix = _ENV_PREFIXES.get(command, "" if command.startswith("testkit") else "SIDECAR_")
        for flag, help_text in flags.items():
            if flag in ("--help", "--version"):
                continue
            where = f"{command} {flag}: {help_text!r}"
            shape = _DEFAULT_LAST.match(help_text)
            assert shape is not None, f"{where}: not 'meaning (default: ...) [env VAR]'"
            assert "(default: " not in shape["meaning"], f"{where}: two defaults"
            assert len(shape["meaning"]) > 3, f"{where}: no meaning"
            if prefix:
                assert shape["env"] == prefix + flag[2:].replace("-", "_").upper(), where
            else:
                assert shape["env"] is None, where


def test_an_engine_that_goes_away_while_serving_is_reported_again_at_a_growing_interval() -> None:
    port = _free_port()
    engine = subprocess.Popen(
        [_script("testkit-engine"), "vllm", "--listen", f"127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
        env=_env(),
    )
    daemon = _sidecar_vllm(f"127.0.0.1:{port}")
    try:
        daemon.wait_for("serving")
        engine.send_signal(signal.SIGKILL)
        engine.wait(timeout=WAIT)
        daemon.wait_for("engine unhealthy: refusing new requests")
        reports = [daemon.wait_for("engine still unhealthy: refusing new requests") for _ in range(2)]
        # The channels redial the engine all along: the reports say where and why it fails.
        assert any(f"127.0.0.1:{port}" in str(line["reason"]) for line in reports), reports
        assert [r["next_report_secs"] for r in reports] == [4.0, 8.0]
        daemon.proc.send_signal(signal.SIGTERM)
        assert daemon.finish() == 0
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait(timeout=WAIT)
        daemon.finish()
