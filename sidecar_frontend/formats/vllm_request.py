"""vLLM's ``/inference/v1/generate`` request: body -> one ``sidecar.v1`` sub-request (pure).

Validation runs in vLLM's order, so that the first problem a client hears about is the one
the real server would name: transport (content type, JSON), the cache-salt pre-check, field
types (every problem listed, pydantic-style), the sampling-parameter checks (the first one
raises), the whole-body checks, the handler's checks (model name, ``n``, stop strings,
output mode, integer ranges), then the engine's input checks we can make here, in the engine's
order (the sampling parameters' vocabulary checks, the data-parallel rank, the prompt's
length, the prompt's vocabulary). Last come our own refusals: every field this frontend
cannot carry to a vLLM sidecar is refused by name, so nothing is dropped silently.

Explicit keys are tracked: a sampling parameter the caller did not send stays absent on the
``PreprocessedRequest`` (its proto3 ``optional`` field is not set), so the engine applies its
own default, exactly as vLLM distinguishes "the client said 16" from "the client said nothing".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Final, TypeVar, cast

from sidecar_common.api import sidecar_pb2
from sidecar_common.structs import JSON, StructError, struct_from_json
from sidecar_frontend.formats.base import FormatContext, GenerateCall, HttpReply
from sidecar_frontend.formats.vllm_checks import (
    check_msgpack,
    check_prompt,
    dp_rank,
    header,
    read_body,
)
from sidecar_frontend.formats.vllm_errors import (
    REFUSED_BEFORE_STREAM,
    Invalid,
    Refused,
    VllmError,
    bad_request,
    uncarried,
    validation_reply,
)
from sidecar_frontend.formats.vllm_model import GenerateRequest, validate_generate
from sidecar_frontend.formats.vllm_sampling import UINT32_MAX
from sidecar_frontend.formats.vllm_sampling import SamplingParams as SamplingChecks

__all__ = ["REQUEST_ID_PREFIX", "ChoiceEnd", "VllmOptions", "parse_generate"]

T = TypeVar("T")

REQUEST_ID_PREFIX: Final = "generate-tokens-"
_INT32: Final = (-(2**31), 2**31 - 1)
_INT64: Final = (-(2**63), 2**63 - 1)
_OUTPUT_MODES: Final = ("tokens", "text", "derender")


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


def parse_generate(body: bytes, headers: Mapping[str, str], ctx: FormatContext) -> GenerateCall | HttpReply:
    try:
        return _parse(body, headers, ctx)
    except Refused as refused:
        return refused.reply
    except Invalid as invalid:
        return validation_reply(invalid.issues)


def _parse(body: bytes, headers: Mapping[str, str], ctx: FormatContext) -> GenerateCall:
    data = read_body(body, headers)
    # Field types, the cache-salt pre-check and vLLM's sampling checks, as vLLM's own request
    # model runs them (pydantic lists every type problem; a vLLM check raises on the first).
    body_model = validate_generate(data)
    sent = body_model.model_fields_set
    params = body_model.sampling_params.checked
    token_ids = body_model.token_ids
    model = body_model.model
    return_token_ids = body_model.return_token_ids
    output_mode = body_model.output_mode if "output_mode" in sent else None
    stream = body_model.stream
    stream_options = body_model.stream_options
    kv_transfer_params = body_model.kv_transfer_params
    ec_transfer_params = body_model.ec_transfer_params
    content_parts = body_model.content_parts

    # The handler's checks, in vLLM's order.
    served = ctx.model_info.served_model_name
    if model and model != served:
        raise Refused(
            VllmError(
                f"The model `{model}` does not exist. Valid aliases: {served}.",
                "NotFoundError",
                HTTPStatus.NOT_FOUND,
                "model",
            )
        )
    max_num_seqs = ctx.model_info.max_num_seqs
    if max_num_seqs and params.n > max_num_seqs:
        raise Refused(
            bad_request(
                "sampling_params.n must be at most the server's max_num_seqs "
                f"({max_num_seqs}), got {params.n}."
            )
        )
    if stream and params.raw("prompt_logprob_token_ids") is not None:
        raise Refused(bad_request("prompt_logprob_token_ids are not available when stream=true."))
    if params.stop:
        raise Refused(
            bad_request(
                "stop strings are not supported on a --tokens-only server because detokenization "
                "is disabled. Check stop strings on the coordinator, or use stop_token_ids."
            )
        )
    if output_mode not in (None, "tokens"):
        raise Refused(
            bad_request(
                f"output_mode={output_mode!r} requires a tokenizer, but this server does not load one "
                "(--tokens-only or --skip-tokenizer-init). Send the request to a server that loads "
                "a tokenizer, or use output_mode='tokens'."
            )
        )
    check_msgpack([*params.integers(), kv_transfer_params])

    rank = _engine_input_checks(params, token_ids, headers, ctx.model_info)

    # What this frontend cannot carry to a vLLM sidecar.
    if ec_transfer_params is not None:
        raise uncarried("ec_transfer_params", "encoder-cache transfer is not carried to the engine")
    if body_model.features is not None:
        raise uncarried("features", "multimodal features are not carried to the engine")
    if content_parts:
        raise uncarried("content_parts", "multimodal content is not carried to the engine")
    params.refuse_uncarried()

    base = header(headers, "X-Request-Id")
    if base is None:
        base = body_model.request_id if "request_id" in sent else ctx.new_id()[:16]
    public_id = REQUEST_ID_PREFIX + base
    request = sidecar_pb2.PreprocessedRequest(
        request_id=public_id,
        model=served,
        token_ids=token_ids,
        eos_token_ids=ctx.model_info.eos_token_ids,
    )
    params.fill(request, len(token_ids), ctx.model_info.max_context_length)
    _fill_routing(request, body_model, rank)
    if kv_transfer_params is not None:
        _fill_kv_transfer(request, kv_transfer_params, ctx.model_info.disaggregation_mode)

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
        prompt_token_ids=tuple(token_ids) if return_token_ids else None,
        created=int(ctx.wall_time),
        prompt=tuple(token_ids) if request.output_options.HasField("prompt_logprobs") else (),
        end=_choice_end(request, ctx.model_info),
    )
    return GenerateCall(
        requests=(request,), stream=bool(stream), options=options, refused_before_stream=REFUSED_BEFORE_STREAM
    )


def _engine_input_checks(
    params: SamplingChecks, token_ids: list[int], headers: Mapping[str, str], info: sidecar_pb2.ModelInfo
) -> int | None:
    """The engine's input checks that what the workers serve lets us make here, in vLLM's
    order: the sampling parameters (``SamplingParams.verify``: biased ids, stop ids, structured
    outputs), then the data-parallel rank, then the prompt's length, then its vocabulary.
    Returns the data-parallel rank asked for, or raises the first refusal.

    vLLM's engine checks one thing before all of these that no worker reports: a logprob count
    against its ``--max-logprobs`` (``SamplingParams._validate_logprobs``, first in
    ``verify``). So when a request asks for logprobs of a vLLM engine and these checks find a
    problem, only the engine knows which one vLLM names first. If every problem found is one
    the engine checks itself, in the same words, behind a vLLM sidecar that passes the request
    through (the ids' vocabulary, the prompt's length), the request is left to the engine,
    which answers in vLLM's order: the logprobs when over its maximum, else the same refusal
    (as vLLM answers it: a 400 unary, an error event in a stream). A problem the sidecar or
    this frontend would answer first in other words (structured outputs, which are not carried;
    the rank, which the sidecar checks) is refused here.
    """
    first: Refused | None = None
    engine_words = True  # every problem found is one the engine states the same way

    def found(refused: Refused, *, by_engine: bool) -> None:
        nonlocal first, engine_words
        first = first or refused
        engine_words = engine_words and by_engine

    try:
        params.check_vocabulary(info.vocab_size)
    except Refused as refused:
        found(refused, by_engine=True)
    if params.present("structured_outputs") and params.raw("structured_outputs") is not None:
        found(
            Refused(
                bad_request(
                    "Structured outputs requires a tokenizer so it can't be used with 'skip_tokenizer_init'"
                )
            ),
            by_engine=False,
        )
    rank: int | None = None
    try:
        rank = dp_rank(header(headers, "X-data-parallel-rank"), info.data_parallel_size)
    except Refused as refused:
        found(refused, by_engine=False)
    try:
        check_prompt(token_ids, info)
    except Refused as refused:
        found(refused, by_engine=True)
    if first is None:
        return rank
    if engine_words and _engine_checks_logprobs_first(params, info) and _carried(params, token_ids):
        return rank
    raise first


def _engine_checks_logprobs_first(params: SamplingChecks, info: sidecar_pb2.ModelInfo) -> bool:
    # vLLM checks a count only when it is non-zero (-1, the whole vocabulary, is refused by name
    # here: never carried); the vLLM sidecar carries counts within 32 signed bits.
    counts = (params.logprobs, params.prompt_logprobs)
    return info.engine == "vllm" and any(count is not None and 0 < count <= _INT32[1] for count in counts)


def _carried(params: SamplingChecks, token_ids: list[int]) -> bool:
    # Every id the engine is to check must reach it: the sidecar's fields are 32-bit unsigned.
    ids = (*token_ids, *(params.logit_bias or {}), *(params.stop_token_ids or ()))
    return all(0 <= token <= UINT32_MAX for token in ids)


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
