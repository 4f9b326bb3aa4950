"""Routing keys of KV-cache blocks, computed from token ids (pure: no I/O, no clock, no globals
but memoised constants).

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

Layout 2 (:data:`KEY_SCHEME`), all arithmetic modulo 2**64:

* a block's value: ``mix(sum(token[p] * weight[p]))`` over its positions ``p``, where
  ``weight[p] = mix(WEIGHT_SEED + p) | 1`` and ``mix`` is MurmurHash3's 64-bit finaliser (a
  bijection that spreads every input bit over every output bit);
* a block's key: ``parent * CHAIN + value``;
* a root key: the first 8 bytes (big-endian) of BLAKE2b over the adapter name and the salt.

The chain is linear on purpose: ``key[i] = parent * CHAIN**(i+1) + sum(value[j] *
CHAIN**(i-j))``, so a long prompt's keys are a cumulative sum computed in a few array
operations (numpy) instead of one hash call per block in Python; short inputs (a KV event of a
block or two) take a plain loop that gives the same integers. Keys are routing hints, not proofs:
the layout is not meant to resist a client crafting two prompts with one key (that client only
misleads the routing of its own requests); the engines look their caches up by their own hashes.
Nothing depends on Python's salted ``hash()`` or on the platform, so every process agrees.

Cost (``python -m bench.kv_keys``; CPython 3.11, numpy 2.4, this repository's 2-core machine):
layout 1 (one BLAKE2b call per block) took 321 µs for the 512 keys of 8,192 tokens; layout 2
takes about 31 µs from a request message's repeated field (numpy reads it natively in 4 µs),
about 95 from a Python list (reading 8,192 Python ints costs 57). A KV event's few blocks take
the middle way (values in numpy, chain in Python): 8 blocks of 16 in 11 µs (BLAKE2b: 5).
"""

from __future__ import annotations

import hashlib
import operator
from array import array
from collections.abc import Callable, Iterator, Sequence
from functools import lru_cache
from typing import Final, overload

import numpy as np
import numpy.typing as npt

__all__ = ["KEY_BITS", "KEY_SCHEME", "KeyChain", "block_key_chain", "block_keys", "extend_keys", "root_key"]

KEY_BITS: Final = 64
# The version of the key layout. A frontend and a sidecar agree on keys only when they compute
# them the same way, so the cache stream says which layout its keys follow.
KEY_SCHEME: Final = 2

_MASK: Final = (1 << KEY_BITS) - 1
_DIGEST_BYTES: Final = KEY_BITS // 8
# BLAKE2b's personalisation names the layout's roots (layout 1 used "root1").
_ROOT_PERSON: Final = b"sidecar.kv.root2"
# Odd, so multiplying by it is invertible modulo 2**64 (the vector path divides by its powers).
_CHAIN: Final = 0x9E3779B97F4A7C15
_CHAIN_INVERSE: Final = pow(_CHAIN, -1, 1 << KEY_BITS)
_WEIGHT_SEED: Final = 0x2545F4914F6CDD1D
_MIX_1: Final = 0xFF51AFD7ED558CCD
_MIX_2: Final = 0xC4CEB9FE1A85EC53
_TOKEN_TYPECODE: Final = "I"
_TOKEN_MAX: Final = (1 << 32) - 1
# Three ways to the same keys (`python -m bench.kv_keys`, this repository's 2-core machine):
# all in Python, about 0.9 + 0.17 * block_size µs a block; the blocks' values in numpy and the
# chain in Python, about 8.5 µs + 0.3 µs a block; all in numpy, about 15.5 µs + 0.02 µs a token.
# Python up to blocks * (block_size + 5) < 50 (2 blocks of 16, 8 of 1), all-numpy from 64 blocks.
_ARRAY_VALUES_FROM: Final = 50
_ARRAY_CHAIN_FROM: Final = 64

if array(_TOKEN_TYPECODE).itemsize != np.dtype(np.uint32).itemsize:  # pragma: no cover - none seen
    raise ImportError("sidecar_common.kv_keys needs a 4-byte array('I')")

_U64 = npt.NDArray[np.uint64]


def _mix(x: int) -> int:
    x ^= x >> 33
    x = (x * _MIX_1) & _MASK
    x ^= x >> 33
    x = (x * _MIX_2) & _MASK
    return x ^ (x >> 33)


def _constant(value: int) -> npt.NDArray[np.uint64]:
    # A read-only 0-d array, not a numpy scalar: a ufunc resolves a scalar operand's type on
    # every call, about 0.2 µs more each (the mix below: 7.3 against 5.6 µs for 512 blocks).
    constant = np.array(value, dtype=np.uint64)
    constant.setflags(write=False)
    return constant


_SHIFT_U64: Final = _constant(33)
_MIX_1_U64: Final = _constant(_MIX_1)
_MIX_2_U64: Final = _constant(_MIX_2)


def _mix_array(x: _U64) -> _U64:
    # In place: x is a fresh intermediate of the caller's.
    x ^= x >> _SHIFT_U64
    x *= _MIX_1_U64
    x ^= x >> _SHIFT_U64
    x *= _MIX_2_U64
    x ^= x >> _SHIFT_U64
    return x


@lru_cache(maxsize=32)
def _weights(block_size: int) -> tuple[tuple[int, ...], _U64]:
    weights = tuple(_mix((_WEIGHT_SEED + p) & _MASK) | 1 for p in range(block_size))
    return weights, np.array(weights, dtype=np.uint64)


@lru_cache(maxsize=32)
def _powers(length: int) -> tuple[_U64, _U64]:
    """CHAIN**i and CHAIN**-i for i in 0..length-1 (lengths are powers of two, so few)."""
    chain = np.full(length, _CHAIN, dtype=np.uint64)
    chain[0] = 1
    inverse = np.full(length, _CHAIN_INVERSE, dtype=np.uint64)
    inverse[0] = 1
    return np.cumprod(chain), np.cumprod(inverse)


def _field(value: str | None) -> bytes:
    # Absent and empty are different requests to an engine only if it says so; we keep them
    # apart (a length prefix after a presence byte) so no two inputs encode alike.
    if value is None:
        return b"\x00"
    encoded = value.encode("utf-8")
    return b"\x01" + len(encoded).to_bytes(4, "big") + encoded


@lru_cache(maxsize=1024)  # a fleet's adapters and salts: few, and asked for every request
def root_key(*, lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """The parent key of a sequence's first block, for this LoRA adapter and cache salt.

    An empty salt is no salt: vLLM leaves an empty ``cache_salt`` out of its block hashes.
    """
    digest = hashlib.blake2b(
        _field(lora_name) + _field(cache_salt or None), digest_size=_DIGEST_BYTES, person=_ROOT_PERSON
    ).digest()
    return int.from_bytes(digest, "big")


def _token_view(token_ids: Sequence[int]) -> npt.NDArray[np.uint32]:
    """``token_ids`` as a uint32 array, copied only where it must be.

    A protobuf repeated field (upb) converts through its ``__array__``, a copy of its native
    values (8,192 ids in 4 µs); a list goes through ``array('I')`` (57 µs, the cost of reading
    8,192 Python ints; numpy's own conversion takes 184)."""
    # Native byte order throughout: these are numbers, never hashed as bytes.
    if isinstance(token_ids, array) and token_ids.typecode == _TOKEN_TYPECODE:
        return np.frombuffer(token_ids, dtype=np.uint32)
    if isinstance(token_ids, list | tuple):
        try:
            return np.frombuffer(array(_TOKEN_TYPECODE, token_ids), dtype=np.uint32)
        except OverflowError:
            raise ValueError(f"token ids must be within 0..{_TOKEN_MAX}") from None
    given = np.asarray(token_ids)
    if given.dtype == np.uint32:
        return given
    if given.dtype.kind not in "iu" or (given.size and (given.min() < 0 or given.max() > _TOKEN_MAX)):
        raise ValueError(f"token ids must be within 0..{_TOKEN_MAX}")
    return given.astype(np.uint32)


def _block_values(token_ids: Sequence[int], block_size: int, blocks: int) -> _U64:
    tokens = _token_view(token_ids)[: blocks * block_size]
    # uint32 rows times uint64 weights: numpy's integer product wraps modulo 2**64 like the loop.
    # matmul, not dot: the same integers in about half the time (8,192 tokens: 9 against 17 µs).
    return _mix_array(np.matmul(tokens.reshape(blocks, block_size), _weights(block_size)[1]))


def _chained_keys(parent_key: int, token_ids: Sequence[int], block_size: int, blocks: int) -> list[int]:
    """The block values in an array, the chain in Python: cheaper than either all-array or
    all-Python for a few blocks (a KV event's)."""
    values: list[int] = _block_values(token_ids, block_size, blocks).tolist()
    keys: list[int] = []
    key = parent_key
    for value in values:
        key = (key * _CHAIN + value) & _MASK
        keys.append(key)
    return keys


def _vector_keys(parent_key: int, token_ids: Sequence[int], block_size: int, blocks: int) -> _U64:
    values = _block_values(token_ids, block_size, blocks)  # a fresh array: worked in place
    chain, inverse = _powers(1 << (blocks - 1).bit_length())
    # key[i] = CHAIN**i * (parent * CHAIN + sum(value[j] * CHAIN**-j for j <= i)): the parent's
    # term joins the first value (CHAIN**-0 = 1), so one running sum carries it to every key.
    np.multiply(values, inverse[:blocks], out=values)
    values[0] = (values.item(0) + parent_key * _CHAIN) & _MASK
    np.add.accumulate(values, out=values)  # np.cumsum's dtype handling costs 2 µs more
    np.multiply(values, chain[:blocks], out=values)
    return values


def _loop_keys(parent_key: int, token_ids: Sequence[int], block_size: int, blocks: int) -> list[int]:
    tokens = token_ids[: blocks * block_size]
    if isinstance(tokens, np.ndarray):  # numpy scalars would not widen to 64 bits
        tokens = tokens.tolist()
    if min(tokens) < 0 or max(tokens) > _TOKEN_MAX:
        raise ValueError(f"token ids must be within 0..{_TOKEN_MAX}")
    weights = _weights(block_size)[0]
    mul = operator.mul
    keys: list[int] = []
    key = parent_key
    for start in range(0, blocks * block_size, block_size):
        value = _mix(sum(map(mul, tokens[start : start + block_size], weights)) & _MASK)
        key = (key * _CHAIN + value) & _MASK
        keys.append(key)
    return keys


def _checked_blocks(parent_key: int, token_ids: Sequence[int], block_size: int) -> int:
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    if not 0 <= parent_key <= _MASK:
        raise ValueError(f"parent_key must be an unsigned {KEY_BITS}-bit integer")
    return len(token_ids) // block_size


def _keys_as_list(parent_key: int, token_ids: Sequence[int], block_size: int, blocks: int) -> list[int]:
    if blocks >= _ARRAY_CHAIN_FROM:
        keys: list[int] = _vector_keys(parent_key, token_ids, block_size, blocks).tolist()
        return keys
    if blocks * (block_size + 5) >= _ARRAY_VALUES_FROM:
        return _chained_keys(parent_key, token_ids, block_size, blocks)
    return _loop_keys(parent_key, token_ids, block_size, blocks)


def extend_keys(parent_key: int, token_ids: Sequence[int], block_size: int) -> list[int]:
    """The keys of the full blocks of ``token_ids``, chained on from ``parent_key``.

    ``parent_key`` is the key of the block just before ``token_ids[0]`` (or a
    :func:`root_key`). The keys of a prefix of ``token_ids`` are a prefix of the result.
    """
    blocks = _checked_blocks(parent_key, token_ids, block_size)
    if blocks == 0:
        return []
    return _keys_as_list(parent_key, token_ids, block_size, blocks)


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[int]:
    """The routing keys of the full blocks of a token sequence, first block first."""
    return extend_keys(root_key(lora_name=lora_name, cache_salt=cache_salt), token_ids, block_size)


class KeyChain(Sequence[int]):
    """The keys :func:`block_keys` gives, kept in an array: a key becomes a Python int only when
    it is read. A routing decision reads a few of a prompt's keys (it bisects), so it skips
    making one int per block (512 for 8,192 tokens: 8 µs). A slice is a view."""

    __slots__ = ("_keys", "at")

    def __init__(self, keys: _U64) -> None:
        self._keys = keys
        # The key at an index, as a Python int, without a Python-level call (a bisecting reader
        # takes this rather than indexing).
        self.at: Callable[[int], int] = keys.item

    def __len__(self) -> int:
        return len(self._keys)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> KeyChain: ...

    def __getitem__(self, index: int | slice) -> int | KeyChain:
        if isinstance(index, slice):
            return KeyChain(self._keys[index])
        return int(self._keys[index])

    def __iter__(self) -> Iterator[int]:
        keys: list[int] = self._keys.tolist()
        return iter(keys)

    def __reversed__(self) -> Iterator[int]:
        keys: list[int] = self._keys[::-1].tolist()
        return iter(keys)

    def __repr__(self) -> str:
        return f"KeyChain({self._keys.tolist()!r})"


def block_key_chain(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> KeyChain:
    """:func:`block_keys` as a :class:`KeyChain` (the same keys)."""
    parent = root_key(lora_name=lora_name, cache_salt=cache_salt)
    blocks = _checked_blocks(parent, token_ids, block_size)
    if blocks >= _ARRAY_CHAIN_FROM:
        return KeyChain(_vector_keys(parent, token_ids, block_size, blocks))
    keys = _keys_as_list(parent, token_ids, block_size, blocks) if blocks else []
    return KeyChain(np.array(keys, dtype=np.uint64))
