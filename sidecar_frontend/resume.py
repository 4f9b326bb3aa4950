"""Resume on request (issue 28): what a client opts into, and how an aborted leg's answer is
handed on (pure).

A trainer that pauses its engines in ``abort`` mode (or updates their weights with every
request aborted) gets each aborted generation back with the tokens made so far, and would
resubmit prompt + those tokens with the budget reduced. With ``X-Resume-On-Abort: true`` (or
the frontend's ``--resume-on-abort``), the frontend does that itself, token-exactly: a
generation its engine aborted on its own continues from what it delivered, budget deducted, on
a worker that takes new requests (waiting while the fleet is paused), and the client sees one
answer. At most :data:`RESUME_LIMIT` times per generation; past that the abort reaches the
client as the engine gave it.
"""

from __future__ import annotations

import itertools
from typing import Final

from sidecar_common.api import sidecar_pb2

__all__ = ["RESUME_HEADER", "RESUME_LIMIT", "by_span", "resume_wanted"]

RESUME_HEADER: Final = "X-Resume-On-Abort"
# A trainer pausing every few seconds aborts a long generation many times; an engine that aborts
# it every time it runs would loop for ever.
RESUME_LIMIT: Final = 64

_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"0", "false", "no", "off"})


def resume_wanted(value: str | None, default: bool) -> bool | str:
    """The header's value read (None: absent, the frontend's default), or why it is refused."""
    if value is None:
        return default
    word = value.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    return f"{RESUME_HEADER} must be true or false, not {value[:40]!r}"


_PER_TOKEN: Final = ("token_ids", "log_probs", "top_logprobs", "token_ids_logprobs")


def by_span(partial: sidecar_pb2.LLMEngineOutput) -> list[sidecar_pb2.LLMEngineOutput]:
    """An aborted leg's tokens as outputs, one per weight version that made them, each labelled
    with its version, when the leg's whole output is this one output (a non-streaming answer,
    whose spans tile exactly its tokens) and carries no text; else ``[partial]``. The spans
    themselves (a terminal's field) are dropped: the client's spans are joined over every leg."""
    count = len(partial.token_ids)
    spans = list(partial.weight_versions)
    plain = sidecar_pb2.LLMEngineOutput()
    plain.CopyFrom(partial)
    plain.ClearField("weight_versions")
    plain.ClearField("routed_experts")
    tiles = bool(spans) and spans[0].start == 0 and spans[-1].end == count
    tiles = tiles and all(a.end == b.start for a, b in itertools.pairwise(spans))
    if not tiles or partial.text or len(spans) < 2:
        if tiles and spans:
            plain.weight_version = spans[-1].version
        return [plain]
    pieces = []
    for span in spans:
        piece = sidecar_pb2.LLMEngineOutput()
        piece.CopyFrom(plain)
        for name in _PER_TOKEN:
            values = list(getattr(plain, name))
            field = getattr(piece, name)
            del field[:]
            if values:
                field.extend(values[span.start : span.end])
        piece.weight_version = span.version
        if span.end > span.start:
            pieces.append(piece)
    return pieces
