"""Routing keys of KV-cache blocks (sidecar_common.kv_keys): the frontend and the sidecar must
compute the same integers from the same token ids, in every process and Python version."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from typing import Final, cast

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar_common import kv_keys
from sidecar_common.api import sidecar_pb2
from sidecar_common.kv_keys import KEY_SCHEME, block_key_chain, block_keys, extend_keys, root_key

TOKEN: Final = st.integers(min_value=0, max_value=2**32 - 1)
TOKENS: Final = st.lists(TOKEN, max_size=200)
BLOCK_SIZES: Final = st.sampled_from([1, 2, 3, 16])
NAMES: Final = st.none() | st.text(max_size=12)

# Pinned: a change of these numbers breaks every frontend and sidecar of a mixed-version fleet
# (they would stop agreeing on keys), so it must be a deliberate change of KEY_SCHEME.
KNOWN_VECTORS: Final = [
    ((list(range(32)), 16, None, None), [7961711506729889092, 16384403228851467164]),
    (
        ([1, 2, 3], 1, None, None),
        [5596390716994570471, 1577230895747052827, 10274657506554174062],
    ),
    ((list(range(16)), 16, "adapter-a", None), [15707320223261826163]),
    ((list(range(16)), 16, None, "s"), [6325485213806262548]),
    # An empty salt is no salt (vLLM leaves it out of its hashes).
    ((list(range(16)), 16, None, ""), [7961711506729889092]),
]


def test_the_scheme_is_layout_2() -> None:
    assert KEY_SCHEME == 2


@pytest.mark.parametrize(("args", "keys"), KNOWN_VECTORS)
def test_known_vectors_are_stable(
    args: tuple[list[int], int, str | None, str | None], keys: list[int]
) -> None:
    tokens, block_size, lora, salt = args
    assert block_keys(tokens, block_size, lora_name=lora, cache_salt=salt) == keys


def _layout_2(tokens: list[int], block_size: int, root: bytes) -> list[int]:
    # The layout written out from the module's docstring, in plain integers, so another
    # implementation (a frontend in another language) can be checked against this one.
    mask = 2**64 - 1

    def mix(x: int) -> int:
        x ^= x >> 33
        x = x * 0xFF51AFD7ED558CCD & mask
        x ^= x >> 33
        x = x * 0xC4CEB9FE1A85EC53 & mask
        return x ^ (x >> 33)

    weights = [mix(0x2545F4914F6CDD1D + p) | 1 for p in range(block_size)]
    key = int.from_bytes(root, "big")
    keys = []
    for start in range(0, len(tokens) // block_size * block_size, block_size):
        block = tokens[start : start + block_size]
        value = mix(sum(t * w for t, w in zip(block, weights, strict=True)) & mask)
        key = (key * 0x9E3779B97F4A7C15 + value) & mask
        keys.append(key)
    return keys


@pytest.mark.parametrize(("length", "block_size"), [(9, 4), (40, 1), (200, 16), (1000, 3)])
def test_the_layout_is_the_documented_one(length: int, block_size: int) -> None:
    # Short and long inputs: the loop and the array paths.
    tokens = [(i * 2654435761) % 2**32 for i in range(length)]
    root = hashlib.blake2b(b"\x00\x00", digest_size=8, person=b"sidecar.kv.root2").digest()
    assert root_key() == int.from_bytes(root, "big")
    assert block_keys(tokens, block_size) == _layout_2(tokens, block_size, root)


@given(
    st.lists(TOKEN, min_size=1, max_size=600),
    st.sampled_from([1, 2, 3, 5, 16, 64]),
    st.integers(min_value=0, max_value=2**64 - 1),
)
def test_the_three_ways_give_the_same_keys(tokens: list[int], block_size: int, parent: int) -> None:
    # All in Python, values in numpy and the chain in Python, all in numpy (by input size).
    blocks = len(tokens) // block_size
    if blocks == 0:
        return
    in_python = kv_keys._loop_keys(parent, tokens, block_size, blocks)
    assert kv_keys._chained_keys(parent, tokens, block_size, blocks) == in_python
    assert kv_keys._vector_keys(parent, tokens, block_size, blocks).tolist() == in_python


@given(
    TOKENS,
    BLOCK_SIZES,
    NAMES,
    st.integers(min_value=-5, max_value=30),
    st.integers(min_value=-5, max_value=30),
)
def test_a_key_chain_reads_as_the_list_of_keys(
    tokens: list[int], block_size: int, salt: str | None, start: int, stop: int
) -> None:
    keys = block_keys(tokens, block_size, cache_salt=salt)
    chain = block_key_chain(tokens, block_size, cache_salt=salt)
    assert len(chain) == len(keys)
    assert list(chain) == keys
    assert list(reversed(chain)) == keys[::-1]
    assert [chain[i] for i in range(-len(keys), len(keys))] == keys[-len(keys) :] + keys
    assert all(type(key) is int for key in chain)
    assert list(chain[start:stop]) == keys[start:stop]
    assert list(chain[start:stop][1:]) == keys[start:stop][1:]
    # What a bisecting reader (BlockIndex.match) calls instead of indexing.
    assert [chain.at(i) for i in range(len(keys))] == keys
    assert all(type(chain.at(i)) is int for i in range(len(keys)))


@pytest.mark.parametrize("length", [20, 300])  # the loop and the array paths
@pytest.mark.parametrize(
    "form",
    [
        tuple,
        lambda ids: array("I", ids),
        lambda ids: array("q", ids),
        lambda ids: np.array(ids, dtype=np.uint32),
        lambda ids: np.array(ids, dtype=np.int64),
        # What the frontend routes from: the request message's repeated field.
        lambda ids: sidecar_pb2.PreprocessedRequest(token_ids=ids).token_ids,
    ],
    ids=["tuple", "array", "array-int64", "numpy-uint32", "numpy-int64", "protobuf"],
)
def test_every_form_of_token_ids_gives_the_keys_of_its_list(
    form: Callable[[list[int]], Sequence[int]], length: int
) -> None:
    tokens = [(i * 2654435761) % 2**32 for i in range(length)]
    assert block_keys(form(tokens), 4) == block_keys(tokens, 4)


@pytest.mark.parametrize("bad", [[-1], [2**32]])
def test_a_numpy_array_outside_32_bits_is_refused(bad: list[int]) -> None:
    with pytest.raises(ValueError, match="token ids"):
        block_keys(cast(Sequence[int], np.array([5] * 299 + bad, dtype=np.int64)), 1)


@pytest.mark.parametrize(
    ("tokens", "block_size", "count"),
    [([], 16, 0), (list(range(15)), 16, 0), (list(range(16)), 16, 1), (list(range(47)), 16, 2), ([7], 1, 1)],
)
def test_only_full_blocks_have_keys(tokens: list[int], block_size: int, count: int) -> None:
    assert len(block_keys(tokens, block_size)) == count


@pytest.mark.parametrize("block_size", [0, -1])
def test_a_block_size_below_one_is_refused(block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_keys([1, 2, 3], block_size)


@pytest.mark.parametrize("token", [-1, 2**32])
@pytest.mark.parametrize("length", [1, 500])
def test_a_token_id_outside_32_bits_is_refused(token: int, length: int) -> None:
    with pytest.raises(ValueError, match="token ids"):
        block_keys([7] * (length - 1) + [token], 1)


@pytest.mark.parametrize("parent", [-1, 2**64])
def test_a_parent_key_outside_64_bits_is_refused(parent: int) -> None:
    with pytest.raises(ValueError, match="parent_key"):
        extend_keys(parent, [1], 1)


@given(TOKENS, BLOCK_SIZES, NAMES, NAMES)
def test_keys_are_unsigned_64_bit(
    tokens: list[int], block_size: int, lora: str | None, salt: str | None
) -> None:
    for key in block_keys(tokens, block_size, lora_name=lora, cache_salt=salt):
        assert 0 <= key < 2**64


@given(TOKENS, st.integers(min_value=0, max_value=80), BLOCK_SIZES, NAMES, NAMES)
def test_keys_of_a_prefix_are_a_prefix_of_the_keys(
    tokens: list[int], cut: int, block_size: int, lora: str | None, salt: str | None
) -> None:
    whole = block_keys(tokens, block_size, lora_name=lora, cache_salt=salt)
    part = block_keys(tokens[:cut], block_size, lora_name=lora, cache_salt=salt)
    assert whole[: len(part)] == part
    assert len(part) == min(cut, len(tokens)) // block_size


@given(TOKENS, TOKENS, BLOCK_SIZES, NAMES, NAMES)
def test_extending_from_a_blocks_key_continues_the_chain(
    head: list[int], tail: list[int], block_size: int, lora: str | None, salt: str | None
) -> None:
    # What the sidecar does with a stored event: its parent's key plus the event's tokens.
    head = head[: len(head) // block_size * block_size]
    whole = block_keys(head + tail, block_size, lora_name=lora, cache_salt=salt)
    head_keys = block_keys(head, block_size, lora_name=lora, cache_salt=salt)
    parent = head_keys[-1] if head_keys else root_key(lora_name=lora, cache_salt=salt)
    assert head_keys + extend_keys(parent, tail, block_size) == whole


@given(st.lists(TOKEN, min_size=1, max_size=40), BLOCK_SIZES, NAMES, NAMES, NAMES, NAMES)
def test_a_different_salt_or_adapter_changes_every_key(
    tokens: list[int],
    block_size: int,
    lora_a: str | None,
    salt_a: str | None,
    lora_b: str | None,
    salt_b: str | None,
) -> None:
    if (lora_a, salt_a or None) == (lora_b, salt_b or None):
        return
    keys_a = block_keys(tokens, block_size, lora_name=lora_a, cache_salt=salt_a)
    keys_b = block_keys(tokens, block_size, lora_name=lora_b, cache_salt=salt_b)
    assert all(a != b for a, b in zip(keys_a, keys_b, strict=True))


@given(TOKENS, TOKENS, BLOCK_SIZES)
def test_a_blocks_key_depends_on_every_token_before_it(
    first: list[int], second: list[int], block_size: int
) -> None:
    keys_first = block_keys(first, block_size)
    keys_second = block_keys(second, block_size)
    for index, (a, b) in enumerate(zip(keys_first, keys_second, strict=False)):
        same_prefix = first[: (index + 1) * block_size] == second[: (index + 1) * block_size]
        assert (a == b) == same_prefix


def test_salt_and_adapter_are_not_interchangeable() -> None:
    assert root_key(lora_name="x") != root_key(cache_salt="x")
    assert root_key(lora_name="") != root_key()
    assert root_key(cache_salt="") == root_key()
    assert root_key(lora_name="a", cache_salt="b") != root_key(lora_name="ab")


def test_a_tuple_and_a_list_give_the_same_keys() -> None:
    assert block_keys(tuple(range(40)), 8) == block_keys(list(range(40)), 8)


@pytest.mark.parametrize(("length", "block_size"), [(300, 1), (2_000, 16), (40, 16), (100, 3)])
def test_a_key_chain_of_any_length_is_the_list_of_keys(length: int, block_size: int) -> None:
    # Long enough for the all-array way (64 blocks and more), and short.
    tokens = [(i * 40503) % 150_000 for i in range(length)]
    for lora, salt in ((None, None), ("adapter", None), (None, "salt"), ("adapter", "salt")):
        chain = block_key_chain(tokens, block_size, lora_name=lora, cache_salt=salt)
        assert list(chain) == block_keys(tokens, block_size, lora_name=lora, cache_salt=salt)


def test_the_largest_token_id_and_the_extreme_parents_are_accepted() -> None:
    top = 2**32 - 1
    assert block_keys(cast(Sequence[int], np.array([top] * 300, dtype=np.int64)), 1) == block_keys(
        [top] * 300, 1
    )
    for parent in (0, 2**64 - 1):
        assert len(extend_keys(parent, [1] * 32, 16)) == 2
