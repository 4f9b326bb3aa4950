"""The rate limits file: at startup a missing or bad file is an error naming it; afterwards a
rewrite is applied, and a bad or missing file keeps the limits in force with one warning per
change of the file."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs

from sidecar_frontend.admission.rate_file import RateFileFollower, follow_rate_file, load_rate_file
from sidecar_frontend.admission.rates import (
    Grant,
    RateConfig,
    RateConfigError,
    RateLimiter,
    RateRefusal,
    TenantRate,
    parse_rate_config,
)

FIRST = "[default]\nrequests_per_minute = 600\n"
SECOND = '[default]\nrequests_per_minute = 60\n[tenants."a"]\ntokens_per_minute = 100\n[tenants."b"]\n'
BAD = "[default]\nrequests_per_minute = -1\n"


def write(path: Path, text: str) -> None:
    """Rewrite the file, and move its modification time on by a second: two writes within the
    file system's timestamp granularity must still look like a change."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text, encoding="utf-8")
    moved = max(path.stat().st_mtime_ns, before + 1_000_000_000)
    os.utime(path, ns=(moved, moved))


def rate_events(logs: Sequence[Mapping[str, Any]]) -> list[tuple[object, object]]:
    return [(entry["event"], entry["log_level"]) for entry in logs]


def test_load_reads_the_file(tmp_path: Path) -> None:
    path = tmp_path / "limits.toml"
    write(path, SECOND)
    assert load_rate_file(str(path)) == parse_rate_config(SECOND, str(path))


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (None, "no such rate limits file"),
        (BAD.encode(), "[default] requests_per_minute"),
        (b"[default]\nrequests_per_minute = \xff\n", "not UTF-8"),
        (b"[default\n", "not valid TOML"),
    ],
)
def test_load_refuses_a_missing_or_bad_file_naming_it(
    tmp_path: Path, content: bytes | None, fragment: str
) -> None:
    path = tmp_path / "limits.toml"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(RateConfigError) as caught:
        load_rate_file(str(path))
    assert str(caught.value).startswith(f"{path}: ")
    assert fragment in str(caught.value)


def test_load_refuses_a_directory(tmp_path: Path) -> None:
    with pytest.raises(RateConfigError, match="cannot be read"):
        load_rate_file(str(tmp_path))


def follower_of(path: Path, now: list[float]) -> RateFileFollower:
    limiter = RateLimiter(load_rate_file(str(path)))
    return RateFileFollower(str(path), limiter, clock=lambda: now[0])


def test_the_first_look_at_an_unchanged_file_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "limits.toml"
    write(path, FIRST)
    follower = follower_of(path, [0.0])
    config = follower.limiter.config
    with capture_logs() as logs:
        assert not follower.check()
        assert not follower.check()
    assert follower.limiter.config is config
    assert logs == []


def test_a_change_before_the_first_look_is_applied(tmp_path: Path) -> None:
    path = tmp_path / "limits.toml"
    write(path, FIRST)
    follower = follower_of(path, [0.0])
    write(path, SECOND)
    assert follower.check()
    assert follower.limiter.config == parse_rate_config(SECOND, str(path))


def test_a_rewrite_is_applied_and_logged(tmp_path: Path) -> None:
    path = tmp_path / "limits.toml"
    write(path, FIRST)
    follower = follower_of(path, [0.0])
    follower.check()
    write(path, SECOND)
    with capture_logs() as logs:
        assert follower.check()
        assert not follower.check()  # nothing changed since
    assert follower.limiter.config == parse_rate_config(SECOND, str(path))
    assert logs == [
        {"event": "rate limits reloaded", "log_level": "info", "path": str(path), "tenants": 2},
    ]


def test_a_replaced_file_is_applied(tmp_path: Path) -> None:
    # How editors and ConfigMaps change a file: a new one renamed over it (a new inode).
    path = tmp_path / "limits.toml"
    write(path, FIRST)
    follower = follower_of(path, [0.0])
    follower.check()
    replacement = tmp_path / "limits.toml.new"
    write(replacement, SECOND)
    os.replace(replacement, path)
    assert follower.check()
    assert follower.limiter.config == parse_rate_config(SECOND, str(path))


def test_a_bad_rewrite_keeps_the_limits_with_one_warning_per_change(tmp_path: Path) -> None:
    path = tmp_path / "limits.toml"
    write(path, FIRST)
    follower = follower_of(path, [0.0])
    follower.check()
    config = follower.limiter.config
    with capture_logs() as logs:
        write(path, BAD)
        assert not follower.check()
        assert not follower.check()
        assert not follower.check()
        write(path, BAD + "\n")
        assert not follower.check()
    assert follower.limiter.config is config
    assert rate_events(logs) == [("rate limits file not applied; the previous limits stay", "warning")] * 2
    assert "[default] requests_per_minute" in str(logs[0]["error"])
    assert logs[0]["path"] == str(path)
    write(path, SECOND)
    assert follower.check()
    assert follower.limiter.config == parse_rate_config(SECOND, str(path))


def test_a_missing_file_keeps_the_limits_with_one_warning(tmp_path: Path) -> None:
    path = tmp_path / "limits.toml"
    write(path, FIRST)
    follower = follower_of(path, [0.0])
    follower.check()
    config = follower.limiter.config
    path.unlink()
    with capture_logs() as logs:
        assert not follower.check()
        assert not follower.check()
    assert follower.limiter.config is config
    assert rate_events(logs) == [("rate limits file not applied; the previous limits stay", "warning")]
    assert "no such rate limits file" in str(logs[0]["error"])
    write(path, SECOND)
    assert follower.check()
    assert follower.limiter.config == parse_rate_config(SECOND, str(path))


def test_a_reload_keeps_the_buckets_levels_as_of_the_clock(tmp_path: Path) -> None:
    path = tmp_path / "limits.toml"
    write(path, "[default]\ntokens_per_minute = 60\n")
    now = [0.0]
    follower = follower_of(path, now)
    follower.check()
    assert isinstance(follower.limiter.take("t", 60, now=0.0), Grant)
    write(path, "[default]\ntokens_per_minute = 6000\n")
    now[0] = 30.0
    assert follower.check()
    # Refilled at the old rate for the 30 s before the reload, not topped up to the new size.
    assert isinstance(follower.limiter.take("t", 30, now=30.0), Grant)
    assert isinstance(follower.limiter.take("t", 1, now=30.0), RateRefusal)


class WatchedLimiter(RateLimiter):
    """A limiter that says when it was given new limits."""

    def __init__(self, config: RateConfig) -> None:
        super().__init__(config)
        self.reconfigured = anyio.Event()

    def reconfigure(self, config: RateConfig, now: float) -> None:
        super().reconfigure(config, now)
        self.reconfigured.set()


async def test_follow_applies_a_rewrite(tmp_path: Path) -> None:
    path = tmp_path / "limits.toml"
    write(path, FIRST)
    limiter = WatchedLimiter(load_rate_file(str(path)))
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(lambda: follow_rate_file(str(path), limiter, interval=0.01))
        write(path, SECOND)
        with anyio.fail_after(60):
            await limiter.reconfigured.wait()
        tasks.cancel_scope.cancel()
    assert limiter.config == RateConfig(
        default=TenantRate(requests_per_minute=60),
        tenants={"a": TenantRate(60, 100), "b": TenantRate(60, None)},
    )
