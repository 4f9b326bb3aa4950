"""--load-push-interval-ms: WatchLoad's push interval, from the flag or its variable, into the
server's config; a value the heartbeat could not keep is a usage error."""

from __future__ import annotations

import pytest

from sidecar_server.daemon import _server_config
from tests.unit.test_cli import ENDPOINT, parse, usage_error


def test_the_default_is_100_ms_and_reaches_the_server() -> None:
    config, _ = parse(ENDPOINT)
    assert config.load_push_interval == pytest.approx(0.1)
    assert _server_config(config).load_push_interval == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("argv", "environ", "seconds"),
    [
        (["--load-push-interval-ms", "25"], {}, 0.025),
        ([], {"SIDECAR_LOAD_PUSH_INTERVAL_MS": "250"}, 0.25),
        (["--load-push-interval-ms", "1"], {"SIDECAR_LOAD_PUSH_INTERVAL_MS": "250"}, 0.001),
        (["--load-push-interval-ms", "1000"], {}, 1.0),
    ],
)
def test_the_flag_and_its_variable(argv: list[str], environ: dict[str, str], seconds: float) -> None:
    config, _ = parse([*ENDPOINT, *argv], environ)
    assert config.load_push_interval == pytest.approx(seconds)
    assert _server_config(config).load_push_interval == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("0", "must be >= 1"),
        ("-5", "must be >= 1"),
        ("0.5", "expected a whole number"),
        ("1001", "must be at most 1000 (WatchLoad's heartbeat is a second)"),
    ],
)
def test_a_value_out_of_range_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], value: str, says: str
) -> None:
    err = usage_error(capsys, [*ENDPOINT, "--load-push-interval-ms", value])
    assert "--load-push-interval-ms" in err
    assert says in err
