"""TLS settings as the flags give them: which files, whether they hold what they should.

Plain data and checks with the standard library's ``ssl`` only, so that a command line can
refuse a bad TLS flag (a usage error naming it) without importing grpc; the credentials and
the connector that use these files live in :mod:`sidecar_common.tls`.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = [
    "ClientTlsFiles",
    "TlsFiles",
    "TlsSettingsError",
    "check_pem",
    "load_client_files",
    "tls_files",
]

# What each kind of PEM file must contain: a file of the wrong kind (a key given as the
# certificate) is refused by name, where grpc would only fail to bind the port.
_CERT_MARKER: Final = "-----BEGIN CERTIFICATE-----"
_KEY_MARKER: Final = "PRIVATE KEY-----"


class TlsSettingsError(ValueError):
    """A TLS flag combination or file that cannot work; the message names the flag."""


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path
    client_ca: Path | None = None  # set: mutual TLS, clients need a certificate it signed

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None


def check_pem(path: Path, kind: str) -> str:
    """Read ``path`` and check it holds a PEM ``kind`` ("certificate" or "private key");
    returns its text. Raises TlsSettingsError saying what is wrong."""
    try:
        text = path.read_text(encoding="ascii", errors="replace")
    except OSError as err:
        raise TlsSettingsError(f"cannot read {path}: {err.strerror or err}") from None
    marker = _CERT_MARKER if kind == "certificate" else _KEY_MARKER
    if marker not in text:
        raise TlsSettingsError(f"{path} holds no PEM {kind}")
    return text


def tls_files(cert: Path | None, key: Path | None, client_ca: Path | None) -> TlsFiles | None:
    """The TLS settings from the three flags, or None for plaintext. Refuses a partial set
    (a key without a certificate, a client CA without either) by flag name."""
    if cert is None and key is None:
        if client_ca is not None:
            raise TlsSettingsError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS)")
        return None
    if cert is None or key is None:
        missing = "--tls-cert" if cert is None else "--tls-key"
        raise TlsSettingsError(f"--tls-cert and --tls-key go together: {missing} is missing")
    return TlsFiles(cert=cert, key=key, client_ca=client_ca)


@dataclass(frozen=True)
class ClientTlsFiles:
    ca: Path  # the CA that signed the servers' certificates
    cert: Path | None = None  # set with key: this client's certificate, for mutual TLS
    key: Path | None = None

    def paths(self) -> tuple[Path, ...]:
        return tuple(p for p in (self.ca, self.cert, self.key) if p is not None)


def load_client_files(files: ClientTlsFiles) -> tuple[bytes, bytes | None, bytes | None]:
    """Read and check the files: PEM of the right kind, a CA that loads, a certificate that
    matches its key. Raises TlsSettingsError naming the file."""
    ca = check_pem(files.ca, "certificate").encode()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cadata=ca.decode())
    except ssl.SSLError as err:
        raise TlsSettingsError(f"{files.ca} holds no usable CA certificate: {err.reason or err}") from None
    if files.cert is None or files.key is None:
        return ca, None, None
    cert = check_pem(files.cert, "certificate").encode()
    key = check_pem(files.key, "private key").encode()
    try:
        context.load_cert_chain(files.cert, files.key)
    except ssl.SSLError as err:
        raise TlsSettingsError(
            f"{files.cert} and {files.key} are not a certificate and its key: {err.reason or err}"
        ) from None
    return ca, cert, key
