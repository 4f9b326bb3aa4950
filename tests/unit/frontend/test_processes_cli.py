"""``--processes``, ``--listen-backlog``, ``--keepalive-timeout-secs``, ``--min-open-files``:
flags, variables, defaults, usage errors; and what the parent hands each process."""

from __future__ import annotations

import io

import pytest

from sidecar_frontend.cli import parse_config
from sidecar_frontend.config import DEFAULT_KEEPALIVE_TIMEOUT, DEFAULT_LISTEN_BACKLOG
from sidecar_frontend.processes.spec import ChildSpec, parse_status, read_spec, serving_line, spec_bytes

WORKER = ["--worker", "127.0.0.1:50061"]


def test_defaults_one_process_and_the_connection_settings() -> None:
    config = parse_config(WORKER, {})
    assert config.processes == 1
    assert config.admission.capacity.processes == 1
    assert config.connections.backlog == DEFAULT_LISTEN_BACKLOG == 4096
    assert config.connections.keepalive_timeout == DEFAULT_KEEPALIVE_TIMEOUT
    assert config.connections.min_open_files is None


def test_flags_and_their_variables() -> None:
    env = {
        "SIDECAR_FRONTEND_PROCESSES": "3",
        "SIDECAR_FRONTEND_LISTEN_BACKLOG": "1024",
        "SIDECAR_FRONTEND_KEEPALIVE_TIMEOUT_SECS": "30",
        "SIDECAR_FRONTEND_MIN_OPEN_FILES": "20000",
    }
    config = parse_config(WORKER, env)
    assert config.processes == 3
    # Each process admits against its share of every worker.
    assert config.admission.capacity.processes == 3
    assert config.connections.backlog == 1024
    assert config.connections.keepalive_timeout == 30.0
    assert config.connections.min_open_files == 20000
    assert parse_config([*WORKER, "--processes", "2"], env).processes == 2


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        (["--processes", "0"], {}, "--processes"),
        (["--listen-backlog", "-1"], {}, "--listen-backlog"),
        (["--keepalive-timeout-secs", "0"], {}, "--keepalive-timeout-secs"),
        ([], {"SIDECAR_FRONTEND_PROCESSES": "two"}, "SIDECAR_FRONTEND_PROCESSES"),
    ],
)
def test_usage_errors_name_the_flag(
    argv: list[str], env: dict[str, str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit:
        parse_config([*WORKER, *argv], env)
    assert exit.value.code == 2
    assert named in capsys.readouterr().err


def test_a_process_reads_the_spec_its_parent_wrote() -> None:
    config = parse_config([*WORKER, "--processes", "2"], {})
    spec = ChildSpec(config, 1, (5, 6), 7)
    assert read_spec(io.BytesIO(spec_bytes(spec))) == spec


@pytest.mark.parametrize("data", [b"", b"\x00\x00\x00\x00\x00\x00\x01\x00short"])
def test_a_missing_or_short_spec_is_refused(data: bytes) -> None:
    with pytest.raises(ValueError, match="spec"):
        read_spec(io.BytesIO(data))


def test_the_serving_status_line_names_the_metrics_port() -> None:
    assert parse_status(serving_line(40123)) == 40123
    assert parse_status(b'{"event": "other"}\n') is None
    assert parse_status(b"not json\n") is None
    assert parse_status(b'{"event": "serving", "metrics_port": 0}\n') is None
