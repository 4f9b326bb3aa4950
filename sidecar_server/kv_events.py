"""The engines' KV-cache events, decoded (pure: no I/O, no clock, no globals).

vLLM (``vllm/distributed/kv_events.py``, read at vLLM 0.34.0) and SGLang
(``sglang/srt/disaggregation/kv_events.py``, read at SGLang 0.5.23) publish the same wire: a
ZeroMQ PUB socket sends ``(topic, sequence number as 8 bytes big-endian, payload)``; the
payload is a msgpack array ``[ts, events, rank]`` (vLLM may leave the rank out), each event a
msgpack map tagged by its ``type``: ``BlockStored``, ``BlockRemoved`` or ``AllBlocksCleared``.
The structs below name only the fields the sidecar uses; msgspec skips the others, so fields
either engine adds later change nothing here. An event of a kind this module does not know is
counted and skipped (:attr:`DecodedBatch.unknown_events`), not a failure of the whole batch.

Engine hashes are opaque here: vLLM sends unsigned 64-bit integers (or 32 raw bytes with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``), SGLang signed 64-bit integers. The sidecar keys
blocks by their token ids instead (:mod:`sidecar_common.kv_keys`) and uses engine hashes only
to find a stored block's parent and a removed block.

What takes part in a block's identity besides its tokens: the LoRA adapter name (both engines'
``lora_name`` field) and the cache salt (SGLang's ``cache_salt`` field; vLLM publishes it
untagged inside ``extra_keys`` of the request's first block). vLLM's ``extra_keys`` also carry
multimodal items (``[identifier, offset]`` pairs) and prompt-embedding digests (bytes): such
blocks cannot be keyed from token ids alone, so :func:`block_identity` calls them opaque.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final

import msgspec

__all__ = [
    "END_OF_REPLAY",
    "AllBlocksCleared",
    "BlockIdentity",
    "BlockRemoved",
    "BlockStored",
    "DecodedBatch",
    "EngineHash",
    "KvEvent",
    "block_identity",
    "decode_batch",
    "decode_sequence",
    "encode_sequence",
    "is_tracked_tier",
]

EngineHash = int | bytes

# The replay socket ends its answer with sequence number -1 (8 bytes, two's complement).
END_OF_REPLAY: Final = -1
# The tier a routing decision cares about: blocks in the GPU's own cache. vLLM names it "GPU",
# SGLang "GPU"; both may leave it out. Offload tiers (CPU, disk, remote) publish their own
# stores and removals of the same hashes, which must not count as the GPU holding a block.
_GPU_MEDIUMS: Final = frozenset({None, "GPU"})


# gc=False: a decoded event holds lists of ints, bytes and strings, never a cycle, so the
# garbage collector need not track one per event (vLLM sends one event per removed block).
class BlockStored(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):
    """Full blocks newly in the cache, chained: each block's parent is the block before it."""

    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None
    cache_salt: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    medium: str | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", gc=False):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    rank: int | None = None


class _KnownBatch(msgspec.Struct, array_like=True):
    """A batch whose every event is of a kind this module knows: the usual one, decoded in
    one call rather than one call per event (vLLM sends one event per removed block)."""

    ts: float
    events: list[KvEvent]
    rank: int | None = None


@dataclass(frozen=True)
class DecodedBatch:
    # The engine's wall clock when it made the batch (``time.time()`` in both engines), in
    # seconds since the Unix epoch; None for a value that is not a finite number, which says
    # nothing of when the batch was made.
    ts: float | None
    events: tuple[KvEvent, ...]
    # vLLM's data_parallel_rank, SGLang's attn_dp_rank; None when the engine left it out.
    rank: int | None
    unknown_events: int


_KNOWN_BATCH_DECODER: Final = msgspec.msgpack.Decoder(_KnownBatch)
_BATCH_DECODER: Final = msgspec.msgpack.Decoder(_Batch)
_EVENT_DECODER: Final = msgspec.msgpack.Decoder(KvEvent)
_TAG_DECODER: Final = msgspec.msgpack.Decoder(dict[str, Any])


def decode_batch(payload: bytes) -> DecodedBatch:
    """One published payload; raises ``msgspec.DecodeError`` (a ValueError) if malformed."""
    try:
        known = _KNOWN_BATCH_DECODER.decode(payload)
    except msgspec.ValidationError:
        pass  # an unknown kind of event, or a malformed batch: the event-by-event path says which
    else:
        return DecodedBatch(_finite(known.ts), tuple(known.events), known.rank, unknown_events=0)
    batch = _BATCH_DECODER.decode(payload)
    events: list[KvEvent] = []
    unknown = 0
    for raw in batch.events:
        try:
            events.append(_EVENT_DECODER.decode(raw))
        except msgspec.ValidationError:
            # A tag we do not know is a newer engine's event kind: skip it. A known tag with
            # wrong fields is a malformed batch.
            if _TAG_DECODER.decode(raw).get("type") in _KNOWN_TAGS:
                raise
            unknown += 1
    return DecodedBatch(_finite(batch.ts), tuple(events), batch.rank, unknown_events=unknown)


def _finite(ts: float) -> float | None:
    return ts if math.isfinite(ts) else None


_KNOWN_TAGS: Final = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


def decode_sequence(frame: bytes) -> int:
    """The sequence-number frame: 8 bytes big-endian (the replay's end marker is -1)."""
    if len(frame) != 8:
        raise ValueError(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def encode_sequence(sequence: int) -> bytes:
    """What a replay request carries: the first sequence number wanted, 8 bytes big-endian."""
    return sequence.to_bytes(8, "big", signed=True)


def is_tracked_tier(medium: str | None, group_idx: int | None) -> bool:
    """Whether an event speaks of the GPU cache's first KV-cache group, the one we index.

    Hybrid models (vLLM's KV-cache groups, e.g. full and sliding-window attention) publish one
    store per group for the same tokens; the first group's blocks are the prefix cache proper.
    """
    return medium in _GPU_MEDIUMS and group_idx in (None, 0)


@dataclass(frozen=True)
class BlockIdentity:
    """What besides tokens names a chain's blocks: the adapter and the salt."""

    lora_name: str | None
    cache_salt: str | None


def block_identity(event: BlockStored, index: int) -> BlockIdentity | None:
    """The identity of the ``index``-th block of a store, or None if it is opaque.

    Opaque: its engine hash also covers something a frontend cannot see in token ids (an
    image, prompt embeddings), so no token-id key would name the same cached content.
    """
    cache_salt = event.cache_salt
    keys = event.extra_keys[index] if event.extra_keys and index < len(event.extra_keys) else None
    if keys:
        parts = list(keys)
        if event.lora_name is not None and parts and parts[0] == event.lora_name:
            parts = parts[1:]
        for part in parts:
            if isinstance(part, str):
                cache_salt = part
            else:
                return None
    return BlockIdentity(lora_name=event.lora_name, cache_salt=cache_salt)
