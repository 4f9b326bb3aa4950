"""vLLM's ``sampling_params`` object: checked and carried onto ``sidecar.v1`` (pure).

The checks are vLLM's ``SamplingParams`` ones, in its order (the first failure is the
answer, in vLLM's ``BadRequestError`` form). :meth:`SamplingParams.fill` sets only the keys
the caller sent: the proto3 ``optional`` fields of the others stay absent, so the engine
applies its own defaults, as vLLM does for a key the client did not send.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, TypeVar, cast

from sidecar_common.api import sidecar_pb2
from sidecar_frontend.formats.vllm.errors import Refused, bad_request, uncarried

__all__ = ["UINT32_MAX", "SamplingParams"]

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
    """``sampling_params`` as pydantic validated it (``model``), checked as vLLM's is.

    ``values`` holds only the keys the client sent, already of their declared types; the
    checks below are vLLM's own (``SamplingParams.__post_init__``), not pydantic's.
    """

    def __init__(self, values: Mapping[str, object]) -> None:
        self._values = values
        self._n = _typed(values, "n", int)
        self.n = 1
        self.presence_penalty = _typed(values, "presence_penalty", float)
        self.frequency_penalty = _typed(values, "frequency_penalty", float)
        self.repetition_penalty = _typed(values, "repetition_penalty", float)
        self.temperature = _typed(values, "temperature", float)
        self.top_p = _typed(values, "top_p", float)
        self.top_k = _typed(values, "top_k", int)
        self.min_p = _typed(values, "min_p", float)
        self.seed = _typed(values, "seed", int)
        stop = values.get("stop")  # a string or a list of them
        self.stop = [stop] if isinstance(stop, str) else cast("list[str] | None", stop)
        self.stop_token_ids: list[int] | None = _typed(values, "stop_token_ids", list)
        self.ignore_eos = _typed(values, "ignore_eos", bool)
        self.max_tokens = _typed(values, "max_tokens", int)
        self.min_tokens = _typed(values, "min_tokens", int)
        self.logprobs = _typed(values, "logprobs", int)
        self.prompt_logprobs = _typed(values, "prompt_logprobs", int)
        detokenize = _typed(values, "detokenize", bool)
        self.detokenize = True if detokenize is None else detokenize
        self.skip_special_tokens = _typed(values, "skip_special_tokens", bool)
        self.include_stop_str_in_output = _typed(values, "include_stop_str_in_output", bool)
        self.stream_interval = _typed(values, "stream_interval", int)
        self.logit_bias: dict[int, float] | None = _typed(values, "logit_bias", dict)
        self.extra_args: dict[str, object] | None = _typed(values, "extra_args", dict)
        self.bad_words: list[str] | None = _typed(values, "bad_words", list)
        self._verify()

    def present(self, name: str) -> bool:
        return name in self._values

    def raw(self, name: str) -> object:
        return self._values.get(name)

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
        start = self.raw("routed_experts_prompt_start")
        if start is not None and start != 0:
            # vLLM's routed experts are a server option answered as .npy bytes, whose shape
            # the workers' wires do not carry (docs/metadata.md): 0, its default, asks nothing.
            raise uncarried("routed_experts_prompt_start", "routed experts are not carried to this format")

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
        elif self.present("max_tokens") and context > prompt_len:
            # An explicit null means "up to the context", without the server's default cap. A
            # prompt that fills the context reaches here only to be refused by the engine
            # (validate.engine_input_checks: a problem left to it): its own default then stands.
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


def _typed(values: Mapping[str, object], name: str, kind: type[T]) -> T | None:
    """A validated value (pydantic made it ``kind``), or None when not sent or sent as null."""
    value = values.get(name)
    assert value is None or isinstance(value, kind), (name, value)
    return value


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
