"""An independent reader of the engines' KV-event wire, for tests: msgspec structs written from
vLLM 0.34.0's ``vllm/distributed/kv_events.py`` and SGLang 0.5.23's
``sglang/srt/disaggregation/kv_events.py`` (shares no code with ``testkit.kv_events``), and a
pyzmq SUB + DEALER pair that collects numbered batches, filling gaps by replay."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

END_MARK = (-1).to_bytes(8, "big", signed=True)


# -- vLLM 0.34.0 ------------------------------------------------------------------------
class VllmEvent(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class VllmStored(VllmEvent, tag="BlockStored"):
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


class VllmRemoved(VllmEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VllmCleared(VllmEvent, tag="AllBlocksCleared"):
    pass


class VllmBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[VllmStored | VllmRemoved | VllmCleared]
    data_parallel_rank: int | None = None


# -- SGLang 0.5.23 ----------------------------------------------------------------------
class SglangEvent(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class SglangStored(SglangEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class SglangRemoved(SglangEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class SglangCleared(SglangEvent, tag="AllBlocksCleared"):
    pass


class SglangBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[SglangStored | SglangRemoved | SglangCleared]
    attn_dp_rank: int | None = None


def decoder(engine: str) -> msgspec.msgpack.Decoder[Any]:
    return msgspec.msgpack.Decoder(VllmBatch if engine == "vllm" else SglangBatch)


@dataclass
class Subscriber:
    """A SUB on ``endpoint`` and a DEALER on ``replay``: ``batches`` by sequence number."""

    endpoint: str
    replay: str | None
    engine: str
    topic: bytes = b""
    ctx: zmq.asyncio.Context = field(default_factory=zmq.asyncio.Context)
    batches: dict[int, Any] = field(default_factory=dict)
    live_seqs: list[int] = field(default_factory=list)
    raw: dict[int, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.sub.connect(self.endpoint)
        self._decode = decoder(self.engine)

    def close(self) -> None:
        self.sub.close(0)
        self.ctx.term()

    async def recv_live(self, timeout: float = 10.0) -> int:
        """The next live batch (kept); its sequence number."""
        topic, seq_b, payload = await asyncio.wait_for(self.sub.recv_multipart(), timeout)
        assert topic == self.topic
        seq = int.from_bytes(seq_b, "big")
        self.live_seqs.append(seq)
        self.raw[seq] = payload
        self.batches[seq] = self._decode.decode(payload)
        return seq

    async def join(
        self, make_batch: Callable[[int], Awaitable[None]], last_seq: Callable[[], int], tries: int = 50
    ) -> int:
        """PUB/SUB joins late: make batches (``make_batch(i)``) until one arrives live, then
        take every batch up to the publisher's ``last_seq()`` (those were sent after it, so
        they come too); that last sequence number."""
        for i in range(tries):
            await make_batch(i)
            try:
                await self.recv_live(timeout=0.5)
            except TimeoutError:
                continue
            while self.live_seqs[-1] < last_seq():
                await self.recv_live()
            return self.live_seqs[-1]
        raise AssertionError("no batch arrived on the SUB socket")

    async def replay_from(self, start: int, timeout: float = 10.0) -> list[int]:
        """Ask the replay socket from ``start``; the sequence numbers it answered (kept)."""
        assert self.replay is not None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            seqs: list[int] = []
            while True:
                empty, topic, seq_b, payload = await asyncio.wait_for(dealer.recv_multipart(), timeout)
                assert empty == b""
                if seq_b == END_MARK:
                    assert topic == b""
                    assert payload == b""
                    return seqs
                assert topic == self.topic
                seq = int.from_bytes(seq_b, "big")
                seqs.append(seq)
                self.raw[seq] = payload
                self.batches[seq] = self._decode.decode(payload)
        finally:
            dealer.close(0)
