"""vLLM 0.33's ``/inference/v1/generate`` request as a pydantic model (pure).

The real server parses the body with pydantic v2 (lax mode) into its ``GenerateRequest``,
whose ``sampling_params`` is a msgspec struct validated as "an instance of SamplingParams, or
an object of its fields". This module states the same fields, types, bounds and validators
in our own words, so that pydantic itself produces the error list (its order, types,
messages and union branches) instead of a hand emulation of it. The field lists follow
vLLM's ``GenerateRequest`` and ``SamplingParams``; where a nested model of vLLM's is only
refused or ignored here, its deeper checks are left out (``parse_context``'s typed chat
fields; the cross-field validators of ``features``, ``structured_outputs`` and
``repetition_detection``; see ``docs/decisions.md``).

Two kinds of checks are not pydantic's and stay hand code: the cache-salt check vLLM runs
before validation, and the sampling checks vLLM's ``SamplingParams.__post_init__`` raises as
its own error type (both raise :class:`~sidecar_frontend.formats.vllm.errors.Refused`, which
pydantic lets through, so the first of them ends validation exactly as it does in vLLM).
"""

from __future__ import annotations

import dataclasses
import re
from enum import Enum
from typing import Annotated, Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import core_schema

from sidecar_frontend.formats.vllm.checks import check_cache_salt
from sidecar_frontend.formats.vllm.errors import Invalid, ValidationIssue
from sidecar_frontend.formats.vllm.sampling import SamplingParams as CheckedSampling

__all__ = ["GenerateRequest", "SamplingParams", "validate_generate"]

_INT64: Final = 2**63


class OutputKind(Enum):
    """vLLM's RequestOutputKind (an Enum of ints: the lax mode takes the value)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclasses.dataclass
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None


@dataclasses.dataclass
class RepetitionDetectionParams:
    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0


# vLLM's SamplingParams fields a client can send, in its declaration order (the order
# pydantic reports their problems in). The private ones are not part of the schema.
SAMPLING_FIELDS: Final[dict[str, Any]] = {
    "n": int,
    "presence_penalty": float,
    "frequency_penalty": float,
    "repetition_penalty": float,
    "temperature": float,
    "watermarking": bool | None,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "seed": int | None,
    "stop": str | list[str] | None,
    "stop_token_ids": list[int] | None,
    "ignore_eos": bool,
    "max_tokens": int | None,
    "min_tokens": int,
    "logprobs": int | None,
    "prompt_logprobs": int | None,
    "prompt_logprob_token_ids": list[list[StrictInt]] | None,
    "prompt_logprob_start": int | None,
    "logprob_token_ids": list[int] | None,
    "flat_logprobs": bool,
    "detokenize": bool,
    "skip_special_tokens": bool,
    "spaces_between_special_tokens": bool,
    "include_stop_str_in_output": bool,
    "output_kind": OutputKind,
    "stream_interval": int | None,
    "skip_clone": bool,
    "output_text_buffer_length": int,
    "structured_outputs": StructuredOutputsParams | None,
    "logit_bias": dict[int, float] | None,
    "allowed_token_ids": list[int] | None,
    "extra_args": dict[str, Any] | None,
    "bad_words": list[str] | None,
    "skip_reading_prefix_cache": bool | None,
    "thinking_token_budget": int | None,
    "repetition_detection": RepetitionDetectionParams | None,
    "routed_experts_prompt_start": int,
    "trace_decode_token_ids": list[int] | None,
}


class SamplingParams:
    """``sampling_params``: what pydantic makes of vLLM's msgspec struct.

    The schema is vLLM's: a union of "an instance of SamplingParams" (never true for a JSON
    body, but its error is listed) and a typed dict of the fields; a valid dict then goes
    through vLLM's own checks (hand code: they raise vLLM's error, not pydantic's).
    """

    def __init__(self, values: dict[str, object]) -> None:
        self.values = values  # only the keys the client sent, coerced
        self.checked = CheckedSampling(values)

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        fields = {
            name: core_schema.typed_dict_field(handler.generate_schema(hint), required=False)
            for name, hint in SAMPLING_FIELDS.items()
        }
        from_fields = core_schema.no_info_after_validator_function(cls, core_schema.typed_dict_schema(fields))
        return core_schema.union_schema([core_schema.is_instance_schema(cls), from_fields])


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class ReasoningParserKwargs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)


class ParseContext(BaseModel):
    # vLLM types its chat fields (tools, tool_choice, ...); they are read only in the
    # "derender" output mode, which a tokens-only server refuses, so they are kept loose.
    model_config = ConfigDict(extra="allow")


class PlaceholderRange(BaseModel):
    offset: int = Field(ge=0)
    length: int = Field(gt=0)


class MultiModalFeatures(BaseModel):
    mm_hashes: dict[str, list[str]]
    mm_placeholders: dict[str, list[PlaceholderRange]]
    kwargs_data: dict[str, list[str | None]] | None = None
    mm_metadata: dict[str, list[str | None]] | None = None


class GenerateRequest(BaseModel):
    """vLLM's GenerateRequest fields, in its declaration order."""

    # vLLM draws a fresh id when absent (``model_fields_set`` tells); null is refused.
    request_id: str = ""
    token_ids: Annotated[list[int], Field(min_length=1)]
    token_offsets: list[tuple[int, int]] | None = None
    features: MultiModalFeatures | None = None
    content_parts: list[dict[str, Any]] | None = None
    sampling_params: SamplingParams
    model: str | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: ReasoningParserKwargs | None = None
    return_token_ids: bool | None = None
    output_mode: Literal["tokens", "text", "derender"] = "tokens"
    parse_context: ParseContext | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: Annotated[str | None, Field(min_length=1, max_length=1024)] = None
    priority: Annotated[int, Field(ge=-_INT64, le=_INT64 - 1)] = 0
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None

    @field_validator("token_ids")
    @classmethod
    def _no_negative_ids(cls, ids: list[int]) -> list[int]:
        if any(t < 0 for t in ids):
            raise ValueError("token_ids must not contain negative values")
        return ids

    @model_validator(mode="before")
    @classmethod
    def _cache_salt_first(cls, data: Any) -> Any:
        # vLLM's pre-check, in vLLM's own error form (raises Refused, which pydantic passes on).
        if isinstance(data, dict):
            check_cache_salt(data.get("cache_salt"))
        return data

    @model_validator(mode="after")
    def _multimodal_inputs_exclusive(self) -> GenerateRequest:
        if self.content_parts and self.features:
            raise ValueError("content_parts and features are mutually exclusive")
        return self

    @model_validator(mode="after")
    def _output_mode_needs_detokenize(self) -> GenerateRequest:
        if self.output_mode != "tokens" and not self.sampling_params.checked.detokenize:
            raise ValueError(
                f"output_mode={self.output_mode!r} requires sampling_params.detokenize to be true"
            )
        return self


def validate_generate(data: object) -> GenerateRequest:
    """The body as vLLM validates it; :class:`Invalid` with pydantic's own error list.

    vLLM's web framework validates the body with ``from_attributes``: a nested model given a
    non-object is "model_attributes_type", as the real server reports it.
    """
    try:
        return GenerateRequest.model_validate(data, from_attributes=True)
    except ValidationError as err:
        raise Invalid(*issues_of(err)) from None


# vLLM writes an error's place without pydantic's schema markers (union branches such as
# ``list[str]``, wrapper kinds such as ``function-after[...]``): a bracketed segment, or one
# of these names, is not a field.
_MARKER_CHARS: Final = re.compile(r"[\[\]{}()]")
_MARKERS: Final = frozenset(
    {
        *("function-wrap", "function-after", "function-before", "function-plain", "json-or-python"),
        *("lax-or-strict", "chain", "default", "nullable", "tagged-union", "union", "call"),
        *("arguments", "is-instance", "is-subclass", "callable", "str", "int", "float", "bool"),
        *("bytes", "bytearray", "list", "tuple", "dict", "set", "frozenset", "complex", "none"),
        "nonetype",
    }
)


def _place(loc: tuple[int | str, ...]) -> str:
    parts = ["body", *(str(part) for part in loc)]
    kept = [p for p in parts if not (_MARKER_CHARS.search(p) or p.lower() in _MARKERS)]
    return ".".join(kept)


def issues_of(err: ValidationError) -> list[ValidationIssue]:
    """pydantic's errors as vLLM reports them: the place dotted under ``body``, markers dropped."""
    issues = []
    for error in err.errors(include_url=False):
        loc = _place(error["loc"])
        ctx = error.get("ctx")
        issues.append(ValidationIssue(error["type"], loc, error["msg"], error["input"], ctx))
    return issues
