"""The KV-event flags as an operator types them: the engine's own addresses (a wildcard host
means the engine beside this sidecar), ipc:// paths as given, refusals in one line naming the
problem, and where each data-parallel rank publishes."""

from __future__ import annotations

import pytest

from sidecar_server.kv_config import rank_endpoint
from tests.unit.test_cli import ENDPOINT, parse, usage_error


@pytest.mark.parametrize(
    ("given", "dialled"),
    [
        ("tcp://*:5557", "tcp://127.0.0.1:5557"),  # both engines' default
        ("tcp://0.0.0.0:5557", "tcp://127.0.0.1:5557"),
        ("tcp://[::]:5557", "tcp://[::1]:5557"),
        ("tcp://[0:0:0:0:0:0:0:0]:5557", "tcp://[::1]:5557"),
        ("tcp://engine-0.engines:5557", "tcp://engine-0.engines:5557"),
        ("tcp://10.0.0.2:65535", "tcp://10.0.0.2:65535"),
        ("tcp://[fd00::2]:5557", "tcp://[fd00::2]:5557"),
        (" tcp://127.0.0.1:5557\n", "tcp://127.0.0.1:5557"),  # from an environment file
        ("ipc:///tmp/kv-events", "ipc:///tmp/kv-events"),
    ],
)
def test_the_engines_address_and_what_the_sidecar_dials(given: str, dialled: str) -> None:
    config, _ = parse([*ENDPOINT, "--kv-events-endpoint", given, "--kv-events-replay-endpoint", given])
    assert config.kv_events is not None
    assert (config.kv_events.endpoint, config.kv_events.replay_endpoint) == (dialled, dialled)


@pytest.mark.parametrize(
    ("given", "words"),
    [
        ("tcp://127.0.0.1:0", "port 0 cannot be dialled"),
        ("tcp://*:0", "port 0 cannot be dialled"),
        ("tcp://127.0.0.1:65536", "port 65536 is out of range (1..65535)"),
        ("tcp://127.0.0.1", "the port is missing"),
        ("tcp://*", "the port is missing"),
        ("tcp://:5557", "the host is missing"),
        ("tcp://::1:5557", "an IPv6 address must be in brackets"),
        ("tcp://a b:5557", "'a b' is not a valid host name or IPv4 address"),
        ("tcp://h:port", "port 'port' is not a number"),
        ("udp://h:5557", "expected tcp://HOST:PORT or ipc://PATH"),
        ("h:5557", "expected tcp://HOST:PORT or ipc://PATH"),
    ],
)
def test_a_bad_address_is_one_line_naming_the_problem(
    capsys: pytest.CaptureFixture[str], given: str, words: str
) -> None:
    err = usage_error(capsys, [*ENDPOINT, f"--kv-events-endpoint={given}"])
    assert "--kv-events-endpoint" in err
    assert words in err


@pytest.mark.parametrize(
    ("base", "rank", "published"),
    [
        ("tcp://127.0.0.1:5557", 0, "tcp://127.0.0.1:5557"),
        ("tcp://127.0.0.1:5557", 3, "tcp://127.0.0.1:5560"),
        ("tcp://[::1]:5557", 1, "tcp://[::1]:5558"),
        ("ipc:///tmp/kv", 0, "ipc:///tmp/kv"),
    ],
)
def test_each_rank_publishes_on_the_base_port_plus_its_rank(base: str, rank: int, published: str) -> None:
    assert rank_endpoint(base, rank) == published


def test_an_ipc_address_has_no_rank_above_zero() -> None:
    with pytest.raises(ValueError, match="only tcp:// ports are offset"):
        rank_endpoint("ipc:///tmp/kv", 1)
