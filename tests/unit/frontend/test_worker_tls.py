"""The frontend's worker TLS settings: the flags' rules (usage errors naming the flag), the
SIDECAR_FRONTEND_* mirrors, and the credentials re-read when the files change."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sidecar_common.tls import ClientCredentials, ClientTlsFiles, TlsSettingsError
from sidecar_frontend.cli import parse_config
from tests.pki import make_ca, make_leaf


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("worker-tls")
    ca = make_ca("fleet CA")
    client, other = make_leaf("frontend", ca, server=False), make_leaf("other", ca, server=False)
    for name, data in {
        "ca.pem": ca[0].cert,
        "tls.crt": client.cert,
        "tls.key": client.key,
        "other.crt": other.cert,
        "other.key": other.key,
    }.items():
        (where / name).write_bytes(data)
    return where


def _usage_error(argv: list[str], env: dict[str, str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        parse_config(["--worker", "a:1", *argv], env)
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_plaintext_unless_a_ca_is_given(files: Path) -> None:
    assert parse_config(["--worker", "a:1"], {}).worker_set.tls is None
    ca_only = parse_config(["--worker", "a:1", "--worker-tls-ca", str(files / "ca.pem")], {})
    assert ca_only.worker_set.tls == ClientTlsFiles(ca=files / "ca.pem")


def test_the_variables_set_mutual_tls_and_a_flag_wins(files: Path) -> None:
    env = {
        "SIDECAR_FRONTEND_WORKER_TLS_CA": str(files / "ca.pem"),
        "SIDECAR_FRONTEND_WORKER_TLS_CERT": str(files / "tls.crt"),
        "SIDECAR_FRONTEND_WORKER_TLS_KEY": str(files / "tls.key"),
    }
    assert parse_config(["--worker", "a:1"], env).worker_set.tls == ClientTlsFiles(
        files / "ca.pem", files / "tls.crt", files / "tls.key"
    )
    flags = ["--worker-tls-cert", str(files / "other.crt"), "--worker-tls-key", str(files / "other.key")]
    tls = parse_config(["--worker", "a:1", *flags], env).worker_set.tls
    assert tls is not None
    assert (tls.cert, tls.key) == (files / "other.crt", files / "other.key")


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--worker-tls-cert", "{d}/tls.crt"], "--worker-tls-key is missing"),
        (["--worker-tls-key", "{d}/tls.key"], "--worker-tls-cert is missing"),
        (["--worker-tls-cert", "{d}/tls.crt", "--worker-tls-key", "{d}/tls.key"], "needs --worker-tls-ca"),
        (["--worker-tls-ca", "{d}/nowhere.pem"], "cannot read {d}/nowhere.pem"),
        (["--worker-tls-ca", "{d}/tls.key"], "{d}/tls.key holds no PEM certificate"),
        (
            [
                "--worker-tls-ca",
                "{d}/ca.pem",
                "--worker-tls-cert",
                "{d}/tls.crt",
                "--worker-tls-key",
                "{d}/other.key",
            ],
            "{d}/tls.crt and {d}/other.key are not a certificate and its key",
        ),
    ],
)
def test_settings_that_cannot_work_are_usage_errors(
    files: Path, argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _usage_error([a.format(d=files) for a in argv], {}, capsys)
    assert says.format(d=files) in err


def test_credentials_follow_the_files_and_keep_the_last_good_ones(tmp_path: Path, files: Path) -> None:
    for name in ("ca.pem", "tls.crt", "tls.key"):
        (tmp_path / name).write_bytes((files / name).read_bytes())
    credentials = ClientCredentials(
        ClientTlsFiles(tmp_path / "ca.pem", tmp_path / "tls.crt", tmp_path / "tls.key")
    )
    assert _state(credentials) == (1, None)
    first = credentials.current()
    assert credentials.refresh() is False  # unchanged: nothing read
    assert credentials.current() is first

    # Half a rotation: the new certificate is there, its key not yet.
    os.replace(_copy(files / "other.crt", tmp_path), tmp_path / "tls.crt")
    assert credentials.refresh() is False
    assert credentials.problem is not None
    assert "are not a certificate and its key" in credentials.problem
    assert credentials.current() is first  # the last good ones, for new connections meanwhile

    os.replace(_copy(files / "other.key", tmp_path), tmp_path / "tls.key")
    assert credentials.refresh() is True
    assert _state(credentials) == (2, None)
    assert credentials.current() is not first

    # A file missing for a moment (a symlink being swapped): kept, no problem reported.
    (tmp_path / "ca.pem").unlink()
    assert credentials.refresh() is False
    assert credentials.version == 2


def test_the_first_load_raises_naming_the_file(tmp_path: Path) -> None:
    with pytest.raises(TlsSettingsError, match="cannot read"):
        ClientCredentials(ClientTlsFiles(tmp_path / "none.pem"))


def _copy(source: Path, where: Path) -> Path:
    target = where / (source.name + ".incoming")
    target.write_bytes(source.read_bytes())
    return target


def _state(credentials: ClientCredentials) -> tuple[int, str | None]:
    return credentials.version, credentials.problem
