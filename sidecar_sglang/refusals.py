"""How a failed SGLang gRPC ``Generate`` reads: a refusal of the prompt, or an engine fault (pure).

SGLang's Rust gRPC server ends a stream with INTERNAL and the text of every error its Python
bridge reports, a refusal of the request or a failure alike (docs/sglang.md, "Refusals only
SGLang makes, over gRPC"). Most refusals the sidecar makes first, from what discovery tells.
One it cannot unless the operator says (``--vocab-size``): a prompt id outside the vocabulary.
SGLang learns its vocabulary size from the model's own configuration
(``ModelConfig.vocab_size``, the Hugging Face config's ``vocab_size``) and reports it on none of
its info calls (``/model_info``, ``/server_info``, ``/v1/models``, and over gRPC
``GetModelInfo``, ``GetServerInfo``, ``ListModels``). Of SGLang 0.5.23's servers only the Rust
HTTP server (``SGLANG_RUST_SERVER=1``) checks the ids, refusing with a 400 and the sentence
below; an engine that gives the same refusal over gRPC arrives as INTERNAL with those words. So
that sentence, naming an id the request's prompt holds outside the range it states, is read as
the client's mistake (INVALID_ARGUMENT in SGLang's words, as its HTTP server answers it); any
other INTERNAL stays an engine fault (UNKNOWN), as before. With ``--vocab-size`` the sidecar
refuses such a prompt itself, before the engine, in the same words (``convert_request``).

One answer (a non-streaming request, ``stream`` false) changes how SGLang's aborts arrive. In
a stream, an abort SGLang decides on its own is a terminal whose ``status_code`` keeps its
class (:func:`abort_reason`: 4xx a refusal, 503 busy). For a non-streaming request its
tokenizer manager raises instead: a ValueError for 400 (its bare message: over gRPC an
INTERNAL nothing tells from a failure, so UNKNOWN), a FastAPI ``HTTPException`` for any other
status, whose text the bridge sends as INTERNAL: ``<status>: <message>``. That whole text, on
a non-streaming call, reads as the abort it is: 503 OVERLOADED, another 4xx INVALID_ARGUMENT,
in SGLang's words (the message).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Final

import grpc

from sidecar_common.errors import FailureReason, SidecarError, engine_words, from_engine_status

__all__ = ["OUT_OF_VOCABULARY", "abort_reason", "generate_error", "out_of_vocabulary"]

_CALL: Final = "Generate"
# SGLang aborts with 503 what its capacity or its time limits refuse (a full waiting queue,
# the waiting or running timeout, a request pre-empted by a higher priority, a retraction
# without a KV backup): the engine is busy, not the request wrong.
_ABORT_BUSY: Final = 503
# The text of the HTTPException SGLang's tokenizer manager raises for an abort of a
# non-streaming request (Starlette's ``str``: status, colon, detail).
_RAISED_ABORT: Final = re.compile(r"([45][0-9][0-9]): (.+)", re.DOTALL)

# SGLang 0.5.23's refusal of a prompt id outside the vocabulary (its Rust HTTP server,
# sglang-server's request checks; the same sentence as the tokenizer manager's for
# token_ids_logprob), whole: the id it names and the vocabulary size.
OUT_OF_VOCABULARY: Final = re.compile(
    r"input_ids contains out-of-vocabulary token id (-?[0-9]+); valid range is \[0, ([0-9]+)\)\."
)


def out_of_vocabulary(token_id: int, vocab_size: int) -> str:
    """SGLang's sentence for a prompt holding ``token_id`` outside ``[0, vocab_size)``."""
    return f"input_ids contains out-of-vocabulary token id {token_id}; valid range is [0, {vocab_size})."


def abort_reason(status: int | None) -> FailureReason:
    """The typed error of an abort SGLang decided on its own, by its ``status_code``: the
    status class a client of SGLang sees (400 stays a refusal, 503 stays "busy")."""
    if status is not None and 400 <= status < 500:
        return FailureReason.INVALID_ARGUMENT
    if status == _ABORT_BUSY:
        return FailureReason.OVERLOADED
    return FailureReason.UNKNOWN


def generate_error(
    code: grpc.StatusCode, details: str | None, prompt: Sequence[int], *, unary: bool = False
) -> SidecarError:
    """The typed error of a failed ``Generate`` of ``prompt`` (``unary``: asked for one answer):
    SGLang's refusal of one of its ids as outside the vocabulary is INVALID_ARGUMENT in SGLang's
    words; on a non-streaming call, an abort SGLang raised with its status (module docstring)
    reads as that status; anything else as every engine status reads."""
    if code is grpc.StatusCode.INTERNAL and details:
        if _refuses_prompt_id(details, prompt):
            return engine_words(FailureReason.INVALID_ARGUMENT, details, _CALL, code.name)
        raised = _RAISED_ABORT.fullmatch(details) if unary else None
        if raised is not None:
            reason = abort_reason(int(raised.group(1)))
            if reason is not FailureReason.UNKNOWN:
                return engine_words(reason, raised.group(2), _CALL, code.name)
    return from_engine_status(_CALL, code, details)


def _refuses_prompt_id(details: str, prompt: Sequence[int]) -> bool:
    # The whole text must be the sentence, and what it names must be true of this request: an
    # id of its prompt, outside the range stated. A failure that merely quotes the words is not
    # a refusal.
    match = OUT_OF_VOCABULARY.fullmatch(details)
    if match is None:
        return False
    token_id, vocab_size = int(match.group(1)), int(match.group(2))
    return not 0 <= token_id < vocab_size and token_id in prompt
