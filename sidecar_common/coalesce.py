"""Merging stream chunks into fewer, fuller messages (pure).

One gRPC message costs the same CPU whatever it carries (DESIGN.md, "The hot path"), so the
relay sends whatever the engine produced while the frontend was busy as one message per
choice. Merging must never change what a frontend reconstructs from the stream: the same
tokens, logprobs and text in the same order, and the same single terminal per choice.
"""

from __future__ import annotations

from collections.abc import Sequence

from sidecar_common.api import sidecar_pb2

__all__ = ["coalesce", "merge_outputs"]


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
    for part in outputs[:-1]:
        if part.finish_reason != sidecar_pb2.UNSPECIFIED:
            raise ValueError("only the last chunk of a merge may be terminal")
    merged = sidecar_pb2.LLMEngineOutput(index=index)
    has_text = False
    texts: list[str] = []
    for part in outputs:
        if part.index != index:
            raise ValueError("merge_outputs got chunks of different choices")
        merged.token_ids.extend(part.token_ids)
        merged.log_probs.extend(part.log_probs)
        merged.top_logprobs.extend(part.top_logprobs)
        if part.HasField("text"):
            has_text = True
            texts.append(part.text)
        if part.HasField("cum_log_probs"):
            # Cumulative: the latest figure already includes every earlier one.
            merged.cum_log_probs = part.cum_log_probs
        # Engines only put these on the terminal; keeping the last one set (rather than
        # strictly the terminal's) means a misplaced value is never silently dropped.
        if part.HasField("completion_usage"):
            merged.completion_usage.CopyFrom(part.completion_usage)
        if part.HasField("disaggregated_params"):
            merged.disaggregated_params.CopyFrom(part.disaggregated_params)
        if part.HasField("engine_data"):
            merged.engine_data.CopyFrom(part.engine_data)
    if has_text:
        merged.text = "".join(texts)
    last = outputs[-1]
    merged.finish_reason = last.finish_reason
    which = last.WhichOneof("stop_reason")
    if which == "stop_token_id":
        merged.stop_token_id = last.stop_token_id
    elif which == "stop_string":
        merged.stop_string = last.stop_string
    return merged


def coalesce(outputs: Sequence[sidecar_pb2.LLMEngineOutput]) -> list[sidecar_pb2.LLMEngineOutput]:
    """Group a batch by choice (first-appearance order) and merge each choice's run.

    Order within a choice is kept. A chunk that follows a terminal of the same choice (a
    malformed stream) starts a new run instead of being merged into the terminal, so the
    caller's stream checks still see it.
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
