"""The size bound of a gRPC message: every channel and server of ours (and the testkit's
engines) uses it. A module of its own, standard library only, so that the command lines read
it (the default of the sidecars' --max-request-bytes) without importing grpc."""

from __future__ import annotations

from typing import Final

__all__ = ["GRPC_MAX_MESSAGE_BYTES"]

# The largest gRPC message our channels and servers send or receive (and the default of the
# sidecars' --max-request-bytes): room for a prompt of millions of token ids and media URLs,
# far below what would strain memory.
GRPC_MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024
