"""SGLang's sampling parameters on its two native wires (pure data): the one list of their names.

SGLang 0.5.23's ``POST /generate`` takes ``sampling_params`` as a strict object: a key outside
:data:`SAMPLING_FIELDS` is refused, and the refusal lists them all in this order. Its gRPC
``SamplingParams`` message carries a subset, :data:`GRPC_FIELDS`, under the same names except
the seed (``sampling_seed`` on HTTP, ``seed`` on gRPC: :func:`grpc_name`).

Two programs speak this shape: the frontend's SGLang format reads it from clients (and refuses
an unknown key in SGLang's words), and the SGLang sidecar writes it to its engine over either
wire. Both take the names from here. It is a wire's shape, like the prompt-logprob and
bootstrap-handoff codecs beside it, so it lives in the kernel; what each program does with a
key (the frontend's type checks, the sidecar's conversion) stays in that program.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

__all__ = [
    "GRPC_FIELDS",
    "LOGIT_BIAS",
    "SAMPLING_FIELDS",
    "SEED",
    "grpc_name",
]

SEED: Final = "sampling_seed"
LOGIT_BIAS: Final = "logit_bias"

# The HTTP schema's keys, in SGLang's order (the order its unknown-field refusal lists them).
SAMPLING_FIELDS: Final = (
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
    LOGIT_BIAS,
    SEED,
    "custom_params",
    "beam_width",
    "watermark",
    "choice",
)

# The keys SGLang's gRPC SamplingParams carries too (protos/sglang/runtime/v1/sglang.proto),
# by their HTTP names, in the message's field order.
GRPC_FIELDS: Final = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "max_new_tokens",
    "min_new_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "n",
    "json_schema",
    "regex",
    SEED,
)

_GRPC_NAMES: Final[Mapping[str, str]] = {SEED: "seed"}


def grpc_name(field: str) -> str:
    """The gRPC ``SamplingParams`` field of the HTTP key ``field`` (one of :data:`GRPC_FIELDS`)."""
    return _GRPC_NAMES.get(field, field)
