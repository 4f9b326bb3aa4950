"""The testkit engines' scheduler: paused admission (a paused scheduler admits nothing),
retraction (a running request back to the queue), and the SGLang scheduler's check of a
routed-experts start."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from testkit.book import Book, Outcome
from testkit.sglang_checks import scheduler_refusal
from testkit.sglang_core import NativeRequest
from testkit.sglang_info import SglangEngineConfig


async def test_a_paused_book_admits_nothing_until_it_resumes() -> None:
    book = Book(max_running=2)
    book.pause_admission()
    first = asyncio.ensure_future(book.admit("a"))
    second = asyncio.ensure_future(book.admit("b"))
    await asyncio.sleep(0)  # let both reach the queue
    assert (book.running_ids(), book.waiting_ids()) == ([], ["a", "b"])
    book.release("nothing", Outcome.FINISHED)  # a release promotes nobody while paused
    assert book.waiting_ids() == ["a", "b"]
    book.resume_admission()
    assert await first
    assert await second
    assert book.running_ids() == ["a", "b"]


async def test_a_retracted_request_queues_behind_the_waiting_ones_with_its_tokens() -> None:
    book = Book(max_running=1)
    assert await book.admit("run", 10)
    book.set_tokens("run", 14)
    book.pause_admission()
    waiting = asyncio.ensure_future(book.admit("wait", 3))
    await asyncio.sleep(0)
    again = book.retract("run")
    assert (book.running_ids(), book.waiting_ids()) == ([], ["wait", "run"])
    book.resume_admission()
    assert await waiting
    assert not again.done()  # one slot: it runs after the request queued before it
    book.release("wait", Outcome.FINISHED)
    assert await again
    assert book.held_tokens("run") == 14


async def test_a_retracted_request_aborted_while_queued_is_told_so() -> None:
    book = Book()
    assert await book.admit("r")
    book.pause_admission()
    again = book.retract("r")
    assert book.abort_waiting("r")
    assert await again is False
    assert not book.is_live("r")


@pytest.mark.parametrize(
    ("start", "refusal"),
    [
        (0, None),
        (4, None),  # the whole prompt may be skipped
        (
            5,
            "recv_req.routed_experts_start_len=5 is higher than the number of input tokens "
            "len(req.origin_input_ids)=4. Please use a smaller routed_experts_start_len.",
        ),
        (
            -1,
            "recv_req.routed_experts_start_len=-1 is lower than 0. "
            "Please use a non-negative routed_experts_start_len.",
        ),
    ],
)
def test_the_routed_experts_start_is_checked_by_the_scheduler(start: int, refusal: str | None) -> None:
    req = NativeRequest(
        rid="r",
        input_ids=(101, 102, 103, 104),
        wire="http",
        return_routed_experts=True,
        routed_experts_start_len=start,
    )
    assert scheduler_refusal(SglangEngineConfig(), req) == refusal
    # Not asked for: not checked.
    assert scheduler_refusal(SglangEngineConfig(), replace(req, return_routed_experts=False)) is None
