"""Engine endpoint parsing (spec/COMMON.md). INTERFACE STUB: being filled in."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Endpoint", "EndpointError", "parse_endpoint"]


class EndpointError(ValueError):
    """A refused endpoint; the message says what is wrong."""


@dataclass(frozen=True)
class Endpoint:
    host: str  # without brackets, even for IPv6
    port: int

    @property
    def target(self) -> str:
        """``host:port`` as grpcio and aiohttp want it (IPv6 in brackets)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def http_base_url(self) -> str:
        return f"http://{self.target}"

    def __str__(self) -> str:
        return self.target


def parse_endpoint(text: str) -> Endpoint:
    """``host:port``, ``grpc://host:port`` or ``http://host:port``; refuses the rest."""
    raise NotImplementedError
