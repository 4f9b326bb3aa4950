"""SGLang 0.5.23's ``/generate`` request dataclass as pydantic sees it (pure).

SGLang's HTTP server takes the body as its ``GenerateReqInput`` dataclass, which its web
framework validates with pydantic v2: the first ("parse") stage of a request, answered with
pydantic's full error list. This module states the dataclass's fields and types in our own
words (in SGLang's order, which is the order of the errors), with SGLang's own validator for
``input_ids``; pydantic then produces the error list by construction. Fields whose real type
holds SGLang classes (images, multimodal placeholders, KV hints) are stated with the shapes
they accept from JSON; the frontend refuses every one of them by name later anyway.

What is not pydantic's stays hand code in ``checks`` (the JSON contract gate, a
generated strict decoder of its own) and ``values`` (SGLang's value sentences).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

from pydantic import GetCoreSchemaHandler, PlainValidator, TypeAdapter, ValidationError
from pydantic_core import ErrorDetails, core_schema

from sidecar_frontend.formats.base import HttpReply
from sidecar_frontend.formats.sglang.checks import input_ids_error
from sidecar_frontend.formats.sglang.wire import bounded_repr, dumps

__all__ = ["AbortReq", "GenerateReqInput", "ModelErrors", "validate_abort", "validate_generate"]


def _input_ids(value: Any) -> Any:
    # SGLang's own validator for this field (a plain one: pydantic's type is not consulted).
    error = input_ids_error(value)
    if error is not None:
        raise ValueError(error)
    return value


_IntsOrRows = list[list[int]] | list[int] | None
_PerItemStr = list[str | None] | str | None
_PerItemInt = list[int | None] | int | None


@dataclasses.dataclass
class GenerateReqInput:
    """SGLang's GenerateReqInput fields, in its declaration order."""

    rid: str | list[str] | None = dataclasses.field(default=None, kw_only=True)
    session_id: str | None = dataclasses.field(default=None, kw_only=True)
    text: str | list[str] | None = None
    input_ids: Annotated[_IntsOrRows, PlainValidator(_input_ids)] = None
    input_embeds: list[list[list[float]]] | list[list[float]] | None = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    mm_hashes: list[str] | list[list[str]] | None = None
    mm_content_hashes: list[str | None] | list[list[str | None]] | None = None
    use_audio_in_video: bool = False
    video_config: dict[str, Any] | None = None
    sampling_params: list[dict[str, Any]] | dict[str, Any] | None = None
    watermark: Any = None
    return_logprob: list[bool] | bool | None = None
    logprob_start_len: list[int] | int | None = None
    top_logprobs_num: list[int] | int | None = None
    token_ids_logprob: list[list[int]] | list[int] | None = None
    return_sampling_mask: list[bool] | bool | None = None
    sampling_logprobs_mode: (
        list[Literal["selected", "support"] | None] | Literal["selected", "support"] | None
    ) = None
    return_text_in_logprobs: bool = False
    return_flat_raw_top_logprobs: bool = False
    return_flat_raw_output_top_logprobs: bool = False
    return_flat_raw_top_logprobs_b64: bool = False
    stream: bool = False
    log_metrics: bool = True
    return_hidden_states: list[bool | Literal["last"]] | bool | Literal["last"] = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    return_indexer_topk: bool = False
    modalities: list[str] | None = None
    session_params: dict[str, Any] | None = None
    lora_path: _PerItemStr = None
    lora_id: _PerItemStr = None
    custom_logit_processor: _PerItemStr = None
    positional_embed_overrides: Any = None
    bootstrap_host: _PerItemStr = None
    bootstrap_port: _PerItemInt = None
    bootstrap_room: _PerItemInt = None
    bootstrap_pair_key: _PerItemStr = None
    decode_tp_size: _PerItemInt = None
    routed_dp_rank: int | None = None
    data_parallel_rank: int | None = None
    disagg_prefill_dp_rank: int | None = None
    routing_key: str | None = None
    conversation_id: str | None = None
    http_worker_ipc: str | None = dataclasses.field(default=None, kw_only=True)
    background: bool = False
    require_reasoning: bool = False
    max_thinking_tokens: int | None = None
    priority: int | None = None
    extra_key: str | list[str] | None = None
    no_logs: bool = False
    custom_labels: dict[str, str] | None = None
    return_bytes: bool = False
    return_entropy: bool = False
    return_prompt_token_ids: bool = False
    external_trace_header: dict[str, Any] | None = None
    received_time: float | None = None
    need_wait_for_mm_inputs: bool | None = None
    num_items_assigned: dict[str, list[int]] | None = None
    encoder_urls: list[str] | None = None
    max_dynamic_patch: int | None = None
    min_dynamic_patch: int | None = None
    image_max_dynamic_patch: int | None = None
    video_max_dynamic_patch: int | None = None
    images_config: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    multi_item_delimiter_indices: list[list[int]] | list[int] | None = None
    token_indices_to_pool: list[list[int]] | list[int] | None = None
    cache_salt: str | list[str] | None = None
    kv_hints: list[dict[str, Any] | None] | dict[str, Any] | None = None


_ADAPTER: TypeAdapter[GenerateReqInput] = TypeAdapter(GenerateReqInput)


class AbortReq:
    """``/abort_request``'s body: SGLang's AbortReq, a msgspec struct, as pydantic sees it.

    SGLang gives its structs the schema "an instance of the struct, or a dict of its fields
    turned into one" (so both branches are reported), with these fields in this order.
    """

    FIELDS: ClassVar[dict[str, Any]] = {
        "rid": str | None,
        "http_worker_ipc": str | None,
        "abort_all": bool,
        "finished_reason": dict[str, str | int | list[int] | None] | None,
        "abort_message": str | None,
        "weight_versions": list[dict[str, Any]] | None,
    }

    def __init__(self, values: dict[str, Any]) -> None:
        self.rid: str | None = values.get("rid")
        self.abort_all: bool = values.get("abort_all", False)

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        fields = {
            name: core_schema.typed_dict_field(handler.generate_schema(hint), required=False)
            for name, hint in cls.FIELDS.items()
        }
        typed = core_schema.typed_dict_schema(fields, cls_name=cls.__name__, extra_behavior="ignore")

        def build_struct(value: dict[str, Any]) -> AbortReq:  # the name shows in error places
            return cls(value)

        from_fields = core_schema.no_info_after_validator_function(build_struct, typed)
        return core_schema.union_schema([core_schema.is_instance_schema(cls), from_fields])


_ABORT_ADAPTER: TypeAdapter[AbortReq] = TypeAdapter(AbortReq)


class ModelErrors(Exception):
    """The parse stage failed: pydantic's errors, answered in SGLang's parse-stage shape."""

    def __init__(self, errors: Sequence[ErrorDetails]) -> None:
        super().__init__(f"{len(errors)} validation errors")
        self.errors = errors

    def reply(self) -> HttpReply:
        count = len(self.errors)
        lines = "".join(f"  {_entry(error)}\n" for error in self.errors)
        message = f"{count} validation error{'s' if count != 1 else ''}:\n{lines}".rstrip()
        body = {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
        return HttpReply(400, dumps(body))


def _entry(error: ErrorDetails) -> str:
    # The web framework's error dict, its place under "body"; the echoed input is bounded
    # (the body may be anything), the rest is written as Python writes the dict.
    loc = ("body", *error["loc"])
    text = f"{{'type': {error['type']!r}, 'loc': {loc!r}, 'msg': {error['msg']!r}, "
    text += f"'input': {bounded_repr(error['input'])}"
    if "ctx" in error:
        text += f", 'ctx': {error['ctx']!r}"
    return text + "}"


def validate_abort(body: object) -> AbortReq:
    """``/abort_request``'s body as SGLang's parse stage takes it; :class:`ModelErrors` if not."""
    try:
        return _ABORT_ADAPTER.validate_python(body)
    except ValidationError as err:
        raise ModelErrors(err.errors(include_url=False)) from None


def validate_generate(body: object) -> GenerateReqInput:
    """The body as SGLang's parse stage takes it; :class:`ModelErrors` with pydantic's list."""
    try:
        return _ADAPTER.validate_python(body)
    except ValidationError as err:
        raise ModelErrors(err.errors(include_url=False)) from None
