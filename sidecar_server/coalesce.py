"""Merging stream chunks into fewer, fuller messages (pure).

One gRPC message costs the same CPU whatever it carries (docs/architecture.md, "The hot path"), so the
relay sends whatever the engine produced while the frontend was busy as one message per
choice. Merging must never change what a frontend reconstructs from the stream: the same
tokens, logprobs and text in the same order, and the same single terminal per choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Literal

from sidecar_common.api import sidecar_pb2

__all__ = ["coalesce", "merge_outputs"]

_Submessage = Literal["completion_usage", "disaggregated_params", "engine_data", "bootstrap_info"]
_LAST_SET: Final[tuple[_Submessage, ...]] = (
    "completion_usage",
    "disaggregated_params",
    "engine_data",
    "bootstrap_info",
)


def merge_outputs(outputs: Sequence[sidecar_pb2.LLMEngineOutput]) -> sidecar_pb2.LLMEngineOutput:
    """Merge consecutive chunks of one choice; only the last may be that choice's terminal.

    Raises ValueError on an empty sequence, mixed choices or a terminal before the end:
    those are caller bugs (use :func:`coalesce`, which never produces them).
    """
    if not outputs:
        raise ValueError("merge_outputs needs at least one chunk")
    if len(outputs) == 1:
        return outputs[0]
    index = outputs[0].index
    last = outputs[-1]
    merged = sidecar_pb2.LLMEngineOutput()
    # MergeFrom (one C call per part) already gives what a merge needs for most fields:
    # repeated token_ids / log_probs / top_logprobs concatenated in order, the last set
    # cum_log_probs (cumulative: the latest figure includes every earlier one), the index,
    # and the terminal's finish_reason (only the last part may set it). The few fields
    # where it differs are fixed below, and only when some part set them.
    for part in outputs:
        if part.index != index:
            raise ValueError("merge_outputs got chunks of different choices")
        if part is not last and part.finish_reason != sidecar_pb2.UNSPECIFIED:
            raise ValueError("only the last chunk of a merge may be terminal")
        merged.MergeFrom(part)
    if merged.HasField("text"):
        # Text is a delta like the tokens: concatenated, where MergeFrom keeps the last.
        merged.text = "".join(part.text for part in outputs if part.HasField("text"))
    for name in _LAST_SET:
        if merged.HasField(name):
            # Engines only put these on the terminal; keeping the last one set (rather than
            # strictly the terminal's, and rather than MergeFrom's field-wise blend) means
            # a misplaced value is never silently dropped nor mixed with another.
            getattr(merged, name).CopyFrom(
                getattr(next(p for p in reversed(outputs) if p.HasField(name)), name)
            )
    if merged.prompt_logprobs:
        # Sent once per choice, not a delta: like the fields above, the last list set is kept
        # whole (MergeFrom would concatenate two).
        carriers = [part for part in outputs if part.prompt_logprobs]
        if len(carriers) > 1:
            del merged.prompt_logprobs[:]
            merged.prompt_logprobs.extend(carriers[-1].prompt_logprobs)
    if last.WhichOneof("stop_reason") is None:
        # Why the choice stopped is the terminal's alone (the last part set it if it has one).
        merged.ClearField("stop_reason")
    return merged


def coalesce(outputs: Sequence[sidecar_pb2.LLMEngineOutput]) -> list[sidecar_pb2.LLMEngineOutput]:
    """Group a batch by choice (first-appearance order) and merge each choice's run.

    Order within a choice is kept. A chunk that follows a terminal of the same choice starts a
    new run instead of being merged into the terminal (the relay never buffers one: the
    tracker refuses it first; kept so that this function alone never hides one).
    """
    if len(outputs) <= 1:
        return list(outputs)
    runs: list[list[sidecar_pb2.LLMEngineOutput]] = []
    open_run: dict[int, list[sidecar_pb2.LLMEngineOutput]] = {}
    for out in outputs:
        run = open_run.get(out.index)
        if run is None:
            run = []
            runs.append(run)
            open_run[out.index] = run
        run.append(out)
        if out.finish_reason != sidecar_pb2.UNSPECIFIED:
            del open_run[out.index]
    return [merge_outputs(run) for run in runs]
