"""vLLM's ``/inference/v1/generate`` responses from ``LLMEngineOutput``s (pure).

Unary: one ``GenerateTokensResponse`` (every key present, nulls included, in vLLM's order).
Streaming: ``GenerateTokensStreamResponse`` chunks, one choice per chunk, as vLLM frames them:
``data: <compact json>\\n\\n`` per event, a usage chunk when ``include_usage`` asked for it, and
``data: [DONE]\\n\\n`` at the end (after an error event too). While the client reads slower
than the stream comes, a choice's chunk carries every token that came meanwhile
(``base.HoldingEncoder``), as one chunk of a worker that sent them in one output would.

A failure is answered as vLLM answers the matching engine condition: a cancelled request
(an abort, or our request deadline) finishes its open choices with ``finish_reason:"abort"``
and keeps the tokens so far; a refused request is a 400; an overloaded engine a 503; a dead
or unreachable engine vLLM's 500. In a stream that already answered 200 the error is one
SSE event (``{"error": …}`` with spaces, as vLLM writes it).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Final, assert_never

from google.protobuf import struct_pb2

from sidecar_common import prompt_logprobs
from sidecar_common.api import sidecar_pb2
from sidecar_common.logprob_floor import LOGPROB_FLOOR, clamp_logprob
from sidecar_common.structs import JSON, StructError, json_from_struct
from sidecar_frontend.formats.base import HttpReply, WorkerFailure
from sidecar_frontend.formats.vllm.errors import (
    DEAD_ENGINE_MESSAGE,
    FAILURE_ANSWERS,
    OVERLOADED_MESSAGE,
    FailureAnswer,
    VllmError,
)
from sidecar_frontend.formats.vllm.plan import VllmOptions
from sidecar_frontend.formats.vllm.wire import compact_json

__all__ = ["DONE", "VllmEncoder", "engine_param", "failure_error"]

DONE: Final = b"data: [DONE]\n\n"

_FINISH: Final = {
    sidecar_pb2.LENGTH: "length",
    sidecar_pb2.STOP: "stop",
    sidecar_pb2.EOS: "stop",
    sidecar_pb2.CANCELLED: "abort",
    # vLLM has no content filter; the nearest of its reasons is an ordinary stop.
    sidecar_pb2.CONTENT_FILTER: "stop",
}


def failure_error(failure: WorkerFailure) -> VllmError | None:
    """The vLLM error a failure reads as (``FAILURE_ANSWERS``), or None when it reads as an
    abort."""
    answer = FAILURE_ANSWERS[failure.reason]
    if answer is FailureAnswer.ABORT:
        return None
    if answer is FailureAnswer.REFUSED:
        # No error goes out without words, whatever the worker sent.
        message = failure.message or "the worker refused the request without a reason"
        if failure.not_found:
            # vLLM's VLLMNotFoundError (the engine lacks the LoRA adapter or model named): 404
            # NotFoundError with param null, the engine's words as they are.
            return VllmError(message, "NotFoundError", HTTPStatus.NOT_FOUND)
        param = engine_param(failure.message) if failure.from_engine else _vllm_param(failure.message)
        return VllmError(message, "BadRequestError", HTTPStatus.BAD_REQUEST, param)
    if answer is FailureAnswer.BUSY:
        # vLLM's admission refusals (a full request queue, a prefill backlog) each say their
        # own sentence: the engine's, when it came with one.
        message = failure.message if failure.from_engine and failure.message else OVERLOADED_MESSAGE
        return VllmError(message, HTTPStatus.SERVICE_UNAVAILABLE.phrase, HTTPStatus.SERVICE_UNAVAILABLE)
    if answer is FailureAnswer.ENGINE_FAILED:
        # A dead or unreachable engine, a malformed answer, anything else: vLLM's answer to an
        # engine failure. (vLLM itself sends an empty message for an EngineGenerateError; an
        # error without words helps no client, so every 500 says this sentence.)
        return VllmError(DEAD_ENGINE_MESSAGE, "InternalServerError", HTTPStatus.INTERNAL_SERVER_ERROR)
    assert_never(answer)


# The sidecars' refusals start with the sidecar.v1 field ("stop_conditions.max_tokens: ...");
# a vLLM client knows the field by its vLLM name.
_VLLM_PARAM: Final = {
    **{
        f"sampling_options.{name}": name
        for name in (
            "n",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "seed",
            "logit_bias",
            "include_stop_str_in_output",
        )
    },
    **{
        f"stop_conditions.{name}": name
        for name in ("max_tokens", "min_tokens", "stop_token_ids", "ignore_eos")
    },
    **{f"output_options.{name}": name for name in ("logprobs", "prompt_logprobs", "skip_special_tokens")},
    "token_ids": "token_ids",
    "routing.cache_namespace": "cache_salt",
    "routing.priority": "priority",
    "extra_args.kv_transfer_params": "kv_transfer_params",
    "prefill_result.disaggregated_params": "kv_transfer_params",
}


# vLLM's validation errors end their text with `` (parameter=<name>, value=<value>)`` (either
# part may be missing); the value may hold anything, brackets and commas included.
_ENGINE_PARAM: Final = re.compile(r" \(parameter=([^,()\s]+)(?:, value=.*)?\)\Z", re.DOTALL)


def engine_param(message: str) -> str | None:
    """The parameter an engine's refusal names by vLLM's convention, else None."""
    match = _ENGINE_PARAM.search(message)
    return match.group(1) if match else None


def _vllm_param(message: str) -> str | None:
    field_name = message.split(":", 1)[0].split("[", 1)[0]
    return _VLLM_PARAM.get(field_name)


@dataclass(frozen=True)
class _Held:
    """A streamed chunk kept back because it may be its choice's last (see ``ChoiceEnd``)."""

    token_ids: list[int]
    logprobs: str | None  # its logprob entries as JSON text; None: not asked for
    generated: int  # the choice's token count with this chunk


@dataclass
class _Choice:
    index: int
    generated: int = 0  # tokens so far
    # Kept for the unary reply only: a stream sends them on and keeps just the count.
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[str] = field(default_factory=list)  # each output's entries as JSON text
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # The terminal's weight_versions as JSON (``null``: the worker's wire does not say).
    weight_versions: bytes = b"null"


def _weight_versions(output: sidecar_pb2.LLMEngineOutput) -> bytes:
    """vLLM's ``weight_versions`` (``[{"version", "start", "end"}]``) of a terminal, or null."""
    if not output.weight_versions:
        return b"null"
    return compact_json(
        [{"version": s.version, "start": s.start, "end": s.end} for s in output.weight_versions]
    )


class VllmEncoder:
    """One generate call's response state (see :mod:`sidecar_frontend.formats.base`)."""

    def __init__(self, options: VllmOptions, started_at: float) -> None:
        self._o = options
        del started_at  # the handler's monotonic clock; `created` is wall time, taken at parse
        self._choices = {i: _Choice(i) for i in range(options.n)}
        self._first_chunk = True
        self._held: dict[int, _Held] = {}
        self._may_end = options.end.may_end
        self._error: VllmError | None = None
        self._aborted = False
        self._prompt_logprobs: JSON = None
        self._kv_transfer_params: JSON = None
        self._chunk_head = b'data: {"request_id":' + compact_json(options.request_id) + b',"usage":'

    @property
    def aborted(self) -> bool:
        return self._aborted

    def on_output(self, index: int, output: sidecar_pb2.LLMEngineOutput, now: float) -> bytes:
        del index, now  # one sub-request; choices are told apart by output.index
        return self._take(output, hold=False)

    def hold(self, index: int, output: sidecar_pb2.LLMEngineOutput, now: float) -> bytes:
        """The output's tokens join its choice's held chunk (a finish is written at once,
        carrying them): ``base.HoldingEncoder``."""
        del index, now
        return self._take(output, hold=True)

    def flush(self, now: float) -> bytes:
        """Every held chunk that cannot be its choice's last, as one chunk per choice; one
        that may be the last stays held for its terminal, as on the ordinary path."""
        del now
        events = []
        for index, held in list(self._held.items()):
            if not self._may_end(held.generated, held.token_ids[-1]):
                del self._held[index]
                events.append(self._write_held(self._choices[index], held))
        return b"".join(events)

    def _take(self, output: sidecar_pb2.LLMEngineOutput, *, hold: bool) -> bytes:
        if self._aborted:
            return b""
        choice = self._choice(output.index)
        if choice.finish_reason is not None:
            return b""
        ids = list(output.token_ids)
        choice.generated += len(ids)
        if not self._o.stream:
            choice.token_ids.extend(ids)
            if self._o.logprobs and ids:
                choice.logprobs.append(_logprob_entries(output, ids))
        finish: str | None = None
        stop_reason: int | str | None = None
        if output.finish_reason != sidecar_pb2.UNSPECIFIED:
            finish = _FINISH.get(output.finish_reason, "stop")
            kind = output.WhichOneof("stop_reason")
            if finish == "stop" and kind == "stop_token_id":
                stop_reason = output.stop_token_id
            elif finish == "stop" and kind == "stop_string":
                stop_reason = output.stop_string
            choice.finish_reason, choice.stop_reason = finish, stop_reason
            choice.weight_versions = _weight_versions(output)
            self._observe_terminal(output)
        if not self._o.stream:
            return b""
        if not (ids or finish):
            return b""  # says nothing: a held chunk stays held
        logprobs = _logprob_entries(output, ids) if self._o.logprobs else None
        held = self._held.pop(choice.index, None) if self._held else None
        if finish is not None:
            if held is not None:
                # The held chunk was the last one: it carries the finish, with anything new.
                ids = held.token_ids + ids
                if logprobs is not None and held.logprobs is not None:
                    logprobs = _join(held.logprobs, logprobs)
            return self._chunk(choice, ids, logprobs, finish, stop_reason, choice.generated)
        if hold:
            # The client is behind: the tokens wait in the choice's held chunk (flush).
            if held is not None:
                ids = held.token_ids + ids
                if logprobs is not None and held.logprobs is not None:
                    logprobs = _join(held.logprobs, logprobs)
            self._held[choice.index] = _Held(ids, logprobs, choice.generated)
            return b""
        written = b"" if held is None else self._write_held(choice, held)
        if self._may_end(choice.generated, ids[-1]):
            # It may be the last chunk: wait for the next output to say so (the terminal comes
            # right after). Any other chunk is written at once.
            self._held[choice.index] = _Held(ids, logprobs, choice.generated)
            return written
        return written + self._chunk(choice, ids, logprobs, None, None, choice.generated)

    def on_failure(self, index: int, failure: WorkerFailure, now: float) -> bytes:
        del index, now
        if self._aborted:
            return b""
        self._aborted = True
        # Tokens that came before the failure were generated: they are written first.
        events = [self._flush_held()]
        error = failure_error(failure)
        if error is not None:
            self._error = error
            return events[0] + error.sse_event() if self._o.stream else b""
        for choice in self._choices.values():
            if choice.finish_reason is None:
                choice.finish_reason = "abort"
                if self._o.stream:
                    logprobs = "" if self._o.logprobs else None
                    events.append(self._chunk(choice, [], logprobs, "abort", None, choice.generated))
        return b"".join(events)

    def close(self) -> bytes:
        held = self._flush_held()
        if self._o.include_usage and self._error is None:
            usage = self._usage(self._completion_tokens())
            chunk = {"request_id": self._o.request_id, "usage": usage, "output_mode": "tokens", "choices": []}
            return held + _event(chunk) + DONE
        return held + DONE

    def reply(self) -> HttpReply:
        if self._error is not None:
            return self._error.reply()
        choices = b",".join(self._unary_choice(self._choices[i]) for i in sorted(self._choices))
        usage = self._usage(self._completion_tokens())
        usage["prompt_tokens_details"] = None
        usage["completion_tokens_details"] = None
        body = {
            "request_id": self._o.request_id,
            "model": self._o.model,
            "created": self._o.created,
            "usage": usage,
            "prompt_logprobs": self._prompt_logprobs,
            "prompt_token_id_logprobs": None,
            "prompt_token_ids": _list_or_none(self._o.prompt_token_ids),
            "mm_placeholders": None,
            "metrics": None,
            "kv_transfer_params": self._kv_transfer_params,
            "ec_transfer_params": None,
            "output_mode": "tokens",
        }
        # "choices" is the last key; the choices are written as a stream writes them.
        return HttpReply(HTTPStatus.OK, compact_json(body)[:-1] + b',"choices":[' + choices + b"]}")

    # ----------------------------------------------------------------------------- helpers

    def _choice(self, index: int) -> _Choice:
        choice = self._choices.get(index)
        if choice is None:
            choice = self._choices[index] = _Choice(index)
        return choice

    def _observe_terminal(self, output: sidecar_pb2.LLMEngineOutput) -> None:
        if self._kv_transfer_params is None and output.HasField("disaggregated_params"):
            self._kv_transfer_params = _struct_json(output.disaggregated_params)
        if self._prompt_logprobs is None and self._o.prompt_logprobs:
            positions = prompt_logprobs.of_output(output, self._o.prompt)
            if positions is not None:
                self._prompt_logprobs = _prompt_logprobs(positions, self._o.prompt)

    def _completion_tokens(self) -> int:
        return sum(c.generated for c in self._choices.values())

    def _usage(self, completion: int) -> dict[str, JSON]:
        prompt = self._o.prompt_tokens
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}

    def _write_held(self, choice: _Choice, held: _Held) -> bytes:
        return self._chunk(choice, held.token_ids, held.logprobs, None, None, held.generated)

    def _flush_held(self) -> bytes:
        """Every held chunk, as an ordinary chunk (the request ends without their terminal)."""
        held, self._held = self._held, {}
        return b"".join(self._write_held(self._choices[i], h) for i, h in held.items())

    def _chunk(
        self,
        choice: _Choice,
        ids: list[int],
        logprobs: str | None,
        finish: str | None,
        stop_reason: int | str | None,
        generated: int,
    ) -> bytes:
        """One token chunk, written out directly: it is the per-token hot path.

        ``logprobs`` are the chunk's entries as JSON text (None: not asked for); ``generated``
        is the choice's token count with this chunk. The bytes are exactly the compact JSON of
        vLLM's chunk (keys in its order); the tests re-serialise every chunk to check it.
        """
        usage = b"null"
        if self._o.continuous_usage:
            # vLLM counts only this chunk's choice so far, not the whole request.
            usage = _continuous_usage(self._o.prompt_tokens, generated)
        prompt_ids = b""
        if self._first_chunk and self._o.prompt_token_ids is not None:
            prompt_ids = b',"prompt_token_ids":[' + _ints(self._o.prompt_token_ids) + b"]"
        self._first_chunk = False
        return b"".join(
            (
                self._chunk_head,
                usage,
                prompt_ids,
                b',"output_mode":"tokens","choices":[',
                _choice_json(
                    choice.index,
                    finish,
                    stop_reason,
                    ids,
                    logprobs,
                    choice.weight_versions if finish is not None else b"null",
                ),
                b"]}\n\n",
            )
        )

    def _unary_choice(self, choice: _Choice) -> bytes:
        # vLLM's default finish reason when a choice ends without one is "stop".
        logprobs = ",".join(choice.logprobs) if self._o.logprobs else None
        return _choice_json(
            choice.index,
            choice.finish_reason or "stop",
            choice.stop_reason,
            choice.token_ids,
            logprobs,
            choice.weight_versions,
        )


def _choice_json(
    index: int,
    finish: str | None,
    stop_reason: int | str | None,
    ids: Sequence[int],
    logprobs: str | None,
    weight_versions: bytes = b"null",
) -> bytes:
    """One choice as vLLM writes it, in a stream chunk or a unary reply alike (keys in vLLM's
    order); ``logprobs`` are its entries as JSON text, None when not asked for;
    ``weight_versions`` the final chunk's spans as JSON (vLLM sets them there only)."""
    return b"".join(
        (
            b'{"index":',
            str(index).encode(),
            b',"finish_reason":',
            b"null" if finish is None else compact_json(finish),
            b',"stop_reason":',
            b"null" if stop_reason is None else compact_json(stop_reason),
            b',"token_ids":[',
            _ints(ids),
            b'],"routed_experts":null,"sampling_mask":null,"weight_versions":',
            weight_versions,
            b',"logprobs":',
            b"null" if logprobs is None else b'{"content":[' + logprobs.encode() + b"]}",
            b"}",
        )
    )


def _join(first: str, then: str) -> str:
    return f"{first},{then}" if first and then else first or then


def _logprob_entries(output: sidecar_pb2.LLMEngineOutput, ids: Sequence[int]) -> str:
    """vLLM's per-token entries (the sampled token, then every candidate the engine returned)
    as compact JSON, comma-separated, written out directly: a stream's per-token path, and the
    pieces of a unary reply."""
    parts: list[str] = []
    for i, token in enumerate(ids):
        tops = output.top_logprobs[i].entries if i < len(output.top_logprobs) else ()
        if i < len(output.log_probs):
            value = clamp_logprob(output.log_probs[i])
        elif tops and tops[0].token_id == token:
            value = clamp_logprob(tops[0].logprob)
        else:
            # vLLM's sentinel for a position the engine gave no logprob for.
            parts.append(f'{{"token_id":{token},"logprob":{LOGPROB_FLOOR!r},"rank":null,"top_logprobs":[]}}')
            continue
        rank = next((_rank(t) for t in tops if t.token_id == token), None)
        candidates = ",".join(
            f'{{"token_id":{t.token_id},"logprob":{clamp_logprob(t.logprob)!r},"rank":{_nullable_int(_rank(t))}}}'
            for t in tops
        )
        parts.append(
            f'{{"token_id":{token},"logprob":{value!r},"rank":{_nullable_int(rank)},"top_logprobs":[{candidates}]}}'
        )
    return ",".join(parts)


def _nullable_int(value: int | None) -> str:
    return "null" if value is None else str(value)


def _rank(entry: sidecar_pb2.TopLogprob) -> int | None:
    # vLLM reports rank 0 (a NaN logprob) as null; so is a rank the engine did not send.
    return entry.rank if entry.HasField("rank") and entry.rank else None


def _prompt_logprobs(positions: Sequence[sidecar_pb2.TopLogprobs], prompt: Sequence[int]) -> JSON:
    """The prompt logprobs as vLLM shapes them.

    One entry per prompt position: null, or ``{token id as text: {logprob, rank,
    decoded_token}}`` with the prompt's own token first, then the candidates best first (a
    0.1 vLLM sidecar's Struct keeps no order, so the order is rebuilt here).
    """
    result: list[JSON] = []
    for index, position in enumerate(positions):
        if not position.entries:
            result.append(None)
            continue
        own = prompt[index] if index < len(prompt) else None
        ordered = sorted(position.entries, key=lambda e: (e.token_id != own, -clamp_logprob(e.logprob)))
        entry: dict[str, JSON] = {}
        for candidate in ordered:
            entry.setdefault(
                str(candidate.token_id),
                {
                    "logprob": clamp_logprob(candidate.logprob),
                    "rank": _given_rank(candidate),
                    "decoded_token": None,
                },
            )
        result.append(entry)
    return result


def _given_rank(entry: sidecar_pb2.TopLogprob) -> int | None:
    return entry.rank if entry.HasField("rank") else None


def _struct_json(struct: struct_pb2.Struct) -> JSON:
    try:
        return json_from_struct(struct)
    except StructError:
        return None


def _ints(ids: Sequence[int]) -> bytes:
    return ",".join(map(str, ids)).encode()


def _continuous_usage(prompt: int, completion: int) -> bytes:
    return (
        b'{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d,'
        b'"prompt_tokens_details":null,"completion_tokens_details":null}'
        % (prompt, prompt + completion, completion)
    )


def _list_or_none(ids: tuple[int, ...] | None) -> JSON:
    return None if ids is None else list(ids)


def _event(obj: object) -> bytes:
    return b"data: " + compact_json(obj) + b"\n\n"
