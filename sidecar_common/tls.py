"""TLS on the frontend-facing port, and the client side that dials it.

Server side: ``--tls-cert`` and ``--tls-key`` switch the public gRPC port to TLS;
``--tls-client-ca`` adds mutual TLS: a client must present a certificate that this CA signed,
or its handshake is refused. The engine side is not covered (it stays plaintext on loopback or
the Pod network; deploy/README.md, "Security"). The files are checked when the flags are
parsed (a usage error naming the flag) and read again when the server starts, so a
certificate renewed in between is the one served.

Client side (the frontend dialling its workers): :class:`ClientCredentials` holds a CA and
optionally a client certificate and key, re-read whenever the files change (as cert-manager
or a kubelet-mounted Secret rotates them), so that every new connection uses the files as
they are; :func:`tls_connector` dials with them and, when a handshake fails, says why
(:class:`TlsHandshakeError`) rather than leaving a bare "connection failed".
"""

from __future__ import annotations

import contextlib
import os
import ssl
from typing import Final

import anyio
import grpc

from sidecar_common.endpoint import parse_endpoint
from sidecar_common.pool import Connector, connect_channel

# The settings and their checks live apart (no grpc there, for the command lines); re-exported
# here, where the credentials that use them are.
from sidecar_common.tls_settings import (
    ClientTlsFiles,
    TlsFiles,
    TlsSettingsError,
    check_pem,
    load_client_files,
    tls_files,
)

__all__ = [
    "ClientCredentials",
    "ClientTlsFiles",
    "TlsFiles",
    "TlsHandshakeError",
    "TlsSettingsError",
    "check_pem",
    "handshake_problem",
    "server_credentials",
    "tls_connector",
    "tls_files",
]


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """Read the files (PEM) into grpc server credentials; raises TlsSettingsError naming the
    file that is not what it should be."""
    cert = check_pem(files.cert, "certificate").encode()
    key = check_pem(files.key, "private key").encode()
    root = check_pem(files.client_ca, "certificate").encode() if files.client_ca is not None else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=root, require_client_auth=root is not None
    )


# ------------------------------------------------------------------------------ client side


class TlsHandshakeError(Exception):
    """The server answered, but the TLS handshake failed (a certificate the CA did not sign,
    a name the certificate does not cover, a client certificate the server refused). Not
    transient: retrying at the connection pool's pace would not change the answer."""


_Signature = tuple[tuple[int, int, int, int], ...]


def _signature(files: ClientTlsFiles) -> _Signature:
    """What changes when a file is replaced or rewritten (stat follows the symlinks a
    kubelet-mounted Secret swaps, so a rotation there is a new inode)."""
    out = []
    for path in files.paths():
        st = os.stat(path)
        out.append((st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size))
    return tuple(out)


class ClientCredentials:
    """Channel credentials from :class:`ClientTlsFiles`, re-read when a file changes.

    ``refresh()`` looks at the files (three ``stat`` calls) and reloads them when they
    changed; ``version`` counts the loads, so a holder of connections can tell whether they
    were made with the files as they are now. A change that does not load (a rotation caught
    half-written, a certificate that does not match its key) keeps the previous credentials
    and is described in ``problem`` until the files load again. Only the first load, in the
    constructor, raises (TlsSettingsError naming the file)."""

    def __init__(self, files: ClientTlsFiles) -> None:
        self.files = files
        self.version = 0
        self.problem: str | None = None
        self._signature: _Signature | None = None
        ca, cert, key = load_client_files(files)
        self._credentials = grpc.ssl_channel_credentials(ca, key, cert)
        self.version = 1
        with contextlib.suppress(OSError):
            self._signature = _signature(files)

    def refresh(self) -> bool:
        """True when the files changed and were loaded."""
        try:
            signature = _signature(self.files)
        except OSError:
            return False  # a file missing for a moment in a rotation: keep what we have
        if signature == self._signature:
            return False
        self._signature = signature
        try:
            ca, cert, key = load_client_files(self.files)
        except TlsSettingsError as err:
            self.problem = str(err)
            return False
        self._credentials = grpc.ssl_channel_credentials(ca, key, cert)
        self.problem = None
        self.version += 1
        return True

    def current(self) -> grpc.ChannelCredentials:
        """The credentials for a new connection: the files as they are now, or the last ones
        that loaded."""
        self.refresh()
        return self._credentials


_H2_PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


async def handshake_problem(target: str, files: ClientTlsFiles, timeout: float) -> str | None:
    """Why a TLS connection to ``target`` with ``files`` fails, or None when it does not
    fail for a TLS reason (nothing listens, the handshake succeeds...). Python's ssl stands in
    for grpc's here because grpc reports a failed handshake only as a failed connection."""
    endpoint = parse_endpoint(target)
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    context.load_verify_locations(cafile=files.ca)
    if files.cert is not None and files.key is not None:
        context.load_cert_chain(files.cert, files.key)
    context.set_alpn_protocols(["h2"])
    try:
        with anyio.fail_after(timeout):
            stream = await anyio.connect_tcp(
                endpoint.host,
                endpoint.port,
                ssl_context=context,
                tls_hostname=endpoint.host,
                tls_standard_compatible=False,  # no close_notify exchange on the way out
            )
            async with stream:
                await stream.send(_H2_PREFACE)
                try:
                    await stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError, ssl.SSLError):
                    # An HTTP/2 server that accepted the connection answers with its SETTINGS.
                    # A grpc server requiring mutual TLS that does not trust the client's
                    # certificate (or got none) closes the connection once the TLS 1.3
                    # handshake is over, without a word.
                    return (
                        "it closed the connection right after the TLS handshake, as a worker "
                        "requiring mutual TLS does when it does not trust this client's "
                        "certificate (or got none)"
                    )
    except ssl.SSLCertVerificationError as err:
        return f"its certificate is not trusted: {err.verify_message}"
    except ssl.SSLError as err:
        if err.reason == "WRONG_VERSION_NUMBER":
            return "it does not speak TLS (a plaintext worker: its --tls-cert is unset?)"
        return f"TLS handshake failed: {err.reason or err}"
    except (OSError, TimeoutError, anyio.EndOfStream, anyio.BrokenResourceError):
        return None
    return None


def tls_connector(credentials: ClientCredentials, *, probe_timeout: float = 5.0) -> Connector:
    """A pool connector dialling over TLS with the credentials as they are at each attempt;
    a handshake that fails raises :class:`TlsHandshakeError` saying why."""

    async def connect(target: str, timeout: float) -> grpc.aio.Channel:
        try:
            return await connect_channel(target, timeout, credentials=credentials.current())
        except ConnectionError:
            problem = await handshake_problem(target, credentials.files, min(timeout, probe_timeout))
            if problem is not None:
                raise TlsHandshakeError(f"TLS with {target} failed: {problem}") from None
            raise

    return connect
