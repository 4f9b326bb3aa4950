"""SGLang's value checks for one ``/generate`` request (pure), in the order its tokenizer
manager and scheduler make them, with their texts; then ours, for what this frontend cannot
carry (a 400 naming the field). Each raises :class:`ValueRefusal`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Final

from sidecar_common.structs import StructError, struct_from_json
from sidecar_frontend.formats.sglang.wire import ValueRefusal

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "INT32_MAX",
    "SAMPLING_EPS",
    "cannot_carry",
    "check_chosen_ids",
    "check_prompt",
    "effective_cap",
    "max_new_tokens",
    "normalize",
    "refuse",
    "request_refusals",
    "scheduler_checks",
    "utf8",
    "verify",
]

DEFAULT_MAX_NEW_TOKENS: Final = 128
_UINT32_MAX: Final = 2**32 - 1
_INT32_MIN: Final = -(2**31)
INT32_MAX: Final = 2**31 - 1
_INT64_MIN: Final = -(2**63)
_INT64_MAX: Final = 2**63 - 1
# SGLang: a temperature below this samples greedily (temperature 1, top_k 1).
SAMPLING_EPS: Final = 1e-6
_TOP_K_ALL: Final = 1 << 30
# SGLang's scheduler: max_req_len = context - 1, max_req_input_len = max_req_len - 5.
_REQ_LEN_MARGIN: Final = 1
_INPUT_LEN_MARGIN: Final = 5

_FLOAT32_MAX: Final = 3.4028234663852886e38
_ABSENT: Final = object()


def refuse(field: str, why: str) -> ValueRefusal:
    return ValueRefusal(f"{field} is not supported by this server: {why}")


def _truthy(value: object) -> bool:
    """Set to something other than a default (null, false, "", 0), or a list holding one
    (in a list, only null, false and "" are defaults: 0 is a token id or a room there)."""
    if isinstance(value, list):
        return any(not (item is None or item is False or item == "") for item in value)
    return bool(value)


def as_float(value: object) -> float:
    """A JSON number as a float; an integer beyond any double counts as infinite."""
    assert isinstance(value, int | float)
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def fits_float32(value: float) -> bool:
    return math.isfinite(value) and abs(value) <= _FLOAT32_MAX


def utf8(value: object, field: str) -> None:
    """A string we forward must be valid UTF-8 (JSON allows lone surrogates; protobuf does not)."""
    texts = value if isinstance(value, list) else [value]
    for text in texts:
        if isinstance(text, str):
            try:
                text.encode()
            except UnicodeEncodeError:
                raise refuse(field, "it is not valid Unicode text (a lone surrogate)") from None


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
    "return_flat_raw_top_logprobs": "flat logprob arrays are not produced by this frontend",
    "return_flat_raw_output_top_logprobs": "flat logprob arrays are not produced by this frontend",
    "return_flat_raw_top_logprobs_b64": "flat logprob arrays are not produced by this frontend",
    "require_reasoning": "reasoning control is not carried by this frontend",
    "positional_embed_overrides": "embedding overrides are not carried by this frontend",
}


def request_refusals(data: Mapping[str, object]) -> None:
    start = data.get("routed_experts_start_len")
    if isinstance(start, int) and not _INT32_MIN <= start <= INT32_MAX:
        # sidecar.v1 carries it as an int32; SGLang refuses any start past the prompt anyway.
        raise refuse("routed_experts_start_len", f"{start} does not fit in 32 bits")
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
            raise refuse(name, why)
    if isinstance(priority, int) and not _INT32_MIN <= priority <= INT32_MAX:
        raise refuse("priority", f"it must fit in 32 bits to reach the engine, got {priority}")


# ------------------------------------------------------------------ per-prompt checks


def check_prompt(index: int | None, prompt: Sequence[int]) -> None:
    where = "input_ids" if index is None else f"input_ids[{index}]"
    if not prompt:
        raise ValueRefusal(f"{where} cannot be empty.")
    bad = next((t for t in prompt if not 0 <= t <= _UINT32_MAX), None)
    if bad is not None:
        raise ValueRefusal(f"{where} contains {bad}, which is not a token id (0 to {_UINT32_MAX}).")


def check_chosen_ids(ids: object, vocab_size: int) -> None:
    """SGLang's check of one prompt's token_ids_logprob (after its length checks)."""
    if not ids:
        return
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise ValueRefusal("token_ids_logprob must be a flat list of integers.")
    for token in ids:
        if vocab_size and not 0 <= token < vocab_size:
            raise ValueRefusal(
                f"token_ids_logprob contains out-of-vocabulary token id {token}; "
                f"valid range is [0, {vocab_size})."
            )
        if not 0 <= token <= _UINT32_MAX:
            raise refuse("token_ids_logprob", f"{token} is not a token id (0 to {_UINT32_MAX})")


def max_new_tokens(params: Mapping[str, object], prompt_len: int, context: int) -> int | None:
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


def normalize(params: Mapping[str, object]) -> None:
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


def verify(params: Mapping[str, object], max_new: int | None, vocab_size: int) -> None:
    """SGLang's SamplingParams.verify, after its defaults and greedy rewrite."""
    beam_width = params.get("beam_width")
    if isinstance(beam_width, int) and beam_width < 1:
        raise ValueRefusal(f"beam_width must be at least 1, got {beam_width}.")
    shown = _value(params, "temperature", 1.0)
    temperature = as_float(shown)
    top_k = _value(params, "top_k", -1)
    if 0 <= temperature < SAMPLING_EPS:
        shown, temperature, top_k = 1.0, 1.0, 1
    if top_k == -1:
        top_k = _TOP_K_ALL
    if not math.isfinite(temperature) or temperature < 0.0:
        raise ValueRefusal(f"temperature must be a non-negative finite number, got {shown}.")
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
            token = _int_orrefuse(key)
            if vocab_size and not 0 <= token < vocab_size:
                raise ValueRefusal(f"logit_bias must has keys in [0, {vocab_size - 1}], got {key}.")
    seed = params.get("sampling_seed")
    if isinstance(seed, int) and not _INT64_MIN <= seed <= _INT64_MAX:
        raise ValueRefusal(f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}.")
    grammars = [params.get(name) or None for name in ("json_schema", "regex", "ebnf", "structural_tag")]
    if sum(g is not None for g in grammars) > 1:
        raise ValueRefusal("Only one of json_schema, regex, ebnf, or structural_tag can be set.")


def _int_orrefuse(key: str) -> int:
    # SGLang calls int() on the key: its ValueError text is the 400 message.
    try:
        return int(key)
    except ValueError as err:
        raise ValueRefusal(str(err)) from None


def cannot_carry(params: Mapping[str, object]) -> None:
    custom = params.get("custom_params")
    if custom is not None:
        # Carried to the worker as extra_args.custom_params (a worker whose wire has no such
        # field refuses it by name): an object whose numbers a Struct holds exactly.
        if not isinstance(custom, dict):
            raise refuse("sampling_params.custom_params", "must be an object")
        try:
            struct_from_json(custom)
        except StructError as err:
            raise refuse("sampling_params.custom_params", str(err)) from None
    if params.get("watermark") is not None:
        raise refuse("sampling_params.watermark", "watermarking is not carried by this frontend")
    if params.get("choice"):
        raise refuse("sampling_params.choice", "choice constraints are not carried by this frontend")
    beam_width = params.get("beam_width")
    if isinstance(beam_width, int) and beam_width > 1:
        raise refuse("sampling_params.beam_width", "beam search is not carried by this frontend")
    for token in params.get("stop_token_ids") or ():  # type: ignore[attr-defined]
        if not 0 <= token <= _UINT32_MAX:
            raise refuse("sampling_params.stop_token_ids", f"{token} is not a token id (0 to {_UINT32_MAX})")
    temperature = params.get("temperature")
    if temperature is not None and not fits_float32(as_float(temperature)):
        raise refuse("sampling_params.temperature", f"{temperature} does not fit in 32 bits")
    bias = params.get("logit_bias")
    if isinstance(bias, dict):
        for key, value in bias.items():
            if not 0 <= int(key) <= _UINT32_MAX:
                raise refuse("sampling_params.logit_bias", f"{key} is not a token id (0 to {_UINT32_MAX})")
            if not fits_float32(as_float(value)):
                raise refuse("sampling_params.logit_bias", f"the bias {value} does not fit in 32 bits")
    for name in ("json_schema", "regex", "ebnf", "structural_tag"):
        utf8(params.get(name), f"sampling_params.{name}")


def effective_cap(wanted: int | None, prompt_len: int, context: int) -> int | None:
    if not context:
        if wanted is not None and wanted > _UINT32_MAX:
            raise refuse("sampling_params.max_new_tokens", f"at most {_UINT32_MAX}, got {wanted}")
        return wanted
    cap = max(0, context - _REQ_LEN_MARGIN - prompt_len - 1)
    return cap if wanted is None else min(wanted, cap)


def scheduler_checks(prompt_len: int, context: int, logprob: bool, start: int) -> None:
    if context and prompt_len >= context - _REQ_LEN_MARGIN - _INPUT_LEN_MARGIN:
        limit = context - _REQ_LEN_MARGIN - _INPUT_LEN_MARGIN
        raise ValueRefusal(
            f"Input length ({prompt_len} tokens) exceeds the maximum allowed length ({limit} tokens). "
            "Use a shorter input or enable --allow-auto-truncate."
        )
    if logprob and start < -1:
        raise refuse("logprob_start_len", f"it must be -1 or at least 0, got {start}")
    if logprob and start > prompt_len:
        raise ValueRefusal(
            f"req.logprob_start_len={start} is higher than the number of input tokens "
            f"len(req.origin_input_ids)={prompt_len}. Please use a smaller logprob_start_len."
        )
