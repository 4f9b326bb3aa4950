"""The one table of sampling limits, and its check (pure: no I/O, no clock, no globals).

Both sidecars call :func:`check_sampling_limits` while converting a request, before any engine
call, so a value the engine would refuse is refused here the same way for every engine:
INVALID_ARGUMENT, the message starting with the field's path in ``PreprocessedRequest`` (one
exception: vLLM's refusal of max_tokens 0 is in vLLM's own words, see docs/limits.md).
Where the engines accept different ranges the table has one column per engine; the code and
the field name of the refusal are the same for both. The ranges are the engines' own
sampling-parameter checks (see docs/limits.md).

Integers that arrive as JSON (engine discovery, the prefill handoff) follow one rule too,
:func:`exact_integer`. The size bound of a gRPC message has a module of its own,
:mod:`sidecar_common.message_size` (standard library only, for the command lines).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import NOT_SENT, FailureReason, engine_words, invalid_argument

__all__ = [
    "MAX_TOKENS_MINIMUM",
    "SAMPLING_LIMITS",
    "SGLANG_GREEDY_BELOW",
    "TOP_K_ALL",
    "TOP_K_MINIMUM",
    "EngineKind",
    "FloatLimit",
    "Span",
    "check_media",
    "check_sampling_limits",
    "exact_integer",
    "vllm_max_tokens_refusal",
]

EngineKind = Literal["vllm", "sglang"]


@dataclass(frozen=True)
class Span:
    """An interval of accepted values; NaN and infinities are never inside one."""

    low: float
    high: float
    low_closed: bool = True
    high_closed: bool = True

    def __contains__(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        above = value >= self.low if self.low_closed else value > self.low
        below = value <= self.high if self.high_closed else value < self.high
        return above and below

    def __str__(self) -> str:
        low = f"{'[' if self.low_closed else '('}{self.low:g}"
        if math.isinf(self.high):
            return f"{low}, +inf)"
        return f"{low}, {self.high:g}{']' if self.high_closed else ')'}"


@dataclass(frozen=True)
class FloatLimit:
    """One optional float of ``SamplingOptions`` and the span each engine accepts."""

    name: str
    vllm: Span
    sglang: Span

    @property
    def field(self) -> str:
        return f"sampling_options.{self.name}"

    def span(self, engine: EngineKind) -> Span:
        return self.vllm if engine == "vllm" else self.sglang


_ANY_FINITE: Final = math.inf
# vLLM SamplingParams._verify_args / SGLang SamplingParams.verify, value for value.
SAMPLING_LIMITS: Final[tuple[FloatLimit, ...]] = (
    FloatLimit("temperature", vllm=Span(0.0, 2.0), sglang=Span(0.0, _ANY_FINITE, high_closed=False)),
    FloatLimit("top_p", vllm=Span(0.0, 1.0, low_closed=False), sglang=Span(0.0, 1.0, low_closed=False)),
    FloatLimit("min_p", vllm=Span(0.0, 1.0), sglang=Span(0.0, 1.0)),
    FloatLimit("frequency_penalty", vllm=Span(-2.0, 2.0), sglang=Span(-2.0, 2.0)),
    FloatLimit("presence_penalty", vllm=Span(-2.0, 2.0), sglang=Span(-2.0, 2.0)),
    FloatLimit(
        "repetition_penalty",
        vllm=Span(0.0, _ANY_FINITE, low_closed=False, high_closed=False),
        sglang=Span(0.0, 2.0, low_closed=False),
    ),
)
# The smallest top_k each engine takes besides -1 ("all"). vLLM also reads 0 as "all"; SGLang
# refuses 0, except when it samples greedily (see SGLANG_GREEDY_BELOW).
TOP_K_ALL: Final = -1
TOP_K_MINIMUM: Final[dict[EngineKind, int]] = {"vllm": 0, "sglang": 1}
# SGLang turns a temperature in [0, this) into greedy sampling (top_k 1) before it checks
# top_k, so any top_k passes then.
SGLANG_GREEDY_BELOW: Final = 1e-6
# The fewest new tokens each engine serves. SGLang runs a request of 0 new tokens (prefill
# only: how clients score a prompt, with its input logprobs); vLLM refuses anything below 1.
MAX_TOKENS_MINIMUM: Final[dict[EngineKind, int]] = {"vllm": 1, "sglang": 0}


def check_sampling_limits(request: sidecar_pb2.PreprocessedRequest, engine: EngineKind) -> None:
    """Raise INVALID_ARGUMENT naming the first field (in table order) the engine would refuse."""
    s = request.sampling_options
    for limit in SAMPLING_LIMITS:
        if not s.HasField(limit.name):  # type: ignore[arg-type]
            continue
        value: float = getattr(s, limit.name)
        span = limit.span(engine)
        if value not in span:
            if not math.isfinite(value):
                raise invalid_argument(limit.field, f"must be a finite number (got {value})")
            raise invalid_argument(limit.field, f"must be in {span} for {engine} (got {value:g})")
    if s.HasField("top_k"):
        _check_top_k(s, engine)
    _check_token_counts(request.stop_conditions, engine)


def _check_top_k(s: sidecar_pb2.SamplingOptions, engine: EngineKind) -> None:
    top_k = s.top_k
    minimum = TOP_K_MINIMUM[engine]
    if top_k == TOP_K_ALL or top_k >= minimum:
        return
    greedy = engine == "sglang" and s.HasField("temperature") and 0.0 <= s.temperature < SGLANG_GREEDY_BELOW
    if greedy:
        return
    raise invalid_argument(
        "sampling_options.top_k", f"must be -1 (all) or at least {minimum} for {engine} (got {top_k})"
    )


def vllm_max_tokens_refusal(max_tokens: int) -> str:
    """vLLM's own sentence for a max_tokens below its minimum (``SamplingParams._verify_args``,
    a validation error naming the parameter and the value), so a client hears the engine."""
    return (
        f"max_tokens must be at least {MAX_TOKENS_MINIMUM['vllm']}, got {max_tokens}. "
        f"(parameter=max_tokens, value={max_tokens})"
    )


def _check_token_counts(stop: sidecar_pb2.StopConditions, engine: EngineKind) -> None:
    has_max = stop.HasField("max_tokens")
    if has_max and stop.max_tokens < MAX_TOKENS_MINIMUM[engine]:
        # Only vLLM has a minimum above 0: the refusal is vLLM's, in its words (not sent to it).
        raise engine_words(
            FailureReason.INVALID_ARGUMENT, vllm_max_tokens_refusal(stop.max_tokens), "Generate", NOT_SENT
        )
    if has_max and stop.HasField("min_tokens") and stop.min_tokens > stop.max_tokens:
        raise invalid_argument(
            "stop_conditions.min_tokens", f"{stop.min_tokens} is more than max_tokens ({stop.max_tokens})"
        )


_MEDIA_KINDS: Final = frozenset(
    {sidecar_pb2.MultimodalItem.IMAGE, sidecar_pb2.MultimodalItem.VIDEO, sidecar_pb2.MultimodalItem.AUDIO}
)


def check_media(items: Sequence[sidecar_pb2.MultimodalItem]) -> None:
    """Every media item names its kind and has a URL; whether the engine's wire can carry
    that kind is the sidecar's own check after this one."""
    for i, item in enumerate(items):
        if item.kind not in _MEDIA_KINDS:
            raise invalid_argument(
                f"multi_modal_data[{i}].kind", f"must be IMAGE, VIDEO or AUDIO (got {item.kind})"
            )
        if not item.url:
            raise invalid_argument(f"multi_modal_data[{i}].url", "empty")


_INTEGER_TEXT: Final = re.compile(r"[+-]?[0-9]{1,20}")


def exact_integer(value: object) -> int | None:
    """The one rule for an integer carried as JSON: a JSON integer, a finite number without a
    fraction (Struct carries every number as a double), or the decimal text of an integer.
    Anything else is None: booleans, fractions, non-finite numbers, and text that is not an
    integer literal (``"1.0"``, ``"1e3"``, ``"0x10"``)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if math.isfinite(value) and value.is_integer() else None
    if isinstance(value, str):
        text = value.strip()
        return int(text) if _INTEGER_TEXT.fullmatch(text) else None
    return None
