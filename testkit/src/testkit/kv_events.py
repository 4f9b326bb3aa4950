"""The engines' KV-event wire, pure: the config flag, the event structs, the block hashes, the
endpoint rules and the replay buffer. The sockets live in ``kv_publisher``.

Facts learned from vLLM 0.34.0 (``vllm/distributed/kv_events.py``, ``vllm/config/kv_events.py``,
``vllm/v1/core/block_pool.py``, ``kv_cache_utils.py``) and SGLang 0.5.23
(``sglang/srt/disaggregation/kv_events.py``, ``sglang/srt/mem_cache/events.py``); the code is ours:

* Both publish ``(topic, sequence number as 8 bytes big-endian, msgpack payload)`` on a PUB
  socket; the payload is an array ``[ts, events, rank]`` whose events are maps tagged by
  ``type`` (the struct's name), optional fields left at None omitted. vLLM names the rank
  ``data_parallel_rank`` and omits defaults in the batch too; SGLang names it
  ``attn_dp_rank`` and always sends three elements (the publisher fills the rank in either way).
* ``BlockStored`` fields, in order. vLLM: block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
  kv_cache_spec_sliding_window, locality, ownership, session_id, lookahead_token_ids (the first
  seven always present). SGLang: block_hashes, parent_block_hash, token_ids, block_size,
  lora_id (always present, None), medium, cache_salt, session_id, lora_name.
* vLLM's hashes are unsigned 64-bit ints (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, default on),
  one ``BlockRemoved`` per evicted block, ``medium`` "GPU", ``group_idx`` 0; ``extra_keys`` has
  one entry per stored block: None, or the untagged tuple (LoRA name, then the cache salt on a
  prompt's first block only). SGLang's hashes are signed int64, consecutive stores of one chain
  and consecutive removals are merged into one event, ``medium`` "GPU", ``cache_salt`` carried.
* Bind or connect: vLLM binds when the endpoint has ``*`` or ``::`` or is ipc/inproc, SGLang
  also for ``0.0.0.0`` or when its config says ``"bind": true``; both bind the replay ROUTER.
  Data-parallel ranks offset the tcp port by the rank (vLLM leaves port 0 alone, SGLang does
  not) and suffix inproc names with ``_dp<rank>``.
* Replay: a request ``(identity, b"", start as 8 bytes big-endian)`` is answered with every
  buffered ``(identity, b"", topic, seq, payload)`` whose seq >= start (so a start older than
  the buffer silently gets the oldest kept), then ``(identity, b"", b"", -1 as 8 signed
  big-endian bytes, b"")``. The buffer keeps the last ``buffer_steps`` batches.

The block hashes here are the testkit's own (a blake2b chain seeded per engine), as the engines' are
their own: a consumer must key blocks by their token ids, never by these.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from testkit.prefix_cache import BlockExtra, CacheEvent, ChainHasher, Cleared, Removed, Stored

__all__ = [
    "END_SEQ",
    "Flavor",
    "KvEventsConfig",
    "ReplayBuffer",
    "binds",
    "block_hasher",
    "encode_batch",
    "offset_endpoint",
    "parse_kv_events_config",
    "seq_bytes",
    "sglang_kv_events_descriptor",
]

Flavor = Literal["vllm", "sglang"]

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM_GPU = "GPU"


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


# -- the flag ---------------------------------------------------------------------------
@dataclass(frozen=True)
class KvEventsConfig:
    """``--kv-events-config`` as both engines take it (JSON). ``publisher`` "null" publishes
    nothing; "zmq" is the only other publisher. ``max_queue_size`` is accepted and unused: the
    testkit sends each batch as it is made, with no queue in front of the socket."""

    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    bind: bool | None = None  # SGLang only

    @property
    def enabled(self) -> bool:
        return self.publisher == "zmq"


_COMMON_KEYS = {"publisher", "endpoint", "replay_endpoint", "buffer_steps", "hwm", "max_queue_size", "topic"}
_KEYS: dict[Flavor, set[str]] = {
    "vllm": _COMMON_KEYS | {"enable_kv_cache_events"},
    "sglang": _COMMON_KEYS | {"bind", "format"},
}


def parse_kv_events_config(text: str, flavor: Flavor) -> KvEventsConfig:
    """The flag's JSON as ``flavor`` reads it; ValueError names what is wrong.

    vLLM: ``publisher`` unset means "zmq" when ``enable_kv_cache_events`` is true, else "null".
    SGLang: ``publisher`` defaults to "null"; only its "default" event format is simulated."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--kv-events-config is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    unknown = sorted(set(raw) - _KEYS[flavor])
    if unknown:
        raise ValueError(f"--kv-events-config: unknown field(s) {', '.join(unknown)}")
    publisher = raw.get("publisher")
    if flavor == "vllm":
        enabled = bool(raw.get("enable_kv_cache_events", False))
        if publisher is None:
            publisher = "zmq" if enabled else "null"
        elif not enabled:
            publisher = "null"  # vLLM creates no publisher while events are disabled
    else:
        publisher = "null" if publisher is None else publisher
        if raw.get("format", "default") != "default":
            raise ValueError("--kv-events-config: the testkit publishes the default format only")
    if publisher not in ("null", "zmq"):
        raise ValueError(f"--kv-events-config: unknown publisher {publisher!r}")
    try:
        config = KvEventsConfig(
            publisher=str(publisher),
            endpoint=str(raw.get("endpoint", KvEventsConfig.endpoint)),
            replay_endpoint=None if raw.get("replay_endpoint") is None else str(raw["replay_endpoint"]),
            buffer_steps=int(raw.get("buffer_steps", KvEventsConfig.buffer_steps)),
            hwm=int(raw.get("hwm", KvEventsConfig.hwm)),
            max_queue_size=int(raw.get("max_queue_size", KvEventsConfig.max_queue_size)),
            topic=str(raw.get("topic", "")),
            bind=None if raw.get("bind") is None else bool(raw["bind"]),
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"--kv-events-config: {e}") from None
    if config.buffer_steps < 1:
        raise ValueError("--kv-events-config: buffer_steps must be >= 1")
    return config


# -- endpoints --------------------------------------------------------------------------
def offset_endpoint(endpoint: str | None, rank: int, flavor: Flavor) -> str | None:
    """The endpoint data-parallel rank ``rank`` publishes on."""
    if not endpoint or rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    if "tcp" not in endpoint:
        raise ValueError(f"invalid KV events endpoint {endpoint!r}: must be tcp or inproc")
    if ":" not in endpoint:
        return endpoint
    base, _, port_text = endpoint.rpartition(":")
    port = int(port_text)
    if port == 0 and flavor == "vllm":
        return endpoint  # vLLM leaves an OS-chosen port alone
    return f"{base}:{port + rank}"


def binds(endpoint: str, flavor: Flavor, bind: bool | None = None) -> bool:
    """Whether the PUB socket binds ``endpoint`` (else it connects to it)."""
    if flavor == "sglang" and bind is not None:
        return bind
    wildcard = "*" in endpoint or "::" in endpoint or (flavor == "sglang" and "0.0.0.0" in endpoint)
    return wildcard or endpoint.startswith(("ipc://", "inproc://"))


def _advertisable_tcp(endpoint: str | None) -> tuple[str, int] | None:
    if not endpoint or not endpoint.startswith("tcp://"):
        return None
    host, sep, port_text = endpoint[len("tcp://") :].rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) <= 65535:
        return None
    return host, int(port_text)


def sglang_kv_events_descriptor(
    config: KvEventsConfig | None,
    endpoint: str | None,
    replay_endpoint: str | None,
    page_size: int,
    dp_size: int,
) -> dict[str, Any] | None:
    """SGLang's ``kv_events`` key of its server info: how a router finds each rank's sockets
    (rank r on port base + r, the wildcard host replaced by the worker's). ``endpoint`` and
    ``replay_endpoint`` are rank 0's as bound (a port 0 already resolved). None when nothing is
    published or the endpoint is no routable tcp address."""
    if config is None or not config.enabled:
        return None
    pub = _advertisable_tcp(endpoint)
    if pub is None:
        return None
    descriptor: dict[str, Any] = {
        "publisher": config.publisher,
        "endpoint_host": pub[0],
        "endpoint_port_base": pub[1],
        "topic": config.topic,
        "block_size": page_size,
        "dp_size": dp_size,
    }
    replay = _advertisable_tcp(replay_endpoint)
    if replay is not None:
        descriptor["replay_endpoint_port_base"] = replay[1]
    return descriptor


# -- block hashes -----------------------------------------------------------------------
def _extra_bytes(extra: BlockExtra) -> bytes:
    out = b""
    for part in (extra.lora_name, extra.cache_salt):
        if part is None:
            out += b"\x00"
        else:
            encoded = part.encode()
            out += b"\x01" + len(encoded).to_bytes(8, "big") + encoded
    return out


def _chain(tag: bytes, signed: bool) -> ChainHasher:
    """A chain of 8-byte blake2b digests over (parent, the block's tokens, extra); a first
    block's parent is a seed made of ``tag`` (0x00-prefixed: never a 0x01-prefixed digest)."""
    seed = b"\x00" + hashlib.blake2b(tag, digest_size=8).digest()

    def chain(parent: int | None, tokens: Sequence[int], block_size: int, extra: BlockExtra) -> list[int]:
        raw = array("q", tokens).tobytes()
        tail = _extra_bytes(extra)
        step = 8 * block_size
        prev = seed if parent is None else b"\x01" + parent.to_bytes(8, "big", signed=signed)
        out: list[int] = []
        for start in range(0, len(raw) - step + 1, step):
            digest = hashlib.blake2b(prev + raw[start : start + step] + tail, digest_size=8).digest()
            out.append(int.from_bytes(digest, "big", signed=signed))
            prev = b"\x01" + digest
        return out

    return chain


_VLLM_CHAIN = _chain(b"testkit-vllm-block", signed=False)
_SGLANG_CHAIN = _chain(b"testkit-sglang-page", signed=True)


def block_hasher(flavor: Flavor) -> ChainHasher:
    """The engine's block hashes: unsigned 64-bit for vLLM, signed int64 for SGLang."""
    return _VLLM_CHAIN if flavor == "vllm" else _SGLANG_CHAIN


# -- vLLM's structs ---------------------------------------------------------------------
class _VllmEvent(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class VllmBlockStored(_VllmEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class VllmBlockRemoved(_VllmEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VllmAllBlocksCleared(_VllmEvent, tag="AllBlocksCleared"):
    pass


class VllmKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]
    data_parallel_rank: int | None = None


# -- SGLang's structs -------------------------------------------------------------------
class _SglangEvent(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class SglangBlockStored(_SglangEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class SglangBlockRemoved(_SglangEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class SglangAllBlocksCleared(_SglangEvent, tag="AllBlocksCleared"):
    pass


class SglangKVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[SglangBlockStored | SglangBlockRemoved | SglangAllBlocksCleared]
    attn_dp_rank: int | None = None


def _vllm_extra_keys(event: Stored) -> list[tuple[Any, ...] | None]:
    keys: list[tuple[Any, ...] | None] = []
    for i in range(len(event.block_hashes)):
        parts: list[Any] = []
        if event.extra.lora_name is not None:
            parts.append(event.extra.lora_name)
        if event.extra.cache_salt and event.first_block_index + i == 0:
            parts.append(event.extra.cache_salt)
        keys.append(tuple(parts) if parts else None)
    return keys


_VllmEventT = VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared


def _vllm_events(events: Sequence[CacheEvent]) -> list[_VllmEventT]:
    out: list[_VllmEventT] = []
    for event in events:
        if isinstance(event, Stored):
            out.append(
                VllmBlockStored(
                    block_hashes=list(event.block_hashes),
                    parent_block_hash=event.parent_hash,
                    token_ids=list(event.token_ids),
                    block_size=event.block_size,
                    lora_id=None if event.extra.lora_name is None else _lora_int_id(event.extra.lora_name),
                    medium=MEDIUM_GPU,
                    lora_name=event.extra.lora_name,
                    extra_keys=_vllm_extra_keys(event),
                    group_idx=0,
                )
            )
        elif isinstance(event, Removed):
            out.extend(
                VllmBlockRemoved(block_hashes=[h], medium=MEDIUM_GPU, group_idx=0) for h in event.block_hashes
            )
        else:
            out.append(VllmAllBlocksCleared())
    return out


def _lora_int_id(name: str) -> int:
    # vLLM's lora_id is the adapter's integer id, which the testkit's wire never carries; a
    # stable positive number derived from the name stands in for it.
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:3], "big") + 1


def _sglang_events(
    events: Sequence[CacheEvent],
) -> list[SglangBlockStored | SglangBlockRemoved | SglangAllBlocksCleared]:
    out: list[SglangBlockStored | SglangBlockRemoved | SglangAllBlocksCleared] = []
    for event in events:
        if isinstance(event, Stored):
            out.append(
                SglangBlockStored(
                    block_hashes=list(event.block_hashes),
                    parent_block_hash=event.parent_hash,
                    token_ids=list(event.token_ids),
                    block_size=event.block_size,
                    lora_id=None,
                    medium=MEDIUM_GPU,
                    cache_salt=event.extra.cache_salt,
                    lora_name=event.extra.lora_name,
                )
            )
        elif isinstance(event, Removed):
            tail = out[-1] if out else None
            if isinstance(tail, SglangBlockRemoved):
                tail.block_hashes.extend(event.block_hashes)  # SGLang merges consecutive removals
            else:
                out.append(SglangBlockRemoved(block_hashes=list(event.block_hashes), medium=MEDIUM_GPU))
        elif isinstance(event, Cleared):
            out.append(SglangAllBlocksCleared())
    return out


_ENCODER = msgspec.msgpack.Encoder()


def encode_batch(flavor: Flavor, ts: float, events: Sequence[CacheEvent], rank: int) -> bytes:
    """One batch's msgpack payload, as ``flavor``'s publisher sends it."""
    if flavor == "vllm":
        return _ENCODER.encode(VllmKVEventBatch(ts=ts, events=_vllm_events(events), data_parallel_rank=rank))
    return _ENCODER.encode(SglangKVEventBatch(ts=ts, events=_sglang_events(events), attn_dp_rank=rank))


# -- replay -----------------------------------------------------------------------------
class ReplayBuffer:
    """The last ``steps`` batches, by sequence number."""

    def __init__(self, steps: int) -> None:
        self._batches: deque[tuple[int, bytes]] = deque(maxlen=steps)

    def append(self, seq: int, payload: bytes) -> None:
        self._batches.append((seq, payload))

    def clear(self) -> None:
        self._batches.clear()

    def since(self, start: int) -> list[tuple[int, bytes]]:
        """Every kept batch from ``start`` on: from the oldest kept when ``start`` is older."""
        return [(seq, payload) for seq, payload in self._batches if seq >= start]

    def answer(self, identity: bytes, request: Sequence[bytes], topic: bytes) -> list[list[bytes]] | None:
        """The ROUTER's reply frames to one request, or None for a malformed one (ignored)."""
        if len(request) != 2:
            return None
        start = int.from_bytes(request[1], "big")
        replies = [[identity, b"", topic, seq_bytes(seq), payload] for seq, payload in self.since(start)]
        replies.append([identity, b"", b"", END_SEQ, b""])
        return replies
