"""vLLM's ``sampling_params`` object: coerced, checked and carried onto ``sidecar.v1`` (pure).

The checks are vLLM's ``SamplingParams`` ones, in its order (the first failure is the
answer, in vLLM's ``BadRequestError`` form). :meth:`SamplingParams.fill` sets only the keys
the caller sent: the proto3 ``optional`` fields of the others stay absent, so the engine
applies its own defaults, as vLLM does for a key the client did not send.
"""

from __future__ import annotations

from typing import Final, TypeVar

from sidecar_common.api import sidecar_pb2
from sidecar_frontend.formats.vllm_errors import Refused, ValidationIssue, bad_request, uncarried
from sidecar_frontend.formats.vllm_lax import (
    Fields,
    Invalid,
    as_bool,
    as_dict,
    as_float,
    as_int,
    as_int_list,
    as_str_list,
    nullable,
)

__all__ = ["UINT32_MAX", "SamplingParams", "not_an_instance"]

T = TypeVar("T")

UINT32_MAX: Final = 2**32 - 1
_INT32: Final = (-(2**31), 2**31 - 1)
_INT64: Final = (-(2**63), 2**63 - 1)
_MAX_N: Final = 16384  # vLLM's VLLM_MAX_N_SEQUENCES default
_FLOAT32_MAX: Final = 3.4028234663852886e38
_GREEDY_EPSILON: Final = 1e-5  # vLLM's _SAMPLING_EPS: below it, sampling is greedy

# Sampling parameters vLLM accepts that cannot travel to a vLLM sidecar (no field on the
# sidecar.v1 wire, or they need a tokenizer the engine does not load): refused by name when set.
_UNCARRIED: Final = (
    ("logprob_token_ids", "scoring chosen token ids is not carried to the engine"),
    ("prompt_logprob_token_ids", "scoring chosen prompt token ids is not carried to the engine"),
    ("prompt_logprob_start", "a prompt-logprob start offset is not carried to the engine"),
    ("allowed_token_ids", "an allowed-token list is not carried to the engine"),
    ("thinking_token_budget", "this server has no reasoning configuration"),
    ("repetition_detection", "repetition detection is not carried to the engine"),
    ("trace_decode_token_ids", "decode tracing is not carried to the engine"),
)


class SamplingParams:
    """``sampling_params`` coerced field by field, then checked as vLLM's SamplingParams is."""

    def __init__(self, data: dict[str, object], parent: Fields) -> None:
        f = Fields(data, "body.sampling_params")
        self._fields = f
        self._n = f.get("n", as_int)
        self.n = 1
        self.presence_penalty = f.get("presence_penalty", as_float)
        self.frequency_penalty = f.get("frequency_penalty", as_float)
        self.repetition_penalty = f.get("repetition_penalty", as_float)
        self.temperature = f.get("temperature", as_float)
        f.get("watermarking", nullable(as_bool))
        self.top_p = f.get("top_p", as_float)
        self.top_k = f.get("top_k", as_int)
        self.min_p = f.get("min_p", as_float)
        self.seed = f.get("seed", nullable(as_int))
        self.stop = f.get("stop", nullable(_stop))
        self.stop_token_ids = f.get("stop_token_ids", nullable(as_int_list))
        self.ignore_eos = f.get("ignore_eos", as_bool)
        self.max_tokens = f.get("max_tokens", nullable(as_int))
        self.min_tokens = f.get("min_tokens", as_int)
        self.logprobs = f.get("logprobs", nullable(as_int))
        self.prompt_logprobs = f.get("prompt_logprobs", nullable(as_int))
        f.get("prompt_logprob_start", nullable(as_int))
        f.get("logprob_token_ids", nullable(as_int_list))
        f.get("flat_logprobs", as_bool)
        detokenize = f.get("detokenize", as_bool)
        self.detokenize = True if detokenize is None else detokenize
        self.skip_special_tokens = f.get("skip_special_tokens", as_bool)
        f.get("spaces_between_special_tokens", as_bool)
        self.include_stop_str_in_output = f.get("include_stop_str_in_output", as_bool)
        self.stream_interval = f.get("stream_interval", nullable(as_int))
        f.get("skip_reading_prefix_cache", nullable(as_bool))
        self.logit_bias = f.get("logit_bias", nullable(_logit_bias))
        f.get("allowed_token_ids", nullable(as_int_list))
        self.extra_args = f.get("extra_args", nullable(as_dict))
        self.bad_words = f.get("bad_words", nullable(as_str_list))
        if f.issues:
            # vLLM's schema is "a SamplingParams instance, or an object": both branches report.
            parent.issues.append(not_an_instance(data, f.loc))
            parent.issues.extend(f.issues)
        else:
            self._verify()

    def present(self, name: str) -> bool:
        return self._fields.present(name)

    def raw(self, name: str) -> object:
        return self._fields.raw(name)

    def _verify(self) -> None:
        """vLLM's SamplingParams checks, in its order: the first failure is the answer."""
        n = _or(self._n, 1)
        self.n = n
        if self.seed == -1:
            self.seed = None
        if n < 1:
            raise Refused(bad_request(f"n must be at least 1, got {n}."))
        if n > _MAX_N:
            raise Refused(
                bad_request(
                    f"n must be at most {_MAX_N}, got {n}. "
                    "To increase this limit, set the VLLM_MAX_N_SEQUENCES environment variable."
                )
            )
        if self.extra_args:
            _check_extra_args(self.extra_args)
        presence = _or(self.presence_penalty, 0.0)
        if not -2.0 <= presence <= 2.0:
            raise Refused(bad_request(f"presence_penalty must be in [-2, 2], got {presence}."))
        frequency = _or(self.frequency_penalty, 0.0)
        if not -2.0 <= frequency <= 2.0:
            raise Refused(bad_request(f"frequency_penalty must be in [-2, 2], got {frequency}."))
        repetition = _or(self.repetition_penalty, 1.0)
        if repetition != repetition or repetition in (float("inf"), float("-inf")):
            raise Refused(bad_request(f"repetition_penalty must be a finite number, got {repetition}."))
        if repetition <= 0.0:
            raise Refused(bad_request(f"repetition_penalty must be greater than zero, got {repetition}."))
        temperature = _or(self.temperature, 1.0)
        if temperature != temperature or temperature in (float("inf"), float("-inf")):
            raise Refused(
                bad_request(
                    f"temperature must be a finite number, got {temperature}.", "temperature", temperature
                )
            )
        if temperature < 0.0:
            raise Refused(
                bad_request(
                    f"temperature must be non-negative, got {temperature}.", "temperature", temperature
                )
            )
        if temperature > 2.0:
            raise Refused(
                bad_request(f"temperature must be in [0, 2], got {temperature}.", "temperature", temperature)
            )
        top_p = _or(self.top_p, 1.0)
        if not 0.0 < top_p <= 1.0:
            raise Refused(bad_request(f"top_p must be in (0, 1], got {top_p}.", "top_p", top_p))
        top_k = _or(self.top_k, 0)
        if top_k < -1:
            raise Refused(bad_request(f"top_k must be 0 (disable), or at least 1, got {top_k}."))
        min_p = _or(self.min_p, 0.0)
        if not 0.0 <= min_p <= 1.0:
            raise Refused(bad_request(f"min_p must be in [0, 1], got {min_p}."))
        if self.max_tokens is not None and self.max_tokens < 1:
            raise Refused(
                bad_request(
                    f"max_tokens must be at least 1, got {self.max_tokens}.", "max_tokens", self.max_tokens
                )
            )
        min_tokens = _or(self.min_tokens, 0)
        if min_tokens < 0:
            raise Refused(bad_request(f"min_tokens must be greater than or equal to 0, got {min_tokens}."))
        if self.max_tokens is not None and min_tokens > self.max_tokens:
            raise Refused(
                bad_request(
                    f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                    f"got {min_tokens}."
                )
            )
        if self.stream_interval is not None and self.stream_interval < 1:
            raise Refused(
                bad_request(
                    f"stream_interval must be at least 1, got {self.stream_interval}.",
                    "stream_interval",
                    self.stream_interval,
                )
            )
        for name, value in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if value is not None and value < -1:
                raise Refused(bad_request(f"{name} must be non-negative or -1, got {value}.", name, value))
        if self.stop and any(not s for s in self.stop):
            raise Refused(bad_request("stop cannot contain an empty string."))
        if self.stop and not self.detokenize:
            raise Refused(
                bad_request(
                    "stop strings are only supported when detokenize is True. "
                    "Set detokenize=True to use stop."
                )
            )
        if self.bad_words and any(not word for word in self.bad_words):
            words = list(dict.fromkeys(self.bad_words))
            raise Refused(bad_request(f"bad_words cannot contain an empty string. Got bad_words={words}"))
        if temperature < _GREEDY_EPSILON and n > 1:
            raise Refused(bad_request(f"n must be 1 when using greedy sampling, got {n}."))

    def integers(self) -> list[int]:
        """Every integer vLLM would encode for its engine (what must fit 64 bits)."""
        scalars = (self.n, self.top_k, self.seed, self.max_tokens, self.min_tokens, self.logprobs)
        more = (self.prompt_logprobs, self.stream_interval)
        ids = [*(self.stop_token_ids or []), *(self.logit_bias or {})]
        return [v for v in (*scalars, *more, *ids) if v is not None]

    def check_vocabulary(self, vocab_size: int) -> None:
        """The engine's vocabulary checks on biased ids, then stop ids, in ``SamplingParams.verify``'s
        order (without a known size only what 32 bits cannot hold is refused)."""
        for name, ids in (
            ("logit_bias", list(self.logit_bias or {})),
            ("stop_token_ids", self.stop_token_ids or []),
        ):
            bad = [t for t in ids if t < 0 or t >= (vocab_size or UINT32_MAX + 1)]
            if bad and not vocab_size:
                raise uncarried(name, f"token ids {bad} do not fit 32 bits")
            if bad:
                raise Refused(
                    bad_request(
                        f"token_id(s) {bad} in {name} contain out-of-vocab token ids. "
                        f"Vocabulary size: {vocab_size}",
                        name,
                        bad,
                    )
                )

    def refuse_uncarried(self) -> None:
        for name, why in _UNCARRIED:
            if self.raw(name) is not None:
                raise uncarried(name, why)
        if self.extra_args:
            raise uncarried("extra_args", "free-form engine arguments are not carried to the engine")
        if self.raw("watermarking"):
            raise uncarried("watermarking", "watermarking is not carried to the engine")

    def fill(self, request: sidecar_pb2.PreprocessedRequest, prompt_len: int, context: int) -> None:
        """Only the keys the caller sent are set: the engine applies its own defaults to the rest."""
        s, stop, out = request.sampling_options, request.stop_conditions, request.output_options
        if self.present("n"):
            s.n = _fits("n", self.n, 1, UINT32_MAX)
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if value is not None:
                if abs(value) > _FLOAT32_MAX:
                    # The field is a 32-bit float: the value would arrive as infinity.
                    raise uncarried(name, f"{value} does not fit the engine's 32-bit float")
                setattr(s, name, value)
        if self.top_k is not None:
            s.top_k = _fits("top_k", self.top_k, *_INT32)
        if self.seed is not None:
            s.seed = _fits("seed", self.seed, *_INT64)
        if self.include_stop_str_in_output is not None:
            s.include_stop_str_in_output = self.include_stop_str_in_output
        for token, bias in (self.logit_bias or {}).items():
            if abs(bias) > _FLOAT32_MAX:
                raise uncarried("logit_bias", f"{bias} does not fit the engine's 32-bit float")
            s.logit_bias[token] = bias
        if self.max_tokens is not None:
            stop.max_tokens = _fits("max_tokens", self.max_tokens, 1, UINT32_MAX)
        elif self.present("max_tokens") and context:
            # An explicit null means "up to the context", without the server's default cap.
            stop.max_tokens = context - prompt_len
        if self.min_tokens is not None:
            stop.min_tokens = _fits("min_tokens", self.min_tokens, 0, UINT32_MAX)
        if self.stop_token_ids:
            stop.stop_token_ids.extend(dict.fromkeys(self.stop_token_ids))
        if self.ignore_eos is not None:
            stop.ignore_eos = self.ignore_eos
        if self.logprobs is not None:
            out.logprobs = _logprob_count("logprobs", self.logprobs)
        if self.prompt_logprobs is not None:
            out.prompt_logprobs = _logprob_count("prompt_logprobs", self.prompt_logprobs)
        if self.skip_special_tokens is not None:
            out.skip_special_tokens = self.skip_special_tokens


def _logprob_count(name: str, value: int) -> int:
    if value == -1:
        # -1 asks for the whole vocabulary; the engine's own limit (20 by default) refuses it anyway.
        raise uncarried(name, "-1 (the whole vocabulary) is not carried to the engine; ask for a count")
    return _fits(name, value, 0, UINT32_MAX)


def not_an_instance(value: object, loc: str) -> ValidationIssue:
    return ValidationIssue(
        "is_instance_of",
        loc,
        "Input should be an instance of SamplingParams",
        value,
        {"class": "SamplingParams"},
    )


def _stop(value: object, loc: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return as_str_list(value, loc)
    raise Invalid(
        ValidationIssue("string_type", loc, "Input should be a valid string", value),
        ValidationIssue("list_type", loc, "Input should be a valid list", value),
    )


def _logit_bias(value: object, loc: str) -> dict[int, float]:
    raw = as_dict(value, loc)
    result: dict[int, float] = {}
    issues: list[ValidationIssue] = []
    for key, bias in raw.items():
        try:
            result[as_int(key, f"{loc}.{key}")] = as_float(bias, f"{loc}.{key}")
        except Invalid as err:
            issues.extend(err.issues)
    if issues:
        raise Invalid(*issues)
    return result


def _check_extra_args(extra: dict[str, object]) -> None:
    pending: list[object] = [extra]
    while pending:
        value = pending.pop()
        if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
            raise Refused(
                bad_request("extra_args integers must be between -2**63 and 2**64 - 1.", "extra_args")
            )
        if isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)


def _or(value: T | None, default: T) -> T:
    return default if value is None else value


def _fits(name: str, value: int | None, low: int, high: int) -> int:
    assert value is not None
    if not low <= value <= high:
        raise uncarried(name, f"{value} does not fit the engine's field ({low}..{high})")
    return value
