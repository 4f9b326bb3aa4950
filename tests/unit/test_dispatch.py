"""Private ids, the stream-shape tracker, CANCELLED terminals and the registry."""

from __future__ import annotations

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar_common.api import sidecar_pb2
from sidecar_common.dispatch import (
    PRIVATE_ID_HEAD_LEN,
    CancelCause,
    ChoiceTracker,
    Delivery,
    PrivateIds,
    Registry,
    choice_count,
    make_private_id,
)
from sidecar_common.errors import ErrorReason, SidecarError

Out = sidecar_pb2.LLMEngineOutput


@given(st.lists(st.text(), min_size=2, max_size=30))
def test_private_ids_are_unique_and_prefix_free_whatever_the_public_ids(public_ids: list[str]) -> None:
    gen = PrivateIds()
    ids = [gen.next(p) for p in public_ids]
    assert len(set(ids)) == len(ids)
    for a in ids:
        for b in ids:
            assert a == b or not b.startswith(a)


@given(st.text(), st.integers(0, (1 << 48) - 1))
def test_private_id_shape(public_id: str, counter: int) -> None:
    pid = make_private_id("0123abcd", counter, public_id)
    assert len(pid) <= PRIVATE_ID_HEAD_LEN + 1 + 64
    assert pid[PRIVATE_ID_HEAD_LEN] == "-"
    assert pid.isascii()
    assert not any(c.isspace() for c in pid)


def test_private_id_keeps_a_readable_public_tail() -> None:
    assert make_private_id("0123abcd", 5, "req-1").endswith("000000000005-req-1")
    assert make_private_id("0123abcd", 5, "a/b c").endswith("-a_b_c")


def test_choice_count() -> None:
    req = sidecar_pb2.PreprocessedRequest()
    assert choice_count(req) == 1
    req.sampling_options.n = 3
    assert choice_count(req) == 3


def test_tracker_completes_after_every_terminal() -> None:
    tracker = ChoiceTracker("fake", 2)
    tracker.observe(Out(index=1))
    assert not tracker.saw_token_or_terminal
    tracker.observe(Out(index=1, token_ids=[1], finish_reason=sidecar_pb2.EOS))
    assert tracker.saw_token_or_terminal
    assert not tracker.complete
    tracker.observe(Out(index=0, finish_reason=sidecar_pb2.LENGTH))
    assert tracker.complete


@pytest.mark.parametrize(
    ("chunks", "what"),
    [
        ([Out(index=2)], "choice index 2"),
        ([Out(index=0, finish_reason=sidecar_pb2.EOS), Out(index=0)], "after the terminal"),
    ],
)
def test_tracker_refuses_malformed_streams(chunks: list[Out], what: str) -> None:
    tracker = ChoiceTracker("fake", 2)
    for c in chunks[:-1]:
        tracker.observe(c)
    with pytest.raises(SidecarError) as info:
        tracker.observe(chunks[-1])
    assert info.value.reason is ErrorReason.PROTOCOL_ERROR
    assert what in info.value.message


def test_cancelled_terminals_count_what_was_delivered() -> None:
    delivery = Delivery(n=3)
    delivery.observe(Out(index=0, token_ids=[1, 2]))
    delivery.observe(Out(index=1, token_ids=[5], finish_reason=sidecar_pb2.EOS))
    delivery.observe(Out(index=0, token_ids=[3]))
    terms = delivery.cancelled_terminals(prompt_tokens=4)
    assert [(t.index, t.finish_reason) for t in terms] == [
        (0, sidecar_pb2.CANCELLED),
        (2, sidecar_pb2.CANCELLED),
    ]
    assert terms[0].completion_usage == sidecar_pb2.CompletionUsage(
        prompt_tokens=4, completion_tokens=3, total_tokens=7
    )
    assert terms[1].completion_usage.completion_tokens == 0


async def test_registry_abort_public_cancels_only_that_id() -> None:
    reg = Registry()
    a1, a2, b = reg.register("a"), reg.register("a"), reg.register("b")
    assert reg.inflight == 3
    assert reg.abort_public("a") == 2
    assert reg.abort_public("nobody") == 0
    assert a1.scope.cancel_called
    assert a2.scope.cancel_called
    assert a1.cause is CancelCause.ABORT_RPC
    assert not b.scope.cancel_called
    assert reg.cancel_all() == 3
    # The first cause wins: an aborted request stays "aborted" during a drain.
    assert a1.cause is CancelCause.ABORT_RPC
    assert b.cause is CancelCause.DRAIN


async def test_registry_wait_idle() -> None:
    reg = Registry()
    assert await reg.wait_idle(0.01)
    entry = reg.register("x")
    assert not await reg.wait_idle(0.01)
    async with anyio.create_task_group() as tg:

        async def later() -> None:
            await anyio.sleep(0.01)
            reg.unregister(entry)

        tg.start_soon(later)
        assert await reg.wait_idle(5)
    assert reg.inflight == 0
