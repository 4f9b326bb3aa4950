"""TLS on the frontend-facing port: the flags' rules, and the files read into credentials.

``--tls-cert`` and ``--tls-key`` switch the public gRPC port to TLS; ``--tls-client-ca``
adds mutual TLS: a client must present a certificate that this CA signed, or its handshake
is refused. The engine side is not covered (it stays plaintext on loopback or the Pod
network; deploy/README.md, "Security").

The files are checked when the flags are parsed (a usage error naming the flag) and read
again when the server starts, so a certificate renewed in between is the one served.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

import grpc

__all__ = ["TlsFiles", "TlsSettingsError", "check_pem", "server_credentials", "tls_files"]

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


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """Read the files (PEM) into grpc server credentials; raises TlsSettingsError naming the
    file that is not what it should be."""
    cert = check_pem(files.cert, "certificate").encode()
    key = check_pem(files.key, "private key").encode()
    root = check_pem(files.client_ca, "certificate").encode() if files.client_ca is not None else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=root, require_client_auth=root is not None
    )
