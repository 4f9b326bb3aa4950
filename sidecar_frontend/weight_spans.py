"""Which weights made which output tokens, across the legs of one generation (pure).

A worker says it two ways (docs/metadata.md): each output carries the version it was labelled
with (``LLMEngineOutput.weight_version``, SGLang's ``meta_info.weight_version``), and a terminal
carries ``weight_versions``, spans ``[start, end)`` over the whole output of its request, each
labelled by the weights that made those tokens. A generation that moved to another worker
(``migration``) ran in legs, and only its last leg ended with a terminal: the legs before it
are known by the labels of the outputs they delivered. :class:`SpanJoiner` joins them into
spans over the client's whole output, the last leg's shifted by the tokens delivered before
it, adjacent spans of the same version merged (as SGLang's own
``compute_weight_version_spans`` merges them, ``sglang/srt/utils/weight_versions.py``).

No I/O, no clock: fed the outputs the client was given, in order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sidecar_common.api import sidecar_pb2

__all__ = ["Span", "SpanJoiner", "merged", "shifted", "spans_of"]


@dataclass(frozen=True)
class Span:
    """Output tokens ``[start, end)`` were made by weights labelled ``version``."""

    version: str
    start: int
    end: int


def merged(spans: Iterable[Span]) -> list[Span]:
    """``spans`` (in order, each starting where the one before ended) with empty ones dropped
    and adjacent ones of the same version joined."""
    out: list[Span] = []
    for span in spans:
        if span.end <= span.start:
            continue
        if out and out[-1].version == span.version and out[-1].end == span.start:
            out[-1] = Span(span.version, out[-1].start, span.end)
        else:
            out.append(span)
    return out


def shifted(spans: Iterable[Span], by: int) -> list[Span]:
    return [Span(s.version, s.start + by, s.end + by) for s in spans]


def spans_of(output: sidecar_pb2.LLMEngineOutput) -> list[Span]:
    return [Span(s.version, s.start, s.end) for s in output.weight_versions]


class SpanJoiner:
    """The labels of every token delivered so far, and the spans a later leg's terminal must
    answer with. Tokens delivered without a label make the spans over them unknown: a join
    that needs them answers none rather than inexact ones."""

    def __init__(self) -> None:
        self._labels: list[Span] = []
        self._delivered = 0
        # The first position delivered without a label (None: every one had one).
        self._unlabelled_from: int | None = None

    @property
    def delivered(self) -> int:
        return self._delivered

    def add(self, output: sidecar_pb2.LLMEngineOutput) -> None:
        """An output the client was given (already rewritten for the client's positions)."""
        count = len(output.token_ids)
        if count and not output.HasField("weight_version"):
            if self._unlabelled_from is None:
                self._unlabelled_from = self._delivered
        elif count:
            span = Span(output.weight_version, self._delivered, self._delivered + count)
            self._labels = merged([*self._labels, span])
        self._delivered += count

    def labels(self) -> Sequence[Span]:
        """Spans over the tokens delivered so far, by their outputs' labels."""
        return tuple(self._labels)

    def join(self, before: Sequence[Span], leg: Sequence[Span], leg_start: int) -> list[Span] | None:
        """The spans over the whole output: ``before`` (the tokens ``[0, leg_start)``, by their
        labels) then the last leg's own spans shifted by ``leg_start``. None when they cannot
        be exact (an output before the leg had no label, or the leg's terminal has no spans)."""
        if not leg or (self._unlabelled_from is not None and self._unlabelled_from < leg_start):
            return None
        joined = merged([*before, *shifted(leg, leg_start)])
        if not joined:
            # No output token at all: the leg's one empty span, as the engine wrote it.
            return list(shifted(leg, leg_start))
        return joined
