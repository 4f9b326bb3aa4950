"""The sidecar's etcd registration flags as a user types them: off by default, each with its
SIDECAR_* mirror, and the wildcard listen address refused unless --advertise is given."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence

import pytest

from sidecar_common.registration_record import DEFAULT_PREFIX, RegistrationConfig
from sidecar_server.cli import parse_config
from sidecar_server.config import EngineSpec, SidecarConfig
from sidecar_server.engine import Engine


def _no_build(config: SidecarConfig, namespace: argparse.Namespace) -> Engine:
    raise AssertionError("parsing must not build the engine")


SPEC = EngineSpec(name="fake", add_arguments=lambda parser: None, build=_no_build)
BASE = ["--grpc-endpoint", "127.0.0.1:50051", "--listen", "10.0.0.7:50061"]


def parse(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> SidecarConfig:
    config, _ = parse_config(SPEC, list(argv), environ or {}, log_format_default="json")
    return config


def usage_error(
    capsys: pytest.CaptureFixture[str], argv: Sequence[str], environ: Mapping[str, str] | None = None
) -> str:
    with pytest.raises(SystemExit) as exc:
        parse(argv, environ)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_registration_is_off_by_default() -> None:
    assert parse(BASE).registration is None


def test_registration_defaults_once_endpoints_are_given() -> None:
    config = parse([*BASE, "--etcd-endpoints", "http://etcd-0:2379,etcd-1:2379"])
    assert config.registration == RegistrationConfig(
        endpoints=("etcd-0:2379", "etcd-1:2379"), prefix=DEFAULT_PREFIX, advertise=None, lease_ttl=10
    )


def test_every_flag_from_its_environment_variable() -> None:
    env = {
        "SIDECAR_ETCD_ENDPOINTS": "127.0.0.1:2379",
        "SIDECAR_ETCD_PREFIX": "/fleet-a/workers",
        "SIDECAR_ADVERTISE": "worker-0.workers.ns.svc:50061",
        "SIDECAR_ETCD_LEASE_TTL_SECS": "4",
    }
    config = parse(["--grpc-endpoint", "127.0.0.1:50051"], env)  # listen 0.0.0.0: advertise needed, given
    assert config.registration == RegistrationConfig(
        endpoints=("127.0.0.1:2379",),
        prefix="/fleet-a/workers/",
        advertise="worker-0.workers.ns.svc:50061",
        lease_ttl=4,
    )


def test_a_flag_beats_its_variable() -> None:
    config = parse([*BASE, "--etcd-endpoints", "a:1"], {"SIDECAR_ETCD_ENDPOINTS": "b:2"})
    assert config.registration is not None
    assert config.registration.endpoints == ("a:1",)


@pytest.mark.parametrize("listen", ["0.0.0.0:50061", "[::]:50061"])
def test_a_wildcard_listen_address_needs_advertise(capsys: pytest.CaptureFixture[str], listen: str) -> None:
    err = usage_error(
        capsys, ["--grpc-endpoint", "127.0.0.1:50051", "--listen", listen, "--etcd-endpoints", "e:2379"]
    )
    assert "--advertise" in err
    assert "every interface" in err


def test_a_wildcard_listen_address_without_etcd_is_fine() -> None:
    assert parse(["--grpc-endpoint", "127.0.0.1:50051", "--listen", "0.0.0.0:50061"]).registration is None


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--etcd-endpoints", "https://etcd:2379"], "--etcd-endpoints"),
        (["--etcd-endpoints", ""], "--etcd-endpoints"),
        (["--etcd-endpoints", "e:2379", "--etcd-prefix", " "], "--etcd-prefix"),
        (["--etcd-endpoints", "e:2379", "--etcd-lease-ttl-secs", "1"], "--etcd-lease-ttl-secs"),
        (["--etcd-endpoints", "e:2379", "--etcd-lease-ttl-secs", "2.5"], "--etcd-lease-ttl-secs"),
        (["--etcd-endpoints", "e:2379", "--advertise", "0.0.0.0:50061"], "--advertise"),
        (["--etcd-endpoints", "e:2379", "--advertise", "host-without-port"], "--advertise"),
    ],
)
def test_bad_values_are_usage_errors_naming_the_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], names: str
) -> None:
    assert names in usage_error(capsys, [*BASE, *argv])


def test_a_bad_variable_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(capsys, BASE, {"SIDECAR_ETCD_LEASE_TTL_SECS": "0"})
    assert "SIDECAR_ETCD_LEASE_TTL_SECS" in err
