"""The KV-events flags of every sidecar, and where each data-parallel rank publishes (pure).

``--kv-events-endpoint`` is the engine's PUB address (what its ``--kv-events-config`` names).
The engines bind wildcard addresses (``tcp://*:5557``, their default): given such an address,
the sidecar connects to the loopback at that port, since it runs beside its engine (the
address is read, and the wildcard told, by the kernel's rules: ``sidecar_common.endpoint``).
``--kv-events-replay-endpoint`` is the engine's replay ROUTER (no default in either engine).

Data-parallel ranks: each rank publishes on the base port plus its rank (vLLM and SGLang both,
for a non-zero port; they differ only for port 0, which a subscriber cannot use since the
engine picks the port). ``--kv-events-data-parallel-size`` says how many ranks to subscribe
to; unset, the engine's own data-parallel size from discovery.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from sidecar_common import flags
from sidecar_common.endpoint import EndpointError, format_host_port, loopback_for, parse_tcp_endpoint

__all__ = ["KvEventsConfig", "add_kv_events_arguments", "kv_events_config", "rank_endpoint"]


@dataclass(frozen=True)
class KvEventsConfig:
    endpoint: str
    replay_endpoint: str | None = None
    # None: the engine's data-parallel size, from discovery.
    data_parallel_size: int | None = None
    topic: str = ""
    # A replay that sends nothing for this long is given up (the feed then resyncs).
    replay_timeout: float = 10.0


def _zmq_endpoint(text: str) -> str:
    """A ZeroMQ address to connect to: ``ipc://PATH`` as given, ``tcp://HOST:PORT`` with a
    wildcard host replaced by the loopback."""
    if text.startswith("ipc://"):
        return text
    if not text.strip().startswith("tcp://"):
        raise argparse.ArgumentTypeError(f"expected tcp://HOST:PORT or ipc://PATH, got {text!r}")
    try:
        address = parse_tcp_endpoint(text)
    except EndpointError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return _tcp(loopback_for(address.host), address.port)


def _tcp(host: str, port: int) -> str:
    return f"tcp://{format_host_port(host, port)}"


def rank_endpoint(endpoint: str, rank: int) -> str:
    """Where data-parallel rank ``rank`` publishes, given rank 0's address."""
    if rank == 0:
        return endpoint
    if not endpoint.startswith("tcp://"):
        # Neither engine offsets an ipc:// address (both refuse one for a rank above 0).
        raise ValueError(
            f"data-parallel rank {rank} cannot publish on {endpoint}: only tcp:// ports are offset"
        )
    address = parse_tcp_endpoint(endpoint)
    return _tcp(address.host, address.port + rank)


def add_kv_events_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("KV-cache events (KV-aware routing)")
    group.add_argument(
        "--kv-events-endpoint",
        type=_zmq_endpoint,
        default=None,
        metavar="tcp://HOST:PORT",
        help="the engine's KV-event PUB address (its --kv-events-config endpoint; a wildcard host "
        "means this host); the sidecar serves the cache state on WatchKvCache (default: unset: off)",
    )
    group.add_argument(
        "--kv-events-replay-endpoint",
        type=_zmq_endpoint,
        default=None,
        metavar="tcp://HOST:PORT",
        help="the engine's KV-event replay address (its --kv-events-config replay_endpoint), to "
        "fill gaps; needs --kv-events-endpoint (default: unset: a gap resyncs)",
    )
    group.add_argument(
        "--kv-events-data-parallel-size",
        type=flags.positive_int_arg,
        default=None,
        metavar="N",
        help="subscribe to ranks 0..N-1, each on the base ports plus its rank; needs "
        "--kv-events-endpoint (default: the engine's data-parallel size)",
    )


def kv_events_config(ns: argparse.Namespace) -> KvEventsConfig | None:
    """The parsed flags; raises ValueError for a flag that needs --kv-events-endpoint."""
    for dest in ("kv_events_replay_endpoint", "kv_events_data_parallel_size"):
        flags.refuse_inapplicable(
            ns, dest, applies=ns.kv_events_endpoint is not None, rule="needs --kv-events-endpoint"
        )
    if ns.kv_events_endpoint is None:
        return None
    return KvEventsConfig(
        endpoint=ns.kv_events_endpoint,
        replay_endpoint=ns.kv_events_replay_endpoint,
        data_parallel_size=ns.kv_events_data_parallel_size,
    )
