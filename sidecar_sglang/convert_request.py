"""Request conversion for SGLang (pure): PreprocessedRequest -> one native intermediate,
then the gRPC ``GenerateRequest`` or the HTTP ``/generate`` JSON body from it.

Every rule of docs/sglang.md "Request conversion" is applied once, in :func:`build_native`;
the two wire renderings only spell the same fields. No I/O, no clock, no globals: the
prefill bootstrap room is drawn by the caller and passed in.

Priority: SGLang's scheduler (``--enable-priority-scheduling``) runs *larger* priority values
first unless the server was started with ``--schedule-low-priority-values-first`` (off by
default). Ours is "higher is more urgent", so the value passes unchanged by default and is
negated when discovery reports the low-values-first flag.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final, Literal

from google.protobuf import struct_pb2

from sidecar_common import bootstrap_handoff, sampling_schema
from sidecar_common.api import sglang_pb2, sidecar_pb2
from sidecar_common.bootstrap_handoff import PORT_MAX, ROOM_MAX
from sidecar_common.disaggregation import DisaggregationMode
from sidecar_common.errors import NOT_SENT, FailureReason, engine_words, invalid_argument
from sidecar_common.limits import check_media, check_sampling_limits
from sidecar_common.structs import JSON, StructError, json_from_struct
from sidecar_sglang.refusals import out_of_vocabulary

__all__ = [
    "CUSTOM_PARAMS",
    "INT32_MAX",
    "RETURN_SAMPLING_MASK",
    "ROOM_MAX",
    "SAMPLING_LOGPROBS_MODE",
    "SGLANG_DEFAULT_MAX_NEW_TOKENS",
    "Bootstrap",
    "NativeRequest",
    "NativeSampling",
    "RequestSettings",
    "asks_one_answer",
    "build_native",
    "handoff_info",
    "lora_disabled_refusal",
    "to_grpc",
    "to_http_json",
]

INT32_MAX: Final = 2**31 - 1
INT32_MIN: Final = -(2**31)
# SGLang's SamplingParams: max_new_tokens when the request names none.
SGLANG_DEFAULT_MAX_NEW_TOKENS: Final = 128

Transport = Literal["grpc", "http"]

_MEDIA_FIELDS: Final = {
    sidecar_pb2.MultimodalItem.IMAGE: "image_data",
    sidecar_pb2.MultimodalItem.VIDEO: "video_data",
    sidecar_pb2.MultimodalItem.AUDIO: "audio_data",
}
# SGLang's sampling_params.custom_params, and its return_sampling_mask and
# sampling_logprobs_mode (HTTP only: its gRPC messages have no such fields); any other key is
# refused by name (never dropped).
CUSTOM_PARAMS: Final = "custom_params"
RETURN_SAMPLING_MASK: Final = "return_sampling_mask"
SAMPLING_LOGPROBS_MODE: Final = "sampling_logprobs_mode"
_SAMPLING_LOGPROBS_MODES: Final = ("selected", "support")
_KNOWN_EXTRA_ARGS: Final[frozenset[str]] = frozenset(
    {CUSTOM_PARAMS, RETURN_SAMPLING_MASK, SAMPLING_LOGPROBS_MODE}
)


@dataclass(frozen=True)
class Bootstrap:
    """The prefill/decode rendezvous triple, exactly as sent to the engine."""

    host: str
    port: int
    room: int


@dataclass(frozen=True)
class RequestSettings:
    """What discovery learned that request conversion depends on."""

    mode: DisaggregationMode = "agg"
    transport: Transport = "grpc"
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    low_priority_values_first: bool = False
    # The engine's data-parallel size (server info ``dp_size``); None: unknown, not checked.
    dp_size: int | None = None
    # The model's context length (the model card's max_model_len) when the engine does not
    # truncate (server info ``allow_auto_truncate`` false); None: not checked here.
    context_length: int | None = None
    # Server info ``enable_lora`` (null or false: off); None: not reported, not checked here.
    lora_enabled: bool | None = None
    # The model's vocabulary size, as the operator gave it (SGLang reports it nowhere); None:
    # not checked here.
    vocab_size: int | None = None


@dataclass(frozen=True)
class NativeSampling:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool | None = None
    json_schema: str | None = None
    regex: str | None = None
    seed: int | None = None
    # (token id, bias) in the request's order; HTTP only (the gRPC wire has no field).
    logit_bias: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class NativeRequest:
    """The shared intermediate: one SGLang generate request, transport-neutral."""

    rid: str
    input_ids: tuple[int, ...]
    sampling: NativeSampling
    return_logprob: bool = False
    top_logprobs_num: int | None = None
    logprob_start_len: int | None = None
    lora_path: str | None = None
    routed_dp_rank: int | None = None
    priority: int | None = None
    bootstrap: Bootstrap | None = None
    media: tuple[tuple[str, str], ...] = ()  # (HTTP field, URL), HTTP only
    # Response-side context, never sent.
    user_stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prefill: bool = False
    # SGLang's token_ids_logprob (HTTP only; sent with return_logprob).
    token_ids_logprob: tuple[int, ...] = ()
    # False: one answer (``stream`` false on either wire), see :func:`asks_one_answer`.
    stream: bool = True
    # SGLang's return_routed_experts and routed_experts_start_len (HTTP only; None: not sent,
    # SGLang's default 0).
    return_routed_experts: bool = False
    routed_experts_start_len: int | None = None
    # SGLang's sampling_params.custom_params (HTTP only), as the caller gave them.
    custom_params: Mapping[str, JSON] | None = None
    # SGLang's return_sampling_mask and sampling_logprobs_mode (HTTP only).
    return_sampling_mask: bool = False
    sampling_logprobs_mode: str | None = None


def _int32(value: int, name: str, *, minimum: int = INT32_MIN) -> int:
    if not minimum <= value <= INT32_MAX:
        raise invalid_argument(name, f"{value} does not fit in int32")
    return value


def _ordered_unique(*groups: Iterable[int]) -> tuple[int, ...]:
    seen: dict[int, None] = {}
    for group in groups:
        for item in group:
            seen.setdefault(item, None)
    return tuple(seen)


def _shortest_float32(value: float) -> float:
    """The shortest decimal that is the same float32: the frontend's 0.7 arrives as
    0.699999988079071 and should reach the engine (and its logs) as 0.7."""
    for digits in range(1, 10):
        candidate = float(f"{value:.{digits}g}")
        try:
            if struct.unpack("<f", struct.pack("<f", candidate))[0] == value:
                return candidate
        except OverflowError:
            # Rounding near the float32 maximum went past it; more digits come closer.
            continue
    return value


def _opt_float(msg: sidecar_pb2.SamplingOptions, name: str) -> float | None:
    if not msg.HasField(name):  # type: ignore[arg-type]
        return None
    value = float(getattr(msg, name))
    return _shortest_float32(value) if math.isfinite(value) else value


def lora_disabled_refusal(adapter: str) -> str:
    """SGLang's tokenizer manager's sentence for an adapter asked of a server without LoRA."""
    return (
        f"LoRA adapter '{adapter}' was requested, but LoRA is not enabled. Please launch the server "
        "with --enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint."
    )


def _refusals(request: sidecar_pb2.PreprocessedRequest, settings: RequestSettings) -> None:
    if not request.token_ids:
        raise invalid_argument("token_ids", "the prompt must not be empty")
    adapter = request.routing.lora_name
    if adapter and settings.lora_enabled is False:
        # SGLang refuses it first, before it reads the prompt, but over gRPC with a bare INTERNAL
        # that nothing tells from a failure: refused here, in SGLang's words, on both wires.
        raise engine_words(
            FailureReason.INVALID_ARGUMENT, lora_disabled_refusal(adapter), "Generate", NOT_SENT
        )
    if settings.vocab_size is not None:
        outside = next((token for token in request.token_ids if token >= settings.vocab_size), None)
        if outside is not None:
            # SGLang's own check of the prompt's ids (its Rust HTTP server's; its default
            # servers make none, and the id reaches the model): refused here, in its words.
            raise engine_words(
                FailureReason.INVALID_ARGUMENT,
                out_of_vocabulary(outside, settings.vocab_size),
                "Generate",
                NOT_SENT,
            )
    check_sampling_limits(request, "sglang")
    s = request.sampling_options
    if s.HasField("n") and s.n != 1:
        raise invalid_argument("sampling_options.n", f"only n = 1 is supported by SGLang (got {s.n})")
    if s.HasField("best_of") and s.best_of != 1:
        raise invalid_argument("sampling_options.best_of", f"only best_of = 1 is supported (got {s.best_of})")
    if s.use_beam_search:
        raise invalid_argument("sampling_options.use_beam_search", "beam search is not supported")
    if s.HasField("length_penalty") and s.length_penalty != 1.0:
        raise invalid_argument("sampling_options.length_penalty", "only 1 is supported (no beam search)")
    if s.include_stop_str_in_output:
        raise invalid_argument(
            "sampling_options.include_stop_str_in_output", "not supported by SGLang's native API"
        )
    if s.logit_bias and settings.transport == "grpc":
        # SGLang's HTTP /generate takes logit_bias; its gRPC SamplingParams has no such field.
        raise invalid_argument("sampling_options.logit_bias", "SGLang's gRPC wire cannot carry it (HTTP can)")
    out = request.output_options
    if out.token_ids_logprob:
        if settings.transport == "grpc":
            # SGLang's HTTP /generate takes token_ids_logprob; its gRPC GenerateRequest does not.
            raise invalid_argument(
                "output_options.token_ids_logprob", "SGLang's gRPC wire cannot carry it (HTTP can)"
            )
        if not out.HasField("logprobs") and not out.HasField("prompt_logprobs"):
            # SGLang returns them only with the other logprobs (return_logprob).
            raise invalid_argument("output_options.token_ids_logprob", "needs logprobs or prompt_logprobs")
    if settings.transport == "grpc":
        # SGLang's gRPC GenerateRequest has no routed-experts fields (its HTTP /generate has);
        # a start of 0 is the default, and asks nothing.
        if out.HasField("return_routed_experts") and out.return_routed_experts:
            raise invalid_argument(
                "output_options.return_routed_experts", "SGLang's gRPC wire cannot carry it (HTTP can)"
            )
        if out.HasField("routed_experts_start_len") and out.routed_experts_start_len != 0:
            raise invalid_argument(
                "output_options.routed_experts_start_len", "SGLang's gRPC wire cannot carry it (HTTP can)"
            )
    bad_bias = next((b for b in s.logit_bias.values() if not math.isfinite(b)), None)
    if bad_bias is not None:
        # JSON has no NaN or infinity.
        raise invalid_argument("sampling_options.logit_bias", f"must be finite numbers (got {bad_bias})")
    # One rule for both sidecars: an empty namespace is no namespace.
    if request.routing.HasField("cache_namespace") and request.routing.cache_namespace:
        raise invalid_argument("routing.cache_namespace", "SGLang has no cache namespaces")
    guided = s.guided_decoding
    for name in ("backend", "whitespace_pattern"):
        if guided.HasField(name):
            raise invalid_argument(
                f"sampling_options.guided_decoding.{name}", "SGLang has no per-request choice"
            )
    if request.multi_modal_data and settings.transport == "grpc":
        raise invalid_argument("multi_modal_data", "media is not supported over SGLang's native gRPC")
    check_media(request.multi_modal_data)
    unknown = sorted(set(request.extra_args.fields) - _KNOWN_EXTRA_ARGS)
    if unknown:
        raise invalid_argument(f"extra_args.{unknown[0]}", "unknown key for SGLang")
    if settings.transport == "grpc":
        carried = sorted(set(request.extra_args.fields) & _KNOWN_EXTRA_ARGS)
        if carried:
            raise invalid_argument(
                f"extra_args.{carried[0]}", "SGLang's gRPC wire cannot carry it (HTTP can)"
            )
    bad = next((t for t in request.token_ids if t > INT32_MAX), None)
    if bad is not None:
        raise invalid_argument("token_ids", f"token ids must fit in int32 (got {bad})")


def _guided(s: sidecar_pb2.SamplingOptions) -> tuple[str | None, str | None]:
    if not s.HasField("guided_decoding"):
        return None, None
    kind = s.guided_decoding.WhichOneof("kind")
    if kind is None:
        return None, None
    if kind == "json":
        return s.guided_decoding.json, None
    if kind == "regex":
        return None, s.guided_decoding.regex
    raise invalid_argument(f"sampling_options.guided_decoding.{kind}", "SGLang accepts only json or regex")


def _sampling(request: sidecar_pb2.PreprocessedRequest, prefill: bool) -> NativeSampling:
    s = request.sampling_options
    stop = request.stop_conditions
    ignore_eos = stop.ignore_eos if stop.HasField("ignore_eos") else None
    hidden = () if ignore_eos else tuple(stop.stop_token_ids_hidden)
    stop_ids = _ordered_unique(stop.stop_token_ids, hidden)
    for token in stop_ids:
        _int32(token, "stop_conditions.stop_token_ids")
    max_new = _int32(stop.max_tokens, "stop_conditions.max_tokens") if stop.HasField("max_tokens") else None
    min_new = _int32(stop.min_tokens, "stop_conditions.min_tokens") if stop.HasField("min_tokens") else None
    if prefill:
        # The prefill half only computes the KV cache and hands it over: one token, no minimum.
        max_new, min_new = 1, None
    elif min_new is not None and max_new is None and min_new > SGLANG_DEFAULT_MAX_NEW_TOKENS:
        # SGLang refuses min_new_tokens above max_new_tokens, whose default applies when the
        # request names none (against a given max_tokens the limits table has checked it).
        raise invalid_argument(
            "stop_conditions.min_tokens",
            f"{min_new} is more than SGLang's default max_new_tokens ({SGLANG_DEFAULT_MAX_NEW_TOKENS})",
        )
    json_schema, regex = _guided(s)
    native = NativeSampling(
        temperature=_opt_float(s, "temperature"),
        top_p=_opt_float(s, "top_p"),
        top_k=s.top_k if s.HasField("top_k") else None,
        min_p=_opt_float(s, "min_p"),
        frequency_penalty=_opt_float(s, "frequency_penalty"),
        presence_penalty=_opt_float(s, "presence_penalty"),
        repetition_penalty=_opt_float(s, "repetition_penalty"),
        max_new_tokens=max_new,
        min_new_tokens=min_new,
        stop=tuple(stop.stop),
        stop_token_ids=stop_ids,
        ignore_eos=ignore_eos,
        json_schema=json_schema,
        regex=regex,
        seed=s.seed if s.HasField("seed") else None,
        logit_bias=tuple((token, _shortest_float32(bias)) for token, bias in sorted(s.logit_bias.items())),
    )
    return native


def _checked(host: str, port: int, room: int, where: str) -> Bootstrap:
    if not host.strip():
        raise invalid_argument(f"{where}.bootstrap_host", "must not be blank")
    if not 0 <= port <= PORT_MAX:
        raise invalid_argument(f"{where}.bootstrap_port", f"{port} does not fit in int32")
    if not 0 <= room <= ROOM_MAX:
        raise invalid_argument(f"{where}.bootstrap_room", f"{room} is out of range (0..2^63-1)")
    return Bootstrap(host, port, room)


def _from_params(params: struct_pb2.Struct) -> Bootstrap:
    """A 0.1 frontend's handoff: the triple in a Struct (accepted through 0.2.x)."""
    where = "prefill_result.disaggregated_params"
    try:
        info = bootstrap_handoff.from_struct(params)
    except bootstrap_handoff.HandoffError as err:
        raise invalid_argument(f"{where}.{err.key}", err.problem) from None
    return _checked(info.bootstrap_host, info.bootstrap_port, info.bootstrap_room, where)


def _bootstrap(
    request: sidecar_pb2.PreprocessedRequest, settings: RequestSettings, room: int
) -> Bootstrap | None:
    if settings.mode == "agg":
        return None
    if request.HasField("bootstrap_info"):
        info = request.bootstrap_info
        return _checked(info.bootstrap_host, info.bootstrap_port, info.bootstrap_room, "bootstrap_info")
    if request.HasField("prefill_result") and request.prefill_result.HasField("disaggregated_params"):
        return _from_params(request.prefill_result.disaggregated_params)
    if settings.mode == "prefill":
        if settings.bootstrap_host is None or settings.bootstrap_port is None:
            raise invalid_argument(
                "bootstrap_info", "the engine reported no bootstrap host/port to default to"
            )
        return _checked(settings.bootstrap_host, settings.bootstrap_port, room, "bootstrap_info")
    raise invalid_argument("prefill_result", "a decode request needs bootstrap_info or prefill_result")


def _check_dp_rank(rank: int, settings: RequestSettings, prefill_rank: bool) -> None:
    size = settings.dp_size
    # As SGLang's tokenizer manager: rank 0 on a single-rank engine is ignored, not refused.
    if size is None or (size <= 1 and rank == 0) or rank < size:
        return
    name = "routing.prefill_dp_rank" if prefill_rank else "routing.dp_rank"
    raise invalid_argument(name, f"{rank} is out of range (the engine has {max(size, 1)} dp ranks)")


def _check_context(prompt: int, max_new: int | None, context: int | None) -> None:
    # SGLang's tokenizer manager refuses both (over gRPC as INTERNAL): refuse them by name.
    if not context:
        return
    if prompt >= context:
        raise invalid_argument(
            "token_ids", f"the prompt ({prompt} tokens) must be shorter than the context ({context})"
        )
    if max_new is not None and prompt + max_new > context:
        raise invalid_argument(
            "stop_conditions.max_tokens",
            f"{prompt} prompt tokens + {max_new} exceed the context length ({context})",
        )


def _priority(request: sidecar_pb2.PreprocessedRequest, settings: RequestSettings) -> int | None:
    if not request.routing.HasField("priority"):
        return None
    value = request.routing.priority
    if settings.low_priority_values_first:
        # -(-2^31) does not fit in int32; the clamp keeps the order.
        return min(-value, INT32_MAX)
    return value


def _custom_params(extra: struct_pb2.Struct) -> Mapping[str, JSON] | None:
    """``extra_args.custom_params``: an object, numbers exact (``sidecar_common.structs``)."""
    if CUSTOM_PARAMS not in extra.fields:
        return None
    value = extra.fields[CUSTOM_PARAMS]
    if value.WhichOneof("kind") != "struct_value":
        raise invalid_argument(f"extra_args.{CUSTOM_PARAMS}", "must be an object")
    try:
        return json_from_struct(value.struct_value)
    except StructError as err:
        raise invalid_argument(f"extra_args.{CUSTOM_PARAMS}", str(err)) from None


def _sampling_mask(extra: struct_pb2.Struct) -> tuple[bool, str | None]:
    """``extra_args.return_sampling_mask`` (a bool) and ``sampling_logprobs_mode`` (one of
    SGLang's modes); SGLang refuses a mode without the mask, in its words."""
    fields = extra.fields
    asked = False
    if RETURN_SAMPLING_MASK in fields:
        value = fields[RETURN_SAMPLING_MASK]
        if value.WhichOneof("kind") != "bool_value":
            raise invalid_argument(f"extra_args.{RETURN_SAMPLING_MASK}", "must be a boolean")
        asked = value.bool_value
    mode: str | None = None
    if SAMPLING_LOGPROBS_MODE in fields:
        value = fields[SAMPLING_LOGPROBS_MODE]
        if value.WhichOneof("kind") != "string_value" or value.string_value not in _SAMPLING_LOGPROBS_MODES:
            raise invalid_argument(f"extra_args.{SAMPLING_LOGPROBS_MODE}", "must be 'selected' or 'support'")
        mode = value.string_value
    return asked, mode


def asks_one_answer(request: sidecar_pb2.PreprocessedRequest, mode: DisaggregationMode) -> bool:
    """Whether the engine is asked for one answer (``stream`` false) rather than a stream: when
    the caller wants one (``OutputOptions.unary``) on an aggregated worker. A prefill streams
    as always (over HTTP its handoff goes out as soon as SGLang admits it, which one answer
    would delay to the end), and so does a decode: the dispatcher holds a cancel until the
    decode's first token (its KV transfer), which one answer would show only at the end."""
    return request.output_options.unary and mode == "agg"


def build_native(
    request: sidecar_pb2.PreprocessedRequest, private_id: str, settings: RequestSettings, room: int
) -> NativeRequest:
    """Every request rule, once. ``room`` is the random room used only when a prefill request
    names no bootstrap of its own. Raises SidecarError(INVALID_ARGUMENT) naming the field."""
    if not private_id:
        # SGLang matches abort rids by prefix: an empty rid would match every request.
        raise invalid_argument("request_id", "the private id must not be empty")
    _refusals(request, settings)
    prefill = settings.mode == "prefill"
    out = request.output_options
    logprobs = out.logprobs if out.HasField("logprobs") else None
    prompt_logprobs = out.prompt_logprobs if out.HasField("prompt_logprobs") else None
    want = logprobs is not None or prompt_logprobs is not None
    routing = request.routing
    dp_rank: int | None = None
    if prefill and routing.HasField("prefill_dp_rank"):
        dp_rank = _int32(routing.prefill_dp_rank, "routing.prefill_dp_rank")
    elif routing.HasField("dp_rank"):
        dp_rank = _int32(routing.dp_rank, "routing.dp_rank")
    if dp_rank is not None:
        _check_dp_rank(dp_rank, settings, prefill and routing.HasField("prefill_dp_rank"))
    top = max(logprobs or 0, prompt_logprobs or 0)
    sampling = _sampling(request, prefill)
    _check_context(len(request.token_ids), sampling.max_new_tokens, settings.context_length)
    mask, mode = _sampling_mask(request.extra_args)
    return NativeRequest(
        rid=private_id,
        input_ids=tuple(request.token_ids),
        sampling=sampling,
        return_logprob=want,
        top_logprobs_num=_int32(top, "output_options.logprobs") if want else None,
        logprob_start_len=(0 if prompt_logprobs is not None else -1) if want else None,
        lora_path=routing.lora_name if routing.HasField("lora_name") else None,
        routed_dp_rank=dp_rank,
        priority=_priority(request, settings),
        bootstrap=_bootstrap(request, settings, room),
        media=tuple((_MEDIA_FIELDS[m.kind], m.url) for m in request.multi_modal_data),
        user_stop_token_ids=frozenset(request.stop_conditions.stop_token_ids),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        prefill=prefill,
        token_ids_logprob=tuple(out.token_ids_logprob),
        stream=not asks_one_answer(request, settings.mode),
        return_routed_experts=out.return_routed_experts,
        custom_params=_custom_params(request.extra_args),
        return_sampling_mask=mask,
        sampling_logprobs_mode=mode,
        routed_experts_start_len=(
            out.routed_experts_start_len if out.HasField("routed_experts_start_len") else None
        ),
    )


def _sampling_items(sampling: NativeSampling, *, http: bool) -> dict[str, object]:
    """The sampling parameters SGLang's two wires share, under each wire's names (the kernel's
    one list): what the request set, lists as lists."""
    items: dict[str, object] = {}
    for key in sampling_schema.GRPC_FIELDS:
        name = sampling_schema.grpc_name(key)
        value = getattr(sampling, name, None)  # NativeSampling holds no n: one choice a request
        if value is None or value == ():
            continue
        items[key if http else name] = list(value) if isinstance(value, tuple) else value
    return items


def _http_sampling(sampling: NativeSampling) -> dict[str, object]:
    # SGLang's HTTP schema refuses unknown keys; the seed is sampling_seed there (the gRPC
    # message calls it seed).
    items = _sampling_items(sampling, http=True)
    if sampling.logit_bias:
        # JSON object keys are text; SGLang reads them back with int() and checks them against
        # its vocabulary (a 400 in its own words when one is outside).
        items[sampling_schema.LOGIT_BIAS] = {str(token): bias for token, bias in sampling.logit_bias}
    return items


def to_grpc(native: NativeRequest) -> sglang_pb2.GenerateRequest:
    """The native gRPC message."""
    message = sglang_pb2.GenerateRequest(
        input_ids=native.input_ids,
        sampling_params=sglang_pb2.SamplingParams(**_sampling_items(native.sampling, http=False)),  # type: ignore[arg-type]
        stream=native.stream,
        rid=native.rid,
    )
    if native.return_logprob:
        message.return_logprob = True
        assert native.top_logprobs_num is not None
        assert native.logprob_start_len is not None
        message.top_logprobs_num = native.top_logprobs_num
        message.logprob_start_len = native.logprob_start_len
    if native.lora_path is not None:
        message.lora_path = native.lora_path
    if native.routed_dp_rank is not None:
        message.routed_dp_rank = native.routed_dp_rank
    if native.priority is not None:
        message.priority = native.priority
    if native.bootstrap is not None:
        b = native.bootstrap
        message.disaggregated_params.CopyFrom(
            sglang_pb2.DisaggregatedParams(
                bootstrap_host=b.host, bootstrap_port=b.port, bootstrap_room=b.room
            )
        )
    return message


def to_http_json(native: NativeRequest) -> dict[str, object]:
    """The ``POST /generate`` body, absent fields omitted."""
    sampling = _http_sampling(native.sampling)
    if native.custom_params is not None:
        sampling[CUSTOM_PARAMS] = dict(native.custom_params)
    body: dict[str, object] = {
        "input_ids": list(native.input_ids),
        "sampling_params": sampling,
        "stream": native.stream,
        "rid": native.rid,
    }
    if native.return_logprob:
        body["return_logprob"] = True
        body["top_logprobs_num"] = native.top_logprobs_num
        body["logprob_start_len"] = native.logprob_start_len
        if native.token_ids_logprob:
            body["token_ids_logprob"] = list(native.token_ids_logprob)
    optional: Mapping[str, object | None] = {
        "lora_path": native.lora_path,
        "routed_dp_rank": native.routed_dp_rank,
        "priority": native.priority,
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    if native.return_routed_experts:
        body["return_routed_experts"] = True
    if native.return_sampling_mask:
        body[RETURN_SAMPLING_MASK] = True
    if native.sampling_logprobs_mode is not None:
        body[SAMPLING_LOGPROBS_MODE] = native.sampling_logprobs_mode
    if native.routed_experts_start_len is not None:
        # Sent as asked, also without the flag: SGLang checks it either way, in its words.
        body["routed_experts_start_len"] = native.routed_experts_start_len
    if native.bootstrap is not None:
        body["bootstrap_host"] = native.bootstrap.host
        body["bootstrap_port"] = native.bootstrap.port
        body["bootstrap_room"] = native.bootstrap.room
    for name, url in native.media:
        urls = body.setdefault(name, [])
        assert isinstance(urls, list)
        urls.append(url)
    return body


def handoff_info(bootstrap: Bootstrap) -> sidecar_pb2.BootstrapInfo:
    """The prefill's handoff as the frontend passes it to the decode (``bootstrap_info``)."""
    return sidecar_pb2.BootstrapInfo(
        bootstrap_host=bootstrap.host, bootstrap_port=bootstrap.port, bootstrap_room=bootstrap.room
    )
