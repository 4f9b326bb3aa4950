"""Which weights produced which output tokens: the engines' weight-version spans (pure).

Both engines label a request's output tokens with the version of the weights that sampled
them, as contiguous spans ``{version, start, end}`` over output-token indexes (``end``
exclusive), reported on a request's final output only. They build the spans two ways, and
each testkit engine builds them as its real engine does:

* SGLang 0.5.23 (``sglang/srt/utils/weight_versions.py``, ``managers/scheduler.py``
  ``record_weight_version_change``): when the scheduler's version changes, every live request
  that has output records a :class:`VersionChange` (the version being left, and how many
  tokens it had); at the end :func:`sglang_spans` turns the changes plus the version then in
  force into spans, and :func:`sglang_meta` is what the tokenizer manager writes into
  ``meta_info`` (``weight_versions``, and ``weight_version`` set to the last span's).
* vLLM 0.34.0 (``vllm/v1/engine/output_processor.py``): every engine step's output carries
  the engine's version; a request starts a span when a step that brought it tokens carries a
  version other than its last one (:func:`vllm_track`), and its final output reports
  :func:`vllm_spans`.

Either way a span's version is the one in force when its tokens were produced:
:func:`spans_of_labels` (run-length encoding of per-token labels) is the law both obey.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "DEFAULT_WEIGHT_VERSION",
    "EngineVersions",
    "VersionChange",
    "WeightVersionSpan",
    "sglang_meta",
    "sglang_spans",
    "spans_of_labels",
    "vllm_spans",
    "vllm_track",
]

# Both engines' version before any update (SGLang's --weight-version default, vLLM's
# EngineCore).
DEFAULT_WEIGHT_VERSION = "default"


@dataclass(frozen=True)
class WeightVersionSpan:
    """Output tokens ``[start, end)`` were sampled by the weights labelled ``version``."""

    version: str
    start: int
    end: int

    def as_json(self) -> dict[str, object]:
        return {"version": self.version, "start": self.start, "end": self.end}


@dataclass(frozen=True)
class VersionChange:
    """SGLang's record on a live request when the version changes: ``old_version`` produced
    its first ``tokens`` output tokens."""

    old_version: str
    tokens: int


@dataclass
class EngineVersions:
    """An SGLang engine's two views of its version. ``current`` is the scheduler's (it labels
    the tokens); ``reported`` is the tokenizer manager's (``meta_info.weight_version`` of
    unfinished outputs, ``/model_info``). They differ only after a weight update whose cache
    flush failed: the scheduler took the new version, the tokenizer manager did not."""

    current: str = DEFAULT_WEIGHT_VERSION
    reported: str = DEFAULT_WEIGHT_VERSION


def spans_of_labels(labels: Sequence[str]) -> list[WeightVersionSpan]:
    """The spans of per-token version labels: one per run of equal labels."""
    spans: list[WeightVersionSpan] = []
    for i, label in enumerate(labels):
        if spans and spans[-1].version == label:
            spans[-1] = WeightVersionSpan(label, spans[-1].start, i + 1)
        else:
            spans.append(WeightVersionSpan(label, i, i + 1))
    return spans


def sglang_spans(changes: Sequence[VersionChange], current: str, tokens: int) -> list[WeightVersionSpan]:
    """SGLang's ``compute_weight_version_spans``: the changes in order, then ``current`` up to
    ``tokens``; a change at or before the previous span's end adds nothing, consecutive equal
    versions merge. With no tokens it is one empty span of ``current``."""
    spans: list[WeightVersionSpan] = []
    for version, at in [*((c.old_version, c.tokens) for c in changes), (current, tokens)]:
        end = min(at, tokens)
        if spans and end <= spans[-1].end:
            continue
        if spans and spans[-1].version == version:
            spans[-1] = WeightVersionSpan(version, spans[-1].start, end)
            continue
        spans.append(WeightVersionSpan(version, spans[-1].end if spans else 0, end))
    return spans


def sglang_meta(spans: Sequence[WeightVersionSpan], tokens: int) -> tuple[list[dict[str, object]], str]:
    """SGLang's ``add_weight_versions_to_meta_info``: the spans a final output reports (those
    starting before ``tokens``, and the first), each ``end`` capped at ``tokens``, and the
    version ``meta_info.weight_version`` then says (the last of them)."""
    visible = [s for s in spans if s.start < tokens or s.start == 0]
    shown = [WeightVersionSpan(s.version, s.start, min(s.end, tokens)).as_json() for s in visible]
    return shown, visible[-1].version


def vllm_track(
    starts: Sequence[tuple[str, int]], version: str, tokens_before: int
) -> tuple[tuple[str, int], ...]:
    """vLLM's ``track_weight_version``: a step that brought a request tokens under ``version``
    starts a span at ``tokens_before`` (its output length before the step) unless its last
    span already has that version."""
    if starts and starts[-1][0] == version:
        return tuple(starts)
    return (*starts, (version, tokens_before))


def vllm_spans(starts: Sequence[tuple[str, int]], tokens: int) -> list[WeightVersionSpan] | None:
    """vLLM's ``_weight_version_spans`` for a final output of ``tokens`` tokens: each start
    runs to the next (the last to ``tokens``); None when tokens came with no version."""
    if not starts and tokens:
        return None
    ends = [start for _, start in starts[1:]] + [tokens]
    return [WeightVersionSpan(v, s, e) for (v, s), e in zip(starts, ends, strict=False)]
