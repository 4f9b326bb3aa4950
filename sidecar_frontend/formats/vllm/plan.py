"""A vLLM ``/inference/v1/generate`` body the checks passed -> one ``sidecar.v1`` sub-request (pure).

The last stage of :func:`~sidecar_frontend.formats.vllm.validate.validate`. Explicit keys are
tracked: a sampling parameter the caller did not send stays absent on the
``PreprocessedRequest`` (its proto3 ``optional`` field is not set), so the engine applies its
own default, exactly as vLLM distinguishes "the client said 16" from "the client said
nothing". A value that does not fit its field on the ``sidecar.v1`` wire is refused by name
as it is written (:func:`~sidecar_frontend.formats.vllm.errors.uncarried`). A non-streaming
request asks the worker for one answer (``OutputOptions.unary``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, cast

from sidecar_common.api import sidecar_pb2
from sidecar_common.structs import JSON, StructError, struct_from_json
from sidecar_frontend.formats.base import FormatContext, GenerateCall
from sidecar_frontend.formats.vllm.checks import header
from sidecar_frontend.formats.vllm.errors import REFUSED_BEFORE_STREAM, uncarried
from sidecar_frontend.formats.vllm.model import GenerateRequest

__all__ = ["REQUEST_ID_PREFIX", "ChoiceEnd", "VllmOptions", "plan"]

REQUEST_ID_PREFIX: Final = "generate-tokens-"
_INT32: Final = (-(2**31), 2**31 - 1)


@dataclass(frozen=True)
class ChoiceEnd:
    """When a choice can end on the tokens it has, from the request alone (no I/O).

    The engine ends a choice on a stop token (the caller's ``stop_token_ids``, and EOS unless
    ``ignore_eos``) once ``min_tokens`` are out, or when it reaches ``max_tokens`` or the
    context. A streamed chunk that can be the last is held until the next output says whether
    it was (vLLM puts ``finish_reason`` on the chunk with the last tokens); any other chunk is
    written at once. ``None``: that limit is unknown.
    """

    stop_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    max_tokens: int | None = None
    # The context left after the prompt.
    room: int | None = None

    def may_end(self, generated: int, last_token: int) -> bool:
        """Whether a choice with ``generated`` tokens, ``last_token`` the latest, may be done."""
        if self.max_tokens is not None and generated >= self.max_tokens:
            return True
        if self.room is not None and generated >= self.room:
            return True
        return generated >= self.min_tokens and last_token in self.stop_token_ids


@dataclass(frozen=True)
class VllmOptions:
    """What the response encoder needs to know about the request."""

    request_id: str  # the client-visible id: generate-tokens-<base>
    model: str
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    logprobs: bool
    prompt_logprobs: bool
    prompt_tokens: int
    # The prompt echoed back (return_token_ids), else None.
    prompt_token_ids: tuple[int, ...] | None
    # Unix seconds at arrival: the unary response's `created`.
    created: int = 0
    # The prompt, when prompt logprobs were asked for (each position lists its own token first).
    prompt: tuple[int, ...] = ()
    end: ChoiceEnd = ChoiceEnd()


def plan(
    body: GenerateRequest, headers: Mapping[str, str], ctx: FormatContext, rank: int | None
) -> GenerateCall:
    """The sub-request for ``body`` (``rank``: the data-parallel rank asked for) and its options."""
    sent = body.model_fields_set
    params = body.sampling_params.checked
    token_ids = body.token_ids
    stream = body.stream
    stream_options = body.stream_options
    served = ctx.model_info.served_model_name
    base = header(headers, "X-Request-Id")
    if base is None:
        base = body.request_id if "request_id" in sent else ctx.new_id()[:16]
    public_id = REQUEST_ID_PREFIX + base
    request = sidecar_pb2.PreprocessedRequest(
        request_id=public_id,
        model=served,
        token_ids=token_ids,
        eos_token_ids=ctx.model_info.eos_token_ids,
    )
    params.fill(request, len(token_ids), ctx.model_info.max_context_length)
    # A non-streaming request is one answer: so is what the worker is asked for (its engine
    # too), and its cost does not grow with the tokens. A worker that streams anyway is joined
    # the same way by the encoder.
    if not stream:
        request.output_options.unary = True
    _fill_routing(request, body, rank)
    if body.kv_transfer_params is not None:
        _fill_kv_transfer(request, body.kv_transfer_params, ctx.model_info.disaggregation_mode)

    include_usage = bool(stream_options and stream_options.include_usage)
    options = VllmOptions(
        request_id=public_id,
        model=served,
        n=params.n,
        stream=bool(stream),
        include_usage=include_usage,
        continuous_usage=include_usage and bool(stream_options and stream_options.continuous_usage_stats),
        logprobs=request.output_options.HasField("logprobs"),
        prompt_logprobs=request.output_options.HasField("prompt_logprobs"),
        prompt_tokens=len(token_ids),
        prompt_token_ids=tuple(token_ids) if body.return_token_ids else None,
        created=int(ctx.wall_time),
        prompt=tuple(token_ids) if request.output_options.HasField("prompt_logprobs") else (),
        end=_choice_end(request, ctx.model_info),
    )
    return GenerateCall(
        requests=(request,), stream=bool(stream), options=options, refused_before_stream=REFUSED_BEFORE_STREAM
    )


def _choice_end(request: sidecar_pb2.PreprocessedRequest, info: sidecar_pb2.ModelInfo) -> ChoiceEnd:
    stop = request.stop_conditions
    stops = set(stop.stop_token_ids)
    if not stop.ignore_eos:
        stops.update(request.eos_token_ids)
    context = info.max_context_length
    return ChoiceEnd(
        stop_token_ids=frozenset(stops),
        min_tokens=stop.min_tokens,
        max_tokens=stop.max_tokens if stop.HasField("max_tokens") else None,
        room=context - len(request.token_ids) if context else None,
    )


def _fill_routing(request: sidecar_pb2.PreprocessedRequest, body: GenerateRequest, rank: int | None) -> None:
    if rank is not None:
        request.routing.dp_rank = rank
    if body.cache_salt is not None:
        request.routing.cache_namespace = body.cache_salt
    if "priority" in body.model_fields_set:
        # vLLM: lower runs earlier; sidecar.v1: higher is more urgent.
        urgency = -body.priority
        if not _INT32[0] <= urgency <= _INT32[1]:
            raise uncarried("priority", "it must lie within a 32-bit signed integer")
        request.routing.priority = urgency


def _fill_kv_transfer(request: sidecar_pb2.PreprocessedRequest, params: dict[str, object], mode: str) -> None:
    # A decode sidecar takes the prefill's handoff as prefill_result; the others as extra_args.
    try:
        struct = struct_from_json(cast("dict[str, JSON]", params))
    except (StructError, RecursionError) as err:
        raise uncarried("kv_transfer_params", f"it cannot be carried exactly ({err})") from None
    if mode == "decode":
        request.prefill_result.disaggregated_params.CopyFrom(struct)
    else:
        request.extra_args.fields["kv_transfer_params"].struct_value.CopyFrom(struct)
