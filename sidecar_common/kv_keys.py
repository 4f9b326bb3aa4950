"""Routing keys of KV-cache blocks, computed from token ids (pure: no I/O, no clock, no globals).

A paged KV cache stores a prompt's prefix in blocks of ``block_size`` tokens; only full blocks
are stored, so a trailing partial block has no key. The key of a block is chained: it is
computed from the key of the block before it (its parent) and the block's own token ids, so it
names the whole prefix that ends with that block. The first block's parent is a root key made
from the request's LoRA adapter name and cache salt, the two request fields that make the
engines keep separate cache entries for the same tokens; so a salt or an adapter changes the
key of every block.

The sidecar computes these keys from the token ids the engine's KV events carry
(:func:`extend_keys` from the stored parent's key), the frontend from a request's token ids
(:func:`block_keys`); both get the same integers without the engine's own hash function.

Keys are unsigned 64-bit integers: BLAKE2b with an 8-byte digest over the parent key and the
block's token ids packed as little-endian unsigned 32-bit integers. Nothing here depends on
Python's salted ``hash()`` or on the platform, so every process and Python version agrees.
Being 64-bit, keys are routing hints, not proofs: a collision can only mislead a routing
choice; the engines look their caches up by their own hashes.

Cost (``python -m bench.kv_keys``; CPython 3.11 on this repository's 2-core machine, shared,
so figures are upper bounds). First measured at load average 5-6 with one
``blake2b(..., digest_size=..., person=...)`` call per block: 1.6-1.8 µs per key in blocks of
16, e.g. 512 keys for 8,192 tokens in 0.9 ms; blocks of 1 (SGLang's default page) make one key
per token, 8,192 keys in about 23 ms. Alternatives measured in the same conditions, per 512
keys: the same loop with SHA-256 about 1.7x and MD5 1.5x slower; a C-level pipeline (``map``
over slices and ``accumulate``, no Python bytecode per block) no faster; a zlib CRC-32 +
Adler-32 chain no faster than BLAKE2b. Per-block object work (slice, call, digest) dominates
the hashing itself. Starting each block's hash as a ``copy()`` of one configured state instead
(the same digests) saves the keyword parsing and parameter setup per call: at load average 0.2,
0.94 -> 0.62 µs per key in blocks of 16 (512 keys in 0.48 -> 0.32 ms), 0.82 -> 0.50 µs in
blocks of 1 (8,192 keys in 6.7 -> 4.1 ms). A C extension would be needed to go much lower.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from typing import Final

__all__ = ["KEY_BITS", "KEY_SCHEME", "block_keys", "extend_keys", "root_key"]

KEY_BITS: Final = 64
# The version of the key layout. A frontend and a sidecar agree on keys only when they compute
# them the same way, so the cache stream says which layout its keys follow.
KEY_SCHEME: Final = 1
_DIGEST_BYTES: Final = KEY_BITS // 8
_KEY_MAX: Final = (1 << KEY_BITS) - 1
# BLAKE2b's personalisation parameter separates the two uses (a root and a block can never
# share a key by construction) and versions the scheme: a change of layout changes the names.
_ROOT_PERSON: Final = b"sidecar.kv.root1"
_BLOCK_PERSON: Final = b"sidecar.kv.blk1"
_TOKEN_TYPECODE: Final = "I"
_TOKEN_BYTES: Final = 4
_TOKEN_MAX: Final = (1 << (8 * _TOKEN_BYTES)) - 1

if array(_TOKEN_TYPECODE).itemsize != _TOKEN_BYTES:  # pragma: no cover - no such platform seen
    raise ImportError("sidecar_common.kv_keys needs a 4-byte array('I')")


def _field(value: str | None) -> bytes:
    # Absent and empty are different requests to an engine only if it says so; we keep them
    # apart (a length prefix after a presence byte) so no two inputs encode alike.
    if value is None:
        return b"\x00"
    encoded = value.encode("utf-8")
    return b"\x01" + len(encoded).to_bytes(4, "big") + encoded


def root_key(*, lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """The parent key of a sequence's first block, for this LoRA adapter and cache salt.

    An empty salt is no salt: vLLM leaves an empty ``cache_salt`` out of its block hashes.
    """
    digest = hashlib.blake2b(
        _field(lora_name) + _field(cache_salt or None), digest_size=_DIGEST_BYTES, person=_ROOT_PERSON
    ).digest()
    return int.from_bytes(digest, "big")


def _packed(token_ids: Sequence[int]) -> bytes:
    try:
        tokens = array(_TOKEN_TYPECODE, token_ids)
    except OverflowError:
        raise ValueError(f"token ids must be within 0..{_TOKEN_MAX}") from None
    if sys.byteorder != "little":  # pragma: no cover - every platform we ship on is little
        tokens.byteswap()
    return tokens.tobytes()


def extend_keys(parent_key: int, token_ids: Sequence[int], block_size: int) -> list[int]:
    """The keys of the full blocks of ``token_ids``, chained on from ``parent_key``.

    ``parent_key`` is the key of the block just before ``token_ids[0]`` (or a
    :func:`root_key`). The keys of a prefix of ``token_ids`` are a prefix of the result.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    if not 0 <= parent_key <= _KEY_MAX:
        raise ValueError(f"parent_key must be an unsigned {KEY_BITS}-bit integer")
    full_blocks = len(token_ids) // block_size
    if full_blocks == 0:
        return []
    packed = _packed(token_ids)
    step = block_size * _TOKEN_BYTES
    digest = parent_key.to_bytes(_DIGEST_BYTES, "big")
    # The hot loop: one hash per block, the ints made afterwards in one C-level map. Each
    # block's hash starts as a copy of one configured (empty) BLAKE2b state: the same digest
    # as a fresh blake2b(digest_size=..., person=...) call, without parsing its keyword
    # arguments and initialising its parameter block again per block.
    copy = hashlib.blake2b(digest_size=_DIGEST_BYTES, person=_BLOCK_PERSON).copy
    digests: list[bytes] = []
    append = digests.append
    for start in range(0, full_blocks * step, step):
        block = copy()
        block.update(digest)
        block.update(packed[start : start + step])
        digest = block.digest()
        append(digest)
    return list(map(int.from_bytes, digests))


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[int]:
    """The routing keys of the full blocks of a token sequence, first block first."""
    return extend_keys(root_key(lora_name=lora_name, cache_salt=cache_salt), token_ids, block_size)
