"""The grpc core settings our programs choose for themselves, before grpc loads.

grpc reads ``GRPC_EXPERIMENTS`` once, when it is first imported, so each program applies these
at its entry, before anything imports grpc (the entries import it only after their flags parse).

``-event_engine_client``: outgoing connections use grpc core's older TCP client (iomgr's)
instead of the EventEngine one that grpcio made the default. Reading a streamed message costs
the client less with it (`bench.grpc_floor`: 21.4 against 25.3 µs), and a sidecar relaying
paced tokens uses 13-31 % less CPU per request at the same latency (`bench`'s paced test);
what it trades is in bench/README.md ("grpc core's older TCP client"). Servers (our listening
side) are unchanged.

An operator's own ``GRPC_EXPERIMENTS`` wins whole, even empty (which keeps grpc's defaults).
Standard library only.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Final

__all__ = ["CLIENT_EXPERIMENTS", "EXPERIMENTS_VARIABLE", "choose_core_settings", "core_environment"]

EXPERIMENTS_VARIABLE: Final = "GRPC_EXPERIMENTS"
CLIENT_EXPERIMENTS: Final = "-event_engine_client"


def core_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to ``environ``: none that its operator set."""
    if EXPERIMENTS_VARIABLE in environ:
        return {}
    return {EXPERIMENTS_VARIABLE: CLIENT_EXPERIMENTS}


def choose_core_settings() -> bool:
    """Add :func:`core_environment` to this process's environment (and so to the processes it
    starts). False, changing nothing, when grpc is already loaded here: it would not read them."""
    if "grpc" in sys.modules:
        return False
    os.environ.update(core_environment(os.environ))
    return True
