"""What a stand-in engine does with its heap once it serves, as a real engine's server does.

vLLM's and SGLang's servers freeze what start-up built (``gc.freeze()`` after loading) so that
the cyclic collector's full passes do not walk it again and again; a stand-in that did not paid
a full pass over some 50,000 start-up objects every so often under load (16-32 ms in
``bench.overload``, every stream on the engine held up meanwhile), which a client then measured
as the frontend's latency.
"""

from __future__ import annotations

import gc

__all__ = ["freeze_startup_heap"]


def freeze_startup_heap() -> None:
    """Collect what start-up left behind, then keep everything alive now out of later passes."""
    gc.collect()
    gc.freeze()
