"""Per-request fault plans for the testkit engines.

A plan is chosen either in-process (``FaultBook.add``: requests whose id *contains* the match
string; the sidecar's private ids end with "-<public id>", so a test chooses by public id) or
out-of-process by a directive inside the request id itself::

    fault=<kind>[:<arg>][:<arg>]

Numeric arguments are the token count ``k`` (seconds for ``stall_first_token``); a textual
argument is the variant (``malformed_terminal``) or the status code name (``error_after``).
Examples: ``r1.fault=close_after:3``, ``r2.fault=error_after:2:RESOURCE_EXHAUSTED``,
``r3.fault=malformed_terminal:negative_id``, ``r4.fault=hang``, ``r5.fault=stall_first_token:0.5``,
``r6.fault=hold_after_terminal``, ``r7.fault=engine_dies:5``.

Two plans fault the engine's KV-event publisher instead of the request's stream (the request
itself runs normally): ``drop_kv_batch`` (the next batch published is numbered and kept for
replay but not sent on the PUB socket: a gap) and ``restart_kv_publisher`` (before the request
runs, the engine's prefix cache is lost and its publisher restarts: a sequence reset).

Engines also take ``--fault MATCH=DIRECTIVE`` at start-up (see ``parse_fault_flag``).
"""

from __future__ import annotations

import asyncio
import enum
import re
from dataclasses import dataclass, field

__all__ = [
    "KV_EVENT_FAULTS",
    "MALFORMED_VARIANTS",
    "FaultBook",
    "FaultKind",
    "FaultPlan",
    "parse_directive",
    "parse_fault_flag",
    "plan_from_request_id",
]


class FaultKind(enum.Enum):
    FAIL_OPEN = "fail_open"  # status UNAVAILABLE before any message
    CLOSE_AFTER = "close_after"  # k tokens, then EOF with no terminal
    ERROR_AFTER = "error_after"  # k tokens, then a status (default INTERNAL)
    HANG = "hang"  # k tokens, then nothing, the stream stays open
    MALFORMED_TERMINAL = "malformed_terminal"  # a terminal that breaks the wire's rules
    REPEAT_AFTER_TERMINAL = "repeat_after_terminal"  # the first message again after the terminal
    STALL_FIRST_TOKEN = "stall_first_token"  # wait `stall_secs` before the first token
    # Every terminal sent, then the stream stays open (no end of stream, no [DONE]) until
    # the client leaves or the engine stops: the window between a finished request and its
    # closed stream, held open.
    HOLD_AFTER_TERMINAL = "hold_after_terminal"
    # k tokens, then the engine dies inside its live server, as the real ones do: vLLM's engine
    # core dies (every stream ends INTERNAL, HealthCheck answers not healthy from then on,
    # the server stays up); SGLang's scheduler dies (every stream stalls, then the server
    # process kills itself: its connections go away).
    ENGINE_DIES = "engine_dies"
    # The engine's KV-event publisher (see the module doc); the request runs normally.
    DROP_KV_BATCH = "drop_kv_batch"
    RESTART_KV_PUBLISHER = "restart_kv_publisher"


# Plans that act on the engine's KV events, not on the request's stream.
KV_EVENT_FAULTS = frozenset({FaultKind.DROP_KV_BATCH, FaultKind.RESTART_KV_PUBLISHER})


MALFORMED_VARIANTS = frozenset(
    {"missing_finish_reason", "unknown_finish_reason", "count_mismatch", "negative_id"}
)


@dataclass(frozen=True)
class FaultPlan:
    kind: FaultKind
    after: int = 0
    code: str = "INTERNAL"
    message: str = ""
    variant: str = "missing_finish_reason"
    stall_secs: float = 1.0
    # In-process tests only: a stall also ends as soon as this is set (a test that needs every
    # request held until all have arrived releases them then, instead of guessing a time).
    release: asyncio.Event | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.after < 0:
            raise ValueError("fault token count must be >= 0")
        if self.kind is FaultKind.MALFORMED_TERMINAL and self.variant not in MALFORMED_VARIANTS:
            raise ValueError(f"unknown malformed_terminal variant {self.variant!r}")
        if self.stall_secs < 0:
            raise ValueError("stall seconds must be >= 0")

    async def stall(self, aborted: asyncio.Event, secs: float) -> None:
        """Wait ``secs`` or until ``aborted`` (or :attr:`release`) is set, whichever is first."""
        events = [aborted] if self.release is None else [aborted, self.release]
        waits = [asyncio.ensure_future(event.wait()) for event in events]
        try:
            await asyncio.wait(waits, timeout=secs, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    @property
    def error_message(self) -> str:
        return self.message or f"testkit fault: error after {self.after} tokens"


_DIRECTIVE = re.compile(r"fault=([a-z_]+)((?::[A-Za-z0-9_.]+)*)")


def parse_directive(text: str) -> FaultPlan:
    """``<kind>[:<arg>]...`` (without the ``fault=`` prefix) → a plan; ValueError if invalid."""
    kind_name, *args = text.split(":")
    try:
        kind = FaultKind(kind_name)
    except ValueError:
        raise ValueError(f"unknown fault kind {kind_name!r}") from None
    number: float | None = None
    word: str | None = None
    for arg in args:
        try:
            number = float(arg)
        except ValueError:
            word = arg
    kwargs: dict[str, object] = {}
    if number is not None:
        if kind is FaultKind.STALL_FIRST_TOKEN:
            kwargs["stall_secs"] = number
        else:
            if number != int(number):
                raise ValueError(f"fault token count must be an integer, got {number}")
            kwargs["after"] = int(number)
    if word is not None:
        if kind is FaultKind.MALFORMED_TERMINAL:
            kwargs["variant"] = word
        elif kind is FaultKind.ERROR_AFTER:
            kwargs["code"] = word.upper()
        else:
            raise ValueError(f"fault {kind_name} takes no word argument ({word!r})")
    return FaultPlan(kind, **kwargs)  # type: ignore[arg-type]


def plan_from_request_id(request_id: str) -> FaultPlan | None:
    """The plan a ``fault=...`` directive inside the id asks for; a bad directive is ignored."""
    m = _DIRECTIVE.search(request_id)
    if m is None:
        return None
    try:
        return parse_directive(m.group(1) + m.group(2))
    except ValueError:
        return None


def parse_fault_flag(flag: str) -> tuple[str, FaultPlan]:
    """``MATCH=DIRECTIVE`` (a start-up flag) → (match, plan)."""
    match, sep, directive = flag.partition("=")
    if not sep or not match:
        raise ValueError(f"expected MATCH=KIND[:ARG]..., got {flag!r}")
    return match, parse_directive(directive)


@dataclass
class _Entry:
    match: str
    plan: FaultPlan
    remaining: int | None


@dataclass
class FaultBook:
    """Faults the tests install; ``plan_for`` consumes one use of the first matching entry."""

    _entries: list[_Entry] = field(default_factory=list)

    def add(self, match: str, plan: FaultPlan, times: int | None = None) -> None:
        if not match:
            raise ValueError("an empty match would fault every request")
        if times is not None and times < 1:
            raise ValueError("times must be >= 1 (None for every matching request)")
        self._entries.append(_Entry(match, plan, times))

    def clear(self) -> None:
        self._entries.clear()

    def plan_for(self, request_id: str) -> FaultPlan | None:
        for entry in self._entries:
            if entry.match in request_id:
                if entry.remaining is not None:
                    entry.remaining -= 1
                    if entry.remaining == 0:
                        self._entries.remove(entry)
                return entry.plan
        return plan_from_request_id(request_id)
