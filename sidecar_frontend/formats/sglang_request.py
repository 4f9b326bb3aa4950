"""SGLang ``/generate`` request -> ``sidecar.v1`` sub-requests (pure).

Order of judgment, as the real server's: the body must be JSON (gate 1), fit the request
model (gate 1) and the JSON contract (gate 2); then value checks in the order SGLang's
tokenizer manager makes them (batch shape, ids, then per prompt: context, sampling
``normalize`` then ``verify``), then what the scheduler would refuse at admission, then what
this frontend cannot carry (ours, naming the field). Every refusal happens before any
sub-request exists: nothing reaches a worker.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from sidecar_common.api import sidecar_pb2
from sidecar_frontend.formats.base import FormatContext, GenerateCall, HttpReply
from sidecar_frontend.formats.sglang_checks import check_contract, check_model
from sidecar_frontend.formats.sglang_wire import (
    ContractError,
    ParseError,
    ValueRefusal,
    contract_error,
    parse_error,
    value_error,
)

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "MAX_SAMPLES",
    "ItemPlan",
    "SglangOptions",
    "parse_generate",
]

DEFAULT_MAX_NEW_TOKENS: Final = 128
# Sub-requests per prompt: each costs a gRPC stream and per-item response state.
MAX_SAMPLES: Final = 1024
_UINT32_MAX: Final = 2**32 - 1
_INT32_MIN: Final = -(2**31)
_INT32_MAX: Final = 2**31 - 1
_INT64_MIN: Final = -(2**63)
_INT64_MAX: Final = 2**63 - 1
# SGLang: a temperature below this samples greedily (temperature 1, top_k 1).
_SAMPLING_EPS: Final = 1e-6
_TOP_K_ALL: Final = 1 << 30
# SGLang's scheduler: max_req_len = context - 1, max_req_input_len = max_req_len - 5.
_REQ_LEN_MARGIN: Final = 1
_INPUT_LEN_MARGIN: Final = 5

_NO_TOKENIZER: Final = (
    "The engine initialized with skip_tokenizer_init=True cannot accept text prompts. "
    "Please provide input_ids or re-initialize the engine with skip_tokenizer_init=False."
)
_ABSENT: Final = object()


@dataclass(frozen=True)
class ItemPlan:
    """What the encoder needs to answer for one sub-request."""

    rid: str
    prompt: tuple[int, ...]
    # The effective cap sent to the worker (None: unlimited); finish_reason.length reports it.
    max_new_tokens: int | None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # -1: output logprobs only; k >= 0: prompt logprobs for positions k..end.
    logprob_start_len: int = -1
    return_prompt_token_ids: bool = False
    # Streams: the first tokens at once, then an event once this many are unsent, and the end.
    stream_interval: int = 1


@dataclass(frozen=True)
class SglangOptions:
    items: tuple[ItemPlan, ...]
    # A list response (batch, or n > 1) whose stream events carry "index".
    batch: bool
    incremental: bool
    # Unix seconds at arrival (FormatContext.wall_time), for response_sent_to_client_ts.
    wall_time: float = 0.0


def _refuse(field: str, why: str) -> ValueRefusal:
    return ValueRefusal(f"{field} is not supported by this server: {why}")


def _load(body: bytes) -> dict[str, object]:
    def constant(name: str) -> object:
        raise ValueError(f"{name} is not valid JSON")

    try:
        data = json.loads(body.decode("utf-8"), parse_constant=constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise ParseError(
            "body", "json_invalid", f"JSON decode error: {err}", body[:100].decode(errors="replace")
        ) from None
    if not isinstance(data, dict):
        raise ParseError(
            "body", "dataclass_type", "Input should be a dictionary or an instance of GenerateReqInput", data
        )
    return data


def _json_content(headers: Mapping[str, str]) -> bool:
    """FastAPI parses the body as JSON when there is no content type or a JSON one."""
    value = next((v for k, v in headers.items() if k.lower() == "content-type"), "")
    media = value.split(";", 1)[0].strip().lower()
    return (
        not media
        or media == "application/json"
        or (media.startswith("application/") and media.endswith("+json"))
    )


def parse_generate(body: bytes, headers: Mapping[str, str], ctx: FormatContext) -> GenerateCall | HttpReply:
    try:
        if not _json_content(headers):
            text = body[:100].decode(errors="replace")
            raise ParseError(
                "body",
                "dataclass_type",
                "Input should be a dictionary or an instance of GenerateReqInput",
                text,
            )
        data = _load(body)
        check_model(data)
        check_contract(data)
    except ParseError as err:
        return parse_error(err)
    except ContractError as err:
        return contract_error(err)
    stream = data.get("stream") is True
    try:
        return _plan(data, ctx, stream)
    except ValueRefusal as err:
        return value_error(str(err), stream=stream)


# ------------------------------------------------------------------ request-level checks


def _per_item(
    data: Mapping[str, object], name: str, default: object, count: int, n: int, single: bool
) -> list[object]:
    """A logprob field: one value for all items, or a list with one per prompt."""
    value = data.get(name)
    if value is None:
        return [default] * count
    if not isinstance(value, list):
        return [value] * count
    if n > 1:
        raise ValueRefusal(f"Cannot use list {name} with parallel_sample_num > 1")
    if len(value) != count:
        what = "a single prompt takes one value" if single else "one value per prompt"
        raise ValueRefusal(f"The length of {name} should be equal to the batch size ({what}).")
    return list(value)


def _sample_count(sampling: object, single: bool) -> int:
    if isinstance(sampling, dict):
        n = sampling.get("n", 1)
    elif isinstance(sampling, list) and sampling:
        n = sampling[0].get("n", 1)
        for params in sampling:
            if params.get("n", 1) != n:
                raise ValueRefusal(
                    "The parallel_sample_num should be the same for all samples in sample params."
                )
    else:
        n = 1
    count = 1 if n is None else n
    assert isinstance(count, int)
    if count > MAX_SAMPLES:
        raise ValueRefusal(f"sampling_params.n must be at most {MAX_SAMPLES}, got {count}.")
    if count < 1 and not single:
        # SGLang fails such a batch with a 500.
        raise ValueRefusal(f"sampling_params.n must be at least 1 for a batch, got {count}.")
    return max(count, 1)


def _rids(
    data: Mapping[str, object], ctx: FormatContext, prompts: int, expanded: int, single: bool
) -> list[str]:
    rid = data.get("rid")
    if single:
        if isinstance(rid, list):
            raise ValueRefusal("rid must be a string for a single prompt, got a list.")
        return [rid or ctx.new_id()] if isinstance(rid, str) else [ctx.new_id()]
    if rid is None:
        return [ctx.new_id() for _ in range(expanded)]
    if isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(expanded)]
    assert isinstance(rid, list)
    if len(rid) != prompts:
        raise ValueRefusal("The specified rids length mismatch with the batch_size for batch processing.")
    counts = Counter(rid)
    duplicates = [item for item, count in counts.items() if count > 1]
    if duplicates:
        raise ValueRefusal(f"Duplicate request IDs detected within the request: {duplicates}")
    return [item or ctx.new_id() for item in rid]


def _lora(data: Mapping[str, object], prompts: int, single: bool) -> list[str | None]:
    lora = data.get("lora_path")
    if lora is None or isinstance(lora, str):
        return [lora] * prompts
    assert isinstance(lora, list)
    if single:
        raise ValueRefusal("lora_path must be a string for a single prompt, got a list.")
    if len(lora) != prompts:
        raise ValueRefusal("The length of lora_path should be equal to the batch size.")
    return [item if isinstance(item, str) else None for item in lora]


def _truthy(value: object) -> bool:
    if isinstance(value, list):
        return any(_truthy(item) for item in value)
    return bool(value)


# Fields a client could send that we cannot carry, or that only a router inside an SGLang
# deployment may set: refused by name when set (null, false and "" are the defaults).
_REFUSED: Final[Mapping[str, str]] = {
    "image_data": "multimodal input is not carried by this frontend",
    "video_data": "multimodal input is not carried by this frontend",
    "audio_data": "multimodal input is not carried by this frontend",
    "bootstrap_host": "disaggregation is arranged by the sidecars, not by the client",
    "bootstrap_port": "disaggregation is arranged by the sidecars, not by the client",
    "bootstrap_room": "disaggregation is arranged by the sidecars, not by the client",
    "bootstrap_pair_key": "disaggregation is arranged by the sidecars, not by the client",
    "decode_tp_size": "disaggregation is arranged by the sidecars, not by the client",
    "routed_dp_rank": "the frontend chooses the worker; a data-parallel rank cannot be routed",
    "data_parallel_rank": "the frontend chooses the worker; a data-parallel rank cannot be routed",
    "disagg_prefill_dp_rank": "disaggregation is arranged by the sidecars, not by the client",
    "routing_key": "the frontend chooses the worker",
    "kv_hints": "KV hints are set by an orchestrator inside an SGLang deployment",
    "session_params": "sessions are not carried by this frontend",
    "session_id": "sessions are not carried by this frontend",
    "extra_key": "cache keys are not carried by this frontend",
    "cache_salt": "cache namespaces are not carried by this frontend",
    "token_ids_logprob": "logprobs of chosen token ids are not carried by this frontend",
    "return_sampling_mask": "sampling masks are not carried by this frontend",
    "return_flat_raw_top_logprobs": "flat logprob arrays are not produced by this frontend",
    "return_flat_raw_output_top_logprobs": "flat logprob arrays are not produced by this frontend",
    "return_flat_raw_top_logprobs_b64": "flat logprob arrays are not produced by this frontend",
    "require_reasoning": "reasoning control is not carried by this frontend",
    "positional_embed_overrides": "embedding overrides are not carried by this frontend",
}


def _refusals(data: Mapping[str, object]) -> None:
    if data.get("max_thinking_tokens") is not None:
        raise ValueRefusal(
            "max_thinking_tokens requires the server to be launched with --enable-strict-thinking"
        )
    priority = data.get("priority")
    if isinstance(priority, int) and not _INT64_MIN <= priority <= _INT64_MAX:
        raise ValueRefusal(
            "priority must be a signed 64-bit integer between -9223372036854775808 and 9223372036854775807"
        )
    if _truthy(data.get("return_hidden_states")):
        raise ValueRefusal(
            "The server is not configured to return hidden states. Please set "
            "`--return-hidden-states-mode last`, `--return-hidden-states-mode full`, or the legacy "
            "`--enable-return-hidden-states` flag."
        )
    if _truthy(data.get("custom_logit_processor")):
        raise ValueRefusal(
            "The server is not configured to enable custom logit processor. "
            "Please set `--enable-custom-logit-processor` to enable this feature."
        )
    for name, why in _REFUSED.items():
        if _truthy(data.get(name)):
            raise _refuse(name, why)
    if isinstance(priority, int) and not _INT32_MIN <= priority <= _INT32_MAX:
        raise _refuse("priority", f"it must fit in 32 bits to reach the engine, got {priority}")


# ------------------------------------------------------------------ per-prompt checks


def _check_prompt(index: int | None, prompt: Sequence[int]) -> None:
    where = "input_ids" if index is None else f"input_ids[{index}]"
    if not prompt:
        raise ValueRefusal(f"{where} cannot be empty.")
    bad = next((t for t in prompt if not 0 <= t <= _UINT32_MAX), None)
    if bad is not None:
        raise ValueRefusal(f"{where} contains {bad}, which is not a token id (0 to {_UINT32_MAX}).")


def _max_new_tokens(params: Mapping[str, object], prompt_len: int, context: int) -> int | None:
    """The effective cap: SGLang's default 128, null = unlimited, both capped by the context."""
    raw = params.get("max_new_tokens", _ABSENT)
    wanted: int | None = DEFAULT_MAX_NEW_TOKENS if raw is _ABSENT else raw  # type: ignore[assignment]
    if context:
        if prompt_len >= context:
            raise ValueRefusal(
                f"The input ({prompt_len} tokens) is longer than the model's context length "
                f"({context} tokens)."
            )
        if raw is not _ABSENT and wanted is not None and wanted + prompt_len > context:
            raise ValueRefusal(
                "Requested token count exceeds the model's maximum context length "
                f"of {context} tokens. You requested a total of {wanted + prompt_len} "
                f"tokens: {prompt_len} tokens from the input messages and "
                f"{wanted} tokens for the completion. Please reduce the number "
                "of tokens in the input messages or the completion to fit within the limit."
            )
    return wanted


def _normalize(params: Mapping[str, object]) -> None:
    """SGLang's SamplingParams.normalize with no tokenizer."""
    for name in ("stop", "stop_regex"):
        value = params.get(name)
        listed = [value] if isinstance(value, str) else value
        if listed:
            raise ValueRefusal(
                f"{name}={listed!r} is unavailable when skip_tokenizer_init=True "
                "(requires tokenizer to decode tokens to text for matching)."
            )
    min_new = params.get("min_new_tokens")
    if isinstance(min_new, int) and min_new > 0:
        raise ValueRefusal(
            f"min_new_tokens={min_new} is unavailable when skip_tokenizer_init=True "
            "(requires tokenizer for eos_token_id)."
        )


def _value(params: Mapping[str, object], name: str, default: float) -> float:
    value = params.get(name)
    return default if value is None else value  # type: ignore[return-value]


def _verify(params: Mapping[str, object], max_new: int | None, vocab_size: int) -> None:
    """SGLang's SamplingParams.verify, after its defaults and greedy rewrite."""
    beam_width = params.get("beam_width")
    if isinstance(beam_width, int) and beam_width < 1:
        raise ValueRefusal(f"beam_width must be at least 1, got {beam_width}.")
    temperature = _value(params, "temperature", 1.0)
    top_k = _value(params, "top_k", -1)
    if 0 <= temperature < _SAMPLING_EPS:
        temperature, top_k = 1.0, 1
    if top_k == -1:
        top_k = _TOP_K_ALL
    if not math.isfinite(temperature) or temperature < 0.0:
        raise ValueRefusal(f"temperature must be a non-negative finite number, got {temperature}.")
    top_p = _value(params, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise ValueRefusal(f"top_p must be in (0, 1], got {top_p}.")
    min_p = _value(params, "min_p", 0.0)
    if not 0.0 <= min_p <= 1.0:
        raise ValueRefusal(f"min_p must be in [0, 1], got {min_p}.")
    if top_k < 1:
        raise ValueRefusal(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    for name in ("frequency_penalty", "presence_penalty"):
        value = _value(params, name, 0.0)
        if not -2.0 <= value <= 2.0:
            raise ValueRefusal(f"{name} must be in [-2, 2], got {value}.")
    repetition = _value(params, "repetition_penalty", 1.0)
    if not 0.0 < repetition <= 2.0:
        raise ValueRefusal(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {repetition}.")
    min_new = _value(params, "min_new_tokens", 0)
    if min_new < 0:
        raise ValueRefusal(f"min_new_tokens must be in [0, max_new_tokens], got {min_new}.")
    if max_new is not None and max_new < 0:
        raise ValueRefusal(f"max_new_tokens must be at least 0, got {max_new}.")
    bias = params.get("logit_bias")
    if isinstance(bias, dict):
        for key in bias:
            token = _int_or_refuse(key)
            if vocab_size and not 0 <= token < vocab_size:
                raise ValueRefusal(f"logit_bias must has keys in [0, {vocab_size - 1}], got {key}.")
    seed = params.get("sampling_seed")
    if isinstance(seed, int) and not _INT64_MIN <= seed <= _INT64_MAX:
        raise ValueRefusal(f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}.")
    grammars = [params.get(name) or None for name in ("json_schema", "regex", "ebnf", "structural_tag")]
    if sum(g is not None for g in grammars) > 1:
        raise ValueRefusal("Only one of json_schema, regex, ebnf, or structural_tag can be set.")


def _int_or_refuse(key: str) -> int:
    # SGLang calls int() on the key: its ValueError text is the 400 message.
    try:
        return int(key)
    except ValueError as err:
        raise ValueRefusal(str(err)) from None


def _cannot_carry(params: Mapping[str, object]) -> None:
    if params.get("custom_params") is not None:
        raise _refuse("sampling_params.custom_params", "no worker accepts custom logit-processor parameters")
    if params.get("watermark") is not None:
        raise _refuse("sampling_params.watermark", "watermarking is not carried by this frontend")
    if params.get("choice"):
        raise _refuse("sampling_params.choice", "choice constraints are not carried by this frontend")
    beam_width = params.get("beam_width")
    if isinstance(beam_width, int) and beam_width > 1:
        raise _refuse("sampling_params.beam_width", "beam search is not carried by this frontend")
    for token in params.get("stop_token_ids") or ():  # type: ignore[attr-defined]
        if not 0 <= token <= _UINT32_MAX:
            raise _refuse("sampling_params.stop_token_ids", f"{token} is not a token id (0 to {_UINT32_MAX})")


# ------------------------------------------------------------------ building sub-requests


def _sampling_options(params: Mapping[str, object], out: sidecar_pb2.SamplingOptions) -> None:
    for name in ("top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        value = params.get(name)
        if value is not None:
            setattr(out, name, float(value))  # type: ignore[arg-type]
    temperature = params.get("temperature")
    greedy = isinstance(temperature, int | float) and 0 <= temperature < _SAMPLING_EPS
    if temperature is not None:
        out.temperature = float(temperature)  # type: ignore[arg-type]
    top_k = params.get("top_k")
    if isinstance(top_k, int):
        # SGLang itself samples greedily with top_k 1 there; a top_k past int32 means "all".
        out.top_k = 1 if greedy else (-1 if top_k > _INT32_MAX else top_k)
    seed = params.get("sampling_seed")
    if isinstance(seed, int):
        out.seed = seed
    bias = params.get("logit_bias")
    if isinstance(bias, dict):
        for key, value in bias.items():
            out.logit_bias[int(key)] = float(value)
    guided = out.guided_decoding
    if params.get("json_schema"):
        guided.json = str(params["json_schema"])
    elif params.get("regex"):
        guided.regex = str(params["regex"])
    elif params.get("ebnf"):
        guided.grammar = str(params["ebnf"])
    elif params.get("structural_tag"):
        guided.structural_tag = str(params["structural_tag"])


def _stop_conditions(
    params: Mapping[str, object], max_new: int | None, out: sidecar_pb2.StopConditions
) -> None:
    if max_new is not None:
        out.max_tokens = max_new
    ignore_eos = params.get("ignore_eos")
    if isinstance(ignore_eos, bool):
        out.ignore_eos = ignore_eos
    if ignore_eos is not True:
        # SGLang's scheduler skips the stop-token check under ignore_eos: so do we, for
        # every engine behind the frontend.
        stops = params.get("stop_token_ids") or []
        assert isinstance(stops, list)
        out.stop_token_ids.extend(dict.fromkeys(stops))


def _stream_interval(params: Mapping[str, object]) -> int:
    interval = params.get("stream_interval")
    return interval if isinstance(interval, int) and interval > 1 else 1


def _effective_cap(wanted: int | None, prompt_len: int, context: int) -> int | None:
    if not context:
        if wanted is not None and wanted > _UINT32_MAX:
            raise _refuse("sampling_params.max_new_tokens", f"at most {_UINT32_MAX}, got {wanted}")
        return wanted
    cap = max(0, context - _REQ_LEN_MARGIN - prompt_len - 1)
    return cap if wanted is None else min(wanted, cap)


def _scheduler_checks(prompt_len: int, context: int, logprob: bool, start: int) -> None:
    if context and prompt_len >= context - _REQ_LEN_MARGIN - _INPUT_LEN_MARGIN:
        limit = context - _REQ_LEN_MARGIN - _INPUT_LEN_MARGIN
        raise ValueRefusal(
            f"Input length ({prompt_len} tokens) exceeds the maximum allowed length ({limit} tokens). "
            "Use a shorter input or enable --allow-auto-truncate."
        )
    if logprob and start < -1:
        raise _refuse("logprob_start_len", f"it must be -1 or at least 0, got {start}")
    if logprob and start > prompt_len:
        raise ValueRefusal(
            f"req.logprob_start_len={start} is higher than the number of input tokens "
            f"len(req.origin_input_ids)={prompt_len}. Please use a smaller logprob_start_len."
        )


def _plan(data: Mapping[str, object], ctx: FormatContext, stream: bool) -> GenerateCall:
    input_ids = data.get("input_ids")
    text, embeds = data.get("text"), data.get("input_embeds")
    if (input_ids is None and text is None and embeds is None) or (
        input_ids is not None and text is not None and embeds is not None
    ):
        raise ValueRefusal("Either text, input_ids or input_embeds should be provided.")
    if input_ids is None:
        if text is not None:
            raise ValueRefusal(_NO_TOKENIZER)
        raise _refuse("input_embeds", "only token ids are carried to the workers")
    assert isinstance(input_ids, list)
    if not input_ids:
        raise ValueRefusal("input_ids cannot be empty.")
    single = isinstance(input_ids[0], int)
    prompts: list[list[int]] = [input_ids] if single else input_ids
    sampling = data.get("sampling_params")
    if single and isinstance(sampling, list):
        raise ValueRefusal("sampling_params must be an object for a single prompt, got a list.")
    n = _sample_count(sampling, single)
    batch = not single or n > 1
    count = len(prompts)
    rids = _rids(data, ctx, count, count * n, single and n == 1)
    loras = _lora(data, count, single)
    if isinstance(sampling, list) and len(sampling) != count:
        raise ValueRefusal("The length of sampling_params should be equal to the batch size.")
    # The type gates made sampling_params an object, a list of objects, or null.
    shared: Mapping[str, object] = sampling if isinstance(sampling, dict) else {}
    per_prompt: list[Mapping[str, object]] = sampling if isinstance(sampling, list) else [shared] * count
    logprob = _per_item(data, "return_logprob", False, count, n, single)
    start = _per_item(data, "logprob_start_len", -1, count, n, single)
    top = _per_item(data, "top_logprobs_num", 0, count, n, single)
    _refusals(data)
    for rid in rids:
        if rid in ctx.inflight_ids:
            raise ValueRefusal(f"Duplicate request ID detected: {rid}")
    info = ctx.model_info
    context = info.max_context_length
    requests: list[sidecar_pb2.PreprocessedRequest] = []
    items: list[ItemPlan] = []
    for i, prompt in enumerate(prompts):
        params = per_prompt[i]
        _check_prompt(None if single else i, prompt)
        wanted = _max_new_tokens(params, len(prompt), context)
        _normalize(params)
        _verify(params, wanted, info.vocab_size)
        want_logprob = bool(logprob[i])
        start_len = start[i] if want_logprob else -1
        assert isinstance(start_len, int)
        _scheduler_checks(len(prompt), context, want_logprob, start_len)
        _cannot_carry(params)
        top_n = top[i] if want_logprob else 0
        assert isinstance(top_n, int)
        if top_n < 0 or top_n > _INT32_MAX:
            raise _refuse("top_logprobs_num", f"it must be between 0 and {_INT32_MAX}, got {top_n}")
        cap = _effective_cap(wanted, len(prompt), context)
        template = sidecar_pb2.PreprocessedRequest(
            model=info.served_model_name, token_ids=prompt, eos_token_ids=info.eos_token_ids
        )
        _stop_conditions(params, cap, template.stop_conditions)
        _sampling_options(params, template.sampling_options)
        if want_logprob:
            template.output_options.logprobs = top_n
            if 0 <= start_len < len(prompt):
                template.output_options.prompt_logprobs = top_n
        if loras[i] is not None:
            template.routing.lora_name = loras[i]  # type: ignore[assignment]
        priority = data.get("priority")
        if isinstance(priority, int):
            template.routing.priority = priority
        for _ in range(n):
            # SGLang gives every parallel sample a fresh id (the client's rid is not used).
            rid = ctx.new_id() if n > 1 else rids[i]
            request = sidecar_pb2.PreprocessedRequest()
            request.CopyFrom(template)
            request.request_id = rid
            requests.append(request)
            items.append(
                ItemPlan(
                    rid=rid,
                    prompt=tuple(prompt),
                    max_new_tokens=cap,
                    return_logprob=want_logprob,
                    top_logprobs_num=top_n,
                    logprob_start_len=start_len,
                    return_prompt_token_ids=data.get("return_prompt_token_ids") is True,
                    stream_interval=_stream_interval(params),
                )
            )
    options = SglangOptions(
        items=tuple(items),
        batch=batch,
        incremental=ctx.sglang_incremental_streaming_output,
        wall_time=ctx.wall_time,
    )
    return GenerateCall(requests=tuple(requests), stream=stream, options=options)
