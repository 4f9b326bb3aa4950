"""How long the testkit engines' decode steps take: pure arithmetic, no clocks or I/O.

A GPU engine decodes every running request in one step. While decoding is memory-bound (the
usual regime at moderate batch sizes), a step costs roughly a fixed part (reading the model's
weights once, whatever the batch) plus a part per running request (reading that request's KV
cache and its share of the activations). So a step's time grows about linearly with the
running batch, and every request in the batch waits that whole step for its next token: the
more requests run, the slower each one streams. This module models exactly that line, nothing
more (no compute-bound knee, no dependence on sequence length); the slope is a flag because
the real one depends on the model and the GPU.
"""

from __future__ import annotations

__all__ = ["decode_step_secs"]


def decode_step_secs(token_latency_ms: float, slope_ms: float, running: int) -> float:
    """One decode step's time, in seconds, with ``running`` requests in the batch.

    ``token_latency_ms`` is the step's time for a batch of one (the engines'
    ``--token-latency-ms``); each running request beyond the first adds ``slope_ms``
    (``--token-latency-slope-ms``). A batch of one or fewer (a request is always in its own
    step, so fewer is only a caller's edge) costs the base; a slope of 0 gives the base at
    every batch size, which is how the engines paced every step before the slope existed.
    The engines' configs refuse a negative slope; nothing here checks it.
    """
    return (token_latency_ms + slope_ms * max(0, running - 1)) / 1000.0
