"""vLLM's ``/inference/v1/generate`` request: body -> one ``sidecar.v1`` sub-request (pure).

Validation runs in vLLM's order, so that the first problem a client hears about is the one
the real server would name: transport (content type, JSON), the cache-salt pre-check, field
types (every problem listed, pydantic-style), the sampling-parameter checks (the first one
raises), the whole-body checks, the handler's checks (model name, ``n``, stop strings,
output mode, integer ranges), then the engine's input checks we can make here (vocabulary,
context length, data-parallel rank). Last come our own refusals: every field this frontend
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
    check_cache_salt,
    check_msgpack,
    check_prompt,
    dp_rank,
    header,
    read_body,
)
from sidecar_frontend.formats.vllm_errors import (
    Refused,
    ValidationIssue,
    VllmError,
    bad_request,
    uncarried,
    validation_reply,
)
from sidecar_frontend.formats.vllm_lax import (
    Fields,
    Invalid,
    as_bool,
    as_dict,
    as_int,
    as_int_list,
    as_str,
    literal,
    nullable,
)
from sidecar_frontend.formats.vllm_sampling import SamplingParams, not_an_instance

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
    check_cache_salt(data.get("cache_salt"))
    fields = Fields(data)
    request_id = fields.get("request_id", as_str)
    token_ids = fields.required("token_ids", _token_ids)
    sampling = fields.required("sampling_params", _sampling_object)
    params = SamplingParams(sampling, fields) if sampling is not None else None
    model = fields.get("model", nullable(as_str))
    fields.get("reasoning_ended", nullable(as_bool))
    fields.get("reasoning_parser_kwargs", nullable(_reasoning_parser_kwargs))
    return_token_ids = fields.get("return_token_ids", nullable(as_bool))
    output_mode = fields.get("output_mode", lambda v, loc: literal(v, loc, _OUTPUT_MODES))
    stream = fields.get("stream", nullable(as_bool))
    stream_options = fields.get("stream_options", nullable(_stream_options))
    fields.get("cache_salt", nullable(as_str))
    priority = fields.get("priority", _priority)
    kv_transfer_params = fields.get("kv_transfer_params", nullable(as_dict))
    ec_transfer_params = fields.get("ec_transfer_params", nullable(as_dict))
    fields.get("features", nullable(as_dict))
    content_parts = fields.get("content_parts", nullable(_list_of_dicts))
    if fields.issues:
        raise Invalid(*fields.issues)
    # Both are required: with no issue collected, they are set.
    assert token_ids is not None
    assert params is not None

    # Whole-body checks (pydantic model validators: a ValueError at the body's root).
    if output_mode not in (None, "tokens") and not params.detokenize:
        _root_value_error(data, f"output_mode={output_mode!r} requires sampling_params.detokenize to be true")

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

    # The engine's input checks that what the workers serve lets us make here.
    check_prompt(token_ids, ctx.model_info)
    params.check_vocabulary(ctx.model_info.vocab_size)
    rank = dp_rank(header(headers, "X-data-parallel-rank"), ctx.model_info.data_parallel_size)
    if params.present("structured_outputs") and params.raw("structured_outputs") is not None:
        raise Refused(
            bad_request(
                "Structured outputs requires a tokenizer so it can't be used with 'skip_tokenizer_init'"
            )
        )

    # What this frontend cannot carry to a vLLM sidecar.
    if ec_transfer_params is not None:
        raise uncarried("ec_transfer_params", "encoder-cache transfer is not carried to the engine")
    if fields.raw("features") is not None:
        raise uncarried("features", "multimodal features are not carried to the engine")
    if content_parts:
        raise uncarried("content_parts", "multimodal content is not carried to the engine")
    params.refuse_uncarried()

    base = header(headers, "X-Request-Id")
    if base is None:
        base = request_id if request_id is not None else ctx.new_id()[:16]
    public_id = REQUEST_ID_PREFIX + base
    request = sidecar_pb2.PreprocessedRequest(
        request_id=public_id,
        model=served,
        token_ids=token_ids,
        eos_token_ids=ctx.model_info.eos_token_ids,
    )
    params.fill(request, len(token_ids), ctx.model_info.max_context_length)
    _fill_routing(request, fields, priority, rank)
    if kv_transfer_params is not None:
        _fill_kv_transfer(request, kv_transfer_params, ctx.model_info.disaggregation_mode)

    include_usage = bool(stream_options and stream_options[0])
    options = VllmOptions(
        request_id=public_id,
        model=served,
        n=params.n,
        stream=bool(stream),
        include_usage=include_usage,
        continuous_usage=include_usage and bool(stream_options and stream_options[1]),
        logprobs=request.output_options.HasField("logprobs"),
        prompt_logprobs=request.output_options.HasField("prompt_logprobs"),
        prompt_tokens=len(token_ids),
        prompt_token_ids=tuple(token_ids) if return_token_ids else None,
        created=int(ctx.wall_time),
        prompt=tuple(token_ids) if request.output_options.HasField("prompt_logprobs") else (),
        end=_choice_end(request, ctx.model_info),
    )
    return GenerateCall(requests=(request,), stream=bool(stream), options=options)


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


def _root_value_error(data: dict[str, object], message: str) -> None:
    raise Invalid(
        ValidationIssue(
            "value_error", "body", f"Value error, {message}", data, {"error": ValueError(message)}
        )
    )


# --------------------------------------------------------------------------------- fields


def _token_ids(value: object, loc: str) -> list[int]:
    ids = as_int_list(value, loc)
    if not ids:
        raise Invalid(
            ValidationIssue(
                "too_short",
                loc,
                "List should have at least 1 item after validation, not 0",
                value,
                {"field_type": "List", "min_length": 1, "actual_length": 0},
            )
        )
    if any(t < 0 for t in ids):
        message = "token_ids must not contain negative values"
        raise Invalid(
            ValidationIssue(
                "value_error", loc, f"Value error, {message}", value, {"error": ValueError(message)}
            )
        )
    return ids


def _sampling_object(value: object, loc: str) -> dict[str, object]:
    if isinstance(value, dict):
        return value
    raise Invalid(
        not_an_instance(value, loc),
        ValidationIssue("dict_type", loc, "Input should be a valid dictionary", value),
    )


def _reasoning_parser_kwargs(value: object, loc: str) -> dict[str, object]:
    kwargs = as_dict(value, loc)
    issues = [
        ValidationIssue("extra_forbidden", f"{loc}.{key}", "Extra inputs are not permitted", item)
        for key, item in kwargs.items()
        if key != "chat_template_kwargs"
    ]
    if "chat_template_kwargs" in kwargs and not isinstance(kwargs["chat_template_kwargs"], dict):
        issues.insert(
            0,
            ValidationIssue(
                "dict_type",
                f"{loc}.chat_template_kwargs",
                "Input should be a valid dictionary",
                kwargs["chat_template_kwargs"],
            ),
        )
    if issues:
        raise Invalid(*issues)
    return kwargs


def _stream_options(value: object, loc: str) -> tuple[bool, bool]:
    if not isinstance(value, dict):
        raise Invalid(
            ValidationIssue(
                "model_type",
                loc,
                "Input should be a valid dictionary or instance of StreamOptions",
                value,
                {"class_name": "StreamOptions"},
            )
        )
    options = Fields(value, loc)
    include = options.get("include_usage", nullable(as_bool))
    continuous = options.get("continuous_usage_stats", nullable(as_bool))
    if options.issues:
        raise Invalid(*options.issues)
    return bool(include), bool(continuous)


def _priority(value: object, loc: str) -> int:
    number = as_int(value, loc)
    low, high = _INT64
    if number > high:
        raise Invalid(
            ValidationIssue(
                "less_than_equal", loc, f"Input should be less than or equal to {high}", value, {"le": high}
            )
        )
    if number < low:
        raise Invalid(
            ValidationIssue(
                "greater_than_equal",
                loc,
                f"Input should be greater than or equal to {low}",
                value,
                {"ge": low},
            )
        )
    return number


def _list_of_dicts(value: object, loc: str) -> list[object]:
    if not isinstance(value, list):
        raise Invalid(ValidationIssue("list_type", loc, "Input should be a valid list", value))
    issues = [
        ValidationIssue("dict_type", f"{loc}.{i}", "Input should be a valid dictionary", item)
        for i, item in enumerate(value)
        if not isinstance(item, dict)
    ]
    if issues:
        raise Invalid(*issues)
    return value


def _fill_routing(
    request: sidecar_pb2.PreprocessedRequest, fields: Fields, priority: int | None, rank: int | None
) -> None:
    if rank is not None:
        request.routing.dp_rank = rank
    salt = fields.raw("cache_salt")
    if isinstance(salt, str):
        request.routing.cache_namespace = salt
    if fields.present("priority") and priority is not None:
        # vLLM: lower runs earlier; sidecar.v1: higher is more urgent.
        urgency = -priority
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
