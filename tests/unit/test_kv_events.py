"""Decoding the engines' KV events (sidecar_server.kv_events): both engines' wire shapes, as
written by hand in tests/kv_sim.py and below (vLLM 0.34.0, SGLang 0.5.23)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from sidecar_server.kv_events import (
    AllBlocksCleared,
    BlockIdentity,
    BlockRemoved,
    BlockStored,
    block_identity,
    decode_batch,
    decode_sequence,
    encode_sequence,
    is_tracked_tier,
)


def stored(**fields: Any) -> dict[str, Any]:
    event = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [1, 2],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    event.update(fields)
    return event


def test_a_vllm_batch_without_its_rank_decodes() -> None:
    payload = msgspec.msgpack.encode([1.5, [stored(block_hashes=[2**64 - 1])]])
    batch = decode_batch(payload)
    assert batch.rank is None
    assert batch.ts == 1.5
    assert batch.events == (
        BlockStored(
            block_hashes=[2**64 - 1], parent_block_hash=None, token_ids=[1, 2], block_size=2, medium="GPU"
        ),
    )


@pytest.mark.parametrize("ts", [float("nan"), float("inf")])
def test_a_batch_time_that_is_not_a_number_decodes_as_none(ts: float) -> None:
    assert decode_batch(msgspec.msgpack.encode([ts, [], 0])).ts is None


def test_an_sglang_batch_with_signed_hashes_and_its_salt_decodes() -> None:
    event = stored(block_hashes=[-(2**63)], parent_block_hash=-5, cache_salt="s", lora_name="a")
    batch = decode_batch(msgspec.msgpack.encode([2, [event], 3]))
    assert batch.rank == 3
    (decoded,) = batch.events
    assert isinstance(decoded, BlockStored)
    assert (decoded.block_hashes, decoded.parent_block_hash, decoded.cache_salt, decoded.lora_name) == (
        [-(2**63)],
        -5,
        "s",
        "a",
    )


def test_raw_32_byte_hashes_decode_as_bytes() -> None:
    digest = bytes(range(32))
    batch = decode_batch(
        msgspec.msgpack.encode([0.0, [stored(block_hashes=[digest], parent_block_hash=digest)]])
    )
    (decoded,) = batch.events
    assert isinstance(decoded, BlockStored)
    assert decoded.block_hashes == [digest]


def test_removals_clears_and_fields_we_do_not_use() -> None:
    events = [
        {
            "type": "BlockRemoved",
            "block_hashes": [1, 2],
            "medium": "GPU",
            "group_idx": 0,
            "locality": "LOCAL",
        },
        {"type": "AllBlocksCleared"},
        stored(session_id="x", lookahead_token_ids=None, kv_cache_spec_kind="full"),
    ]
    batch = decode_batch(msgspec.msgpack.encode([0.0, events, 0]))
    assert batch.events[0] == BlockRemoved(block_hashes=[1, 2], medium="GPU", group_idx=0)
    assert batch.events[1] == AllBlocksCleared()
    assert batch.unknown_events == 0


def test_an_event_kind_we_do_not_know_is_counted_and_skipped() -> None:
    batch = decode_batch(
        msgspec.msgpack.encode([0.0, [{"type": "BlockPinned", "x": 1}, {"type": "AllBlocksCleared"}]])
    )
    assert batch.events == (AllBlocksCleared(),)
    assert batch.unknown_events == 1


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",
        msgspec.msgpack.encode({"ts": 0}),
        msgspec.msgpack.encode([0.0, [{"type": "BlockStored", "block_hashes": "x"}]]),
        msgspec.msgpack.encode([0.0, [{"type": "BlockRemoved"}]]),
    ],
)
def test_a_malformed_payload_is_a_value_error(payload: bytes) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - msgspec's messages are its own
        decode_batch(payload)


def test_sequence_frames() -> None:
    assert decode_sequence((7).to_bytes(8, "big")) == 7
    assert decode_sequence(b"\xff" * 8) == -1  # the replay's end marker
    assert encode_sequence(258) == b"\x00\x00\x00\x00\x00\x00\x01\x02"
    with pytest.raises(ValueError, match="8 bytes"):
        decode_sequence(b"\x01")


@pytest.mark.parametrize(
    ("medium", "group", "tracked"),
    [(None, None, True), ("GPU", 0, True), ("GPU", 1, False), ("CPU", None, False), ("CPU_PINNED", 0, False)],
)
def test_only_the_gpu_cache_first_group_is_tracked(
    medium: str | None, group: int | None, tracked: bool
) -> None:
    assert is_tracked_tier(medium, group) is tracked


def _event(extra_keys: list[Any] | None, lora: str | None = None, salt: str | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=[1, 2],
        parent_block_hash=None,
        token_ids=[1, 2],
        block_size=1,
        lora_name=lora,
        cache_salt=salt,
        extra_keys=extra_keys,
    )


@pytest.mark.parametrize(
    ("event", "index", "identity"),
    [
        (_event(None), 0, BlockIdentity(None, None)),
        (_event(None, salt="s"), 0, BlockIdentity(None, "s")),  # SGLang's field
        (_event([["s"], None]), 0, BlockIdentity(None, "s")),  # vLLM: salt on the first block
        (_event([["a", "s"], ["a"]], lora="a"), 0, BlockIdentity("a", "s")),
        (_event([["a", "s"], ["a"]], lora="a"), 1, BlockIdentity("a", None)),
        (_event([["a"], ["a"]], lora="a"), 0, BlockIdentity("a", None)),
        (_event([[["image-1", 0]], None]), 0, None),  # a multimodal item
        (_event([None, [b"\x00" * 32]]), 1, None),  # prompt embeddings
        (_event([None, [b"\x00" * 32]]), 0, BlockIdentity(None, None)),
    ],
)
def test_block_identity(event: BlockStored, index: int, identity: BlockIdentity | None) -> None:
    assert block_identity(event, index) == identity
