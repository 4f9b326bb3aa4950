"""The frontend's discovery flags (added to any argparse parser) and the config they build;
contradictions are refused with a message naming the flag."""

from __future__ import annotations

import argparse

import pytest

from sidecar_common.registration_record import DEFAULT_PREFIX
from sidecar_frontend.discovery import DiscoveryConfig, add_discovery_arguments, discovery_config_from_args
from sidecar_frontend.discovery_records import DnsTarget


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="frontend", exit_on_error=False)
    add_discovery_arguments(p)
    return p


def config(argv: list[str], workers: tuple[str | tuple[str, str], ...] = ()) -> DiscoveryConfig:
    return discovery_config_from_args(parser().parse_args(argv), workers)


def test_static_is_the_default_and_takes_the_worker_list() -> None:
    got = config([], ("10.0.0.1:50061", ("10.0.0.2:50061", "prefill"), "10.0.0.1:50061"))
    assert got.mode == "static"
    assert got.static_workers == (("10.0.0.1:50061", "agg"), ("10.0.0.2:50061", "prefill"))


def test_static_may_start_with_no_worker() -> None:
    # Workers then come through the membership API (sidecar_frontend/admin.py).
    assert config([]).static_workers == ()


def test_dns() -> None:
    got = config(
        [
            "--discovery",
            "dns",
            "--dns-name",
            "w.ns.svc:50061",
            "--dns-name",
            "prefill=p.ns.svc:6000",
            "--dns-refresh-secs",
            "2",
        ]
    )
    assert got.mode == "dns"
    assert got.dns_targets == (DnsTarget("w.ns.svc", 50061), DnsTarget("p.ns.svc", 6000, "prefill"))
    assert got.dns_refresh == 2.0


def test_etcd() -> None:
    got = config(["--discovery", "etcd", "--etcd-endpoints", "http://e0:2379,e1:2379", "--etcd-prefix", "/f"])
    assert (got.mode, got.etcd_endpoints, got.etcd_prefix) == ("etcd", ("e0:2379", "e1:2379"), "/f/")
    assert config(["--discovery", "etcd", "--etcd-endpoints", "e:1"]).etcd_prefix == DEFAULT_PREFIX


@pytest.mark.parametrize(
    ("argv", "workers", "mentions"),
    [
        (["--discovery", "dns"], (), "--dns-name"),
        (["--discovery", "etcd"], (), "--etcd-endpoints"),
        (["--discovery", "etcd", "--etcd-endpoints", "e:1"], ("10.0.0.1:1",), "--worker"),
        (["--dns-name", "w:1"], ("10.0.0.1:1",), "--dns-name"),
        ([], (("10.0.0.1:1", "leader"),), "role"),
    ],
)
def test_contradictions_are_refused(
    argv: list[str], workers: tuple[str | tuple[str, str], ...], mentions: str
) -> None:
    with pytest.raises(ValueError, match=mentions):
        config(argv, workers)


@pytest.mark.parametrize(
    "argv",
    [
        ["--discovery", "consul"],
        ["--dns-name", "no-port"],
        ["--dns-name", "leader=w:1"],
        ["--dns-refresh-secs", "0"],
        ["--dns-refresh-secs", "inf"],
        ["--etcd-endpoints", "https://e:2379"],
        ["--etcd-prefix", " "],
    ],
)
def test_bad_values_are_argparse_errors(argv: list[str]) -> None:
    with pytest.raises((argparse.ArgumentError, SystemExit)):
        parser().parse_args(argv)
