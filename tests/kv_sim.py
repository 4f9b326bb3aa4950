"""A paged prefix cache that publishes KV events the way vLLM or SGLang does (a test oracle).

Its own block hashes (SHA-256 of the chain, as unsigned 64-bit for vLLM, signed 64-bit for
SGLang, or 32 raw bytes for vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0), its own LRU
eviction, and the wire written out by hand (plain msgpack maps and arrays), sharing no code
with sidecar_server.kv_events. :meth:`SimCache.truth` is what the cache holds, in routing keys
computed from each block's whole prefix with sidecar_common.kv_keys.block_keys.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from sidecar_common.kv_keys import block_keys

Style = Literal["vllm", "vllm-bytes", "sglang"]


@dataclass
class _Block:
    tokens: tuple[int, ...]  # the whole prefix up to and including this block
    lora: str | None
    salt: str | None


@dataclass
class SimCache:
    block_size: int
    style: Style = "vllm"
    capacity: int = 64
    rank: int | None = None
    blocks: OrderedDict[Any, _Block] = field(default_factory=OrderedDict)

    def _hash(self, parent: Any, tokens: tuple[int, ...], lora: str | None, salt: str | None) -> Any:
        digest = hashlib.sha256(repr((parent, tokens, lora, salt)).encode()).digest()
        if self.style == "vllm-bytes":
            return digest
        return int.from_bytes(digest[:8], "big", signed=self.style == "sglang")

    def request(
        self, tokens: list[int], *, lora: str | None = None, salt: str | None = None
    ) -> list[dict[str, Any]]:
        """Serve one prompt: reuse the cached prefix, store the rest's full blocks, evict LRU."""
        size = self.block_size
        events: list[dict[str, Any]] = []
        parent: Any = None
        hashes: list[Any] = []
        for index in range(len(tokens) // size):
            block = tuple(tokens[index * size : (index + 1) * size])
            parent = self._hash(parent, block, lora, salt if index == 0 else None)
            hashes.append(parent)
        cached = 0
        while cached < len(hashes) and hashes[cached] in self.blocks:
            self.blocks.move_to_end(hashes[cached])
            cached += 1
        new = hashes[cached:]
        if new:
            for index, block_hash in enumerate(new, start=cached):
                self.blocks[block_hash] = _Block(tuple(tokens[: (index + 1) * size]), lora, salt)
            events.append(
                self._stored(new, hashes[cached - 1] if cached else None, tokens, cached, lora, salt)
            )
        evicted: list[Any] = []
        while len(self.blocks) > self.capacity:
            victim = next(iter(self.blocks))
            if victim in new:
                break
            del self.blocks[victim]
            evicted.append(victim)
        if evicted:
            events.append(self._removed(evicted))
        return events

    def _stored(
        self, new: list[Any], parent: Any, tokens: list[int], first: int, lora: str | None, salt: str | None
    ) -> dict[str, Any]:
        size = self.block_size
        event: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": new,
            "parent_block_hash": parent,
            "token_ids": tokens[first * size : (first + len(new)) * size],
            "block_size": size,
            "lora_id": 1 if lora is not None else None,
            "medium": "GPU",
            "lora_name": lora,
        }
        if self.style == "sglang":
            if salt is not None:
                event["cache_salt"] = salt
        else:
            # vLLM: per block, untagged: the LoRA name, then the salt on the request's first block.
            extra: list[Any] = []
            for index in range(first, first + len(new)):
                keys = ([lora] if lora is not None else []) + ([salt] if salt and index == 0 else [])
                extra.append(keys or None)
            if any(extra):
                event["extra_keys"] = extra
        return event

    @staticmethod
    def _removed(hashes: list[Any]) -> dict[str, Any]:
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}

    def clear(self) -> list[dict[str, Any]]:
        self.blocks.clear()
        return [{"type": "AllBlocksCleared"}]

    def truth(self) -> set[int]:
        keys: set[int] = set()
        for block in self.blocks.values():
            keys.add(
                block_keys(block.tokens, self.block_size, lora_name=block.lora, cache_salt=block.salt)[-1]
            )
        return keys

    def batch(self, events: list[dict[str, Any]], ts: float = 0.0) -> bytes:
        """One payload as the engine encodes it (vLLM leaves out a rank it does not have)."""
        if self.style == "sglang" or self.rank is not None:
            return msgspec.msgpack.encode([ts, events, self.rank])
        return msgspec.msgpack.encode([ts, events])
