"""Helpers of the discovery tests: a sink that records what discovery told it, and lets a
test wait (bounded, on events) until a condition over those calls holds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import anyio

from tests.e2e_helpers import WAIT

__all__ = ["RecordingSink"]

Call = tuple[str, str, str]  # ("add", address, role) or ("drain", address, "")


@dataclass
class RecordingSink:
    """Behaves like the worker set's sink: add is idempotent, a drained worker stays (and an
    add of it is ignored) until :meth:`forget` — as the worker set does while it drains."""

    calls: list[Call] = field(default_factory=list)
    roles: dict[str, str] = field(default_factory=dict)
    draining: set[str] = field(default_factory=set)
    _changed: anyio.Event = field(default_factory=anyio.Event)

    def add_worker(self, address: str, role: str = "agg") -> None:
        self.calls.append(("add", address, role))
        if address not in self.roles:
            self.roles[address] = role
        self._poke()

    def drain_worker(self, address: str) -> None:
        self.calls.append(("drain", address, ""))
        if address in self.roles:
            self.draining.add(address)
        self._poke()

    def addresses(self) -> frozenset[str]:
        return frozenset(self.roles)

    def next_change(self) -> anyio.Event:
        return self._changed

    def serving(self) -> dict[str, str]:
        """Addresses taking new work, with their role."""
        return {a: r for a, r in self.roles.items() if a not in self.draining}

    def forget(self, address: str) -> None:
        """What the worker set does once a drained worker is idle."""
        self.roles.pop(address, None)
        self.draining.discard(address)
        self._poke()

    def _poke(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_for(
        self, condition: Callable[[RecordingSink], bool], what: str, secs: float = WAIT
    ) -> None:
        with anyio.move_on_after(secs):
            while not condition(self):
                await self._changed.wait()
        assert condition(self), f"not reached within {secs}s: {what}; calls so far: {self.calls}"
