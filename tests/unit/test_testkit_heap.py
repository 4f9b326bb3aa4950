"""The stand-in engines freeze what start-up built once they serve (testkit/heap.py)."""

from __future__ import annotations

import gc
import weakref

from testkit.heap import freeze_startup_heap


class _Node:
    other: _Node | None = None


def test_what_is_alive_at_start_up_leaves_the_collectors_passes() -> None:
    survivor = [object() for _ in range(100)]
    before = gc.get_freeze_count()
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() >= before + len(survivor)
        # A cycle made later is still collected.
        node = _Node()
        node.other = node
        gone = weakref.ref(node)
        del node
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()
